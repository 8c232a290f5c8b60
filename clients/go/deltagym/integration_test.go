package deltagym_test

import (
	"context"
	"errors"
	"io"
	"net"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"connectrpc.com/connect"

	deltagym "github.com/deltagym/deltagym/clients/go/deltagym"
	deltagymv1 "github.com/deltagym/deltagym/clients/go/gen/deltagym/v1"
)

// protocols are the wire protocols every RPC is checked through.
var protocols = []struct {
	name string
	opts []deltagym.Option
}{
	{"connect", nil},
	{"connect-json", []deltagym.Option{deltagym.WithProtoJSON()}},
	{"grpc", []deltagym.Option{deltagym.WithGRPC()}},
}

func dial(t *testing.T, opts ...deltagym.Option) *deltagym.Client {
	t.Helper()
	c, err := deltagym.Dial(testAddr, opts...)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = c.Close() })
	return c
}

func reset(t *testing.T, c *deltagym.Client, opts ...deltagym.EpisodeOption) *deltagym.Sandbox {
	t.Helper()
	sb, err := c.Reset(t.Context(), "shell", opts...)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = sb.Close(context.Background()) })
	return sb
}

// TestEveryRPC calls each wrapped RPC once through each protocol against the
// in-process server and checks what comes back.
func TestEveryRPC(t *testing.T) {
	needServer(t)
	for _, p := range protocols {
		t.Run(p.name, func(t *testing.T) {
			ctx := t.Context()
			c := dial(t, p.opts...)
			run := "rpc-" + p.name + "-" + deltagym.NewIdempotencyKey()[:6]

			envs, err := c.ListEnvs(ctx)
			if err != nil || len(envs) == 0 || envs[0].GetSpec().GetName() != "shell" {
				t.Fatalf("ListEnvs = %v, %v", envs, err)
			}

			sb := reset(t, c, deltagym.WithSeed(3), deltagym.WithRun(run), deltagym.WithGroup(run))
			if sb.ID() == "" || sb.EpisodeID() == "" || sb.StartCheckpointID() == "" || sb.LeaseExpiry().IsZero() {
				t.Fatalf("Reset handle: id %q episode %q checkpoint %q lease %v", sb.ID(), sb.EpisodeID(), sb.StartCheckpointID(), sb.LeaseExpiry())
			}
			if !strings.Contains(sb.Task(), "answer") {
				t.Errorf("Task() = %q", sb.Task())
			}

			ex, err := sb.Exec(ctx, "echo out; echo err >&2; exit 3", deltagym.WithEnv("X", "y"))
			if err != nil || string(ex.Stdout) != "out\n" || string(ex.Stderr) != "err\n" || ex.ExitCode != 3 || ex.OK() {
				t.Fatalf("Exec = %+v, %v", ex, err)
			}
			run2, err := sb.Run(ctx, []string{"printenv", "X"}, deltagym.WithEnv("X", "from argv"), deltagym.WithStdin([]byte("ignored")))
			if err != nil || string(run2.Stdout) != "from argv\n" || !run2.OK() || run2.StepIndex != ex.StepIndex+1 {
				t.Fatalf("Run = %+v, %v (previous step %d)", run2, err, ex.StepIndex)
			}
			w, err := sb.WriteFile(ctx, "/work/answer.txt", []byte("4"), deltagym.WithMode(0o600))
			if err != nil || w.Size != 1 {
				t.Fatalf("WriteFile = %+v, %v", w, err)
			}
			if w, err = sb.WriteFile(ctx, "/work/answer.txt", []byte("2"), deltagym.Appending(), deltagym.WithCheckpoint()); err != nil || w.Size != 2 || w.CheckpointID == "" {
				t.Fatalf("WriteFile append = %+v, %v", w, err)
			}
			r, err := sb.ReadFile(ctx, "/work/answer.txt", deltagym.WithRange(1, 1))
			if err != nil || string(r.Content) != "2" || r.Size != 2 {
				t.Fatalf("ReadFile = %+v, %v", r, err)
			}

			ck, err := sb.Checkpoint(ctx)
			if err != nil || ck.ID == "" || ck.ParentID == "" {
				t.Fatalf("Checkpoint = %+v, %v", ck, err)
			}
			if _, err := sb.Exec(ctx, "rm /work/answer.txt"); err != nil {
				t.Fatal(err)
			}
			ev, err := sb.Evaluate(ctx)
			if err != nil || ev.Reward != 0 {
				t.Fatalf("Evaluate after rm = %+v, %v", ev, err)
			}
			oldEpisode := sb.EpisodeID()
			rs, err := sb.Restore(ctx, ck.ID)
			if err != nil || rs.EpisodeID == oldEpisode || sb.EpisodeID() != rs.EpisodeID || rs.NextStepIndex == 0 {
				t.Fatalf("Restore = %+v, %v (old episode %s)", rs, err, oldEpisode)
			}
			if ev, err = sb.Evaluate(ctx); err != nil || ev.Reward != 1 || ev.Components["correct"] != 1 {
				t.Fatalf("Evaluate after restore = %+v, %v", ev, err)
			}

			info, err := sb.Info(ctx)
			if err != nil || info.GetSandboxId() != sb.ID() || info.GetEpisodeId() != rs.EpisodeID || info.GetState() != deltagymv1.SandboxState_SANDBOX_STATE_READY {
				t.Fatalf("Info = %v, %v", info, err)
			}
			exp, err := sb.Heartbeat(ctx)
			if err != nil || !exp.After(time.Now()) {
				t.Fatalf("Heartbeat = %v, %v", exp, err)
			}
			listed, err := c.ListSandboxes(ctx, deltagym.SandboxFilter{Run: run})
			if err != nil || len(listed) != 1 || listed[0].GetSandboxId() != sb.ID() {
				t.Fatalf("ListSandboxes(run %s) = %v, %v", run, listed, err)
			}

			forked, err := sb.Fork(ctx, 2, deltagym.WithGroup(run+"-kids"))
			if err != nil || len(forked.Sandboxes) != 2 || forked.CheckpointID == "" {
				t.Fatalf("Fork of sandbox = %+v, %v", forked, err)
			}
			for _, kid := range forked.Sandboxes {
				got, err := kid.ReadFile(ctx, "/work/answer.txt")
				if err != nil || string(got.Content) != "42" {
					t.Fatalf("child %s reads %q, %v", kid.ID(), got.Content, err)
				}
				sub, err := kid.Submit(ctx, "42")
				if err != nil || sub.Reward != 1 || !sub.Terminated || sub.Components["correct"] != 1 {
					t.Fatalf("Submit = %+v, %v", sub, err)
				}
				if _, err := kid.Exec(ctx, "true"); connect.CodeOf(err) != connect.CodeFailedPrecondition {
					t.Fatalf("Exec after submit = %v, want FailedPrecondition", err)
				}
				if err := kid.Close(ctx); err != nil {
					t.Fatal(err)
				}
			}
			fromCkpt, err := c.Fork(ctx, ck.ID, 1)
			if err != nil || len(fromCkpt.Sandboxes) != 1 || fromCkpt.CheckpointID != ck.ID {
				t.Fatalf("Fork of checkpoint = %+v, %v", fromCkpt, err)
			}
			if err := fromCkpt.Sandboxes[0].Close(ctx); err != nil {
				t.Fatal(err)
			}
			if err := c.ReleaseCheckpoint(ctx, ck.ID); err != nil {
				t.Fatalf("ReleaseCheckpoint: %v", err)
			}

			// Ledger queries see what was just done.
			var episodes []*deltagymv1.Episode
			for e, err := range c.Episodes(ctx, deltagym.EpisodeFilter{Run: run, PageSize: 1}) {
				if err != nil {
					t.Fatal(err)
				}
				episodes = append(episodes, e)
			}
			if len(episodes) != 5 { // reset, restore, 2 sandbox forks, 1 checkpoint fork
				t.Errorf("Episodes(run) = %d episodes, want 5: %v", len(episodes), episodes)
			}
			traj, err := c.Trajectory(ctx, rs.EpisodeID)
			if err != nil || traj.GetEpisode().GetEpisodeId() != rs.EpisodeID || len(traj.GetSteps()) < 5 || !traj.GetSteps()[0].GetInherited() {
				t.Fatalf("Trajectory = %v, %v", traj, err)
			}
			if tree, err := c.RunCheckpointTree(ctx, run); err != nil || len(tree) == 0 {
				t.Fatalf("RunCheckpointTree = %v, %v", tree, err)
			}
			if tree, err := c.EpisodeCheckpointTree(ctx, rs.EpisodeID); err != nil || len(tree) == 0 {
				t.Fatalf("EpisodeCheckpointTree = %v, %v", tree, err)
			}
			kid0 := forked.Sandboxes[0].EpisodeID()
			if err := c.ReportReward(ctx, kid0, "judge", 0.25, "llm"); err != nil {
				t.Fatal(err)
			}
			adv, err := c.GroupAdvantages(ctx, run+"-kids", "")
			if err != nil || adv.GetCountedCount() != 2 || adv.GetMean() != 1 {
				t.Fatalf("GroupAdvantages = %v, %v", adv, err)
			}

			if err := sb.Close(ctx); err != nil {
				t.Fatal(err)
			}
			if err := sb.Close(ctx); err != nil {
				t.Fatalf("second Close = %v", err)
			}
		})
	}
}

