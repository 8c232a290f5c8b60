package sandbox_test

import (
	"context"
	"os"
	"runtime"
	"strconv"
	"strings"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/deltagym/deltagym/sandbox"
)

// tracedThreadPy is a leftover (it holds the exec's stdout) whose second
// thread has its parent, another python3 that holds none of the pipes and
// never waits, for tracer (PTRACE_TRACEME). Once the server stops the
// leftover's leader to give it the null device (leftovers.go, nullAt,
// ptfork SeizeLeader) and has begun the dup3 calls it injects for the
// stdout the leftover holds at 400 descriptors, that thread SIGKILLs its
// own process, while its leader is in a stop between two of them: the leader,
// woken from its stop, becomes a zombie that cannot be reaped while the
// thread, a zombie its tracer must reap, is still in its thread group.
const tracedThreadPy = `
import ctypes, os, sys, threading, time
libc = ctypes.CDLL(None, use_errno=True)
if os.fork():
    n = os.open("/dev/null", os.O_RDWR)
    for i in (0, 1, 2):
        os.dup2(n, i)
    time.sleep(1e6)
    sys.exit()
def thread():
    if libc.ptrace(0, 0, 0, 0) != 0:  # PTRACE_TRACEME: the parent above
        print("traceme failed", ctypes.get_errno(), flush=True)
    open("/tmp/atk3-ready", "w").close()
    me = os.getpid()
    fd = os.open("/proc/%d/stat" % me, os.O_RDONLY)
    # The server's injected dup3 calls have begun once fd 100 is no
    # longer the exec's pipe: kill at the next stop between two of them.
    while os.readlink("/proc/self/fd/100").startswith("pipe:"):
        pass
    while True:
        st = os.pread(fd, 512, 0)
        if st[st.rindex(b")") + 2] == ord("t"):
            os.kill(me, 9)
for i in range(400):  # the server injects a dup3 for each: a longer stop
    os.dup2(1, 100 + i)
threading.Thread(target=thread, daemon=True).start()
while True:
    time.sleep(0.001)
`

// A hostile command's leftover, killed by one of its own threads while the
// server holds its leader in a ptrace stop, hangs the exec for ever (its
// timeout included), and with it the sandbox's Destroy (tearDown waits for
// s.op, which the exec holds shared), every checkpoint and restore of it:
// Proc.detach meets ESRCH and waitGone (ptfork.go) waits, with no bound,
// for a leader the kernel will not report while a thread of it is a zombie
// traced by another process of the sandbox, which never reaps it.
func TestAttackLeftoverTracedThreadHangsExec(t *testing.T) {
	b := setup(t)
	s := b.create(t, sandbox.Spec{Image: defaultImage(t, b)})
	ctx := context.Background()
	if err := s.WriteFile(ctx, "/tmp/atk3.py", []byte(tracedThreadPy), 0o644, false); err != nil {
		t.Fatal(err)
	}
	type res struct {
		r   sandbox.ExecResult
		err error
	}
	done := make(chan res, 1)
	go func() {
		r, err := s.Exec(ctx, sandbox.ExecRequest{
			Command: "python3 /tmp/atk3.py & until [ -e /tmp/atk3-ready ]; do sleep 0.01; done; sleep 0.2; echo started",
			Timeout: 10 * time.Second,
		})
		done <- res{r, err}
	}()
	select {
	case r := <-done:
		t.Logf("the exec returned: %v %+v", r.err, r.r)
		return
	case <-time.After(30 * time.Second):
	}
	t.Errorf("the exec (timeout 10 s) has not returned after 30 s")
	logPtforkStacks(t)
	for _, pid := range hostPids("atk3.py") {
		tasks, _ := os.ReadDir("/proc/" + strconv.Itoa(pid) + "/task")
		for _, task := range tasks {
			st, _ := os.ReadFile("/proc/" + strconv.Itoa(pid) + "/task/" + task.Name() + "/status")
			var keep []string
			for _, l := range strings.Split(string(st), "\n") {
				if strings.HasPrefix(l, "State") || strings.HasPrefix(l, "PPid") || strings.HasPrefix(l, "TracerPid") {
					keep = append(keep, l)
				}
			}
			t.Logf("pid %d task %s: %s", pid, task.Name(), strings.Join(keep, ", "))
		}
	}
	destroyed := make(chan error, 1)
	go func() { destroyed <- s.Destroy(context.Background()) }()
	select {
	case err := <-destroyed:
		t.Logf("Destroy returned %v", err)
	case <-time.After(10 * time.Second):
		t.Errorf("the sandbox's Destroy has not returned after 10 s either")
	}
	// The tracer's end releases the traced zombie thread, and so the
	// leader: the exec returns.
	for _, pid := range hostPids("atk3.py") {
		_ = unix.Kill(pid, unix.SIGKILL)
	}
	select {
	case r := <-done:
		t.Logf("once the sandbox's python3 were killed from the host, the exec returned %v", r.err)
	case <-time.After(20 * time.Second):
		t.Errorf("the exec has not returned after the kill either")
	}
	select {
	case err := <-destroyed:
		t.Logf("Destroy: %v", err)
	case <-time.After(20 * time.Second):
		t.Errorf("Destroy has not returned after the kill either")
	}
}

