// Package errdefs is the error taxonomy every package of the server wraps: a handful of
// classes, each one status code at the API's edge. A package's own sentinel errors wrap one of
// them (sandbox.ErrNotFound wraps ErrNotFound; envpool.ErrUnknownEnv wraps ErrNotFound too), so
// that callers test either the precise error or its class with errors.Is, and the RPC layer maps
// classes, never packages, to codes (server/errors.go).
package errdefs

import "errors"

// The classes. Messages of errors that wrap them say what was being done; the class says what
// the caller can do about it.
var (
	// ErrInvalidArgument: the request is malformed or names something impossible; sending it
	// again changes nothing.
	ErrInvalidArgument = errors.New("invalid argument")
	// ErrNotFound: what the request names does not exist (or no longer does).
	ErrNotFound = errors.New("not found")
	// ErrAlreadyExists: what the request would create exists.
	ErrAlreadyExists = errors.New("already exists")
	// ErrFailedPrecondition: the request is well formed but the state it acts on refuses it (a
	// closed sandbox, an ended episode, processes that cannot be captured).
	ErrFailedPrecondition = errors.New("failed precondition")
	// ErrResourceExhausted: a limit or budget is reached.
	ErrResourceExhausted = errors.New("resource exhausted")
	// ErrAborted: the operation was cut short by a concurrent one (a restore that ends a
	// running command); it may be retried.
	ErrAborted = errors.New("aborted")
	// ErrUnavailable: the service is stopping or a dependency is down; retry later.
	ErrUnavailable = errors.New("unavailable")
	// ErrUnauthenticated: the caller did not prove who it is.
	ErrUnauthenticated = errors.New("unauthenticated")
	// ErrInternal: a fault of the server itself, not of the request.
	ErrInternal = errors.New("internal error")
)

// Classes lists every class, for tables and tests.
var Classes = []error{ErrInvalidArgument, ErrNotFound, ErrAlreadyExists, ErrFailedPrecondition,
	ErrResourceExhausted, ErrAborted, ErrUnavailable, ErrUnauthenticated, ErrInternal}

// Class returns the class err wraps nearest its top: the unwrap tree is walked breadth first,
// left to right, so that an error that wraps its own class and, as its cause, an error of
// another class (an env not ready because its image is not found) has its own class. nil
// when it wraps none.
func Class(err error) error {
	queue := []error{err}
	for len(queue) > 0 {
		e := queue[0]
		queue = queue[1:]
		if e == nil {
			continue
		}
		for _, c := range Classes {
			if e == c {
				return c
			}
		}
		switch u := e.(type) {
		case interface{ Unwrap() error }:
			queue = append(queue, u.Unwrap())
		case interface{ Unwrap() []error }:
			queue = append(queue, u.Unwrap()...)
		}
	}
	return nil
}
