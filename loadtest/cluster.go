package loadtest

import (
	"context"
	"errors"
	"fmt"
	"io"
	"maps"
	"net/http"
	"sync"

	"connectrpc.com/connect"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/known/timestamppb"

	deltagym "github.com/deltagym/deltagym/clients/go/deltagym"
	deltagymv1 "github.com/deltagym/deltagym/clients/go/gen/deltagym/v1"
	"github.com/deltagym/deltagym/clients/go/gen/deltagym/v1/deltagymv1connect"
)

// clusterEnv is the EnvService of a cluster of nodes, as the scenarios see one server's: a
// deltagym.Cluster places each Reset on the least loaded node, spreads each Fork of a checkpoint
// over the nodes, and sends every other call to the node its sandbox or checkpoint ID names.
// Errors come back as gRPC statuses with the code the node (or the Cluster, for a node that is
// unreachable) gave.
type clusterEnv struct {
	cl *deltagym.Cluster

	mu sync.Mutex
	// placed counts the sandboxes made on each node, by name: Resets and Fork children.
	// +checklocks:mu
	placed map[string]int
}

var _ deltagymv1.EnvServiceClient = (*clusterEnv)(nil)

// dialCluster dials the cluster cfg.Addr names with cfg's token and cluster options.
func dialCluster(ctx context.Context, cfg *Config) (*clusterEnv, error) {
	opts := append([]deltagym.Option{deltagym.WithToken(cfg.Token)}, cfg.ClusterOptions...)
	cl, err := deltagym.DialCluster(ctx, cfg.Addr, opts...)
	if err != nil {
		return nil, fmt.Errorf("dialing the cluster %s: %w", cfg.Addr, err)
	}
	return &clusterEnv{cl: cl, placed: map[string]int{}}, nil
}

// closeCluster closes the cluster's clients.
func (e *clusterEnv) closeCluster() error { return e.cl.Close() }

// placedOn returns how many sandboxes the run made on each node.
func (e *clusterEnv) placedOn() map[string]int {
	e.mu.Lock()
	defer e.mu.Unlock()
	return maps.Clone(e.placed)
}

func (e *clusterEnv) count(ids ...string) {
	e.mu.Lock()
	defer e.mu.Unlock()
	for _, id := range ids {
		e.placed[deltagym.NodeOf(id)]++
	}
}

// grpcError turns an error of the Go client into the gRPC status the scenarios read.
func grpcError(err error) error {
	if err == nil {
		return nil
	}
	if _, ok := status.FromError(err); ok {
		return err
	}
	return status.Error(codes.Code(connect.CodeOf(err)), err.Error())
}

// routed sends req to the node that holds id, by method m of its EnvService.
func routed[Req, Res any](ctx context.Context, e *clusterEnv, id string,
	m func(deltagymv1connect.EnvServiceClient, context.Context, *connect.Request[Req]) (*connect.Response[Res], error), req *Req,
) (*Res, error) {
	c, err := e.cl.Owner(id)
	return callOn(ctx, c, err, m, req)
}

// anyNode sends req to any node that answers: the nodes share their envs and their ledger.
func anyNode[Req, Res any](ctx context.Context, e *clusterEnv,
	m func(deltagymv1connect.EnvServiceClient, context.Context, *connect.Request[Req]) (*connect.Response[Res], error), req *Req,
) (*Res, error) {
	c, err := e.cl.Any()
	return callOn(ctx, c, err, m, req)
}

// callOn sends req by method m of c's EnvService, c the node routed or anyNode chose (err: why
// none could be).
func callOn[Req, Res any](ctx context.Context, c *deltagym.Client, err error,
	m func(deltagymv1connect.EnvServiceClient, context.Context, *connect.Request[Req]) (*connect.Response[Res], error), req *Req,
) (*Res, error) {
	if err != nil {
		return nil, grpcError(err)
	}
	res, err := m(c.EnvService(), ctx, connect.NewRequest(req))
	if err != nil {
		return nil, grpcError(err)
	}
	return res.Msg, nil
}

