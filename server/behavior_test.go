package server_test

import (
	"bytes"
	"context"
	"errors"
	"io"
	"math"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"connectrpc.com/connect"

	deltagymv1 "github.com/deltagym/deltagym/clients/go/gen/deltagym/v1"
	"github.com/deltagym/deltagym/server"
)

func TestBadInput(t *testing.T) {
	b := setup(t, func(c *server.Config) { c.MaxRequestBytes = 1 << 20 })
	rr, err := b.connect.Reset(t.Context(), connect.NewRequest(&deltagymv1.ResetRequest{Env: "plain"}))
	must(t, err)
	sb := rr.Msg.GetSandboxId()
	// A checkpoint of another env (of the same image).
	other, err := b.connect.Reset(t.Context(), connect.NewRequest(&deltagymv1.ResetRequest{Env: "task"}))
	must(t, err)
	otherCk, err := b.connect.Checkpoint(t.Context(), connect.NewRequest(&deltagymv1.CheckpointRequest{SandboxId: other.Msg.GetSandboxId()}))
	must(t, err)
	cases := []struct {
		name string
		call func(c api) error
		want connect.Code
	}{
		{"unknown env", func(c api) error { _, err := c.Reset(t.Context(), &deltagymv1.ResetRequest{Env: "nope"}); return err }, connect.CodeNotFound},
		{"reset without env", func(c api) error { _, err := c.Reset(t.Context(), &deltagymv1.ResetRequest{}); return err }, connect.CodeInvalidArgument},
		{"bad option name", func(c api) error {
			_, err := c.Reset(t.Context(), &deltagymv1.ResetRequest{Env: "task", Options: map[string]string{"A=B": "x"}})
			return err
		}, connect.CodeInvalidArgument},
		{"unknown sandbox", func(c api) error {
			_, err := c.Step(t.Context(), &deltagymv1.StepRequest{SandboxId: "sb-nope", Action: execAction("true")})
			return err
		}, connect.CodeNotFound},
		{"no action", func(c api) error { _, err := c.Step(t.Context(), &deltagymv1.StepRequest{SandboxId: sb}); return err }, connect.CodeInvalidArgument},
		{"command and argv", func(c api) error {
			_, err := c.Step(t.Context(), &deltagymv1.StepRequest{SandboxId: sb, Action: &deltagymv1.Action{Kind: &deltagymv1.Action_Exec{
				Exec: &deltagymv1.ExecAction{Command: "true", Argv: []string{"true"}}}}})
			return err
		}, connect.CodeInvalidArgument},
		{"empty path", func(c api) error {
			_, err := c.Step(t.Context(), &deltagymv1.StepRequest{SandboxId: sb, Action: &deltagymv1.Action{Kind: &deltagymv1.Action_ReadFile{
				ReadFile: &deltagymv1.ReadFileAction{}}}})
			return err
		}, connect.CodeInvalidArgument},
		{"oversized payload", func(c api) error {
			_, err := c.Step(t.Context(), &deltagymv1.StepRequest{SandboxId: sb, Action: &deltagymv1.Action{Kind: &deltagymv1.Action_WriteFile{
				WriteFile: &deltagymv1.WriteFileAction{Path: "/tmp/big", Content: make([]byte, 2<<20)}}}})
			return err
		}, connect.CodeResourceExhausted},
		{"unknown checkpoint", func(c api) error {
			_, err := c.Restore(t.Context(), &deltagymv1.RestoreRequest{SandboxId: sb, CheckpointId: "ck-nope"})
			return err
		}, connect.CodeNotFound},
		{"undefined process mode", func(c api) error {
			_, err := c.Checkpoint(t.Context(), &deltagymv1.CheckpointRequest{SandboxId: sb, ProcessMode: deltagymv1.ProcessMode(7)})
			return err
		}, connect.CodeInvalidArgument},
		{"checkpoint of another env", func(c api) error {
			_, err := c.Restore(t.Context(), &deltagymv1.RestoreRequest{SandboxId: sb, CheckpointId: otherCk.Msg.GetCheckpointId()})
			if err != nil && !strings.Contains(err.Error(), "fork the checkpoint") {
				t.Errorf("restore of another env's checkpoint: %v, want a hint to fork it", err)
			}
			return err
		}, connect.CodeFailedPrecondition},
		{"fork n 0", func(c api) error {
			_, err := c.Fork(t.Context(), &deltagymv1.ForkRequest{Source: &deltagymv1.ForkRequest_SandboxId{SandboxId: sb}})
			return err
		}, connect.CodeInvalidArgument},
		{"bad spec", func(c api) error {
			_, err := c.RegisterEnv(t.Context(), &deltagymv1.RegisterEnvRequest{Spec: &deltagymv1.EnvSpec{Name: "Bad Name", Image: "default"}})
			return err
		}, connect.CodeInvalidArgument},
		{"env exists", func(c api) error {
			_, err := c.RegisterEnv(t.Context(), &deltagymv1.RegisterEnvRequest{Spec: &deltagymv1.EnvSpec{Name: "plain", Image: "default"}})
			return err
		}, connect.CodeAlreadyExists},
		{"run too long", func(c api) error {
			_, err := c.Reset(t.Context(), &deltagymv1.ResetRequest{Env: "plain", Run: strings.Repeat("r", 64<<10)})
			return err
		}, connect.CodeInvalidArgument},
		{"option value with NUL", func(c api) error {
			_, err := c.Reset(t.Context(), &deltagymv1.ResetRequest{Env: "task", Options: map[string]string{"A": "b\x00c"}})
			return err
		}, connect.CodeInvalidArgument},
		{"idempotency key too long", func(c api) error {
			_, err := c.Reset(t.Context(), &deltagymv1.ResetRequest{Env: "nope", IdempotencyKey: strings.Repeat("k", 64<<10)})
			return err
		}, connect.CodeInvalidArgument},
		{"sandbox id too long", func(c api) error {
			_, err := c.Step(t.Context(), &deltagymv1.StepRequest{SandboxId: strings.Repeat("s", 64<<10), Action: execAction("true")})
			if err != nil && len(err.Error()) > 1000 {
				t.Errorf("the error quotes the id: %d bytes", len(err.Error()))
			}
			return err
		}, connect.CodeInvalidArgument},
		{"group too long for a fork", func(c api) error {
			_, err := c.Fork(t.Context(), &deltagymv1.ForkRequest{Source: &deltagymv1.ForkRequest_SandboxId{SandboxId: sb}, N: 1, GroupId: strings.Repeat("g", 64<<10)})
			return err
		}, connect.CodeInvalidArgument},
		{"unknown image format", func(c api) error {
			_, err := c.ImportImage(t.Context(), &deltagymv1.ImportImageRequest{Name: "x", Path: b.busybox, Format: deltagymv1.ImageFormat(99)})
			return err
		}, connect.CodeInvalidArgument},
		{"reward not a number", func(c api) error {
			_, err := c.ReportReward(t.Context(), &deltagymv1.ReportRewardRequest{EpisodeId: rr.Msg.GetEpisodeId(), Name: "r", Value: math.NaN()})
			return err
		}, connect.CodeInvalidArgument},
		{"unknown episode", func(c api) error {
			_, err := c.GetTrajectory(t.Context(), &deltagymv1.GetTrajectoryRequest{EpisodeId: "ep_nope"})
			return err
		}, connect.CodeNotFound},
	}
	for _, cl := range b.clients() {
		for _, tc := range cases {
			t.Run(cl.name+"/"+tc.name, func(t *testing.T) {
				err := tc.call(cl.c)
				if codeOf(err) != tc.want {
					t.Fatalf("got %v, want %v", err, tc.want)
				}
				if err != nil && strings.Contains(err.Error(), os.TempDir()+"/dgsrv") {
					t.Fatalf("message leaks a host path: %v", err)
				}
				if repeatsCode(err) {
					t.Fatalf("message repeats its code: %v", err)
				}
			})
		}
	}
	// The sandbox still works after all that.
	st, err := b.connect.Step(t.Context(), connect.NewRequest(&deltagymv1.StepRequest{SandboxId: sb, Action: execAction("cat /tmp/plain")}))
	must(t, err)
	if stdout(t, st.Msg) != "plain\n" {
		t.Fatalf("state %q", stdout(t, st.Msg))
	}
}

