package criu

import (
	"fmt"

	"github.com/deltagym/deltagym/internal/errdefs"
)

var (
	// ErrNotInstalled means no CRIU wrapper was given, or the one given is not an executable
	// file (`make criu` installs it).
	ErrNotInstalled = fmt.Errorf("criu is not installed: %w", errdefs.ErrUnavailable)
	// ErrInvalidConfig means a Config or an options struct failed validation.
	ErrInvalidConfig = fmt.Errorf("invalid criu config: %w", errdefs.ErrInvalidArgument)
	// ErrClosed means the Service was used after Close.
	ErrClosed = fmt.Errorf("criu service is closed: %w", errdefs.ErrUnavailable)
	// ErrRequest means CRIU answered a request with a failure; its log holds the reason.
	ErrRequest = fmt.Errorf("criu request failed: %w", errdefs.ErrInternal)
)
