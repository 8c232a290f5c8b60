package clustertest

import (
	"context"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"syscall"
	"testing"
	"time"

	"connectrpc.com/connect"

	deltagym "github.com/deltagym/deltagym/clients/go/deltagym"
	"github.com/deltagym/deltagym/internal/locate"
	"github.com/deltagym/deltagym/internal/testenv"
	"github.com/deltagym/deltagym/server/ledger/pgtest"
)

func TestMain(m *testing.M) { os.Exit(pgtest.Run(m)) }

// dnsName is the name the cluster's DNS lists every node under, as a headless Service's.
const dnsName = "nodes.deltagym.test"

// target is the cluster's target, for the servers (--peers) and the clients alike.
var target = "dns:" + dnsName + ":" + nodePort

// node is one `deltagym serve` of the cluster, in its own network namespace.
type node struct {
	name, addr, data string
	host             nodeHost
	args             []string
	token            string

	cmd    *exec.Cmd
	exited chan error
	log    *os.File
}

// cluster is the test's cluster: its network, DNS, nodes and a client of the nodes.
type cluster struct {
	nw    *network
	dns   *dnsServer
	nodes []*node
	token string
	cl    *deltagym.Cluster
}

// clientOptions are the options every client of the test's cluster is dialled with: its token,
// and connections and DNS queries made from the bridge's namespace.
func (c *cluster) clientOptions() []deltagym.Option {
	return []deltagym.Option{deltagym.WithToken(c.token), deltagym.WithHTTPClient(c.nw.bridge.httpClient()),
		deltagym.WithResolver(c.nw.bridge.resolver(c.dns.addr)), deltagym.WithRetry(1, 0)}
}

// direct dials one node, not through the cluster.
func (c *cluster) direct(t testing.TB, n *node) *deltagym.Client {
	t.Helper()
	dc, err := deltagym.Dial(n.addr, deltagym.WithToken(c.token), deltagym.WithHTTPClient(c.nw.bridge.httpClient()), deltagym.WithRetry(1, 0))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { dc.Close() })
	return dc
}

// paths are what the servers need from the checkout: the binary, the init, the image, the envs.
type paths struct{ bin, init, image, envs string }

// needCluster skips t unless a cluster of real servers can run here, saying why.
func needCluster(t testing.TB) paths {
	t.Helper()
	testenv.Privileged(t, "network namespaces, a bridge and three servers")
	root := locate.Checkout()
	if root == "" {
		t.Skip("not inside a checkout: needs its bin/deltagym and image")
	}
	p := paths{bin: cmpEnv("DELTAGYM_BIN", filepath.Join(root, "bin", "deltagym")),
		image: cmpEnv("DELTAGYM_IMAGE_DIR", filepath.Join(root, ".data", "images", "default")), envs: filepath.Join(root, "envs")}
	if _, err := os.Stat(p.bin); err != nil {
		t.Skipf("needs bin/deltagym (make build, or DELTAGYM_BIN): %v", err)
	}
	if _, err := os.Stat(p.image); err != nil {
		t.Skipf("needs the default image (make image, or DELTAGYM_IMAGE_DIR): %v", err)
	}
	for _, tool := range []string{"ip", "nsenter"} {
		if _, err := exec.LookPath(tool); err != nil {
			t.Skipf("needs %s: %v", tool, err)
		}
	}
	p.init = testenv.Init(t)
	return p
}

func cmpEnv(name, def string) string {
	if v := os.Getenv(name); v != "" {
		return v
	}
	return def
}

