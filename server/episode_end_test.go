package server_test

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"testing"
	"time"

	"connectrpc.com/connect"
	"golang.org/x/sys/unix"

	deltagymv1 "github.com/deltagym/deltagym/clients/go/gen/deltagym/v1"
	"github.com/deltagym/deltagym/envpool"
	"github.com/deltagym/deltagym/sandbox"
	"github.com/deltagym/deltagym/server"
	"github.com/deltagym/deltagym/server/episode"
)

// register adds an env to b's catalog through the API.
func (b *bundle) register(t testing.TB, spec *deltagymv1.EnvSpec) {
	t.Helper()
	if spec.Image == "" {
		spec.Image = "default"
	}
	_, err := b.connect.RegisterEnv(t.Context(), connect.NewRequest(&deltagymv1.RegisterEnvRequest{Spec: spec}))
	must(t, err)
}

// episode returns an episode's trajectory from the ledger.
func (b *bundle) episode(t testing.TB, id string) *deltagymv1.GetTrajectoryResponse {
	t.Helper()
	tr, err := b.ledger.GetTrajectory(t.Context(), connect.NewRequest(&deltagymv1.GetTrajectoryRequest{EpisodeId: id}))
	must(t, err)
	return tr.Msg
}

// TestTimeBudget checks the episode time budget: a long exec is cut at the budget and truncates
// the episode; a step begun after the budget is spent does not run its action, answers
// truncated, and is recorded so.
func TestTimeBudget(t *testing.T) {
	b := setup(t, nil)
	const budget = 700 * time.Millisecond
	b.register(t, &deltagymv1.EnvSpec{Name: "timed", PoolSize: 2, Budgets: &deltagymv1.Budgets{MaxSeconds: budget.Seconds()}})
	ctx := t.Context()

	t.Run("long exec is cut at the budget", func(t *testing.T) {
		rr, err := b.connect.Reset(ctx, connect.NewRequest(&deltagymv1.ResetRequest{Env: "timed"}))
		must(t, err)
		start := time.Now()
		st, err := b.connect.Step(ctx, connect.NewRequest(&deltagymv1.StepRequest{SandboxId: rr.Msg.GetSandboxId(), Action: execAction("sleep 30")}))
		must(t, err)
		took := time.Since(start)
		ex := st.Msg.GetObservation().GetExec()
		if !ex.GetTimedOut() || !st.Msg.GetTruncated() || st.Msg.GetInfo()["truncated_by"] != "max_seconds" {
			t.Fatalf("sleep 30 under a %v budget: timed_out %v, step %v", budget, ex.GetTimedOut(), st.Msg)
		}
		// The exec's timeout is the budget left when it starts; killing it and collecting its
		// output may overrun a little.
		const slack = 500 * time.Millisecond
		if took > budget+2*slack || ex.GetDurationSeconds() > (budget+slack).Seconds() {
			t.Fatalf("the step took %v (exec %.3fs) under a %v budget", took, ex.GetDurationSeconds(), budget)
		}
		t.Logf("exec cut after %.3fs, step answered after %v (budget %v)", ex.GetDurationSeconds(), took, budget)
		_, err = b.connect.Step(ctx, connect.NewRequest(&deltagymv1.StepRequest{SandboxId: rr.Msg.GetSandboxId(), Action: execAction("true")}))
		if codeOf(err) != connect.CodeFailedPrecondition {
			t.Fatalf("step after truncation: %v", err)
		}
		ep := b.episode(t, rr.Msg.GetEpisodeId())
		if ep.GetEpisode().GetStatus() != deltagymv1.EpisodeStatus_EPISODE_STATUS_TRUNCATED || len(ep.GetSteps()) != 1 || !ep.GetSteps()[0].GetTruncated() {
			t.Fatalf("ledger: %v", ep)
		}
	})

	t.Run("step begun past the budget does not run", func(t *testing.T) {
		rr, err := b.connect.Reset(ctx, connect.NewRequest(&deltagymv1.ResetRequest{Env: "timed"}))
		must(t, err)
		sb := rr.Msg.GetSandboxId()
		// The budget counts from the episode's start, before Reset answered: let it run out.
		// (The wait is the elapsed time under test, not synchronisation.)
		time.Sleep(budget)
		st, err := b.connect.Step(ctx, connect.NewRequest(&deltagymv1.StepRequest{SandboxId: sb, Action: execAction("echo ran > /tmp/ran")}))
		must(t, err)
		if !st.Msg.GetTruncated() || st.Msg.GetTerminated() || st.Msg.GetInfo()["action_skipped"] == "" || st.Msg.GetObservation() != nil {
			t.Fatalf("step past the budget: %v", st.Msg)
		}
		box, err := b.srv.Runtime().Get(sb)
		must(t, err)
		if _, _, err := box.ReadFile(ctx, "/tmp/ran", 0, 0); err == nil {
			t.Fatal("the action of a step begun past the budget ran")
		}
		_, err = b.connect.Step(ctx, connect.NewRequest(&deltagymv1.StepRequest{SandboxId: sb, Action: execAction("true")}))
		if codeOf(err) != connect.CodeFailedPrecondition {
			t.Fatalf("step after truncation: %v", err)
		}
		ep := b.episode(t, rr.Msg.GetEpisodeId())
		if ep.GetEpisode().GetStatus() != deltagymv1.EpisodeStatus_EPISODE_STATUS_TRUNCATED || len(ep.GetSteps()) != 1 {
			t.Fatalf("ledger: %v", ep)
		}
		if s := ep.GetSteps()[0]; !s.GetTruncated() || s.GetAction().GetExec().GetCommand() != "echo ran > /tmp/ran" {
			t.Fatalf("recorded step: %v", s)
		}
	})

	t.Run("restore starts a new budget", func(t *testing.T) {
		rr, err := b.connect.Reset(ctx, connect.NewRequest(&deltagymv1.ResetRequest{Env: "timed"}))
		must(t, err)
		sb := rr.Msg.GetSandboxId()
		time.Sleep(budget) // let the first episode's budget run out
		re, err := b.connect.Restore(ctx, connect.NewRequest(&deltagymv1.RestoreRequest{SandboxId: sb, CheckpointId: rr.Msg.GetCheckpointId()}))
		must(t, err)
		st, err := b.connect.Step(ctx, connect.NewRequest(&deltagymv1.StepRequest{SandboxId: sb, Action: execAction("echo ok")}))
		must(t, err)
		if st.Msg.GetTruncated() || stdout(t, st.Msg) != "ok\n" || st.Msg.GetEpisodeId() != re.Msg.GetEpisodeId() {
			t.Fatalf("first step of the restored episode: %v", st.Msg)
		}
	})
}