func TestBudgetTruncates(t *testing.T) {
	b := setup(t, func(c *server.Config) { c.NoLedger = true })
	rr, err := b.grpc.Reset(t.Context(), &deltagymv1.ResetRequest{Env: "short"})
	must(t, err)
	st, err := b.grpc.Step(t.Context(), &deltagymv1.StepRequest{SandboxId: rr.GetSandboxId(), Action: execAction("true")})
	must(t, err)
	if st.GetTruncated() {
		t.Fatal("truncated after 1 of 2 steps")
	}
	st, err = b.grpc.Step(t.Context(), &deltagymv1.StepRequest{SandboxId: rr.GetSandboxId(), Action: execAction("true")})
	must(t, err)
	if !st.GetTruncated() || st.GetTerminated() {
		t.Fatalf("second of 2 steps: %v", st)
	}
	_, err = b.grpc.Step(t.Context(), &deltagymv1.StepRequest{SandboxId: rr.GetSandboxId(), Action: execAction("true")})
	if codeOf(err) != connect.CodeFailedPrecondition {
		t.Fatalf("step after truncation: %v", err)
	}
}

func TestIdempotentRetries(t *testing.T) {
	b := setup(t, func(c *server.Config) { c.NoLedger = true })
	for _, cl := range b.clients() {
		t.Run(cl.name, func(t *testing.T) {
			key := "k-" + cl.name
			var wg sync.WaitGroup
			ids := make([]string, 4)
			for i := range ids {
				wg.Go(func() {
					r, err := cl.c.Reset(t.Context(), &deltagymv1.ResetRequest{Env: "plain", IdempotencyKey: key})
					if err == nil {
						ids[i] = r.GetSandboxId()
					}
				})
			}
			wg.Wait()
			for _, id := range ids {
				if id == "" || id != ids[0] {
					t.Fatalf("retried resets gave %v", ids)
				}
			}
			f1, err := cl.c.Fork(t.Context(), &deltagymv1.ForkRequest{Source: &deltagymv1.ForkRequest_SandboxId{SandboxId: ids[0]}, N: 3, IdempotencyKey: key})
			must(t, err)
			f2, err := cl.c.Fork(t.Context(), &deltagymv1.ForkRequest{Source: &deltagymv1.ForkRequest_SandboxId{SandboxId: ids[0]}, N: 3, IdempotencyKey: key})
			must(t, err)
			if strings.Join(f1.GetSandboxIds(), ",") != strings.Join(f2.GetSandboxIds(), ",") {
				t.Fatalf("retried fork: %v then %v", f1.GetSandboxIds(), f2.GetSandboxIds())
			}
			// The key reused for another request: refused, nothing made.
			_, err = cl.c.Fork(t.Context(), &deltagymv1.ForkRequest{Source: &deltagymv1.ForkRequest_SandboxId{SandboxId: ids[0]}, N: 2, IdempotencyKey: key})
			if got := codeOf(err); got != connect.CodeInvalidArgument || !strings.Contains(err.Error(), "different fork request") {
				t.Fatalf("fork with a reused key and another n: %v (%v), want invalid_argument naming the reuse", err, got)
			}
			ls, err := cl.c.ListSandboxes(t.Context(), &deltagymv1.ListSandboxesRequest{Env: "plain"})
			must(t, err)
			n := 0
			for _, s := range ls.GetSandboxes() {
				if s.GetSandboxId() == ids[0] || strings.Contains(strings.Join(f1.GetSandboxIds(), ","), s.GetSandboxId()) {
					n++
				}
			}
			if n != 4 {
				t.Fatalf("%d of the 4 sandboxes listed", n)
			}
		})
	}
}

