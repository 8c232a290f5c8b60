package server_test

import (
	"context"

	"connectrpc.com/connect"
	"google.golang.org/grpc"

	deltagymv1 "github.com/deltagym/deltagym/clients/go/gen/deltagym/v1"
	"github.com/deltagym/deltagym/clients/go/gen/deltagym/v1/deltagymv1connect"
)

// api is the unary part of both services, as one test body drives it over Connect or gRPC.
type api interface {
	ListEnvs(context.Context, *deltagymv1.ListEnvsRequest) (*deltagymv1.ListEnvsResponse, error)
	RegisterEnv(context.Context, *deltagymv1.RegisterEnvRequest) (*deltagymv1.RegisterEnvResponse, error)
	ImportImage(context.Context, *deltagymv1.ImportImageRequest) (*deltagymv1.ImportImageResponse, error)
	Reset(context.Context, *deltagymv1.ResetRequest) (*deltagymv1.ResetResponse, error)
	Step(context.Context, *deltagymv1.StepRequest) (*deltagymv1.StepResponse, error)
	Checkpoint(context.Context, *deltagymv1.CheckpointRequest) (*deltagymv1.CheckpointResponse, error)
	Restore(context.Context, *deltagymv1.RestoreRequest) (*deltagymv1.RestoreResponse, error)
	Fork(context.Context, *deltagymv1.ForkRequest) (*deltagymv1.ForkResponse, error)
	ReleaseCheckpoint(context.Context, *deltagymv1.ReleaseCheckpointRequest) (*deltagymv1.ReleaseCheckpointResponse, error)
	Evaluate(context.Context, *deltagymv1.EvaluateRequest) (*deltagymv1.EvaluateResponse, error)
	Close(context.Context, *deltagymv1.CloseRequest) (*deltagymv1.CloseResponse, error)
	Heartbeat(context.Context, *deltagymv1.HeartbeatRequest) (*deltagymv1.HeartbeatResponse, error)
	GetSandbox(context.Context, *deltagymv1.GetSandboxRequest) (*deltagymv1.GetSandboxResponse, error)
	ListSandboxes(context.Context, *deltagymv1.ListSandboxesRequest) (*deltagymv1.ListSandboxesResponse, error)
	ListCheckpoints(context.Context, *deltagymv1.ListCheckpointsRequest) (*deltagymv1.ListCheckpointsResponse, error)
	DiffCheckpoints(context.Context, *deltagymv1.DiffCheckpointsRequest) (*deltagymv1.DiffCheckpointsResponse, error)
	ListEpisodes(context.Context, *deltagymv1.ListEpisodesRequest) (*deltagymv1.ListEpisodesResponse, error)
	GetTrajectory(context.Context, *deltagymv1.GetTrajectoryRequest) (*deltagymv1.GetTrajectoryResponse, error)
	GetCheckpointTree(context.Context, *deltagymv1.GetCheckpointTreeRequest) (*deltagymv1.GetCheckpointTreeResponse, error)
	GetGroupAdvantages(context.Context, *deltagymv1.GetGroupAdvantagesRequest) (*deltagymv1.GetGroupAdvantagesResponse, error)
	ReportReward(context.Context, *deltagymv1.ReportRewardRequest) (*deltagymv1.ReportRewardResponse, error)
}

func call[Req, Res any](f func(context.Context, *connect.Request[Req]) (*connect.Response[Res], error), ctx context.Context, r *Req) (*Res, error) {
	resp, err := f(ctx, connect.NewRequest(r))
	if err != nil {
		return nil, err
	}
	return resp.Msg, nil
}

type connectAPI struct {
	e deltagymv1connect.EnvServiceClient
	l deltagymv1connect.LedgerServiceClient
}