// TestInfraFailure kills sandboxes' inits: the episodes end failed with class infra, whether
// the init dies during a step or before one.
func TestInfraFailure(t *testing.T) {
	b := setup(t, nil)
	ctx := t.Context()
	cases := []struct {
		name   string
		during bool // kill the init while a step runs
	}{
		{"init dies during a step", true},
		{"init died before a step", false},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			rr, err := b.grpc.Reset(ctx, &deltagymv1.ResetRequest{Env: "plain"})
			must(t, err)
			sb := rr.GetSandboxId()
			box, err := b.srv.Runtime().Get(sb)
			must(t, err)
			// A first step that works.
			_, err = b.grpc.Step(ctx, &deltagymv1.StepRequest{SandboxId: sb, Action: execAction("echo one > /tmp/one")})
			must(t, err)
			done := make(chan error, 1)
			if tc.during {
				go func() {
					_, err := b.grpc.Step(ctx, &deltagymv1.StepRequest{SandboxId: sb, Action: execAction("echo started > /tmp/s; sleep 30")})
					done <- err
				}()
				for { // wait until the exec runs
					if _, _, err := box.ReadFile(ctx, "/tmp/s", 0, 0); err == nil {
						break
					}
					time.Sleep(10 * time.Millisecond) // polling interval
				}
			}
			must(t, unix.Kill(box.InitPid(), unix.SIGKILL))
			if !tc.during {
				select { // the runtime destroys a sandbox whose init died
				case <-box.Done():
				case <-time.After(20 * time.Second):
					t.Fatal("sandbox not destroyed 20s after its init was killed")
				}
				go func() {
					_, err := b.grpc.Step(ctx, &deltagymv1.StepRequest{SandboxId: sb, Action: execAction("true")})
					done <- err
				}()
			}
			select {
			case err = <-done:
			case <-time.After(20 * time.Second):
				t.Fatal("the step did not return 20s after its sandbox's init was killed")
			}
			// (Before a step, the reaper may have come first: then the step finds the lease ended.)
			if codeOf(err) != connect.CodeFailedPrecondition || (tc.during && !strings.Contains(err.Error(), "failed (infra)")) {
				t.Fatalf("step on a sandbox whose init died: %v", err)
			}
			ep := b.episode(t, rr.GetEpisodeId()).GetEpisode()
			if ep.GetStatus() != deltagymv1.EpisodeStatus_EPISODE_STATUS_FAILED || ep.GetFailureClass() != deltagymv1.FailureClass_FAILURE_CLASS_INFRA {
				t.Fatalf("episode after its init died: %v", ep)
			}
			if m := ep.GetFailureMessage(); !strings.Contains(m, "init died") && !strings.Contains(m, "init exited") {
				t.Fatalf("failure message %q does not say the sandbox's init died", m)
			}
			if ep.GetStepCount() != 1 {
				t.Fatalf("episode records %d steps, want the 1 that ran", ep.GetStepCount())
			}
		})
	}

	// The reaper finds a dead sandbox nobody steps on and fails its episode too.
	t.Run("reaped after its init died", func(t *testing.T) {
		rr, err := b.connect.Reset(ctx, connect.NewRequest(&deltagymv1.ResetRequest{Env: "plain"}))
		must(t, err)
		box, err := b.srv.Runtime().Get(rr.Msg.GetSandboxId())
		must(t, err)
		must(t, unix.Kill(box.InitPid(), unix.SIGKILL))
		deadline := time.Now().Add(30 * time.Second)
		for {
			_, err := b.connect.GetSandbox(ctx, connect.NewRequest(&deltagymv1.GetSandboxRequest{SandboxId: rr.Msg.GetSandboxId()}))
			if err != nil {
				break
			}
			if time.Now().After(deadline) {
				t.Fatal("dead sandbox not reaped within 30s")
			}
			time.Sleep(50 * time.Millisecond) // polling interval
		}
		ep := b.episode(t, rr.Msg.GetEpisodeId()).GetEpisode()
		if ep.GetStatus() != deltagymv1.EpisodeStatus_EPISODE_STATUS_FAILED || ep.GetFailureClass() != deltagymv1.FailureClass_FAILURE_CLASS_INFRA {
			t.Fatalf("reaped dead sandbox's episode: %v", ep)
		}
		if m := ep.GetFailureMessage(); m != "its sandbox died (its init exited)" {
			t.Fatalf("reaped dead sandbox's episode: failure message %q", m)
		}
	})

	// Which errors of an action count as the infrastructure's, on a live and a dead sandbox.
	t.Run("classification", func(t *testing.T) {
		live, err := b.connect.Reset(ctx, connect.NewRequest(&deltagymv1.ResetRequest{Env: "plain"}))
		must(t, err)
		liveBox, err := b.srv.Runtime().Get(live.Msg.GetSandboxId())
		must(t, err)
		dead, err := b.connect.Reset(ctx, connect.NewRequest(&deltagymv1.ResetRequest{Env: "plain"}))
		must(t, err)
		deadBox, err := b.srv.Runtime().Get(dead.Msg.GetSandboxId())
		must(t, err)
		must(t, unix.Kill(deadBox.InitPid(), unix.SIGKILL))
		select {
		case <-deadBox.Done():
		case <-time.After(20 * time.Second):
			t.Fatal("sandbox not destroyed 20s after its init was killed")
		}
		aborted, abort := context.WithCancelCause(ctx)
		abort(envpool.ErrAborted) // as Lease.Abort does for Restore, Close and the reaper
		cancelled, cancel := context.WithCancel(ctx)
		cancel()
		cases := []struct {
			name        string
			ctx         context.Context
			box         *sandbox.Sandbox
			err         error
			gone, infra bool
		}{
			{"no error", ctx, liveBox, nil, false, false},
			{"bad input", ctx, liveBox, fmt.Errorf("path: %w", sandbox.ErrInvalid), false, false},
			{"disk budget", ctx, liveBox, fmt.Errorf("write: %w", sandbox.ErrBudget), false, false},
			{"ended session, live sandbox", ctx, liveBox, fmt.Errorf("%w: session s has ended", sandbox.ErrClosed), false, false},
			{"closed, init dead", ctx, deadBox, fmt.Errorf("%w: the sandbox's init went away", sandbox.ErrClosed), true, true},
			{"exec aborted by the runtime", ctx, deadBox, fmt.Errorf("%w: the sandbox was restored or closed", sandbox.ErrAborted), true, true},
			{"aborted by restore or close", aborted, liveBox, fmt.Errorf("%w: x", sandbox.ErrAborted), false, false},
			{"caller cancelled", cancelled, liveBox, fmt.Errorf("command cut short: %w", context.Canceled), false, false},
			{"internal", ctx, liveBox, errors.New("opening cgroup.procs: too many open files"), false, true},
		}
		for _, tc := range cases {
			t.Run(tc.name, func(t *testing.T) {
				gone, infra := server.InfraFailure(tc.ctx, tc.box, tc.err)
				if gone != tc.gone || infra != tc.infra {
					t.Fatalf("infraFailure(%v) = gone %v, infra %v; want %v, %v", tc.err, gone, infra, tc.gone, tc.infra)
				}
			})
		}
	})
}

