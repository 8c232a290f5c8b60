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

// plain is msg without the words of the error classes in it ("egress refused: not in the
// env's allow-list", not "egress refused: failed precondition: …"): a reply's status says
// the class to the program in the sandbox that reads its body.
func plain(msg string) string {
	for _, c := range errdefs.Classes {
		msg = errdefs.Strip(msg, c)
	}
	return msg
}
