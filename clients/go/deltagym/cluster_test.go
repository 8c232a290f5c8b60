package deltagym_test

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"runtime"
	"slices"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"connectrpc.com/connect"

	deltagym "github.com/deltagym/deltagym/clients/go/deltagym"
	deltagymv1 "github.com/deltagym/deltagym/clients/go/gen/deltagym/v1"
)

func TestSpread(t *testing.T) {
	node := func(sandboxes, max int32) *deltagymv1.NodeInfo {
		return &deltagymv1.NodeInfo{Sandboxes: sandboxes, MaxSandboxes: max, CpuLoad: 0.2, MemoryAvailableBytes: 6 << 30, MemoryTotalBytes: 8 << 30}
	}
	sum := func(c []int) (s int) {
		for _, k := range c {
			s += k
		}
		return s
	}
	t.Run("equal nodes share equally", func(t *testing.T) {
		for _, capped := range []int32{0, 1000} {
			got := deltagym.Spread([]*deltagymv1.NodeInfo{node(0, capped), node(0, capped), node(0, capped)}, 64)
			for i, k := range got {
				if d := float64(k) - 64.0/3; d < -6.4 || d > 6.4 {
					t.Errorf("cap %d: node %d gets %d of 64 (%v), want 64/3 ± 10%% of 64", capped, i, k, got)
				}
			}
			if sum(got) != 64 {
				t.Errorf("cap %d: %v sums to %d, want 64", capped, got, sum(got))
			}
		}
	})
	t.Run("a loaded node gets fewer", func(t *testing.T) {
		got := deltagym.Spread([]*deltagymv1.NodeInfo{node(0, 0), node(30, 0), node(0, 0)}, 64)
		if sum(got) != 64 || got[1] >= got[0] || got[1] >= got[2] {
			t.Errorf("with 30 sandboxes on node 1: %v, want fewer there than on each other", got)
		}
	})
	t.Run("a busier CPU takes less", func(t *testing.T) {
		busy := node(0, 100)
		busy.CpuLoad = 0.6
		got := deltagym.Spread([]*deltagymv1.NodeInfo{node(0, 100), busy}, 60)
		if sum(got) != 60 || got[1] >= got[0] || got[1] == 0 {
			t.Errorf("CPU load 0.2 and 0.6: %v, want fewer, but some, on the busier", got)
		}
	})
	t.Run("caps hold while another node has room", func(t *testing.T) {
		got := deltagym.Spread([]*deltagymv1.NodeInfo{node(8, 10), node(0, 100)}, 50)
		if got[0] > 2 || sum(got) != 50 {
			t.Errorf("a node with room for 2: %v", got)
		}
		got = deltagym.Spread([]*deltagymv1.NodeInfo{node(10, 10), node(5, 10)}, 8)
		if sum(got) != 8 || got[1] < 5 {
			t.Errorf("all full after 5: %v, want the room filled first, then the rest spread", got)
		}
	})
	t.Run("draining and missing nodes get none", func(t *testing.T) {
		d := node(0, 0)
		d.Draining = true
		got := deltagym.Spread([]*deltagymv1.NodeInfo{d, nil, node(50, 0)}, 5)
		if !slices.Equal(got, []int{0, 0, 5}) {
			t.Errorf("draining, nil, loaded: %v, want all on the last", got)
		}
		if got := deltagym.Spread([]*deltagymv1.NodeInfo{d}, 3); !slices.Equal(got, []int{0}) {
			t.Errorf("only a draining node: %v", got)
		}
		if got := deltagym.Spread(nil, 3); len(got) != 0 {
			t.Errorf("no nodes: %v", got)
		}
	})
	t.Run("one at a time", func(t *testing.T) {
		// Reset places one sandbox at a time, counting those it placed: round robin over equals.
		nodes := []*deltagymv1.NodeInfo{node(0, 0), node(0, 0), node(0, 0)}
		var order []int
		for range 6 {
			i := slices.Index(deltagym.Spread(nodes, 1), 1)
			order = append(order, i)
			nodes[i].Sandboxes++
		}
		if !slices.Equal(order, []int{0, 1, 2, 0, 1, 2}) {
			t.Errorf("six Resets went to %v", order)
		}
	})
}

