package envpool

import (
	"fmt"

	"github.com/deltagym/deltagym/internal/errdefs"
)

// Sentinel errors returned (wrapped) by this package. Each wraps its class of internal/errdefs,
// so that callers test either the precise error or its class with errors.Is. Errors of the
// sandbox runtime are passed through wrapped, so callers can test them with errors.Is too.
var (
	// ErrInvalidSpec means an env spec is malformed; the message names the file and field.
	ErrInvalidSpec = fmt.Errorf("invalid env spec: %w", errdefs.ErrInvalidArgument)
	// ErrBadOption means a Reset option's key is not a valid environment variable name, or the
	// env's reset hook refused the task's seed and options.
	ErrBadOption = fmt.Errorf("invalid reset option: %w", errdefs.ErrInvalidArgument)
	// ErrUnknownEnv means no env of that name is in the catalog.
	ErrUnknownEnv = fmt.Errorf("unknown env: %w", errdefs.ErrNotFound)
	// ErrUnknownSandbox means no live lease has that sandbox id.
	ErrUnknownSandbox = fmt.Errorf("unknown sandbox: %w", errdefs.ErrNotFound)
	// ErrEnvExists means an env of that name is already in the catalog.
	ErrEnvExists = fmt.Errorf("env already exists: %w", errdefs.ErrAlreadyExists)
	// ErrNotReady means the env's pool could not be warmed (its image is missing or a setup
	// command failed); the message says why.
	ErrNotReady = fmt.Errorf("env not ready: %w", errdefs.ErrFailedPrecondition)
	// ErrWaiting means the env's setup was refused by a cap of the server (its live sandboxes,
	// checkpoints, descriptors or mounts) and is retried once capacity frees; the message names
	// the cap.
	ErrWaiting = fmt.Errorf("env waiting for capacity: %w", errdefs.ErrResourceExhausted)
	// ErrLeaseEnded means the lease was closed or reaped.
	ErrLeaseEnded = fmt.Errorf("sandbox closed: %w", errdefs.ErrFailedPrecondition)
	// ErrVerifier means the verifier failed or printed no reward.
	ErrVerifier = fmt.Errorf("verifier failed: %w", errdefs.ErrFailedPrecondition)
	// ErrNoVerifier means the env has no verifier.
	ErrNoVerifier = fmt.Errorf("env has no verifier: %w", errdefs.ErrFailedPrecondition)
	// ErrExhausted means no warm sandbox became free before the acquire deadline.
	ErrExhausted = fmt.Errorf("no warm sandbox available: %w", errdefs.ErrResourceExhausted)
	// ErrAborted means the call was aborted by a Restore or Close of its sandbox.
	ErrAborted = fmt.Errorf("aborted by restore or close: %w", errdefs.ErrAborted)
	// ErrClosed means the Manager was closed.
	ErrClosed = fmt.Errorf("env pool manager closed: %w", errdefs.ErrUnavailable)
)