// logPtforkStacks logs the stacks of the goroutines in a ptrace session.
func logPtforkStacks(t *testing.T) {
	buf := make([]byte, 1<<20)
	buf = buf[:runtime.Stack(buf, true)]
	for _, g := range strings.Split(string(buf), "\n\n") {
		if strings.Contains(g, "ptfork.") {
			t.Logf("%s", g)
		}
	}
}

// heldUse returns the usage of the held memory group (cgroup/held.go) of
// b's runtime, and its path.
func heldUse(t *testing.T, b *bundle) (int64, string) {
	dir := "/sys/fs/cgroup/memory/" + b.cfg.CgroupRoot + ".held"
	raw, err := os.ReadFile(dir + "/memory.usage_in_bytes")
	if err != nil {
		t.Skipf("no held memory group (memory not a v1 controller?): %v", err)
	}
	u, _ := strconv.ParseInt(strings.TrimSpace(string(raw)), 10, 64)
	return u, dir
}

// The stash of a tree's root (procstate treeChild) is the template's own
// memory: charged to the sandbox's memory group, it counts against the
// sandbox's limit as its checkpoints' templates do (docs/OPERATIONS.md), and
// a checkpoint stashes only while the limit has the room (MemoryRoom: three
// quarters of it less what the sandbox uses, stashes included). Six
// checkpoints of a tree whose root wrote a quarter of a 256 MiB limit stash
// while there is room and then copy the root's pages at restores instead:
// the sandbox stays within its limit, with no OOM kill, and nothing of the
// stashes goes to the runtime's held memory group, which no sandbox's limit
// sees.
func TestAttackTreeStashesPastTheLimit(t *testing.T) {
	needCRIU(t)
	b := setup(t)
	ctx := context.Background()
	const limit = 256 << 20
	s := b.create(t, sandbox.Spec{Image: defaultImage(t, b), Limits: sandbox.Limits{MemoryBytes: limit}})
	prog := rootTreeProgram(64, 4<<10) // every page written
	_, err := s.Exec(ctx, sandbox.ExecRequest{Argv: []string{"python3", "-c", prog}, Background: true})
	must(t, err)
	waitFor(t, s, "[ -e /tmp/ready ]")
	hostRoot := hostPids("mmap.mmap(-1")[0]
	held0, dir := heldUse(t, b)
	var ids []string
	for i := range 6 {
		ck, err := s.Checkpoint(ctx)
		must(t, err)
		ids = append(ids, ck.ID)
		use, _, kills := memoryUse(hostRoot)
		held, _ := heldUse(t, b)
		t.Logf("checkpoint %d: stashes %d; the sandbox uses %d MiB of %d (OOM kills %d), the held group %s %d MiB more than before the first",
			i+1, s.TreeStashes(), use>>20, limit>>20, kills, dir, (held-held0)>>20)
	}
	held, _ := heldUse(t, b)
	use, _, kills := memoryUse(hostRoot)
	if s.TreeStashes() == 0 {
		t.Fatal("the root was never stashed")
	}
	if held-held0 > 16<<20 {
		t.Errorf("the checkpoints of a sandbox limited to %d MiB put %d MiB in the held group, charged to no limit of the sandbox's", limit>>20, (held-held0)>>20)
	}
	if kills != 0 || use > limit {
		t.Errorf("after %d stashes the sandbox uses %d MiB of its %d, with %d OOM kills", s.TreeStashes(), use>>20, limit>>20, kills)
	}
	// Every checkpoint restores its tree, stashed or not.
	for _, id := range ids {
		copies := s.TreeCopies()
		must(t, s.Restore(ctx, id))
		if s.TreeCopies() != copies+1 {
			t.Errorf("checkpoint %s: the tree was not copied from its templates", id)
		}
	}
}