func TestClusterTarget(t *testing.T) {
	for _, c := range []struct {
		target  string
		cluster bool
		ok      bool
	}{
		{"dns:deltagym.deltagym.svc.cluster.local:8080", true, true},
		{"dns:///deltagym:8080", true, true},
		{"10.0.0.1:8080,10.0.0.2:8080", true, true},
		{"10.0.0.1:8080, https://b.example:443,", true, true},
		{"10.0.0.1:8080", false, true},
		{"dns:deltagym", true, false},
		{"dns:deltagym:http", true, false},
		{"dns::8080", true, false},
		{",,", true, false},
		{"10.0.0.1:8080,nohost", true, false},
		{"10.0.0.1:8080,dns:x:1", true, false},
	} {
		if got := deltagym.IsClusterTarget(c.target); got != c.cluster {
			t.Errorf("IsClusterTarget(%q) = %v", c.target, got)
		}
		err := deltagym.CheckClusterTarget(c.target)
		if (err == nil) != c.ok || err != nil && !errors.Is(err, deltagym.ErrBadAddress) {
			t.Errorf("CheckClusterTarget(%q) = %v, want ok %v", c.target, err, c.ok)
		}
	}
	if _, err := deltagym.Dial("dns:x:8080"); !errors.Is(err, deltagym.ErrBadAddress) || !strings.Contains(err.Error(), "DialCluster") {
		t.Errorf("Dial of a cluster target: %v, want a pointer to DialCluster", err)
	}
	if _, err := deltagym.DialCluster(t.Context(), "dns:nope", deltagym.WithToken("")); !errors.Is(err, deltagym.ErrBadAddress) {
		t.Errorf("DialCluster of a bad target: %v", err)
	}
	ctx, cancel := context.WithCancel(t.Context())
	cancel()
	if _, err := deltagym.DialCluster(ctx, "127.0.0.1:1", deltagym.WithToken("")); !errors.Is(err, context.Canceled) {
		t.Errorf("DialCluster with an ended context: %v", err)
	}
}

func TestNodeOf(t *testing.T) {
	for id, want := range map[string]string{
		"sb-node-a-3f2a9c0d1e4b5a69": "node-a", "ck-a-3f2a9c0d1e4b5a69": "a", "sb-ip-10-0-0-1.ec2.internal-3f2a9c0d1e4b5a69": "ip-10-0-0-1.ec2.internal",
		"sb-3f2a9c0d1e4b5a69": "", "sb-Node-3f2a9c0d1e4b5a69": "", "sb-node-3F2A9C0D1E4B5A69": "", "sb-node-3f2a9c0d1e4b5a6": "",
		"": "", "sb-": "", "sb--3f2a9c0d1e4b5a69": "", "sb-.x-3f2a9c0d1e4b5a69": "", "sb-" + strings.Repeat("n", 101) + "-3f2a9c0d1e4b5a69": "",
	} {
		if got := deltagym.NodeOf(id); got != want {
			t.Errorf("NodeOf(%q) = %q, want %q", id, got, want)
		}
	}
}

// fakeCluster is three fake nodes on 127.0.0.2-4, one port, and the DNS name that lists them.
type fakeCluster struct {
	nodes   []*fakeNode
	dns     *dnsServer
	port    int
	target  string
	token   string
	refresh chan struct{} // a value after each refresh of the cluster dialled by dial
}

const fakeName = "nodes.deltagym.test"

var fakeIPs = []string{"127.0.0.2", "127.0.0.3", "127.0.0.4"}

func startFakeCluster(t testing.TB) *fakeCluster {
	t.Helper()
	lns, port := listenSamePort(t, fakeIPs...)
	fc := &fakeCluster{port: port, token: "cluster-token", target: "dns:" + fakeName + ":" + strconv.Itoa(port), refresh: make(chan struct{}, 64)}
	for i, ln := range lns {
		fc.nodes = append(fc.nodes, startFake(t, "node-"+string(rune('a'+i)), fc.token, ln))
	}
	fc.dns = startDNS(t, fakeName, fakeIPs...)
	return fc
}

