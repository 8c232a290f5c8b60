// Package errdefs is the error taxonomy every package of the server wraps: a handful of
// classes, each one status code at the API's edge. A package's own sentinel errors wrap one of
// them (sandbox.ErrNotFound wraps ErrNotFound; envpool.ErrUnknownEnv wraps ErrNotFound too), so
// that callers test either the precise error or its class with errors.Is, and the RPC layer maps
// classes, never packages, to codes (server/errors.go).
package errdefs

import (
	"errors"
	"strings"
)

// The classes. Messages of errors that wrap them say what was being done; the class says what
// the caller can do about it. An error's text holds its class's words ("…: not found") where it
// wrapped it with %w; where the class is said otherwise (a status code at the API's edge, a
// listing's state), Message gives the text without them.
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

// Class returns the first class met by a walk of err's unwrap tree in the order errors.Is
// walks it: depth first, left to right. Along one chain that is the class nearest the top; an
// error that joins its own kind and a cause (fmt.Errorf("%w: %w", ErrNotReady, cause)) lists
// its own kind first, so that it keeps its class whatever the cause's (an env not ready for
// want of its image is FailedPrecondition, not NotFound). nil when it wraps none.
func Class(err error) error {
	if err == nil {
		return nil
	}
	for _, c := range Classes {
		if err == c {
			return c
		}
	}
	switch u := err.(type) {
	case interface{ Unwrap() error }:
		return Class(u.Unwrap())
	case interface{ Unwrap() []error }:
		for _, e := range u.Unwrap() {
			if c := Class(e); c != nil {
				return c
			}
		}
	}
	return nil
}

// Message returns err's text without the words of its class (Class), which the caller says
// otherwise, as a status code does: "env x: checkpointing: the server's cap …" for
// "env x: checkpointing: resource exhausted: the server's cap …". The words go where they stand
// alone between ": " separators, wherever in the chain a sentinel or a wrap put them; the words
// of other classes stay (a failed precondition caused by an image "not found" says so). A text
// that is the class's words alone is kept.
func Message(err error) string {
	if err == nil {
		return ""
	}
	return Strip(err.Error(), Class(err))
}

// Strip removes from msg the segments, between ": " separators, that are class's words alone
// (see Message). msg is returned as it is when class is nil or msg is nothing but its words.
func Strip(msg string, class error) string {
	if class == nil {
		return msg
	}
	words := class.Error()
	parts := strings.Split(msg, ": ")
	kept := parts[:0]
	for _, p := range parts {
		if p != words {
			kept = append(kept, p)
		}
	}
	if len(kept) == 0 {
		return msg
	}
	return strings.Join(kept, ": ")
}

// Detail is what an error tells a client's program besides its text and class: a reason, in
// UPPER_SNAKE_CASE (SANDBOX_NOT_FOUND), and metadata naming what the error is about
// (sandbox_id, checkpoint_id, env). The server sends them as a google.rpc.ErrorInfo.
type Detail struct {
	Reason string
	Meta   map[string]string
}

// detailed is an error with a Detail; its text and class are its cause's.
type detailed struct {
	cause  error
	detail Detail
}

func (e *detailed) Error() string { return e.cause.Error() }
func (e *detailed) Unwrap() error { return e.cause }

// WithDetail returns err carrying reason (empty: none of its own; one set nearer err's top
// wins) and metadata from kv, pairs of key and value; err as it is when nil. The error's text
// and class are err's.
func WithDetail(err error, reason string, kv ...string) error {
	if err == nil {
		return nil
	}
	d := Detail{Reason: reason, Meta: map[string]string{}}
	for i := 0; i+1 < len(kv); i += 2 {
		d.Meta[kv[i]] = kv[i+1]
	}
	return &detailed{cause: err, detail: d}
}

// DetailOf gathers the Details err's chain carries, as errors.As walks it: the reason and
// each metadata key nearest the top win. The zero Detail when it carries none.
func DetailOf(err error) Detail {
	var out Detail
	walkDetails(err, &out)
	return out
}

func walkDetails(err error, out *Detail) {
	if err == nil {
		return
	}
	if d, ok := err.(*detailed); ok {
		if out.Reason == "" {
			out.Reason = d.detail.Reason
		}
		for k, v := range d.detail.Meta {
			if _, set := out.Meta[k]; !set {
				if out.Meta == nil {
					out.Meta = map[string]string{}
				}
				out.Meta[k] = v
			}
		}
	}
	switch u := err.(type) {
	case interface{ Unwrap() error }:
		walkDetails(u.Unwrap(), out)
	case interface{ Unwrap() []error }:
		for _, e := range u.Unwrap() {
			walkDetails(e, out)
		}
	}
}
