package clustertest

import (
	"context"
	"errors"
	"fmt"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"strings"
	"testing"
	"time"

	"golang.org/x/sys/unix"
)

// The test network: one bridge, in a namespace of its own, and a namespace per node, each
// joined to the bridge by a veth pair. The host's network namespace is never touched: every
// link is made with `ip -n`, inside the test's namespaces, which keep all of the subnet.
const (
	subnet     = "10.77.0."
	clientIP   = subnet + "254" // the bridge's own address: the test's clients and its DNS
	nodePort   = "8080"
	bridgeName = "dgbr0"
)

// netns is a named network namespace the test made (/run/netns/NAME, as `ip netns add` makes
// one), open as fd for setns.
type netns struct {
	name string
	fd   int
}

func (n *netns) path() string { return filepath.Join("/run/netns", n.name) }

// ipCmd runs ip(8) with args, failing t with its output when it fails.
func ipCmd(t testing.TB, args ...string) {
	t.Helper()
	if out, err := exec.Command("ip", args...).CombinedOutput(); err != nil {
		t.Fatalf("ip %s: %v: %s", strings.Join(args, " "), err, out)
	}
}

// addNetns makes a network namespace of the given role, named for this process so that
// concurrent test binaries never share one, with its loopback up; the test's end deletes it.
func addNetns(t testing.TB, role string) *netns {
	t.Helper()
	n := &netns{name: fmt.Sprintf("dgct%d-%s", os.Getpid(), role), fd: -1}
	ipCmd(t, "netns", "add", n.name)
	t.Cleanup(func() {
		if n.fd >= 0 {
			unix.Close(n.fd)
		}
		// Deleting the name unmounts it; the namespace (its links with it) goes once no
		// process is left in it.
		if out, err := exec.Command("ip", "netns", "del", n.name).CombinedOutput(); err != nil {
			t.Errorf("ip netns del %s: %v: %s", n.name, err, out)
		}
	})
	fd, err := unix.Open(n.path(), unix.O_RDONLY|unix.O_CLOEXEC, 0)
	if err != nil {
		t.Fatalf("opening %s: %v", n.path(), err)
	}
	n.fd = fd
	ipCmd(t, "-n", n.name, "link", "set", "lo", "up")
	return n
}

// network is the test's network: the bridge's namespace (where the test's clients and DNS
// are) and one namespace per node.
type network struct {
	bridge *netns
	nodes  []*netns
}

// newNetwork makes the bridge's namespace and n node namespaces, node i (from 1) at
// 10.77.0.i/24 on eth0, the bridge at 10.77.0.254/24.
func newNetwork(t testing.TB, n int) *network {
	t.Helper()
	nw := &network{bridge: addNetns(t, "br")}
	ipCmd(t, "-n", nw.bridge.name, "link", "add", bridgeName, "type", "bridge")
	ipCmd(t, "-n", nw.bridge.name, "addr", "add", clientIP+"/24", "dev", bridgeName)
	ipCmd(t, "-n", nw.bridge.name, "link", "set", bridgeName, "up")
	for i := 1; i <= n; i++ {
		ns := addNetns(t, fmt.Sprintf("n%d", i))
		peer := fmt.Sprintf("vn%d", i)
		// Made inside the node's namespace, its peer sent straight into the bridge's.
		ipCmd(t, "-n", ns.name, "link", "add", "eth0", "type", "veth", "peer", "name", peer, "netns", nw.bridge.name)
		ipCmd(t, "-n", ns.name, "addr", "add", nodeIP(i)+"/24", "dev", "eth0")
		ipCmd(t, "-n", ns.name, "link", "set", "eth0", "up")
		ipCmd(t, "-n", nw.bridge.name, "link", "set", peer, "master", bridgeName)
		ipCmd(t, "-n", nw.bridge.name, "link", "set", peer, "up")
		nw.nodes = append(nw.nodes, ns)
	}
	return nw
}

func nodeIP(i int) string { return fmt.Sprintf("%s%d", subnet, i) }

// inNetns runs f on an OS thread of its own that joined ns first: the sockets f opens belong
// to ns, and stay there whichever thread uses them after. The thread is never given back to
// the runtime: it ends with f's goroutine, its namespace with it.
func inNetns[T any](ns *netns, f func() (T, error)) (T, error) {
	type result struct {
		v   T
		err error
	}
	ch := make(chan result, 1)
	go func() {
		runtime.LockOSThread()
		if err := unix.Setns(ns.fd, unix.CLONE_NEWNET); err != nil {
			var zero T
			ch <- result{zero, fmt.Errorf("joining network namespace %s: %w", ns.name, err)}
			return
		}
		v, err := f()
		ch <- result{v, err}
	}()
	r := <-ch
	return r.v, r.err
}

