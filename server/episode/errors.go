package episode

import (
	"errors"
	"fmt"

	"github.com/deltagym/deltagym/internal/errdefs"
	"github.com/deltagym/deltagym/sandbox"
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

// about returns err with metadata kv (errdefs.WithDetail), pairs of key and value naming what
// it is about: the API's error reasons carry them (sandbox_id, checkpoint_id, env).
func about(err error, kv ...string) error { return errdefs.WithDetail(err, "", kv...) }

// checkpointErr is err, from the runtime about checkpoint id, with its reason
// (CHECKPOINT_NOT_FOUND for the runtime's not-found, which says no more than that) and id.
func checkpointErr(err error, id string) error {
	if errors.Is(err, sandbox.ErrNotFound) {
		return errdefs.WithDetail(err, "CHECKPOINT_NOT_FOUND", "checkpoint_id", id)
	}
	return about(err, "checkpoint_id", id)
}
