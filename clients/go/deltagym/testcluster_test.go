package deltagym_test

import (
	"context"
	"errors"
	"fmt"
	"net"
	"net/http"
	"net/netip"
	"strconv"
	"strings"
	"sync"
	"testing"

	"connectrpc.com/connect"
	"golang.org/x/net/dns/dnsmessage"
	"google.golang.org/genproto/googleapis/rpc/errdetails"

	deltagym "github.com/deltagym/deltagym/clients/go/deltagym"
	deltagymv1 "github.com/deltagym/deltagym/clients/go/gen/deltagym/v1"
	"github.com/deltagym/deltagym/clients/go/gen/deltagym/v1/deltagymv1connect"
)

// dnsServer is the DNS of a test cluster, as a Kubernetes headless Service is: it answers the
// A queries for one name with the addresses the test sets (AAAA: none; other names: NXDOMAIN),
// on a loopback UDP port.
type dnsServer struct {
	conn net.PacketConn
	name string // fully qualified, lowercase
	done chan struct{}

	mu sync.Mutex
	// +checklocks:mu
	ips []netip.Addr
}

// startDNS serves name with ips until the test ends.
func startDNS(t testing.TB, name string, ips ...string) *dnsServer {
	t.Helper()
	conn, err := net.ListenPacket("udp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	d := &dnsServer{conn: conn, name: strings.ToLower(strings.TrimSuffix(name, ".")) + ".", done: make(chan struct{})}
	d.set(t, ips...)
	go d.serve()
	t.Cleanup(func() {
		conn.Close()
		<-d.done
	})
	return d
}

// set makes the name resolve to ips.
func (d *dnsServer) set(t testing.TB, ips ...string) {
	t.Helper()
	addrs := make([]netip.Addr, len(ips))
	for i, s := range ips {
		a, err := netip.ParseAddr(s)
		if err != nil || !a.Is4() {
			t.Fatalf("DNS record %q: want an IPv4 address", s)
		}
		addrs[i] = a
	}
	d.mu.Lock()
	d.ips = addrs
	d.mu.Unlock()
}

// resolver returns a resolver that asks d, and only d.
func (d *dnsServer) resolver() *net.Resolver {
	return &net.Resolver{PreferGo: true, Dial: func(ctx context.Context, _, _ string) (net.Conn, error) {
		var dl net.Dialer
		return dl.DialContext(ctx, "udp", d.conn.LocalAddr().String())
	}}
}

func (d *dnsServer) serve() {
	defer close(d.done)
	buf := make([]byte, 1500)
	for {
		n, from, err := d.conn.ReadFrom(buf)
		if err != nil {
			return // closed
		}
		if resp, err := d.answer(buf[:n]); err == nil {
			_, _ = d.conn.WriteTo(resp, from)
		}
	}
}

func (d *dnsServer) answer(query []byte) ([]byte, error) {
	var p dnsmessage.Parser
	h, err := p.Start(query)
	if err != nil {
		return nil, err
	}
	q, err := p.Question()
	if err != nil {
		return nil, err
	}
	ours := strings.EqualFold(q.Name.String(), d.name)
	rh := dnsmessage.Header{ID: h.ID, Response: true, Authoritative: true, RecursionDesired: h.RecursionDesired}
	if !ours {
		rh.RCode = dnsmessage.RCodeNameError
	}
	b := dnsmessage.NewBuilder(nil, rh)
	b.EnableCompression()
	if err := b.StartQuestions(); err != nil {
		return nil, err
	}
	if err := b.Question(q); err != nil {
		return nil, err
	}
	if err := b.StartAnswers(); err != nil {
		return nil, err
	}
	if ours && q.Type == dnsmessage.TypeA {
		d.mu.Lock()
		ips := d.ips
		d.mu.Unlock()
		for _, ip := range ips {
			if err := b.AResource(dnsmessage.ResourceHeader{Name: q.Name, Class: dnsmessage.ClassINET}, dnsmessage.AResource{A: ip.As4()}); err != nil {
				return nil, err
			}
		}
	}
	return b.Finish()
}

// listenSamePort listens on port P of every one of ips (loopback addresses: Linux routes all of
// 127.0.0.0/8 to lo), P the same for all: a headless Service's nodes share the port, as DNS
// A records give no port.
func listenSamePort(t testing.TB, ips ...string) (lns []net.Listener, port int) {
	t.Helper()
	for range 20 {
		first, err := net.Listen("tcp", net.JoinHostPort(ips[0], "0"))
		if err != nil {
			t.Fatal(err)
		}
		port = first.Addr().(*net.TCPAddr).Port
		lns = []net.Listener{first}
		for _, ip := range ips[1:] {
			ln, err := net.Listen("tcp", net.JoinHostPort(ip, strconv.Itoa(port)))
			if err != nil {
				break
			}
			lns = append(lns, ln)
		}
		if len(lns) == len(ips) {
			return lns, port
		}
		for _, ln := range lns {
			ln.Close()
		}
	}
	t.Fatalf("no port free on all of %v", ips)
	return nil, 0
}

// fakeNode is a node of a cluster for the client's unit tier: a real Connect server, on a
// loopback address, that answers NodeService and the EnvService and LedgerService calls a
// Cluster routes with what lets a test see where they went (each sandbox's env is the name of
// the node that answered). The integration tests run the same against real servers.
type fakeNode struct {
	deltagymv1connect.UnimplementedEnvServiceHandler
	deltagymv1connect.UnimplementedLedgerServiceHandler
	deltagymv1connect.UnimplementedNodeServiceHandler

	name   string
	addr   string
	token  string
	srv    *http.Server
	served chan struct{}

	mu sync.Mutex
	// sandboxes are the IDs it handed out, in order.
	// +checklocks:mu
	sandboxes []string
}

// startFake serves a fake node called name on ln until stop or the test's end; every call must
// carry token.
func startFake(t testing.TB, name, token string, ln net.Listener) *fakeNode {
	t.Helper()
	f := &fakeNode{name: name, addr: ln.Addr().String(), token: token, served: make(chan struct{})}
	mux := http.NewServeMux()
	mux.Handle(deltagymv1connect.NewNodeServiceHandler(f))
	mux.Handle(deltagymv1connect.NewEnvServiceHandler(f))
	mux.Handle(deltagymv1connect.NewLedgerServiceHandler(f))
	var p http.Protocols
	p.SetHTTP1(true)
	p.SetUnencryptedHTTP2(true)
	f.srv = &http.Server{Protocols: &p, Handler: http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.Header.Get("Authorization") != "Bearer "+token {
			http.Error(w, "unauthenticated", http.StatusUnauthorized)
			return
		}
		mux.ServeHTTP(w, r)
	})}
	go func() {
		defer close(f.served)
		_ = f.srv.Serve(ln)
	}()
	t.Cleanup(f.stop)
	return f
}