// TestCatalogRPCs registers an env and asks for an image import.
func TestCatalogRPCs(t *testing.T) {
	needServer(t)
	ctx := t.Context()
	c := dial(t)
	name := "tiny-" + deltagym.NewIdempotencyKey()[:6]
	info, err := c.RegisterEnv(ctx, &deltagymv1.EnvSpec{Name: name, Image: "default", PoolSize: 1, Verifier: "echo 0.5"}, false)
	if err != nil || info.GetSpec().GetName() != name {
		t.Fatalf("RegisterEnv = %v, %v", info, err)
	}
	if _, err := c.RegisterEnv(ctx, &deltagymv1.EnvSpec{Name: name, Image: "default"}, false); connect.CodeOf(err) != connect.CodeAlreadyExists {
		t.Fatalf("RegisterEnv again = %v, want AlreadyExists", err)
	}
	sb, err := c.Reset(ctx, name)
	if err != nil {
		t.Fatal(err)
	}
	defer sb.Close(ctx)
	if ev, err := sb.Evaluate(ctx); err != nil || ev.Reward != 0.5 {
		t.Fatalf("Evaluate on the registered env = %+v, %v", ev, err)
	}
	if _, err := c.ImportImage(ctx, &deltagymv1.ImportImageRequest{Name: "nothing", Path: "/nonexistent/image"}); err == nil {
		t.Fatal("ImportImage of a missing path succeeded")
	}
}

