package server_test

import (
	"errors"
	"io"
	"slices"
	"testing"
	"time"

	"connectrpc.com/connect"

	deltagymv1 "github.com/deltagym/deltagym/clients/go/gen/deltagym/v1"
)

// setupFlags lists the setup flags of a trajectory's steps, in order.
func setupFlags(tr *deltagymv1.GetTrajectoryResponse) []bool {
	var out []bool
	for _, s := range tr.GetSteps() {
		out = append(out, s.GetSetup())
	}
	return out
}

// TestSetupSteps checks setup steps over Connect and gRPC on an env of two agent steps: they
// are numbered and recorded as setup steps, count against no step budget, and the agent's
// steps a checkpoint holds still count after a restore of it and in a fork of it.
func TestSetupSteps(t *testing.T) {
	b := setup(t, nil)
	for _, cl := range b.clients() {
		t.Run(cl.name, func(t *testing.T) {
			c, ctx := cl.c, t.Context()
			rr, err := c.Reset(ctx, &deltagymv1.ResetRequest{Env: "short"})
			must(t, err)
			sb := rr.GetSandboxId()
			defer c.Close(ctx, &deltagymv1.CloseRequest{SandboxId: sb})
			step := func(r *deltagymv1.StepRequest, index, left int32, truncated bool) *deltagymv1.StepResponse {
				t.Helper()
				if r.SandboxId == "" {
					r.SandboxId = sb
				}
				st, err := c.Step(ctx, r)
				must(t, err)
				if st.GetStepIndex() != index || st.GetStepsLeft() != left || st.GetTruncated() != truncated {
					t.Fatalf("step %v: index %d, steps_left %d, truncated %v; want %d, %d, %v", r, st.GetStepIndex(), st.GetStepsLeft(),
						st.GetTruncated(), index, left, truncated)
				}
				return st
			}
			step(&deltagymv1.StepRequest{Action: execAction("echo set > /tmp/setup"), Setup: true}, 0, 2, false)
			_, err = c.Step(ctx, &deltagymv1.StepRequest{SandboxId: sb, Setup: true, Action: &deltagymv1.Action{Kind: &deltagymv1.Action_Submit{Submit: &deltagymv1.SubmitAction{}}}})
			if codeOf(err) != connect.CodeInvalidArgument {
				t.Fatalf("a setup submit: %v, want invalid_argument", err)
			}
			ckpt := step(&deltagymv1.StepRequest{Action: execAction("cat /tmp/setup"), Checkpoint: true}, 1, 1, false).GetCheckpointId()
			step(&deltagymv1.StepRequest{Action: execAction("true"), Setup: true}, 2, 1, false)
			last := step(&deltagymv1.StepRequest{Action: execAction("true")}, 3, 0, true)
			if last.GetInfo()["truncated_by"] != "max_steps" {
				t.Fatalf("the second agent step was truncated by %q", last.GetInfo()["truncated_by"])
			}
			if got, want := setupFlags(b.episode(t, rr.GetEpisodeId())), []bool{true, false, true, false}; !slices.Equal(got, want) {
				t.Fatalf("recorded setup flags %v, want %v", got, want)
			}

			// Restored at the checkpoint (two steps, one the agent's), the episode has one agent
			// step left, whatever setup steps it takes first.
			st := step(&deltagymv1.StepRequest{Action: execAction("true"), Setup: true, RestoreCheckpointId: ckpt}, 2, 1, false)
			step(&deltagymv1.StepRequest{Action: execAction("true"), Setup: true}, 3, 1, false)
			step(&deltagymv1.StepRequest{Action: execAction("true")}, 4, 0, true)
			if got, want := setupFlags(b.episode(t, st.GetEpisodeId())), []bool{true, false, true, true, false}; !slices.Equal(got, want) {
				t.Fatalf("restored episode's setup flags %v, want %v", got, want)
			}

			// So is a fork of it.
			fr, err := c.Fork(ctx, &deltagymv1.ForkRequest{Source: &deltagymv1.ForkRequest_CheckpointId{CheckpointId: ckpt}, N: 1})
			must(t, err)
			child := fr.GetSandboxIds()[0]
			defer c.Close(ctx, &deltagymv1.CloseRequest{SandboxId: child})
			step(&deltagymv1.StepRequest{SandboxId: child, Action: execAction("test -f /tmp/setup")}, 2, 0, true)
		})
	}
}

