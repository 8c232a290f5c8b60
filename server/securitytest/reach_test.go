package securitytest

import (
	"net"
	"net/url"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"sync/atomic"
	"testing"

	"github.com/deltagym/deltagym/clients/go/deltagym"
)

// dialScript tries each target given as an argument — host:port (TCP), udp:host:port (a
// datagram, then a read of the answer), unix:path, abstract:name — and prints one line per
// target: "ok" or the errno's name ("timeout" when nothing answered in a second).
const dialScript = `import errno, socket, sys
for t in sys.argv[1:]:
    kind, _, addr = t.partition(":")
    try:
        if kind in ("unix", "abstract"):
            s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            s.settimeout(1)
            s.connect(("\0" + addr) if kind == "abstract" else addr)
        elif kind == "udp":
            host, _, port = addr.rpartition(":")
            s = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_DGRAM)
            s.settimeout(1)
            s.connect((host.strip("[]"), int(port)))
            s.send(b"x")
            s.recv(1)
        else:
            host, _, port = t.rpartition(":")
            s = socket.create_connection((host.strip("[]"), int(port)), timeout=1)
        print(t, "ok")
    except socket.timeout:
        print(t, "timeout")
    except OSError as e:
        print(t, errno.errorcode.get(e.errno, str(e.errno)))
`

// dial runs dialScript in sb and returns each target's answer.
func (s *suite) dial(t *testing.T, sb *deltagym.Sandbox, targets ...string) map[string]string {
	t.Helper()
	res, err := sb.Run(t.Context(), append([]string{"python3", "-c", dialScript}, targets...))
	if err != nil {
		t.Fatal(err)
	}
	got := map[string]string{}
	for _, line := range strings.Split(strings.TrimSpace(string(res.Stdout)), "\n") {
		if i := strings.LastIndexByte(line, ' '); i > 0 {
			got[line[:i]] = line[i+1:]
		}
	}
	if len(got) != len(targets) {
		t.Fatalf("dialling %v: %q %s", targets, res.Stdout, res.Stderr)
	}
	return got
}

// countingListener accepts and counts connections until the test ends.
func countingListener(t *testing.T, network, addr string) (net.Listener, *atomic.Int64) {
	t.Helper()
	ln, err := net.Listen(network, addr)
	if err != nil {
		t.Fatal(err)
	}
	var n atomic.Int64
	go func() {
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			n.Add(1)
			c.Close()
		}
	}()
	t.Cleanup(func() { ln.Close() })
	return ln, &n
}

// hostAddrs are the host's own addresses a sandbox could try: loopback and every interface's
// (IPv6 link-local ones need a zone and are left out).
func hostAddrs(t *testing.T) []string {
	t.Helper()
	addrs := []string{"127.0.0.1", "127.0.0.2", "[::1]"}
	ifaddrs, err := net.InterfaceAddrs()
	if err != nil {
		t.Fatal(err)
	}
	for _, a := range ifaddrs {
		ip, _, err := net.ParseCIDR(a.String())
		if err != nil || ip.IsLoopback() || ip.IsLinkLocalUnicast() {
			continue
		}
		if ip.To4() != nil {
			addrs = append(addrs, ip.String())
		} else {
			addrs = append(addrs, "["+ip.String()+"]")
		}
	}
	return addrs
}

// Reaching the host: the server's port, its Postgres (a unix socket in the data directory), a
// service listening on all the host's addresses (as a Postgres with listen_addresses '*' would),
// and the host's abstract unix sockets. The sandbox's network namespace has loopback only: every
// attempt fails, and nothing reaches a host listener.
func TestAttackReachHost(t *testing.T) {
	s := begin(t)
	sb := s.sandbox(t)
	_, serverPort, err := net.SplitHostPort(srv.Addr)
	if err != nil {
		t.Fatal(err)
	}
	anyLn, anyAccepts := countingListener(t, "tcp", ":0")
	anyPort := strconv.Itoa(anyLn.Addr().(*net.TCPAddr).Port)
	abstract := "dgsec-host-" + strconv.Itoa(os.Getpid())
	_, abstractAccepts := countingListener(t, "unix", "@"+abstract)
	var targets []string
	for _, a := range hostAddrs(t) {
		targets = append(targets, a+":"+serverPort, a+":"+anyPort, a+":5432")
	}
	targets = append(targets, "abstract:"+abstract)
	// The private Postgres listens on a unix socket only: its path on the host.
	if sock := pgSocket(t); sock != "" {
		targets = append(targets, "unix:"+sock)
	}
	for target, got := range s.dial(t, sb, targets...) {
		if got == "ok" {
			t.Errorf("%s: reached from the sandbox", target)
		}
	}
	if n := anyAccepts.Load() + abstractAccepts.Load(); n != 0 {
		t.Errorf("host listeners accepted %d connections from the sandbox", n)
	}
	// The interfaces the sandbox sees: loopback alone.
	if out := s.sh(t, sb, "ls /sys/class/net 2>/dev/null || python3 -c 'import socket; print(*[n for _, n in socket.if_nameindex()])'"); strings.Fields(out)[0] != "lo" || len(strings.Fields(out)) != 1 {
		t.Errorf("the sandbox's interfaces: %q, want lo", out)
	}
}

