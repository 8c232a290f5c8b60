package sandbox_test

import (
	"context"
	"strings"
	"testing"

	"github.com/deltagym/deltagym/sandbox"
)

// listenSrv serves its tag on 127.0.0.1:8000, on [::1]:8001 (IPv6 only)
// and on /tmp/srv.sock, one connection at a time, and writes its pid to
// /tmp/srv.<tag> once it listens.
const listenSrv = `
import os, select, socket, sys
tag = sys.argv[1]
t = socket.socket()
t.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
t.bind(("127.0.0.1", 8000))
t.listen(16)
s6 = socket.socket(socket.AF_INET6)
s6.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
s6.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s6.bind(("::1", 8001))
s6.listen(8)
u = socket.socket(socket.AF_UNIX)
try:
    os.unlink("/tmp/srv.sock")
except FileNotFoundError:
    pass
u.bind("/tmp/srv.sock")
os.chmod("/tmp/srv.sock", 0o640)
u.listen(16)
with open("/tmp/srv.new", "w") as f:
    f.write(str(os.getpid()))
os.rename("/tmp/srv.new", "/tmp/srv." + tag)
while True:
    for l in select.select([t, s6, u], [], [])[0]:
        c, _ = l.accept()
        c.sendall(tag.encode())
        c.close()
`

// listenClient says what each of the server's addresses answers: its
// tag, "refused", or "timeout" (a socket listens that no one serves).
const listenClient = `
import socket
def tcp(): return socket.create_connection(("127.0.0.1", 8000), timeout=5)
def tcp6(): return socket.create_connection(("::1", 8001), timeout=5)
def unx():
    s = socket.socket(socket.AF_UNIX)
    s.settimeout(5)
    s.connect("/tmp/srv.sock")
    return s
out = []
for name, f in (("tcp", tcp), ("tcp6", tcp6), ("unix", unx)):
    try:
        out.append(name + "=" + (f().recv(100).decode() or "closed"))
    except ConnectionRefusedError:
        out.append(name + "=refused")
    except socket.timeout:
        out.append(name + "=timeout")
print(" ".join(out))
`

// TestListenersFreed: a checkpoint's template does not hold the addresses
// its process listened on. Once the agent ends the server, clients are
// refused and a new server listens there; a restore ends the new one and
// brings the checkpoint's back on every address; a fork's image listens in
// the child while the live server goes on serving.
func TestListenersFreed(t *testing.T) {
	needCRIU(t)
	b := setup(t)
	b.rt.ForkAheadAlways()
	ctx := t.Context()
	s := pySandbox(t, b, map[string]string{"/tmp/srv.py": listenSrv, "/tmp/client.py": listenClient})
	start := func(tag string) {
		t.Helper()
		if _, err := s.Exec(ctx, sandbox.ExecRequest{Command: "python3 /tmp/srv.py " + tag, Background: true}); err != nil {
			t.Fatal(err)
		}
		waitFor(t, s, "[ -e /tmp/srv."+tag+" ]")
	}
	answers := func(s *sandbox.Sandbox, want string) {
		t.Helper()
		if got := strings.TrimSpace(sh(t, s, "python3 /tmp/client.py")); got != want {
			t.Errorf("the server's addresses answer %q, want %q", got, want)
		}
	}
	start("one")
	answers(s, "tcp=one tcp6=one unix=one")
	ck, err := s.Checkpoint(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if m := captureMethods(ck.Processes); m != "template" {
		t.Fatalf("the server was taken by %s, want template", m)
	}
	sh(t, s, "pid=$(cat /tmp/srv.one); kill $pid; while kill -0 $pid 2>/dev/null; do sleep 0.01; done")
	answers(s, "tcp=refused tcp6=refused unix=refused")
	start("two")
	answers(s, "tcp=two tcp6=two unix=two")

	if err := s.Restore(ctx, ck.ID); err != nil {
		t.Fatal(err)
	}
	answers(s, "tcp=one tcp6=one unix=one")
	kids, err := b.rt.Fork(ctx, ck.ID, 1, sandbox.Spec{})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = kids[0].Destroy(context.Background()) })
	answers(kids[0], "tcp=one tcp6=one unix=one")
	answers(s, "tcp=one tcp6=one unix=one")
	if got, want := sh(t, kids[0], "stat -c '%a %U' /tmp/srv.sock"), sh(t, s, "stat -c '%a %U' /tmp/srv.sock"); got != want || want != "640 root\n" {
		t.Errorf("the socket's file in the fork is %q, in its source %q, want 640 root", got, want)
	}
	// Again, then from the copies forked ahead of each restore.
	for i := range 3 {
		if i > 0 && s.AheadPids(ck.ID) == nil {
			t.Fatal("no copy forked ahead")
		}
		if err := s.Restore(ctx, ck.ID); err != nil {
			t.Fatal(err)
		}
		answers(s, "tcp=one tcp6=one unix=one")
	}
}

// TestListenerShared: a listening socket two processes hold stays shared
// with their templates (a copy of one listening anew would shut the
// other's out): the checkpoint restores with both serving.
func TestListenerShared(t *testing.T) {
	needCRIU(t)
	b := setup(t)
	ctx := t.Context()
	s := pySandbox(t, b, map[string]string{"/tmp/srv.py": workersSrv})
	sh(t, s, "python3 /tmp/srv.py")
	waitFor(t, s, "[ -e /tmp/worker.a ] && [ -e /tmp/worker.b ]")
	ck, err := s.Checkpoint(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if m := captureMethods(ck.Processes); m != "template" || len(ck.Processes) != 2 {
		t.Fatalf("the workers were taken as %v, want two templates", ck.Processes)
	}
	for range 2 {
		if err := s.Restore(ctx, ck.ID); err != nil {
			t.Fatal(err)
		}
		// Each worker's copy accepts on the one socket: ask until both
		// have answered.
		got := sh(t, s, `python3 -c '
import socket
seen = set()
for _ in range(200):
    if len(seen) == 2:
        break
    seen.add(socket.create_connection(("127.0.0.1", 8000), timeout=5).recv(10).decode())
print(" ".join(sorted(seen)))'`)
		if got != "a b\n" {
			t.Fatalf("the workers answered %q", got)
		}
	}
}

// pySandbox is a sandbox of the default image holding files (path:
// contents).
func pySandbox(t *testing.T, b *bundle, files map[string]string) *sandbox.Sandbox {
	t.Helper()
	s, err := b.rt.Create(t.Context(), sandbox.Spec{Image: defaultImage(t, b)})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = s.Destroy(context.Background()) })
	for path, data := range files {
		if err := s.WriteFile(t.Context(), path, []byte(data), 0o644, false); err != nil {
			t.Fatal(err)
		}
	}
	return s
}
