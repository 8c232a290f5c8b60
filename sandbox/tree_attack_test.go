package sandbox_test

import (
	"context"
	"errors"
	"fmt"
	"os"
	"strconv"
	"strings"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/deltagym/deltagym/sandbox"
)

// treeChildWith is treeProgram with code run first in its python3 child.
func treeChildWith(code string) string {
	return strings.Replace(treeProgram, "import os, signal\n", "import os, signal\n"+code, 1)
}

// checkpointOrHang takes a checkpoint of s, failing the test if it has
// not returned after 20 s (a checkpoint takes well under a second);
// then it tries to destroy the sandbox, kills the sandbox's processes
// whose command line holds marker, from the host, and waits for the
// checkpoint to return.
func checkpointOrHang(t *testing.T, s *sandbox.Sandbox, marker string) (sandbox.CheckpointInfo, error, bool) {
	t.Helper()
	type res struct {
		ck  sandbox.CheckpointInfo
		err error
	}
	done := make(chan res, 1)
	go func() {
		ck, err := s.Checkpoint(context.Background())
		done <- res{ck, err}
	}()
	select {
	case r := <-done:
		return r.ck, r.err, true
	case <-time.After(20 * time.Second):
	}
	t.Errorf("the checkpoint has not returned after 20 s")
	for _, pid := range hostPids("criu") {
		wchan, _ := os.ReadFile("/proc/" + strconv.Itoa(pid) + "/wchan")
		cl, _ := os.ReadFile("/proc/" + strconv.Itoa(pid) + "/cmdline")
		t.Logf("criu pid %d (%s) waits in %s", pid, strings.ReplaceAll(string(cl), "\x00", " "), wchan)
	}
	for _, pid := range hostPids(marker) {
		st, _ := os.ReadFile("/proc/" + strconv.Itoa(pid) + "/status")
		for _, l := range strings.Split(string(st), "\n") {
			if strings.HasPrefix(l, "State") || strings.HasPrefix(l, "PPid") || strings.HasPrefix(l, "TracerPid") {
				t.Logf("pid %d: %s", pid, l)
			}
		}
		kids, _ := os.ReadFile("/proc/" + strconv.Itoa(pid) + "/task/" + strconv.Itoa(pid) + "/children")
		t.Logf("pid %d children %q", pid, kids)
	}
	// Nor does the sandbox's end come while the checkpoint holds it.
	destroyed := make(chan error, 1)
	go func() { destroyed <- s.Destroy(context.Background()) }()
	select {
	case err := <-destroyed:
		t.Logf("the sandbox's Destroy returned %v", err)
	case <-time.After(10 * time.Second):
		t.Errorf("the sandbox's Destroy has not returned after 10 s either")
	}
	for _, pid := range hostPids(marker) {
		_ = unix.Kill(pid, unix.SIGKILL)
	}
	r := <-done
	t.Logf("after the kill of %q, the checkpoint returned %v", marker, r.err)
	return r.ck, r.err, false
}

// hostPids lists the host pids of the processes whose command line holds
// marker.
func hostPids(marker string) []int {
	var out []int
	ents, _ := os.ReadDir("/proc")
	for _, e := range ents {
		pid, err := strconv.Atoi(e.Name())
		if err != nil || pid == os.Getpid() {
			continue
		}
		if cl, err := os.ReadFile("/proc/" + e.Name() + "/cmdline"); err == nil && strings.Contains(string(cl), marker) {
			out = append(out, pid)
		}
	}
	return out
}