// startCluster starts n nodes (node-1 … node-n), each in a namespace of its own at 10.77.0.i,
// with one shared ledger, the DNS listing all of them, and a Cluster client of them.
func startCluster(t testing.TB, n int) *cluster {
	t.Helper()
	p := needCluster(t)
	db := pgtest.Start(t)
	mounts := mountDir(t)
	c := &cluster{nw: newNetwork(t, n), token: "cluster-" + deltagym.NewIdempotencyKey()}
	ips := make([]string, n)
	for i := range ips {
		ips[i] = nodeIP(i + 1)
	}
	c.dns = startDNS(t, c.nw.bridge, clientIP, dnsName, ips...)
	resolv := filepath.Join(t.TempDir(), "resolv.conf")
	if err := os.WriteFile(resolv, []byte("nameserver "+clientIP+"\noptions timeout:1 attempts:2\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	for i := range n {
		data, err := os.MkdirTemp("", "dgct-")
		if err != nil {
			t.Fatal(err)
		}
		name := fmt.Sprintf("node-%d", i+1)
		nd := &node{name: name, addr: ips[i] + ":" + nodePort, data: data, token: c.token,
			host: nodeHost{net: c.nw.nodes[i], mnt: addMountNS(t, mounts, name, resolv)}}
		nd.args = []string{p.bin, "serve", "--addr", nd.addr, "--advertise-addr", nd.addr, "--node-name", nd.name,
			"--peers", target, "--data", data, "--envs", p.envs, "--init", p.init, "--database-url", db, "--acquire-timeout", "1m"}
		t.Cleanup(func() {
			nd.stop(t)
			if t.Failed() {
				t.Logf("%s's log:\n%s", nd.name, nd.logTail())
			}
			// In the node's namespaces, where its mounts are.
			purge := exec.Command(p.bin, "purge", "--data", data)
			if err := nd.host.command(purge); err != nil {
				t.Error(err)
			} else if out, err := purge.CombinedOutput(); err != nil {
				t.Errorf("purge of %s: %v: %s", nd.name, err, out)
			}
			_ = os.RemoveAll(data)
		})
		if err := os.MkdirAll(filepath.Join(data, "images"), 0o755); err != nil {
			t.Fatal(err)
		}
		if err := os.Symlink(p.image, filepath.Join(data, "images", "default")); err != nil {
			t.Fatal(err)
		}
		c.nodes = append(c.nodes, nd)
	}
	// All at once: each learns its peers at its start or its next refresh.
	for _, nd := range c.nodes {
		nd.start(t)
	}
	for _, nd := range c.nodes {
		c.waitReady(t, nd)
	}
	cl, err := deltagym.DialCluster(t.Context(), target, append(c.clientOptions(), deltagym.WithRefreshInterval(time.Hour))...)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { cl.Close() })
	c.cl = cl
	for _, nd := range c.nodes {
		if st, ok := cl.Node(nd.name); !ok || st.Err != nil || st.Addr != nd.addr || !st.Listed {
			t.Fatalf("the cluster's first refresh: %s: %+v (found %v)", nd.name, st, ok)
		}
	}
	return c
}

// start starts the node's server inside its namespace.
func (n *node) start(t testing.TB) {
	t.Helper()
	var err error
	if n.log, err = os.OpenFile(filepath.Join(n.data, "server.log"), os.O_CREATE|os.O_WRONLY|os.O_APPEND, 0o644); err != nil {
		t.Fatal(err)
	}
	cmd := exec.Command(n.args[0], n.args[1:]...)
	// The token goes by the environment, not argv.
	cmd.Env = append(os.Environ(), "DELTAGYM_TOKEN="+n.token)
	cmd.Stdout, cmd.Stderr = n.log, n.log
	cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true}
	err = n.host.command(cmd)
	if err == nil {
		err = cmd.Start()
	}
	if err != nil {
		n.log.Close()
		t.Fatalf("starting %s: %v", n.name, err)
	}
	n.cmd = cmd
	n.exited = make(chan error, 1)
	go func() { n.exited <- cmd.Wait() }()
}

// waitReady waits until nd answers GetNode, under its name, with every env's pool warm.
func (c *cluster) waitReady(t testing.TB, nd *node) {
	t.Helper()
	dc := c.direct(t, nd)
	ctx, cancel := context.WithTimeout(t.Context(), 3*time.Minute)
	defer cancel()
	tick := time.NewTicker(50 * time.Millisecond)
	defer tick.Stop()
	var last error
	for {
		cctx, ccancel := context.WithTimeout(ctx, 5*time.Second)
		info, err := dc.GetNode(cctx)
		var ready bool
		if err == nil {
			if info.GetName() != nd.name {
				ccancel()
				t.Fatalf("the server at %s reports the name %q, want %q", nd.addr, info.GetName(), nd.name)
			}
			envs, lerr := dc.ListEnvs(cctx)
			ready, err = lerr == nil && len(envs) > 0, lerr
			for _, e := range envs {
				ready = ready && e.GetWarmCount() > 0
			}
		}
		ccancel()
		if ready {
			return
		}
		last = err
		select {
		case werr := <-nd.exited:
			nd.exited <- werr
			t.Fatalf("%s exited while starting: %v\n%s", nd.name, werr, nd.logTail())
		case <-ctx.Done():
			t.Fatalf("%s is not ready after 3 minutes (last: %v)\n%s", nd.name, last, nd.logTail())
		case <-tick.C:
		}
	}
}

// kill ends the node's server at once (SIGKILL to its PID), as a crash does.
func (n *node) kill(t testing.TB) {
	t.Helper()
	if n.cmd == nil {
		return
	}
	if err := n.cmd.Process.Kill(); err != nil {
		t.Fatalf("killing %s: %v", n.name, err)
	}
	<-n.exited
	n.cmd = nil
	n.log.Close()
}