func episodeOpts(run, group, key string) []deltagym.EpisodeOption {
	opts := []deltagym.EpisodeOption{deltagym.WithRun(run), deltagym.WithGroup(group)}
	if key != "" {
		opts = append(opts, deltagym.WithIdempotencyKey(key))
	}
	return opts
}

func (e *clusterEnv) ListEnvs(ctx context.Context, in *deltagymv1.ListEnvsRequest, _ ...grpc.CallOption) (*deltagymv1.ListEnvsResponse, error) {
	return anyNode(ctx, e, deltagymv1connect.EnvServiceClient.ListEnvs, in)
}

// RegisterEnv is refused: every node keeps its own catalog, which a load test does not change.
func (e *clusterEnv) RegisterEnv(context.Context, *deltagymv1.RegisterEnvRequest, ...grpc.CallOption) (*deltagymv1.RegisterEnvResponse, error) {
	return nil, status.Error(codes.Unimplemented, "the load test registers no envs on a cluster: each node keeps its own catalog")
}

// ImportImage is refused as RegisterEnv is.
func (e *clusterEnv) ImportImage(context.Context, *deltagymv1.ImportImageRequest, ...grpc.CallOption) (*deltagymv1.ImportImageResponse, error) {
	return nil, status.Error(codes.Unimplemented, "the load test imports no images into a cluster: each node keeps its own")
}

// Reset places the sandbox on the least loaded node (Cluster.Reset, which goes to the next node
// when one is unreachable or full).
func (e *clusterEnv) Reset(ctx context.Context, in *deltagymv1.ResetRequest, _ ...grpc.CallOption) (*deltagymv1.ResetResponse, error) {
	opts := episodeOpts(in.GetRun(), in.GetGroupId(), in.GetIdempotencyKey())
	if in.Seed != nil {
		opts = append(opts, deltagym.WithSeed(in.GetSeed()))
	}
	for k, v := range in.GetOptions() {
		opts = append(opts, deltagym.WithTaskOption(k, v))
	}
	sb, err := e.cl.Reset(ctx, in.GetEnv(), opts...)
	if err != nil {
		return nil, grpcError(err)
	}
	e.count(sb.ID())
	return &deltagymv1.ResetResponse{SandboxId: sb.ID(), EpisodeId: sb.EpisodeID()}, nil
}

func (e *clusterEnv) Step(ctx context.Context, in *deltagymv1.StepRequest, _ ...grpc.CallOption) (*deltagymv1.StepResponse, error) {
	return routed(ctx, e, in.GetSandboxId(), deltagymv1connect.EnvServiceClient.Step, in)
}

// StepStream opens, on the first step sent, a StepStream to the node of that step's sandbox:
// every later step on it must be on a sandbox of that node (the scenarios keep one sandbox
// per stream).
func (e *clusterEnv) StepStream(ctx context.Context, _ ...grpc.CallOption) (grpc.BidiStreamingClient[deltagymv1.StepStreamRequest, deltagymv1.StepStreamResponse], error) {
	return &clusterStream{ctx: ctx, e: e}, nil
}

// StreamStep is refused: no scenario streams a step's output.
func (e *clusterEnv) StreamStep(ctx context.Context, in *deltagymv1.StreamStepRequest, _ ...grpc.CallOption) (grpc.ServerStreamingClient[deltagymv1.StreamStepResponse], error) {
	return nil, status.Error(codes.Unimplemented, "the load test's cluster client does not stream a step's output")
}

func (e *clusterEnv) Checkpoint(ctx context.Context, in *deltagymv1.CheckpointRequest, _ ...grpc.CallOption) (*deltagymv1.CheckpointResponse, error) {
	return routed(ctx, e, in.GetSandboxId(), deltagymv1connect.EnvServiceClient.Checkpoint, in)
}

func (e *clusterEnv) Restore(ctx context.Context, in *deltagymv1.RestoreRequest, _ ...grpc.CallOption) (*deltagymv1.RestoreResponse, error) {
	return routed(ctx, e, in.GetSandboxId(), deltagymv1connect.EnvServiceClient.Restore, in)
}

