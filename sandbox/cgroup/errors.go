package cgroup

import (
	"fmt"

	"github.com/deltagym/deltagym/internal/errdefs"
)

var (
	// ErrInvalidConfig is returned by Config.Validate for a bad configuration.
	ErrInvalidConfig = fmt.Errorf("invalid cgroup config: %w", errdefs.ErrInvalidArgument)
	// ErrInvalidName is returned for a group name that is not a single,
	// plain path segment.
	ErrInvalidName = fmt.Errorf("invalid cgroup name: %w", errdefs.ErrInvalidArgument)
	// ErrInvalidLimits is returned for negative or non-finite limits.
	ErrInvalidLimits = fmt.Errorf("invalid cgroup limits: %w", errdefs.ErrInvalidArgument)
	// ErrNoCgroups is returned when the host has no usable cgroup hierarchy.
	ErrNoCgroups = fmt.Errorf("no usable cgroup hierarchy: %w", errdefs.ErrUnavailable)
	// ErrControllerUnavailable is returned when a limit needs a controller
	// that is in no hierarchy of this host.
	ErrControllerUnavailable = fmt.Errorf("cgroup controller unavailable: %w", errdefs.ErrFailedPrecondition)
	// ErrExist is returned by Create for a name that is already in use.
	ErrExist = fmt.Errorf("cgroup already exists: %w", errdefs.ErrAlreadyExists)
	// ErrNotExist is returned for a group that does not exist (any more).
	ErrNotExist = fmt.Errorf("cgroup does not exist: %w", errdefs.ErrNotFound)
	// ErrTimeout is returned when a freeze, thaw or kill did not complete
	// within Config.WaitTimeout.
	ErrTimeout = fmt.Errorf("cgroup state change timed out: %w", errdefs.ErrUnavailable)
	// ErrSubGroup is returned for operations that only a top-level group
	// (one made by Manager.Create) supports, such as SetLimits.
	ErrSubGroup = fmt.Errorf("operation not supported on a sub-group: %w", errdefs.ErrFailedPrecondition)
	// ErrNoV2 is returned by Dir on hosts where no cgroup2 group is used.
	ErrNoV2 = fmt.Errorf("no cgroup v2 group: %w", errdefs.ErrFailedPrecondition)
)
