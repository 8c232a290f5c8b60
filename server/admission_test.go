package server_test

import (
	"strings"
	"sync"
	"testing"
	"time"

	"connectrpc.com/connect"
	"golang.org/x/sys/unix"

	deltagymv1 "github.com/deltagym/deltagym/clients/go/gen/deltagym/v1"
	"github.com/deltagym/deltagym/sandbox"
	"github.com/deltagym/deltagym/server"
)

// forkTwiceNoFile is the descriptor limit TestForkTwiceOverCaps runs the server with: room for
// one Fork of 1024 children, not two (1,976 descriptors for the server's sandboxes, an idle one
// holding one, less 480 for the hot set of the sandboxes used last).
const forkTwiceNoFile = 3000

// Two Fork(n=1024) at once on a server whose descriptors hold one: the one beyond the caps is
// refused with resource_exhausted naming the cap, its value and the flag that raises it, and
// makes nothing, while an unrelated sandbox's Steps go on answering.
func TestForkTwiceOverCaps(t *testing.T) {
	var was unix.Rlimit
	must(t, unix.Getrlimit(unix.RLIMIT_NOFILE, &was))
	must(t, unix.Setrlimit(unix.RLIMIT_NOFILE, &unix.Rlimit{Cur: forkTwiceNoFile, Max: forkTwiceNoFile}))
	t.Cleanup(func() { _ = unix.Setrlimit(unix.RLIMIT_NOFILE, &was) })
	b := setup(t, func(c *server.Config) { c.NoLedger = true })
	ctx := t.Context()
	canary, err := b.connect.Reset(ctx, connect.NewRequest(&deltagymv1.ResetRequest{Env: "plain"}))
	must(t, err)
	src, err := b.connect.Reset(ctx, connect.NewRequest(&deltagymv1.ResetRequest{Env: "plain"}))
	must(t, err)
	ck, err := b.connect.Checkpoint(ctx, connect.NewRequest(&deltagymv1.CheckpointRequest{SandboxId: src.Msg.GetSandboxId()}))
	must(t, err)

	stop := make(chan struct{})
	steps := make(chan error, 1)
	go func() {
		defer close(steps)
		for n := 0; ; n++ {
			select {
			case <-stop:
				if n == 0 {
					steps <- nil
				}
				return
			default:
			}
			r, err := b.connect.Step(ctx, connect.NewRequest(&deltagymv1.StepRequest{SandboxId: canary.Msg.GetSandboxId(), Action: execAction("echo alive")}))
			if err == nil && strings.TrimSpace(string(r.Msg.GetObservation().GetExec().GetStdout())) != "alive" {
				err = connect.NewError(connect.CodeInternal, nil)
			}
			if err != nil {
				steps <- err
				return
			}
		}
	}()

	var wg sync.WaitGroup
	res := make([]*connect.Response[deltagymv1.ForkResponse], 2)
	errs := make([]error, 2)
	start := time.Now()
	for i := range 2 {
		wg.Go(func() {
			res[i], errs[i] = b.connect.Fork(ctx, connect.NewRequest(&deltagymv1.ForkRequest{
				Source: &deltagymv1.ForkRequest_CheckpointId{CheckpointId: ck.Msg.GetCheckpointId()}, N: 1024}))
		})
	}
	wg.Wait()
	close(stop)
	t.Logf("two Fork(1024) took %v", time.Since(start))
	if err := <-steps; err != nil {
		t.Fatalf("the canary's Step failed during the forks: %v", err)
	}
	refusals := 0
	for i, err := range errs {
		if err == nil {
			if n := len(res[i].Msg.GetSandboxIds()); n != 1024 {
				t.Fatalf("fork %d made %d children, not 1024", i, n)
			}
			continue
		}
		refusals++
		t.Logf("fork %d refused: %v", i, err)
		if codeOf(err) != connect.CodeResourceExhausted {
			t.Fatalf("fork %d: %v, want resource_exhausted", i, err)
		}
		for _, want := range []string{`cap "`, "deltagym serve --max-"} {
			if !strings.Contains(err.Error(), want) {
				t.Fatalf("fork %d's refusal %q does not name the cap and its flag (%q)", i, err, want)
			}
		}
	}
	if refusals == 0 {
		t.Fatal("two Fork(1024) were both admitted on a server with descriptors for one")
	}
	if _, err := b.connect.Step(ctx, connect.NewRequest(&deltagymv1.StepRequest{SandboxId: canary.Msg.GetSandboxId(), Action: execAction("true")})); err != nil {
		t.Fatalf("the canary's Step after the forks: %v", err)
	}
	for i := range res {
		if errs[i] != nil {
			continue
		}
		for _, id := range res[i].Msg.GetSandboxIds() {
			_, err := b.connect.Close(ctx, connect.NewRequest(&deltagymv1.CloseRequest{SandboxId: id}))
			must(t, err)
		}
	}
}

