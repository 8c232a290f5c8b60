//go:build linux && amd64

package ptfork

import (
	"bufio"
	"bytes"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"strconv"
	"strings"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/deltagym/deltagym/internal/testenv"
)

// startLines starts cmd, which the test's end kills and waits for, and
// returns a scanner of its output.
func startLines(tb testing.TB, cmd *exec.Cmd) *bufio.Scanner {
	tb.Helper()
	out, err := cmd.StdoutPipe()
	if err != nil {
		tb.Fatal(err)
	}
	if err := cmd.Start(); err != nil {
		tb.Fatal(err)
	}
	tb.Cleanup(func() {
		_ = cmd.Process.Kill()
		_ = cmd.Wait()
	})
	return bufio.NewScanner(out)
}

func needRoot(t testing.TB) {
	t.Helper()
	testenv.Privileged(t, "ptrace of another process needs root (CAP_SYS_PTRACE)")
}

// counterLoop prints a "pid counter" line every 2 ms, each with one write.
const counterLoop = `
import os, time
i = 0
while True:
    i += 1
    os.write(1, b"%d %d\n" % (os.getpid(), i))
    time.sleep(0.002)
`

// counter starts counterLoop in python3; lines receives its lines.
func counter(t testing.TB) (*exec.Cmd, chan [2]int) {
	t.Helper()
	py, err := exec.LookPath("python3")
	if err != nil {
		t.Skip("python3 not on the host")
	}
	cmd := exec.Command(py, "-u", "-c", counterLoop)
	out, err := cmd.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	lines := make(chan [2]int, 1<<16)
	go func() {
		sc := bufio.NewScanner(out)
		for sc.Scan() {
			f := strings.Fields(sc.Text())
			if len(f) != 2 {
				continue
			}
			p, _ := strconv.Atoi(f[0])
			n, _ := strconv.Atoi(f[1])
			lines <- [2]int{p, n}
		}
		close(lines)
	}()
	t.Cleanup(func() {
		_ = cmd.Process.Kill()
		_ = cmd.Wait()
	})
	return cmd, lines
}

// counterToFile starts counterLoop in python3 with its stdout appending to
// a file and returns the file's path. No reader stands between the counter
// and the file: once the counter is stopped, the file holds every line it
// printed (a write to a regular file is done before its writer can stop).
func counterToFile(t testing.TB) (*exec.Cmd, string) {
	t.Helper()
	py, err := exec.LookPath("python3")
	if err != nil {
		t.Skip("python3 not on the host")
	}
	path := filepath.Join(t.TempDir(), "out")
	f, err := os.OpenFile(path, os.O_WRONLY|os.O_CREATE|os.O_APPEND, 0o644)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	cmd := exec.Command(py, "-u", "-c", counterLoop)
	cmd.Stdout = f
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		_ = cmd.Process.Kill()
		_ = cmd.Wait()
	})
	return cmd, path
}

// readLines returns the complete "pid counter" lines of path from byte
// *off on and moves *off past them; a line still being written is left
// for the next call.
func readLines(t testing.TB, path string, off *int64) [][2]int {
	t.Helper()
	b, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	var out [][2]int
	for {
		i := bytes.IndexByte(b[*off:], '\n')
		if i < 0 {
			return out
		}
		f := strings.Fields(string(b[*off : *off+int64(i)]))
		*off += int64(i) + 1
		if len(f) == 2 {
			p, _ := strconv.Atoi(f[0])
			n, _ := strconv.Atoi(f[1])
			out = append(out, [2]int{p, n})
		}
	}
}

// poll calls done every millisecond until it returns true, or 5 s pass.
func poll(done func() bool) bool {
	deadline := time.Now().Add(5 * time.Second)
	for !done() {
		if time.Now().After(deadline) {
			return false
		}
		time.Sleep(time.Millisecond)
	}
	return true
}

