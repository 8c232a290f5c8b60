package server

import (
	"context"
	"errors"
	"strings"

	"connectrpc.com/connect"

	"github.com/deltagym/deltagym/envpool"
	"github.com/deltagym/deltagym/sandbox"
	"github.com/deltagym/deltagym/server/ledger"
)

// Sentinel errors of the server itself.
var (
	// ErrInvalid means a malformed request (missing field, bad action).
	ErrInvalid = errors.New("invalid request")
	// ErrEpisodeEnded means a step on an episode that is terminated or truncated.
	ErrEpisodeEnded = errors.New("episode ended")
	// ErrNoLedger means a ledger query on a server started without a ledger.
	ErrNoLedger = errors.New("ledger disabled on this server")
	// ErrUnauthenticated means a missing or wrong bearer token.
	ErrUnauthenticated = errors.New("missing or wrong bearer token")
	// ErrOtherEnv means a restore of a checkpoint of another env than the sandbox's.
	ErrOtherEnv = errors.New("a sandbox restores only checkpoints of its own env; fork the checkpoint for sandboxes of its env")
)

// codeOf maps an error to its Connect code. It is the one place where the sentinel errors of the
// sandbox runtime, the pools, the ledger and the server meet the wire.
func codeOf(err error) connect.Code {
	var ce *connect.Error
	switch {
	case errors.As(err, &ce):
		return ce.Code()
	case errors.Is(err, ErrUnauthenticated):
		return connect.CodeUnauthenticated
	case errors.Is(err, sandbox.ErrAborted), errors.Is(err, envpool.ErrAborted):
		return connect.CodeAborted
	case errors.Is(err, envpool.ErrNotReady): // before NotFound: a missing image makes an env unready
		return connect.CodeFailedPrecondition
	case errors.Is(err, sandbox.ErrNotFound), errors.Is(err, envpool.ErrUnknownEnv),
		errors.Is(err, envpool.ErrUnknownSandbox), errors.Is(err, ledger.ErrNotFound):
		return connect.CodeNotFound
	case errors.Is(err, sandbox.ErrInvalid), errors.Is(err, envpool.ErrInvalidSpec),
		errors.Is(err, envpool.ErrBadOption), errors.Is(err, ledger.ErrInvalid), errors.Is(err, ErrInvalid):
		return connect.CodeInvalidArgument
	case errors.Is(err, sandbox.ErrExists), errors.Is(err, envpool.ErrEnvExists):
		return connect.CodeAlreadyExists
	case errors.Is(err, sandbox.ErrBudget), errors.Is(err, envpool.ErrExhausted):
		return connect.CodeResourceExhausted
	case errors.Is(err, sandbox.ErrClosed), errors.Is(err, sandbox.ErrMismatch), errors.Is(err, sandbox.ErrProcesses), errors.Is(err, envpool.ErrLeaseEnded),
		errors.Is(err, envpool.ErrNoVerifier), errors.Is(err, envpool.ErrVerifier),
		errors.Is(err, ErrEpisodeEnded), errors.Is(err, ErrNoLedger), errors.Is(err, ErrOtherEnv):
		return connect.CodeFailedPrecondition
	case errors.Is(err, envpool.ErrClosed), errors.Is(err, ledger.ErrClosed):
		return connect.CodeUnavailable
	case errors.Is(err, context.DeadlineExceeded):
		return connect.CodeDeadlineExceeded
	case errors.Is(err, context.Canceled):
		return connect.CodeCanceled
	}
	return connect.CodeInternal
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
	msg := s.scrub(err.Error())
	// The code already says it: "not_found: checkpoint …", not
	// "not_found: not found: checkpoint …".
	if p, ok := codePhrase[code]; ok {
		if rest, cut := strings.CutPrefix(msg, p+": "); cut && rest != "" {
			msg = rest
		}
	}
	return connect.NewError(code, errors.New(msg))
}

// codePhrase is the text a sentinel error of the runtime puts first in its
// messages, which the code it maps to repeats.
var codePhrase = map[connect.Code]string{
	connect.CodeNotFound:          sandbox.ErrNotFound.Error(),
	connect.CodeInvalidArgument:   sandbox.ErrInvalid.Error(),
	connect.CodeAlreadyExists:     sandbox.ErrExists.Error(),
	connect.CodeResourceExhausted: sandbox.ErrBudget.Error(),
	connect.CodeAborted:           sandbox.ErrAborted.Error(),
}

// scrub replaces the server's host paths in a message.
func (s *Server) scrub(msg string) string {
	for _, r := range s.scrubbers {
		msg = strings.ReplaceAll(msg, r[0], r[1])
	}
	return msg
}
