package server_test

import (
	"context"
	"net/http"
	"testing"
	"time"

	"connectrpc.com/connect"

	deltagymv1 "github.com/deltagym/deltagym/clients/go/gen/deltagym/v1"
	"github.com/deltagym/deltagym/clients/go/gen/deltagym/v1/deltagymv1connect"
	"github.com/deltagym/deltagym/internal/nodeid"
	"github.com/deltagym/deltagym/internal/version"
	"github.com/deltagym/deltagym/server"
)

// TestNodeIdentity: a node's IDs carry its name, GetNode reports its name, address and load,
// and a call on an ID of another node fails with WRONG_NODE naming it, while an ID of no node
// is still an unknown one.
func TestNodeIdentity(t *testing.T) {
	b := setup(t, func(c *server.Config) {
		c.Cluster.Node = "node-a"
		c.Cluster.AdvertiseAddr = "10.0.0.7:8080"
	})
	ctx := t.Context()
	nodes := deltagymv1connect.NewNodeServiceClient(http.DefaultClient, "http://"+b.addr, connect.WithInterceptors(bearer(b.token)))
	gr, err := nodes.GetNode(ctx, connect.NewRequest(&deltagymv1.GetNodeRequest{}))
	must(t, err)
	n := gr.Msg.GetNode()
	if n.GetName() != "node-a" || n.GetAddress() != "10.0.0.7:8080" || n.GetVersion() != version.Version || n.GetDraining() {
		t.Fatalf("GetNode: %v", n)
	}
	if n.GetCpus() < 1 || n.GetMemoryTotalBytes() <= 0 || n.GetMemoryAvailableBytes() <= 0 || n.GetMemoryAvailableBytes() > n.GetMemoryTotalBytes() ||
		n.GetCpuLoad() < 0 || n.GetMeasuredAt() == nil || n.GetMaxSandboxes() < 0 {
		t.Fatalf("GetNode's load: %v", n)
	}
	noToken := deltagymv1connect.NewNodeServiceClient(http.DefaultClient, "http://"+b.addr)
	if _, err := noToken.GetNode(ctx, connect.NewRequest(&deltagymv1.GetNodeRequest{})); connect.CodeOf(err) != connect.CodeUnauthenticated {
		t.Fatalf("GetNode without the token: %v, want unauthenticated", err)
	}

	c := b.clients()[0].c
	rr, err := c.Reset(ctx, &deltagymv1.ResetRequest{Env: "short"})
	must(t, err)
	sb := rr.GetSandboxId()
	ck, err := c.Checkpoint(ctx, &deltagymv1.CheckpointRequest{SandboxId: sb})
	must(t, err)
	if nodeid.Node(sb) != "node-a" || nodeid.Node(ck.GetCheckpointId()) != "node-a" || nodeid.Node(rr.GetCheckpointId()) != "node-a" {
		t.Fatalf("IDs %s, %s, %s do not name node-a", sb, ck.GetCheckpointId(), rr.GetCheckpointId())
	}
	gs, err := c.GetSandbox(ctx, &deltagymv1.GetSandboxRequest{SandboxId: sb})
	must(t, err)
	if gs.GetSandbox().GetSandboxId() != sb {
		t.Fatalf("GetSandbox of its own sandbox: %v", gs)
	}

	otherSB, otherCK := nodeid.New("sb", "node-b"), nodeid.New("ck", "node-b")
	for _, cl := range b.clients() {
		_, err := cl.c.GetSandbox(ctx, &deltagymv1.GetSandboxRequest{SandboxId: otherSB})
		wantReason(t, cl.name+": GetSandbox of node-b's sandbox", err, connect.CodeFailedPrecondition, "WRONG_NODE", "sandbox_id", otherSB, "node", "node-b")
		_, err = cl.c.Step(ctx, &deltagymv1.StepRequest{SandboxId: otherSB, Action: execAction("true")})
		wantReason(t, cl.name+": Step in node-b's sandbox", err, connect.CodeFailedPrecondition, "WRONG_NODE", "sandbox_id", otherSB, "node", "node-b")
		_, err = cl.c.Restore(ctx, &deltagymv1.RestoreRequest{SandboxId: sb, CheckpointId: otherCK})
		wantReason(t, cl.name+": Restore of node-b's checkpoint", err, connect.CodeFailedPrecondition, "WRONG_NODE", "checkpoint_id", otherCK, "node", "node-b")
		_, err = cl.c.ReleaseCheckpoint(ctx, &deltagymv1.ReleaseCheckpointRequest{CheckpointId: otherCK})
		wantReason(t, cl.name+": ReleaseCheckpoint of node-b's checkpoint", err, connect.CodeFailedPrecondition, "WRONG_NODE", "checkpoint_id", otherCK, "node", "node-b")
		// An ID of no node is this node's: unknown, not another's.
		_, err = cl.c.GetSandbox(ctx, &deltagymv1.GetSandboxRequest{SandboxId: "sb-0123456789abcdef"})
		wantReason(t, cl.name+": GetSandbox of an ID of no node", err, connect.CodeNotFound, "SANDBOX_NOT_FOUND")
		// An ID of this node that it does not hold is unknown too.
		_, err = cl.c.GetSandbox(ctx, &deltagymv1.GetSandboxRequest{SandboxId: nodeid.New("sb", "node-a")})
		wantReason(t, cl.name+": GetSandbox of an unknown ID of this node", err, connect.CodeNotFound, "SANDBOX_NOT_FOUND")
	}
	// Nothing changed: the sandbox still steps.
	_, err = c.Step(ctx, &deltagymv1.StepRequest{SandboxId: sb, Action: execAction("true")})
	must(t, err)
}