// dial dials the cluster through its DNS, refreshing every interval.
func (fc *fakeCluster) dial(t *testing.T, interval time.Duration) *deltagym.Cluster {
	t.Helper()
	cl, err := deltagym.DialCluster(t.Context(), fc.target, deltagym.WithToken(fc.token), deltagym.WithResolver(fc.dns.resolver()),
		deltagym.WithRefreshInterval(interval), deltagym.WithRetry(1, 0), deltagym.WithOnRefresh(func() {
			select {
			case fc.refresh <- struct{}{}:
			default:
			}
		}))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = cl.Close() })
	return cl
}

// restartAt serves node i again at its address, as a node restarted with its name.
func (fc *fakeCluster) restartAt(t *testing.T, i int) {
	t.Helper()
	ln, err := net.Listen("tcp", fc.nodes[i].addr)
	if err != nil {
		t.Fatal(err)
	}
	fc.nodes[i] = startFake(t, fc.nodes[i].name, fc.token, ln)
}

// names returns the names of the nodes of cl that answer.
func names(cl *deltagym.Cluster) []string {
	var out []string
	for _, n := range cl.Nodes() {
		if n.Err == nil {
			out = append(out, n.Name)
		}
	}
	return out
}

// TestClusterRouting drives a Cluster over three fake nodes found through DNS: placement spreads
// Resets, calls go to the node an ID names, a node that stops makes calls on its sandboxes fail
// Unavailable naming it while Resets go to the others, and it rejoins after a refresh.
func TestClusterRouting(t *testing.T) {
	fc := startFakeCluster(t)
	cl := fc.dial(t, time.Hour) // refreshed by the test only
	ctx := t.Context()

	nodes := cl.Nodes()
	if len(nodes) != 3 {
		t.Fatalf("Nodes() = %+v, want 3", nodes)
	}
	for i, n := range nodes {
		want := fmt.Sprintf("127.0.0.%d:%d", i+2, fc.port)
		if n.Name != fc.nodes[i].name || n.Addr != want || n.Err != nil || !n.Listed || n.Report.GetVersion() != "test" {
			t.Errorf("node %d: %+v, want %s at %s, answering", i, n, fc.nodes[i].name, want)
		}
	}

	// Placement: nine Resets, three to each equal node.
	var sbs []*deltagym.Sandbox
	for range 9 {
		sb, err := cl.Reset(ctx, "shell")
		if err != nil {
			t.Fatal(err)
		}
		sbs = append(sbs, sb)
	}
	for _, f := range fc.nodes {
		if got := len(f.handedOut()); got != 3 {
			t.Errorf("%s took %d of 9 Resets, want 3", f.name, got)
		}
	}

	// Routing: each sandbox's calls go to its node, through handles and by ID.
	for _, sb := range sbs {
		info, err := sb.Info(ctx)
		if err != nil || info.GetEnv() != deltagym.NodeOf(sb.ID()) {
			t.Fatalf("Info of %s answered by %q: %v", sb.ID(), info.GetEnv(), err)
		}
		got, err := cl.GetSandbox(ctx, sb.ID())
		if err != nil || got.GetEnv() != deltagym.NodeOf(sb.ID()) {
			t.Fatalf("GetSandbox(%s) answered by %q: %v", sb.ID(), got.GetEnv(), err)
		}
	}
	ids := make([]string, len(sbs))
	for i, sb := range sbs {
		ids[i] = sb.ID()
	}
	hb, err := cl.Heartbeat(ctx, ids...)
	if err != nil || len(hb.Leases) != len(ids) {
		t.Fatalf("Heartbeat of all: %+v, %v", hb, err)
	}
	listed, err := cl.ListSandboxes(ctx, deltagym.SandboxFilter{})
	if err != nil || len(listed) != 9 {
		t.Fatalf("ListSandboxes: %d, %v", len(listed), err)
	}
	// A fork spreads over the nodes by load, a checkpoint of node-c on all three; one whose
	// processes stay on node-c (PROCESSES_STAY elsewhere) is made on node-c whole.
	fork, err := cl.Fork(ctx, "ck-node-c-00000000000000aa", 6)
	if err != nil || len(fork.Sandboxes) != 6 {
		t.Fatalf("Fork of node-c's checkpoint: %+v, %v", fork, err)
	}
	on := map[string]int{}
	for _, sb := range fork.Sandboxes {
		info, err := sb.Info(ctx)
		if err != nil || info.GetEnv() != deltagym.NodeOf(sb.ID()) {
			t.Fatalf("a child of node-c's checkpoint: %s on %q, %v", sb.ID(), info.GetEnv(), err)
		}
		on[info.GetEnv()]++
	}
	if len(on) != 3 {
		t.Fatalf("a fork of 6 over three equal nodes went to %v", on)
	}
	fork, err = cl.Fork(ctx, "ck-node-c-000000000000beef", 4)
	if err != nil || len(fork.Sandboxes) != 4 {
		t.Fatalf("Fork of node-c's checkpoint with processes: %+v, %v", fork, err)
	}
	for _, sb := range fork.Sandboxes {
		if deltagym.NodeOf(sb.ID()) != "node-c" {
			t.Fatalf("a child of node-c's checkpoint with processes is %s", sb.ID())
		}
	}
	if err := cl.ReleaseCheckpoint(ctx, "ck-node-b-00000000000000aa"); err != nil {
		t.Fatal(err)
	}
	if eps, _, err := cl.ListEpisodes(ctx, deltagym.EpisodeFilter{}); err != nil || len(eps) != 1 {
		t.Fatalf("ListEpisodes: %v, %v", eps, err)
	}

	// An ID of no node goes nowhere in a cluster of three.
	if _, err := cl.Sandbox("sb-0123456789abcdef"); connect.CodeOf(err) != connect.CodeInvalidArgument || !strings.Contains(err.Error(), "names no node") {
		t.Fatalf("Sandbox of an ID of no node: %v, want invalid_argument", err)
	}
	if _, err := cl.Sandbox("sb-node-z-0123456789abcdef"); connect.CodeOf(err) != connect.CodeUnavailable || !strings.Contains(err.Error(), "node node-z is unreachable") {
		t.Fatalf("Sandbox of an unknown node's ID: %v, want unavailable naming node-z", err)
	}

	// node-b stops: calls on its sandboxes fail naming it, Resets go to the others.
	b := fc.nodes[1]
	var onB []*deltagym.Sandbox
	for _, sb := range sbs {
		if deltagym.NodeOf(sb.ID()) == "node-b" {
			onB = append(onB, sb)
		}
	}
	b.stop()
	wantDown := fmt.Sprintf("node node-b (%s) is unreachable", b.addr)
	for _, sb := range onB {
		_, err := sb.Info(ctx)
		var ce *connect.Error
		var ne *deltagym.NodeError
		if !errors.As(err, &ce) || ce.Code() != connect.CodeUnavailable || !strings.Contains(ce.Message(), wantDown) || !errors.As(err, &ne) || ne.Node != "node-b" {
			t.Fatalf("Info of %s on the stopped node: %v, want unavailable: %s", sb.ID(), err, wantDown)
		}
	}
	before := len(fc.nodes[0].handedOut()) + len(fc.nodes[2].handedOut())
	for range 6 {
		if _, err := cl.Reset(ctx, "shell"); err != nil {
			t.Fatalf("Reset with node-b down: %v", err)
		}
	}
	if after := len(fc.nodes[0].handedOut()) + len(fc.nodes[2].handedOut()); after != before+6 {
		t.Fatalf("node-a and node-c took %d of 6 Resets", after-before)
	}
	hb, err = cl.Heartbeat(ctx, ids...)
	if err == nil || len(hb.Leases) != 6 || !strings.Contains(err.Error(), wantDown) {
		t.Fatalf("Heartbeat with node-b down: %d leases, %v; want the 6 of the others and an error naming node-b", len(hb.Leases), err)
	}
	if listed, err = cl.ListSandboxes(ctx, deltagym.SandboxFilter{}); err == nil || len(listed) != before+6 {
		t.Fatalf("ListSandboxes with node-b down: %d, %v", len(listed), err)
	}

	// The DNS drops it: it is forgotten as an address, known as a node whose calls fail.
	fc.dns.set(t, fakeIPs[0], fakeIPs[2])
	if err := cl.Refresh(ctx); err != nil {
		t.Fatal(err)
	}
	if got := names(cl); !slices.Equal(got, []string{"node-a", "node-c"}) {
		t.Fatalf("after node-b left the DNS: %v answer", got)
	}
	if st, ok := cl.Node("node-b"); !ok || st.Err == nil || st.Listed {
		t.Fatalf("node-b after it left: %+v, %v", st, ok)
	}
	if _, err := onB[0].Info(ctx); connect.CodeOf(err) != connect.CodeUnavailable || !strings.Contains(err.Error(), wantDown) {
		t.Fatalf("Info on node-b after it left the DNS: %v", err)
	}

	// It comes back at its address, and the DNS lists it: the next refresh takes it in.
	fc.restartAt(t, 1)
	fc.dns.set(t, fakeIPs...)
	if err := cl.Refresh(ctx); err != nil {
		t.Fatal(err)
	}
	if got := names(cl); !slices.Equal(got, []string{"node-a", "node-b", "node-c"}) {
		t.Fatalf("after node-b came back: %v answer", got)
	}
	if _, err := onB[0].Info(ctx); err != nil {
		t.Fatalf("Info on node-b after it came back: %v", err)
	}
	sb, err := cl.Reset(ctx, "shell")
	if err != nil || deltagym.NodeOf(sb.ID()) != "node-b" {
		t.Fatalf("Reset after node-b came back empty: %v, %v; want it on node-b", sb, err)
	}
}