func TestForkContinuesFromStop(t *testing.T) {
	needRoot(t)
	cmd, out := counterToFile(t)
	pid := cmd.Process.Pid
	var off int64
	last := 0
	if !poll(func() bool {
		for _, l := range readLines(t, out, &off) {
			last = l[1]
		}
		return last >= 20
	}) {
		t.Fatalf("the counter got to %d, not 20", last)
	}
	s := NewSession()
	p, err := s.Attach(pid)
	if err != nil {
		s.Close()
		t.Fatal(err)
	}
	// Stopped, it prints nothing more: the file's last line is its count.
	for _, l := range readLines(t, out, &off) {
		last = l[1]
	}
	c, nsPid, err := p.Fork()
	if err != nil {
		s.Close()
		t.Fatal(err)
	}
	if nsPid != c.Pid {
		t.Errorf("clone returned %d, the event said %d (same pid namespace)", nsPid, c.Pid)
	}
	copyPid := c.Pid
	if err := s.Close(); err != nil {
		t.Fatal(err)
	}
	defer func() {
		_ = unix.Kill(copyPid, unix.SIGKILL)
		var ws unix.WaitStatus
		_, _ = unix.Wait4(copyPid, &ws, 0, nil) // CLONE_PARENT: we are its parent
	}()
	first := map[int]int{}
	if !poll(func() bool {
		for _, l := range readLines(t, out, &off) {
			if _, ok := first[l[0]]; !ok {
				first[l[0]] = l[1]
			}
		}
		return len(first) >= 2
	}) {
		t.Fatalf("only %v printed after the fork", first)
	}
	if first[pid] != last+1 || first[copyPid] != last+1 {
		t.Fatalf("after stopping at %d: original (%d) went on at %d, copy (%d) at %d: %v", last, pid, first[pid], copyPid, first[copyPid], first)
	}
}

func TestSyscallInCopy(t *testing.T) {
	needRoot(t)
	cmd, lines := counter(t)
	<-lines
	s := NewSession()
	defer s.Close()
	p, err := s.Attach(cmd.Process.Pid)
	if err != nil {
		t.Fatal(err)
	}
	c, _, err := p.Fork()
	if err != nil {
		t.Fatal(err)
	}
	defer c.Kill()
	r, err := c.Syscall(unix.SYS_GETPID)
	if err != nil || int(r) != c.Pid {
		t.Fatalf("getpid in the copy: %d, %v; want %d", r, err, c.Pid)
	}
	if _, err := c.Syscall(unix.SYS_CLOSE, 12345); err != unix.EBADF {
		t.Fatalf("close(12345) in the copy: %v, want EBADF", err)
	}
}

func BenchmarkFork8MB(b *testing.B) {
	needRoot(b)
	cmd, lines := counter(b)
	go func() {
		for range lines {
		}
	}()
	s := NewSession()
	defer s.Close()
	p, err := s.Attach(cmd.Process.Pid)
	if err != nil {
		b.Fatal(err)
	}
	b.ResetTimer()
	for i := 0; i < b.N; i++ {
		c, _, err := p.Fork()
		if err != nil {
			b.Fatal(err)
		}
		c.Kill()
		var ws unix.WaitStatus
		_, _ = unix.Wait4(c.Pid, &ws, 0, nil)
	}
}

// A session runs its tracees on its own CPU while they are attached; each
// gets its own mask back on detach, a copy its parent's, and the tracer's
// thread too.
func TestCPUMaskRestored(t *testing.T) {
	needRoot(t)
	if runtime.NumCPU() < 2 {
		t.Skip("one CPU: nothing to pin")
	}
	cmd, lines := counter(t)
	<-lines
	go func() {
		for range lines {
		}
	}()
	var all unix.CPUSet
	if err := unix.SchedGetaffinity(cmd.Process.Pid, &all); err != nil {
		t.Fatal(err)
	}
	s := NewSession()
	var mine unix.CPUSet
	if err := unix.SchedGetaffinity(0, &mine); err != nil || mine.Count() != 1 {
		s.Close()
		t.Fatalf("tracer's mask during the session: %d CPUs, %v; want 1", mine.Count(), err)
	}
	p, err := s.Attach(cmd.Process.Pid)
	if err != nil {
		s.Close()
		t.Fatal(err)
	}
	c, _, err := p.Fork()
	if err != nil {
		s.Close()
		t.Fatal(err)
	}
	var m unix.CPUSet
	if err := unix.SchedGetaffinity(c.Pid, &m); err != nil || m != mine {
		s.Close()
		t.Fatalf("copy's mask while attached: %v, %v; want the session's CPU", m, err)
	}
	copyPid := c.Pid
	defer func() {
		_ = unix.Kill(copyPid, unix.SIGKILL)
		var ws unix.WaitStatus
		_, _ = unix.Wait4(copyPid, &ws, 0, nil)
	}()
	if err := s.Close(); err != nil {
		t.Fatal(err)
	}
	for _, pid := range []int{cmd.Process.Pid, copyPid} {
		if err := unix.SchedGetaffinity(pid, &m); err != nil || m != all {
			t.Fatalf("mask of %d after detach: %d CPUs, %v; want %d", pid, m.Count(), err, all.Count())
		}
	}
	runtime.LockOSThread()
	defer runtime.UnlockOSThread()
	if err := unix.SchedGetaffinity(0, &m); err != nil || m.Count() != runtime.NumCPU() {
		t.Fatalf("a thread's mask after the session: %d CPUs, %v", m.Count(), err)
	}
}