// A process may rewrite its own vDSO (mapped with VM_MAYWRITE, for
// debuggers), where ptfork injects every call: the checkpoint fails with
// ErrProcesses saying so, at once, and the sandbox goes on (it hung, the
// injection stepping a faulting instruction again and again).
func TestAttackPatchedVdsoCheckpoint(t *testing.T) {
	b := setup(t)
	ctx := context.Background()
	s := b.create(t, sandbox.Spec{Image: defaultImage(t, b)})
	const prog = `
import ctypes, signal
marker = "atkpatchedvdso"
for line in open("/proc/self/maps"):
    if line.rstrip().endswith("[vdso]"):
        lo, hi = (int(x, 16) for x in line.split()[0].split("-"))
libc = ctypes.CDLL(None)
libc.mprotect.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
assert libc.mprotect(lo, hi - lo, 7) == 0
buf = (ctypes.c_ubyte * (hi - lo)).from_address(lo)
for i in range(hi - lo - 1):
    if buf[i] == 0x0f and buf[i + 1] == 0x05:
        buf[i + 1] = 0x0b
open("/tmp/ready", "w").close()
while True: signal.pause()
`
	_, err := s.Exec(ctx, sandbox.ExecRequest{Argv: []string{"python3", "-c", prog}, Background: true})
	must(t, err)
	waitFor(t, s, "[ -e /tmp/ready ]")
	if _, err, ok := checkpointOrHang(t, s, "atkpatchedvdso"); ok && (!errors.Is(err, sandbox.ErrProcesses) || !strings.Contains(err.Error(), "vDSO")) {
		t.Fatalf("the checkpoint of a process with a rewritten vDSO: %v, want ErrProcesses naming the vDSO", err)
	}
	if got := sh(t, s, "echo ok"); got != "ok\n" {
		t.Fatalf("the sandbox after the checkpoint: %q", got)
	}
}

// A tree's child that is a child subreaper would adopt the template
// ForkOrphan makes of it, which criu would then meet in the tree, frozen,
// and wait for: the tree gets no templates, and its images serve.
func TestAttackTreeSubreaper(t *testing.T) {
	needCRIU(t)
	b := setup(t)
	ctx := context.Background()
	s := b.create(t, sandbox.Spec{Image: defaultImage(t, b)})
	prog := treeChildWith("import ctypes\nctypes.CDLL(None).prctl(36, 1, 0, 0, 0)\n")
	_, err := s.Exec(ctx, sandbox.ExecRequest{Argv: []string{"sh", "-c", prog}, Background: true})
	must(t, err)
	waitFor(t, s, "[ -e /tmp/ready ]")
	before := sh(t, s, "ps -o pid=,ppid=,pgid=,sid=,stat=,comm=")
	ck, err, ok := checkpointOrHang(t, s, "prctl(36")
	if !ok {
		return
	}
	must(t, err)
	after := sh(t, s, "ps -o pid=,ppid=,pgid=,sid=,stat=,comm=")
	t.Logf("before the checkpoint:\n%s\nafter:\n%s", before, after)
	// The live child has a python3 child now: the template.
	kids := sh(t, s, `for p in $(pgrep -x python3); do pp=$(ps -o ppid= -p $p | tr -d ' '); [ "$(cat /proc/$pp/comm 2>/dev/null)" = python3 ] && echo $p; done; true`)
	if strings.TrimSpace(kids) != "" {
		t.Errorf("a python3 process (%s) is the child of the live python3: the child's template was adopted", strings.TrimSpace(kids))
	}
	// The checkpoint says why the tree is not copied.
	for _, p := range ck.Processes {
		if !strings.Contains(p.Reason, "not copied from templates") || !strings.Contains(p.Reason, "subreaper") {
			t.Errorf("pid %d's reason does not say why the tree is not copied: %q", p.Pid, p.Reason)
		}
	}
	copies := s.TreeCopies()
	must(t, s.Restore(ctx, ck.ID))
	if s.TreeCopies() != copies {
		t.Errorf("a tree whose child is a subreaper was copied from templates")
	}
	// A new sandbox from the checkpoint takes its images.
	f := b.create(t, sandbox.Spec{Checkpoint: ck.ID})
	t.Logf("a sandbox from the checkpoint:\n%s", sh(t, f, "ps -o pid=,ppid=,pgid=,sid=,stat=,comm="))
	if n := strings.Count(sh(t, f, "pgrep -x python3 || true"), "\n"); n != 1 {
		t.Errorf("a sandbox from the checkpoint runs %d python3 processes, want 1", n)
	}
}

