package deltagym_test

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"connectrpc.com/connect"
	"google.golang.org/genproto/googleapis/rpc/errdetails"

	deltagym "github.com/deltagym/deltagym/clients/go/deltagym"
	deltagymv1 "github.com/deltagym/deltagym/clients/go/gen/deltagym/v1"
)

// serverNode is a node of a real test cluster: `deltagym serve` of the checkout, on a loopback
// address of its own, with a data directory, a node name and the cluster's token.
type serverNode struct {
	name, addr, data string
	bin, init        string
	peers, token     string

	cmd    *exec.Cmd
	exited chan error
	log    *os.File
}

// start starts the node's server and waits until its pools are warm.
func (n *serverNode) start(t *testing.T) {
	t.Helper()
	envs, err := filepath.Abs(filepath.Join("testdata", "envs"))
	if err != nil {
		t.Fatal(err)
	}
	if n.log, err = os.OpenFile(filepath.Join(n.data, "server.log"), os.O_CREATE|os.O_WRONLY|os.O_APPEND, 0o644); err != nil {
		t.Fatal(err)
	}
	n.cmd = exec.Command(n.bin, "serve", "--addr", n.addr, "--advertise-addr", n.addr, "--node-name", n.name, "--peers", n.peers,
		"--data", n.data, "--envs", envs, "--init", n.init, "--no-ledger", "--acquire-timeout", "1m")
	n.cmd.Env = append(os.Environ(), "DELTAGYM_TOKEN="+n.token)
	n.cmd.Stdout, n.cmd.Stderr = n.log, n.log
	n.cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true}
	if err := n.cmd.Start(); err != nil {
		t.Fatal(err)
	}
	n.exited = make(chan error, 1)
	go func() { n.exited <- n.cmd.Wait() }()
	if err := waitNode(n.addr, n.token, n.exited); err != nil {
		t.Fatalf("%s: %v\n%s", n.name, err, n.logText())
	}
}

// stop stops the node's server as a clean stop does (SIGTERM), and waits for it to exit.
func (n *serverNode) stop(t *testing.T) {
	t.Helper()
	if n.cmd == nil {
		return
	}
	_ = n.cmd.Process.Signal(syscall.SIGTERM)
	select {
	case err := <-n.exited:
		if err != nil {
			t.Errorf("%s exited: %v\n%s", n.name, err, n.logText())
		}
	case <-time.After(time.Minute):
		_ = n.cmd.Process.Kill()
		t.Errorf("%s did not stop within a minute: %v", n.name, <-n.exited)
	}
	n.cmd = nil
	n.log.Close()
}

func (n *serverNode) logText() string {
	b, _ := os.ReadFile(filepath.Join(n.data, "server.log"))
	return string(b)
}

// waitNode waits until the server at addr answers with every env warm. A server that exits
// meanwhile leaves its exit in exited again, for the stop that follows.
func waitNode(addr, token string, exited chan error) error {
	c, err := deltagym.Dial(addr, deltagym.WithToken(token), deltagym.WithRetry(1, 0))
	if err != nil {
		return err
	}
	defer c.Close()
	deadline := time.Now().Add(3 * time.Minute)
	tick := time.NewTicker(50 * time.Millisecond)
	defer tick.Stop()
	for {
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		envs, err := c.ListEnvs(ctx)
		cancel()
		ready := err == nil && len(envs) > 0
		for _, e := range envs {
			ready = ready && e.GetWarmCount() > 0
		}
		if ready {
			return nil
		}
		select {
		case werr := <-exited:
			exited <- werr
			return fmt.Errorf("the server exited while starting: %v", werr)
		case <-tick.C:
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("the server is not ready after 3 minutes (last: %v)", err)
		}
	}
}

