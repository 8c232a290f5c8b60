package server

import (
	"context"
	"encoding/json"
	"fmt"
	"math"
	"time"

	"connectrpc.com/connect"
	"google.golang.org/protobuf/encoding/protojson"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/known/timestamppb"

	deltagymv1 "github.com/deltagym/deltagym/clients/go/gen/deltagym/v1"
	"github.com/deltagym/deltagym/clients/go/gen/deltagym/v1/deltagymv1connect"
	"github.com/deltagym/deltagym/server/episode"
	"github.com/deltagym/deltagym/server/ledger"
)

type ledgerService struct{ s *Server }

var _ deltagymv1connect.LedgerServiceHandler = (*ledgerService)(nil)

func (g *ledgerService) store() (*ledger.Store, error) {
	if g.s.store == nil {
		return nil, fmt.Errorf("start the server without --no-ledger: %w", ErrNoLedger)
	}
	return g.s.store, nil
}

var episodeStatus = map[ledger.Status]deltagymv1.EpisodeStatus{
	ledger.StatusRunning: deltagymv1.EpisodeStatus_EPISODE_STATUS_RUNNING, ledger.StatusTerminated: deltagymv1.EpisodeStatus_EPISODE_STATUS_TERMINATED,
	ledger.StatusTruncated: deltagymv1.EpisodeStatus_EPISODE_STATUS_TRUNCATED, ledger.StatusBranched: deltagymv1.EpisodeStatus_EPISODE_STATUS_BRANCHED,
	ledger.StatusFailed: deltagymv1.EpisodeStatus_EPISODE_STATUS_FAILED,
}

var failureClass = map[ledger.FailureClass]deltagymv1.FailureClass{
	ledger.FailureInfra: deltagymv1.FailureClass_FAILURE_CLASS_INFRA, ledger.FailureAgent: deltagymv1.FailureClass_FAILURE_CLASS_AGENT,
	ledger.FailureVerifier: deltagymv1.FailureClass_FAILURE_CLASS_VERIFIER,
}

var checkpointKind = map[ledger.CheckpointKind]deltagymv1.CheckpointKind{
	ledger.KindUser: deltagymv1.CheckpointKind_CHECKPOINT_KIND_USER, ledger.KindPool: deltagymv1.CheckpointKind_CHECKPOINT_KIND_POOL,
	ledger.KindTask: deltagymv1.CheckpointKind_CHECKPOINT_KIND_TASK, ledger.KindEvaluate: deltagymv1.CheckpointKind_CHECKPOINT_KIND_EVALUATE,
}

func episodeProto(e ledger.Episode) *deltagymv1.Episode {
	p := &deltagymv1.Episode{EpisodeId: e.ID, Env: e.Env, Run: e.Run, GroupId: e.Group, StartCheckpointId: e.StartCheckpoint,
		ParentEpisodeId: e.ParentEpisode, Status: episodeStatus[e.Status], FailureClass: failureClass[e.FailureClass],
		FailureMessage: e.FailureMessage, StartTime: timestamppb.New(e.StartedAt), StepCount: int32(e.Steps)}
	if e.Seed != 0 {
		seed := e.Seed
		p.Seed = &seed
	}
	if e.TotalReward != nil {
		p.TotalReward = *e.TotalReward
	}
	if e.EndedAt != nil {
		p.EndTime = timestamppb.New(*e.EndedAt)
	}
	return p
}

func rewardsProto(rs []ledger.RewardRow) []*deltagymv1.ReportedReward {
	var out []*deltagymv1.ReportedReward
	for _, r := range rs {
		if r.Source == ledger.SourceVerifier || r.Source == "evaluate" {
			continue
		}
		name := ""
		for k := range r.Components {
			name = k
		}
		out = append(out, &deltagymv1.ReportedReward{Name: name, Value: r.Value, Source: r.Source, ReportTime: timestamppb.New(r.CreatedAt)})
	}
	return out
}

func (g *ledgerService) ListEpisodes(ctx context.Context, req *connect.Request[deltagymv1.ListEpisodesRequest]) (*connect.Response[deltagymv1.ListEpisodesResponse], error) {
	st, err := g.store()
	if err != nil {
		return nil, g.s.toConnect(err)
	}
	m := req.Msg
	eps, next, err := st.ListEpisodes(ctx, ledger.EpisodeFilter{Run: m.GetRun(), Group: m.GetGroupId(), Env: m.GetEnv(),
		PageSize: int(m.GetPageSize()), PageToken: m.GetPageToken()})
	if err != nil {
		return nil, g.s.toConnect(err)
	}
	ids := make([]string, len(eps))
	for i, e := range eps {
		ids[i] = e.ID
	}
	rewards, err := st.EpisodeRewards(ctx, ids)
	if err != nil {
		return nil, g.s.toConnect(err)
	}
	resp := &deltagymv1.ListEpisodesResponse{NextPageToken: next}
	for _, e := range eps {
		ep := episodeProto(e)
		ep.Rewards = rewardsProto(rewards[e.ID])
		resp.Episodes = append(resp.Episodes, ep)
	}
	return connect.NewResponse(resp), nil
}

