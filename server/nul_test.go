package server_test

import (
	"encoding/json"
	"errors"
	"strings"
	"testing"

	"connectrpc.com/connect"
	"google.golang.org/grpc/status"

	deltagymv1 "github.com/deltagym/deltagym/clients/go/gen/deltagym/v1"
	"github.com/deltagym/deltagym/server/ledger"
)

// errMessage is the message of an error from either client.
func errMessage(err error) string {
	if ce := (*connect.Error)(nil); errors.As(err, &ce) {
		return ce.Message()
	}
	return status.Convert(err).Message()
}

// A request whose strings hold NUL, which no path, argument, variable or ledger text can, is
// refused with invalid_argument naming the field, before anything runs: the episode takes no
// step, the ledger records nothing, and no row reaches Postgres to be refused there. Through
// the real server with its ledger, over Connect and gRPC.
func TestNULRefused(t *testing.T) {
	b := setup(t, nil)
	ans := "4\x002"
	exec := func(x *deltagymv1.ExecAction) *deltagymv1.Action { return argvAction(x) }
	path := func(kind string, p string) *deltagymv1.Action {
		switch kind {
		case "list_dir":
			return &deltagymv1.Action{Kind: &deltagymv1.Action_ListDir{ListDir: &deltagymv1.ListDirAction{Path: p}}}
		case "stat":
			return &deltagymv1.Action{Kind: &deltagymv1.Action_Stat{Stat: &deltagymv1.StatAction{Path: p}}}
		case "remove":
			return &deltagymv1.Action{Kind: &deltagymv1.Action_Remove{Remove: &deltagymv1.RemoveAction{Path: p}}}
		case "make_dir":
			return &deltagymv1.Action{Kind: &deltagymv1.Action_MakeDir{MakeDir: &deltagymv1.MakeDirAction{Path: p}}}
		case "upload":
			return &deltagymv1.Action{Kind: &deltagymv1.Action_Upload{Upload: &deltagymv1.UploadAction{Path: p}}}
		case "download":
			return &deltagymv1.Action{Kind: &deltagymv1.Action_Download{Download: &deltagymv1.DownloadAction{Path: p}}}
		case "read_file":
			return readFileAction(p)
		}
		return writeFileAction(p, []byte("x"))
	}
	actions := []struct {
		name  string
		a     *deltagymv1.Action
		words string // the message names the field
	}{
		{"command", execAction("echo a\x00b"), "NUL byte in command"},
		{"argv", exec(&deltagymv1.ExecAction{Argv: []string{"echo", "a\x00b"}}), "NUL byte in argv[1]"},
		{"program", exec(&deltagymv1.ExecAction{Argv: []string{"ec\x00ho"}}), "NUL byte in argv[0]"},
		{"cwd", exec(&deltagymv1.ExecAction{Command: "true", Cwd: "/tmp\x00"}), "exec cwd"},
		{"env name", exec(&deltagymv1.ExecAction{Command: "true", Env: map[string]string{"A\x00": "b"}}), "exec env variable name"},
		{"env value", exec(&deltagymv1.ExecAction{Command: "true", Env: map[string]string{"A": "a\x00b"}}), `"A" has a NUL byte in its value`},
		{"session", exec(&deltagymv1.ExecAction{Command: "true", Session: "s\x00"}), "session name"},
		{"session command", exec(&deltagymv1.ExecAction{Command: "echo a\x00b", Session: "s"}), "NUL byte in command"},
		{"expect", exec(&deltagymv1.ExecAction{Command: "cat", Session: "s", Interactive: true, Expect: []string{"a\x00b"}}),
			`expect pattern 0 holds a NUL byte: write \x00`},
		{"submit answer", &deltagymv1.Action{Kind: &deltagymv1.Action_Submit{Submit: &deltagymv1.SubmitAction{Answer: &ans}}}, "submit's answer"},
	}
	for _, kind := range []string{"write_file", "read_file", "list_dir", "stat", "remove", "make_dir", "upload", "download"} {
		actions = append(actions, struct {
			name  string
			a     *deltagymv1.Action
			words string
		}{kind + " path", path(kind, "/tmp/a\x00b"), kind + `: path "/tmp/a\x00b" has a NUL byte`})
	}
	for _, cl := range b.clients() {
		t.Run(cl.name, func(t *testing.T) {
			c, ctx := cl.c, t.Context()
			rr, err := c.Reset(ctx, &deltagymv1.ResetRequest{Env: "plain", Run: "nul-" + cl.name})
			must(t, err)
			sb, ep := rr.GetSandboxId(), rr.GetEpisodeId()
			defer c.Close(ctx, &deltagymv1.CloseRequest{SandboxId: sb})
			_, err = c.Step(ctx, &deltagymv1.StepRequest{SandboxId: sb, Action: execAction("echo before")})
			must(t, err)
			for _, a := range actions {
				_, err := c.Step(ctx, &deltagymv1.StepRequest{SandboxId: sb, Action: a.a})
				if codeOf(err) != connect.CodeInvalidArgument || !strings.Contains(errMessage(err), a.words) {
					t.Errorf("%s: %v, want invalid_argument saying %q", a.name, err, a.words)
				}
			}
			if next, ok := nextStep(t, c, sb); next != 1 || !ok {
				t.Fatalf("next step %d (going on: %v), want 1: a refused step counted", next, ok)
			}
			obs, status := stepsRecorded(t, c, ep)
			if len(obs) != 1 || status != deltagymv1.EpisodeStatus_EPISODE_STATUS_RUNNING {
				t.Fatalf("the ledger holds %d steps of the episode (%v), want the one before", len(obs), status)
			}

			for name, req := range map[string]*deltagymv1.ResetRequest{
				"run":      {Env: "plain", Run: "r\x00"},
				"group_id": {Env: "plain", GroupId: "g\x00"},
				"option":   {Env: "plain", Options: map[string]string{"Q": "a\x00"}},
			} {
				if _, err := c.Reset(ctx, req); codeOf(err) != connect.CodeInvalidArgument || !strings.Contains(errMessage(err), name) {
					t.Errorf("Reset with NUL in %s: %v, want invalid_argument naming it", name, err)
				}
			}
			for name, req := range map[string]*deltagymv1.ForkRequest{
				"run":      {Source: &deltagymv1.ForkRequest_CheckpointId{CheckpointId: rr.GetCheckpointId()}, N: 1, Run: "r\x00"},
				"group_id": {Source: &deltagymv1.ForkRequest_CheckpointId{CheckpointId: rr.GetCheckpointId()}, N: 1, GroupId: "g\x00"},
			} {
				if _, err := c.Fork(ctx, req); codeOf(err) != connect.CodeInvalidArgument || !strings.Contains(errMessage(err), name) {
					t.Errorf("Fork with NUL in %s: %v, want invalid_argument naming it", name, err)
				}
			}
			for name, req := range map[string]*deltagymv1.ReportRewardRequest{
				"reward name": {EpisodeId: ep, Name: "n\x00", Value: 1},
				"source":      {EpisodeId: ep, Name: "n", Source: "s\x00", Value: 1},
				"episode_id":  {EpisodeId: ep + "\x00", Name: "n", Value: 1},
			} {
				if _, err := c.ReportReward(ctx, req); codeOf(err) != connect.CodeInvalidArgument || !strings.Contains(errMessage(err), name) {
					t.Errorf("ReportReward with NUL in %s: %v, want invalid_argument naming it", name, err)
				}
			}
			// The ledger's queries: a value no row holds is the caller's mistake, not the server's.
			queries := map[string]error{
				"episode_id": second(c.GetTrajectory(ctx, &deltagymv1.GetTrajectoryRequest{EpisodeId: ep + "\x00"})),
				"run":        second(c.ListEpisodes(ctx, &deltagymv1.ListEpisodesRequest{Run: "r\x00"})),
				"group_id":   second(c.GetGroupAdvantages(ctx, &deltagymv1.GetGroupAdvantagesRequest{GroupId: "g\x00"})),
				"reward_source": second(c.GetGroupAdvantages(ctx, &deltagymv1.GetGroupAdvantagesRequest{GroupId: "g",
					RewardSource: "s\x00"})),
				"run ": second(c.GetCheckpointTree(ctx, &deltagymv1.GetCheckpointTreeRequest{Scope: &deltagymv1.GetCheckpointTreeRequest_Run{Run: "r\x00"}})),
			}
			for name, err := range queries {
				if codeOf(err) != connect.CodeInvalidArgument || !strings.Contains(errMessage(err), strings.TrimSpace(name)) {
					t.Errorf("a ledger query with NUL in %s: %v, want invalid_argument naming it", name, err)
				}
			}

			eps, err := c.ListEpisodes(ctx, &deltagymv1.ListEpisodesRequest{Run: "nul-" + cl.name})
			must(t, err)
			if n := len(eps.GetEpisodes()); n != 1 || len(eps.GetEpisodes()[0].GetRewards()) != 0 {
				t.Fatalf("the ledger holds %v, want the one episode without rewards", eps.GetEpisodes())
			}
		})
	}
	if got := gauge(b.scrape(t), "deltagym_ledger_rows_refused_total", `[^}]*`); got != 0 {
		t.Fatalf("deltagym_ledger_rows_refused_total = %d, want 0: no row reached Postgres to be refused", got)
	}
}