// startServerCluster starts len(names) nodes on 127.0.0.2, 127.0.0.3, …, all on one port, each
// knowing the others (--peers), one after the other: the last one's discovery, at its start,
// finds every other.
func startServerCluster(t *testing.T, names ...string) (nodes []*serverNode, port int) {
	t.Helper()
	root, err := checkoutRoot()
	if err != nil {
		t.Fatal(err)
	}
	initBin := os.Getenv("DELTAGYM_INIT")
	if initBin == "" {
		initBin = filepath.Join(root, "bin", "dg-init")
	}
	image := filepath.Join(root, ".data", "images", "default")
	if d := os.Getenv("DATA"); d != "" {
		image = filepath.Join(d, "images", "default")
	}
	ips := make([]string, len(names))
	for i := range names {
		ips[i] = "127.0.0." + strconv.Itoa(i+2)
	}
	lns, port := listenSamePort(t, ips...)
	for _, ln := range lns {
		ln.Close() // the servers listen there
	}
	addrs := make([]string, len(ips))
	for i, ip := range ips {
		addrs[i] = net.JoinHostPort(ip, strconv.Itoa(port))
	}
	token := "cluster-" + deltagym.NewIdempotencyKey()
	for i, name := range names {
		data, err := os.MkdirTemp("", "dgcluster-")
		if err != nil {
			t.Fatal(err)
		}
		if err := os.MkdirAll(filepath.Join(data, "images"), 0o755); err != nil {
			t.Fatal(err)
		}
		if err := os.Symlink(image, filepath.Join(data, "images", "default")); err != nil {
			t.Fatal(err)
		}
		n := &serverNode{name: name, addr: addrs[i], data: data, bin: filepath.Join(root, "bin", "deltagym"), init: initBin,
			peers: strings.Join(addrs, ","), token: token}
		t.Cleanup(func() {
			n.stop(t)
			if t.Failed() {
				t.Logf("%s's log:\n%s", n.name, n.logText())
			}
			out, err := exec.Command(n.bin, "purge", "--data", n.data).CombinedOutput()
			if err != nil {
				t.Errorf("purge of %s: %v: %s", n.name, err, out)
			}
			_ = os.RemoveAll(n.data)
		})
		n.start(t)
		nodes = append(nodes, n)
	}
	return nodes, port
}