// A tree's child that holds memory marked MADV_DONTFORK (V8's heap, and so
// Node's; pinned buffers, RDMA and GPU libraries mark theirs so) would have
// a template without it (ForkOrphan forks it twice): the memory is marked
// to be copied for the template's making, and each restore in place is a
// copy that has it, twice over.
func TestAttackTreeDontFork(t *testing.T) {
	needCRIU(t)
	b := setup(t)
	ctx := context.Background()
	s := b.create(t, sandbox.Spec{Image: defaultImage(t, b)})
	prog := treeChildWith(`import mmap
m = mmap.mmap(-1, 1 << 20, flags=mmap.MAP_PRIVATE)
m.write(b"\x07" * (1 << 20))
m.madvise(mmap.MADV_DONTFORK)
`)
	prog = strings.Replace(prog, `"%d %d %d" % (n[0], os.getpid(), os.getppid())`, `"%d %d %d %d" % (n[0], os.getpid(), os.getppid(), m[12345])`, 1)
	_, err := s.Exec(ctx, sandbox.ExecRequest{Argv: []string{"sh", "-c", prog}, Background: true})
	must(t, err)
	waitFor(t, s, "[ -e /tmp/ready ]")
	counter := func() string {
		return strings.TrimSpace(sh(t, s, "rm -f /tmp/counter; kill -USR2 "+treeChildPid+"; for i in $(seq 300); do [ -e /tmp/counter ] && break; sleep 0.01; done; cat /tmp/counter 2>/dev/null; cat /tmp/done 2>/dev/null; true"))
	}
	want := counter()
	if !strings.HasSuffix(want, " 7") {
		t.Fatalf("the child's answer before the checkpoint: %q", want)
	}
	ck, err := s.Checkpoint(ctx)
	must(t, err)
	t.Logf("captured: %+v", ck.Processes)
	for i := range 2 {
		copies := s.TreeCopies()
		must(t, s.Restore(ctx, ck.ID))
		if s.TreeCopies() != copies+1 {
			t.Errorf("restore %d: a tree whose child has MADV_DONTFORK memory was not copied from templates", i)
		}
		if got := counter(); got != want {
			t.Fatalf("restore %d: the child answers %q, want %q", i, got, want)
		}
	}
}

// seccompTree is a python3 parent and child, each stacking a seccomp
// filter of its own after the fork (so both have as many: Fits passes),
// the parent's refusing getcwd, the child's refusing the call numbered
// CHILDNR. The child counts SIGUSR1s and writes "count pid ppid" to
// /tmp/counter at SIGUSR2; the parent writes whether getcwd is allowed to
// /tmp/rootcwd at SIGUSR1.
const seccompTree = `
import ctypes, os, signal, struct
libc = ctypes.CDLL(None, use_errno=True)
def deny(nr):
    prog = b"".join(struct.pack("HBBI", *i) for i in [(0x20, 0, 0, 0), (0x15, 0, 1, nr), (0x06, 0, 0, 0x50001), (0x06, 0, 0, 0x7fff0000)])
    buf = ctypes.create_string_buffer(prog, len(prog))
    fprog = ctypes.create_string_buffer(struct.pack("HxxxxxxQ", 4, ctypes.addressof(buf)), 16)
    assert libc.prctl(22, 2, fprog, 0, 0) == 0, ctypes.get_errno()
n = [0]
def add(*_): n[0] += 1
def tell(*_):
    with open("/tmp/counter.tmp", "w") as f: f.write("%d %d %d" % (n[0], os.getpid(), os.getppid()))
    os.rename("/tmp/counter.tmp", "/tmp/counter")
pid = os.fork()
if pid == 0:
    deny(CHILDNR)
    signal.signal(signal.SIGUSR1, add)
    signal.signal(signal.SIGUSR2, tell)
    open("/tmp/ready", "w").close()
    while True: signal.pause()
def cwd(*_):
    try:
        os.getcwd()
        r = "allowed"
    except OSError:
        r = "denied"
    with open("/tmp/rootcwd.tmp", "w") as f: f.write(r)
    os.rename("/tmp/rootcwd.tmp", "/tmp/rootcwd")
signal.signal(signal.SIGUSR1, cwd)
deny(79)
while True:
    try:
        os.waitpid(pid, 0)
        break
    except InterruptedError:
        pass
`

