package sandbox_test

import (
	"errors"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/deltagym/deltagym/sandbox"
)

// vfSource vforks. The child, before its exec, marks /tmp/child and waits
// for /tmp/go to appear, then runs sleep; the parent, once the kernel lets
// it return from vfork (the child's exec), marks /tmp/parent and waits.
const vfSource = `#include <fcntl.h>
#include <time.h>
#include <unistd.h>

static void mark(const char *path) { close(open(path, O_CREAT | O_WRONLY, 0644)); }

int main(void) {
	struct timespec ms = {0, 1000000};
	if (vfork() == 0) {
		mark("/tmp/child");
		while (access("/tmp/go", F_OK) != 0) nanosleep(&ms, 0);
		execl("/bin/sleep", "sleep", "1000", (char *)0);
		_exit(127);
	}
	mark("/tmp/parent");
	for (;;) pause();
}
`

// TestCheckpointDuringVfork: a checkpoint taken while a child of vfork has
// not called exec leaves the child and its parent (which the kernel holds
// until that exec, out of reach of a ptrace stop) to run. If the exec does
// not come within the bound, the checkpoint fails with ErrProcesses naming
// them and leaves both running; once it has come, the checkpoint takes
// both processes.
func TestCheckpointDuringVfork(t *testing.T) {
	b := setup(t)
	bin := buildStaticC(t, "vf", vfSource)
	data, err := os.ReadFile(bin)
	if err != nil {
		t.Fatal(err)
	}
	if err := os.MkdirAll(filepath.Join(b.root, "usr/local/bin"), 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(b.root, "usr/local/bin/vf"), data, 0o755); err != nil {
		t.Fatal(err)
	}
	if _, err := b.rt.ImportImage(t.Context(), "vfork", b.root); err != nil {
		t.Fatal(err)
	}
	b.rt.SetStopWait(200 * time.Millisecond)
	s := b.create(t, sandbox.Spec{Image: "vfork"})
	ctx := t.Context()
	if _, err := s.Exec(ctx, sandbox.ExecRequest{Argv: []string{"/usr/local/bin/vf"}, Background: true}); err != nil {
		t.Fatal(err)
	}
	waitFor(t, s, "[ -e /tmp/child ]")

	_, err = s.Checkpoint(ctx)
	if !errors.Is(err, sandbox.ErrProcesses) || !strings.Contains(err.Error(), "vfork") {
		t.Fatalf("checkpoint while the vfork child waits: %v, want ErrProcesses naming the vfork", err)
	}
	// Neither was left stopped: the child goes on to its exec, and the
	// parent returns from vfork.
	sh(t, s, "touch /tmp/go")
	waitFor(t, s, "[ -e /tmp/parent ]")
	waitFor(t, s, running("sleep"))

	ck, err := s.Checkpoint(ctx)
	if err != nil {
		t.Fatal(err)
	}
	var cmds []string
	for _, p := range ck.Processes {
		cmds = append(cmds, p.Command)
	}
	if len(cmds) != 2 || !strings.Contains(strings.Join(cmds, " "), "vf") || !strings.Contains(strings.Join(cmds, " "), "sleep") {
		t.Fatalf("captured %q, want vf and sleep", cmds)
	}
	// The tree's template (its child's, which holds the parent's memory
	// too: procstate/tree.go) is listed beside it, and refuses the signal.
	sh(t, s, "for p in $(grep -lx -e sleep -e vf /proc/[0-9]*/comm | cut -d/ -f3); do kill -9 $p 2>/dev/null; done; true")
	waitFor(t, s, count("sleep", 1)+" && "+count("vf", 0))
	if err := s.Restore(ctx, ck.ID); err != nil {
		t.Fatal(err)
	}
	waitFor(t, s, count("sleep", 2)+" && "+count("vf", 1))
}

// count is a shell condition: n processes are named name.
func count(name string, n int) string {
	return "[ $(grep -lx " + name + " /proc/[0-9]*/comm | wc -l) = " + strconv.Itoa(n) + " ]"
}

// running is a shell condition: a process named name runs (busybox has no
// pgrep).
func running(name string) string {
	return "grep -qx " + name + " /proc/[0-9]*/comm"
}
