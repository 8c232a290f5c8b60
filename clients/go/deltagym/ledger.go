package deltagym

import (
	"context"
	"fmt"
	"iter"

	"connectrpc.com/connect"

	deltagymv1 "github.com/deltagym/deltagym/clients/go/gen/deltagym/v1"
)

// EpisodeFilter selects episodes in ListEpisodes; empty fields match all.
type EpisodeFilter struct {
	Run, Group, Env string
	// PageSize is the most episodes per page (zero means the server's
	// default, 100).
	PageSize int
	// PageToken continues a listing from the page that returned it.
	PageToken string
}

// ListEpisodes returns one page of recorded episodes and the token of the
// next page ("" on the last).
func (c *Client) ListEpisodes(ctx context.Context, f EpisodeFilter) ([]*deltagymv1.Episode, string, error) {
	if err := c.checkOpen(); err != nil {
		return nil, "", err
	}
	res, err := c.ledger.ListEpisodes(ctx, connect.NewRequest(&deltagymv1.ListEpisodesRequest{
		Run: f.Run, GroupId: f.Group, Env: f.Env, PageSize: int32(min(max(f.PageSize, 0), 1<<20)), PageToken: f.PageToken,
	}))
	if err != nil {
		return nil, "", fmt.Errorf("listing episodes: %w", err)
	}
	return res.Msg.GetEpisodes(), res.Msg.GetNextPageToken(), nil
}

// Episodes iterates over every episode matching f, page after page. The
// iteration stops at the first error, which it yields.
func (c *Client) Episodes(ctx context.Context, f EpisodeFilter) iter.Seq2[*deltagymv1.Episode, error] {
	return func(yield func(*deltagymv1.Episode, error) bool) {
		for {
			page, next, err := c.ListEpisodes(ctx, f)
			if err != nil {
				yield(nil, err)
				return
			}
			for _, e := range page {
				if !yield(e, nil) {
					return
				}
			}
			if next == "" {
				return
			}
			f.PageToken = next
		}
	}
}

// Trajectory returns an episode and its steps from its Reset, inherited steps
// (taken in ancestor episodes) first.
func (c *Client) Trajectory(ctx context.Context, episodeID string) (*deltagymv1.GetTrajectoryResponse, error) {
	if err := c.checkOpen(); err != nil {
		return nil, err
	}
	res, err := c.ledger.GetTrajectory(ctx, connect.NewRequest(&deltagymv1.GetTrajectoryRequest{EpisodeId: episodeID}))
	if err != nil {
		return nil, fmt.Errorf("trajectory of episode %s: %w", episodeID, err)
	}
	return res.Msg, nil
}

// RunCheckpointTree returns the checkpoints of a run's episodes with their
// ancestors, parents before children.
func (c *Client) RunCheckpointTree(ctx context.Context, run string) ([]*deltagymv1.CheckpointNode, error) {
	return c.checkpointTree(ctx, &deltagymv1.GetCheckpointTreeRequest{Scope: &deltagymv1.GetCheckpointTreeRequest_Run{Run: run}}, "run "+run)
}

// EpisodeCheckpointTree returns the checkpoints of an episode's lineage,
// parents before children.
func (c *Client) EpisodeCheckpointTree(ctx context.Context, episodeID string) ([]*deltagymv1.CheckpointNode, error) {
	return c.checkpointTree(ctx, &deltagymv1.GetCheckpointTreeRequest{Scope: &deltagymv1.GetCheckpointTreeRequest_EpisodeId{EpisodeId: episodeID}}, "episode "+episodeID)
}

func (c *Client) checkpointTree(ctx context.Context, req *deltagymv1.GetCheckpointTreeRequest, what string) ([]*deltagymv1.CheckpointNode, error) {
	if err := c.checkOpen(); err != nil {
		return nil, err
	}
	res, err := c.ledger.GetCheckpointTree(ctx, connect.NewRequest(req))
	if err != nil {
		return nil, fmt.Errorf("checkpoint tree of %s: %w", what, err)
	}
	return res.Msg.GetNodes(), nil
}

// GroupAdvantages computes the group-relative (GRPO) advantages of the
// episodes of group. An empty rewardSource means each episode's verifier
// reward; otherwise the rewards reported with that source.
func (c *Client) GroupAdvantages(ctx context.Context, group, rewardSource string) (*deltagymv1.GetGroupAdvantagesResponse, error) {
	if err := c.checkOpen(); err != nil {
		return nil, err
	}
	res, err := c.ledger.GetGroupAdvantages(ctx, connect.NewRequest(&deltagymv1.GetGroupAdvantagesRequest{GroupId: group, RewardSource: rewardSource}))
	if err != nil {
		return nil, fmt.Errorf("advantages of group %s: %w", group, err)
	}
	return res.Msg, nil
}

// ReportReward records a reward computed outside the server (an LLM judge, a
// reward model) for an episode. Reporting the same name and source again
// replaces the value, so the call is retried safely.
func (c *Client) ReportReward(ctx context.Context, episodeID, name string, value float64, source string) error {
	if err := c.checkOpen(); err != nil {
		return err
	}
	if _, err := c.ledger.ReportReward(ctx, connect.NewRequest(&deltagymv1.ReportRewardRequest{
		EpisodeId: episodeID, Name: name, Value: value, Source: source,
	})); err != nil {
		return fmt.Errorf("reporting reward %q of episode %s: %w", name, episodeID, err)
	}
	return nil
}
