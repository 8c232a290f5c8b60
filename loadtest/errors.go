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
	// ErrUnavailable is a feature the server or the sandbox's env does not offer (the CRIU
	// process mode, python3 for the rollback-process scenario): reported as "not
	// available", never as a figure.
	ErrUnavailable = errors.New("not available")
	// ErrServerStart is a server that did not start or did not become healthy.
	ErrServerStart = errors.New("server did not start")
)
