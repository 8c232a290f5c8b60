package server_test

import (
	"context"
	"net"
	"net/http"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"connectrpc.com/connect"

	deltagymv1 "github.com/deltagym/deltagym/clients/go/gen/deltagym/v1"
	"github.com/deltagym/deltagym/clients/go/gen/deltagym/v1/deltagymv1connect"
	"github.com/deltagym/deltagym/internal/nodeid"
	"github.com/deltagym/deltagym/server"
)

// hostilePeer is a node of the cluster that lies: it reports its name, then answers
// DescribeCheckpoint and FetchLayer as its describe and fetch say.
type hostilePeer struct {
	deltagymv1connect.UnimplementedNodeServiceHandler
	name     string
	addr     string
	describe func(id string) *deltagymv1.CheckpointManifest
	fetch    func(ctx context.Context, digest string, stream *connect.ServerStream[deltagymv1.FetchLayerResponse]) error
	fetches  atomic.Int64
	images   []byte // the stream FetchImages sends
	imaged   atomic.Int64
}

func startHostilePeer(t *testing.T, p *hostilePeer) *hostilePeer {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	p.addr = ln.Addr().String()
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

func (p *hostilePeer) GetNode(context.Context, *connect.Request[deltagymv1.GetNodeRequest]) (*connect.Response[deltagymv1.GetNodeResponse], error) {
	return connect.NewResponse(&deltagymv1.GetNodeResponse{Node: &deltagymv1.NodeInfo{Name: p.name}}), nil
}

func (p *hostilePeer) DescribeCheckpoint(_ context.Context, req *connect.Request[deltagymv1.DescribeCheckpointRequest]) (*connect.Response[deltagymv1.DescribeCheckpointResponse], error) {
	return connect.NewResponse(&deltagymv1.DescribeCheckpointResponse{Manifest: p.describe(req.Msg.GetCheckpointId())}), nil
}

func (p *hostilePeer) FetchLayer(ctx context.Context, req *connect.Request[deltagymv1.FetchLayerRequest], stream *connect.ServerStream[deltagymv1.FetchLayerResponse]) error {
	p.fetches.Add(1)
	if p.fetch == nil {
		return connect.NewError(connect.CodeNotFound, nil)
	}
	return p.fetch(ctx, req.Msg.GetDigest(), stream)
}

func (p *hostilePeer) FetchImages(_ context.Context, _ *connect.Request[deltagymv1.FetchImagesRequest], stream *connect.ServerStream[deltagymv1.FetchImagesResponse]) error {
	p.imaged.Add(1)
	return stream.Send(&deltagymv1.FetchImagesResponse{Data: p.images})
}

// digestOf makes a well-formed layer digest of one repeated hex digit.
func digestOf(c byte) string { return "sha256:" + strings.Repeat(string(c), 64) }

// TestAdoptRefusesHugeSizes: a peer whose manifest claims layers so large that their sum
// passes the largest int64 is refused by the checkpoint bytes cap, before any layer is
// fetched: the sum does not wrap into a small or negative need.
func TestAdoptRefusesHugeSizes(t *testing.T) {
	const token = "cluster-token"
	evil := startHostilePeer(t, &hostilePeer{name: "evil", describe: func(id string) *deltagymv1.CheckpointManifest {
		return &deltagymv1.CheckpointManifest{CheckpointId: id, Image: "default", Layers: []*deltagymv1.LayerDescriptor{
			{Digest: digestOf('a'), SizeBytes: 1 << 62}, {Digest: digestOf('b'), SizeBytes: 1 << 62}}}
	}})
	b := setup(t, func(c *server.Config) {
		c.Cluster.Node, c.AuthToken, c.NoLedger = "node-b", token, true
		c.Cluster.Peers = evil.addr
	})
	for _, cl := range b.clients() {
		ck := nodeid.New("ck", "evil")
		_, err := cl.c.Fork(t.Context(), &deltagymv1.ForkRequest{Source: &deltagymv1.ForkRequest_CheckpointId{CheckpointId: ck}, N: 1})
		if codeOf(err) != connect.CodeResourceExhausted {
			t.Fatalf("%s: a fork of a checkpoint whose layers claim 2^63 bytes: %v, want resource_exhausted", cl.name, err)
		}
		if n := evil.fetches.Load(); n != 0 {
			t.Fatalf("%s: %d layers fetched of a checkpoint beyond the cap", cl.name, n)
		}
	}
}

// TestNodeServiceBoundsIDs: DescribeCheckpoint and FetchLayer refuse an ID or digest longer
// than any the server makes with invalid_argument, and their errors do not quote it whole.
func TestNodeServiceBoundsIDs(t *testing.T) {
	b := setup(t, func(c *server.Config) { c.Cluster.Node, c.NoLedger = "node-a", true })
	nodes := deltagymv1connect.NewNodeServiceClient(http.DefaultClient, "http://"+b.addr, connect.WithInterceptors(bearer(b.token)))
	long := nodeid.New("ck", "node-a") + strings.Repeat("x", 1<<20)
	_, err := nodes.DescribeCheckpoint(t.Context(), connect.NewRequest(&deltagymv1.DescribeCheckpointRequest{CheckpointId: long}))
	if connect.CodeOf(err) != connect.CodeInvalidArgument || len(err.Error()) > 1024 {
		t.Fatalf("DescribeCheckpoint of a 1 MiB id: %.200s (%d bytes), want a short invalid_argument", err, len(err.Error()))
	}
	st, err := nodes.FetchLayer(t.Context(), connect.NewRequest(&deltagymv1.FetchLayerRequest{Digest: "sha256:" + strings.Repeat("0", 1<<20)}))
	must(t, err)
	for st.Receive() {
		t.Fatal("FetchLayer of a 1 MiB digest sent data")
	}
	if err := st.Err(); connect.CodeOf(err) != connect.CodeInvalidArgument || len(err.Error()) > 1024 {
		t.Fatalf("FetchLayer of a 1 MiB digest: %.200s (%d bytes), want a short invalid_argument", err, len(err.Error()))
	}
	_ = st.Close()
}

// TestFetchLayerStalledReader: a FetchLayer whose reader stops taking its messages is ended
// after Cluster.LayerTimeout without progress: it pins no layer (nor its memory) beyond
// that, here the layer of a checkpoint released meanwhile.
func TestFetchLayerStalledReader(t *testing.T) {
	b := setup(t, func(c *server.Config) {
		c.Cluster.Node, c.NoLedger = "node-a", true
		c.Admission.CheckpointBytes = 1 << 30
		c.Cluster.LayerTimeout = 500 * time.Millisecond
	})
	ctx := t.Context()
	c := b.clients()[0].c
	rr, err := c.Reset(ctx, &deltagymv1.ResetRequest{Env: "plain"})
	must(t, err)
	run(t, c, rr.GetSandboxId(), "head -c 33554432 /dev/urandom > /tmp/big")
	ck, err := c.Checkpoint(ctx, &deltagymv1.CheckpointRequest{SandboxId: rr.GetSandboxId()})
	must(t, err)
	var protos http.Protocols
	protos.SetUnencryptedHTTP2(true)
	h2c := &http.Client{Transport: &http.Transport{Protocols: &protos}}
	nodes := deltagymv1connect.NewNodeServiceClient(h2c, "http://"+b.addr, connect.WithInterceptors(bearer(b.token)))
	dr, err := nodes.DescribeCheckpoint(ctx, connect.NewRequest(&deltagymv1.DescribeCheckpointRequest{CheckpointId: ck.GetCheckpointId()}))
	must(t, err)
	layers := dr.Msg.GetManifest().GetLayers()
	top := layers[len(layers)-1]
	if top.GetSizeBytes() < 32<<20 {
		t.Fatalf("the checkpoint's top layer: %v, want one of 32 MiB", top)
	}
	st, err := nodes.FetchLayer(ctx, connect.NewRequest(&deltagymv1.FetchLayerRequest{Digest: top.GetDigest()}))
	must(t, err)
	defer st.Close()
	if !st.Receive() {
		t.Fatalf("FetchLayer: %v", st.Err())
	}
	// The reader stalls; the checkpoint and its sandbox go.
	_, err = c.Close(ctx, &deltagymv1.CloseRequest{SandboxId: rr.GetSandboxId()})
	must(t, err)
	_, err = c.ReleaseCheckpoint(ctx, &deltagymv1.ReleaseCheckpointRequest{CheckpointId: ck.GetCheckpointId()})
	must(t, err)
	for deadline := time.Now().Add(30 * time.Second); ; time.Sleep(50 * time.Millisecond) { // a watchdog's poll
		used := gauge(b.scrape(t), "deltagym_admission_used", `cap="checkpoint-bytes"[^}]*`)
		if used >= 0 && used < 16<<20 {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("a stalled FetchLayer pins its released layer: %d bytes of checkpoints held", used)
		}
	}
	got := int64(len(st.Msg().GetData()))
	for st.Receive() {
		got += int64(len(st.Msg().GetData()))
	}
	if st.Err() == nil {
		t.Fatalf("a stalled FetchLayer ended without an error, after %d bytes", got)
	}
}

// TestFetchLayerStalledPeer: a peer that starts a layer and then sends nothing more is given
// up on after Cluster.LayerTimeout: the Fork fails with NODE_UNAVAILABLE, the peer's stream
// is cancelled, and a retry asks again rather than wait on the first.
func TestFetchLayerStalledPeer(t *testing.T) {
	ended := make(chan struct{}, 2)
	evil := startHostilePeer(t, &hostilePeer{name: "evil",
		describe: func(id string) *deltagymv1.CheckpointManifest {
			return &deltagymv1.CheckpointManifest{CheckpointId: id, Image: "default", Layers: []*deltagymv1.LayerDescriptor{{Digest: digestOf('c'), SizeBytes: 4096}}}
		},
		fetch: func(ctx context.Context, _ string, stream *connect.ServerStream[deltagymv1.FetchLayerResponse]) error {
			defer func() { ended <- struct{}{} }()
			if err := stream.Send(&deltagymv1.FetchLayerResponse{Data: []byte("dglayer\x01")}); err != nil {
				return err
			}
			<-ctx.Done()
			return ctx.Err()
		}})
	b := setup(t, func(c *server.Config) {
		c.Cluster.Node, c.NoLedger = "node-b", true
		c.Cluster.Peers = evil.addr
		c.Cluster.LayerTimeout = 500 * time.Millisecond
	})
	ck := nodeid.New("ck", "evil")
	for i, cl := range b.clients() {
		_, err := cl.c.Fork(t.Context(), &deltagymv1.ForkRequest{Source: &deltagymv1.ForkRequest_CheckpointId{CheckpointId: ck}, N: 1})
		wantReason(t, cl.name+": a fork of a checkpoint whose layer stalls", err, connect.CodeUnavailable, "NODE_UNAVAILABLE", "checkpoint_id", ck, "node", "evil")
		<-ended // the peer's stream was cancelled
		if n := evil.fetches.Load(); n != int64(i+1) {
			t.Fatalf("%s: %d fetches, want %d", cl.name, n, i+1)
		}
	}
}
