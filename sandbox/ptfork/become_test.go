//go:build linux && amd64

package ptfork

import (
	"errors"
	"fmt"
	"os"
	"os/exec"
	"slices"
	"strconv"
	"strings"
	"testing"

	"golang.org/x/sys/unix"
)

// treeSource is a parent with one child. The parent fills 1 MiB of static
// memory and 256 KiB of heap with a pattern, counts SIGUSR1s in a handler,
// forks, and waits for any child; then it checks its memory and prints
// what it reaped. The child writes 8 MiB and pauses.
const treeSource = `#include <errno.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

static volatile sig_atomic_t usr1;
static void on_usr1(int sig) { (void)sig; usr1++; }
static unsigned char data[1 << 20];

int main(void) {
	setvbuf(stdout, NULL, _IONBF, 0);
	size_t hn = 256 << 10;
	unsigned char *heap = malloc(hn);
	for (size_t i = 0; i < sizeof data; i++) data[i] = (unsigned char)(i * 7);
	for (size_t i = 0; i < hn; i++) heap[i] = (unsigned char)(i * 13 + 1);
	struct sigaction sa = {0};
	sa.sa_handler = on_usr1;
	sa.sa_flags = SA_RESTART;
	sigaction(SIGUSR1, &sa, NULL);
	signal(SIGPIPE, SIG_IGN);
	pid_t c = fork();
	if (c == 0) {
		size_t n = 8 << 20;
		unsigned char *m = malloc(n);
		memset(m, 0x5a, n);
		printf("child %d\n", getpid());
		for (;;) pause();
	}
	printf("parent %d child %d\n", getpid(), c);
	int st = 0;
	pid_t r;
	do r = waitpid(-1, &st, 0); while (r < 0 && errno == EINTR);
	int ok = 1;
	for (size_t i = 0; i < sizeof data; i++) ok &= data[i] == (unsigned char)(i * 7);
	for (size_t i = 0; i < hn; i++) ok &= heap[i] == (unsigned char)(i * 13 + 1);
	printf("reaped %d status %d by %d ok %d usr1 %d\n", r, st, getpid(), ok, (int)usr1);
	return 0;
}
`

// TestBecomeTree copies a parent and its child the way a tree is copied:
// the child is forked (X), X forks the child's copy, and X becomes the
// parent. The parent's copy has its memory, its signal handler, its name
// and arguments, and reaps the child's copy as its own child. Once with
// the parent's pages copied in, once moved from a stash in the child's
// orphan copy, which X is forked from; the child's copy then has the
// child's maps, line for line.
func TestBecomeTree(t *testing.T) {
	needRoot(t)
	t.Run("copied", func(t *testing.T) { testBecomeTree(t, false) })
	t.Run("stashed", func(t *testing.T) { testBecomeTree(t, true) })
}

