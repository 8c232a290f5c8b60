package server

import (
	"context"
	"fmt"
	"sync"

	"connectrpc.com/connect"
	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/trace"

	deltagymv1 "github.com/deltagym/deltagym/clients/go/gen/deltagym/v1"
	"github.com/deltagym/deltagym/sandbox"
	"github.com/deltagym/deltagym/server/episode"
)

// StreamStep performs one step as Step does (the same core call, the same ledger row) and
// sends an exec's output as the sandbox reads it, then the step's response.
//
// A slow client never slows the command: the goroutines that read the command's output hand
// each piece to a queue and go on, and a sender goroutine sends what the queue holds, joined,
// as the client takes it. The queue is bounded by the step itself: each stream's pieces are cut
// at the env's output cap, as the result is, and they are slices of the result's own bytes for a
// plain command (a session's are copies of the same size), so a client that reads nothing costs
// at most the output the step returns anyway. What is still queued when the step ends is sent
// before the response. A client that goes away, or a send that fails, cuts the step short as a
// cancelled Step is.
func (e *envService) StreamStep(ctx context.Context, req *connect.Request[deltagymv1.StreamStepRequest], stream *connect.ServerStream[deltagymv1.StreamStepResponse]) error {
	m := req.Msg.GetStep()
	if m == nil {
		return e.s.toConnect(fmt.Errorf("stream_step needs a step: %w", ErrInvalid))
	}
	span := trace.SpanFromContext(ctx)
	span.SetAttributes(attribute.String("deltagym.sandbox_id", m.GetSandboxId()), attribute.String("deltagym.action", actionKind(m.GetAction())))
	resp, err := e.s.streamStep(ctx, m, stream)
	if err != nil {
		return e.s.toConnect(err)
	}
	span.SetAttributes(attribute.String("deltagym.episode_id", resp.GetEpisodeId()), attribute.Int("deltagym.step_index", int(resp.GetStepIndex())))
	return stream.Send(&deltagymv1.StreamStepResponse{Event: &deltagymv1.StreamStepResponse_Step{Step: resp}})
}

// streamStep performs step m, sending its exec's output on stream as it comes, and returns its
// response once every piece is sent.
func (s *Server) streamStep(ctx context.Context, m *deltagymv1.StepRequest, stream *connect.ServerStream[deltagymv1.StreamStepResponse]) (*deltagymv1.StepResponse, error) {
	ctx, cancel := context.WithCancelCause(ctx)
	defer cancel(nil)
	q := newOutputQueue()
	sent := make(chan error, 1)
	go func() {
		err := q.drain(func(c *deltagymv1.OutputChunk) error {
			return stream.Send(&deltagymv1.StreamStepResponse{Event: &deltagymv1.StreamStepResponse_Output{Output: c}})
		})
		if err != nil {
			cancel(err) // the client is gone: the step is cut short as a cancelled call's
		}
		sent <- err
	}()
	r := stepRequest(m)
	if x, ok := r.Action.(episode.Exec); ok && !x.Background {
		x.Output = q.put
		r.Action = x
	}
	res, err := s.core.Step(ctx, r)
	q.close()
	if serr := <-sent; serr != nil && err == nil {
		err = serr
	}
	if err != nil {
		return nil, err
	}
	return stepResponse(res), nil
}

// outputChunkMax is the most one OutputChunk message joins of pieces queued together.
const outputChunkMax = 64 << 10

// outputQueue holds the pieces of a command's output not sent yet (StreamStep).
type outputQueue struct {
	mu sync.Mutex
	// +checklocks:mu
	pieces []*deltagymv1.OutputChunk
	// +checklocks:mu
	closed bool
	// ready is signalled when a piece is queued or the queue closed.
	ready chan struct{}
}

func newOutputQueue() *outputQueue { return &outputQueue{ready: make(chan struct{}, 1)} }

var outputStreams = map[int]deltagymv1.OutputStream{
	sandbox.OutputStdout: deltagymv1.OutputStream_OUTPUT_STREAM_STDOUT,
	sandbox.OutputStderr: deltagymv1.OutputStream_OUTPUT_STREAM_STDERR,
}

// put queues piece p of stream (sandbox.ExecRequest.Output); p is not written to after.
func (q *outputQueue) put(stream int, p []byte) {
	c := &deltagymv1.OutputChunk{Stream: outputStreams[stream], Data: p}
	q.mu.Lock()
	q.pieces = append(q.pieces, c)
	q.mu.Unlock()
	q.signal()
}

// close ends the queue: drain returns once it has sent what it holds.
func (q *outputQueue) close() {
	q.mu.Lock()
	q.closed = true
	q.mu.Unlock()
	q.signal()
}

func (q *outputQueue) signal() {
	select {
	case q.ready <- struct{}{}:
	default:
	}
}

// drain sends the queued pieces with send, in order, joining the neighbours of one stream up
// to outputChunkMax, until the queue is closed and empty or a send fails.
func (q *outputQueue) drain(send func(*deltagymv1.OutputChunk) error) error {
	for {
		q.mu.Lock()
		pieces, closed := q.pieces, q.closed
		q.pieces = nil
		q.mu.Unlock()
		for _, c := range joinPieces(pieces) {
			if err := send(c); err != nil {
				return err
			}
		}
		if closed {
			return nil
		}
		if len(pieces) == 0 {
			<-q.ready
		}
	}
}

// joinPieces joins neighbouring pieces of one stream, up to outputChunkMax each.
func joinPieces(pieces []*deltagymv1.OutputChunk) []*deltagymv1.OutputChunk {
	if len(pieces) < 2 {
		return pieces
	}
	out := pieces[:0:0]
	owned := false // out's last holds a buffer of its own, not a piece's bytes
	for _, p := range pieces {
		if n := len(out); n > 0 && out[n-1].Stream == p.Stream && len(out[n-1].Data)+len(p.Data) <= outputChunkMax {
			last := out[n-1]
			if !owned { // the pieces are the result's bytes, never written to
				last.Data, owned = append(make([]byte, 0, outputChunkMax), last.Data...), true
			}
			last.Data = append(last.Data, p.Data...)
			continue
		}
		out, owned = append(out, p), false
	}
	return out
}