// dial dials addr from inside ns.
func (n *netns) dial(ctx context.Context, network, addr string) (net.Conn, error) {
	return inNetns(n, func() (net.Conn, error) {
		var d net.Dialer
		return d.DialContext(ctx, network, addr)
	})
}

// httpClient returns an HTTP client (HTTP/2 over cleartext, as the Go client's own) whose
// connections are made inside n.
func (n *netns) httpClient() *http.Client {
	var p http.Protocols
	p.SetUnencryptedHTTP2(true)
	return &http.Client{Transport: &http.Transport{Protocols: &p, DialContext: n.dial,
		HTTP2: &http.HTTP2Config{SendPingTimeout: 5 * time.Second, PingTimeout: 5 * time.Second}}}
}

// resolver returns a resolver that asks only the DNS server at addr, from inside n.
func (n *netns) resolver(addr string) *net.Resolver {
	return &net.Resolver{PreferGo: true, Dial: func(ctx context.Context, network, _ string) (net.Conn, error) {
		return n.dial(ctx, network, addr)
	}}
}

// nodeHost is what a node's server runs in besides its network namespace: a mount namespace
// the test keeps for the node, as a host keeps its own across restarts of its server, so that
// the mounts a server makes (its store's tmpfs) outlive a crash of it, as they do on a host,
// and in which the test's resolv.conf is bound over /etc/resolv.conf: the node's name server,
// as a pod's resolv.conf gives its cluster's DNS.
type nodeHost struct {
	net *netns
	mnt string // the file the mount namespace is bound at
}

// mountDir makes the directory the test binds its mount namespaces at: a bind mount of its own,
// private, as a namespace's file must be (on a shared mount the bind would propagate into the
// namespace it holds). The test's end unmounts and removes it, after the namespaces in it.
func mountDir(t testing.TB) string {
	t.Helper()
	dir := fmt.Sprintf("/run/dgct%d", os.Getpid())
	if err := os.MkdirAll(dir, 0o700); err != nil {
		t.Fatal(err)
	}
	if err := unix.Mount(dir, dir, "", unix.MS_BIND, ""); err != nil {
		os.Remove(dir)
		t.Fatalf("binding %s: %v", dir, err)
	}
	t.Cleanup(func() {
		if err := unix.Unmount(dir, unix.MNT_DETACH); err != nil {
			t.Errorf("unmounting %s: %v", dir, err)
		}
		if err := os.Remove(dir); err != nil {
			t.Error(err)
		}
	})
	if err := unix.Mount("", dir, "", unix.MS_PRIVATE, ""); err != nil {
		t.Fatalf("making %s private: %v", dir, err)
	}
	return dir
}

// addMountNS makes a mount namespace bound at dir/role, a slave of the test's own (the host's
// mounts reach it, its own stay in it), with resolvConf bound over /etc/resolv.conf in it. The
// test's end unbinds it: the namespace, and every mount in it, goes once no process is left in
// it.
func addMountNS(t testing.TB, dir, role, resolvConf string) string {
	t.Helper()
	file := filepath.Join(dir, role)
	if err := os.WriteFile(file, nil, 0o600); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		// Not bound when the unshare failed.
		_ = unix.Unmount(file, unix.MNT_DETACH)
		if err := os.Remove(file); err != nil {
			t.Error(err)
		}
	})
	out, err := exec.Command("unshare", "--mount="+file, "--propagation", "slave",
		"mount", "--bind", resolvConf, "/etc/resolv.conf").CombinedOutput()
	if err != nil {
		t.Fatalf("making mount namespace %s: %v: %s", file, err, out)
	}
	return file
}

// command returns cmd run inside h: nsenter joins h's namespaces and execs cmd's program, so
// that the process started is the program itself and a signal to its PID reaches it.
func (h nodeHost) command(cmd *exec.Cmd) error {
	nsenter, err := exec.LookPath("nsenter")
	if err != nil {
		return err
	}
	if len(cmd.Args) == 0 || cmd.Path == "" {
		return errors.New("no program to start")
	}
	cmd.Args = append([]string{nsenter, "--net=" + h.net.path(), "--mount=" + h.mnt, "--", cmd.Path}, cmd.Args[1:]...)
	cmd.Path = nsenter
	return nil
}