// TestErrorCodes checks that errors keep their Connect code through the
// client's wrapping, and say what was being done.
func TestErrorCodes(t *testing.T) {
	needServer(t)
	ctx := t.Context()
	c := dial(t)
	sb := reset(t, c)
	tests := []struct {
		name string
		call func() error
		code connect.Code
		says string
	}{
		{"unknown env", func() error { _, err := c.Reset(ctx, "no-such-env"); return err }, connect.CodeNotFound, "no-such-env"},
		{"unknown sandbox", func() error { _, err := c.Sandbox("sb-unknown").Exec(ctx, "true"); return err }, connect.CodeNotFound, "sb-unknown"},
		{"unknown checkpoint", func() error { _, err := sb.Restore(ctx, "ck-unknown"); return err }, connect.CodeNotFound, "ck-unknown"},
		{"fork of zero", func() error { _, err := sb.Fork(ctx, 0); return err }, connect.CodeInvalidArgument, sb.ID()},
		{"empty action", func() error { _, err := sb.Step(ctx, &deltagymv1.Action{}, false); return err }, connect.CodeInvalidArgument, sb.ID()},
		{"two answers", func() error { _, err := sb.Submit(ctx, "a", "b"); return err }, connect.CodeInvalidArgument, "answer"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			err := tt.call()
			if got := connect.CodeOf(err); got != tt.code {
				t.Fatalf("code %v (%v), want %v", got, err, tt.code)
			}
			if !strings.Contains(err.Error(), tt.says) {
				t.Errorf("message %q does not name %q", err, tt.says)
			}
		})
	}
}

