package server_test

import (
	"flag"
	"io"
	"strings"
	"testing"

	"connectrpc.com/connect"
	"google.golang.org/protobuf/proto"

	deltagymv1 "github.com/deltagym/deltagym/clients/go/gen/deltagym/v1"
	"github.com/deltagym/deltagym/server"
)

func execAction(cmd string) *deltagymv1.Action {
	return &deltagymv1.Action{Kind: &deltagymv1.Action_Exec{Exec: &deltagymv1.ExecAction{Command: cmd}}}
}

func stdout(t testing.TB, r *deltagymv1.StepResponse) string {
	t.Helper()
	return string(r.GetObservation().GetExec().GetStdout())
}

// TestEveryRPC drives every RPC of both services through a Connect and a gRPC client, checking
// the episode semantics along the way.
func TestEveryRPC(t *testing.T) {
	b := setup(t, nil)
	for _, cl := range b.clients() {
		t.Run(cl.name, func(t *testing.T) {
			c, ctx := cl.c, t.Context()
			envs, err := c.ListEnvs(ctx, &deltagymv1.ListEnvsRequest{})
			must(t, err)
			if len(envs.GetEnvs()) < 3 || envs.GetEnvs()[0].GetSpec().GetName() != "plain" {
				t.Fatalf("ListEnvs = %v", envs)
			}
			seed := int64(7)
			run, group := "run-"+cl.name, "group-"+cl.name
			rr, err := c.Reset(ctx, &deltagymv1.ResetRequest{Env: "task", Seed: &seed, Options: map[string]string{"Q": "why"}, Run: run, GroupId: group})
			must(t, err)
			if got := string(rr.GetObservation().GetReset_().GetHook().GetStdout()); got != "seed=7 q=why\n" {
				t.Fatalf("reset hook stdout %q", got)
			}
			if rr.GetObservation().GetReset_().GetTask() != "write 42 to /tmp/answer" || rr.GetCheckpointId() == "" {
				t.Fatalf("reset = %v", rr)
			}
			sb := rr.GetSandboxId()
			// The same task again is a fork of the cached task checkpoint.
			rr2, err := c.Reset(ctx, &deltagymv1.ResetRequest{Env: "task", Seed: &seed, Options: map[string]string{"Q": "why"}, Run: run, GroupId: group})
			must(t, err)
			if rr2.GetCheckpointId() != rr.GetCheckpointId() || rr2.GetInfo()["task_cached"] != "true" {
				t.Fatalf("second reset of one task: %v", rr2)
			}
			st, err := c.Step(ctx, &deltagymv1.StepRequest{SandboxId: rr2.GetSandboxId(), Action: execAction("cat /tmp/seed /tmp/base")})
			must(t, err)
			if stdout(t, st) != "7\nbase\n" {
				t.Fatalf("forked task state: %q", stdout(t, st))
			}
			_, err = c.Close(ctx, &deltagymv1.CloseRequest{SandboxId: rr2.GetSandboxId()})
			must(t, err)

			st, err = c.Step(ctx, &deltagymv1.StepRequest{SandboxId: sb, Action: execAction("echo 1 > /tmp/answer; echo hi; exit 3")})
			must(t, err)
			if ex := st.GetObservation().GetExec(); string(ex.GetStdout()) != "hi\n" || ex.GetExitCode() != 3 || st.GetStepIndex() != 0 {
				t.Fatalf("exec step = %v", st)
			}
			w, err := c.Step(ctx, &deltagymv1.StepRequest{SandboxId: sb, Checkpoint: true, Action: &deltagymv1.Action{Kind: &deltagymv1.Action_WriteFile{
				WriteFile: &deltagymv1.WriteFileAction{Path: "/tmp/f", Content: []byte("hello")}}}})
			must(t, err)
			if w.GetObservation().GetWriteFile().GetSize() != 5 || w.GetCheckpointId() == "" || w.GetStepIndex() != 1 {
				t.Fatalf("write_file step = %v", w)
			}
			c1 := w.GetCheckpointId() // after 2 steps
			rf, err := c.Step(ctx, &deltagymv1.StepRequest{SandboxId: sb, Action: &deltagymv1.Action{Kind: &deltagymv1.Action_ReadFile{
				ReadFile: &deltagymv1.ReadFileAction{Path: "/tmp/f", Offset: 1, MaxBytes: 2}}}})
			must(t, err)
			if r := rf.GetObservation().GetReadFile(); string(r.GetContent()) != "el" || r.GetSize() != 5 || !r.GetTruncated() {
				t.Fatalf("read_file = %v", r)
			}
			// Evaluate sees the state but does not change it.
			_, err = c.Step(ctx, &deltagymv1.StepRequest{SandboxId: sb, Action: execAction("echo 42 > /tmp/answer")})
			must(t, err)
			ev, err := c.Evaluate(ctx, &deltagymv1.EvaluateRequest{SandboxId: sb})
			must(t, err)
			if ev.GetReward() != 1 || ev.GetComponents()["correct"] != 1 {
				t.Fatalf("evaluate = %v", ev)
			}
			ck, err := c.Checkpoint(ctx, &deltagymv1.CheckpointRequest{SandboxId: sb})
			must(t, err)
			if ck.GetCheckpointId() == "" || ck.GetParentId() == "" {
				t.Fatalf("checkpoint = %v", ck)
			}
			// Restore: a new episode, indices continue from the checkpoint's step.
			rs, err := c.Restore(ctx, &deltagymv1.RestoreRequest{SandboxId: sb, CheckpointId: c1})
			must(t, err)
			if rs.GetEpisodeId() == rr.GetEpisodeId() || rs.GetNextStepIndex() != 2 {
				t.Fatalf("restore = %v", rs)
			}
			st, err = c.Step(ctx, &deltagymv1.StepRequest{SandboxId: sb, Action: execAction("cat /tmp/answer")})
			must(t, err)
			if stdout(t, st) != "1\n" || st.GetStepIndex() != 2 || st.GetEpisodeId() != rs.GetEpisodeId() {
				t.Fatalf("step after restore = %v", st)
			}
			// Fork from a checkpoint and from a sandbox.
			fk, err := c.Fork(ctx, &deltagymv1.ForkRequest{Source: &deltagymv1.ForkRequest_CheckpointId{CheckpointId: ck.GetCheckpointId()}, N: 2})
			must(t, err)
			if len(fk.GetSandboxIds()) != 2 || len(fk.GetEpisodeIds()) != 2 || fk.GetCheckpointId() != ck.GetCheckpointId() {
				t.Fatalf("fork = %v", fk)
			}
			gs, err := c.GetSandbox(ctx, &deltagymv1.GetSandboxRequest{SandboxId: fk.GetSandboxIds()[0]})
			must(t, err)
			if s := gs.GetSandbox(); s.GetRun() != run || s.GetGroupId() != group || s.GetNextStepIndex() != 4 || s.GetEnv() != "task" {
				t.Fatalf("forked sandbox = %v", s)
			}
			st, err = c.Step(ctx, &deltagymv1.StepRequest{SandboxId: fk.GetSandboxIds()[1], Action: execAction("cat /tmp/answer")})
			must(t, err)
			if stdout(t, st) != "42\n" {
				t.Fatalf("forked state %q", stdout(t, st))
			}
			fs, err := c.Fork(ctx, &deltagymv1.ForkRequest{Source: &deltagymv1.ForkRequest_SandboxId{SandboxId: sb}, N: 1, GroupId: "g2"})
			must(t, err)
			if len(fs.GetSandboxIds()) != 1 || fs.GetCheckpointId() == "" {
				t.Fatalf("fork from sandbox = %v", fs)
			}
			// Submit terminates; later steps are refused.
			sub, err := c.Step(ctx, &deltagymv1.StepRequest{SandboxId: fk.GetSandboxIds()[1], Action: &deltagymv1.Action{Kind: &deltagymv1.Action_Submit{Submit: &deltagymv1.SubmitAction{}}}})
			must(t, err)
			if !sub.GetTerminated() || sub.GetReward() != 1 {
				t.Fatalf("submit = %v", sub)
			}
			_, err = c.Step(ctx, &deltagymv1.StepRequest{SandboxId: fk.GetSandboxIds()[1], Action: execAction("true")})
			if codeOf(err) != connect.CodeFailedPrecondition {
				t.Fatalf("step after submit: %v, want FailedPrecondition", err)
			}
			hb, err := c.Heartbeat(ctx, &deltagymv1.HeartbeatRequest{SandboxIds: []string{sb, "nope"}})
			must(t, err)
			if len(hb.GetLeases()) != 1 || len(hb.GetUnknownSandboxIds()) != 1 {
				t.Fatalf("heartbeat = %v", hb)
			}
			ls, err := c.ListSandboxes(ctx, &deltagymv1.ListSandboxesRequest{Run: run, GroupId: group})
			must(t, err)
			if len(ls.GetSandboxes()) != 3 {
				t.Fatalf("ListSandboxes = %d sandboxes, want 3", len(ls.GetSandboxes()))
			}
			_, err = c.ReleaseCheckpoint(ctx, &deltagymv1.ReleaseCheckpointRequest{CheckpointId: fs.GetCheckpointId()})
			must(t, err)
			for _, id := range append(fk.GetSandboxIds(), fs.GetSandboxIds()...) {
				_, err = c.Close(ctx, &deltagymv1.CloseRequest{SandboxId: id})
				must(t, err)
			}
			_, err = c.Close(ctx, &deltagymv1.CloseRequest{SandboxId: fs.GetSandboxIds()[0]})
			must(t, err) // closing twice succeeds
			_, err = c.Step(ctx, &deltagymv1.StepRequest{SandboxId: fs.GetSandboxIds()[0], Action: execAction("true")})
			if codeOf(err) != connect.CodeFailedPrecondition {
				t.Fatalf("step on a closed sandbox: %v, want FailedPrecondition", err)
			}

			// Ledger.
			tr, err := c.GetTrajectory(ctx, &deltagymv1.GetTrajectoryRequest{EpisodeId: rs.GetEpisodeId()})
			must(t, err)
			if n := len(tr.GetSteps()); n != 3 || !tr.GetSteps()[0].GetInherited() || tr.GetSteps()[2].GetInherited() {
				t.Fatalf("trajectory after restore: %d steps %v", n, tr.GetSteps())
			}
			if !proto.Equal(tr.GetSteps()[2].GetAction(), execAction("cat /tmp/answer")) {
				t.Fatalf("recorded action %v", tr.GetSteps()[2].GetAction())
			}
			eps, err := c.ListEpisodes(ctx, &deltagymv1.ListEpisodesRequest{Run: run})
			must(t, err)
			statuses := map[deltagymv1.EpisodeStatus]int{}
			for _, e := range eps.GetEpisodes() {
				statuses[e.GetStatus()]++
				if e.GetEpisodeId() == rs.GetEpisodeId() && e.GetStepCount() != 1 {
					t.Fatalf("listed episode has step_count %d, want 1 (its trajectory: 2 inherited steps, 1 own)", e.GetStepCount())
				}
			}
			if statuses[deltagymv1.EpisodeStatus_EPISODE_STATUS_BRANCHED] != 1 || statuses[deltagymv1.EpisodeStatus_EPISODE_STATUS_TERMINATED] != 1 {
				t.Fatalf("episode statuses %v", statuses)
			}
			tree, err := c.GetCheckpointTree(ctx, &deltagymv1.GetCheckpointTreeRequest{Scope: &deltagymv1.GetCheckpointTreeRequest_Run{Run: run}})
			must(t, err)
			kinds := map[deltagymv1.CheckpointKind]int{}
			for _, n := range tree.GetNodes() {
				kinds[n.GetKind()]++
			}
			if kinds[deltagymv1.CheckpointKind_CHECKPOINT_KIND_POOL] != 1 || kinds[deltagymv1.CheckpointKind_CHECKPOINT_KIND_TASK] != 1 ||
				kinds[deltagymv1.CheckpointKind_CHECKPOINT_KIND_EVALUATE] != 1 || kinds[deltagymv1.CheckpointKind_CHECKPOINT_KIND_USER] < 2 {
				t.Fatalf("checkpoint tree kinds %v", kinds)
			}
			_, err = c.ReportReward(ctx, &deltagymv1.ReportRewardRequest{EpisodeId: fk.GetEpisodeIds()[1], Name: "judge", Value: 0.5, Source: "judge"})
			must(t, err)
			eps, err = c.ListEpisodes(ctx, &deltagymv1.ListEpisodesRequest{Run: run})
			must(t, err)
			for _, e := range eps.GetEpisodes() {
				rs := e.GetRewards()
				if judged := e.GetEpisodeId() == fk.GetEpisodeIds()[1]; judged != (len(rs) == 1) ||
					judged && (rs[0].GetName() != "judge" || rs[0].GetSource() != "judge" || rs[0].GetValue() != 0.5) {
					t.Fatalf("listed episode %s has rewards %v; want the judge's 0.5 on %s alone", e.GetEpisodeId(), rs, fk.GetEpisodeIds()[1])
				}
			}
			adv, err := c.GetGroupAdvantages(ctx, &deltagymv1.GetGroupAdvantagesRequest{GroupId: group})
			must(t, err)
			if adv.GetCountedCount() != 1 {
				t.Fatalf("advantages = %v", adv)
			}
			// RegisterEnv and ImportImage while running.
			name := "reg-" + cl.name
			re, err := c.RegisterEnv(ctx, &deltagymv1.RegisterEnvRequest{Spec: &deltagymv1.EnvSpec{Name: name, Image: "img-" + cl.name, PoolSize: 1}})
			must(t, err)
			if re.GetEnv().GetSpec().GetName() != name {
				t.Fatalf("RegisterEnv = %v", re)
			}
			_, err = c.Reset(ctx, &deltagymv1.ResetRequest{Env: name})
			if codeOf(err) != connect.CodeFailedPrecondition || !strings.Contains(err.Error(), "img-"+cl.name) {
				t.Fatalf("reset of an env without its image: %v", err)
			}
			im, err := c.ImportImage(ctx, &deltagymv1.ImportImageRequest{Name: "img-" + cl.name, Path: b.busybox})
			must(t, err)
			if !strings.HasPrefix(im.GetDigest(), "sha256:") {
				t.Fatalf("ImportImage = %v", im)
			}
			rn, err := c.Reset(ctx, &deltagymv1.ResetRequest{Env: name})
			must(t, err)
			_, err = c.Close(ctx, &deltagymv1.CloseRequest{SandboxId: rn.GetSandboxId()})
			must(t, err)
			_, err = c.Close(ctx, &deltagymv1.CloseRequest{SandboxId: sb})
			must(t, err)
		})
	}
}

