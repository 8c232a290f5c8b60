package sandbox_test

import (
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

// TestListenerDupped: a listening socket a process holds on two fds
// restores, listening on both.
func TestListenerDupped(t *testing.T) {
	needCRIU(t)
	b := setup(t)
	ctx := t.Context()
	s := pySandbox(t, b, map[string]string{"/tmp/srv.py": dupSrv})
	if _, err := s.Exec(ctx, sandbox.ExecRequest{Command: "python3 /tmp/srv.py", Background: true}); err != nil {
		t.Fatal(err)
	}
	waitFor(t, s, "[ -e /tmp/ready ]")
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
	if got := strings.TrimSpace(sh(t, s, askTCP("8000"))); got != "x" {
		t.Fatalf("the restored server answers %q", got)
	}
}

// workersSrv is sharedSrv, each worker writing its pid to
// /tmp/worker.<name>.
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

// TestListenerFreebind: a socket listening on an address no interface has
// (IP_FREEBIND) restores.
func TestListenerFreebind(t *testing.T) {
	needCRIU(t)
	b := setup(t)
	ctx := t.Context()
	s := pySandbox(t, b, map[string]string{"/tmp/srv.py": freebindSrv})
	if _, err := s.Exec(ctx, sandbox.ExecRequest{Command: "python3 /tmp/srv.py", Background: true}); err != nil {
		t.Fatal(err)
	}
	waitFor(t, s, "[ -e /tmp/ready ]")
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
	if got := strings.TrimSpace(sh(t, s, askTCP("8000"))); got != "x" {
		t.Fatalf("the restored server answers %q", got)
	}
}

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

// TestListenerEpoll: a server that waits on its listening socket with
// epoll serves once restored (its epoll instance watches the socket that
// listens anew).
func TestListenerEpoll(t *testing.T) {
	needCRIU(t)
	b := setup(t)
	ctx := t.Context()
	s := pySandbox(t, b, map[string]string{"/tmp/srv.py": epollSrv})
	if _, err := s.Exec(ctx, sandbox.ExecRequest{Command: "python3 /tmp/srv.py", Background: true}); err != nil {
		t.Fatal(err)
	}
	waitFor(t, s, "[ -e /tmp/ready ]")
	if got := strings.TrimSpace(sh(t, s, askTCP("8000"))); got != "x" {
		t.Fatalf("the server answers %q", got)
	}
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
	if got := strings.TrimSpace(sh(t, s, askTCP("8000"))); got != "x" {
		t.Fatalf("the restored server answers %q", got)
	}
}