// A process that moved its vDSO away from where its auxiliary vector says
// still gets system calls injected: the address is found in its maps.
func TestSyscallWithMovedVDSO(t *testing.T) {
	needRoot(t)
	py, err := exec.LookPath("python3")
	if err != nil {
		t.Skip("python3 not on the host")
	}
	// Moves [vdso] with mremap, then sleeps in raw system calls (its
	// libc's cached vDSO entry points are stale now).
	cmd := exec.Command(py, "-c", `
import ctypes, os, sys
libc = ctypes.CDLL(None, use_errno=True)
libc.syscall.restype = ctypes.c_long
for line in open("/proc/self/maps"):
    if line.rstrip().endswith("[vdso]"):
        lo, hi = (int(x, 16) for x in line.split()[0].split("-"))
size = hi - lo
# A free spot: map, then unmap, an anonymous range.
libc.mmap.restype = ctypes.c_void_p
spot = libc.mmap(None, size + (1 << 20), 3, 0x22, -1, 0) + (1 << 20)
libc.munmap(ctypes.c_void_p(spot - (1 << 20)), size + (1 << 20))
MREMAP_MAYMOVE, MREMAP_FIXED = 1, 2
got = libc.syscall(25, ctypes.c_void_p(lo), ctypes.c_size_t(size), ctypes.c_size_t(size), MREMAP_MAYMOVE | MREMAP_FIXED, ctypes.c_void_p(spot))
if got != spot:
    os.write(2, b"mremap failed %d\n" % ctypes.get_errno())
    sys.exit(1)
os.write(1, b"moved\n")
while True:
    libc.syscall(34)  # pause
`)
	cmd.Stderr = os.Stderr
	lines := startLines(t, cmd)
	if !lines.Scan() || lines.Text() != "moved" {
		t.Fatalf("the helper did not move its vDSO: %q %v", lines.Text(), lines.Err())
	}
	pid := cmd.Process.Pid
	if base, ok := auxvVDSO(pid); !ok {
		t.Fatal("no vDSO address in the auxiliary vector")
	} else if lo, _, err := vdsoRange(strconv.Itoa(pid)); err != nil || lo == base {
		t.Fatalf("the vDSO did not move: maps %#x (%v), auxv %#x", lo, err, base)
	}
	s := NewSession()
	defer s.Close()
	p, err := s.Attach(pid)
	if err != nil {
		t.Fatal(err)
	}
	got, err := p.Syscall(unix.SYS_GETPID)
	if err != nil {
		t.Fatal(err)
	}
	if int(got) != pid {
		t.Fatalf("getpid in the process returned %d, want %d", got, pid)
	}
}

// vforkSource vforks. The child prints "child" and, before its exec, waits
// for the file argv[1] to appear; the parent prints "parent" once the
// kernel lets it return from vfork (the child's exec), then waits.
const vforkSource = `#include <stdio.h>
#include <time.h>
#include <unistd.h>

int main(int argc, char **argv) {
	struct timespec ms = {0, 1000000};
	if (argc != 2) return 2;
	if (vfork() == 0) {
		write(1, "child\n", 6);
		while (access(argv[1], F_OK) != 0) nanosleep(&ms, 0);
		execl("/bin/sleep", "sleep", "1000", (char *)0);
		_exit(127);
	}
	write(1, "parent\n", 7);
	for (;;) pause();
}
`

