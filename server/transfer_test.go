package server_test

import (
	"net/http"
	"os"
	"strings"
	"testing"
	"time"

	"connectrpc.com/connect"

	deltagymv1 "github.com/deltagym/deltagym/clients/go/gen/deltagym/v1"
	"github.com/deltagym/deltagym/clients/go/gen/deltagym/v1/deltagymv1connect"
	"github.com/deltagym/deltagym/internal/benchq"
	"github.com/deltagym/deltagym/internal/nodeid"
	"github.com/deltagym/deltagym/server"
)

// run execs cmd in sandbox sb and returns its stdout.
func run(t *testing.T, c api, sb, cmd string) string {
	t.Helper()
	r, err := c.Step(t.Context(), &deltagymv1.StepRequest{SandboxId: sb, Action: execAction(cmd)})
	must(t, err)
	return string(r.GetObservation().GetExec().GetStdout())
}

// TestCheckpointMoves: node B forks and restores a checkpoint of node A: it fetches the
// checkpoint's layers from A (its files, a removal of a file of the layer below, a link) and
// then holds the checkpoint as its own; what cannot move (processes) or does not exist is
// refused with a reason, and a node B does not know is unavailable.
func TestCheckpointMoves(t *testing.T) {
	const token = "cluster-token"
	a := setup(t, func(c *server.Config) { c.Cluster.Node, c.AuthToken = "node-a", token })
	b := setup(t, func(c *server.Config) {
		c.Cluster.Node, c.AuthToken, c.DatabaseURL = "node-b", token, a.dbURL
		c.Cluster.Peers = a.addr
	})
	ctx := t.Context()
	ca, cb := a.clients()[0].c, b.clients()[0].c

	rr, err := ca.Reset(ctx, &deltagymv1.ResetRequest{Env: "plain"})
	must(t, err)
	sbA := rr.GetSandboxId()
	run(t, ca, sbA, "echo moved > /tmp/f && ln -s /tmp/f /tmp/link && mkdir -p /tmp/d/e && rm /tmp/plain && seq 1 20000 > /tmp/d/e/big")
	ck, err := ca.Checkpoint(ctx, &deltagymv1.CheckpointRequest{SandboxId: sbA})
	must(t, err)
	ckA := ck.GetCheckpointId()
	const probe = "cat /tmp/f; readlink /tmp/link; test -e /tmp/plain || echo gone; md5sum < /tmp/d/e/big"
	want := run(t, ca, sbA, probe)
	if !strings.HasPrefix(want, "moved\n/tmp/f\ngone\n") {
		t.Fatalf("the checkpoint's files on node A: %q", want)
	}

	fr, err := cb.Fork(ctx, &deltagymv1.ForkRequest{Source: &deltagymv1.ForkRequest_CheckpointId{CheckpointId: ckA}, N: 2})
	must(t, err)
	for _, s := range fr.GetSandboxIds() {
		if nodeid.Node(s) != "node-b" {
			t.Fatalf("a child of the fork on node B is %s", s)
		}
		if got := run(t, cb, s, probe); got != want {
			t.Fatalf("a fork on node B of node A's checkpoint reads %q, want %q", got, want)
		}
	}
	// Restore into a sandbox of node B, from the copy it holds now.
	rb, err := cb.Reset(ctx, &deltagymv1.ResetRequest{Env: "plain"})
	must(t, err)
	sbB := rb.GetSandboxId()
	_, err = cb.Restore(ctx, &deltagymv1.RestoreRequest{SandboxId: sbB, CheckpointId: ckA})
	must(t, err)
	if got := run(t, cb, sbB, probe); got != want {
		t.Fatalf("a restore on node B of node A's checkpoint reads %q, want %q", got, want)
	}
	// A checkpoint of node B, taken after, stays B's.
	ckB, err := cb.Checkpoint(ctx, &deltagymv1.CheckpointRequest{SandboxId: sbB})
	must(t, err)
	if nodeid.Node(ckB.GetCheckpointId()) != "node-b" {
		t.Fatalf("a checkpoint of node B's sandbox is %s", ckB.GetCheckpointId())
	}

	// Processes move as CRIU images: made from the template on node A, fetched by node B.
	const sleeper = "for p in /proc/[0-9]*; do tr '\\0' ' ' < $p/cmdline; echo; done | grep -c '^sleep 1000 $'"
	_, err = ca.Step(ctx, &deltagymv1.StepRequest{SandboxId: sbA, Action: &deltagymv1.Action{Kind: &deltagymv1.Action_Exec{Exec: &deltagymv1.ExecAction{Command: "sleep 1000", Background: true}}}})
	must(t, err)
	pk, err := ca.Checkpoint(ctx, &deltagymv1.CheckpointRequest{SandboxId: sbA})
	must(t, err)
	fr, err = cb.Fork(ctx, &deltagymv1.ForkRequest{Source: &deltagymv1.ForkRequest_CheckpointId{CheckpointId: pk.GetCheckpointId()}, N: 1})
	must(t, err)
	if got := run(t, cb, fr.GetSandboxIds()[0], sleeper+"; cat /tmp/f"); got != "1\nmoved\n" {
		t.Fatalf("a fork on node B of node A's checkpoint with a process reads %q, want the process running and the files", got)
	}
	_, err = cb.Restore(ctx, &deltagymv1.RestoreRequest{SandboxId: sbB, CheckpointId: pk.GetCheckpointId()})
	must(t, err)
	if got := run(t, cb, sbB, sleeper); got != "1\n" {
		t.Fatalf("a restore on node B of node A's checkpoint with a process: %q processes, want 1", got)
	}
	_, err = cb.Restore(ctx, &deltagymv1.RestoreRequest{SandboxId: sbB, CheckpointId: ckB.GetCheckpointId()})
	must(t, err)
	// A process whose image cannot be made (it holds a file removed since the checkpoint, and
	// its image is made from a copy in the sandbox's live root) stays: refused, saying why.
	run(t, ca, sbA, "pkill sleep; echo held > /tmp/held")
	_, err = ca.Step(ctx, &deltagymv1.StepRequest{SandboxId: sbA, Action: &deltagymv1.Action{Kind: &deltagymv1.Action_Exec{Exec: &deltagymv1.ExecAction{Command: "exec 3</tmp/held; exec sleep 1001", Background: true}}}})
	must(t, err)
	// The background command returns at its spawn: the checkpoint waits for the sleep, which
	// runs only once the shell has opened the file.
	run(t, ca, sbA, "until for p in /proc/[0-9]*; do tr '\\0' ' ' < $p/cmdline; echo; done | grep -q '^sleep 1001 $'; do :; done")
	hk, err := ca.Checkpoint(ctx, &deltagymv1.CheckpointRequest{SandboxId: sbA})
	must(t, err)
	run(t, ca, sbA, "rm /tmp/held")
	_, err = cb.Fork(ctx, &deltagymv1.ForkRequest{Source: &deltagymv1.ForkRequest_CheckpointId{CheckpointId: hk.GetCheckpointId()}, N: 1})
	wantReason(t, "a fork on node B of a checkpoint of node A whose process has no image", err, connect.CodeFailedPrecondition, "PROCESSES_STAY",
		"checkpoint_id", hk.GetCheckpointId())
	if !strings.Contains(err.Error(), "processes") {
		t.Fatalf("a fork on node B of a checkpoint whose process has no image: %v, want a message about its processes", err)
	}

	// A checkpoint node A does not hold, and one of a node B does not know.
	gone := nodeid.New("ck", "node-a")
	_, err = cb.Fork(ctx, &deltagymv1.ForkRequest{Source: &deltagymv1.ForkRequest_CheckpointId{CheckpointId: gone}, N: 1})
	wantReason(t, "a fork of a checkpoint node A does not hold", err, connect.CodeNotFound, "CHECKPOINT_NOT_FOUND", "checkpoint_id", gone)
	far := nodeid.New("ck", "node-z")
	_, err = cb.Restore(ctx, &deltagymv1.RestoreRequest{SandboxId: sbB, CheckpointId: far})
	wantReason(t, "a restore of a checkpoint of an unknown node", err, connect.CodeUnavailable, "NODE_UNAVAILABLE", "checkpoint_id", far, "node", "node-z")
	// Nothing changed in sandbox B.
	if got := run(t, cb, sbB, probe); got != want {
		t.Fatalf("after the refusals, sandbox B reads %q, want %q", got, want)
	}
}