func testBecomeTree(t *testing.T, stashed bool) {
	bin := buildC(t, t.TempDir(), "tree", treeSource)
	cmd := exec.Command(bin)
	lines := startLines(t, cmd)
	var parent, child int
	for parent == 0 || child == 0 {
		if !lines.Scan() {
			t.Fatalf("the tree ended early: %v", lines.Err())
		}
		f := strings.Fields(lines.Text())
		switch f[0] {
		case "parent":
			parent, _ = strconv.Atoi(f[1])
		case "child":
			child, _ = strconv.Atoi(f[1])
		}
	}
	// The child outlives its parent's kill: ended on every path.
	t.Cleanup(func() { _ = unix.Kill(child, unix.SIGKILL) })
	s := NewSession()
	defer s.Close()
	sp, err := s.Attach(parent)
	if err != nil {
		t.Fatal(err)
	}
	cp, err := s.Attach(child)
	if err != nil {
		t.Fatal(err)
	}
	// A copy of the child outside the tree: no child of it, nor of the
	// parent, and the child has no middle child left, dead or alive.
	o, _, err := cp.ForkOrphan()
	if err != nil {
		t.Fatal(err)
	}
	if ppid, err := parentOf(o.Pid); err != nil || ppid == child || ppid == parent {
		t.Errorf("the orphan copy %d has parent %d (%v)", o.Pid, ppid, err)
	}
	if kids, err := os.ReadFile(fmt.Sprintf("/proc/%d/task/%d/children", child, child)); err != nil || len(kids) != 0 {
		t.Errorf("the child has children %q (%v) after ForkOrphan", kids, err)
	}
	defer o.Kill()
	src, err := sp.ReadSource()
	if err != nil {
		t.Fatal(err)
	}
	from := cp
	var like *Layout
	if stashed {
		if like, err = o.Stash(src); err != nil {
			t.Fatal(err)
		}
		from = o
	}
	x, _, err := from.Fork()
	if err != nil {
		t.Fatal(err)
	}
	c2, _, err := x.ForkChild()
	if err != nil {
		t.Fatal(err)
	}
	if ppid, err := parentOf(c2.Pid); err != nil || ppid != x.Pid {
		t.Fatalf("the child's copy %d has parent %d (%v), want %d", c2.Pid, ppid, err, x.Pid)
	}
	if err := c2.DropStash(like); err != nil {
		t.Fatal(err)
	}
	if err := x.Become(src, like); err != nil {
		t.Fatal(err)
	}
	xPid, cPid := x.Pid, c2.Pid
	if err := x.Detach(); err != nil {
		t.Fatal(err)
	}
	if err := c2.Detach(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		_ = unix.Kill(cPid, unix.SIGKILL)
		_ = unix.Kill(xPid, unix.SIGKILL)
	})
	for _, f := range []string{"cmdline", "comm", "environ"} {
		a, err1 := os.ReadFile(fmt.Sprintf("/proc/%d/%s", xPid, f))
		b, err2 := os.ReadFile(fmt.Sprintf("/proc/%d/%s", parent, f))
		if err1 != nil || err2 != nil || string(a) != string(b) {
			t.Errorf("%s: the copy's %q (%v), the parent's %q (%v)", f, a, err1, b, err2)
		}
	}
	layout := func(pid int) []string {
		maps, err := readMaps(pid)
		if err != nil {
			t.Fatal(err)
		}
		var out []string
		for _, v := range maps {
			out = append(out, fmt.Sprintf("%x-%x %s %s", v.start, v.end, v.perms, v.path))
		}
		return out
	}
	if a, b := layout(xPid), layout(parent); !slices.Equal(a, b) {
		t.Errorf("the copy's maps differ from the parent's:\n%s\n--\n%s", strings.Join(a, "\n"), strings.Join(b, "\n"))
	}
	if a, b := layout(cPid), layout(child); !slices.Equal(a, b) {
		t.Errorf("the child's copy's maps differ from the child's:\n%s\n--\n%s", strings.Join(a, "\n"), strings.Join(b, "\n"))
	}
	if err := unix.Kill(xPid, unix.SIGUSR1); err != nil {
		t.Fatal(err)
	}
	if err := unix.Kill(cPid, unix.SIGTERM); err != nil {
		t.Fatal(err)
	}
	if !lines.Scan() {
		t.Fatalf("no line from the parent's copy: %v", lines.Err())
	}
	want := fmt.Sprintf("reaped %d status %d by %d ok 1 usr1 1", cPid, unix.SIGTERM, xPid)
	if got := lines.Text(); got != want {
		t.Fatalf("the parent's copy printed %q, want %q", got, want)
	}
	cp.Kill()
	sp.Kill()
}

func parentOf(pid int) (int, error) {
	st, err := procStatus(pid)
	if err != nil {
		return 0, err
	}
	return strconv.Atoi(st["PPid"])
}

// BenchmarkForkTree copies a dash whose child is a python3, as a tree is
// copied: the child's fork, the copy's own fork, and Become. Each holds
// about 8 MB of its own (the shell in a variable). The shell's pages are
// copied in, or moved from a stash in an orphan copy of the child, which
// the child's copy then unmaps.
func BenchmarkForkTree(b *testing.B) {
	needRoot(b)
	b.Run("copied", func(b *testing.B) { benchmarkForkTree(b, false) })
	b.Run("stashed", func(b *testing.B) { benchmarkForkTree(b, true) })
}