func second[T any](_ T, err error) error { return err }

// A verifier's component names, which the sandbox's state may steer, are recorded with NUL as
// U+FFFD: the submit's step and its reward are stored, not refused by Postgres.
func TestVerifierComponentsWithNUL(t *testing.T) {
	b := setup(t, nil)
	c, ctx := b.clients()[0].c, t.Context()
	rr, err := c.Reset(ctx, &deltagymv1.ResetRequest{Env: "plain"})
	must(t, err)
	// The env's verifier prints /tmp/answer.
	_, err = c.Step(ctx, &deltagymv1.StepRequest{SandboxId: rr.GetSandboxId(),
		Action: writeFileAction("/tmp/answer", []byte(`{"reward": 1, "components": {"pass\u0000ed": 1}}`))})
	must(t, err)
	sr, err := c.Step(ctx, &deltagymv1.StepRequest{SandboxId: rr.GetSandboxId(),
		Action: &deltagymv1.Action{Kind: &deltagymv1.Action_Submit{Submit: &deltagymv1.SubmitAction{}}}})
	must(t, err)
	if got := sr.GetObservation().GetSubmit().GetComponents(); sr.GetReward() != 1 || got["pass\x00ed"] != 1 {
		t.Fatalf("submit: reward %v, components %v", sr.GetReward(), got)
	}
	tr, err := b.srv.Ledger().Trajectory(ctx, rr.GetEpisodeId())
	must(t, err)
	if len(tr.Steps) != 2 || len(tr.Rewards) != 1 || tr.Rewards[0].Components["pass\uFFFDed"] != 1 {
		t.Fatalf("the ledger holds %d steps and rewards %+v, want 2 and the verifier's with pass\uFFFDed", len(tr.Steps), tr.Rewards)
	}
	if got := gauge(b.scrape(t), "deltagym_ledger_rows_refused_total", `[^}]*`); got != 0 {
		t.Fatalf("deltagym_ledger_rows_refused_total = %d, want 0", got)
	}
}