// TestClusterRefreshes: the Cluster looks the name up again by itself, every interval.
func TestClusterRefreshes(t *testing.T) {
	fc := startFakeCluster(t)
	cl := fc.dial(t, 20*time.Millisecond)
	fc.dns.set(t, fakeIPs[0])
	// Of the refreshes that end after the change, the first may have looked the name up before
	// it; the second began after the first ended.
	for len(fc.refresh) > 0 {
		<-fc.refresh
	}
	for range 2 {
		select {
		case <-fc.refresh:
		case <-t.Context().Done():
			t.Fatal("no refresh")
		}
	}
	var listed []string
	for _, n := range cl.Nodes() {
		if n.Listed {
			listed = append(listed, n.Name)
		}
	}
	if !slices.Equal(listed, []string{"node-a"}) {
		t.Fatalf("after the DNS listed node-a alone: %v listed", listed)
	}
	// The others still answer: they keep serving their sandboxes, and take no new ones.
	if got := names(cl); !slices.Equal(got, []string{"node-a", "node-b", "node-c"}) {
		t.Fatalf("answering: %v", got)
	}
	for range 3 {
		sb, err := cl.Reset(t.Context(), "shell")
		if err != nil || deltagym.NodeOf(sb.ID()) != "node-a" {
			t.Fatalf("Reset with node-a alone listed: %v, %v", sb, err)
		}
	}
}

