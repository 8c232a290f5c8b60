package server_test

import (
	"context"
	"fmt"
	"net"
	"net/http"
	"strings"
	"sync"
	"testing"
	"time"

	"connectrpc.com/connect"

	deltagymv1 "github.com/deltagym/deltagym/clients/go/gen/deltagym/v1"
	"github.com/deltagym/deltagym/clients/go/gen/deltagym/v1/deltagymv1connect"
	"github.com/deltagym/deltagym/internal/nodeid"
	"github.com/deltagym/deltagym/internal/version"
	"github.com/deltagym/deltagym/server"
)

// peer is another node of the cluster, as this node's discovery of its peers sees it: its
// NodeService, which reports its name and the address it advertises, and records the
// Authorization header it was asked with.
type peer struct {
	deltagymv1connect.UnimplementedNodeServiceHandler
	name       string
	advertised string
	addr       string // where it listens

	mu sync.Mutex
	// +checklocks:mu
	auth string
}

func startPeer(t *testing.T, name, advertised string) *peer {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	p := &peer{name: name, advertised: advertised, addr: ln.Addr().String()}
	mux := http.NewServeMux()
	mux.Handle(deltagymv1connect.NewNodeServiceHandler(p))
	var protos http.Protocols
	protos.SetHTTP1(true)
	protos.SetUnencryptedHTTP2(true)
	srv := &http.Server{Handler: mux, Protocols: &protos}
	served := make(chan struct{})
	go func() {
		defer close(served)
		_ = srv.Serve(ln)
	}()
	t.Cleanup(func() {
		_ = srv.Close()
		<-served
	})
	return p
}

// DescribeCheckpoint answers as a node that holds no checkpoint.
func (p *peer) DescribeCheckpoint(_ context.Context, req *connect.Request[deltagymv1.DescribeCheckpointRequest]) (*connect.Response[deltagymv1.DescribeCheckpointResponse], error) {
	return nil, connect.NewError(connect.CodeNotFound, fmt.Errorf("checkpoint %q: unknown or released checkpoint", req.Msg.GetCheckpointId()))
}

func (p *peer) GetNode(_ context.Context, req *connect.Request[deltagymv1.GetNodeRequest]) (*connect.Response[deltagymv1.GetNodeResponse], error) {
	p.mu.Lock()
	p.auth = req.Header().Get("Authorization")
	p.mu.Unlock()
	return connect.NewResponse(&deltagymv1.GetNodeResponse{Node: &deltagymv1.NodeInfo{Name: p.name, Address: p.advertised}}), nil
}

// TestNodeIdentity: a node's IDs carry its name, GetNode reports its name, address and load,
// and a call on an ID of another node fails with WRONG_NODE naming it, with the address its
// peers (--peers) give, while an ID of no node is still an unknown one.
func TestNodeIdentity(t *testing.T) {
	peerB := startPeer(t, "node-b", "10.0.0.8:8080") // advertises its address
	peerC := startPeer(t, "node-c", "")              // does not: it is where the node reached it
	b := setup(t, func(c *server.Config) {
		c.Cluster.Node = "node-a"
		c.Cluster.AdvertiseAddr = "10.0.0.7:8080"
		c.Cluster.Peers = peerB.addr + "," + peerC.addr
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

	for _, p := range []*peer{peerB, peerC} {
		p.mu.Lock()
		auth := p.auth
		p.mu.Unlock()
		if auth != "Bearer "+b.token {
			t.Fatalf("%s was asked for its report with %q, want the node's own token", p.name, auth)
		}
	}
	otherSB, otherCK := nodeid.New("sb", "node-b"), nodeid.New("ck", "node-b")
	const addrB = "10.0.0.8:8080"
	for _, cl := range b.clients() {
		_, err := cl.c.GetSandbox(ctx, &deltagymv1.GetSandboxRequest{SandboxId: otherSB})
		wantReason(t, cl.name+": GetSandbox of node-b's sandbox", err, connect.CodeFailedPrecondition, "WRONG_NODE", "sandbox_id", otherSB, "node", "node-b", "address", addrB)
		_, err = cl.c.Step(ctx, &deltagymv1.StepRequest{SandboxId: otherSB, Action: execAction("true")})
		wantReason(t, cl.name+": Step in node-b's sandbox", err, connect.CodeFailedPrecondition, "WRONG_NODE", "sandbox_id", otherSB, "node", "node-b", "address", addrB)
		// A restore of node-b's checkpoint asks node-b for it (TestCheckpointMoves), which has
		// none.
		_, err = cl.c.Restore(ctx, &deltagymv1.RestoreRequest{SandboxId: sb, CheckpointId: otherCK})
		wantReason(t, cl.name+": Restore of a checkpoint node-b lacks", err, connect.CodeNotFound, "CHECKPOINT_NOT_FOUND", "checkpoint_id", otherCK)
		_, err = cl.c.ReleaseCheckpoint(ctx, &deltagymv1.ReleaseCheckpointRequest{CheckpointId: otherCK})
		wantReason(t, cl.name+": ReleaseCheckpoint of node-b's checkpoint", err, connect.CodeFailedPrecondition, "WRONG_NODE", "checkpoint_id", otherCK, "node", "node-b", "address", addrB)
		if !strings.Contains(err.Error(), "node node-b ("+addrB+")") {
			t.Fatalf("%s: WRONG_NODE's message %q does not give node-b's address", cl.name, err)
		}
		sbC := nodeid.New("sb", "node-c")
		_, err = cl.c.GetSandbox(ctx, &deltagymv1.GetSandboxRequest{SandboxId: sbC})
		wantReason(t, cl.name+": GetSandbox of node-c's sandbox", err, connect.CodeFailedPrecondition, "WRONG_NODE", "node", "node-c", "address", peerC.addr)
		sbD := nodeid.New("sb", "node-d")
		_, err = cl.c.GetSandbox(ctx, &deltagymv1.GetSandboxRequest{SandboxId: sbD})
		wantReason(t, cl.name+": GetSandbox of a sandbox of a node no peer reports", err, connect.CodeFailedPrecondition, "WRONG_NODE", "node", "node-d", "address", "")
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
