package sandbox_test

import (
	"errors"
	"fmt"
	"strings"
	"testing"

	"github.com/deltagym/deltagym/sandbox"
)

// descriptionsPy holds a description of each kind a copy must not share
// with its template: a pipe to itself with data in it, an eventfd, an
// epoll instance watching both, a listening TCP socket and a connection to
// it (both ends its own) with data on the way. SIGUSR1 changes every one
// (and leaves a connection waiting to be accepted); SIGUSR2 writes
// /tmp/desc.<n> (n counting reports) describing them without changing
// them.
const descriptionsPy = `
import os, select, signal, socket, time
r, w = os.pipe()
os.write(w, b"ckpt")
efd = os.eventfd(5)
ep = select.epoll()
ep.register(r, select.EPOLLIN)
ep.register(efd, select.EPOLLIN)
ls = socket.socket()
ls.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
ls.bind(("127.0.0.1", 7007))
ls.listen(8)
c = socket.create_connection(("127.0.0.1", 7007))
s, _ = ls.accept()
c.sendall(b"hello")
todo = []
signal.signal(signal.SIGUSR1, lambda *a: todo.append("change"))
signal.signal(signal.SIGUSR2, lambda *a: todo.append("report"))
n = 0
def report():
    global n
    n += 1
    data = os.read(r, 100) if select.select([r], [], [], 0)[0] else b""
    if data:
        os.write(w, data)
    v = os.eventfd_read(efd)
    os.eventfd_write(efd, v)
    ready = sorted("pipe" if fd == r else "eventfd" for fd, _ in ep.poll(0))
    try:
        conn = s.recv(100, socket.MSG_PEEK | socket.MSG_DONTWAIT).decode()
    except OSError as e:
        conn = "errno %d" % e.errno
    waiting = bool(select.select([ls], [], [], 0)[0])
    line = "pipe=%s eventfd=%d epoll=%s conn=%s waiting=%s" % (data.decode(), v, ",".join(ready), conn, waiting)
    with open("/tmp/desc.tmp", "w") as f:
        f.write(line)
    os.rename("/tmp/desc.tmp", "/tmp/desc.%d" % n)
def change():
    os.read(r, 100)
    os.write(w, b"changed")
    os.eventfd_write(efd, 7)
    ep.unregister(efd)
    try:
        c.sendall(b"more")
    except OSError:
        pass  # reset in a copy
    global extra
    extra = socket.create_connection(("127.0.0.1", 7007))
    open("/tmp/changed", "w").close()
open("/tmp/ready", "w").close()
while True:
    while todo:
        {"change": change, "report": report}[todo.pop(0)]()
    time.sleep(0.01)
`

