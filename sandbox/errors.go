package sandbox

import "errors"

// Sentinel errors of the runtime. The RPC edge maps each to one status code.
var (
	// ErrNotFound: an unknown sandbox, checkpoint or image.
	ErrNotFound = errors.New("not found")
	// ErrInvalid: bad input, such as a path that escapes or an empty argv.
	ErrInvalid = errors.New("invalid argument")
	// ErrExists: an image name already taken by another image.
	ErrExists = errors.New("already exists")
	// ErrBudget: a storage budget or disk limit is exhausted.
	ErrBudget = errors.New("resource exhausted")
	// ErrClosed: the sandbox has been destroyed.
	ErrClosed = errors.New("sandbox is closed")
	// ErrAborted: a running exec was aborted by Restore or Destroy.
	ErrAborted = errors.New("aborted")
	// ErrMismatch: a checkpoint of another image than the sandbox's.
	ErrMismatch = errors.New("checkpoint belongs to another image")
	// ErrProcesses: a live process cannot be captured by a checkpoint, or a
	// checkpoint's processes cannot be brought back (lost, or held by
	// another sandbox).
	ErrProcesses = errors.New("processes cannot be checkpointed or restored")
)