func (g *ledgerService) GetTrajectory(ctx context.Context, req *connect.Request[deltagymv1.GetTrajectoryRequest]) (*connect.Response[deltagymv1.GetTrajectoryResponse], error) {
	st, err := g.store()
	if err != nil {
		return nil, g.s.toConnect(err)
	}
	if req.Msg.GetEpisodeId() == "" {
		return nil, g.s.toConnect(fmt.Errorf("episode_id is required: %w", ErrInvalid))
	}
	tr, err := st.Trajectory(ctx, req.Msg.GetEpisodeId())
	if err != nil {
		return nil, g.s.toConnect(err)
	}
	ep := episodeProto(tr.Episode)
	ep.Rewards = rewardsProto(tr.Rewards)
	resp := &deltagymv1.GetTrajectoryResponse{Episode: ep}
	for i, s := range tr.Steps {
		ts := &deltagymv1.TrajectoryStep{StepIndex: int32(i), EpisodeId: s.EpisodeID, Inherited: s.Inherited,
			ObservationSizeBytes: s.ObservationSize, ObservationSha256: fmt.Sprintf("%x", s.ObservationSHA256), Reward: s.Reward,
			Terminated: s.Terminated, Truncated: s.Truncated, StartTime: timestamppb.New(s.StartedAt),
			DurationSeconds: s.Duration.Seconds(), CheckpointId: s.CheckpointID, Setup: s.Setup}
		if len(s.Action) > 0 && string(s.Action) != "null" {
			a := &deltagymv1.Action{}
			if (protojson.UnmarshalOptions{DiscardUnknown: true}).Unmarshal(s.Action, a) == nil {
				ts.Action = a
			}
			var rec struct {
				Cut *episode.ActionCut `json:"cut"`
			}
			if json.Unmarshal(s.Action, &rec) == nil && rec.Cut != nil {
				ts.ActionBulkSizeBytes, ts.ActionBulkSha256 = rec.Cut.SizeBytes, rec.Cut.SHA256
			}
		}
		o := &deltagymv1.Observation{}
		if proto.Unmarshal(s.Observation, o) == nil { // a capped observation may not decode
			ts.Observation = o
		}
		resp.Steps = append(resp.Steps, ts)
	}
	return connect.NewResponse(resp), nil
}

func (g *ledgerService) GetCheckpointTree(ctx context.Context, req *connect.Request[deltagymv1.GetCheckpointTreeRequest]) (*connect.Response[deltagymv1.GetCheckpointTreeResponse], error) {
	st, err := g.store()
	if err != nil {
		return nil, g.s.toConnect(err)
	}
	// The graph's order: parents before children (Store.CheckpointGraph).
	nodes, err := st.CheckpointGraph(ctx, req.Msg.GetRun(), req.Msg.GetEpisodeId())
	if err != nil {
		return nil, g.s.toConnect(err)
	}
	resp := &deltagymv1.GetCheckpointTreeResponse{Nodes: make([]*deltagymv1.CheckpointNode, 0, len(nodes))}
	for _, n := range nodes {
		node := &deltagymv1.CheckpointNode{CheckpointId: n.ID, ParentId: n.ParentID, Kind: checkpointKind[n.Kind],
			SandboxId: n.Sandbox, EpisodeId: n.EpisodeID, StepIndex: int32(n.StepIndex), CreateTime: timestamppb.New(n.CreatedAt),
			Released: n.ReleasedAt != nil, ParentIds: n.ParentIDs}
		if n.Digest.Files != "" {
			node.Digest = &deltagymv1.StateDigest{Files: n.Digest.Files, Processes: n.Digest.Processes}
		}
		resp.Nodes = append(resp.Nodes, node)
	}
	return connect.NewResponse(resp), nil
}

func (g *ledgerService) GetGroupAdvantages(ctx context.Context, req *connect.Request[deltagymv1.GetGroupAdvantagesRequest]) (*connect.Response[deltagymv1.GetGroupAdvantagesResponse], error) {
	st, err := g.store()
	if err != nil {
		return nil, g.s.toConnect(err)
	}
	a, err := st.Advantages(ctx, req.Msg.GetGroupId(), req.Msg.GetRewardSource())
	if err != nil {
		return nil, g.s.toConnect(err)
	}
	resp := &deltagymv1.GetGroupAdvantagesResponse{Mean: a.Mean, Std: a.Std, CountedCount: int32(len(a.Counted))}
	for _, c := range a.Counted {
		resp.Advantages = append(resp.Advantages, &deltagymv1.GroupAdvantage{EpisodeId: c.EpisodeID, Reward: c.Reward, Advantage: c.Advantage, Counted: true})
	}
	for _, x := range a.Excluded {
		resp.Advantages = append(resp.Advantages, &deltagymv1.GroupAdvantage{EpisodeId: x.EpisodeID, Reason: x.Reason})
	}
	return connect.NewResponse(resp), nil
}

func (g *ledgerService) ReportReward(ctx context.Context, req *connect.Request[deltagymv1.ReportRewardRequest]) (*connect.Response[deltagymv1.ReportRewardResponse], error) {
	st, err := g.store()
	if err != nil {
		return nil, g.s.toConnect(err)
	}
	m := req.Msg
	if m.GetEpisodeId() == "" || m.GetName() == "" {
		return nil, g.s.toConnect(fmt.Errorf("report_reward needs an episode_id and a name: %w", ErrInvalid))
	}
	if v := m.GetValue(); math.IsNaN(v) || math.IsInf(v, 0) {
		return nil, g.s.toConnect(fmt.Errorf("report_reward value %v is not a finite number: %w", v, ErrInvalid))
	}
	src := m.GetSource()
	if src == "" {
		src = ledger.SourceTrainer
	}
	if err := st.ReportReward(ctx, ledger.RewardRow{EpisodeID: m.GetEpisodeId(), Source: src,
		Components: map[string]float64{m.GetName(): m.GetValue()}, Value: m.GetValue(), CreatedAt: time.Now()}); err != nil {
		return nil, g.s.toConnect(err)
	}
	return connect.NewResponse(&deltagymv1.ReportRewardResponse{}), nil
}
