//go:build linux && amd64

package ptfork

import (
	"bufio"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"golang.org/x/sys/unix"
)

// attackSource is a parent with one child, each prepared in one way a
// hostile command may (argv[1]):
//
//   - subreaper: the child is a child subreaper;
//   - dontfork: the child holds 1 MiB it wrote, marked MADV_DONTFORK;
//   - seccomp: the parent and the child each stack one seccomp filter of
//     their own, after the fork (so both have as many filters), the
//     parent's refusing getcwd, the child's getppid;
//   - nowait: the child's own seccomp filter refuses wait4;
//   - vdso: the child marks its vDSO MADV_DONTFORK;
//   - novvar: the child unmaps its vvar pages.
//
// At SIGUSR1 a process says whether getcwd is allowed; at SIGUSR2 it says
// the first byte of its region (dontfork).
const attackSource = `#define _GNU_SOURCE
#include <errno.h>
#include <linux/filter.h>
#include <linux/seccomp.h>
#include <signal.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/prctl.h>
#include <sys/syscall.h>
#include <unistd.h>

static int deny(int nr) {
	struct sock_filter f[] = {
		BPF_STMT(BPF_LD | BPF_W | BPF_ABS, offsetof(struct seccomp_data, nr)),
		BPF_JUMP(BPF_JMP | BPF_JEQ | BPF_K, nr, 0, 1),
		BPF_STMT(BPF_RET | BPF_K, SECCOMP_RET_ERRNO | EPERM),
		BPF_STMT(BPF_RET | BPF_K, SECCOMP_RET_ALLOW),
	};
	struct sock_fprog p = {4, f};
	return prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, &p);
}

static volatile unsigned char *region;

static void on_usr1(int s) {
	(void)s;
	char b[256], m[64];
	long r = syscall(SYS_getcwd, b, sizeof b);
	int n = snprintf(m, sizeof m, "getcwd %s %d\n", r < 0 ? "denied" : "allowed", (int)syscall(SYS_getpid));
	write(1, m, n);
}

static void on_usr2(int s) {
	(void)s;
	char m[64];
	int n = snprintf(m, sizeof m, "region %d\n", region[0]);
	write(1, m, n);
}

int main(int argc, char **argv) {
	(void)argc;
	setvbuf(stdout, NULL, _IONBF, 0);
	const char *mode = argv[1];
	prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0);
	struct sigaction sa = {0};
	sa.sa_handler = on_usr1;
	sa.sa_flags = SA_RESTART;
	sigaction(SIGUSR1, &sa, NULL);
	sa.sa_handler = on_usr2;
	sigaction(SIGUSR2, &sa, NULL);
	pid_t c = fork();
	if (c == 0) {
		if (!strcmp(mode, "subreaper")) prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0);
		if (!strcmp(mode, "dontfork")) {
			region = mmap(NULL, 1 << 20, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
			memset((void *)region, 7, 1 << 20);
			madvise((void *)region, 1 << 20, MADV_DONTFORK);
		}
		if (!strcmp(mode, "seccomp") && deny(SYS_getppid) < 0) return 2;
		if (!strcmp(mode, "nowait") && deny(SYS_wait4) < 0) return 2;
		if (!strcmp(mode, "novvar")) {
			FILE *f = fopen("/proc/self/maps", "r");
			char line[512];
			while (fgets(line, sizeof line, f)) {
				unsigned long lo, hi;
				if (strstr(line, "[vvar") && sscanf(line, "%lx-%lx", &lo, &hi) == 2 && munmap((void *)lo, hi - lo) < 0)
					return 3;
			}
			fclose(f);
		}
		if (!strcmp(mode, "vdso")) {
			FILE *f = fopen("/proc/self/maps", "r");
			char line[512];
			while (fgets(line, sizeof line, f)) {
				unsigned long lo, hi;
				if (strstr(line, "[vdso]") && sscanf(line, "%lx-%lx", &lo, &hi) == 2 &&
				    madvise((void *)lo, hi - lo, MADV_DONTFORK) < 0)
					return 3;
			}
			fclose(f);
		}
		printf("child %d\n", getpid());
		for (;;) pause();
	}
	if (!strcmp(mode, "seccomp") && deny(SYS_getcwd) < 0) return 2;
	printf("parent %d child %d\n", getpid(), c);
	for (;;) pause();
}
`