// parseServe parses serve's flags into a validated Config.
func parseServe(args []string) (server.Config, error) {
	var cfg server.Config
	fs := flag.NewFlagSet("serve", flag.ContinueOnError)
	fs.SetOutput(io.Discard)
	cfg.RegisterFlags(fs)
	err := fs.Parse(args)
	if err == nil {
		err = cfg.Validate()
	}
	return cfg, err
}

// TestPostgresMemoryFlag: --postgres-memory-mb maps to the private cluster's cap, and a cap too
// small for Postgres's shared buffers is refused before anything starts.
func TestPostgresMemoryFlag(t *testing.T) {
	for _, c := range []struct {
		args  []string
		limit int64
		err   string
	}{
		{nil, 512 << 20, ""},
		{[]string{"--postgres-memory-mb", "1024"}, 1024 << 20, ""},
		{[]string{"--postgres-memory-mb", "-1"}, -1, ""},
		{[]string{"--postgres-memory-mb", "100"}, 0, "from 256 to"},
		{[]string{"--postgres-memory-mb", "0"}, 0, "from 256 to"},
		{[]string{"--postgres-memory-mb", "-2"}, 0, "or -1 for no cap"},
		{[]string{"--postgres-memory-mb", "99999999999"}, 0, "from 256 to"},
	} {
		cfg, err := parseServe(c.args)
		if c.err != "" {
			if err == nil || !strings.Contains(err.Error(), c.err) {
				t.Fatalf("%v: Validate = %v, want %q", c.args, err, c.err)
			}
			continue
		}
		if err != nil {
			t.Fatalf("%v: %v", c.args, err)
		}
		if got := cfg.PostgresMemoryLimit(); got != c.limit {
			t.Fatalf("%v: memory limit %d, want %d", c.args, got, c.limit)
		}
	}
}

