package sandbox

import (
	"cmp"
	"fmt"

	"golang.org/x/sys/unix"

	"github.com/deltagym/deltagym/internal/errdefs"
	"github.com/deltagym/deltagym/sandbox/procstate"
)

// Sentinel errors of the runtime, each wrapping its class of
// internal/errdefs; ErrBudget and ErrProcesses are those of the process
// state (sandbox/procstate). Where the class's own message says it all (not found,
// invalid argument, already exists, resource exhausted, aborted), the
// sentinel's message is the class's: the server strips it from messages
// whose status code repeats it (errdefs.Message).
var (
	// ErrNotFound: an unknown sandbox, checkpoint or image.
	ErrNotFound = fmt.Errorf("%w", errdefs.ErrNotFound)
	// ErrInvalid: bad input, such as a path that escapes or an empty argv.
	ErrInvalid = fmt.Errorf("%w", errdefs.ErrInvalidArgument)
	// ErrExists: an image name already taken by another image.
	ErrExists = fmt.Errorf("%w", errdefs.ErrAlreadyExists)
	// ErrBudget: a storage budget, a disk limit or the pids limit is
	// exhausted.
	ErrBudget = procstate.ErrBudget
	// ErrCap: a server-wide cap (Config.Caps, CheckpointBudgetBytes) would
	// be exceeded; the request was refused before anything was made.
	ErrCap = fmt.Errorf("%w", errdefs.ErrResourceExhausted)
	// ErrClosed: the sandbox has been destroyed.
	ErrClosed = fmt.Errorf("sandbox is closed: %w", errdefs.ErrFailedPrecondition)
	// ErrAborted: a running exec was aborted by Restore or Destroy.
	ErrAborted = fmt.Errorf("%w", errdefs.ErrAborted)
	// ErrMismatch: a checkpoint of another image than the sandbox's.
	ErrMismatch = fmt.Errorf("checkpoint belongs to another image: %w", errdefs.ErrFailedPrecondition)
	// ErrProcesses: a live process cannot be captured by a checkpoint, or a
	// checkpoint's processes cannot be brought back (lost, or held by
	// another sandbox).
	ErrProcesses = procstate.ErrProcesses
	// ErrUncopyable: a copy's source holds what a copy refuses (a symlink, device, FIFO or
	// socket, a tree nested too deep), or more than the copy's limits (CopyFrom).
	ErrUncopyable = fmt.Errorf("refused to copy: %w", errdefs.ErrFailedPrecondition)
	// ErrSessionEnded: a shell session's shell has exited (a command run
	// in it ended it); the session's next command starts another shell.
	ErrSessionEnded = fmt.Errorf("session ended: %w", errdefs.ErrFailedPrecondition)
	// ErrExpectBudget: an interactive command's search of its output for its patterns took
	// more than a call allows (interact.go); the command goes on.
	ErrExpectBudget = fmt.Errorf("the expect patterns' search of the output took more than %v: %w", expectBudget, errdefs.ErrResourceExhausted)
)

// FileError is a file action's failure that the sandbox's filesystem gave:
// the path missing, of the wrong type (a directory, a FIFO, a socket), not
// permitted, a running program's, or the writable layer full. Errno is the
// kernel's answer (EINVAL for a path that is not a regular file, which file
// actions refuse by policy) and Msg says it in words. It wraps its class
// (ErrNotFound for ENOENT, ErrBudget for a full layer, else ErrInvalid) and
// the errno. Faults of the host (EIO, EMFILE, ENOMEM) are not FileErrors.
type FileError struct {
	Path  string
	Errno unix.Errno
	Msg   string
	class error
}

// Error implements error.
func (e *FileError) Error() string { return e.cls().Error() + ": " + e.Path + ": " + e.Msg }

// Unwrap returns the error's class and its errno.
func (e *FileError) Unwrap() []error { return []error{e.cls(), e.Errno} }

// cls is the error's class; ErrInvalid for one made without.
func (e *FileError) cls() error { return cmp.Or(e.class, ErrInvalid) }
