package procstate

import (
	"fmt"

	"github.com/deltagym/deltagym/internal/errdefs"
)

var (
	// ErrProcesses: a live process cannot be captured by a checkpoint, or a
	// checkpoint's processes cannot be brought back (lost, or held by
	// another sandbox).
	ErrProcesses = fmt.Errorf("processes cannot be checkpointed or restored: %w", errdefs.ErrFailedPrecondition)
	// ErrBudget: a limit of the sandbox (its pids) is reached.
	ErrBudget = fmt.Errorf("%w", errdefs.ErrResourceExhausted)
)