// stop stops the node's server as a clean stop does (SIGTERM to its PID) and waits for it; past
// a minute it kills it.
func (n *node) stop(t testing.TB) {
	t.Helper()
	if n.cmd == nil {
		return
	}
	_ = n.cmd.Process.Signal(syscall.SIGTERM)
	select {
	case err := <-n.exited:
		if err != nil {
			t.Errorf("%s exited: %v", n.name, err)
		}
	case <-time.After(time.Minute):
		_ = n.cmd.Process.Kill()
		t.Errorf("%s did not stop within a minute: %v", n.name, <-n.exited)
	}
	n.cmd = nil
	n.log.Close()
}

// logTail returns the end of the node's log.
func (n *node) logTail() string {
	b, _ := os.ReadFile(filepath.Join(n.data, "server.log"))
	if len(b) > 8000 {
		b = b[len(b)-8000:]
	}
	return string(b)
}

// closeAtEnd closes sb when the test ends.
func closeAtEnd(t testing.TB, sbs ...*deltagym.Sandbox) {
	for _, sb := range sbs {
		t.Cleanup(func() { _ = sb.Close(context.WithoutCancel(t.Context())) })
	}
}

// exec runs command in sb and returns its standard output, failing t unless it exits 0.
func execOut(t testing.TB, sb *deltagym.Sandbox, command string) string {
	t.Helper()
	res, err := sb.Exec(t.Context(), command)
	if err != nil {
		t.Fatalf("exec %q in %s: %v", command, sb.ID(), err)
	}
	if res.ExitCode != 0 {
		t.Fatalf("exec %q in %s: exit %d: %s", command, sb.ID(), res.ExitCode, res.Stderr)
	}
	return string(res.Stdout)
}

// resetOn takes a sandbox on the node called name.
func resetOn(t testing.TB, cl *deltagym.Cluster, name string) *deltagym.Sandbox {
	t.Helper()
	nc, err := cl.NodeClient(name)
	if err != nil {
		t.Fatal(err)
	}
	sb, err := nc.Reset(t.Context(), "shell")
	if err != nil {
		t.Fatalf("reset on %s: %v", name, err)
	}
	closeAtEnd(t, sb)
	return sb
}

// wantUnavailable fails t unless err is the cluster's unavailable naming node name.
func wantUnavailable(t testing.TB, what string, err error, name string) {
	t.Helper()
	var ne *deltagym.NodeError
	if connect.CodeOf(err) != connect.CodeUnavailable || !errors.As(err, &ne) || ne.Node != name ||
		!strings.Contains(err.Error(), "node "+name) {
		t.Fatalf("%s: %v, want unavailable naming node %s", what, err, name)
	}
}