func (c connectAPI) ListEnvs(ctx context.Context, r *deltagymv1.ListEnvsRequest) (*deltagymv1.ListEnvsResponse, error) {
	return call(c.e.ListEnvs, ctx, r)
}
func (c connectAPI) RegisterEnv(ctx context.Context, r *deltagymv1.RegisterEnvRequest) (*deltagymv1.RegisterEnvResponse, error) {
	return call(c.e.RegisterEnv, ctx, r)
}
func (c connectAPI) ImportImage(ctx context.Context, r *deltagymv1.ImportImageRequest) (*deltagymv1.ImportImageResponse, error) {
	return call(c.e.ImportImage, ctx, r)
}
func (c connectAPI) Reset(ctx context.Context, r *deltagymv1.ResetRequest) (*deltagymv1.ResetResponse, error) {
	return call(c.e.Reset, ctx, r)
}
func (c connectAPI) Step(ctx context.Context, r *deltagymv1.StepRequest) (*deltagymv1.StepResponse, error) {
	return call(c.e.Step, ctx, r)
}
func (c connectAPI) Checkpoint(ctx context.Context, r *deltagymv1.CheckpointRequest) (*deltagymv1.CheckpointResponse, error) {
	return call(c.e.Checkpoint, ctx, r)
}
func (c connectAPI) Restore(ctx context.Context, r *deltagymv1.RestoreRequest) (*deltagymv1.RestoreResponse, error) {
	return call(c.e.Restore, ctx, r)
}
func (c connectAPI) Fork(ctx context.Context, r *deltagymv1.ForkRequest) (*deltagymv1.ForkResponse, error) {
	return call(c.e.Fork, ctx, r)
}
func (c connectAPI) DiffCheckpoints(ctx context.Context, r *deltagymv1.DiffCheckpointsRequest) (*deltagymv1.DiffCheckpointsResponse, error) {
	return call(c.e.DiffCheckpoints, ctx, r)
}
func (c connectAPI) ReleaseCheckpoint(ctx context.Context, r *deltagymv1.ReleaseCheckpointRequest) (*deltagymv1.ReleaseCheckpointResponse, error) {
	return call(c.e.ReleaseCheckpoint, ctx, r)
}
func (c connectAPI) Evaluate(ctx context.Context, r *deltagymv1.EvaluateRequest) (*deltagymv1.EvaluateResponse, error) {
	return call(c.e.Evaluate, ctx, r)
}
func (c connectAPI) Close(ctx context.Context, r *deltagymv1.CloseRequest) (*deltagymv1.CloseResponse, error) {
	return call(c.e.Close, ctx, r)
}
func (c connectAPI) Heartbeat(ctx context.Context, r *deltagymv1.HeartbeatRequest) (*deltagymv1.HeartbeatResponse, error) {
	return call(c.e.Heartbeat, ctx, r)
}
func (c connectAPI) GetSandbox(ctx context.Context, r *deltagymv1.GetSandboxRequest) (*deltagymv1.GetSandboxResponse, error) {
	return call(c.e.GetSandbox, ctx, r)
}
func (c connectAPI) ListSandboxes(ctx context.Context, r *deltagymv1.ListSandboxesRequest) (*deltagymv1.ListSandboxesResponse, error) {
	return call(c.e.ListSandboxes, ctx, r)
}

func (c connectAPI) ListCheckpoints(ctx context.Context, r *deltagymv1.ListCheckpointsRequest) (*deltagymv1.ListCheckpointsResponse, error) {
	return call(c.e.ListCheckpoints, ctx, r)
}
func (c connectAPI) ListEpisodes(ctx context.Context, r *deltagymv1.ListEpisodesRequest) (*deltagymv1.ListEpisodesResponse, error) {
	return call(c.l.ListEpisodes, ctx, r)
}
func (c connectAPI) GetTrajectory(ctx context.Context, r *deltagymv1.GetTrajectoryRequest) (*deltagymv1.GetTrajectoryResponse, error) {
	return call(c.l.GetTrajectory, ctx, r)
}
func (c connectAPI) GetCheckpointTree(ctx context.Context, r *deltagymv1.GetCheckpointTreeRequest) (*deltagymv1.GetCheckpointTreeResponse, error) {
	return call(c.l.GetCheckpointTree, ctx, r)
}
func (c connectAPI) GetGroupAdvantages(ctx context.Context, r *deltagymv1.GetGroupAdvantagesRequest) (*deltagymv1.GetGroupAdvantagesResponse, error) {
	return call(c.l.GetGroupAdvantages, ctx, r)
}
func (c connectAPI) ReportReward(ctx context.Context, r *deltagymv1.ReportRewardRequest) (*deltagymv1.ReportRewardResponse, error) {
	return call(c.l.ReportReward, ctx, r)
}

// grpcAPI adapts the grpc-go clients (whose methods take call options) to api.
type grpcAPI struct {
	deltagymv1.EnvServiceClient
	l deltagymv1.LedgerServiceClient
}

func g[Req, Res any](f func(context.Context, *Req, ...grpc.CallOption) (*Res, error), ctx context.Context, r *Req) (*Res, error) {
	return f(ctx, r)
}