// TestWaitForVforkParent: the parent of a vfork child that has not called
// exec cannot stop. WaitFor gives up with ErrNoStop naming its state,
// SharesParentMemory finds the child, and Close leaves the parent to the
// end of the session's thread, which detaches it: it runs on once the
// child has called exec.
func TestWaitForVforkParent(t *testing.T) {
	needRoot(t)
	dir := t.TempDir()
	bin, gate := buildC(t, dir, "vf", vforkSource), filepath.Join(dir, "go")
	cmd := exec.Command(bin, gate)
	lines := startLines(t, cmd)
	if !lines.Scan() || lines.Text() != "child" {
		t.Fatalf("first line %q, want child", lines.Text())
	}
	parent := cmd.Process.Pid
	child := 0
	kids, err := os.ReadFile("/proc/" + strconv.Itoa(parent) + "/task/" + strconv.Itoa(parent) + "/children")
	if err != nil {
		t.Fatal(err)
	}
	if child, err = strconv.Atoi(strings.TrimSpace(string(kids))); err != nil {
		t.Fatalf("children of the parent: %q", kids)
	}
	if ppid, shared, err := SharesParentMemory(child); err != nil || !shared || ppid != parent {
		t.Fatalf("SharesParentMemory(child) = %d, %v, %v; want %d, true", ppid, shared, err, parent)
	}
	if _, shared, err := SharesParentMemory(parent); err != nil || shared {
		t.Fatalf("SharesParentMemory(parent) = %v, %v; want false", shared, err)
	}

	// The session's goroutine ends with its thread locked to it (Close
	// leaves it so): the kernel detaches the parent then.
	done := make(chan error, 1)
	tid := make(chan int, 1)
	go func() {
		s := NewSession()
		tid <- unix.Gettid()
		p, err := s.Seize(parent)
		if err != nil {
			s.Close()
			done <- err
			return
		}
		werr := p.WaitFor(50 * time.Millisecond)
		if cerr := s.Close(); !errors.Is(cerr, ErrNoStop) {
			werr = fmt.Errorf("close: %v, want ErrNoStop (then wait: %w)", cerr, werr)
		}
		done <- werr
	}()
	if err := <-done; !errors.Is(err, ErrNoStop) || !strings.Contains(err.Error(), "state D") {
		t.Fatalf("WaitFor on the vfork parent: %v, want ErrNoStop in state D", err)
	}
	tracer := <-tid
	if tracer == unix.Getpid() {
		t.Fatal("the session ran on the main thread, which never ends")
	}
	// The parent is detached when the thread ends, its task gone from
	// /proc: only then may the child's exec let the parent run.
	for {
		if _, err := os.Stat("/proc/self/task/" + strconv.Itoa(tracer)); err != nil {
			break
		}
		runtime.Gosched()
	}
	if err := os.WriteFile(gate, nil, 0o644); err != nil {
		t.Fatal(err)
	}
	if !lines.Scan() || lines.Text() != "parent" {
		t.Fatalf("after the exec: %q, %v; want parent", lines.Text(), lines.Err())
	}
}

// BenchmarkSharesParentMemory: the look a checkpoint takes at each process
// it has not seen before.
func BenchmarkSharesParentMemory(b *testing.B) {
	needRoot(b)
	pid := os.Getpid()
	for b.Loop() {
		if _, shared, err := SharesParentMemory(pid); err != nil || shared {
			b.Fatal(shared, err)
		}
	}
}

// buildC compiles C source src into dir/name with $CC (cc if unset), as
// make init builds dg-init, and returns the binary's path.
func buildC(t testing.TB, dir, name, src string, flags ...string) string {
	t.Helper()
	cc := os.Getenv("CC")
	if cc == "" {
		cc = "cc"
	}
	path, bin := filepath.Join(dir, name+".c"), filepath.Join(dir, name)
	if err := os.WriteFile(path, []byte(src), 0o644); err != nil {
		t.Fatal(err)
	}
	args := append([]string{"-O2", "-Wall", "-o", bin, path}, flags...)
	if out, err := exec.Command(cc, args...).CombinedOutput(); err != nil {
		t.Fatalf("building %s with %s: %v\n%s", name, cc, err, out)
	}
	return bin
}

// A tracee killed while stopped (an OOM kill during a checkpoint) is
// waited for by its tracer at Detach: else it stays a zombie its parent
// cannot reap for as long as the tracer's thread lives (and a sandbox's
// init, waiting for it, cannot end).
func TestDetachKilled(t *testing.T) {
	needRoot(t)
	// The shell is the parent; the test process only traces its child.
	cmd := exec.Command("sh", "-c", "sleep 100 & echo $!; wait $!; echo reaped")
	lines := startLines(t, cmd)
	if !lines.Scan() {
		t.Fatal("no pid from the shell")
	}
	pid, err := strconv.Atoi(lines.Text())
	if err != nil {
		t.Fatal(err)
	}
	s := NewSession()
	defer s.Close()
	p, err := s.Attach(pid)
	if err != nil {
		t.Fatal(err)
	}
	if err := unix.Kill(pid, unix.SIGKILL); err != nil {
		t.Fatal(err)
	}
	if err := p.Detach(); err != nil {
		t.Fatalf("detaching a tracee killed in its stop: %v", err)
	}
	// The shell reaps it: no traced zombie is left (a zombie would hold
	// the shell's wait for ever: bounded here).
	reaped := make(chan string, 1)
	go func() {
		lines.Scan()
		reaped <- lines.Text()
	}()
	select {
	case got := <-reaped:
		if got != "reaped" {
			t.Fatalf("the shell printed %q, not that it reaped its killed child", got)
		}
	case <-time.After(30 * time.Second):
		t.Fatal("the shell has not reaped its child, killed in its stop and detached, after 30 s")
	}
}