// TestKeepAlive checks that a kept-alive sandbox outlives the lease TTL while
// an idle one is reaped, and that Close stops the heartbeat.
func TestKeepAlive(t *testing.T) {
	needServer(t)
	ctx := t.Context()
	c := dial(t)
	run := "keepalive-" + deltagym.NewIdempotencyKey()[:6]
	kept := reset(t, c, deltagym.WithRun(run))
	idle := reset(t, c, deltagym.WithRun(run))

	var beats atomic.Int64
	beat := make(chan error, 1000)
	deltagym.SetOnBeat(kept, func(_ time.Time, err error) {
		beats.Add(1)
		beat <- err
	})
	if err := kept.KeepAlive(testLeaseTTL / 10); err != nil {
		t.Fatal(err)
	}
	if err := kept.KeepAlive(time.Hour); err != nil { // a second call changes nothing
		t.Fatal(err)
	}
	// Wait, beat by beat, until the reaper has freed the idle sandbox.
	deadline := time.Now().Add(10 * testLeaseTTL)
	for {
		if err := <-beat; err != nil {
			t.Fatalf("heartbeat: %v", err)
		}
		listed, err := c.ListSandboxes(ctx, deltagym.SandboxFilter{Run: run})
		if err != nil {
			t.Fatal(err)
		}
		if len(listed) == 1 {
			if listed[0].GetSandboxId() != kept.ID() {
				t.Fatalf("the kept sandbox was reaped, the idle one lives: %v", listed)
			}
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("idle sandbox not reaped within %v", 10*testLeaseTTL)
		}
	}
	if res, err := kept.Exec(ctx, "echo alive"); err != nil || string(res.Stdout) != "alive\n" {
		t.Fatalf("kept sandbox: %v, %v", res, err)
	}
	if _, err := idle.Exec(ctx, "true"); err == nil {
		t.Fatal("idle sandbox still answers after its lease expired")
	}
	if _, err := idle.Heartbeat(ctx); !errors.Is(err, deltagym.ErrLeaseLost) || connect.CodeOf(err) != connect.CodeNotFound {
		t.Fatalf("Heartbeat of the reaped sandbox = %v, want ErrLeaseLost (NotFound)", err)
	}
	if err := kept.Close(ctx); err != nil {
		t.Fatal(err)
	}
	// Close waited for the heartbeat goroutine to end: after the beats sent
	// before it, none comes, though one was due every tenth of the TTL.
	for drained := false; !drained; {
		select {
		case <-beat:
		default:
			drained = true
		}
	}
	select {
	case <-beat:
		t.Fatal("heartbeat after Close")
	case <-time.After(testLeaseTTL / 5):
	}
	if beats.Load() < 10 {
		t.Errorf("%d heartbeats, want at least 10 over two lease TTLs", beats.Load())
	}
	if kept.LeaseErr() != nil {
		t.Fatalf("LeaseErr = %v after a clean Close", kept.LeaseErr())
	}
}

// TestKeepAliveNoticesLoss checks that the heartbeat loop stops by itself and
// reports ErrLeaseLost when the sandbox is closed behind its back.
func TestKeepAliveNoticesLoss(t *testing.T) {
	needServer(t)
	ctx := t.Context()
	c := dial(t)
	sb := c.Sandbox(reset(t, c).ID()) // a handle that does not know the lease yet
	lost := make(chan struct{})
	var once sync.Once
	deltagym.SetOnBeat(sb, func(_ time.Time, err error) {
		if errors.Is(err, deltagym.ErrLeaseLost) {
			once.Do(func() { close(lost) })
		}
	})
	if err := sb.KeepAlive(0); err != nil { // a third of the lease
		t.Fatal(err)
	}
	if left := time.Until(sb.LeaseExpiry()); left <= 0 || left > testLeaseTTL {
		t.Fatalf("KeepAlive(0) learnt a lease expiring in %v, want within the TTL %v", left, testLeaseTTL)
	}
	if err := c.Sandbox(sb.ID()).Close(ctx); err != nil { // another handle closes it
		t.Fatal(err)
	}
	<-lost
	if !errors.Is(sb.LeaseErr(), deltagym.ErrLeaseLost) {
		t.Fatalf("LeaseErr = %v, want ErrLeaseLost", sb.LeaseErr())
	}
}

