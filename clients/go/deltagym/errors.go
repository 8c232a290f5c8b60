package deltagym

import "errors"

// Sentinel errors returned (wrapped) by this package. Errors from the server
// are *connect.Error values instead; use connect.CodeOf to read their code.
var (
	// ErrClientClosed means the Client was closed.
	ErrClientClosed = errors.New("deltagym client closed")
	// ErrSandboxClosed means the Sandbox handle was closed.
	ErrSandboxClosed = errors.New("sandbox handle closed")
	// ErrBadAddress means the server address given to Dial cannot be used.
	ErrBadAddress = errors.New("bad server address")
	// ErrLeaseLost means the server no longer knows the sandbox a heartbeat
	// was renewing (it was closed or reaped).
	ErrLeaseLost = errors.New("sandbox lease lost")
)
