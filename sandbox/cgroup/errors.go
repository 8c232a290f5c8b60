package cgroup

import "errors"

var (
	// ErrInvalidConfig is returned by Config.Validate for a bad configuration.
	ErrInvalidConfig = errors.New("invalid cgroup config")
	// ErrInvalidName is returned for a group name that is not a single,
	// plain path segment.
	ErrInvalidName = errors.New("invalid cgroup name")
	// ErrInvalidLimits is returned for negative or non-finite limits.
	ErrInvalidLimits = errors.New("invalid cgroup limits")
	// ErrNoCgroups is returned when the host has no usable cgroup hierarchy.
	ErrNoCgroups = errors.New("no usable cgroup hierarchy")
	// ErrControllerUnavailable is returned when a limit needs a controller
	// that is in no hierarchy of this host.
	ErrControllerUnavailable = errors.New("cgroup controller unavailable")
	// ErrExist is returned by Create for a name that is already in use.
	ErrExist = errors.New("cgroup already exists")
	// ErrNotExist is returned for a group that does not exist (any more).
	ErrNotExist = errors.New("cgroup does not exist")
	// ErrTimeout is returned when a freeze, thaw or kill did not complete
	// within Config.WaitTimeout.
	ErrTimeout = errors.New("cgroup state change timed out")
	// ErrSubGroup is returned for operations that only a top-level group
	// (one made by Manager.Create) supports, such as SetLimits.
	ErrSubGroup = errors.New("operation not supported on a sub-group")
	// ErrNoV2 is returned by Dir on hosts where no cgroup2 group is used.
	ErrNoV2 = errors.New("no cgroup v2 group")
)
