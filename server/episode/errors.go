package episode

import (
	"fmt"

	"github.com/deltagym/deltagym/internal/errdefs"
)

// Sentinel errors of the episode core. Errors of the runtime, the pools and the ledger pass
// through wrapped, so that callers test them with errors.Is too.
var (
	// ErrInvalid means a malformed request: a missing field, an action of no kind or of two.
	ErrInvalid = fmt.Errorf("invalid request: %w", errdefs.ErrInvalidArgument)
	// ErrEpisodeEnded means a step on an episode that is terminated, truncated or failed.
	ErrEpisodeEnded = fmt.Errorf("episode ended: %w", errdefs.ErrFailedPrecondition)
	// ErrOtherEnv means a restore of a checkpoint of another env than the sandbox's.
	ErrOtherEnv = fmt.Errorf("a sandbox restores only checkpoints of its own env; fork the checkpoint for sandboxes of its env: %w",
		errdefs.ErrFailedPrecondition)
)