// TestDrain: a draining node takes no new sandboxes (Reset and Fork fail with DRAINING, GetNode
// says so) while the sandbox it holds steps, checkpoints and restores on; Drained returns once
// that sandbox is closed.
func TestDrain(t *testing.T) {
	b := setup(t, func(c *server.Config) { c.Cluster.Node = "node-d" })
	ctx := t.Context()
	c := b.clients()[0].c
	rr, err := c.Reset(ctx, &deltagymv1.ResetRequest{Env: "short"})
	must(t, err)
	sb := rr.GetSandboxId()
	b.srv.BeginDrain()
	nodes := deltagymv1connect.NewNodeServiceClient(http.DefaultClient, "http://"+b.addr, connect.WithInterceptors(bearer(b.token)))
	gr, err := nodes.GetNode(ctx, connect.NewRequest(&deltagymv1.GetNodeRequest{}))
	must(t, err)
	if !gr.Msg.GetNode().GetDraining() {
		t.Fatalf("GetNode of a draining node: %v", gr.Msg.GetNode())
	}
	for _, cl := range b.clients() {
		_, err := cl.c.Reset(ctx, &deltagymv1.ResetRequest{Env: "short"})
		wantReason(t, cl.name+": Reset on a draining node", err, connect.CodeUnavailable, "DRAINING", "node", "node-d")
		_, err = cl.c.Fork(ctx, &deltagymv1.ForkRequest{Source: &deltagymv1.ForkRequest_CheckpointId{CheckpointId: rr.GetCheckpointId()}, N: 1})
		wantReason(t, cl.name+": Fork on a draining node", err, connect.CodeUnavailable, "DRAINING", "node", "node-d")
	}
	_, err = c.Step(ctx, &deltagymv1.StepRequest{SandboxId: sb, Action: execAction("true")})
	must(t, err)
	_, err = c.Restore(ctx, &deltagymv1.RestoreRequest{SandboxId: sb, CheckpointId: rr.GetCheckpointId()})
	must(t, err)
	short, cancel := context.WithTimeout(ctx, 50*time.Millisecond)
	left := b.srv.Drained(short)
	cancel()
	if left != 1 {
		t.Fatalf("Drained with one sandbox leased: %d left", left)
	}
	_, err = c.Close(ctx, &deltagymv1.CloseRequest{SandboxId: sb})
	must(t, err)
	if left := b.srv.Drained(ctx); left != 0 {
		t.Fatalf("Drained after the close: %d left", left)
	}
}
