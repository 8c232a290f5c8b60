package criu

import "errors"

var (
	// ErrNotInstalled means no CRIU wrapper was found: run `make criu` or set DELTAGYM_CRIU.
	ErrNotInstalled = errors.New("criu is not installed")
	// ErrInvalidConfig means a Config or an options struct failed validation.
	ErrInvalidConfig = errors.New("invalid criu config")
	// ErrClosed means the Service was used after Close.
	ErrClosed = errors.New("criu service is closed")
	// ErrRequest means CRIU answered a request with a failure; its log holds the reason.
	ErrRequest = errors.New("criu request failed")
)
