package server

import (
	"context"
	"errors"
	"fmt"
	"strings"

	"connectrpc.com/connect"

	"github.com/deltagym/deltagym/envpool"
	"github.com/deltagym/deltagym/internal/errdefs"
	"github.com/deltagym/deltagym/sandbox"
	"github.com/deltagym/deltagym/server/episode"
)

// Sentinel errors of the server itself.
var (
	// ErrInvalid means a malformed request (missing field, bad action): the episode core's.
	ErrInvalid = episode.ErrInvalid
	// ErrNoLedger means a ledger query on a server started without a ledger.
	ErrNoLedger = fmt.Errorf("ledger disabled on this server: %w", errdefs.ErrFailedPrecondition)
	// ErrUnauthenticated means a missing or wrong bearer token.
	ErrUnauthenticated = fmt.Errorf("missing or wrong bearer token: %w", errdefs.ErrUnauthenticated)
)

// classCodes maps the error classes to Connect codes. An error of several classes (an abort
// that wraps what the aborted call returned) takes the first in this order.
var classCodes = []struct {
	class error
	code  connect.Code
}{
	{errdefs.ErrUnauthenticated, connect.CodeUnauthenticated},
	{errdefs.ErrAborted, connect.CodeAborted},
	{errdefs.ErrNotFound, connect.CodeNotFound},
	{errdefs.ErrInvalidArgument, connect.CodeInvalidArgument},
	{errdefs.ErrAlreadyExists, connect.CodeAlreadyExists},
	{errdefs.ErrResourceExhausted, connect.CodeResourceExhausted},
	{errdefs.ErrFailedPrecondition, connect.CodeFailedPrecondition},
	{errdefs.ErrUnavailable, connect.CodeUnavailable},
	{errdefs.ErrInternal, connect.CodeInternal},
}

// codeOf maps an error to its Connect code: a Connect error keeps its own, a classed error
// (internal/errdefs) gets its class's, a context's end its own; anything else is Internal.
func codeOf(err error) connect.Code {
	var ce *connect.Error
	if errors.As(err, &ce) {
		return ce.Code()
	}
	if code, ok := legacyCode(err); ok {
		return code
	}
	for _, c := range classCodes {
		if errors.Is(err, c.class) {
			return c.code
		}
	}
	switch {
	case errors.Is(err, context.DeadlineExceeded):
		return connect.CodeDeadlineExceeded
	case errors.Is(err, context.Canceled):
		return connect.CodeCanceled
	}
	return connect.CodeInternal
}

// isInternal reports whether err is the server's own fault (Internal on the wire).
func isInternal(err error) bool { return codeOf(err) == connect.CodeInternal }

// Fallback for the sentinels of packages sandbox and envpool that do not wrap an errdefs class
// yet: delete legacyClasses, legacyCode and classedBefore, and legacyCode's call in codeOf, once
// they all do.
//
// legacyClasses gives each such sentinel its class; an entry ranks where its rank class stands
// in classCodes, ahead of that class's errors (an env that is not ready for want of its image
// is FailedPrecondition, not NotFound).
var legacyClasses = []struct {
	sentinels   []error
	class, rank error
}{
	{[]error{sandbox.ErrAborted, envpool.ErrAborted}, errdefs.ErrAborted, errdefs.ErrAborted},
	{[]error{envpool.ErrNotReady}, errdefs.ErrFailedPrecondition, errdefs.ErrNotFound},
	{[]error{sandbox.ErrNotFound, envpool.ErrUnknownEnv, envpool.ErrUnknownSandbox}, errdefs.ErrNotFound, errdefs.ErrNotFound},
	{[]error{sandbox.ErrInvalid, envpool.ErrInvalidSpec, envpool.ErrBadOption}, errdefs.ErrInvalidArgument, errdefs.ErrInvalidArgument},
	{[]error{sandbox.ErrExists, envpool.ErrEnvExists}, errdefs.ErrAlreadyExists, errdefs.ErrAlreadyExists},
	{[]error{sandbox.ErrBudget, envpool.ErrExhausted}, errdefs.ErrResourceExhausted, errdefs.ErrResourceExhausted},
	{[]error{sandbox.ErrClosed, sandbox.ErrMismatch, sandbox.ErrProcesses, envpool.ErrLeaseEnded, envpool.ErrNoVerifier, envpool.ErrVerifier},
		errdefs.ErrFailedPrecondition, errdefs.ErrFailedPrecondition},
	{[]error{envpool.ErrClosed}, errdefs.ErrUnavailable, errdefs.ErrUnavailable},
}

// legacyCode is the code of err by the first of legacyClasses whose sentinel it wraps, unless
// it also wraps a class that ranks before that entry (classCodes then decide).
func legacyCode(err error) (connect.Code, bool) {
	for _, l := range legacyClasses {
		for _, s := range l.sentinels {
			if !errors.Is(err, s) {
				continue
			}
			if classedBefore(err, l.rank) {
				return 0, false
			}
			for _, c := range classCodes {
				if c.class == l.class {
					return c.code, true
				}
			}
		}
	}
	return 0, false
}

// classedBefore reports whether err wraps a class that comes before rank in classCodes.
func classedBefore(err, rank error) bool {
	for _, c := range classCodes {
		if c.class == rank {
			return false
		}
		if errors.Is(err, c.class) {
			return true
		}
	}
	return false
}

// toConnect turns err into a Connect error with the right code and a client-safe message: host
// paths under the server's directories are replaced by placeholders, and internal errors are
// reported without detail (the log has it).
func (s *Server) toConnect(err error) error {
	if err == nil {
		return nil
	}
	var ce *connect.Error
	if errors.As(err, &ce) {
		return err
	}
	code := codeOf(err)
	if code == connect.CodeInternal {
		s.log.Error("internal error", "err", err)
		return connect.NewError(code, errors.New("internal error (details in the server log)"))
	}
	return connect.NewError(code, errors.New(trimClass(s.scrub(err.Error()), code)))
}

// trimClass drops from msg the text of its class where the code already says it: "not_found:
// checkpoint …", not "not_found: not found: checkpoint …" or "… unknown env: not found".
func trimClass(msg string, code connect.Code) string {
	for _, c := range classCodes {
		if c.code != code {
			continue
		}
		p := c.class.Error()
		if rest, ok := strings.CutPrefix(msg, p+": "); ok && rest != "" {
			msg = rest
		}
		if rest, ok := strings.CutSuffix(msg, ": "+p); ok && rest != "" {
			msg = rest
		}
	}
	return msg
}

// scrub replaces the server's host paths in a message.
func (s *Server) scrub(msg string) string {
	for _, r := range s.scrubbers {
		msg = strings.ReplaceAll(msg, r[0], r[1])
	}
	return msg
}