func TestPoolBurst(t *testing.T) {
	b := setup(t, func(c *server.Config) { c.NoLedger = true })
	const burst = 12 // pool size of "plain" is 4
	var wg sync.WaitGroup
	errs := make([]error, burst)
	start := time.Now()
	for i := range burst {
		wg.Go(func() {
			_, errs[i] = b.connect.Reset(t.Context(), connect.NewRequest(&deltagymv1.ResetRequest{Env: "plain"}))
		})
	}
	wg.Wait()
	for i, err := range errs {
		if err != nil && codeOf(err) != connect.CodeResourceExhausted {
			t.Fatalf("reset %d: %v", i, err)
		}
	}
	t.Logf("burst of %d resets on a pool of 4 took %v", burst, time.Since(start))
}

func TestPoolExhausted(t *testing.T) {
	b := setup(t, func(c *server.Config) { c.NoLedger = true; c.AcquireTimeout = time.Millisecond })
	// "short" has a pool of 1; with a 1 ms acquire deadline, a burst must see ResourceExhausted
	// rather than wait.
	exhausted := 0
	for range 20 {
		_, err := b.connect.Reset(t.Context(), connect.NewRequest(&deltagymv1.ResetRequest{Env: "short"}))
		switch codeOf(err) {
		case 0:
		case connect.CodeResourceExhausted:
			exhausted++
		default:
			t.Fatal(err)
		}
	}
	if exhausted == 0 {
		t.Fatal("20 back-to-back resets on a pool of 1 with a 1ms deadline never got ResourceExhausted")
	}
}

