package loadtest

import "errors"

var (
	// ErrInvalid is a bad Config or flag value.
	ErrInvalid = errors.New("invalid load test configuration")
	// ErrWrongRestore is a restore whose result was not the checkpointed state: a
	// verification failure, counted as an error, never as a success.
	ErrWrongRestore = errors.New("sandbox state after restore is not the checkpointed state")
	// ErrUnexpected is a response that does not match what the scenario asked for.
	ErrUnexpected = errors.New("unexpected response")
	// ErrServerStart is a server that did not start or did not become healthy.
	ErrServerStart = errors.New("server did not start")
)
