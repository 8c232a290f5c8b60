package deltagym

import (
	"context"
	"errors"
	"fmt"
	"sync"

	"connectrpc.com/connect"

	deltagymv1 "github.com/deltagym/deltagym/clients/go/gen/deltagym/v1"
)

// StepStream pipelines steps over many sandboxes on one bidirectional
// stream: steps for one sandbox are performed in the order sent, and results
// for different sandboxes come back in any order, matched by request ID. Send
// and Receive may be called from two goroutines at once (one sender, one
// receiver). Streams are never retried.
type StepStream struct {
	stream *connect.BidiStreamForClient[deltagymv1.StepStreamRequest, deltagymv1.StepStreamResponse]

	mu sync.Mutex
	// +checklocks:mu
	nextID uint64
	// +checklocks:mu
	closed bool
}

// StreamResult is the outcome of one step sent on a StepStream.
type StreamResult struct {
	// RequestID is the ID Send returned for the step.
	RequestID uint64
	// Response is the step's response, when it succeeded.
	Response *deltagymv1.StepResponse
	// Err is why the step failed (a *connect.Error with the step's code); the
	// stream goes on.
	Err error
}

// StepStream opens a stream. Close it when done.
func (c *Client) StepStream(ctx context.Context) (*StepStream, error) {
	if err := c.checkOpen(); err != nil {
		return nil, err
	}
	return &StepStream{stream: c.env.StepStream(ctx)}, nil
}

// Send queues a step and returns the request ID its result will carry.
func (s *StepStream) Send(sandboxID string, action *deltagymv1.Action, checkpoint bool) (uint64, error) {
	return s.SendRequest(&deltagymv1.StepRequest{SandboxId: sandboxID, Action: action, Checkpoint: checkpoint})
}

// SendRequest queues any step, such as one that restores a checkpoint first
// (StepRequest.RestoreCheckpointId), and returns the request ID its result
// will carry.
func (s *StepStream) SendRequest(step *deltagymv1.StepRequest) (uint64, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.closed {
		return 0, errors.New("sending on a closed step stream")
	}
	s.nextID++
	id := s.nextID
	if err := s.stream.Send(&deltagymv1.StepStreamRequest{RequestId: id, Step: step}); err != nil {
		return 0, fmt.Errorf("sending step %d: %w", id, err)
	}
	return id, nil
}

// Receive returns the next result. After CloseSend and the last result it
// returns an error wrapping io.EOF.
func (s *StepStream) Receive() (*StreamResult, error) {
	m, err := s.stream.Receive()
	if err != nil {
		return nil, err
	}
	r := &StreamResult{RequestID: m.GetRequestId(), Response: m.GetStep()}
	if e := m.GetError(); e != nil {
		r.Err = connect.NewError(connect.Code(e.GetCode()), errors.New(e.GetMessage()))
	}
	return r, nil
}

// CloseSend tells the server no more steps come; results still arrive.
func (s *StepStream) CloseSend() error {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.closed {
		return nil
	}
	s.closed = true
	return s.stream.CloseRequest()
}

// Close ends the stream in both directions. It is idempotent.
func (s *StepStream) Close() error {
	err := s.CloseSend()
	return errors.Join(err, s.stream.CloseResponse())
}

// ExecAction returns an Action that runs command with /bin/sh -c, for Step and
// StepStream.Send.
func ExecAction(command string, opts ...StepOption) *deltagymv1.Action {
	a := stepOptions(opts).exec()
	a.Command = command
	return &deltagymv1.Action{Kind: &deltagymv1.Action_Exec{Exec: a}}
}
