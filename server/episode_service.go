package server

import (
	"context"

	"connectrpc.com/connect"
	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/trace"
	"google.golang.org/protobuf/types/known/timestamppb"

	deltagymv1 "github.com/deltagym/deltagym/clients/go/gen/deltagym/v1"
	"github.com/deltagym/deltagym/server/episode"
)

// The episode calls of EnvService: each decodes its request (episode_wire.go), calls the
// episode core, and maps the result and the error.

func (e *envService) Reset(ctx context.Context, req *connect.Request[deltagymv1.ResetRequest]) (*connect.Response[deltagymv1.ResetResponse], error) {
	r, err := e.s.core.Reset(ctx, resetRequest(req.Msg))
	if err != nil {
		return nil, e.s.toConnect(err)
	}
	trace.SpanFromContext(ctx).SetAttributes(attribute.String("deltagym.env", r.Env), attribute.String("deltagym.sandbox_id", r.SandboxID),
		attribute.String("deltagym.episode_id", r.EpisodeID), attribute.String("deltagym.checkpoint_id", r.CheckpointID),
		attribute.Bool("deltagym.task_cached", r.TaskCached))
	return connect.NewResponse(resetResponse(r)), nil
}

func (e *envService) Step(ctx context.Context, req *connect.Request[deltagymv1.StepRequest]) (*connect.Response[deltagymv1.StepResponse], error) {
	span := trace.SpanFromContext(ctx)
	span.SetAttributes(attribute.String("deltagym.sandbox_id", req.Msg.GetSandboxId()), attribute.String("deltagym.action", actionKind(req.Msg.GetAction())))
	resp, err := e.s.step(ctx, req.Msg)
	if err != nil {
		return nil, e.s.toConnect(err)
	}
	span.SetAttributes(attribute.String("deltagym.episode_id", resp.GetEpisodeId()), attribute.Int("deltagym.step_index", int(resp.GetStepIndex())),
		attribute.Bool("deltagym.terminated", resp.GetTerminated()), attribute.Bool("deltagym.truncated", resp.GetTruncated()))
	return connect.NewResponse(resp), nil
}

// step performs one Step (also for StepStream).
func (s *Server) step(ctx context.Context, m *deltagymv1.StepRequest) (*deltagymv1.StepResponse, error) {
	r, err := s.core.Step(ctx, stepRequest(m))
	if err != nil {
		return nil, err
	}
	return stepResponse(r), nil
}

// actionKind names an action's kind for traces.
func actionKind(a *deltagymv1.Action) string {
	if x := action(a); x != nil {
		return x.Kind()
	}
	return ""
}

func (e *envService) StepStream(ctx context.Context, stream *connect.BidiStream[deltagymv1.StepStreamRequest, deltagymv1.StepStreamResponse]) error {
	return e.s.stepStream(ctx, stream)
}

func (e *envService) Checkpoint(ctx context.Context, req *connect.Request[deltagymv1.CheckpointRequest]) (*connect.Response[deltagymv1.CheckpointResponse], error) {
	// An undefined mode is refused before the request waits for the sandbox.
	mode, err := processMode(req.Msg.GetProcessMode())
	if err != nil {
		return nil, e.s.toConnect(err)
	}
	r, err := e.s.core.Checkpoint(ctx, episode.CheckpointRequest{SandboxID: req.Msg.GetSandboxId(), Processes: mode, Durable: req.Msg.GetDurable(),
		WaitDigest: req.Msg.GetWaitForDigest(), Dedupe: req.Msg.GetDedupe()})
	if err != nil {
		return nil, e.s.toConnect(err)
	}
	trace.SpanFromContext(ctx).SetAttributes(attribute.String("deltagym.checkpoint_id", r.Info.ID), attribute.Bool("deltagym.deduplicated", r.Deduplicated))
	return connect.NewResponse(checkpointResponse(r, e.s.scrub)), nil
}

func (e *envService) Restore(ctx context.Context, req *connect.Request[deltagymv1.RestoreRequest]) (*connect.Response[deltagymv1.RestoreResponse], error) {
	r, err := e.s.core.Restore(ctx, episode.RestoreRequest{SandboxID: req.Msg.GetSandboxId(), CheckpointID: req.Msg.GetCheckpointId(),
		FreshEntropy: req.Msg.GetFreshEntropy()})
	if err != nil {
		return nil, e.s.toConnect(err)
	}
	return connect.NewResponse(&deltagymv1.RestoreResponse{EpisodeId: r.EpisodeID, NextStepIndex: int32(r.NextStepIndex)}), nil
}

func (e *envService) Fork(ctx context.Context, req *connect.Request[deltagymv1.ForkRequest]) (*connect.Response[deltagymv1.ForkResponse], error) {
	r, err := e.s.core.Fork(ctx, forkRequest(req.Msg))
	if err != nil {
		return nil, e.s.toConnect(err)
	}
	return connect.NewResponse(forkResponse(r, e.s.scrub)), nil
}