// TestClusterOfServers runs three real servers as a cluster found through DNS: Resets spread
// over them, calls go to the node an ID names, a call sent to the wrong node says where the
// sandbox is, the CLI routes as the client does, and a node that stops makes calls on its
// sandboxes fail naming it while Resets go to the others; restarted, it rejoins after a
// refresh and serves its checkpoints again.
func TestClusterOfServers(t *testing.T) {
	needServer(t)
	nodes, port := startServerCluster(t, "node-a", "node-b", "node-c")
	a, b, c := nodes[0], nodes[1], nodes[2]
	dns := startDNS(t, "nodes.deltagym.test", "127.0.0.2", "127.0.0.3", "127.0.0.4")
	ctx := t.Context()
	cl, err := deltagym.DialCluster(ctx, "dns:nodes.deltagym.test:"+strconv.Itoa(port), deltagym.WithToken(a.token),
		deltagym.WithResolver(dns.resolver()), deltagym.WithRefreshInterval(time.Hour))
	if err != nil {
		t.Fatal(err)
	}
	defer cl.Close()

	got := cl.Nodes()
	if len(got) != 3 {
		t.Fatalf("Nodes() = %+v", got)
	}
	for i, st := range got {
		if st.Name != nodes[i].name || st.Addr != nodes[i].addr || st.Err != nil || st.Report.GetAddress() != nodes[i].addr ||
			st.Report.GetDraining() || st.Report.GetVersion() == "" || st.Report.GetMaxSandboxes() <= 0 {
			t.Fatalf("node %d: %+v, want %s at %s", i, st, nodes[i].name, nodes[i].addr)
		}
	}

	// Placement: six Resets over three equal nodes.
	var sbs []*deltagym.Sandbox
	per := map[string][]*deltagym.Sandbox{}
	for range 6 {
		sb, err := cl.Reset(ctx, "shell")
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { _ = sb.Close(context.Background()) })
		sbs = append(sbs, sb)
		per[deltagym.NodeOf(sb.ID())] = append(per[deltagym.NodeOf(sb.ID())], sb)
	}
	for _, n := range nodes {
		if len(per[n.name]) < 1 {
			t.Fatalf("Resets went to %v: none to %s", keys(per), n.name)
		}
	}

	// Routing: steps, descriptions, checkpoints and forks go to each sandbox's node.
	cks := map[string]string{}
	var ids []string
	for _, sb := range sbs {
		ids = append(ids, sb.ID())
		node := deltagym.NodeOf(sb.ID())
		if res, err := sb.Exec(ctx, "echo "+node+" > /work/mark; cat /work/mark"); err != nil || string(res.Stdout) != node+"\n" {
			t.Fatalf("Exec in %s: %+v, %v", sb.ID(), res, err)
		}
		info, err := cl.GetSandbox(ctx, sb.ID())
		if err != nil || info.GetSandboxId() != sb.ID() {
			t.Fatalf("GetSandbox(%s): %v, %v", sb.ID(), info, err)
		}
		if cks[node] == "" {
			ck, err := sb.Checkpoint(ctx)
			if err != nil || deltagym.NodeOf(ck.ID) != node {
				t.Fatalf("Checkpoint of %s: %+v, %v", sb.ID(), ck, err)
			}
			cks[node] = ck.ID
		}
	}
	// A fork of node-a's checkpoint spreads over the nodes: the others fetch it from node-a.
	fork, err := cl.Fork(ctx, cks["node-a"], 3)
	if err != nil || len(fork.Sandboxes) != 3 {
		t.Fatalf("Fork of node-a's checkpoint: %+v, %v", fork, err)
	}
	forkedOn := map[string]bool{}
	for _, kid := range fork.Sandboxes {
		t.Cleanup(func() { _ = kid.Close(context.Background()) })
		forkedOn[deltagym.NodeOf(kid.ID())] = true
		if res, err := kid.Exec(ctx, "cat /work/mark"); err != nil || string(res.Stdout) != "node-a\n" {
			t.Fatalf("a child of node-a's checkpoint: %s: %+v, %v", kid.ID(), res, err)
		}
	}
	if len(forkedOn) < 2 {
		t.Fatalf("a fork of 3 over three nodes went to %v only", forkedOn)
	}
	hb, err := cl.Heartbeat(ctx, ids...)
	if err != nil || len(hb.Leases) != len(ids) {
		t.Fatalf("Heartbeat of %d sandboxes over three nodes: %+v, %v", len(ids), hb, err)
	}
	listed, err := cl.ListSandboxes(ctx, deltagym.SandboxFilter{})
	if err != nil {
		t.Fatal(err)
	}
	for _, id := range ids {
		if !slices.ContainsFunc(listed, func(s *deltagymv1.Sandbox) bool { return s.GetSandboxId() == id }) {
			t.Fatalf("ListSandboxes over the nodes lacks %s", id)
		}
	}
	ckList, err := cl.ListCheckpoints(ctx, deltagym.CheckpointFilter{})
	if err != nil {
		t.Fatal(err)
	}
	for _, ck := range cks {
		if !slices.ContainsFunc(ckList, func(s *deltagymv1.CheckpointSummary) bool { return s.GetCheckpointId() == ck }) {
			t.Fatalf("ListCheckpoints over the nodes lacks %s", ck)
		}
	}

	// A call sent to the wrong node names the owner and its address (node-c knows its peers).
	direct, err := deltagym.Dial(c.addr, deltagym.WithToken(c.token))
	if err != nil {
		t.Fatal(err)
	}
	defer direct.Close()
	onA := per["node-a"][0].ID()
	_, err = direct.Sandbox(onA).Info(ctx)
	var ce *connect.Error
	if !errors.As(err, &ce) || ce.Code() != connect.CodeFailedPrecondition || !strings.Contains(ce.Message(), "node node-a ("+a.addr+")") {
		t.Fatalf("GetSandbox of node-a's sandbox on node-c: %v, want failed_precondition naming node-a at %s", err, a.addr)
	}
	if info := errorInfo(ce); info.GetReason() != "WRONG_NODE" || info.GetMetadata()["node"] != "node-a" || info.GetMetadata()["address"] != a.addr {
		t.Fatalf("WRONG_NODE's details: %v", info)
	}

	// The CLI routes as the client does.
	peers := a.peers
	out := runBin(t, a.bin, a.token, "nodes", "--addr", peers)
	for _, n := range nodes {
		if !strings.Contains(out, n.name) || !strings.Contains(out, n.addr) {
			t.Fatalf("deltagym nodes: %q lacks %s at %s", out, n.name, n.addr)
		}
	}
	if strings.Count(out, " ok\n") != 3 {
		t.Fatalf("deltagym nodes: %q, want three nodes ok", out)
	}
	onB := per["node-b"][0]
	if out := runBin(t, a.bin, a.token, "exec", "--addr", peers, onB.ID(), "--", "cat", "/work/mark"); out != "node-b\n" {
		t.Fatalf("deltagym exec in node-b's sandbox through the cluster printed %q", out)
	}
	// The CLI's fork of a checkpoint spreads its children over the nodes, as Cluster.Fork does.
	kidsOut := runBin(t, a.bin, a.token, "fork", "--addr", peers, cks["node-a"], "-n", "3", "-q")
	cliKids := strings.Fields(kidsOut)
	kidNodes := map[string]bool{}
	for _, id := range cliKids {
		kidNodes[deltagym.NodeOf(id)] = true
		kid, err := cl.Sandbox(id)
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { _ = kid.Close(context.Background()) })
	}
	if len(cliKids) != 3 || len(kidNodes) < 2 {
		t.Fatalf("deltagym fork -n 3 through the cluster printed %q: want three children on two nodes or more", kidsOut)
	}

	// node-b stops: calls on its sandboxes fail naming it, Resets go to the others.
	if _, err := onB.Exec(ctx, "echo kept > /work/kept"); err != nil {
		t.Fatal(err)
	}
	ckB, err := onB.Checkpoint(ctx)
	if err != nil {
		t.Fatal(err)
	}
	b.stop(t)
	wantDown := "node node-b (" + b.addr + ") is unreachable"
	_, err = onB.Exec(ctx, "true")
	if !errors.As(err, &ce) || ce.Code() != connect.CodeUnavailable || !strings.Contains(ce.Message(), wantDown) {
		t.Fatalf("Exec in node-b's sandbox with node-b stopped: %v, want unavailable: %s", err, wantDown)
	}
	if _, err := cl.Fork(ctx, ckB.ID, 1); connect.CodeOf(err) != connect.CodeUnavailable || !strings.Contains(err.Error(), wantDown) {
		t.Fatalf("Fork of node-b's checkpoint with node-b stopped: %v", err)
	}
	for range 4 {
		sb, err := cl.Reset(ctx, "shell")
		if err != nil {
			t.Fatalf("Reset with node-b stopped: %v", err)
		}
		t.Cleanup(func() { _ = sb.Close(context.Background()) })
		if deltagym.NodeOf(sb.ID()) == "node-b" {
			t.Fatalf("Reset with node-b stopped made %s", sb.ID())
		}
	}
	hb, err = cl.Heartbeat(ctx, ids...)
	if err == nil || !strings.Contains(err.Error(), wantDown) || len(hb.Leases) != len(ids)-len(per["node-b"]) {
		t.Fatalf("Heartbeat with node-b stopped: %d leases, %v", len(hb.Leases), err)
	}

	// It leaves the DNS, comes back on its data directory with its name, and the DNS lists it:
	// a refresh takes it in, and its checkpoint is served again.
	dns.set(t, "127.0.0.2", "127.0.0.4")
	if err := cl.Refresh(ctx); err != nil {
		t.Fatal(err)
	}
	if got := names(cl); !slices.Equal(got, []string{"node-a", "node-c"}) {
		t.Fatalf("answering after node-b left: %v", got)
	}
	b.start(t)
	dns.set(t, "127.0.0.2", "127.0.0.3", "127.0.0.4")
	if err := cl.Refresh(ctx); err != nil {
		t.Fatal(err)
	}
	if got := names(cl); !slices.Equal(got, []string{"node-a", "node-b", "node-c"}) {
		t.Fatalf("answering after node-b came back: %v", got)
	}
	kids, err := cl.Fork(ctx, ckB.ID, 1)
	if err != nil {
		t.Fatalf("Fork of node-b's checkpoint after its restart: %v", err)
	}
	kid := kids.Sandboxes[0]
	defer kid.Close(context.Background())
	if res, err := kid.Exec(ctx, "cat /work/kept"); err != nil || string(res.Stdout) != "kept\n" {
		t.Fatalf("a child of node-b's checkpoint after its restart: %s: %+v, %v", kid.ID(), res, err)
	}
	// The emptiest node now: the next Reset goes there.
	sb, err := cl.Reset(ctx, "shell")
	if err != nil || deltagym.NodeOf(sb.ID()) != "node-b" {
		t.Fatalf("Reset after node-b came back: %v, %v", sb, err)
	}
	_ = sb.Close(ctx)
}

// runBin runs the CLI binary with token and returns its standard output; it fails the test
// unless the command succeeds.
func runBin(t *testing.T, bin, token string, args ...string) string {
	t.Helper()
	cmd := exec.Command(bin, args...)
	cmd.Env = append(os.Environ(), "DELTAGYM_TOKEN="+token)
	var out, errb bytes.Buffer
	cmd.Stdout, cmd.Stderr = &out, &errb
	if err := cmd.Run(); err != nil {
		t.Fatalf("deltagym %q: %v\nstdout: %s\nstderr: %s", args, err, out.String(), errb.String())
	}
	return out.String()
}

// errorInfo returns the ErrorInfo detail of ce, nil when it has none.
func errorInfo(ce *connect.Error) *errdetails.ErrorInfo {
	for _, d := range ce.Details() {
		if v, err := d.Value(); err == nil {
			if info, ok := v.(*errdetails.ErrorInfo); ok {
				return info
			}
		}
	}
	return nil
}

func keys[V any](m map[string]V) []string {
	out := make([]string, 0, len(m))
	for k := range m {
		out = append(out, k)
	}
	slices.Sort(out)
	return out
}