func (c grpcAPI) ListEnvs(ctx context.Context, r *deltagymv1.ListEnvsRequest) (*deltagymv1.ListEnvsResponse, error) {
	return g(c.EnvServiceClient.ListEnvs, ctx, r)
}
func (c grpcAPI) RegisterEnv(ctx context.Context, r *deltagymv1.RegisterEnvRequest) (*deltagymv1.RegisterEnvResponse, error) {
	return g(c.EnvServiceClient.RegisterEnv, ctx, r)
}
func (c grpcAPI) ImportImage(ctx context.Context, r *deltagymv1.ImportImageRequest) (*deltagymv1.ImportImageResponse, error) {
	return g(c.EnvServiceClient.ImportImage, ctx, r)
}
func (c grpcAPI) Reset(ctx context.Context, r *deltagymv1.ResetRequest) (*deltagymv1.ResetResponse, error) {
	return g(c.EnvServiceClient.Reset, ctx, r)
}
func (c grpcAPI) Step(ctx context.Context, r *deltagymv1.StepRequest) (*deltagymv1.StepResponse, error) {
	return g(c.EnvServiceClient.Step, ctx, r)
}
func (c grpcAPI) Checkpoint(ctx context.Context, r *deltagymv1.CheckpointRequest) (*deltagymv1.CheckpointResponse, error) {
	return g(c.EnvServiceClient.Checkpoint, ctx, r)
}
func (c grpcAPI) Restore(ctx context.Context, r *deltagymv1.RestoreRequest) (*deltagymv1.RestoreResponse, error) {
	return g(c.EnvServiceClient.Restore, ctx, r)
}
func (c grpcAPI) Fork(ctx context.Context, r *deltagymv1.ForkRequest) (*deltagymv1.ForkResponse, error) {
	return g(c.EnvServiceClient.Fork, ctx, r)
}
func (c grpcAPI) DiffCheckpoints(ctx context.Context, r *deltagymv1.DiffCheckpointsRequest) (*deltagymv1.DiffCheckpointsResponse, error) {
	return g(c.EnvServiceClient.DiffCheckpoints, ctx, r)
}
func (c grpcAPI) ReleaseCheckpoint(ctx context.Context, r *deltagymv1.ReleaseCheckpointRequest) (*deltagymv1.ReleaseCheckpointResponse, error) {
	return g(c.EnvServiceClient.ReleaseCheckpoint, ctx, r)
}
func (c grpcAPI) Evaluate(ctx context.Context, r *deltagymv1.EvaluateRequest) (*deltagymv1.EvaluateResponse, error) {
	return g(c.EnvServiceClient.Evaluate, ctx, r)
}
func (c grpcAPI) Close(ctx context.Context, r *deltagymv1.CloseRequest) (*deltagymv1.CloseResponse, error) {
	return g(c.EnvServiceClient.Close, ctx, r)
}
func (c grpcAPI) Heartbeat(ctx context.Context, r *deltagymv1.HeartbeatRequest) (*deltagymv1.HeartbeatResponse, error) {
	return g(c.EnvServiceClient.Heartbeat, ctx, r)
}
func (c grpcAPI) GetSandbox(ctx context.Context, r *deltagymv1.GetSandboxRequest) (*deltagymv1.GetSandboxResponse, error) {
	return g(c.EnvServiceClient.GetSandbox, ctx, r)
}
func (c grpcAPI) ListSandboxes(ctx context.Context, r *deltagymv1.ListSandboxesRequest) (*deltagymv1.ListSandboxesResponse, error) {
	return g(c.EnvServiceClient.ListSandboxes, ctx, r)
}

func (c grpcAPI) ListCheckpoints(ctx context.Context, r *deltagymv1.ListCheckpointsRequest) (*deltagymv1.ListCheckpointsResponse, error) {
	return g(c.EnvServiceClient.ListCheckpoints, ctx, r)
}
func (c grpcAPI) ListEpisodes(ctx context.Context, r *deltagymv1.ListEpisodesRequest) (*deltagymv1.ListEpisodesResponse, error) {
	return g(c.l.ListEpisodes, ctx, r)
}
func (c grpcAPI) GetTrajectory(ctx context.Context, r *deltagymv1.GetTrajectoryRequest) (*deltagymv1.GetTrajectoryResponse, error) {
	return g(c.l.GetTrajectory, ctx, r)
}
func (c grpcAPI) GetCheckpointTree(ctx context.Context, r *deltagymv1.GetCheckpointTreeRequest) (*deltagymv1.GetCheckpointTreeResponse, error) {
	return g(c.l.GetCheckpointTree, ctx, r)
}
func (c grpcAPI) GetGroupAdvantages(ctx context.Context, r *deltagymv1.GetGroupAdvantagesRequest) (*deltagymv1.GetGroupAdvantagesResponse, error) {
	return g(c.l.GetGroupAdvantages, ctx, r)
}
func (c grpcAPI) ReportReward(ctx context.Context, r *deltagymv1.ReportRewardRequest) (*deltagymv1.ReportRewardResponse, error) {
	return g(c.l.ReportReward, ctx, r)
}

// clients returns both API clients of b, by name.
func (b *bundle) clients() []struct {
	name string
	c    api
} {
	return []struct {
		name string
		c    api
	}{{"connect", connectAPI{b.connect, b.ledger}}, {"grpc", grpcAPI{b.grpc, b.gledger}}}
}
