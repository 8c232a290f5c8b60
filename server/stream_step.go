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
// at the env's output cap, as the result is, and joined as they are queued (outputQueue), so a
// client that reads nothing costs a parked handler and at most about twice the output cap per
// stream (the response's bytes and the queued copies). What is still queued when the step ends
// is sent before the response. A client that goes away, or a send that fails, cuts the step
// short as a cancelled Step is.
//
// A client that keeps its connection but reads nothing parks the handler until it reads,
// cancels or goes, or the server closes: a blocked Send ends only when the HTTP/2 stream does,
// and the handler reaches no write deadline of the stream through Connect (returning while the
// sender's Send is blocked would race it on the stream), so it has no clean way to end such a
// stream itself.
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
//
// A piece is joined, as it is put, to the last piece of its stream that the sender has not
// taken yet, up to outputChunkMax, and a piece that does not fit fills that one up before a new
// one holds the rest. So whatever the client reads, a stream has at most one queued piece that is
// not full, and the queue holds at most the stream's output bytes (copies, or, for a plain
// command's lone piece, a slice of the result itself) plus outputChunkMax and a message's
// overhead per stream: however small the pieces the readers hand over (a line each, a pipe read
// each), a client that reads nothing costs no more than the output cap per stream, which the
// step's response holds anyway, so at most about twice the cap in all. The order of one stream's
// bytes is kept; a stream's piece joined to one queued before a piece of the other stream is sent
// before that piece, as it would have been had its reader been scheduled sooner.
type outputQueue struct {
	mu sync.Mutex
	// pieces are the queued pieces, oldest first.
	// +checklocks:mu
	pieces []*deltagymv1.OutputChunk
	// tail holds, per stream, the last queued piece of the stream, or nil once the sender took it.
	// +checklocks:mu
	tail map[deltagymv1.OutputStream]*queuedPiece
	// +checklocks:mu
	closed bool
	// ready is signalled when a piece is queued or the queue closed.
	ready chan struct{}
}

// queuedPiece is a queued piece and whether its bytes are the queue's own, to append to.
type queuedPiece struct {
	c     *deltagymv1.OutputChunk
	owned bool
}

func newOutputQueue() *outputQueue {
	return &outputQueue{ready: make(chan struct{}, 1), tail: make(map[deltagymv1.OutputStream]*queuedPiece, 2)}
}

var outputStreams = map[int]deltagymv1.OutputStream{
	sandbox.OutputStdout: deltagymv1.OutputStream_OUTPUT_STREAM_STDOUT,
	sandbox.OutputStderr: deltagymv1.OutputStream_OUTPUT_STREAM_STDERR,
}

// put queues piece p of stream (sandbox.ExecRequest.Output); p is not written to after.
func (q *outputQueue) put(stream int, p []byte) {
	if len(p) == 0 {
		return
	}
	st := outputStreams[stream]
	q.mu.Lock()
	if t := q.tail[st]; t != nil {
		p = t.fill(p)
	}
	for len(p) > 0 {
		// p, or what did not fit, starts a piece: p itself (never written to), cut at
		// outputChunkMax so that a later piece joins a piece of the queue's own.
		n := min(len(p), outputChunkMax)
		t := &queuedPiece{c: &deltagymv1.OutputChunk{Stream: st, Data: p[:n:n]}}
		q.pieces = append(q.pieces, t.c)
		q.tail[st] = t
		p = p[n:]
	}
	q.mu.Unlock()
	q.signal()
}

// fill appends to t what of p fits below outputChunkMax and returns the rest of p. Its bytes
// become the queue's own, in a buffer of outputChunkMax: the piece is joined only while the
// sender has not taken it.
func (t *queuedPiece) fill(p []byte) []byte {
	d := t.c.Data
	n := min(len(p), outputChunkMax-len(d))
	if n == 0 {
		return p
	}
	if !t.owned {
		d, t.owned = append(make([]byte, 0, outputChunkMax), d...), true
	}
	t.c.Data = append(d, p[:n]...)
	return p[n:]
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

// take removes the oldest queued piece, or returns nil and whether the queue is closed.
func (q *outputQueue) take() (*deltagymv1.OutputChunk, bool) {
	q.mu.Lock()
	defer q.mu.Unlock()
	if len(q.pieces) == 0 {
		q.pieces = nil // the array held pieces sent since
		return nil, q.closed
	}
	c := q.pieces[0]
	q.pieces[0] = nil
	q.pieces = q.pieces[1:]
	if t := q.tail[c.Stream]; t != nil && t.c == c {
		q.tail[c.Stream] = nil
	}
	return c, false
}

// drain sends the queued pieces with send, oldest first, one at a time (what is not taken yet
// goes on being joined to), until the queue is closed and empty or a send fails.
func (q *outputQueue) drain(send func(*deltagymv1.OutputChunk) error) error {
	for {
		c, closed := q.take()
		switch {
		case c != nil:
			if err := send(c); err != nil {
				return err
			}
		case closed:
			return nil
		default:
			<-q.ready
		}
	}
}