// TestRetryReachesLateServer checks the positive side of the retry policy: a
// Reset sent while the server is unreachable succeeds once it listens, with
// one sandbox handed out for all the attempts.
func TestRetryReachesLateServer(t *testing.T) {
	needServer(t)
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	addr := ln.Addr().String()
	if err := ln.Close(); err != nil {
		t.Fatal(err)
	}
	// The late server is a proxy to the test server on a new address.
	var lateLn net.Listener
	var attempts atomic.Int64
	var listenErr error
	served := make(chan struct{})
	startOnFailure := connect.UnaryInterceptorFunc(func(next connect.UnaryFunc) connect.UnaryFunc {
		return func(ctx context.Context, req connect.AnyRequest) (connect.AnyResponse, error) {
			res, err := next(ctx, req)
			if attempts.Add(1) == 1 && connect.CodeOf(err) == connect.CodeUnavailable {
				// The first attempt was refused: start listening before the retry.
				late, lerr := net.Listen("tcp", addr)
				if lerr != nil {
					listenErr = lerr
					return res, err
				}
				lateLn = late
				go func() { defer close(served); proxy(late, testAddr) }()
			}
			return res, err
		}
	})
	defer func() {
		if lateLn != nil {
			lateLn.Close()
			<-served
		}
	}()
	c2, err := deltagym.Dial(addr, deltagym.WithRetry(5, 10*time.Millisecond), deltagym.WithConnectOptions(connect.WithInterceptors(startOnFailure)))
	if err != nil {
		t.Fatal(err)
	}
	defer c2.Close()
	sb, err := c2.Reset(t.Context(), "shell", deltagym.WithRun("late-"+deltagym.NewIdempotencyKey()[:6]))
	if listenErr != nil {
		t.Skipf("could not listen again on %s: %v", addr, listenErr)
	}
	if err != nil {
		t.Fatalf("Reset with a late server = %v after %d attempts", err, attempts.Load())
	}
	defer sb.Close(context.Background())
	if n := attempts.Load(); n != 2 {
		t.Fatalf("%d attempts, want 2 (refused, then served)", n)
	}
	if res, err := sb.Exec(t.Context(), "echo ok"); err != nil || string(res.Stdout) != "ok\n" {
		t.Fatalf("Exec = %v, %v", res, err)
	}
}

// TestStepStreamClose checks a stream's result for a failed step keeps the
// step's code, and that Close is idempotent.
func TestStepStreamClose(t *testing.T) {
	needServer(t)
	c := dial(t, deltagym.WithGRPC())
	stream, err := c.StepStream(t.Context())
	if err != nil {
		t.Fatal(err)
	}
	id, err := stream.Send("sb-unknown", deltagym.ExecAction("true"), false)
	if err != nil {
		t.Fatal(err)
	}
	if err := stream.CloseSend(); err != nil {
		t.Fatal(err)
	}
	r, err := stream.Receive()
	if err != nil || r.RequestID != id || connect.CodeOf(r.Err) != connect.CodeNotFound {
		t.Fatalf("Receive = %+v, %v", r, err)
	}
	if _, err := stream.Receive(); !errors.Is(err, io.EOF) {
		t.Fatalf("Receive after the last result = %v, want EOF", err)
	}
	if _, err := stream.Send("sb", deltagym.ExecAction("true"), false); err == nil {
		t.Fatal("Send after CloseSend succeeded")
	}
	for range 2 {
		if err := stream.Close(); err != nil {
			t.Fatalf("Close: %v", err)
		}
	}
}

