package ledger

import (
	"context"
	"errors"
	"fmt"
	"math"

	"github.com/jackc/pgx/v5"

	"github.com/deltagym/deltagym/internal/errdefs"
)

// AdvantageEpsilon is added to the group's standard deviation so an all-equal group gives zero
// advantages rather than a division by zero.
const AdvantageEpsilon = 1e-4

// Advantage is one counted episode's reward and group-relative advantage.
type Advantage struct {
	EpisodeID string  `json:"episode_id"`
	Reward    float64 `json:"reward"`
	Advantage float64 `json:"advantage"`
}

// ExcludedEpisode is an episode of the group that did not count, and why.
type ExcludedEpisode struct {
	EpisodeID string `json:"episode_id"`
	Reason    string `json:"reason"`
}

// GroupAdvantages are the GRPO advantages of one group.
type GroupAdvantages struct {
	Group        string            `json:"group"`
	RewardSource string            `json:"reward_source"`
	Mean         float64           `json:"mean"`
	Std          float64           `json:"std"` // sample standard deviation (n-1); 0 for n < 2
	Counted      []Advantage       `json:"counted"`
	Excluded     []ExcludedEpisode `json:"excluded"`
}

// Advantages computes group-relative advantages for GRPO: for each finished (terminated or
// truncated) episode of the group that did not fail for infrastructure reasons and has a reward
// from the source, (reward − group mean) / (group sample std + AdvantageEpsilon). The reward is
// the last one recorded from rewardSource ("" means the verifier). Episodes are listed in start
// order.
func (s *Store) Advantages(ctx context.Context, group, rewardSource string) (*GroupAdvantages, error) {
	if group == "" {
		return nil, fmt.Errorf("advantages need a group: %w", ErrInvalid)
	}
	if err := errors.Join(checkText("group_id", group), checkText("reward_source", rewardSource)); err != nil {
		return nil, err
	}
	if rewardSource == "" {
		rewardSource = SourceVerifier
	}
	if err := s.flush(ctx); err != nil {
		return nil, err
	}
	rows, err := s.pool.Query(ctx, `SELECT e.id, e.status, coalesce(e.failure_class, ''), r.value
		FROM episodes e
		LEFT JOIN LATERAL (SELECT value FROM rewards WHERE episode_id = e.id AND source = $2 ORDER BY id DESC LIMIT 1) r ON true
		WHERE e.group_id = $1 ORDER BY e.started_at, e.id`, group, rewardSource)
	if err != nil {
		return nil, fmt.Errorf("reading group %s: %w", group, err)
	}
	type row struct {
		id     string
		status Status
		class  FailureClass
		reward *float64
	}
	eps, err := pgx.CollectRows(rows, func(r pgx.CollectableRow) (row, error) {
		var x row
		var status, class string
		err := r.Scan(&x.id, &status, &class, &x.reward)
		x.status, x.class = Status(status), FailureClass(class)
		return x, err
	})
	if err != nil {
		return nil, fmt.Errorf("reading group %s: %w", group, err)
	}
	if len(eps) == 0 {
		return nil, errdefs.WithDetail(fmt.Errorf("group %s: %w", group, ErrNotFound), "GROUP_NOT_FOUND", "group_id", group)
	}
	out := &GroupAdvantages{Group: group, RewardSource: rewardSource, Counted: []Advantage{}, Excluded: []ExcludedEpisode{}}
	for _, e := range eps {
		reason := ""
		switch {
		case e.class == FailureInfra:
			reason = "infra failure"
		case e.status != StatusTerminated && e.status != StatusTruncated:
			reason = "not finished: " + string(e.status)
		case e.reward == nil:
			reason = "no reward from " + rewardSource
		}
		if reason != "" {
			out.Excluded = append(out.Excluded, ExcludedEpisode{EpisodeID: e.id, Reason: reason})
			continue
		}
		out.Counted = append(out.Counted, Advantage{EpisodeID: e.id, Reward: *e.reward})
	}
	n := float64(len(out.Counted))
	if n == 0 {
		return out, nil
	}
	for _, a := range out.Counted {
		out.Mean += a.Reward
	}
	out.Mean /= n
	if n > 1 {
		var ss float64
		for _, a := range out.Counted {
			ss += (a.Reward - out.Mean) * (a.Reward - out.Mean)
		}
		out.Std = math.Sqrt(ss / (n - 1))
	}
	for i := range out.Counted {
		out.Counted[i].Advantage = (out.Counted[i].Reward - out.Mean) / (out.Std + AdvantageEpsilon)
	}
	return out, nil
}