// A tree whose child's own seccomp filter refuses rseq (which Become
// calls in the copy) gets no templates, its filters differing from its
// root's; the tree's images serve: the restore has the checkpoint's pids,
// memory and no other process. (The root's parent is compared apart: a root restored by CRIU
// has none in the sandbox, ppid 0, where it had the init.)
func TestAttackTreeChildFilterImages(t *testing.T) {
	needCRIU(t)
	b := setup(t)
	ctx := context.Background()
	s := b.create(t, sandbox.Spec{Image: defaultImage(t, b)})
	_, err := s.Exec(ctx, sandbox.ExecRequest{Argv: []string{"python3", "-c", strings.Replace(seccompTree, "CHILDNR", "334", 1)}, Background: true})
	must(t, err)
	waitFor(t, s, "[ -e /tmp/ready ]")
	ids := func() string {
		return sh(t, s, "c="+treeChildPid+"; ps -o pid=,pgid=,sid=,comm= -p $c,$(ps -o ppid= -p $c | tr -d ' ')")
	}
	counter := func() string {
		return strings.TrimSpace(sh(t, s, "rm -f /tmp/counter; kill -USR2 "+treeChildPid+"; for i in $(seq 300); do [ -e /tmp/counter ] && break; sleep 0.01; done; cat /tmp/counter 2>/dev/null; true"))
	}
	sh(t, s, "kill -USR1 "+treeChildPid)
	want, wantIDs := counter(), ids()
	ck, err := s.Checkpoint(ctx)
	must(t, err)
	t.Logf("captured: %+v", ck.Processes)
	all := "ps -o pid=,sid=,comm= | grep python3"
	before := sh(t, s, all)
	sh(t, s, "kill -USR1 "+treeChildPid)
	copies := s.TreeCopies()
	must(t, s.Restore(ctx, ck.ID))
	t.Logf("tree copies %d -> %d", copies, s.TreeCopies())
	if got := ids(); got != wantIDs {
		t.Errorf("the processes are\n%s\nnot, as at the checkpoint,\n%s", got, wantIDs)
	}
	if got := counter(); got != want {
		t.Errorf("the child answers %q, want %q", got, want)
	}
	if got := sh(t, s, all); got != before {
		t.Errorf("the sandbox runs\n%s\nnot, as after the checkpoint,\n%s", got, before)
	}
}

// A python3 parent and child that each stacked a seccomp filter of their
// own after the fork have as many filters, but not the same: the tree gets
// no templates (a copy of the root would have the child's filter), and a
// restore in place from its images keeps the root's (getcwd refused).
func TestAttackTreeSeccompSwap(t *testing.T) {
	needCRIU(t)
	b := setup(t)
	ctx := context.Background()
	s := b.create(t, sandbox.Spec{Image: defaultImage(t, b)})
	_, err := s.Exec(ctx, sandbox.ExecRequest{Argv: []string{"python3", "-c", strings.Replace(seccompTree, "CHILDNR", "110", 1)}, Background: true})
	must(t, err)
	waitFor(t, s, "[ -e /tmp/ready ]")
	const root = `$(for p in $(pgrep -x python3); do [ "$(ps -o sid= -p $p | tr -d ' ')" = $p ] && [ -n "$(pgrep -P $p)" ] && echo $p; done)`
	rootCwd := func() string {
		return strings.TrimSpace(sh(t, s, "rm -f /tmp/rootcwd; kill -USR1 "+root+"; for i in $(seq 300); do [ -e /tmp/rootcwd ] && break; sleep 0.01; done; cat /tmp/rootcwd 2>/dev/null; true"))
	}
	if got := rootCwd(); got != "denied" {
		t.Fatalf("the root before the checkpoint: getcwd %q", got)
	}
	ck, err := s.Checkpoint(ctx)
	must(t, err)
	copies := s.TreeCopies()
	must(t, s.Restore(ctx, ck.ID))
	if s.TreeCopies() != copies {
		t.Errorf("a tree whose processes differ in seccomp filters was copied from templates")
	}
	if got := rootCwd(); got != "denied" {
		t.Errorf("after a restore in place by copies, the root's getcwd is %q, not denied: it has the child's seccomp filter, not its own", got)
	}
}

// rootTreeProgram is a python3 root that forks a child (which waits), then
// maps mib MiB and writes one byte in each stride bytes of it (in small
// pages: the root asks for no huge page, the machine's THP setting is
// madvise or never). The root writes /tmp/ready when it is done.
func rootTreeProgram(mib, stride int) string {
	return fmt.Sprintf(`
import mmap, os, signal
pid = os.fork()
if pid == 0:
    while True: signal.pause()
m = mmap.mmap(-1, %d << 20, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
for i in range(0, %d << 20, %d): m[i] = 1
open("/tmp/ready", "w").close()
while True:
    try:
        os.waitpid(pid, 0)
        break
    except InterruptedError:
        pass
`, mib, mib, stride)
}