// StepFrom restores and acts in one call; StepStream.SendRequest carries the
// same request on a stream.
func TestStepFrom(t *testing.T) {
	needServer(t)
	for _, p := range protocols {
		t.Run(p.name, func(t *testing.T) {
			ctx := t.Context()
			c := dial(t, p.opts...)
			sb := reset(t, c)
			if _, err := sb.WriteFile(ctx, "/work/answer.txt", []byte("42")); err != nil {
				t.Fatal(err)
			}
			ck, err := sb.Checkpoint(ctx)
			if err != nil {
				t.Fatal(err)
			}
			if _, err := sb.Exec(ctx, "rm /work/answer.txt"); err != nil {
				t.Fatal(err)
			}
			before := sb.EpisodeID()
			sf, err := sb.StepFrom(ctx, ck.ID, deltagym.ExecAction("cat /work/answer.txt"), false)
			if err != nil || string(sf.GetObservation().GetExec().GetStdout()) != "42" || sf.GetEpisodeId() == before || sb.EpisodeID() != sf.GetEpisodeId() {
				t.Fatalf("StepFrom = %v, %v (episode before %s)", sf, err, before)
			}
			if _, err := sb.StepFrom(ctx, "ck-unknown", deltagym.ExecAction("true"), false); connect.CodeOf(err) != connect.CodeNotFound {
				t.Fatalf("StepFrom an unknown checkpoint: %v, want NotFound", err)
			}
			stream, err := c.StepStream(ctx)
			if err != nil {
				t.Fatal(err)
			}
			if _, err := stream.Send(sb.ID(), deltagym.ExecAction("rm /work/answer.txt"), false); err != nil {
				t.Fatal(err)
			}
			id, err := stream.SendRequest(&deltagymv1.StepRequest{SandboxId: sb.ID(), RestoreCheckpointId: ck.ID, Action: deltagym.ExecAction("cat /work/answer.txt")})
			if err != nil {
				t.Fatal(err)
			}
			if err := stream.CloseSend(); err != nil {
				t.Fatal(err)
			}
			for range 2 {
				r, err := stream.Receive()
				if err != nil || r.Err != nil {
					t.Fatalf("stream: %+v, %v", r, err)
				}
				if r.RequestID == id && string(r.Response.GetObservation().GetExec().GetStdout()) != "42" {
					t.Fatalf("stream step with restore = %v", r.Response)
				}
			}
			if err := stream.Close(); err != nil {
				t.Fatal(err)
			}
		})
	}
}

// TestRestoreFreshEntropy: Restore and StepFrom with RestoreFreshEntropy
// write a new seed at each restore.
func TestRestoreFreshEntropy(t *testing.T) {
	needServer(t)
	ctx := t.Context()
	c := dial(t, protocols[0].opts...)
	sb := reset(t, c)
	ck, err := sb.Checkpoint(ctx)
	if err != nil {
		t.Fatal(err)
	}
	seeds := map[string]bool{}
	for range 3 {
		if _, err := sb.Restore(ctx, ck.ID, deltagym.RestoreFreshEntropy()); err != nil {
			t.Fatal(err)
		}
		seed, err := sb.ReadFile(ctx, "/run/deltagym/fork-seed")
		if err != nil {
			t.Fatal(err)
		}
		seeds[string(seed.Content)] = true
		sf, err := sb.StepFrom(ctx, ck.ID, deltagym.ExecAction("cat /run/deltagym/fork-seed"), false, deltagym.RestoreFreshEntropy())
		if err != nil {
			t.Fatal(err)
		}
		seeds[string(sf.GetObservation().GetExec().GetStdout())] = true
	}
	if len(seeds) != 6 {
		t.Fatalf("6 restores with fresh entropy gave %d distinct seeds", len(seeds))
	}
}

// proxy forwards every connection ln accepts to addr, until ln is closed and
// every forwarded connection has ended.
func proxy(ln net.Listener, addr string) {
	var wg sync.WaitGroup
	defer wg.Wait()
	for {
		c, err := ln.Accept()
		if err != nil {
			return
		}
		wg.Add(1)
		go func() {
			defer wg.Done()
			defer c.Close()
			up, err := net.Dial("tcp", addr)
			if err != nil {
				return
			}
			defer up.Close()
			done := make(chan struct{})
			go func() { io.Copy(up, c); up.(*net.TCPConn).CloseWrite(); close(done) }()
			io.Copy(c, up)
			c.(*net.TCPConn).CloseWrite()
			<-done
		}()
	}
}