// attackTree starts attackSource in mode and returns the parent's and the
// child's pids and the lines they print.
func attackTree(t *testing.T, mode string) (parent, child int, lines *bufio.Scanner) {
	t.Helper()
	bin := buildC(t, t.TempDir(), "attack", attackSource)
	cmd := exec.Command(bin, mode)
	cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true} // killed as a group
	out, err := cmd.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		_ = unix.Kill(-cmd.Process.Pid, unix.SIGKILL)
		_ = cmd.Process.Kill()
		_ = cmd.Wait()
	})
	lines = bufio.NewScanner(out)
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
	return parent, child, lines
}

// A child that is a child subreaper adopts its own ForkOrphan copy: the
// copy (a tree's template) is then part of the tree, which a later dump of
// the tree meets.
func TestAttackForkOrphanSubreaper(t *testing.T) {
	needRoot(t)
	_, child, _ := attackTree(t, "subreaper")
	s := NewSession()
	defer s.Close()
	cp, err := s.Attach(child)
	if err != nil {
		t.Fatal(err)
	}
	if o, _, err := cp.ForkOrphan(); !errors.Is(err, ErrBecome) {
		if o != nil {
			o.Kill()
		}
		t.Fatalf("ForkOrphan of a subreaper: %v, want ErrBecome", err)
	}
	if kids, err := os.ReadFile(fmt.Sprintf("/proc/%d/task/%d/children", child, child)); err != nil || len(kids) != 0 {
		t.Errorf("the child has children %q (%v) after a refused ForkOrphan", kids, err)
	}
}

// A child's MADV_DONTFORK mapping is not in its ForkOrphan copy (a tree's
// template), nor in the copies made of it: the child's copy would lack
// memory the child has, and fault where the child reads it. ForkOrphan
// refuses such a copy (ErrPartial: the caller marks the memory to be
// copied and forks again).
func TestAttackForkOrphanDontFork(t *testing.T) {
	needRoot(t)
	_, child, _ := attackTree(t, "dontfork")
	s := NewSession()
	defer s.Close()
	cp, err := s.Attach(child)
	if err != nil {
		t.Fatal(err)
	}
	if o, _, err := cp.ForkOrphan(); !errors.Is(err, ErrBecome) || !errors.Is(err, ErrPartial) {
		if o != nil {
			o.Kill()
		}
		t.Fatalf("ForkOrphan of a process with MADV_DONTFORK memory: %v, want ErrPartial", err)
	}
}

// Become checks that the two processes have as many seccomp filters, not
// the same ones: a parent and a child that each stacked a filter of their
// own after the fork pass, and the parent's copy has the child's filter
// instead of the parent's (getcwd, which the parent's refuses, is
// allowed in the copy).
func TestAttackBecomeOtherSeccompFilter(t *testing.T) {
	needRoot(t)
	parent, child, _ := attackTree(t, "seccomp")
	st, err := procStatus(parent)
	if err != nil {
		t.Fatal(err)
	}
	sc, err := procStatus(child)
	if err != nil {
		t.Fatal(err)
	}
	t.Logf("filters: parent %s, child %s", st["Seccomp_filters"], sc["Seccomp_filters"])
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
	x, _, err := cp.Fork()
	if err != nil {
		t.Fatal(err)
	}
	c2, _, err := x.ForkChild()
	if err != nil {
		t.Fatal(err)
	}
	src, err := sp.ReadSource()
	if err != nil {
		t.Fatal(err)
	}
	err = x.Become(src, nil)
	c2.Kill()
	x.Kill()
	if !errors.Is(err, ErrBecome) {
		t.Fatalf("Become of a parent whose seccomp filter differs from the child's: %v, want ErrBecome", err)
	}
}

