package server

import (
	"context"
	"errors"
	"fmt"
	"maps"
	"strings"

	"connectrpc.com/connect"
	"google.golang.org/genproto/googleapis/rpc/errdetails"

	"github.com/deltagym/deltagym/envpool"
	"github.com/deltagym/deltagym/internal/errdefs"
	"github.com/deltagym/deltagym/internal/wiretext"
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

// classCodes maps the error classes to Connect codes.
var classCodes = map[error]connect.Code{
	errdefs.ErrUnauthenticated:    connect.CodeUnauthenticated,
	errdefs.ErrAborted:            connect.CodeAborted,
	errdefs.ErrNotFound:           connect.CodeNotFound,
	errdefs.ErrInvalidArgument:    connect.CodeInvalidArgument,
	errdefs.ErrAlreadyExists:      connect.CodeAlreadyExists,
	errdefs.ErrResourceExhausted:  connect.CodeResourceExhausted,
	errdefs.ErrFailedPrecondition: connect.CodeFailedPrecondition,
	errdefs.ErrUnavailable:        connect.CodeUnavailable,
	errdefs.ErrInternal:           connect.CodeInternal,
}

// codeOf maps an error to its Connect code: a Connect error keeps its own, a classed error
// gets the code of its class nearest its top (errdefs.Class: an env not ready for want of its
// image is FailedPrecondition, not NotFound), a context's end its own; anything else is
// Internal.
func codeOf(err error) connect.Code {
	var ce *connect.Error
	if errors.As(err, &ce) {
		return ce.Code()
	}
	if code, ok := classCodes[errdefs.Class(err)]; ok {
		return code
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

// toConnect turns err into a Connect error with the right code and a client-safe message: host
// paths under the server's directories are replaced by placeholders, the words of the error's
// class are left out (errdefs.Message), and internal errors are reported without detail (the
// log has it).
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
	ce = connect.NewError(code, errors.New(s.message(err)))
	if info := errorInfo(err); info != nil {
		if d, derr := connect.NewErrorDetail(info); derr == nil {
			ce.AddDetail(d)
		}
	}
	return ce
}

// ErrorDomain is the domain of the google.rpc.ErrorInfo the server attaches to its errors.
const ErrorDomain = "deltagym.dev"

// reasons maps the error sentinels to the reasons of the ErrorInfo that toConnect attaches,
// first match first: an error that is several (an ended episode in a closed sandbox) gets the
// reason of the one listed first. A reason an error carries itself (errdefs.WithDetail: where
// the sentinel is too broad, as the runtime's not-found for checkpoints and images) comes
// before these. The reasons are the API's (docs/OPERATIONS.md, "Error reasons"): a reason,
// once given, keeps its meaning.
var reasons = []struct {
	err    error
	reason string
}{
	{envpool.ErrUnknownSandbox, "SANDBOX_NOT_FOUND"},
	{envpool.ErrUnknownEnv, "ENV_NOT_FOUND"},
	{episode.ErrEpisodeEnded, "EPISODE_ENDED"},
	{envpool.ErrLeaseEnded, "SANDBOX_CLOSED"},
	{sandbox.ErrClosed, "SANDBOX_CLOSED"},
	{envpool.ErrExhausted, "NO_CAPACITY"},
	{envpool.ErrWaiting, "NO_CAPACITY"},
	{sandbox.ErrCap, "NO_CAPACITY"},
	{envpool.ErrNotReady, "ENV_NOT_READY"},
	{episode.ErrOtherEnv, "CHECKPOINT_OF_OTHER_ENV"},
	{sandbox.ErrProcessesStay, "PROCESSES_STAY"},
	{ErrNoLedger, "LEDGER_DISABLED"},
	{envpool.ErrClosed, "SHUTTING_DOWN"},
}

// errorInfo is the google.rpc.ErrorInfo of err: its reason (errdefs.DetailOf, else the
// reasons table) and metadata; nil for an error of no known reason.
func errorInfo(err error) *errdetails.ErrorInfo {
	d := errdefs.DetailOf(err)
	if d.Reason == "" {
		for _, r := range reasons {
			if errors.Is(err, r.err) {
				d.Reason = r.reason
				break
			}
		}
	}
	if d.Reason == "" {
		return nil
	}
	// Metadata may quote a sandbox's path: made valid, in a copy of the error's own map, since a
	// detail that is not UTF-8 would not marshal and the error would go without its reason.
	info := &errdetails.ErrorInfo{Reason: d.Reason, Domain: ErrorDomain, Metadata: maps.Clone(d.Meta)}
	wiretext.Message(info)
	return info
}

// reasonOf is the reason toConnect attaches to err; "" for none.
func reasonOf(err error) string {
	if codeOf(err) == connect.CodeInternal {
		return ""
	}
	var ce *connect.Error
	if errors.As(err, &ce) {
		return ""
	}
	return errorInfo(err).GetReason()
}

// describe is err's text for a client of another protocol than Connect's: message, or for an
// internal error a pointer at the log, which has it.
func (s *Server) describe(err error) string {
	if codeOf(err) == connect.CodeInternal {
		s.log.Error("internal error", "err", err)
		return "internal error (details in the server log)"
	}
	return s.message(err)
}

// message is err's text for a client: host paths scrubbed and without the words of its class,
// which its code says, or the field that holds it ("not_found: checkpoint …", not
// "not_found: not found: checkpoint …" nor "… env not ready: failed precondition"). A path or
// name the message quotes that is not UTF-8 is shown by wiretext's rule: every protocol's
// error message is text.
func (s *Server) message(err error) string {
	return wiretext.String(errdefs.Strip(s.scrub(err.Error()), errdefs.Class(err)))
}

// scrub replaces the server's host paths in a message.
func (s *Server) scrub(msg string) string {
	for _, r := range s.scrubbers {
		msg = strings.ReplaceAll(msg, r[0], r[1])
	}
	return msg
}