// stop ends the node: its listener and connections close, and new ones are refused.
func (f *fakeNode) stop() {
	_ = f.srv.Close()
	<-f.served
}

// handedOut returns the sandboxes the node handed out.
func (f *fakeNode) handedOut() []string {
	f.mu.Lock()
	defer f.mu.Unlock()
	return append([]string(nil), f.sandboxes...)
}

func (f *fakeNode) newSandbox() string {
	f.mu.Lock()
	defer f.mu.Unlock()
	id := fmt.Sprintf("sb-%s-%016x", f.name, len(f.sandboxes)+1)
	f.sandboxes = append(f.sandboxes, id)
	return id
}

func (f *fakeNode) GetNode(context.Context, *connect.Request[deltagymv1.GetNodeRequest]) (*connect.Response[deltagymv1.GetNodeResponse], error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	return connect.NewResponse(&deltagymv1.GetNodeResponse{Node: &deltagymv1.NodeInfo{Name: f.name, Address: f.addr, Version: "test",
		Sandboxes: int32(len(f.sandboxes)), Cpus: 2, MemoryAvailableBytes: 1 << 30, MemoryTotalBytes: 2 << 30}}), nil
}

func (f *fakeNode) Reset(_ context.Context, req *connect.Request[deltagymv1.ResetRequest]) (*connect.Response[deltagymv1.ResetResponse], error) {
	if req.Msg.GetIdempotencyKey() == "" {
		return nil, connect.NewError(connect.CodeInvalidArgument, errors.New("no idempotency key"))
	}
	return connect.NewResponse(&deltagymv1.ResetResponse{SandboxId: f.newSandbox(), EpisodeId: "ep-" + f.name}), nil
}