// TestCopiesOwnDescriptions: the copies of a template each get their own
// pipe, eventfd and epoll instance in the checkpoint's state, though each
// copy changed its own before the next restore; a connection the process
// held comes back reset, and no connection made to an earlier copy waits
// on the listening socket. Three restores in a row report the same.
func TestCopiesOwnDescriptions(t *testing.T) {
	b := setup(t)
	s := b.create(t, sandbox.Spec{Image: defaultImage(t, b)})
	ctx := t.Context()
	if err := s.WriteFile(ctx, "/tmp/desc.py", []byte(descriptionsPy), 0o644, false); err != nil {
		t.Fatal(err)
	}
	if _, err := s.Exec(ctx, sandbox.ExecRequest{Argv: []string{"python3", "/tmp/desc.py"}, Background: true}); err != nil {
		t.Fatal(err)
	}
	waitFor(t, s, "[ -e /tmp/ready ]")
	report := func(n int) string {
		t.Helper()
		sh(t, s, "pkill -USR2 -f '[d]esc.py'")
		waitFor(t, s, fmt.Sprintf("[ -e /tmp/desc.%d ]", n))
		return sh(t, s, fmt.Sprintf("cat /tmp/desc.%d", n))
	}
	before := report(1)
	if want := "pipe=ckpt eventfd=5 epoll=eventfd,pipe conn=hello waiting=False"; before != want {
		t.Fatalf("before the checkpoint: %q, want %q", before, want)
	}
	ck, err := s.Checkpoint(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if got := methods(ck.Processes); got != "python3:template" {
		t.Fatalf("captured %q", got)
	}
	// The live process changes them all after the checkpoint, too.
	sh(t, s, "pkill -USR1 -f '[d]esc.py'")
	waitFor(t, s, "[ -e /tmp/changed ]")
	if got := report(2); !strings.HasPrefix(got, "pipe=changed eventfd=12 epoll=pipe conn=hellomore waiting=True") {
		t.Fatalf("after the change: %q", got)
	}
	for round := range 3 {
		if err := s.Restore(ctx, ck.ID); err != nil {
			t.Fatalf("round %d: %v", round, err)
		}
		// The copy counts reports from the checkpoint's 1.
		if got, want := report(2), "pipe=ckpt eventfd=5 epoll=eventfd,pipe conn=errno 107 waiting=False"; got != want {
			t.Fatalf("round %d: restored %q, want %q (the connection reset: ENOTCONN)", round, got, want)
		}
		sh(t, s, "pkill -USR1 -f '[d]esc.py'")
		waitFor(t, s, "[ -e /tmp/changed ]")
		if got := report(3); !strings.HasPrefix(got, "pipe=changed eventfd=12 epoll=pipe ") || !strings.HasSuffix(got, "waiting=True") {
			t.Fatalf("round %d: after the copy's change: %q", round, got)
		}
	}
}

// sharedMemPy maps anonymous memory shared and writable (mmap.mmap(-1, n)
// is MAP_SHARED) holding "ckpt"; SIGUSR1 overwrites it, SIGUSR2 writes it
// to /tmp/shm.<n>.
const sharedMemPy = `
import mmap, os, signal, time
m = mmap.mmap(-1, 4096)
m[:4] = b"ckpt"
todo = []
signal.signal(signal.SIGUSR1, lambda *a: todo.append("change"))
signal.signal(signal.SIGUSR2, lambda *a: todo.append("report"))
n = 0
open("/tmp/ready", "w").close()
while True:
    while todo:
        if todo.pop(0) == "change":
            m[:4] = b"new!"
            open("/tmp/changed", "w").close()
        else:
            n += 1
            with open("/tmp/shm.tmp", "wb") as f:
                f.write(m[:4])
            os.rename("/tmp/shm.tmp", "/tmp/shm.%d" % n)
    time.sleep(0.01)
`

// TestSharedMemoryNotShared: a process that maps memory shared and
// writable is not a template (its copies would share that memory with the
// template and the live process): CRIU saves it, and three restores, each
// after the memory was overwritten, bring back the checkpoint's contents.
func TestSharedMemoryNotShared(t *testing.T) {
	needCRIU(t)
	b := setup(t)
	s := b.create(t, sandbox.Spec{Image: defaultImage(t, b)})
	ctx := t.Context()
	if err := s.WriteFile(ctx, "/tmp/shm.py", []byte(sharedMemPy), 0o644, false); err != nil {
		t.Fatal(err)
	}
	if _, err := s.Exec(ctx, sandbox.ExecRequest{Argv: []string{"python3", "/tmp/shm.py"}, Background: true}); err != nil {
		t.Fatal(err)
	}
	waitFor(t, s, "[ -e /tmp/ready ]")
	report := func(n int) string {
		t.Helper()
		sh(t, s, "pkill -USR2 -f '[s]hm.py'")
		waitFor(t, s, fmt.Sprintf("[ -e /tmp/shm.%d ]", n))
		return sh(t, s, fmt.Sprintf("cat /tmp/shm.%d", n))
	}
	if got := report(1); got != "ckpt" {
		t.Fatalf("before the checkpoint: %q", got)
	}
	ck, err := s.Checkpoint(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if len(ck.Processes) != 1 || ck.Processes[0].Method != sandbox.CaptureCRIU || !strings.Contains(ck.Processes[0].Reason, "shared and writable") {
		t.Fatalf("captured %+v, want CRIU for memory mapped shared and writable", ck.Processes)
	}
	for round := range 3 {
		sh(t, s, "pkill -USR1 -f '[s]hm.py'")
		waitFor(t, s, "[ -e /tmp/changed ]")
		if err := s.Restore(ctx, ck.ID); err != nil {
			t.Fatalf("round %d: %v", round, err)
		}
		if got := report(2); got != "ckpt" {
			t.Fatalf("round %d: restored memory %q, want the checkpoint's", round, got)
		}
	}
}

// What a template copy cannot carry goes to CRIU, saying why, or is left
// as it is: pipes to itself holding more than a copy carries; a unix
// socket bound to a relative path (the cwd of its bind is not known), whose listener stays
// shared, and the file at that path from the checkpoint's cwd untouched.
func TestTemplateLimits(t *testing.T) {
	needCRIU(t)
	b := setup(t)
	ctx := t.Context()
	bigPipe := `import fcntl, os, time
r, w = os.pipe()
fcntl.fcntl(w, 1031, 1 << 20)
os.write(w, b"x" * (300 << 10))
open("/tmp/ready", "w").close()
time.sleep(1e9)
`
	relSocket := `import os, socket, time
os.makedirs("/tmp/d", exist_ok=True)
os.chdir("/tmp/d")
s = socket.socket(socket.AF_UNIX)
s.bind("answer.txt")
s.listen()
os.chdir("/work")
open("/tmp/ready", "w").close()
time.sleep(1e9)
`
	for _, c := range []struct{ name, prog, ready, method, reason string }{
		{"big pipe", bigPipe, "[ -e /tmp/ready ]", "python3:criu", "pipes to itself"},
		{"relative unix socket", relSocket, "[ -e /tmp/ready ]", "python3:template", ""},
	} {
		t.Run(c.name, func(t *testing.T) {
			s := b.create(t, sandbox.Spec{Image: defaultImage(t, b)})
			sh(t, s, "mkdir -p /work && echo 42 > /work/answer.txt")
			if _, err := s.Exec(ctx, sandbox.ExecRequest{Argv: []string{"python3", "-c", c.prog}, Background: true}); err != nil {
				t.Fatal(err)
			}
			waitFor(t, s, c.ready)
			ck, err := s.Checkpoint(ctx)
			if err != nil {
				t.Fatalf("checkpoint: %v", err)
			}
			if got := methods(ck.Processes); got != c.method || !strings.Contains(ck.Processes[0].Reason, c.reason) {
				t.Fatalf("captured %q (%+v), want %s saying %q", got, ck.Processes, c.method, c.reason)
			}
			if err := s.Restore(ctx, ck.ID); err != nil {
				t.Fatalf("restore: %v", err)
			}
			if got := sh(t, s, "cat /work/answer.txt"); got != "42\n" {
				t.Fatalf("/work/answer.txt after the restore: %q", got)
			}
		})
	}
}

// removedShmPy maps a file of /dev/shm shared and writable and removes it,
// as POSIX semaphores and multiprocessing's shared memory are; with
// argument "tree" it runs as the child of a shell.
const removedShmPy = `import mmap, os, time
f = open("/dev/shm/seg", "w+b")
f.truncate(4096)
m = mmap.mmap(f.fileno(), 4096)
os.unlink("/dev/shm/seg")
open("/tmp/ready", "w").close()
time.sleep(1e9)
`

// A process that maps a /dev/shm file it removed stays a template (CRIU
// cannot bring such a file back in a sandbox), and the checkpoint says
// that its copies share it; in a process tree, which only CRIU takes, the
// checkpoint is refused, saying why, rather than taken and never restored.
func TestRemovedShmShared(t *testing.T) {
	needCRIU(t)
	b := setup(t)
	ctx := t.Context()
	s := b.create(t, sandbox.Spec{Image: defaultImage(t, b)})
	if err := s.WriteFile(ctx, "/tmp/rm.py", []byte(removedShmPy), 0o644, false); err != nil {
		t.Fatal(err)
	}
	if _, err := s.Exec(ctx, sandbox.ExecRequest{Argv: []string{"python3", "/tmp/rm.py"}, Background: true}); err != nil {
		t.Fatal(err)
	}
	waitFor(t, s, "[ -e /tmp/ready ]")
	ck, err := s.Checkpoint(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if got := methods(ck.Processes); got != "python3:template" || !strings.Contains(ck.Processes[0].Reason, "/dev/shm/seg") || !strings.Contains(ck.Processes[0].Reason, "not rolled back") {
		t.Fatalf("captured %q (%+v), want a template whose reason names the shared file", got, ck.Processes)
	}
	if err := s.Restore(ctx, ck.ID); err != nil {
		t.Fatal(err)
	}
	sh(t, s, "rm /tmp/ready")
	if _, err := s.Exec(ctx, sandbox.ExecRequest{Argv: []string{"sh", "-c", "python3 /tmp/rm.py; true"}, Background: true}); err != nil {
		t.Fatal(err)
	}
	waitFor(t, s, "[ -e /tmp/ready ]")
	_, err = s.Checkpoint(ctx)
	if !errors.Is(err, sandbox.ErrProcesses) || !strings.Contains(err.Error(), "removed while in use") {
		t.Fatalf("checkpoint of a tree holding a removed /dev/shm file: %v, want it refused saying why", err)
	}
}
