package deltagym

import (
	"context"
	"errors"
	"fmt"

	"connectrpc.com/connect"

	deltagymv1 "github.com/deltagym/deltagym/clients/go/gen/deltagym/v1"
)

// StreamStep performs a raw action as Step does and hands output, as the
// server reads it, each piece of an exec's output in order (a piece of
// stdout or of stderr), before it returns the step's response. The pieces
// of one stream, joined, begin with what the response holds (both are cut
// at the env's output cap). output runs on the caller's goroutine; while it
// runs the next pieces wait at the server, which never holds the command up
// for them. Cancelling ctx cuts the step short as it does for Step. Not
// retried.
func (s *Sandbox) StreamStep(ctx context.Context, action *deltagymv1.Action, checkpoint bool, output func(stream deltagymv1.OutputStream, data []byte)) (*deltagymv1.StepResponse, error) {
	if err := s.checkOpen(); err != nil {
		return nil, err
	}
	req := &deltagymv1.StepRequest{SandboxId: s.id, Action: action, Checkpoint: checkpoint}
	resp, err := s.streamStep(ctx, req, output)
	if err != nil {
		return nil, fmt.Errorf("stream step in sandbox %s: %w", s.id, err)
	}
	s.mu.Lock()
	if ep := resp.GetEpisodeId(); ep != "" {
		s.episodeID = ep
	}
	s.mu.Unlock()
	return resp, nil
}

// streamStep reads the StreamStep of req to its response.
func (s *Sandbox) streamStep(ctx context.Context, req *deltagymv1.StepRequest, output func(deltagymv1.OutputStream, []byte)) (*deltagymv1.StepResponse, error) {
	st, err := s.c.env.StreamStep(ctx, connect.NewRequest(&deltagymv1.StreamStepRequest{Step: req}))
	if err != nil {
		return nil, err
	}
	defer st.Close()
	var resp *deltagymv1.StepResponse
	for st.Receive() {
		m := st.Msg()
		if c := m.GetOutput(); c != nil && output != nil {
			output(c.GetStream(), c.GetData())
		}
		if r := m.GetStep(); r != nil {
			resp = r
		}
	}
	if err := st.Err(); err != nil {
		return nil, err
	}
	if resp == nil {
		return nil, errors.New("the stream ended without the step's response")
	}
	return resp, nil
}