func benchmarkForkTree(b *testing.B, stashed bool) {
	py, err := exec.LookPath("python3")
	if err != nil {
		b.Skip("python3 not on the host")
	}
	dash, err := exec.LookPath("dash")
	if err != nil {
		b.Skip("dash not on the host")
	}
	cmd := exec.Command(dash, "-c", `x=$(head -c 8000000 /dev/zero | tr '\0' x); `+py+` -c 'import os, signal, sys
b = bytearray(8 << 20)
for i in range(0, len(b), 4096): b[i] = 1
print(os.getpid(), flush=True)
signal.pause()'; echo ${#x}`)
	lines := startLines(b, cmd)
	if !lines.Scan() {
		b.Fatal(lines.Err())
	}
	child, err := strconv.Atoi(strings.TrimSpace(lines.Text()))
	if err != nil {
		b.Fatal(err)
	}
	// The shell's child outlives the shell's kill: ended on every path.
	b.Cleanup(func() { _ = unix.Kill(child, unix.SIGKILL) })
	s := NewSession()
	defer s.Close()
	sp, err := s.Attach(cmd.Process.Pid)
	if err != nil {
		b.Fatal(err)
	}
	cp, err := s.Attach(child)
	if err != nil {
		b.Fatal(err)
	}
	src, err := sp.ReadSource()
	if err != nil {
		b.Fatal(err)
	}
	from := cp
	like, err := ReadLayout(child)
	if err != nil {
		b.Fatal(err)
	}
	if stashed {
		o, _, err := cp.ForkOrphan()
		if err != nil {
			b.Fatal(err)
		}
		defer o.Kill()
		if like, err = o.Stash(src); err != nil {
			b.Fatal(err)
		}
		from = o
	}
	b.ResetTimer()
	for range b.N {
		x, _, err := from.Fork()
		if err != nil {
			b.Fatal(err)
		}
		c2, _, err := x.ForkChild()
		if err != nil {
			b.Fatal(err)
		}
		if err := c2.DropStash(like); err != nil {
			b.Fatal(err)
		}
		if err := x.Become(src, like); err != nil {
			b.Fatal(err)
		}
		b.StopTimer()
		c2.Kill()
		x.Kill()
		b.StartTimer()
	}
}

// A batch runs its calls in order, in the process, and stops at the first
// that fails, saying which; one of more than BatchMax calls runs whole.
func TestBatch(t *testing.T) {
	needRoot(t)
	cmd := exec.Command("sleep", "1000")
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		_ = cmd.Process.Kill()
		_ = cmd.Wait()
	})
	s := NewSession()
	defer s.Close()
	p, err := s.Attach(cmd.Process.Pid)
	if err != nil {
		t.Fatal(err)
	}
	page, err := p.Syscall(unix.SYS_MMAP, 0, scratchSize, unix.PROT_READ|unix.PROT_WRITE|unix.PROT_EXEC,
		unix.MAP_PRIVATE|unix.MAP_ANONYMOUS, ^uintptr(0), 0)
	if err != nil {
		t.Fatal(err)
	}
	calls := []Call{{Nr: unix.SYS_GETPID}, {Nr: unix.SYS_GETPPID}, {Nr: unix.SYS_CLOSE, Args: [6]uintptr{1 << 20}}, {Nr: unix.SYS_GETPID}}
	out, err := p.Batch(page, calls)
	var be *BatchError
	if !errors.As(err, &be) || be.Index != 2 || be.Errno != unix.EBADF {
		t.Fatalf("the batch's error: %v, want EBADF at call 2", err)
	}
	if len(out) != 2 || int(out[0]) != cmd.Process.Pid || int(out[1]) != os.Getpid() {
		t.Fatalf("results %v, want [%d %d]", out, cmd.Process.Pid, os.Getpid())
	}
	many := make([]Call, 3*BatchMax+1)
	for i := range many {
		many[i] = Call{Nr: unix.SYS_GETPID}
	}
	out, err = p.Batch(page, many)
	if err != nil || len(out) != len(many) || int(out[len(out)-1]) != cmd.Process.Pid {
		t.Fatalf("%d calls: %d results, %v", len(many), len(out), err)
	}
	if _, err := p.Syscall(unix.SYS_MUNMAP, page, scratchSize); err != nil {
		t.Fatal(err)
	}
	if err := p.Detach(); err != nil {
		t.Fatal(err)
	}
	// It sleeps on, as before.
	if !poll(func() bool { st, err := State(cmd.Process.Pid); return err == nil && st == 'S' }) {
		st, err := State(cmd.Process.Pid)
		t.Fatalf("the process after the batch: state %c, %v", st, err)
	}
}