// TestLedgerVacuumFlag: --ledger-vacuum-steps takes a number of steps or -1, and refuses 0.
func TestLedgerVacuumFlag(t *testing.T) {
	for _, c := range []struct {
		args []string
		n    int
		err  string
	}{
		{nil, 0, ""}, // the writer's default
		{[]string{"--ledger-vacuum-steps", "500"}, 500, ""},
		{[]string{"--ledger-vacuum-steps", "-1"}, -1, ""},
		{[]string{"--ledger-vacuum-steps", "0"}, 0, "1 or more"},
		{[]string{"--ledger-vacuum-steps", "-2"}, 0, "or -1 to leave"},
		{[]string{"--ledger-vacuum-steps", "many"}, 0, "a number of steps"},
	} {
		cfg, err := parseServe(c.args)
		if c.err != "" {
			if err == nil || !strings.Contains(err.Error(), c.err) {
				t.Fatalf("%v: %v, want %q", c.args, err, c.err)
			}
			continue
		}
		if err != nil {
			t.Fatalf("%v: %v", c.args, err)
		}
		if cfg.LedgerVacuumSteps != c.n {
			t.Fatalf("%v: LedgerVacuumSteps %d, want %d", c.args, cfg.LedgerVacuumSteps, c.n)
		}
	}
}