// TestCluster runs three real servers, each in a network namespace of its own behind one
// bridge, found through a DNS server as a headless Service's nodes are, sharing one ledger:
// the load test's scenarios through the routing client, checkpoints that move between nodes
// and those that do not, a node killed mid-run, and its return.
func TestCluster(t *testing.T) {
	c := startCluster(t, 3)
	ctx := t.Context()
	n1, n2, n3 := c.nodes[0], c.nodes[1], c.nodes[2]

	t.Run("loadtest", func(t *testing.T) { testLoad(t, c) })

	// A checkpoint of files moves: a restore on node-2 and a fork over the nodes read it.
	a := resetOn(t, c.cl, n1.name)
	execOut(t, a, "echo moved > /work/f && ln -s /work/f /work/link && mkdir -p /work/d/e && seq 1 20000 > /work/d/e/big")
	const probe = "cat /work/f; readlink /work/link; md5sum < /work/d/e/big"
	want := execOut(t, a, probe)
	ck, err := a.Checkpoint(ctx)
	if err != nil || deltagym.NodeOf(ck.ID) != n1.name {
		t.Fatalf("checkpoint on node-1: %+v, %v", ck, err)
	}
	b := resetOn(t, c.cl, n2.name)
	// node-2 learned its peers through the DNS (--peers): a call on node-1's sandbox sent to it
	// names node-1's address. A node asks its peers at its start and every 10 s after.
	wrongNode(t, c.direct(t, n2), a.ID(), n1)
	if _, err := b.Restore(ctx, ck.ID); err != nil {
		t.Fatalf("restore on node-2 of node-1's checkpoint: %v", err)
	}
	if got := execOut(t, b, probe); got != want {
		t.Fatalf("node-2 restored node-1's checkpoint as %q, want %q", got, want)
	}
	fork, err := c.cl.Fork(ctx, ck.ID, 3)
	if err != nil || len(fork.Sandboxes) != 3 {
		t.Fatalf("cluster fork of node-1's checkpoint: %+v, %v", fork, err)
	}
	closeAtEnd(t, fork.Sandboxes...)
	forkedOn := map[string]int{}
	for _, kid := range fork.Sandboxes {
		forkedOn[deltagym.NodeOf(kid.ID())]++
		if got := execOut(t, kid, probe); got != want {
			t.Fatalf("child %s of node-1's checkpoint reads %q, want %q", kid.ID(), got, want)
		}
	}
	if len(forkedOn) < 2 {
		t.Fatalf("a fork of 3 over three nodes made its children on %v only", forkedOn)
	}

	// A checkpoint with a live process moves as CRIU images: a restore on node-2 brings the
	// process back there, and a cluster fork spreads its children, each running it.
	if _, err := a.Exec(ctx, "sleep 1000", deltagym.InBackground()); err != nil {
		t.Fatal(err)
	}
	pk, err := a.Checkpoint(ctx)
	if err != nil {
		t.Fatal(err)
	}
	const running = "; pgrep -x sleep >/dev/null && echo running"
	if _, err = b.Restore(ctx, pk.ID); err != nil {
		t.Fatalf("restore on node-2 of node-1's checkpoint with a process: %v", err)
	}
	if got := execOut(t, b, probe+running); got != want+"running\n" {
		t.Fatalf("after the restore of node-1's checkpoint with a process node-2's sandbox reads %q", got)
	}
	pfork, err := c.cl.Fork(ctx, pk.ID, 3)
	if err != nil || len(pfork.Sandboxes) != 3 {
		t.Fatalf("cluster fork of a checkpoint with a process: %+v, %v", pfork, err)
	}
	closeAtEnd(t, pfork.Sandboxes...)
	for _, kid := range pfork.Sandboxes {
		if got := execOut(t, kid, probe+running); got != want+"running\n" {
			t.Fatalf("child %s of the checkpoint with a process reads %q", kid.ID(), got)
		}
	}

	t.Run("kill", func(t *testing.T) { testKill(t, c, n3) })
}

// testLoad runs the load test's rollback (on StepStreams) and grpo scenarios through the
// routing client: no errors, and every node made sandboxes.
func testLoad(t *testing.T, c *cluster) {
	for _, cfg := range []loadConfig{
		{scenario: "rollback", api: "stream", concurrency: 6},
		{scenario: "grpo", concurrency: 3, group: 4},
	} {
		r := runLoad(t, c, cfg)
		t.Logf("%s: %.0f %s/s over the cluster, %d errors, sandboxes per node %v", cfg.scenario, r.Throughput, r.Unit, r.ErrorCount, r.Nodes)
		if r.ErrorCount != 0 || r.Iterations == 0 {
			t.Fatalf("%s through the cluster: %d iterations, %d errors: %v", cfg.scenario, r.Iterations, r.ErrorCount, r.Errors)
		}
		for _, nd := range c.nodes {
			if r.Nodes[nd.name] == 0 {
				t.Fatalf("%s through the cluster made no sandbox on %s: %v", cfg.scenario, nd.name, r.Nodes)
			}
		}
	}
}