func TestLeaseExpiry(t *testing.T) {
	b := setup(t, func(c *server.Config) { c.Lease.TTL = 300 * time.Millisecond })
	rr, err := b.connect.Reset(t.Context(), connect.NewRequest(&deltagymv1.ResetRequest{Env: "plain"}))
	must(t, err)
	kept, err := b.connect.Reset(t.Context(), connect.NewRequest(&deltagymv1.ResetRequest{Env: "plain"}))
	must(t, err)
	id := rr.Msg.GetSandboxId()
	deadline := time.Now().Add(10 * time.Second)
	for {
		// Heartbeats keep the second sandbox alive while the first expires.
		_, err := b.connect.Heartbeat(t.Context(), connect.NewRequest(&deltagymv1.HeartbeatRequest{SandboxIds: []string{kept.Msg.GetSandboxId()}}))
		must(t, err)
		_, err = b.srv.Runtime().Get(id)
		if err != nil {
			break
		}
		if time.Now().After(deadline) {
			t.Fatal("sandbox not reaped 10s after its 300ms lease")
		}
		time.Sleep(50 * time.Millisecond) // polling interval, not synchronisation
	}
	_, err = b.connect.Step(t.Context(), connect.NewRequest(&deltagymv1.StepRequest{SandboxId: id, Action: execAction("true")}))
	if codeOf(err) != connect.CodeFailedPrecondition {
		t.Fatalf("step on a reaped sandbox: %v", err)
	}
	_, err = b.connect.Step(t.Context(), connect.NewRequest(&deltagymv1.StepRequest{SandboxId: kept.Msg.GetSandboxId(), Action: execAction("true")}))
	must(t, err)
	// Its checkpoint survives: the episode's start state can still be forked.
	_, err = b.connect.Fork(t.Context(), connect.NewRequest(&deltagymv1.ForkRequest{Source: &deltagymv1.ForkRequest_CheckpointId{CheckpointId: rr.Msg.GetCheckpointId()}, N: 1}))
	must(t, err)
	tr, err := b.ledger.GetTrajectory(t.Context(), connect.NewRequest(&deltagymv1.GetTrajectoryRequest{EpisodeId: rr.Msg.GetEpisodeId()}))
	must(t, err)
	if s := tr.Msg.GetEpisode().GetStatus(); s != deltagymv1.EpisodeStatus_EPISODE_STATUS_TRUNCATED {
		t.Fatalf("reaped episode status %v", s)
	}
}

func TestRestoreAbortsExec(t *testing.T) {
	b := setup(t, func(c *server.Config) { c.NoLedger = true })
	rr, err := b.grpc.Reset(t.Context(), &deltagymv1.ResetRequest{Env: "plain"})
	must(t, err)
	sb := rr.GetSandboxId()
	done := make(chan error, 1)
	go func() {
		_, err := b.grpc.Step(context.Background(), &deltagymv1.StepRequest{SandboxId: sb, Action: execAction("echo started > /tmp/s; sleep 30")})
		done <- err
	}()
	for { // wait until the exec runs
		st, err := b.srv.Runtime().Get(sb)
		must(t, err)
		if _, _, err := st.ReadFile(t.Context(), "/tmp/s", 0, 0); err == nil {
			break
		}
		time.Sleep(10 * time.Millisecond) // polling interval
	}
	start := time.Now()
	_, err = b.grpc.Restore(t.Context(), &deltagymv1.RestoreRequest{SandboxId: sb, CheckpointId: rr.GetCheckpointId()})
	must(t, err)
	err = <-done
	if codeOf(err) != connect.CodeAborted {
		t.Fatalf("running exec: %v, want Aborted", err)
	}
	if n := strings.Count(err.Error(), "restore or close"); n != 1 {
		t.Fatalf("running exec: %q says why %d times", err, n)
	}
	if d := time.Since(start); d > 10*time.Second {
		t.Fatalf("restore waited %v for the exec", d)
	}
}