// BenchmarkCrossNodeFork: a Fork of one sandbox on node B of a checkpoint of node A whose delta
// is 50 MB (1,000 files of 50 KiB of random bytes), cold: each round writes new files on A,
// from the same base, and checkpoints them there (untimed), so B holds the base's layers but
// none of the delta's. The same round's Fork on A, of the same checkpoint, is timed beside it.
// DELTAGYM_BENCH_HASHED=1 waits (untimed) for A's hash of the new layer before the fork, as a
// fork that comes later than its checkpoint finds it; DELTAGYM_BENCH_DIGEST_AHEAD=0 turns A's
// hashing ahead off.
func BenchmarkCrossNodeFork(b *testing.B) {
	const token = "cluster-token"
	a := setup(b, func(c *server.Config) {
		c.Cluster.Node, c.AuthToken, c.NoLedger = "node-a", token, true
		c.Cluster.DigestAhead = os.Getenv("DELTAGYM_BENCH_DIGEST_AHEAD") != "0" // as with --peers
	})
	nb := setup(b, func(c *server.Config) {
		c.Cluster.Node, c.AuthToken, c.NoLedger = "node-b", token, true
		c.Cluster.Peers = a.addr
	})
	ctx := b.Context()
	ca, cb := a.clients()[1].c, nb.clients()[1].c
	nodeA := deltagymv1connect.NewNodeServiceClient(http.DefaultClient, "http://"+a.addr, connect.WithInterceptors(bearer(token)))
	hashed := os.Getenv("DELTAGYM_BENCH_HASHED") == "1"
	rr, err := ca.Reset(ctx, &deltagymv1.ResetRequest{Env: "plain"})
	must(b, err)
	sb, base := rr.GetSandboxId(), rr.GetCheckpointId()
	fork := func(c api, ck string) time.Duration {
		start := time.Now()
		fr, err := c.Fork(ctx, &deltagymv1.ForkRequest{Source: &deltagymv1.ForkRequest_CheckpointId{CheckpointId: ck}, N: 1})
		d := time.Since(start)
		must(b, err)
		_, err = c.Close(ctx, &deltagymv1.CloseRequest{SandboxId: fr.GetSandboxIds()[0]})
		must(b, err)
		return d
	}
	var cross, local []time.Duration
	for b.Loop() {
		b.StopTimer()
		_, err := ca.Restore(ctx, &deltagymv1.RestoreRequest{SandboxId: sb, CheckpointId: base})
		must(b, err)
		_, err = ca.Step(ctx, &deltagymv1.StepRequest{SandboxId: sb, Action: execAction(
			"mkdir -p /tmp/w && head -c 51200000 /dev/urandom > /tmp/all && split -b 51200 -a 3 /tmp/all /tmp/w/f && rm /tmp/all")})
		must(b, err)
		ck, err := ca.Checkpoint(ctx, &deltagymv1.CheckpointRequest{SandboxId: sb})
		must(b, err)
		if hashed {
			// The fork comes after the background hashing of the new layer is done, as a fork
			// that does not follow its checkpoint at once does: asking A for the manifest
			// waits for it.
			_, err = nodeA.DescribeCheckpoint(ctx, connect.NewRequest(&deltagymv1.DescribeCheckpointRequest{CheckpointId: ck.GetCheckpointId()}))
			must(b, err)
		}
		b.StartTimer()
		cross = append(cross, fork(cb, ck.GetCheckpointId()))
		b.StopTimer()
		local = append(local, fork(ca, ck.GetCheckpointId()))
		for _, c := range []api{ca, cb} {
			_, err = c.ReleaseCheckpoint(ctx, &deltagymv1.ReleaseCheckpointRequest{CheckpointId: ck.GetCheckpointId()})
			must(b, err)
		}
		b.StartTimer()
	}
	benchq.Report(b, cross, "cross-node-")
	benchq.Report(b, local, "same-node-")
}