// TestSetupStepTime checks that a setup step's time is not counted in max_seconds: a setup step
// longer than the budget runs whole, and the agent's step after it is not truncated.
func TestSetupStepTime(t *testing.T) {
	b := setup(t, nil)
	const budget = time.Second
	b.register(t, &deltagymv1.EnvSpec{Name: "timedsetup", PoolSize: 1, Budgets: &deltagymv1.Budgets{MaxSeconds: budget.Seconds()}})
	ctx := t.Context()
	rr, err := b.connect.Reset(ctx, connect.NewRequest(&deltagymv1.ResetRequest{Env: "timedsetup"}))
	must(t, err)
	sb := rr.Msg.GetSandboxId()
	st, err := b.connect.Step(ctx, connect.NewRequest(&deltagymv1.StepRequest{SandboxId: sb, Setup: true, Action: execAction("sleep 1.5; echo done")}))
	must(t, err)
	if st.Msg.GetTruncated() || st.Msg.GetObservation().GetExec().GetTimedOut() || stdout(t, st.Msg) != "done\n" || st.Msg.GetStepsLeft() != -1 {
		t.Fatalf("a setup step longer than the time budget: %v", st.Msg)
	}
	st, err = b.connect.Step(ctx, connect.NewRequest(&deltagymv1.StepRequest{SandboxId: sb, Action: execAction("echo agent")}))
	must(t, err)
	if st.Msg.GetTruncated() || stdout(t, st.Msg) != "agent\n" {
		t.Fatalf("the agent's step after a long setup step: %v", st.Msg)
	}
	// The agent's own time still counts.
	st, err = b.connect.Step(ctx, connect.NewRequest(&deltagymv1.StepRequest{SandboxId: sb, Action: execAction("sleep 5")}))
	must(t, err)
	if !st.Msg.GetTruncated() || st.Msg.GetInfo()["truncated_by"] != "max_seconds" {
		t.Fatalf("the agent's step past the budget: %v", st.Msg)
	}
}

// TestSetupStepOnStream checks that a setup step passes through StepStream.
func TestSetupStepOnStream(t *testing.T) {
	b := setup(t, nil)
	ctx := t.Context()
	rr, err := b.connect.Reset(ctx, connect.NewRequest(&deltagymv1.ResetRequest{Env: "short"}))
	must(t, err)
	s := b.connect.StepStream(ctx)
	for i, setup := range []bool{true, false} {
		must(t, s.Send(&deltagymv1.StepStreamRequest{RequestId: uint64(i + 1), Step: &deltagymv1.StepRequest{SandboxId: rr.Msg.GetSandboxId(),
			Action: execAction("true"), Setup: setup}}))
	}
	must(t, s.CloseRequest())
	var left []int32
	for {
		r, err := s.Receive()
		if errors.Is(err, io.EOF) {
			break
		}
		must(t, err)
		left = append(left, r.GetStep().GetStepsLeft())
	}
	must(t, s.CloseResponse())
	if len(left) != 2 || left[0] != 2 || left[1] != 1 {
		t.Fatalf("steps_left on the stream: %v, want [2 1]", left)
	}
	if got, want := setupFlags(b.episode(t, rr.Msg.GetEpisodeId())), []bool{true, false}; !slices.Equal(got, want) {
		t.Fatalf("recorded setup flags %v, want %v", got, want)
	}
}