// testKill kills victim mid-run: calls on its sandboxes fail naming it, the others' go on without
// an error, and a checkpoint of it that another node fetched before is restored there still.
// Restarted on its data directory, it rejoins.
func testKill(t *testing.T, c *cluster, victim *node) {
	ctx := t.Context()
	cl := c.cl
	var other *node
	for _, nd := range c.nodes {
		if nd != victim {
			other = nd
			break
		}
	}
	// A checkpoint of the victim's, fetched by other before the kill.
	v := resetOn(t, cl, victim.name)
	execOut(t, v, "echo doomed > /work/kept")
	vck, err := v.Checkpoint(ctx)
	if err != nil {
		t.Fatal(err)
	}
	fetcher := resetOn(t, cl, other.name)
	if _, err := fetcher.Restore(ctx, vck.ID); err != nil {
		t.Fatalf("restore on %s of %s's checkpoint: %v", other.name, victim.name, err)
	}
	if got := execOut(t, fetcher, "cat /work/kept"); got != "doomed\n" {
		t.Fatalf("%s restored %s's checkpoint as %q", other.name, victim.name, got)
	}

	// Two looping workers per node.
	var ws []*looper
	for _, nd := range c.nodes {
		for range 2 {
			ws = append(ws, &looper{sb: resetOn(t, cl, nd.name), node: nd.name})
		}
	}
	progress := make(chan struct{}, 1)
	lctx, stop := context.WithCancel(ctx)
	done := make(chan struct{})
	go func() {
		defer close(done)
		runLoopers(lctx, ws, progress)
	}()
	defer func() { stop(); <-done }()
	waitFor(t, progress, "every worker to loop twice", func() bool {
		return !slices.ContainsFunc(ws, func(w *looper) bool { return w.count() < 2 })
	})

	victim.kill(t)
	before := map[*looper]int64{}
	for _, w := range ws {
		before[w] = w.count()
	}
	waitFor(t, progress, "the victim's workers to fail and the others' to loop three times more", func() bool {
		return !slices.ContainsFunc(ws, func(w *looper) bool {
			if w.node == victim.name {
				return w.failure() == nil
			}
			return w.failure() == nil && w.count() < before[w]+3
		})
	})
	for _, w := range ws {
		if w.node == victim.name {
			wantUnavailable(t, "a call on a sandbox of the killed node", w.failure(), victim.name)
		} else if err := w.failure(); err != nil {
			t.Fatalf("a worker on %s failed with %s killed: %v", w.node, victim.name, err)
		}
	}
	stop()
	<-done
	_, err = v.Exec(ctx, "true")
	wantUnavailable(t, "exec on the killed node", err, victim.name)

	// other holds the victim's checkpoint: a new sandbox there restores it still.
	again := resetOn(t, cl, other.name)
	if _, err := again.Restore(ctx, vck.ID); err != nil {
		t.Fatalf("restore on %s of the killed node's checkpoint: %v", other.name, err)
	}
	if got := execOut(t, again, "cat /work/kept"); got != "doomed\n" {
		t.Fatalf("%s restored the killed node's checkpoint as %q", other.name, got)
	}

	// Back on its data directory, with its name: a refresh lists it, and it takes the next
	// sandbox (it holds the fewest) and serves the checkpoint its crash kept.
	victim.start(t)
	c.waitReady(t, victim)
	if err := cl.Refresh(ctx); err != nil {
		t.Fatal(err)
	}
	if st, ok := cl.Node(victim.name); !ok || st.Err != nil {
		t.Fatalf("after its restart and a refresh, %s: %+v", victim.name, st)
	}
	sb, err := cl.Reset(ctx, "shell")
	if err != nil {
		t.Fatal(err)
	}
	closeAtEnd(t, sb)
	if deltagym.NodeOf(sb.ID()) != victim.name {
		t.Fatalf("the Reset after %s rejoined went to %s", victim.name, sb.ID())
	}
	nc, err := cl.NodeClient(victim.name)
	if err != nil {
		t.Fatal(err)
	}
	kids, err := nc.Fork(ctx, vck.ID, 1)
	if err != nil {
		t.Fatalf("fork on the restarted %s of its checkpoint: %v", victim.name, err)
	}
	closeAtEnd(t, kids.Sandboxes...)
	if got := execOut(t, kids.Sandboxes[0], "cat /work/kept"); got != "doomed\n" {
		t.Fatalf("the restarted %s forked its checkpoint as %q", victim.name, got)
	}
}

// waitFor waits until cond holds, checking it at each signal on progress; it fails t after two
// minutes.
func waitFor(t testing.TB, progress <-chan struct{}, what string, cond func() bool) {
	t.Helper()
	deadline := time.NewTimer(2 * time.Minute)
	defer deadline.Stop()
	for !cond() {
		select {
		case <-progress:
		case <-deadline.C:
			t.Fatalf("waiting for %s: two minutes passed", what)
		}
	}
}

// wrongNode waits until at, asked about sandbox id of owner, refuses with WRONG_NODE naming
// owner's address, which it learns from its peers (their reports, every 10 s); it fails t after a
// minute.
func wrongNode(t testing.TB, at *deltagym.Client, id string, owner *node) {
	t.Helper()
	tick := time.NewTicker(100 * time.Millisecond)
	defer tick.Stop()
	deadline := time.NewTimer(time.Minute)
	defer deadline.Stop()
	for {
		_, err := at.Sandbox(id).Info(t.Context())
		if connect.CodeOf(err) != connect.CodeFailedPrecondition || deltagym.ErrorReason(err) != "WRONG_NODE" {
			t.Fatalf("%s asked on another node: %v, want failed_precondition WRONG_NODE", id, err)
		}
		if strings.Contains(err.Error(), "node "+owner.name+" ("+owner.addr+")") {
			return
		}
		select {
		case <-tick.C:
		case <-deadline.C:
			t.Fatalf("a minute on, WRONG_NODE does not give %s's address: %v", owner.name, err)
		}
	}
}