// TestStepDeadline: a step cut short by the caller's own deadline answers DeadlineExceeded, not
// Aborted (which means a Restore or Close ended it), for a plain exec and a session command alike.
func TestStepDeadline(t *testing.T) {
	b := setup(t, func(c *server.Config) { c.NoLedger = true })
	rr, err := b.grpc.Reset(t.Context(), &deltagymv1.ResetRequest{Env: "plain"})
	must(t, err)
	// busybox has no bash: stand ash in for it.
	_, err = b.grpc.Step(t.Context(), &deltagymv1.StepRequest{SandboxId: rr.GetSandboxId(), Action: execAction("printf '#!/bin/sh\\nexec /bin/busybox ash\\n' > /bin/bash && chmod +x /bin/bash")})
	must(t, err)
	for _, a := range []*deltagymv1.Action{execAction("sleep 30"), sessionAction("sleep 30")} {
		ctx, cancel := context.WithTimeout(t.Context(), 300*time.Millisecond)
		_, err := b.grpc.Step(ctx, &deltagymv1.StepRequest{SandboxId: rr.GetSandboxId(), Action: a})
		cancel()
		if codeOf(err) != connect.CodeDeadlineExceeded {
			t.Fatalf("step past the caller's deadline: %v, want DeadlineExceeded", err)
		}
	}
	// The sandbox serves the next step.
	_, err = b.grpc.Step(t.Context(), &deltagymv1.StepRequest{SandboxId: rr.GetSandboxId(), Action: execAction("true")})
	must(t, err)
}

// TestStepStreamConcurrent sends 32 `sleep 0.2` steps on 32 sandboxes through one stream; the
// run intervals the server recorded must overlap. A step on an unknown sandbox gets an error item
// and the stream goes on.
func TestStepStreamConcurrent(t *testing.T) {
	b := setup(t, nil)
	ctx := t.Context()
	rr, err := b.connect.Reset(ctx, connect.NewRequest(&deltagymv1.ResetRequest{Env: "plain"}))
	must(t, err)
	fk, err := b.connect.Fork(ctx, connect.NewRequest(&deltagymv1.ForkRequest{Source: &deltagymv1.ForkRequest_SandboxId{SandboxId: rr.Msg.GetSandboxId()}, N: 32}))
	must(t, err)
	stream := b.connect.StepStream(ctx)
	for i, id := range fk.Msg.GetSandboxIds() {
		must(t, stream.Send(&deltagymv1.StepStreamRequest{RequestId: uint64(i), Step: &deltagymv1.StepRequest{SandboxId: id, Action: execAction("sleep 0.2")}}))
	}
	must(t, stream.Send(&deltagymv1.StepStreamRequest{RequestId: 999, Step: &deltagymv1.StepRequest{SandboxId: "sb-nope", Action: execAction("true")}}))
	// Two ordered steps on one sandbox.
	first := fk.Msg.GetSandboxIds()[0]
	must(t, stream.Send(&deltagymv1.StepStreamRequest{RequestId: 1000, Step: &deltagymv1.StepRequest{SandboxId: first, Action: execAction("echo a >> /tmp/order")}}))
	must(t, stream.Send(&deltagymv1.StepStreamRequest{RequestId: 1001, Step: &deltagymv1.StepRequest{SandboxId: first, Action: execAction("echo b >> /tmp/order; cat /tmp/order")}}))
	must(t, stream.CloseRequest())
	got := map[uint64]*deltagymv1.StepStreamResponse{}
	for {
		r, err := stream.Receive()
		if errors.Is(err, io.EOF) {
			break
		}
		must(t, err)
		got[r.GetRequestId()] = r
	}
	must(t, stream.CloseResponse())
	if len(got) != 35 {
		t.Fatalf("%d responses, want 35", len(got))
	}
	if e := got[999].GetError(); e == nil || connect.Code(e.GetCode()) != connect.CodeNotFound {
		t.Fatalf("unknown sandbox item: %v", got[999])
	}
	if out := string(got[1001].GetStep().GetObservation().GetExec().GetStdout()); out != "a\nb\n" {
		t.Fatalf("ordered steps: %q", out)
	}
	var latestStart, earliestEnd time.Time
	for i, id := range fk.Msg.GetSandboxIds() {
		if got[uint64(i)].GetError() != nil {
			t.Fatalf("step %d: %v", i, got[uint64(i)].GetError())
		}
		tr, err := b.ledger.GetTrajectory(ctx, connect.NewRequest(&deltagymv1.GetTrajectoryRequest{EpisodeId: fk.Msg.GetEpisodeIds()[i]}))
		must(t, err)
		if len(tr.Msg.GetSteps()) == 0 {
			t.Fatalf("sandbox %s: no step recorded", id)
		}
		s := tr.Msg.GetSteps()[0]
		start := s.GetStartTime().AsTime()
		end := start.Add(time.Duration(s.GetDurationSeconds() * float64(time.Second)))
		if latestStart.IsZero() || start.After(latestStart) {
			latestStart = start
		}
		if earliestEnd.IsZero() || end.Before(earliestEnd) {
			earliestEnd = end
		}
	}
	if !latestStart.Before(earliestEnd) {
		t.Fatalf("the 32 steps did not all overlap: last start %v, first end %v", latestStart, earliestEnd)
	}
}

