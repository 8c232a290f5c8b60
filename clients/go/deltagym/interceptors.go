package deltagym

import (
	"context"
	"errors"
	"math/rand/v2"
	"time"

	"connectrpc.com/connect"

	deltagymv1 "github.com/deltagym/deltagym/clients/go/gen/deltagym/v1"
	"github.com/deltagym/deltagym/clients/go/gen/deltagym/v1/deltagymv1connect"
)

// bearerInterceptor sets the Authorization header of every call.
type bearerInterceptor string

func (b bearerInterceptor) WrapUnary(next connect.UnaryFunc) connect.UnaryFunc {
	return func(ctx context.Context, req connect.AnyRequest) (connect.AnyResponse, error) {
		req.Header().Set("Authorization", string(b))
		return next(ctx, req)
	}
}

func (b bearerInterceptor) WrapStreamingClient(next connect.StreamingClientFunc) connect.StreamingClientFunc {
	return func(ctx context.Context, spec connect.Spec) connect.StreamingClientConn {
		conn := next(ctx, spec)
		conn.RequestHeader().Set("Authorization", string(b))
		return conn
	}
}

func (b bearerInterceptor) WrapStreamingHandler(next connect.StreamingHandlerFunc) connect.StreamingHandlerFunc {
	return next
}

// readOnlyOrIdempotent lists the procedures that may be retried whatever
// their request: they change nothing, or doing them twice is the same as
// doing them once (Close of a closed sandbox succeeds; a second ReportReward
// with the same name and source replaces the first).
var readOnlyOrIdempotent = map[string]bool{
	deltagymv1connect.EnvServiceListEnvsProcedure:              true,
	deltagymv1connect.EnvServiceGetSandboxProcedure:            true,
	deltagymv1connect.EnvServiceListSandboxesProcedure:         true,
	deltagymv1connect.EnvServiceListCheckpointsProcedure:       true,
	deltagymv1connect.EnvServiceHeartbeatProcedure:             true,
	deltagymv1connect.EnvServiceCloseProcedure:                 true,
	deltagymv1connect.LedgerServiceListEpisodesProcedure:       true,
	deltagymv1connect.LedgerServiceGetTrajectoryProcedure:      true,
	deltagymv1connect.LedgerServiceGetCheckpointTreeProcedure:  true,
	deltagymv1connect.LedgerServiceGetGroupAdvantagesProcedure: true,
	deltagymv1connect.LedgerServiceReportRewardProcedure:       true,
	deltagymv1connect.NodeServiceGetNodeProcedure:              true,
}

// retrySafe reports whether a call may be sent again after Unavailable, when
// the server may or may not have performed the first attempt.
func retrySafe(procedure string, msg any) bool {
	if readOnlyOrIdempotent[procedure] {
		return true
	}
	switch m := msg.(type) {
	case *deltagymv1.ResetRequest:
		return m.GetIdempotencyKey() != ""
	case *deltagymv1.ForkRequest:
		return m.GetIdempotencyKey() != ""
	}
	return false
}

// retryInterceptor retries unary calls that are safe to retry while the
// server is Unavailable, with jittered exponential backoff, within the call's
// context. Streams and unsafe calls are sent once, and so is a call to a node
// a Cluster finds unreachable (a *NodeError): the Cluster sends new work to
// the other nodes at once, and learns when the node is back from its refresh.
type retryInterceptor struct {
	attempts     int
	backoff, max time.Duration
}

func (r retryInterceptor) WrapUnary(next connect.UnaryFunc) connect.UnaryFunc {
	return func(ctx context.Context, req connect.AnyRequest) (connect.AnyResponse, error) {
		if r.attempts <= 1 || !retrySafe(req.Spec().Procedure, req.Any()) {
			return next(ctx, req)
		}
		delay := r.backoff
		for attempt := 1; ; attempt++ {
			res, err := next(ctx, req)
			var down *NodeError
			if err == nil || connect.CodeOf(err) != connect.CodeUnavailable || attempt >= r.attempts || errors.As(err, &down) {
				return res, err
			}
			// Full jitter in [delay/2, delay) spreads the retries of many clients.
			wait := delay/2 + rand.N(delay/2+1)
			t := time.NewTimer(wait)
			select {
			case <-ctx.Done():
				t.Stop()
				return nil, err
			case <-t.C:
			}
			delay = min(2*delay, r.max)
		}
	}
}

func (r retryInterceptor) WrapStreamingClient(next connect.StreamingClientFunc) connect.StreamingClientFunc {
	return next
}

func (r retryInterceptor) WrapStreamingHandler(next connect.StreamingHandlerFunc) connect.StreamingHandlerFunc {
	return next
}

// noTokenHint is the advice added to an unauthenticated error of a client that found no token.
const noTokenHint = " (this client found no token: pass WithToken, set $" + EnvToken + " or $" + EnvTokenFile +
	", or run from the directory that holds the server's data directory " + DefaultDataDir + ", or set $" + EnvData + " to it)"

// noTokenInterceptor adds noTokenHint to the unauthenticated errors of a client that sends no
// token, so that the error says where the client looked.
type noTokenInterceptor struct{}

func withNoTokenHint(err error) error {
	var ce *connect.Error
	if !errors.As(err, &ce) || ce.Code() != connect.CodeUnauthenticated {
		return err
	}
	out := connect.NewError(ce.Code(), errors.New(ce.Message()+noTokenHint))
	for k, v := range ce.Meta() {
		out.Meta()[k] = v
	}
	return out
}

func (noTokenInterceptor) WrapUnary(next connect.UnaryFunc) connect.UnaryFunc {
	return func(ctx context.Context, req connect.AnyRequest) (connect.AnyResponse, error) {
		res, err := next(ctx, req)
		return res, withNoTokenHint(err)
	}
}

func (noTokenInterceptor) WrapStreamingClient(next connect.StreamingClientFunc) connect.StreamingClientFunc {
	return func(ctx context.Context, spec connect.Spec) connect.StreamingClientConn {
		return noTokenConn{next(ctx, spec)}
	}
}

func (noTokenInterceptor) WrapStreamingHandler(next connect.StreamingHandlerFunc) connect.StreamingHandlerFunc {
	return next
}

// noTokenConn is a client stream whose unauthenticated errors carry noTokenHint.
type noTokenConn struct{ connect.StreamingClientConn }

func (c noTokenConn) Send(m any) error    { return withNoTokenHint(c.StreamingClientConn.Send(m)) }
func (c noTokenConn) Receive(m any) error { return withNoTokenHint(c.StreamingClientConn.Receive(m)) }
func (c noTokenConn) CloseResponse() error {
	return withNoTokenHint(c.StreamingClientConn.CloseResponse())
}