// TestClusterOfOne: a static list of one address; an ID of no node goes to its only node, and
// two addresses of one node are one node.
func TestClusterOfOne(t *testing.T) {
	lns, port := listenSamePort(t, "127.0.0.2")
	f := startFake(t, "solo", "tok", lns[0])
	// Two spellings of one address, and a URL of it: one node, keyed by its name.
	target := fmt.Sprintf("127.0.0.2:%d,http://127.0.0.2:%d/", port, port)
	cl, err := deltagym.DialCluster(t.Context(), target, deltagym.WithToken("tok"))
	if err != nil {
		t.Fatal(err)
	}
	defer cl.Close()
	if got := names(cl); !slices.Equal(got, []string{"solo"}) {
		t.Fatalf("nodes: %v", cl.Nodes())
	}
	info, err := cl.GetSandbox(t.Context(), "sb-0123456789abcdef")
	if err != nil || info.GetEnv() != "solo" {
		t.Fatalf("GetSandbox of an ID of no node: %v, %v", info, err)
	}
	if cl.Target() != target || len(f.handedOut()) != 0 {
		t.Fatalf("target %q", cl.Target())
	}
	// A refresh its caller gives up on learns nothing: the node still answers.
	gone, cancel := context.WithCancel(t.Context())
	cancel()
	_ = cl.Refresh(gone)
	if got := names(cl); !slices.Equal(got, []string{"solo"}) {
		t.Fatalf("after a refresh cut short: %v", cl.Nodes())
	}
	// A wrong token: the node does not answer as one of the cluster.
	bad, err := deltagym.DialCluster(t.Context(), target, deltagym.WithToken("wrong"))
	if err != nil {
		t.Fatal(err)
	}
	defer bad.Close()
	if _, err := bad.Reset(t.Context(), "shell"); connect.CodeOf(err) != connect.CodeUnavailable || !strings.Contains(err.Error(), "unreachable") {
		t.Fatalf("Reset with a wrong token: %v", err)
	}
	for _, n := range bad.Nodes() {
		if connect.CodeOf(n.Err) != connect.CodeUnauthenticated {
			t.Fatalf("a node asked with a wrong token: %+v", n)
		}
	}
}

