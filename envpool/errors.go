package envpool

import "errors"

// Sentinel errors returned (wrapped) by this package. Errors of the sandbox runtime are passed
// through wrapped, so callers can test them with errors.Is too.
var (
	// ErrInvalidSpec means an env spec is malformed; the message names the file and field.
	ErrInvalidSpec = errors.New("invalid env spec")
	// ErrUnknownEnv means no env of that name is in the catalog.
	ErrUnknownEnv = errors.New("unknown env")
	// ErrEnvExists means an env of that name is already in the catalog.
	ErrEnvExists = errors.New("env already exists")
	// ErrNotReady means the env's pool could not be warmed (its image is missing or a setup
	// command failed); the message says why.
	ErrNotReady = errors.New("env not ready")
	// ErrExhausted means no warm sandbox became free before the acquire deadline.
	ErrExhausted = errors.New("no warm sandbox available")
	// ErrUnknownSandbox means no live lease has that sandbox id.
	ErrUnknownSandbox = errors.New("unknown sandbox")
	// ErrLeaseEnded means the lease was closed or reaped.
	ErrLeaseEnded = errors.New("sandbox closed")
	// ErrAborted means the call was aborted by a Restore or Close of its sandbox.
	ErrAborted = errors.New("aborted by restore or close")
	// ErrVerifier means the verifier failed or printed no reward.
	ErrVerifier = errors.New("verifier failed")
	// ErrNoVerifier means the env has no verifier.
	ErrNoVerifier = errors.New("env has no verifier")
	// ErrClosed means the Manager was closed.
	ErrClosed = errors.New("env pool manager closed")
)