// it never returns (the server spins in the checkpoint).
func TestAttackForkOrphanVdsoDontFork(t *testing.T) {
	needRoot(t)
	parent, child, _ := attackTree(t, "vdso")
	done := make(chan error, 1)
	go func() {
		// A session's calls come from its own thread.
		s := NewSession()
		defer s.Close()
		cp, err := s.Attach(child)
		if err != nil {
			done <- err
			return
		}
		o, _, err := cp.ForkOrphan()
		if err == nil {
			o.Kill()
		}
		done <- err
	}()
	select {
	case err := <-done:
		t.Logf("ForkOrphan returned: %v", err)
	case <-time.After(10 * time.Second):
		// Ends the spin: the middle child dies with its process group.
		_ = unix.Kill(-parent, unix.SIGKILL)
		t.Errorf("ForkOrphan has not returned after 10 s (it steps a faulting instruction over and over); after the child's kill: %v", <-done)
	}
}

// patchedVdsoSource makes its vDSO writable and turns every syscall
// instruction in it (0f 05) into ud2 (0f 0b), then waits.
const patchedVdsoSource = `#define _GNU_SOURCE
#include <stdio.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

int main(void) {
	setvbuf(stdout, NULL, _IONBF, 0);
	FILE *f = fopen("/proc/self/maps", "r");
	char line[512];
	unsigned long lo = 0, hi = 0;
	while (fgets(line, sizeof line, f))
		if (strstr(line, "[vdso]")) sscanf(line, "%lx-%lx", &lo, &hi);
	fclose(f);
	if (!lo || mprotect((void *)lo, hi - lo, PROT_READ | PROT_WRITE | PROT_EXEC) < 0) return 2;
	int n = 0;
	for (unsigned char *p = (unsigned char *)lo; p + 1 < (unsigned char *)hi; p++)
		if (p[0] == 0x0f && p[1] == 0x05) { p[1] = 0x0b; n++; }
	printf("patched %d\n", n);
	for (;;) pause();
}
`

// A process may rewrite its own vDSO (it is mapped with VM_MAYWRITE, for
// debuggers): Syscall injects at the vDSO's syscall instruction, now a
// ud2, and steps it again at every SIGILL, never returning. Every
// checkpoint's first injection into a live process (a template's clone)
// goes through it.
func TestAttackSyscallPatchedVdso(t *testing.T) {
	needRoot(t)
	bin := buildC(t, t.TempDir(), "vdso", patchedVdsoSource)
	cmd := exec.Command(bin)
	cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true}
	lines := startLines(t, cmd)
	if !lines.Scan() {
		t.Fatalf("no line: %v", lines.Err())
	}
	t.Log(lines.Text())
	done := make(chan error, 1)
	go func() {
		// A session's calls come from its own thread.
		s := NewSession()
		defer s.Close()
		p, err := s.Attach(cmd.Process.Pid)
		if err != nil {
			done <- err
			return
		}
		_, err = p.Syscall(unix.SYS_GETPID)
		done <- err
	}()
	select {
	case err := <-done:
		t.Logf("Syscall returned: %v", err)
	case <-time.After(10 * time.Second):
		_ = unix.Kill(-cmd.Process.Pid, unix.SIGKILL)
		t.Errorf("Syscall has not returned after 10 s (it steps a faulting instruction over and over); after the process's kill: %v", <-done)
	}
}

// Become checks that each special mapping of the copy is the process's
// too, not the other way round: a child that unmapped its vvar pages makes
// copies of its parent without them (the parent's vDSO then reads unmapped
// memory).
func TestAttackBecomeChildWithoutVvar(t *testing.T) {
	needRoot(t)
	parent, child, _ := attackTree(t, "novvar")
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
	x, _, err := cp.Fork()
	if err != nil {
		t.Fatal(err)
	}
	defer x.Kill()
	src, err := sp.ReadSource()
	if err != nil {
		t.Fatal(err)
	}
	if err := x.Become(src, nil); err != nil {
		t.Logf("Become refuses: %v", err)
		return
	}
	specials := func(pid int) []string {
		maps, err := readMaps(pid)
		if err != nil {
			t.Fatal(err)
		}
		var out []string
		for _, v := range maps {
			if v.special() {
				out = append(out, fmt.Sprintf("%x-%x %s", v.start, v.end, v.path))
			}
		}
		return out
	}
	if a, b := specials(x.Pid), specials(parent); strings.Join(a, ",") != strings.Join(b, ",") {
		t.Errorf("the copy's special mappings %v, the parent's %v", a, b)
	}
}