// pgSocket returns the path of the server's Postgres socket on the host ("" without one).
func pgSocket(t *testing.T) string {
	t.Helper()
	u, err := url.Parse(srv.DatabaseURL())
	if err != nil {
		t.Fatalf("the ledger's URL: %v", err)
	}
	dir := u.Query().Get("host")
	if dir == "" || !filepath.IsAbs(dir) {
		return ""
	}
	port := u.Port()
	if port == "" {
		port = "5432"
	}
	return filepath.Join(dir, ".s.PGSQL."+port)
}

// listenScript (sandbox A) listens on TCP and UDP loopback ports, an abstract and a path unix
// socket, makes SysV shared memory, a message queue and a semaphore set, and writes the keys to
// the FIFO /tmp/ready once all exist; then it serves until killed.
const listenScript = `import ctypes, os, socket
libc = ctypes.CDLL(None, use_errno=True)
keys = []
for call, args in ((29, (4096,)), (68, ()), (64, (1,))):  # shmget, msgget, semget
    key = 0x5ec00000 + call
    if libc.syscall(call, key, *args, 0o1666) < 0:
        raise OSError(ctypes.get_errno(), "ipc")
    keys.append(hex(key))
tcp = socket.create_server(("127.0.0.1", 7070))
udp = socket.socket(socket.AF_INET, socket.SOCK_DGRAM); udp.bind(("127.0.0.1", 7071))
ab = socket.socket(socket.AF_UNIX); ab.bind("\0dgsec-a"); ab.listen()
pa = socket.socket(socket.AF_UNIX); pa.bind("/tmp/a.sock"); pa.listen()
with open("/tmp/ready", "w") as f:
    f.write(" ".join(keys) + "\n")
while True:
    c, _ = tcp.accept()
    c.close()
`

// Cross-sandbox: what sandbox A listens on, writes and creates is not there for sandbox B — its
// loopback ports, abstract unix sockets, files (/tmp, /dev/shm), and SysV IPC — while A itself
// reaches all of it (the control).
func TestAttackCrossSandbox(t *testing.T) {
	s := begin(t)
	a, b := s.sandbox(t), s.sandbox(t)
	if _, err := a.WriteFile(t.Context(), "/tmp/listen.py", []byte(listenScript)); err != nil {
		t.Fatal(err)
	}
	s.sh(t, a, "mkfifo /tmp/ready; echo a-secret > /tmp/a-secret; echo a-secret > /dev/shm/a-secret")
	s.exec(t, a, "python3 /tmp/listen.py", deltagym.InBackground())
	keys := strings.Fields(s.sh(t, a, "cat /tmp/ready")) // opens when the listener has written
	if len(keys) != 3 {
		t.Fatalf("the listener's IPC keys: %q", keys)
	}
	targets := []string{"127.0.0.1:7070", "udp:127.0.0.1:7071", "abstract:dgsec-a", "unix:/tmp/a.sock"}
	self := s.dial(t, a, targets...)
	if self["127.0.0.1:7070"] != "ok" || self["abstract:dgsec-a"] != "ok" || self["unix:/tmp/a.sock"] != "ok" {
		t.Fatalf("A cannot reach its own listeners: %v", self)
	}
	for target, got := range s.dial(t, b, targets...) {
		if got == "ok" {
			t.Errorf("B reached A's %s", target)
		}
	}
	if res := s.exec(t, b, "cat /tmp/a-secret /dev/shm/a-secret"); res.OK() || strings.Contains(string(res.Stdout), "a-secret") {
		t.Errorf("B read A's files: %q", res.Stdout)
	}
	// shmget, msgget and semget of A's keys, without IPC_CREAT.
	s.syscalls(t, b, []syscallCase{
		{"shmget A's key", []string{"29", keys[0], "0", "0"}, []string{"ENOENT"}},
		{"msgget A's key", []string{"68", keys[1], "0"}, []string{"ENOENT"}},
		{"semget A's key", []string{"64", keys[2], "0", "0"}, []string{"ENOENT"}},
	})
	s.syscalls(t, a, []syscallCase{{"shmget its own key", []string{"29", keys[0], "0", "0"}, []string{"ok 0", "ok 1", "ok 2", "ok 3"}}})
	if out := s.sh(t, b, "ipcs -m -q -s | grep -c 0x5ec || true"); strings.TrimSpace(out) != "0" {
		t.Errorf("B's ipcs lists A's objects: %s", out)
	}
	// Nor does the host see them: the sandbox's IPC namespace is its own.
	if data, err := os.ReadFile("/proc/sysvipc/shm"); err == nil && strings.Contains(string(data), strconv.Itoa(0x5ec00000+29)) {
		t.Errorf("A's shared memory is in the host's IPC namespace")
	}
}
