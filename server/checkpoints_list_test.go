package server_test

import (
	"slices"
	"testing"

	deltagymv1 "github.com/deltagym/deltagym/clients/go/gen/deltagym/v1"
)

// ListCheckpoints lists the checkpoints the server holds with where each was taken and what
// keeps it: an episode's checkpoints by episode, env and run, a released one no more, the env's
// own pinned; through Connect and gRPC.
func TestListCheckpoints(t *testing.T) {
	b := setup(t, nil)
	for _, cl := range b.clients() {
		t.Run(cl.name, func(t *testing.T) {
			c := cl.c
			rr, err := c.Reset(t.Context(), &deltagymv1.ResetRequest{Env: "plain", Run: "list-" + cl.name})
			must(t, err)
			sb, ep := rr.GetSandboxId(), rr.GetEpisodeId()
			defer c.Close(t.Context(), &deltagymv1.CloseRequest{SandboxId: sb})
			_, err = c.Step(t.Context(), &deltagymv1.StepRequest{SandboxId: sb, Action: execAction("echo a > /tmp/a")})
			must(t, err)
			first, err := c.Checkpoint(t.Context(), &deltagymv1.CheckpointRequest{SandboxId: sb})
			must(t, err)
			_, err = c.Step(t.Context(), &deltagymv1.StepRequest{SandboxId: sb, Action: execAction("echo b > /tmp/b")})
			must(t, err)
			second, err := c.Checkpoint(t.Context(), &deltagymv1.CheckpointRequest{SandboxId: sb})
			must(t, err)
			ids := func(r *deltagymv1.ListCheckpointsRequest) []string {
				l, err := c.ListCheckpoints(t.Context(), r)
				must(t, err)
				var out []string
				for _, k := range l.GetCheckpoints() {
					out = append(out, k.GetCheckpointId())
				}
				return out
			}
			want := []string{first.GetCheckpointId(), second.GetCheckpointId()}
			if got := ids(&deltagymv1.ListCheckpointsRequest{EpisodeId: ep}); !slices.Equal(got, want) {
				t.Fatalf("the episode's checkpoints: %v, want %v", got, want)
			}
			if got := ids(&deltagymv1.ListCheckpointsRequest{Run: "list-" + cl.name}); !slices.Equal(got, want) {
				t.Fatalf("the run's checkpoints: %v, want %v", got, want)
			}
			all, err := c.ListCheckpoints(t.Context(), &deltagymv1.ListCheckpointsRequest{Env: "plain"})
			must(t, err)
			var pinned, mine int
			for _, k := range all.GetCheckpoints() {
				switch {
				case k.GetPinned():
					pinned++
				case k.GetCheckpointId() == second.GetCheckpointId():
					mine++
					if k.GetEnv() != "plain" || k.GetEpisodeId() != ep || k.GetParentId() != first.GetCheckpointId() ||
						k.GetStepIndex() != 2 || k.GetSizeBytes() <= 0 || k.GetLiveDescendants() != 1 || k.GetExpireTime() != nil ||
						k.GetCreateTime() == nil || k.GetLastUsedTime() == nil {
						t.Fatalf("the sandbox's head checkpoint: %v", k)
					}
				case k.GetCheckpointId() == first.GetCheckpointId():
					mine++
					if k.GetLiveDescendants() != 0 || k.GetExpireTime() == nil {
						t.Fatalf("a checkpoint nothing descends from is held by the TTL: %v", k)
					}
				}
			}
			if pinned == 0 || mine != 2 {
				t.Fatalf("env plain: %d pinned checkpoints and %d of the episode's, want its pool's and 2", pinned, mine)
			}
			_, err = c.ReleaseCheckpoint(t.Context(), &deltagymv1.ReleaseCheckpointRequest{CheckpointId: first.GetCheckpointId()})
			must(t, err)
			if got := ids(&deltagymv1.ListCheckpointsRequest{EpisodeId: ep}); !slices.Equal(got, want[1:]) {
				t.Fatalf("after releasing the first: %v, want %v", got, want[1:])
			}
			if got := ids(&deltagymv1.ListCheckpointsRequest{Env: "no-such-env"}); len(got) != 0 {
				t.Fatalf("checkpoints of an unknown env: %v", got)
			}
		})
	}
}