// TestShutdownLeavesNothing closes a server with live sandboxes and looks for leftovers.
func TestShutdownLeavesNothing(t *testing.T) {
	b := setup(t, func(c *server.Config) { c.NoLedger = true })
	for range 3 {
		_, err := b.connect.Reset(t.Context(), connect.NewRequest(&deltagymv1.ResetRequest{Env: "plain"}))
		must(t, err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	must(t, b.srv.Close(ctx))
	cgs, _ := filepath.Glob("/sys/fs/cgroup/*/" + b.cgroup + "/*")
	cgs2, _ := filepath.Glob("/sys/fs/cgroup/*/*/" + b.cgroup + "/*")
	var left []string
	for _, p := range append(cgs, cgs2...) {
		if st, err := os.Stat(p); err == nil && st.IsDir() {
			left = append(left, p)
		}
	}
	if len(left) > 0 {
		t.Fatalf("sandbox cgroups left: %v", left)
	}
	procs, _ := filepath.Glob("/proc/[0-9]*/cgroup")
	for _, p := range procs {
		data, err := os.ReadFile(p)
		if err == nil && bytes.Contains(data, []byte("/"+b.cgroup+"/")) {
			comm, _ := os.ReadFile(filepath.Join(filepath.Dir(p), "comm"))
			t.Errorf("process %s (%s) left in the server's cgroups", filepath.Dir(p), bytes.TrimSpace(comm))
		}
	}
}

// TestStepStreamGRPC runs StepStream through the grpc-go client.
func TestStepStreamGRPC(t *testing.T) {
	b := setup(t, func(c *server.Config) { c.NoLedger = true })
	ctx := t.Context()
	var ids []string
	for range 2 {
		r, err := b.grpc.Reset(ctx, &deltagymv1.ResetRequest{Env: "plain"})
		must(t, err)
		ids = append(ids, r.GetSandboxId())
	}
	st, err := b.grpc.StepStream(ctx)
	must(t, err)
	for i, cmd := range []string{"echo 1 > /tmp/x", "cat /tmp/x"} {
		for j, id := range ids {
			must(t, st.Send(&deltagymv1.StepStreamRequest{RequestId: uint64(10*i + j), Step: &deltagymv1.StepRequest{SandboxId: id, Action: execAction(cmd)}}))
		}
	}
	must(t, st.Send(&deltagymv1.StepStreamRequest{RequestId: 99, Step: &deltagymv1.StepRequest{SandboxId: ids[0]}}))
	must(t, st.CloseSend())
	got := recvAll(t, st)
	if len(got) != 5 || string(got[10].GetStep().GetObservation().GetExec().GetStdout()) != "1\n" ||
		string(got[11].GetStep().GetObservation().GetExec().GetStdout()) != "1\n" {
		t.Fatalf("responses %v", got)
	}
	if e := got[99].GetError(); e == nil || connect.Code(e.GetCode()) != connect.CodeInvalidArgument {
		t.Fatalf("malformed item: %v", got[99])
	}
}

// TestServeAfterClose: a Serve that starts after Close (its goroutine was started just
// before Close ran) returns at once with its listener closed, instead of serving forever
// and leaving whoever waits for it hanging.
func TestServeAfterClose(t *testing.T) {
	b := setup(t, func(c *server.Config) { c.NoLedger = true })
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	if err := b.srv.Close(ctx); err != nil {
		t.Fatal(err)
	}
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	served := make(chan error, 1)
	go func() { served <- b.srv.Serve(ln) }()
	select {
	case err := <-served:
		if !errors.Is(err, http.ErrServerClosed) {
			t.Fatalf("Serve after Close: %v, want http.ErrServerClosed", err)
		}
	case <-time.After(10 * time.Second):
		ln.Close() // let the stray Serve end with the test
		t.Fatal("Serve after Close is still serving after 10 s")
	}
	if c, err := net.Dial("tcp", ln.Addr().String()); err == nil {
		c.Close()
		t.Fatal("the listener of a Serve after Close still accepts connections")
	}
}

// A step with restore_checkpoint_id restores first, as Restore does (a new episode whose
// indices continue from the checkpoint's step), then acts; over unary Step (Connect and gRPC)
// and StepStream. Bad requests change nothing.
func TestStepWithRestore(t *testing.T) {
	b := setup(t, nil)
	readF := &deltagymv1.Action{Kind: &deltagymv1.Action_ReadFile{ReadFile: &deltagymv1.ReadFileAction{Path: "/tmp/f"}}}
	writeF := func(s string) *deltagymv1.Action {
		return &deltagymv1.Action{Kind: &deltagymv1.Action_WriteFile{WriteFile: &deltagymv1.WriteFileAction{Path: "/tmp/f", Content: []byte(s)}}}
	}
	content := func(r *deltagymv1.StepResponse) string { return string(r.GetObservation().GetReadFile().GetContent()) }
	for _, cl := range b.clients() {
		t.Run(cl.name, func(t *testing.T) {
			c, ctx := cl.c, t.Context()
			rr, err := c.Reset(ctx, &deltagymv1.ResetRequest{Env: "plain"})
			must(t, err)
			sb := rr.GetSandboxId()
			w, err := c.Step(ctx, &deltagymv1.StepRequest{SandboxId: sb, Action: writeF("checkpointed"), Checkpoint: true})
			must(t, err)
			ck := w.GetCheckpointId() // after step 0
			_, err = c.Step(ctx, &deltagymv1.StepRequest{SandboxId: sb, Action: writeF("changed")})
			must(t, err)
			for i := range 2 {
				st, err := c.Step(ctx, &deltagymv1.StepRequest{SandboxId: sb, RestoreCheckpointId: ck, Action: readF})
				must(t, err)
				if content(st) != "checkpointed" || st.GetStepIndex() != 1 || st.GetEpisodeId() == rr.GetEpisodeId() {
					t.Fatalf("step %d with restore = %v", i, st)
				}
				gs, err := c.GetSandbox(ctx, &deltagymv1.GetSandboxRequest{SandboxId: sb})
				must(t, err)
				if gs.GetSandbox().GetEpisodeId() != st.GetEpisodeId() || gs.GetSandbox().GetNextStepIndex() != 2 {
					t.Fatalf("sandbox after a step with restore: %v (step %v)", gs.GetSandbox(), st)
				}
				_, err = c.Step(ctx, &deltagymv1.StepRequest{SandboxId: sb, Action: writeF("changed")})
				must(t, err)
			}
			// Refused, with nothing restored: an unknown checkpoint, a checkpoint of another
			// env, fresh entropy without a checkpoint, no action.
			other, err := c.Reset(ctx, &deltagymv1.ResetRequest{Env: "task"})
			must(t, err)
			bad := []struct {
				req  *deltagymv1.StepRequest
				code connect.Code
			}{
				{&deltagymv1.StepRequest{SandboxId: sb, RestoreCheckpointId: "ck-nope", Action: readF}, connect.CodeNotFound},
				{&deltagymv1.StepRequest{SandboxId: sb, RestoreCheckpointId: other.GetCheckpointId(), Action: readF}, connect.CodeFailedPrecondition},
				{&deltagymv1.StepRequest{SandboxId: sb, RestoreFreshEntropy: true, Action: readF}, connect.CodeInvalidArgument},
				{&deltagymv1.StepRequest{SandboxId: sb, RestoreCheckpointId: ck}, connect.CodeInvalidArgument},
			}
			for _, tc := range bad {
				if _, err := c.Step(ctx, tc.req); codeOf(err) != tc.code {
					t.Fatalf("step %v: %v, want %v", tc.req, err, tc.code)
				}
			}
			st, err := c.Step(ctx, &deltagymv1.StepRequest{SandboxId: sb, Action: readF})
			must(t, err)
			if content(st) != "changed" {
				t.Fatalf("a refused step with restore changed the sandbox: %q", content(st))
			}
		})
	}
	t.Run("stream", func(t *testing.T) {
		ctx := t.Context()
		rr, err := b.grpc.Reset(ctx, &deltagymv1.ResetRequest{Env: "plain"})
		must(t, err)
		sb := rr.GetSandboxId()
		w, err := b.grpc.Step(ctx, &deltagymv1.StepRequest{SandboxId: sb, Action: writeF("checkpointed"), Checkpoint: true})
		must(t, err)
		st, err := b.grpc.StepStream(ctx)
		must(t, err)
		reqs := []*deltagymv1.StepRequest{
			{SandboxId: sb, Action: writeF("changed")},
			{SandboxId: sb, RestoreCheckpointId: w.GetCheckpointId(), Action: readF},
			{SandboxId: sb, Action: writeF("changed again")},
			{SandboxId: sb, RestoreCheckpointId: w.GetCheckpointId(), RestoreFreshEntropy: true, Action: readF},
			{SandboxId: sb, RestoreCheckpointId: "ck-nope", Action: readF},
		}
		for i, r := range reqs {
			must(t, st.Send(&deltagymv1.StepStreamRequest{RequestId: uint64(i), Step: r}))
		}
		must(t, st.CloseSend())
		got := recvAll(t, st)
		for _, i := range []uint64{1, 3} {
			if s := got[i].GetStep(); content(s) != "checkpointed" || s.GetStepIndex() != 1 {
				t.Fatalf("stream step %d with restore: %v", i, got[i])
			}
		}
		if got[1].GetStep().GetEpisodeId() == got[3].GetStep().GetEpisodeId() {
			t.Fatalf("two restores on a stream share episode %s", got[1].GetStep().GetEpisodeId())
		}
		if e := got[4].GetError(); e == nil || connect.Code(e.GetCode()) != connect.CodeNotFound {
			t.Fatalf("stream step with an unknown checkpoint: %v", got[4])
		}
	})
}

// recvAll receives a gRPC StepStream's responses until it ends, by request ID.
func recvAll(t *testing.T, st interface {
	Recv() (*deltagymv1.StepStreamResponse, error)
}) map[uint64]*deltagymv1.StepStreamResponse {
	t.Helper()
	got := map[uint64]*deltagymv1.StepStreamResponse{}
	for {
		r, err := st.Recv()
		if errors.Is(err, io.EOF) {
			return got
		}
		must(t, err)
		got[r.GetRequestId()] = r
	}
}

// Over JSON, an enum value by a name the schema lacks is refused with InvalidArgument (naming
// it), not taken for unspecified; an unknown field is still ignored (a newer client's).
func TestJSONEnumNames(t *testing.T) {
	b := setup(t, func(c *server.Config) { c.NoLedger = true })
	post := func(body string) (int, string) {
		req, _ := http.NewRequestWithContext(t.Context(), "POST", "http://"+b.addr+"/deltagym.v1.EnvService/Checkpoint", strings.NewReader(body))
		req.Header.Set("Content-Type", "application/json")
		req.Header.Set("Authorization", "Bearer "+b.token)
		resp, err := http.DefaultClient.Do(req)
		must(t, err)
		defer resp.Body.Close()
		out, _ := io.ReadAll(resp.Body)
		return resp.StatusCode, string(out)
	}
	for _, tc := range []struct{ body, code, has string }{
		{`{"sandboxId":"sb-none","processMode":"CRIU"}`, "invalid_argument", `processMode: \"CRIU\" is not a value of ProcessMode (PROCESS_MODE_UNSPECIFIED, PROCESS_MODE_FILESYSTEM, PROCESS_MODE_TEMPLATE, PROCESS_MODE_CRIU, or their numbers)`},
		{`{"sandboxId":"sb-none","processMode":"PROCESS_MODE_CRIU"}`, "not_found", "sb-none"},
		{`{"sandboxId":"sb-none","processMode":3}`, "not_found", "sb-none"},
		{`{"sandboxId":"sb-none","fromANewerClient":{"x":1}}`, "not_found", "sb-none"},
		{`{"sandboxId":"sb-none","fromANewerClient":1,"processMode":"CRIU"}`, "invalid_argument", `processMode: \"CRIU\"`},
	} {
		status, body := post(tc.body)
		if !strings.Contains(body, `"code":"`+tc.code+`"`) || !strings.Contains(body, tc.has) {
			t.Errorf("%s: %d %s, want %s naming %s", tc.body, status, body, tc.code, tc.has)
		}
	}
}