// memoryUse returns the usage and limit of the memory group (v1) with a
// limit that holds host pid pid, and the OOM kills in it, or zeros.
func memoryUse(pid int) (use, limit, kills int64) {
	cg, err := os.ReadFile("/proc/" + strconv.Itoa(pid) + "/cgroup")
	if err != nil {
		return 0, 0, 0
	}
	for _, l := range strings.Split(string(cg), "\n") {
		f := strings.SplitN(l, ":", 3)
		if len(f) != 3 || f[1] != "memory" {
			continue
		}
		for dir := "/sys/fs/cgroup/memory" + f[2]; strings.HasPrefix(dir, "/sys/fs/cgroup/memory/"); dir = dir[:strings.LastIndexByte(dir, '/')] {
			lb, _ := os.ReadFile(dir + "/memory.limit_in_bytes")
			ub, _ := os.ReadFile(dir + "/memory.usage_in_bytes")
			lim, _ := strconv.ParseInt(strings.TrimSpace(string(lb)), 10, 64)
			if lim > 0 && lim < 1<<50 {
				u, _ := strconv.ParseInt(strings.TrimSpace(string(ub)), 10, 64)
				oc, _ := os.ReadFile(dir + "/memory.oom_control")
				for _, l := range strings.Split(string(oc), "\n") {
					if v, ok := strings.CutPrefix(l, "oom_kill "); ok {
						kills, _ = strconv.ParseInt(v, 10, 64)
					}
				}
				return u, lim, kills
			}
		}
	}
	return 0, 0, 0
}

// A tree's root that wrote one byte in each 2 MiB of a large region has
// little memory of its own (Written: 768 KiB for 384 MiB), and the stash
// is made for that little (MemoryRoom). But Stash maps each anonymous
// mapping of 2 MiB or more MADV_HUGEPAGE and populates its written runs
// (mapLike): each byte the root wrote costs a 2 MiB huge page in the
// child's template, 512 times what was reckoned, charged to the sandbox
// (the template makes it in the sandbox's memory group, before it is
// held: forkTemplateWith's before) for as long as the checkpoint lives.
// Here the stash takes ~384 MiB of a 512 MiB limit, and a command that
// had room for 128 MiB before the checkpoint is OOM-killed after it. What a
// checkpoint may take is three quarters of the limit less what is used.
func TestAttackTreeStashFillsLimit(t *testing.T) {
	needCRIU(t)
	b := setup(t)
	ctx := context.Background()
	const limit = 512 << 20
	s := b.create(t, sandbox.Spec{Image: defaultImage(t, b), Limits: sandbox.Limits{MemoryBytes: limit}})
	prog := rootTreeProgram(384, 2<<20) // a byte in each 2 MiB
	_, err := s.Exec(ctx, sandbox.ExecRequest{Argv: []string{"python3", "-c", prog}, Background: true})
	must(t, err)
	waitFor(t, s, "[ -e /tmp/ready ]")
	const eat = `python3 -c 'b = bytearray(b"x") * (128 << 20); print(len(b))'`
	if res, err := s.Exec(ctx, sandbox.ExecRequest{Command: eat, Timeout: 20 * time.Second}); err != nil || res.ExitCode != 0 {
		t.Fatalf("128 MiB before the checkpoint: %v %+v", err, res)
	}
	hostRoot := hostPids("mmap.mmap(-1")[0]
	use0, _, _ := memoryUse(hostRoot)
	_, err = s.Checkpoint(ctx)
	must(t, err)
	use1, _, _ := memoryUse(hostRoot)
	t.Logf("stashes %d; the sandbox's memory group uses %d MiB before the checkpoint, %d MiB after", s.TreeStashes(), use0>>20, use1>>20)
	if s.TreeStashes() != 1 {
		t.Skip("the root was not stashed")
	}
	if use1 > use0+limit/4 {
		t.Errorf("the checkpoint of a root with 768 KiB of its own took %d MiB of the sandbox's %d MiB", (use1-use0)>>20, limit>>20)
	}
	res, err := s.Exec(ctx, sandbox.ExecRequest{Command: eat, Timeout: 20 * time.Second})
	if err != nil || res.ExitCode != 0 {
		t.Errorf("128 MiB after the checkpoint, which had room before it: %v exit %d signal %q %s", err, res.ExitCode, res.Signal, res.Stderr)
	}
}