func (f *fakeNode) owns(id string) error {
	if n := deltagym.NodeOf(id); n != f.name && n != "" {
		return connect.NewError(connect.CodeFailedPrecondition, fmt.Errorf("%s is on node %s, not on %s", id, n, f.name))
	}
	return nil
}

func (f *fakeNode) GetSandbox(_ context.Context, req *connect.Request[deltagymv1.GetSandboxRequest]) (*connect.Response[deltagymv1.GetSandboxResponse], error) {
	if err := f.owns(req.Msg.GetSandboxId()); err != nil {
		return nil, err
	}
	return connect.NewResponse(&deltagymv1.GetSandboxResponse{Sandbox: &deltagymv1.Sandbox{SandboxId: req.Msg.GetSandboxId(), Env: f.name}}), nil
}

// Fork forks a checkpoint of any node, as a real node does once it has fetched it from its
// owner, but one whose ID says "beef" (a checkpoint with processes, which do not move) only on
// its own node: elsewhere it refuses, with PROCESSES_STAY.
func (f *fakeNode) Fork(_ context.Context, req *connect.Request[deltagymv1.ForkRequest]) (*connect.Response[deltagymv1.ForkResponse], error) {
	if id := req.Msg.GetCheckpointId(); strings.Contains(id, "beef") {
		if err := f.owns(id); err != nil {
			ce := connect.NewError(connect.CodeFailedPrecondition, fmt.Errorf("checkpoint %s holds live processes: they do not move between nodes", id))
			if d, derr := connect.NewErrorDetail(&errdetails.ErrorInfo{Reason: "PROCESSES_STAY", Domain: "deltagym.dev"}); derr == nil {
				ce.AddDetail(d)
			}
			return nil, ce
		}
	}
	res := &deltagymv1.ForkResponse{CheckpointId: req.Msg.GetCheckpointId()}
	for range req.Msg.GetN() {
		res.SandboxIds = append(res.SandboxIds, f.newSandbox())
	}
	return connect.NewResponse(res), nil
}

func (f *fakeNode) ReleaseCheckpoint(_ context.Context, req *connect.Request[deltagymv1.ReleaseCheckpointRequest]) (*connect.Response[deltagymv1.ReleaseCheckpointResponse], error) {
	if err := f.owns(req.Msg.GetCheckpointId()); err != nil {
		return nil, err
	}
	return connect.NewResponse(&deltagymv1.ReleaseCheckpointResponse{}), nil
}

func (f *fakeNode) Heartbeat(_ context.Context, req *connect.Request[deltagymv1.HeartbeatRequest]) (*connect.Response[deltagymv1.HeartbeatResponse], error) {
	res := &deltagymv1.HeartbeatResponse{}
	for _, id := range req.Msg.GetSandboxIds() {
		if err := f.owns(id); err != nil {
			return nil, err
		}
		res.Leases = append(res.Leases, &deltagymv1.Lease{SandboxId: id})
	}
	return connect.NewResponse(res), nil
}

func (f *fakeNode) ListSandboxes(context.Context, *connect.Request[deltagymv1.ListSandboxesRequest]) (*connect.Response[deltagymv1.ListSandboxesResponse], error) {
	res := &deltagymv1.ListSandboxesResponse{}
	for _, id := range f.handedOut() {
		res.Sandboxes = append(res.Sandboxes, &deltagymv1.Sandbox{SandboxId: id, Env: f.name})
	}
	return connect.NewResponse(res), nil
}

func (f *fakeNode) ListEpisodes(context.Context, *connect.Request[deltagymv1.ListEpisodesRequest]) (*connect.Response[deltagymv1.ListEpisodesResponse], error) {
	return connect.NewResponse(&deltagymv1.ListEpisodesResponse{Episodes: []*deltagymv1.Episode{{EpisodeId: "ep-shared", Env: f.name}}}), nil
}