// A row Postgres refuses, appended by the server's writer among the rows of running episodes
// (no request can make one: a test appends it), is set aside and counted on /metrics; the
// episodes' other rows are stored and the server's later steps too.
func TestLedgerRefusedRowCounted(t *testing.T) {
	b := setup(t, nil)
	c, ctx := b.clients()[0].c, t.Context()
	rr, err := c.Reset(ctx, &deltagymv1.ResetRequest{Env: "plain"})
	must(t, err)
	step := func() {
		t.Helper()
		_, err := c.Step(ctx, &deltagymv1.StepRequest{SandboxId: rr.GetSandboxId(), Action: execAction("true")})
		must(t, err)
	}
	step()
	// An action the writer is told is JSON, which Postgres's jsonb refuses.
	must(t, b.srv.LedgerWriter().Step(ledger.StepRow{EpisodeID: rr.GetEpisodeId(), Index: 1000, Action: json.RawMessage(`{"exec":`),
		ActionValid: true}))
	step()
	obs, _ := stepsRecorded(t, c, rr.GetEpisodeId()) // flushes the writer
	if len(obs) != 2 {
		t.Fatalf("the ledger holds %d steps of the episode, want 2", len(obs))
	}
	if got := gauge(b.scrape(t), "deltagym_ledger_rows_refused_total", `[^}]*`); got != 1 {
		t.Fatalf("deltagym_ledger_rows_refused_total = %d, want 1", got)
	}
	step()
	if obs, _ := stepsRecorded(t, c, rr.GetEpisodeId()); len(obs) != 3 {
		t.Fatalf("the ledger holds %d steps after, want 3", len(obs))
	}
}