func (e *envService) ReleaseCheckpoint(ctx context.Context, req *connect.Request[deltagymv1.ReleaseCheckpointRequest]) (*connect.Response[deltagymv1.ReleaseCheckpointResponse], error) {
	if err := e.s.core.ReleaseCheckpoint(req.Msg.GetCheckpointId()); err != nil {
		return nil, e.s.toConnect(err)
	}
	return connect.NewResponse(&deltagymv1.ReleaseCheckpointResponse{}), nil
}

func (e *envService) Evaluate(ctx context.Context, req *connect.Request[deltagymv1.EvaluateRequest]) (*connect.Response[deltagymv1.EvaluateResponse], error) {
	v, err := e.s.core.Evaluate(ctx, req.Msg.GetSandboxId())
	if err != nil {
		return nil, e.s.toConnect(err)
	}
	return connect.NewResponse(&deltagymv1.EvaluateResponse{Reward: v.Reward, Components: v.Components, Output: v.Output,
		DurationSeconds: v.Took.Seconds()}), nil
}

func (e *envService) Close(ctx context.Context, req *connect.Request[deltagymv1.CloseRequest]) (*connect.Response[deltagymv1.CloseResponse], error) {
	if err := e.s.core.Close(ctx, req.Msg.GetSandboxId()); err != nil {
		return nil, e.s.toConnect(err)
	}
	return connect.NewResponse(&deltagymv1.CloseResponse{}), nil
}

func (e *envService) Heartbeat(ctx context.Context, req *connect.Request[deltagymv1.HeartbeatRequest]) (*connect.Response[deltagymv1.HeartbeatResponse], error) {
	// A TTL refused is refused before any lease is renewed.
	ttl := leaseTTL(req.Msg.GetLeaseTtlSeconds())
	if err := e.s.core.CheckLeaseTTL(ttl); err != nil {
		return nil, e.s.toConnect(err)
	}
	resp := &deltagymv1.HeartbeatResponse{}
	for _, id := range req.Msg.GetSandboxIds() {
		t, err := e.s.core.Renew(id, ttl)
		if err != nil {
			resp.UnknownSandboxIds = append(resp.UnknownSandboxIds, id)
			continue
		}
		resp.Leases = append(resp.Leases, &deltagymv1.Lease{SandboxId: id, ExpireTime: timestamppb.New(t)})
	}
	return connect.NewResponse(resp), nil
}

func (e *envService) ListCheckpoints(ctx context.Context, req *connect.Request[deltagymv1.ListCheckpointsRequest]) (*connect.Response[deltagymv1.ListCheckpointsResponse], error) {
	m := req.Msg
	resp := &deltagymv1.ListCheckpointsResponse{}
	f := episode.CheckpointFilter{Env: m.GetEnv(), Run: m.GetRun(), Group: m.GetGroupId(), Episode: m.GetEpisodeId()}
	for _, d := range e.s.core.Checkpoints(f) {
		resp.Checkpoints = append(resp.Checkpoints, checkpointSummaryProto(d))
	}
	return connect.NewResponse(resp), nil
}

func (e *envService) GetSandbox(ctx context.Context, req *connect.Request[deltagymv1.GetSandboxRequest]) (*connect.Response[deltagymv1.GetSandboxResponse], error) {
	d, err := e.s.core.Sandbox(req.Msg.GetSandboxId())
	if err != nil {
		return nil, e.s.toConnect(err)
	}
	return connect.NewResponse(&deltagymv1.GetSandboxResponse{Sandbox: sandboxProto(d)}), nil
}

func (e *envService) ListSandboxes(ctx context.Context, req *connect.Request[deltagymv1.ListSandboxesRequest]) (*connect.Response[deltagymv1.ListSandboxesResponse], error) {
	m := req.Msg
	resp := &deltagymv1.ListSandboxesResponse{}
	for _, d := range e.s.core.Sandboxes(episode.Filter{Env: m.GetEnv(), Run: m.GetRun(), Group: m.GetGroupId()}) {
		resp.Sandboxes = append(resp.Sandboxes, sandboxProto(d))
	}
	return connect.NewResponse(resp), nil
}

// DiffCheckpoints compares two checkpoints of one env.
func (e *envService) DiffCheckpoints(ctx context.Context, req *connect.Request[deltagymv1.DiffCheckpointsRequest]) (*connect.Response[deltagymv1.DiffCheckpointsResponse], error) {
	m := req.Msg
	span := trace.SpanFromContext(ctx)
	span.SetAttributes(attribute.String("deltagym.checkpoint_id", m.GetCheckpointId()), attribute.String("deltagym.base_checkpoint_id", m.GetBaseCheckpointId()))
	detail, err := diffDetail(m.GetDetail())
	if err != nil {
		return nil, e.s.toConnect(err)
	}
	d, err := e.s.core.DiffCheckpoints(ctx, episode.DiffRequest{Base: m.GetBaseCheckpointId(), ID: m.GetCheckpointId(), Detail: detail,
		Path: m.GetPath(), MaxPaths: int(m.GetMaxPaths())})
	if err != nil {
		return nil, e.s.toConnect(err)
	}
	span.SetAttributes(attribute.Int("deltagym.paths", len(d.Paths)), attribute.Bool("deltagym.truncated", d.Truncated))
	return connect.NewResponse(diffResponse(d)), nil
}