// raceInitPy watches for new processes of the sandbox (the init's spawn
// children between their clone and their exec among them, which hold the
// init's CAP_CHECKPOINT_RESTORE and its descriptor of ns_last_pid) and
// tries to reach each: ptrace, its descriptors, its memory, pidfd_getfd;
// and the init's own. It prints what it got of a process that had the
// capability or of the descriptor.
const raceInitPy = `
import ctypes, os, time, sys
libc = ctypes.CDLL(None, use_errno=True)
got = []
def privileged(pid):
    try:
        st = open("/proc/%d/status" % pid).read()
    except OSError:
        return False
    for l in st.splitlines():
        if l.startswith("CapEff:") or l.startswith("CapPrm:"):
            if int(l.split()[1], 16) & (1 << 40):
                return True
    return False
def tryall(pid):
    for fd in range(3, 12):
        try:
            l = os.readlink("/proc/%d/fd/%d" % (pid, fd))
            if "ns_last_pid" in l:
                got.append("readlink %d %d %s" % (pid, fd, l))
            f = os.open("/proc/%d/fd/%d" % (pid, fd), os.O_WRONLY)
            if "ns_last_pid" in l or privileged(pid):
                got.append("opened %d fd %d: %s" % (pid, fd, l))
            os.close(f)
        except OSError:
            pass
    try:
        f = os.open("/proc/%d/mem" % pid, os.O_RDONLY)
        if privileged(pid):
            got.append("mem of %d" % pid)
        os.close(f)
    except OSError:
        pass
    if libc.ptrace(0x4206, pid, 0, 0) == 0:  # PTRACE_SEIZE
        if privileged(pid):
            got.append("seized %d" % pid)
        libc.ptrace(17, pid, 0, 0)
    pfd = libc.syscall(434, pid, 0)  # pidfd_open
    if pfd >= 0:
        for fd in range(3, 12):
            r = libc.syscall(438, pfd, fd, 0)  # pidfd_getfd
            if r >= 0 and ("ns_last_pid" in os.readlink("/proc/self/fd/%d" % r) or privileged(pid)):
                got.append("pidfd_getfd %d %d: %s" % (pid, fd, os.readlink("/proc/self/fd/%d" % r)))
                os.close(r)
        os.close(pfd)
tryall(1)
seen = set(os.listdir("/proc"))
end = time.time() + float(sys.argv[1])
open("/tmp/race-ready", "w").close()
while time.time() < end:
    now = set(os.listdir("/proc"))
    for p in now - seen:
        if p.isdigit() and int(p) != os.getpid():
            tryall(int(p))
    seen = now
print("\n".join(got) if got else "nothing")
`

// A command reaches neither the init's CAP_CHECKPOINT_RESTORE nor its
// descriptor of ns_last_pid: not in the init (non-dumpable, a capability
// the command lacks), nor in a spawn child between its clone and its exec
// (it shares the init's mm, non-dumpable, whose user namespace is the
// host's), as root of the sandbox.
func TestAttackInitNextPidOutOfReach(t *testing.T) {
	b := setup(t)
	s := b.create(t, sandbox.Spec{Image: defaultImage(t, b)})
	ctx := context.Background()
	must(t, s.WriteFile(ctx, "/tmp/race.py", []byte(raceInitPy), 0o644, false))
	type res struct {
		r   sandbox.ExecResult
		err error
	}
	done := make(chan res, 1)
	go func() {
		r, err := s.Exec(ctx, sandbox.ExecRequest{Argv: []string{"python3", "/tmp/race.py", "8"}, Timeout: 30 * time.Second})
		done <- res{r, err}
	}()
	waitFor(t, s, "[ -e /tmp/race-ready ]")
	for i := 0; i < 150; i++ {
		if _, err := s.Exec(ctx, sandbox.ExecRequest{Argv: []string{"/bin/true"}}); err != nil {
			t.Fatal(err)
		}
	}
	r := <-done
	if r.err != nil || strings.TrimSpace(string(r.r.Stdout)) != "nothing" {
		t.Errorf("a command reached the init or its spawn children: %v %q %q", r.err, r.r.Stdout, r.r.Stderr)
	}
	if out := sh(t, s, "grep -E 'CapEff|CapPrm|CapBnd' /proc/self/status"); strings.Contains(out, "00000100") {
		t.Errorf("a command's capabilities: %q", out)
	}
}
