package server

import (
	"context"
	"errors"
	"io"
	"sync"

	"connectrpc.com/connect"

	deltagymv1 "github.com/deltagym/deltagym/clients/go/gen/deltagym/v1"
)

// streamQueue is the maximum number of steps queued for one sandbox on a stream before the
// stream stops reading (back-pressure).
const streamQueue = 256

// stepStream runs the steps of one StepStream: one worker goroutine per sandbox named on the
// stream performs that sandbox's steps in order; different sandboxes run concurrently. A failed
// step is answered with its error; the stream ends when the client closes its side and every
// queued step is answered, or when ctx ends.
func (s *Server) stepStream(ctx context.Context, stream *connect.BidiStream[deltagymv1.StepStreamRequest, deltagymv1.StepStreamResponse]) error {
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	var (
		sendMu  sync.Mutex
		sendErr error
		wg      sync.WaitGroup
		queues  = map[string]chan *deltagymv1.StepStreamRequest{}
	)
	send := func(r *deltagymv1.StepStreamResponse) {
		sendMu.Lock()
		defer sendMu.Unlock()
		if sendErr != nil {
			return
		}
		if err := stream.Send(r); err != nil {
			sendErr = err
			cancel()
		}
	}
	answer := func(req *deltagymv1.StepStreamRequest) {
		resp, err := s.step(ctx, req.GetStep())
		if err != nil {
			ce := s.toConnect(err).(*connect.Error)
			send(&deltagymv1.StepStreamResponse{RequestId: req.GetRequestId(), Result: &deltagymv1.StepStreamResponse_Error{
				Error: &deltagymv1.ErrorStatus{Code: int32(ce.Code()), Message: ce.Message(), Reason: reasonOf(err)}}})
			return
		}
		send(&deltagymv1.StepStreamResponse{RequestId: req.GetRequestId(), Result: &deltagymv1.StepStreamResponse_Step{Step: resp}})
	}
	defer func() {
		for _, q := range queues {
			close(q)
		}
		wg.Wait()
	}()
	for {
		req, err := stream.Receive()
		if errors.Is(err, io.EOF) {
			break
		}
		if err != nil {
			return err
		}
		if req.GetStep() == nil {
			send(&deltagymv1.StepStreamResponse{RequestId: req.GetRequestId(), Result: &deltagymv1.StepStreamResponse_Error{
				Error: &deltagymv1.ErrorStatus{Code: int32(connect.CodeInvalidArgument), Message: "stream message has no step"}}})
			continue
		}
		id := req.GetStep().GetSandboxId()
		q, ok := queues[id]
		if !ok {
			q = make(chan *deltagymv1.StepStreamRequest, streamQueue)
			queues[id] = q
			wg.Go(func() {
				for r := range q {
					answer(r)
				}
			})
		}
		select {
		case q <- req:
		case <-ctx.Done():
			return ctx.Err()
		}
	}
	for _, q := range queues {
		close(q)
	}
	queues = nil
	wg.Wait()
	sendMu.Lock()
	defer sendMu.Unlock()
	return sendErr
}