// TestVerifierFailure submits to envs whose verifier crashes or prints no reward: the step
// answers terminated with the verifier's error, and the episode ends failed with class verifier.
func TestVerifierFailure(t *testing.T) {
	b := setup(t, nil)
	ctx := t.Context()
	cases := []struct {
		name, verifier, wantErr string
	}{
		{"crashes", "echo partial; kill -SEGV $$", "verifier exited"},
		{"exits non-zero", "echo 1; exit 3", "verifier exited 3"},
		{"prints no reward", "true", "printed no reward"},
		{"prints garbage", "echo 'the answer is yes'", "neither a number"},
	}
	for i, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			name := "verif" + string(rune('a'+i))
			b.register(t, &deltagymv1.EnvSpec{Name: name, PoolSize: 1, Verifier: tc.verifier})
			rr, err := b.connect.Reset(ctx, connect.NewRequest(&deltagymv1.ResetRequest{Env: name}))
			must(t, err)
			st, err := b.connect.Step(ctx, connect.NewRequest(&deltagymv1.StepRequest{SandboxId: rr.Msg.GetSandboxId(),
				Action: &deltagymv1.Action{Kind: &deltagymv1.Action_Submit{Submit: &deltagymv1.SubmitAction{}}}}))
			must(t, err)
			if !st.Msg.GetTerminated() || !strings.Contains(st.Msg.GetInfo()["verifier_error"], tc.wantErr) {
				t.Fatalf("submit: %v", st.Msg)
			}
			ep := b.episode(t, rr.Msg.GetEpisodeId())
			e := ep.GetEpisode()
			if e.GetStatus() != deltagymv1.EpisodeStatus_EPISODE_STATUS_FAILED || e.GetFailureClass() != deltagymv1.FailureClass_FAILURE_CLASS_VERIFIER {
				t.Fatalf("episode after a failed verifier: %v", e)
			}
			if m := e.GetFailureMessage(); !strings.HasPrefix(m, "the verifier failed: ") || !strings.Contains(m, tc.wantErr) {
				t.Fatalf("failure message %q, want the verifier's error (%q)", m, tc.wantErr)
			}
			if len(ep.GetSteps()) != 1 || !ep.GetSteps()[0].GetTerminated() {
				t.Fatalf("recorded steps: %v", ep.GetSteps())
			}
		})
	}
}

