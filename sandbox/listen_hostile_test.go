package sandbox_test

import (
	"context"
	"strings"
	"testing"

	"github.com/deltagym/deltagym/sandbox"
)

// askTCP prints what 127.0.0.1:port answers, "refused" or "timeout".
func askTCP(port string) string {
	return `python3 -c '
import socket
try:
    print(socket.create_connection(("127.0.0.1", ` + port + `), timeout=5).recv(100).decode() or "closed")
except ConnectionRefusedError:
    print("refused")
except socket.timeout:
    print("timeout")'`
}

// dupSrv listens on 127.0.0.1:8000, holds the socket on fd 20 too, and
// serves "x" on it.
const dupSrv = `
import os, socket
t = socket.socket()
t.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
t.bind(("127.0.0.1", 8000))
t.listen(16)
os.dup2(t.fileno(), 20)
open("/tmp/ready", "w").close()
while True:
    c, _ = t.accept()
    c.sendall(b"x")
    c.close()
`

// workersSrv listens on 127.0.0.1:8000 and forks two workers that serve
// it (each answers its own name and writes its pid to /tmp/worker.<name>),
// then exits: two processes of their own, sharing one listening socket.
const workersSrv = `
import os, socket
l = socket.create_server(("127.0.0.1", 8000))
for name in ("a", "b"):
    if os.fork() == 0:
        with open("/tmp/w.new" + name, "w") as f:
            f.write(str(os.getpid()))
        os.rename("/tmp/w.new" + name, "/tmp/worker." + name)
        while True:
            c, _ = l.accept()
            c.sendall(name.encode())
            c.close()
os._exit(0)
`

// TestListenerSharedThenAlone: a listening socket two workers shared at
// one checkpoint, and one of them alone holds at the next, restores at the
// next (the first checkpoint's templates still hold it).
func TestListenerSharedThenAlone(t *testing.T) {
	needCRIU(t)
	b := setup(t)
	ctx := t.Context()
	s := pySandbox(t, b, map[string]string{"/tmp/srv.py": workersSrv})
	sh(t, s, "python3 /tmp/srv.py")
	waitFor(t, s, "[ -e /tmp/worker.a ] && [ -e /tmp/worker.b ]")
	if _, err := s.Checkpoint(ctx); err != nil {
		t.Fatal(err)
	}
	sh(t, s, "pid=$(cat /tmp/worker.b); kill $pid; while kill -0 $pid 2>/dev/null; do sleep 0.01; done")
	ck2, err := s.Checkpoint(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if m := captureMethods(ck2.Processes); m != "template" {
		t.Fatalf("the worker was taken by %s, want template", m)
	}
	if err := s.Restore(ctx, ck2.ID); err != nil {
		t.Fatal(err)
	}
	if got := strings.TrimSpace(sh(t, s, askTCP("8000"))); got != "a" {
		t.Fatalf("the restored worker answers %q", got)
	}
}

// freebindSrv listens on 10.9.9.9:8000, an address of no interface
// (IP_FREEBIND), and on 127.0.0.1:8000.
const freebindSrv = `
import socket
f = socket.socket()
f.setsockopt(socket.SOL_IP, 15, 1)  # IP_FREEBIND
f.bind(("10.9.9.9", 8000))
f.listen(4)
l = socket.create_server(("127.0.0.1", 8000))
open("/tmp/ready", "w").close()
while True:
    c, _ = l.accept()
    c.sendall(b"x")
    c.close()
`

// epollSrv serves "x" on 127.0.0.1:8000, waiting for connections with
// edge-triggered epoll.
const epollSrv = `
import select, socket
l = socket.create_server(("127.0.0.1", 8000))
l.setblocking(False)
ep = select.epoll()
ep.register(l.fileno(), select.EPOLLIN | select.EPOLLET)
open("/tmp/ready", "w").close()
while True:
    for fd, _ in ep.poll():
        while True:
            try:
                c, _ = l.accept()
            except BlockingIOError:
                break
            c.setblocking(True)
            c.sendall(b"x")
            c.close()
`

// TestListenerShapes: servers whose listening socket is held in odd ways
// serve once restored in place and in a fork: on two fds (dupSrv: the new
// socket goes on both), bound to an address no interface has (freebindSrv:
// IP_FREEBIND), and behind edge-triggered epoll (epollSrv: the copy's
// epoll instance watches the socket that listens anew). But for a fork of
// the IPv4 socket bound with IP_FREEBIND: criu sets IP_FREEBIND before the
// bind only for IPv6, and the restore fails (forkErr).
func TestListenerShapes(t *testing.T) {
	needCRIU(t)
	b := setup(t)
	for _, c := range []struct{ name, prog, forkErr string }{
		{"two fds", dupSrv, ""},
		{"freebind", freebindSrv, "Can't bind inet socket"},
		{"epoll", epollSrv, ""},
	} {
		t.Run(c.name, func(t *testing.T) {
			ctx := t.Context()
			s := pySandbox(t, b, map[string]string{"/tmp/srv.py": c.prog})
			if _, err := s.Exec(ctx, sandbox.ExecRequest{Command: "python3 /tmp/srv.py", Background: true}); err != nil {
				t.Fatal(err)
			}
			waitFor(t, s, "[ -e /tmp/ready ]")
			answers := func(s *sandbox.Sandbox, when string) {
				t.Helper()
				if got := strings.TrimSpace(sh(t, s, askTCP("8000"))); got != "x" {
					t.Fatalf("%s, the server answers %q", when, got)
				}
			}
			answers(s, "at the checkpoint")
			ck, err := s.Checkpoint(ctx)
			if err != nil {
				t.Fatal(err)
			}
			if m := captureMethods(ck.Processes); m != "template" {
				t.Fatalf("the server was taken by %s, want template", m)
			}
			if err := s.Restore(ctx, ck.ID); err != nil {
				t.Fatal(err)
			}
			answers(s, "restored")
			kids, err := b.rt.Fork(ctx, ck.ID, 1, sandbox.Spec{})
			if c.forkErr != "" {
				if err == nil || !strings.Contains(err.Error(), c.forkErr) {
					t.Fatalf("fork: %v, want an error saying %q", err, c.forkErr)
				}
				answers(s, "after the fork failed")
				return
			}
			if err != nil {
				t.Fatal(err)
			}
			t.Cleanup(func() { _ = kids[0].Destroy(context.Background()) })
			answers(kids[0], "in a fork")
			answers(s, "after the fork")
		})
	}
}