// The admission flags reach the runtime's config: caps, -1 for none, 0 derived (by the runtime,
// or here for the checkpoint bytes), sizes with units, the TTL (0: never); bad values are refused
// before anything starts.
func TestAdmissionFlags(t *testing.T) {
	host := sandbox.Host{NoFile: 20000, PidMax: 32768, MountMax: 100000, MemoryBytes: 8 << 30}
	for _, c := range []struct {
		args []string
		want func(sandbox.Config) bool
		err  string
	}{
		{nil, func(r sandbox.Config) bool {
			return r.Caps == (sandbox.Caps{}) && r.CheckpointBudgetBytes == 4<<30 && r.CheckpointTTL == time.Hour && r.CPUWeight == 100 && r.InitPool == 0 &&
				strings.Contains(r.CapFlags[sandbox.CapSandboxes], "--max-sandboxes")
		}, ""},
		{[]string{"--max-sandboxes", "5", "--max-checkpoints", "-1", "--max-descriptors", "900", "--max-mounts", "70"}, func(r sandbox.Config) bool {
			return r.Caps == sandbox.Caps{Sandboxes: 5, Checkpoints: -1, Descriptors: 900, Mounts: 70}
		}, ""},
		{[]string{"--max-checkpoint-bytes", "2GiB", "--sandboxes-memory", "6GiB"}, func(r sandbox.Config) bool {
			return r.CheckpointBudgetBytes == 2<<30 && r.MemoryBytes == 6<<30
		}, ""},
		{[]string{"--max-checkpoint-bytes", "-1", "--checkpoint-ttl", "0"}, func(r sandbox.Config) bool {
			return r.CheckpointBudgetBytes == 0 && r.CheckpointTTL == 0
		}, ""},
		{[]string{"--checkpoint-ttl", "90m", "--sandbox-cpu-weight", "250"}, func(r sandbox.Config) bool {
			return r.CheckpointTTL == 90*time.Minute && r.CPUWeight == 250
		}, ""},
		{[]string{"--warm-inits", "100"}, func(r sandbox.Config) bool { return r.InitPool == 100 }, ""},
		{[]string{"--warm-inits", "0"}, func(r sandbox.Config) bool { return r.InitPool < 0 }, ""},
		{[]string{"--warm-inits", "2000"}, nil, "to 1024"},
		{[]string{"--max-sandboxes", "-2"}, nil, "or -1 for no cap"},
		{[]string{"--max-sandboxes", "many"}, nil, "a number"},
		{[]string{"--max-checkpoint-bytes", "lots"}, nil, "a size in bytes"},
		{[]string{"--checkpoint-ttl", "-1h"}, nil, "a duration"},
		{[]string{"--sandbox-cpu-weight", "20000"}, nil, "from 1 to 10000"},
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
		if r := cfg.Admission.RuntimeConfig(host); !c.want(r) {
			t.Fatalf("%v: runtime config %+v", c.args, r)
		}
	}
}

// A Step asking for a checkpoint when the checkpoint cap is full is refused before its action
// runs: resource_exhausted naming the cap, no step counted, nothing recorded, the episode going
// on.
func TestStepCheckpointAtCap(t *testing.T) {
	b := setup(t, func(c *server.Config) { c.Admission.Checkpoints = 40 })
	c := b.clients()[0].c
	rr, err := c.Reset(t.Context(), &deltagymv1.ResetRequest{Env: "plain"})
	must(t, err)
	sb, ep := rr.GetSandboxId(), rr.GetEpisodeId()
	defer c.Close(t.Context(), &deltagymv1.CloseRequest{SandboxId: sb})
	for n := 0; ; n++ {
		_, err := c.Checkpoint(t.Context(), &deltagymv1.CheckpointRequest{SandboxId: sb})
		if codeOf(err) == connect.CodeResourceExhausted {
			break
		}
		must(t, err)
		if n > 40 {
			t.Fatal("40 checkpoints, none refused by a cap of 40")
		}
	}
	before, _ := nextStep(t, c, sb)
	_, err = c.Step(t.Context(), &deltagymv1.StepRequest{SandboxId: sb, Action: execAction("touch /tmp/ran"), Checkpoint: true})
	if codeOf(err) != connect.CodeResourceExhausted || !strings.Contains(err.Error(), `"checkpoints"`) {
		t.Fatalf("a step with a checkpoint at the cap: %v (%v), want resource_exhausted naming the cap", err, codeOf(err))
	}
	after, going := nextStep(t, c, sb)
	if after != before || !going {
		t.Fatalf("after the refused step: next step %d (was %d), episode going on %v", after, before, going)
	}
	st, err := c.Step(t.Context(), &deltagymv1.StepRequest{SandboxId: sb, Action: execAction("test -e /tmp/ran && echo ran || echo not")})
	must(t, err)
	if out := stdout(t, st); out != "not\n" {
		t.Fatalf("the refused step's action ran: %q", out)
	}
	recorded, _ := stepsRecorded(t, c, ep)
	if len(recorded) != int(after)+1 {
		t.Fatalf("the ledger holds %d steps, want %d", len(recorded), after+1)
	}
}