// --ledger-sync makes calls wait for their rows' fsync; it is off by default, and means nothing
// without a ledger.
func TestLedgerSyncFlag(t *testing.T) {
	if cfg, err := parseServe(nil); err != nil || cfg.LedgerSync {
		t.Fatalf("by default: LedgerSync %v (%v), want off", cfg.LedgerSync, err)
	}
	if cfg, err := parseServe([]string{"--ledger-sync"}); err != nil || !cfg.LedgerSync {
		t.Fatalf("--ledger-sync: LedgerSync %v (%v), want on", cfg.LedgerSync, err)
	}
	if _, err := parseServe([]string{"--ledger-sync", "--no-ledger"}); err == nil || !strings.Contains(err.Error(), "exclude each other") {
		t.Fatalf("--ledger-sync --no-ledger: %v, want them refused together", err)
	}
}

// --import-max-bytes takes a number of bytes or a size with a unit.
func TestImportMaxBytesFlag(t *testing.T) {
	for _, c := range []struct {
		arg  string
		want int64
	}{
		{"", 16 << 30}, {"1048576", 1 << 20}, {"500MiB", 500 << 20}, {"16GiB", 16 << 30}, {"1G", 1 << 30},
		{"2k", 2 << 10}, {"3 TB", 3 << 40}, {"0", -1}, {"-5", -1}, {"12x", -1}, {"GiB", -1}, {"9999999TiB", -1},
	} {
		var args []string
		if c.arg != "" {
			args = []string{"--import-max-bytes", c.arg}
		}
		cfg, err := parseServe(args)
		switch {
		case c.want < 0 && err == nil:
			t.Errorf("--import-max-bytes %q accepted: %d", c.arg, cfg.Import.MaxBytes)
		case c.want >= 0 && (err != nil || cfg.Import.MaxBytes != c.want):
			t.Errorf("--import-max-bytes %q: %d, %v; want %d", c.arg, cfg.Import.MaxBytes, err, c.want)
		}
	}
}