// Fork of a checkpoint spreads its children over the nodes by load (Cluster.Fork); a fork of a
// sandbox goes to the sandbox's node.
func (e *clusterEnv) Fork(ctx context.Context, in *deltagymv1.ForkRequest, _ ...grpc.CallOption) (*deltagymv1.ForkResponse, error) {
	ck := in.GetCheckpointId()
	if ck == "" {
		res, err := routed(ctx, e, in.GetSandboxId(), deltagymv1connect.EnvServiceClient.Fork, in)
		if err == nil {
			e.count(res.GetSandboxIds()...)
		}
		return res, err
	}
	opts := episodeOpts(in.GetRun(), in.GetGroupId(), in.GetIdempotencyKey())
	if in.GetFreshEntropy() {
		opts = append(opts, deltagym.WithFreshEntropy())
	}
	fr, err := e.cl.Fork(ctx, ck, int(in.GetN()), opts...)
	if fr != nil {
		for _, sb := range fr.Sandboxes {
			e.count(sb.ID())
		}
	}
	if err != nil {
		if fr != nil {
			// The children of the parts that succeeded are the caller's no longer: close them.
			for _, sb := range fr.Sandboxes {
				_ = sb.Close(context.WithoutCancel(ctx))
			}
		}
		return nil, grpcError(err)
	}
	res := &deltagymv1.ForkResponse{CheckpointId: fr.CheckpointID}
	for _, sb := range fr.Sandboxes {
		res.SandboxIds = append(res.SandboxIds, sb.ID())
		res.EpisodeIds = append(res.EpisodeIds, sb.EpisodeID())
	}
	return res, nil
}

func (e *clusterEnv) ReleaseCheckpoint(ctx context.Context, in *deltagymv1.ReleaseCheckpointRequest, _ ...grpc.CallOption) (*deltagymv1.ReleaseCheckpointResponse, error) {
	return routed(ctx, e, in.GetCheckpointId(), deltagymv1connect.EnvServiceClient.ReleaseCheckpoint, in)
}

// DiffCheckpoints goes to the node of checkpoint_id, which fetches the base when it is another's.
func (e *clusterEnv) DiffCheckpoints(ctx context.Context, in *deltagymv1.DiffCheckpointsRequest, _ ...grpc.CallOption) (*deltagymv1.DiffCheckpointsResponse, error) {
	return routed(ctx, e, in.GetCheckpointId(), deltagymv1connect.EnvServiceClient.DiffCheckpoints, in)
}

func (e *clusterEnv) Evaluate(ctx context.Context, in *deltagymv1.EvaluateRequest, _ ...grpc.CallOption) (*deltagymv1.EvaluateResponse, error) {
	return routed(ctx, e, in.GetSandboxId(), deltagymv1connect.EnvServiceClient.Evaluate, in)
}

func (e *clusterEnv) Close(ctx context.Context, in *deltagymv1.CloseRequest, _ ...grpc.CallOption) (*deltagymv1.CloseResponse, error) {
	return routed(ctx, e, in.GetSandboxId(), deltagymv1connect.EnvServiceClient.Close, in)
}

// Heartbeat splits the IDs by node (Cluster.Heartbeat).
func (e *clusterEnv) Heartbeat(ctx context.Context, in *deltagymv1.HeartbeatRequest, _ ...grpc.CallOption) (*deltagymv1.HeartbeatResponse, error) {
	hb, err := e.cl.Heartbeat(ctx, in.GetSandboxIds()...)
	if err != nil {
		return nil, grpcError(err)
	}
	res := &deltagymv1.HeartbeatResponse{UnknownSandboxIds: hb.Unknown}
	for id, exp := range hb.Leases {
		res.Leases = append(res.Leases, &deltagymv1.Lease{SandboxId: id, ExpireTime: timestamppb.New(exp)})
	}
	return res, nil
}

