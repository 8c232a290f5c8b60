package egress

import (
	"fmt"

	"github.com/deltagym/deltagym/internal/errdefs"
)

// Sentinel errors of the package, each wrapping its class of internal/errdefs.
var (
	// ErrBadEntry means an allow-list entry is not host:port; the message says why.
	ErrBadEntry = fmt.Errorf("invalid egress entry: %w", errdefs.ErrInvalidArgument)
	// ErrBadLimit means an env's egress limit is negative or above the server's.
	ErrBadLimit = fmt.Errorf("invalid egress limit: %w", errdefs.ErrInvalidArgument)
	// ErrCapped means a sandbox's egress limits refuse a connection; the message names the
	// limit.
	ErrCapped = fmt.Errorf("egress cap: %w", errdefs.ErrResourceExhausted)
	// ErrRefused means the policy refuses a destination; the message says why.
	ErrRefused = fmt.Errorf("egress refused: %w", errdefs.ErrFailedPrecondition)
)