// TestClusterClose: Close stops the refreshes and closes every node's Client, leaving no
// goroutine; it is idempotent, and calls after it fail with ErrClientClosed.
func TestClusterClose(t *testing.T) {
	fc := startFakeCluster(t)
	before := clientGoroutines()
	cl, err := deltagym.DialCluster(t.Context(), fc.target, deltagym.WithToken(fc.token), deltagym.WithResolver(fc.dns.resolver()),
		deltagym.WithRefreshInterval(5*time.Millisecond))
	if err != nil {
		t.Fatal(err)
	}
	sb, err := cl.Reset(t.Context(), "shell")
	if err != nil {
		t.Fatal(err)
	}
	if err := sb.KeepAlive(time.Hour); err != nil {
		t.Fatal(err)
	}
	fc.nodes[2].stop() // a node down: its connections' goroutines end too
	if _, err := cl.ListSandboxes(t.Context(), deltagym.SandboxFilter{}); err == nil {
		t.Fatal("ListSandboxes with node-c down: no error")
	}
	for range 2 {
		if err := cl.Close(); err != nil {
			t.Fatal(err)
		}
	}
	if _, err := cl.Reset(t.Context(), "shell"); !errors.Is(err, deltagym.ErrClientClosed) {
		t.Fatalf("Reset after Close: %v", err)
	}
	if err := cl.Refresh(t.Context()); !errors.Is(err, deltagym.ErrClientClosed) {
		t.Fatalf("Refresh after Close: %v", err)
	}
	if _, err := sb.Info(t.Context()); !errors.Is(err, deltagym.ErrClientClosed) {
		t.Fatalf("a handle's call after Close: %v", err)
	}
	// Goroutines that are on their way out (connections' readers closing) may still run: give
	// them until they are done, as goleak does. The fake nodes' own goroutines (a connection
	// the server side has not seen closed yet) are not the client's.
	deadline := time.Now().Add(10 * time.Second)
	for delay := time.Millisecond; clientGoroutines() > before; delay = min(2*delay, 100*time.Millisecond) {
		if time.Now().After(deadline) {
			buf := make([]byte, 1<<20)
			t.Fatalf("%d goroutines of the client before DialCluster, %d after Close:\n%s", before, clientGoroutines(), buf[:runtime.Stack(buf, true)])
		}
		time.Sleep(delay)
	}
}

// serverFrames mark a goroutine of the test's fake nodes or DNS server, not of the client.
var serverFrames = []string{"net/http.(*conn).serve", "net/http.(*http2serverConn)", "net/http.(*Server)", "(*dnsServer)"}

// clientGoroutines counts the goroutines of the process but those of the test's servers.
func clientGoroutines() int {
	buf := make([]byte, 1<<22)
	n := 0
	for _, g := range strings.Split(string(buf[:runtime.Stack(buf, true)]), "\n\n") {
		if !slices.ContainsFunc(serverFrames, func(f string) bool { return strings.Contains(g, f) }) {
			n++
		}
	}
	return n
}

// BenchmarkClusterRoute times what a Cluster adds to a call before it is sent: reading the node
// an ID names and finding that node's Client (Cluster.Sandbox), over three nodes.
func BenchmarkClusterRoute(b *testing.B) {
	fc := startFakeCluster(b)
	cl, err := deltagym.DialCluster(b.Context(), fc.target, deltagym.WithToken(fc.token), deltagym.WithResolver(fc.dns.resolver()))
	if err != nil {
		b.Fatal(err)
	}
	defer cl.Close()
	id := "sb-node-b-3f2a9c0d1e4b5a69"
	for b.Loop() {
		if _, err := cl.Sandbox(id); err != nil {
			b.Fatal(err)
		}
	}
}