func (e *clusterEnv) GetSandbox(ctx context.Context, in *deltagymv1.GetSandboxRequest, _ ...grpc.CallOption) (*deltagymv1.GetSandboxResponse, error) {
	return routed(ctx, e, in.GetSandboxId(), deltagymv1connect.EnvServiceClient.GetSandbox, in)
}

// ListSandboxes asks every node and merges their answers, unfiltered by page.
func (e *clusterEnv) ListSandboxes(ctx context.Context, in *deltagymv1.ListSandboxesRequest, _ ...grpc.CallOption) (*deltagymv1.ListSandboxesResponse, error) {
	sbs, err := e.cl.ListSandboxes(ctx, deltagym.SandboxFilter{Env: in.GetEnv(), Run: in.GetRun()})
	if err != nil {
		return nil, grpcError(err)
	}
	return &deltagymv1.ListSandboxesResponse{Sandboxes: sbs}, nil
}

// ListCheckpoints asks every node and merges their answers.
func (e *clusterEnv) ListCheckpoints(ctx context.Context, in *deltagymv1.ListCheckpointsRequest, _ ...grpc.CallOption) (*deltagymv1.ListCheckpointsResponse, error) {
	cks, err := e.cl.ListCheckpoints(ctx, deltagym.CheckpointFilter{})
	if err != nil {
		return nil, grpcError(err)
	}
	return &deltagymv1.ListCheckpointsResponse{Checkpoints: cks}, nil
}

// clusterStream is a StepStream to the node of the sandbox of its first step, opened then.
type clusterStream struct {
	ctx context.Context
	e   *clusterEnv
	st  *connect.BidiStreamForClient[deltagymv1.StepStreamRequest, deltagymv1.StepStreamResponse]
}

var errNoStep = errors.New("no step was sent on the stream: it has no node yet")

func (s *clusterStream) Send(m *deltagymv1.StepStreamRequest) error {
	if s.st == nil {
		c, err := s.e.cl.Owner(m.GetStep().GetSandboxId())
		if err != nil {
			return grpcError(err)
		}
		s.st = c.EnvService().StepStream(s.ctx)
	}
	return grpcError(s.st.Send(m))
}

func (s *clusterStream) Recv() (*deltagymv1.StepStreamResponse, error) {
	if s.st == nil {
		return nil, status.Error(codes.FailedPrecondition, errNoStep.Error())
	}
	m, err := s.st.Receive()
	if errors.Is(err, io.EOF) {
		return nil, io.EOF
	}
	return m, grpcError(err)
}

func (s *clusterStream) Header() (metadata.MD, error) {
	if s.st == nil {
		return nil, status.Error(codes.FailedPrecondition, errNoStep.Error())
	}
	return headerMD(s.st.ResponseHeader()), nil
}

func (s *clusterStream) Trailer() metadata.MD {
	if s.st == nil {
		return nil
	}
	return headerMD(s.st.ResponseTrailer())
}

// CloseSend ends the stream's requests and waits for the node to end its answers.
func (s *clusterStream) CloseSend() error {
	if s.st == nil {
		return nil
	}
	return grpcError(errors.Join(s.st.CloseRequest(), s.st.CloseResponse()))
}

func (s *clusterStream) Context() context.Context { return s.ctx }

func (s *clusterStream) SendMsg(m any) error {
	req, ok := m.(*deltagymv1.StepStreamRequest)
	if !ok {
		return status.Errorf(codes.Internal, "a StepStream sends StepStreamRequest, not %T", m)
	}
	return s.Send(req)
}

func (s *clusterStream) RecvMsg(m any) error {
	dst, ok := m.(*deltagymv1.StepStreamResponse)
	if !ok {
		return status.Errorf(codes.Internal, "a StepStream receives StepStreamResponse, not %T", m)
	}
	got, err := s.Recv()
	if err != nil {
		return err
	}
	proto.Reset(dst)
	proto.Merge(dst, got)
	return nil
}

func headerMD(h http.Header) metadata.MD {
	md := metadata.MD{}
	for k, v := range h {
		md.Append(k, v...)
	}
	return md
}