// tracedZombies lists the processes that are zombies traced by a thread
// of this process (the server's ptrace sessions).
func tracedZombies() []int {
	own := map[string]bool{}
	tasks, _ := os.ReadDir("/proc/self/task")
	for _, e := range tasks {
		own[e.Name()] = true
	}
	var out []int
	ents, _ := os.ReadDir("/proc")
	for _, e := range ents {
		pid, err := strconv.Atoi(e.Name())
		if err != nil {
			continue
		}
		st, err := os.ReadFile("/proc/" + e.Name() + "/status")
		if err != nil {
			continue
		}
		var state, tracer string
		for _, l := range strings.Split(string(st), "\n") {
			if v, ok := strings.CutPrefix(l, "State:"); ok {
				state = strings.TrimSpace(v)
			}
			if v, ok := strings.CutPrefix(l, "TracerPid:"); ok {
				tracer = strings.TrimSpace(v)
			}
		}
		if strings.HasPrefix(state, "Z") && own[tracer] {
			out = append(out, pid)
		}
	}
	return out
}

// The stash's huge pages (see TestAttackTreeStashFillsLimit) take the
// sandbox to its limit in the middle of the checkpoint, with its
// processes seized: the kernel's OOM killer picks the largest process of
// the sandbox's memory group, here another command (200 MiB of a 384 MiB
// limit), stopped by the checkpoint, which ends it. Two faults:
//
//   - a command of the sandbox is OOM-killed by a checkpoint of a tree
//     whose root has 1 MiB of its own;
//   - the command, killed while seized and stopped (its registers
//     saved), becomes a zombie traced by the server's thread; Proc.detach
//     (ptfork.go) meets ESRCH, ignores it and never waits for the tracee,
//     so the zombie stays traced for as long as that thread lives. Its
//     parent cannot reap it, the sandbox's init cannot end
//     (zap_pid_ns_processes waits for it), and Destroy hangs for ever.
//
// The test reaps the zombie itself (any thread of the tracer's process
// may) once Destroy has hung, so that it ends.
func TestAttackTreeStashOOMBystander(t *testing.T) {
	needCRIU(t)
	b := setup(t)
	ctx := context.Background()
	s := b.create(t, sandbox.Spec{Image: defaultImage(t, b), Limits: sandbox.Limits{MemoryBytes: 384 << 20}})
	const hold = `python3 -c 'import time; b = bytearray(b"x") * (200 << 20); open("/tmp/held", "w").close(); time.sleep(1e6)' # atkbystander`
	_, err := s.Exec(ctx, sandbox.ExecRequest{Command: hold, Background: true})
	must(t, err)
	waitFor(t, s, "[ -e /tmp/held ]")
	prog := rootTreeProgram(512, 2<<20)
	_, err = s.Exec(ctx, sandbox.ExecRequest{Argv: []string{"python3", "-c", prog}, Background: true})
	must(t, err)
	waitFor(t, s, "[ -e /tmp/ready ]")
	hostRoot := hostPids("mmap.mmap(-1")[0]
	_, _, kills0 := memoryUse(hostRoot)
	ck, err, ok := checkpointOrHang(t, s, "mmap.mmap(-1")
	if !ok {
		return
	}
	t.Logf("the checkpoint: %v; captured %+v", err, ck.Processes)
	if _, _, kills := memoryUse(hostRoot); kills != kills0 {
		t.Errorf("the checkpoint of a tree whose root has 1 MiB of its own OOM-killed %d processes of the sandbox (another command held 200 MiB of its 384 MiB)", kills-kills0)
	}
	zombies := tracedZombies()
	if len(zombies) > 0 {
		t.Errorf("pids %v, ended during the checkpoint, are zombies the server still traces", zombies)
	}
	destroyed := make(chan error, 1)
	go func() { destroyed <- s.Destroy(context.Background()) }()
	select {
	case err := <-destroyed:
		t.Logf("Destroy: %v", err)
		return
	case <-time.After(20 * time.Second):
		t.Errorf("the sandbox's Destroy has not returned after 20 s")
	}
	for _, pid := range tracedZombies() {
		_, werr := unix.Wait4(pid, nil, unix.WALL, nil)
		t.Logf("reaped traced zombie %d: %v", pid, werr)
	}
	select {
	case err := <-destroyed:
		t.Logf("Destroy, once the zombie was reaped: %v", err)
	case <-time.After(20 * time.Second):
		t.Errorf("the sandbox's Destroy has not returned after reaping the zombies either")
	}
}