// A step's large output is cut in the ledger, and what the step did is kept: its exit status,
// the size and sum of the whole observation.
func TestLargeObservationRecorded(t *testing.T) {
	b := setup(t, nil)
	rr, err := b.grpc.Reset(t.Context(), &deltagymv1.ResetRequest{Env: "plain"})
	must(t, err)
	_, err = b.grpc.Step(t.Context(), &deltagymv1.StepRequest{SandboxId: rr.GetSandboxId(), Action: execAction("head -c 200000 /dev/zero | tr '\\0' a; exit 7")})
	must(t, err)
	st := b.episode(t, rr.GetEpisodeId()).GetSteps()[0]
	x := st.GetObservation().GetExec()
	if x.GetExitCode() != 7 || len(x.GetStdout()) != episode.ObservationBulkCap/4 || st.GetObservationSizeBytes() < 200_000 {
		t.Fatalf("the recorded step: exit %d, %d bytes of stdout, size %d", x.GetExitCode(), len(x.GetStdout()), st.GetObservationSizeBytes())
	}
}

// A step whose caller goes away while the action runs is a step: what it did stays, so it is
// recorded and counted, and the caller gets its own error.
func TestStepCutByCaller(t *testing.T) {
	b := setup(t, nil)
	rr, err := b.grpc.Reset(t.Context(), &deltagymv1.ResetRequest{Env: "plain"})
	must(t, err)
	ctx, cancel := context.WithTimeout(t.Context(), 2*time.Second)
	defer cancel()
	_, err = b.grpc.Step(ctx, &deltagymv1.StepRequest{SandboxId: rr.GetSandboxId(), Action: execAction("touch /tmp/side; sleep 60")})
	if codeOf(err) != connect.CodeDeadlineExceeded {
		t.Fatalf("a step past its caller's deadline: %v", err)
	}
	r, err := b.grpc.Step(t.Context(), &deltagymv1.StepRequest{SandboxId: rr.GetSandboxId(), Action: execAction("ls /tmp/side")})
	must(t, err)
	if r.GetStepIndex() != 1 {
		t.Fatalf("the step after a cut one has index %d, want 1", r.GetStepIndex())
	}
	st := b.episode(t, rr.GetEpisodeId()).GetSteps()
	if len(st) != 2 || st[0].GetObservation().GetError().GetErrnoName() != "ECANCELED" {
		t.Fatalf("the recorded steps: %v", st)
	}
}