// TestClusterNameClash: nodes at two addresses that advertise different addresses but report
// one name (two nodes given one name, or one posing as another) get no calls on that name's
// IDs and no new sandboxes, each refused naming both addresses, while the other nodes serve on;
// once one of them is gone, the name serves again.
func TestClusterNameClash(t *testing.T) {
	const token = "t"
	listen := func() net.Listener {
		ln, err := net.Listen("tcp", "127.0.0.1:0")
		if err != nil {
			t.Fatal(err)
		}
		return ln
	}
	twinA := startFake(t, "twin", token, listen())
	twinB := startFake(t, "twin", token, listen())
	other := startFake(t, "other", token, listen())
	cl, err := deltagym.DialCluster(t.Context(), twinA.addr+","+twinB.addr+","+other.addr, deltagym.WithToken(token), deltagym.WithRefreshInterval(time.Hour))
	if err != nil {
		t.Fatal(err)
	}
	defer cl.Close()
	ctx := t.Context()
	_, err = cl.Sandbox("sb-twin-0000000000000001")
	if connect.CodeOf(err) != connect.CodeUnavailable || !strings.Contains(err.Error(), "all report the name twin") ||
		!strings.Contains(err.Error(), twinA.addr) || !strings.Contains(err.Error(), twinB.addr) {
		t.Fatalf("Sandbox of a clashing name's ID: %v, want unavailable naming both addresses", err)
	}
	for range 3 {
		sb, err := cl.Reset(ctx, "shell")
		if err != nil || deltagym.NodeOf(sb.ID()) != "other" {
			t.Fatalf("Reset beside a clashing name: %v, %v; want node other", sb, err)
		}
	}
	twinB.stop()
	if err := cl.Refresh(ctx); err != nil {
		t.Fatal(err)
	}
	if _, err := cl.Sandbox("sb-twin-0000000000000001"); err != nil {
		t.Fatalf("Sandbox of twin's ID once one of the two is gone: %v", err)
	}
}

// BenchmarkSpread times the placement of a Fork's 64 children over 100 nodes of unequal loads
// (Spread's water-filling: one score per node for each child), as a Cluster of 100 nodes makes it.
func BenchmarkSpread(b *testing.B) {
	nodes := make([]*deltagymv1.NodeInfo, 100)
	for i := range nodes {
		nodes[i] = &deltagymv1.NodeInfo{Name: fmt.Sprintf("node-%d", i), Sandboxes: int32(i % 17 * 5), MaxSandboxes: 1000,
			Cpus: 64, CpuLoad: float64(i%5) / 10, MemoryAvailableBytes: 200 << 30, MemoryTotalBytes: 256 << 30}
	}
	for b.Loop() {
		if got := deltagym.Spread(nodes, 64); len(got) != len(nodes) {
			b.Fatalf("Spread gave %d counts for %d nodes", len(got), len(nodes))
		}
	}
}

// A call's error is the transport's when no server answered it: a connection refused or
// lost, broken by the peer, or an answer cut short by the peer's end; a server's answer
// (a wire error) never is, nor an error of the caller's own context.
func TestTransportFailure(t *testing.T) {
	ctx := context.Background()
	done, cancel := context.WithCancel(ctx)
	cancel()
	cut := connect.NewError(connect.CodeUnknown, fmt.Errorf("read message: %w", io.ErrUnexpectedEOF))
	wire := connect.NewWireError(connect.CodeUnknown, io.ErrUnexpectedEOF)
	for _, c := range []struct {
		name string
		ctx  context.Context
		err  error
		want bool
	}{
		{"refused", ctx, connect.NewError(connect.CodeUnavailable, syscall.ECONNREFUSED), true},
		{"reset", ctx, connect.NewError(connect.CodeCanceled, syscall.ECONNRESET), true},
		{"cut short", ctx, cut, true},
		{"cut short, the caller gone", done, cut, false},
		{"a server's unknown", ctx, wire, false},
		{"another unknown", ctx, connect.NewError(connect.CodeUnknown, errors.New("x")), false},
	} {
		if got := deltagym.TransportFailure(c.ctx, c.err); got != c.want {
			t.Errorf("%s: %v, want %v", c.name, got, c.want)
		}
	}
}
