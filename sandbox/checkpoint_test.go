package sandbox_test

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/deltagym/deltagym/sandbox"
)

func TestCheckpointRestoreBranches(t *testing.T) {
	b := setup(t)
	s := b.create(t, sandbox.Spec{})
	ctx := t.Context()
	sh(t, s, "echo base > /root/f; mkdir -p /data; echo keep > /data/k; rm /bin/true")
	a, err := s.Checkpoint(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if a.Parent != "" || a.Depth != 1 || s.Head() != a.ID {
		t.Fatalf("first checkpoint %+v head %s", a, s.Head())
	}
	sh(t, s, "echo branch-b > /root/f; rm /data/k; echo new > /data/n")
	bck, err := s.Checkpoint(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if bck.Parent != a.ID {
		t.Fatalf("parent %s, want %s", bck.Parent, a.ID)
	}
	sh(t, s, "echo live > /root/f")
	if err := s.Restore(ctx, a.ID); err != nil {
		t.Fatal(err)
	}
	if out := sh(t, s, "cat /root/f /data/*; ls /bin/true 2>&1 || true"); out != "base\nkeep\nls: /bin/true: No such file or directory\n" {
		t.Fatalf("at a: %q", out)
	}
	sh(t, s, "echo branch-c > /root/f")
	c, err := s.Checkpoint(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if c.Parent != a.ID {
		t.Fatalf("branch c parent %s, want %s", c.Parent, a.ID)
	}
	// Across branches, back and forth.
	for _, step := range []struct{ id, want string }{{bck.ID, "branch-b\nnew\n"}, {c.ID, "branch-c\nkeep\n"}, {bck.ID, "branch-b\nnew\n"}} {
		if err := s.Restore(ctx, step.id); err != nil {
			t.Fatal(err)
		}
		if out := sh(t, s, "cat /root/f /data/*"); out != step.want {
			t.Fatalf("restore %s: %q, want %q", step.id, out, step.want)
		}
	}
	// From another sandbox, and into a fork.
	other := b.create(t, sandbox.Spec{})
	if err := other.Restore(ctx, c.ID); err != nil {
		t.Fatal(err)
	}
	if out := sh(t, other, "cat /root/f"); out != "branch-c\n" {
		t.Fatalf("other sandbox at c: %q", out)
	}
	kids, err := b.rt.Fork(ctx, bck.ID, 3, sandbox.Spec{})
	if err != nil {
		t.Fatal(err)
	}
	for i, k := range kids {
		t.Cleanup(func() { _ = k.Destroy(context.Background()) })
		sh(t, k, "echo kid > /root/mine")
		if out := sh(t, k, "cat /root/f; ls /root"); out != "branch-b\nf\nmine\n" {
			t.Fatalf("fork %d: %q", i, out)
		}
	}
	// Checkpoints outlive the sandbox that made them.
	if err := s.Destroy(ctx); err != nil {
		t.Fatal(err)
	}
	if err := s.Destroy(ctx); err != nil {
		t.Fatalf("second destroy: %v", err)
	}
	if _, err := s.Exec(ctx, sandbox.ExecRequest{Command: "true"}); !errors.Is(err, sandbox.ErrClosed) {
		t.Fatalf("exec on a destroyed sandbox: %v", err)
	}
	if err := other.Restore(ctx, a.ID); err != nil {
		t.Fatal(err)
	}
	if out := sh(t, other, "cat /root/f"); out != "base\n" {
		t.Fatalf("after the maker closed: %q", out)
	}
	// Release, and unknown IDs.
	if err := b.rt.ReleaseCheckpoint(a.ID); err != nil {
		t.Fatal(err)
	}
	if err := other.Restore(ctx, a.ID); !errors.Is(err, sandbox.ErrNotFound) {
		t.Fatalf("restore of a released checkpoint: %v", err)
	}
	if err := b.rt.ReleaseCheckpoint("ck-nope"); !errors.Is(err, sandbox.ErrNotFound) {
		t.Fatalf("release unknown: %v", err)
	}
	if _, err := b.rt.Fork(ctx, "ck-nope", 1, sandbox.Spec{}); !errors.Is(err, sandbox.ErrNotFound) {
		t.Fatalf("fork unknown: %v", err)
	}
	// Children failing alike say so once.
	if _, err := b.rt.Fork(ctx, "ck-nope", 3, sandbox.Spec{}); !errors.Is(err, sandbox.ErrNotFound) ||
		strings.Count(err.Error(), "ck-nope") != 1 || !strings.Contains(err.Error(), "(3 children)") {
		t.Fatalf("fork unknown, 3 children: %v", err)
	}
	// The layers of b still serve the forks and the other checkpoints.
	if out := sh(t, kids[0], "cat /root/f /root/mine"); out != "branch-b\nkid\n" {
		t.Fatalf("fork after release: %q", out)
	}
}

// A background process appending to a file across a checkpoint, through an
// open fd and from a cwd below /, keeps running, its later writes land in
// the live state, and the checkpoint shows the file as it was.
func TestCheckpointWithBackgroundWriters(t *testing.T) {
	b := setup(t)
	s := b.create(t, sandbox.Spec{})
	ctx := t.Context()
	sh(t, s, "mkdir -p /w/sub")
	// Writer 1 holds an fd open on /w/fd.log; writer 2 has cwd /w/sub and
	// appends by relative path.
	for _, cmd := range []string{
		"exec 3>>/w/fd.log; i=0; while true; do i=$((i+1)); echo $i >&3; sleep 0.01; done",
		"cd /w/sub && i=0; while true; do i=$((i+1)); echo $i >> cwd.log; sleep 0.01; done",
	} {
		if _, err := s.Exec(ctx, sandbox.ExecRequest{Command: cmd, Background: true}); err != nil {
			t.Fatal(err)
		}
	}
	sh(t, s, "while [ ! -s /w/fd.log ] || [ ! -s /w/sub/cwd.log ]; do sleep 0.01; done")
	ck, err := s.CheckpointWith(ctx, sandbox.CheckpointOptions{Processes: sandbox.ProcessesNone})
	if err != nil {
		t.Fatal(err)
	}
	// Read the checkpoint's view in a fork, twice, apart in time: it must
	// not change, and the live files must keep growing.
	kid, err := b.rt.Fork(ctx, ck.ID, 1, sandbox.Spec{})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = kid[0].Destroy(context.Background()) })
	snap1 := sh(t, kid[0], "cat /w/fd.log; echo --; cat /w/sub/cwd.log")
	live1 := sh(t, s, "wc -l < /w/fd.log; wc -l < /w/sub/cwd.log")
	sh(t, s, "sleep 0.3")
	live2 := sh(t, s, "wc -l < /w/fd.log; wc -l < /w/sub/cwd.log")
	snap2 := sh(t, kid[0], "cat /w/fd.log; echo --; cat /w/sub/cwd.log")
	if snap1 != snap2 {
		t.Fatalf("the checkpoint changed after it was taken")
	}
	if live1 == live2 {
		t.Fatalf("writers stopped: %q", live1)
	}
	if err := s.Restore(ctx, ck.ID); err != nil {
		t.Fatal(err)
	}
	if got := sh(t, s, "cat /w/fd.log; echo --; cat /w/sub/cwd.log"); got != snap1 {
		t.Fatalf("restored state differs from the checkpoint:\n%q\nvs\n%q", got, snap1)
	}
	// The restore ended the writers.
	if got := sh(t, s, "sleep 0.1; cat /w/fd.log; echo --; cat /w/sub/cwd.log"); got != snap1 {
		t.Fatalf("writers survived the restore")
	}
}

func TestRestoreAbortsExec(t *testing.T) {
	b := setup(t)
	s := b.create(t, sandbox.Spec{})
	ctx := t.Context()
	ck, err := s.Checkpoint(ctx)
	if err != nil {
		t.Fatal(err)
	}
	started := make(chan struct{})
	errc := make(chan error, 1)
	go func() {
		close(started)
		_, err := s.Exec(ctx, sandbox.ExecRequest{Command: "sleep 30"})
		errc <- err
	}()
	<-started
	// Wait until the sleep runs.
	for !strings.Contains(sh(t, s, "ps -o args"), "sleep 30") {
		time.Sleep(10 * time.Millisecond)
	}
	if err := s.Restore(ctx, ck.ID); err != nil {
		t.Fatal(err)
	}
	if err := <-errc; !errors.Is(err, sandbox.ErrAborted) {
		t.Fatalf("exec during restore: %v, want ErrAborted", err)
	}
}

func TestForkIntoAnotherRange(t *testing.T) {
	b := setup(t)
	s := b.create(t, sandbox.Spec{})
	ctx := t.Context()
	sh(t, s, "echo x > /tmp/agent-file; chown 1000:1000 /tmp/agent-file; echo r > /root/root-file")
	ck, err := s.Checkpoint(ctx)
	if err != nil {
		t.Fatal(err)
	}
	kids, err := b.rt.Fork(ctx, ck.ID, 2, sandbox.Spec{})
	if err != nil {
		t.Fatal(err)
	}
	for _, k := range kids {
		t.Cleanup(func() { _ = k.Destroy(context.Background()) })
		out := sh(t, k, "stat -c '%u:%g' /tmp/agent-file /root/root-file /bin/busybox; awk '{print $2}' /proc/self/uid_map")
		lines := strings.Split(strings.TrimSpace(out), "\n")
		if len(lines) != 4 || lines[0] != "1000:1000" || lines[1] != "0:0" || lines[2] != "0:0" {
			t.Fatalf("owners in the fork: %q", out)
		}
		if own := strings.Split(sh(t, s, "awk '{print $2}' /proc/self/uid_map"), "\n")[0]; own == lines[3] {
			t.Fatalf("fork shares the uid range %s of its parent", own)
		}
	}
}

func TestCheckpointBudgetAndDiskLimit(t *testing.T) {
	b := setup(t, func(c *sandbox.Config) { c.CheckpointBudgetBytes = 2 << 20 })
	s := b.create(t, sandbox.Spec{Limits: sandbox.Limits{DiskBytes: 4 << 20}})
	ctx := t.Context()
	res, err := s.Exec(ctx, sandbox.ExecRequest{Command: "dd if=/dev/zero of=/big bs=1M count=10"})
	if err != nil {
		t.Fatal(err)
	}
	if res.ExitCode == 0 || !strings.Contains(string(res.Stderr), "No space left") {
		t.Fatalf("filling the disk: %+v %s", res, res.Stderr)
	}
	if _, err := s.Checkpoint(ctx); !errors.Is(err, sandbox.ErrCap) {
		t.Fatalf("checkpoint over budget: %v", err)
	}
	sh(t, s, "rm /big; echo small > /small")
	if _, err := s.Checkpoint(ctx); err != nil {
		t.Fatalf("checkpoint within budget: %v", err)
	}
	if err := s.WriteFile(ctx, "/huge", make([]byte, 5<<20), 0, false); !errors.Is(err, sandbox.ErrBudget) {
		t.Fatalf("write beyond the disk limit: %v", err)
	}
}

func TestRestartKeepsCheckpoints(t *testing.T) {
	b := setup(t)
	s := b.create(t, sandbox.Spec{})
	ctx := t.Context()
	sh(t, s, "echo survived > /root/f")
	ck, err := s.Checkpoint(ctx)
	if err != nil {
		t.Fatal(err)
	}
	pinned, err := s.CheckpointWith(ctx, sandbox.CheckpointOptions{Pinned: true})
	if err != nil {
		t.Fatal(err)
	}
	live := s.ID()
	// Stop the runtime as a crash would leave it: abandon it without
	// closing, so its sandbox's init dies with its socket.
	if err := b.rt.Close(ctx); err != nil {
		t.Fatal(err)
	}
	rt2, err := sandbox.New(ctx, b.cfg)
	if err != nil {
		t.Fatal(err)
	}
	b.rt = rt2
	if ended := rt2.Ended(); len(ended) != 0 {
		t.Fatalf("a clean close left %v", ended)
	}
	_ = live
	// A pin is its owner's, which did not outlive the runtime: kept, but no longer pinned.
	for _, c := range rt2.ListCheckpoints() {
		if c.ID == pinned.ID && c.Hold.Pinned {
			t.Fatalf("checkpoint %s still pinned after a restart: %+v", c.ID, c.Hold)
		}
	}
	if _, err := rt2.Checkpoint(pinned.ID); err != nil {
		t.Fatalf("a pinned checkpoint after a restart: %v", err)
	}
	k, err := rt2.Fork(ctx, ck.ID, 1, sandbox.Spec{})
	if err != nil {
		t.Fatal(err)
	}
	defer k[0].Destroy(ctx)
	if out := sh(t, k[0], "cat /root/f"); out != "survived\n" {
		t.Fatalf("after restart: %q", out)
	}
}

// Processes a restore ends are gone for the next command: none shows in
// /proc (not even exiting), none holds what it held.
func TestRestoreLeavesNoProcess(t *testing.T) {
	b := setup(t)
	s := b.create(t, sandbox.Spec{})
	ctx := t.Context()
	ck := mustCheckpoint(t, s)
	for round := range 5 {
		for range 20 {
			if _, err := s.Exec(ctx, sandbox.ExecRequest{Command: "while :; do :; done", Background: true}); err != nil {
				t.Fatal(err)
			}
		}
		if err := s.RestoreWith(ctx, ck, sandbox.RestoreOptions{}); err != nil {
			t.Fatal(err)
		}
		out := sh(t, s, "for p in /proc/[0-9]*; do n=${p#/proc/}; [ $n = 1 ] || [ $n = $$ ] || echo $n; done")
		if out != "" {
			t.Fatalf("round %d: processes after the restore: %q", round, out)
		}
	}
}

// TestRootSwappedInWhenNeeded: a restore or checkpoint that leaves nothing
// running keeps the new root out of the init's mount namespace; file actions
// see it all the same, /proc and /dev stay out of their reach, and the first
// command, session or background process swaps it in with every change.
func TestRootSwappedInWhenNeeded(t *testing.T) {
	b := setup(t)
	s := b.create(t, sandbox.Spec{})
	ctx := t.Context()
	// The device of the init's root: each overlay has its own.
	rootDev := func() uint64 {
		t.Helper()
		var st unix.Stat_t
		if err := unix.Stat(fmt.Sprintf("/proc/%d/root/", s.InitPid()), &st); err != nil {
			t.Fatal(err)
		}
		return st.Dev
	}
	read := func(p string) string {
		t.Helper()
		data, _, err := s.ReadFile(ctx, p, 0, 0)
		if err != nil {
			t.Fatalf("read %s: %v", p, err)
		}
		return string(data)
	}
	write := func(p, data string) {
		t.Helper()
		if err := s.WriteFile(ctx, p, []byte(data), 0, false); err != nil {
			t.Fatalf("write %s: %v", p, err)
		}
	}
	sh(t, s, "mkdir /w; echo one > /w/f; ln -s /dev /w/devlink; ln -s /proc/self/status /w/st; ln -s f /w/flink")
	ck := mustCheckpoint(t, s)
	dev := rootDev()
	write("/w/f", "two")
	restore := func() {
		t.Helper()
		if err := s.Restore(ctx, ck); err != nil {
			t.Fatal(err)
		}
		if pending, covered := s.RootCovered(); !pending || covered {
			t.Fatalf("after a restore: root pending %v, covered %v; want pending, not covered", pending, covered)
		}
	}

	restore()
	if got := read("/w/f"); got != "one\n" {
		t.Fatalf("after the restore, file actions read %q", got)
	}
	write("/w/g", "pending\n")
	write("/w/new/dir/h", "made with its parents\n")
	if _, covered := s.RootCovered(); covered {
		t.Fatal("file actions on paths that cannot reach /proc or /dev covered the pending root")
	}
	// Each way into /proc or /dev, on a root not covered yet: the covers go
	// on first, and the action fails as on a swapped-in root.
	intoMounts := []string{"/dev/x", "/proc/x", "/w/devlink/x", "/dev/null", "/w/../proc/x", "w/../../dev/x", "/w/devlink/../w/f", "/proc", "/w/st"}
	probe := func(op, p string) error {
		if op == "write" {
			return s.WriteFile(ctx, p, []byte("x"), 0, false)
		}
		_, _, err := s.ReadFile(ctx, p, 0, 0)
		return err
	}
	for _, p := range intoMounts {
		for _, op := range []string{"write", "read"} {
			restore()
			if err := probe(op, p); !errors.Is(err, sandbox.ErrInvalid) {
				t.Errorf("%s %s before the root is swapped in: %v, want ErrInvalid (as after)", op, p, err)
			}
			if _, covered := s.RootCovered(); !covered {
				t.Errorf("%s %s left the pending root without its covers", op, p)
			}
		}
	}
	// A symbolic link that stays out of them covers too (the probe stops at
	// any link), and resolves as in a live root.
	restore()
	if got := read("/w/flink"); got != "one\n" {
		t.Fatalf("read through a link: %q", got)
	}
	if _, covered := s.RootCovered(); !covered {
		t.Error("a path through a symbolic link did not cover the pending root")
	}
	write("/w/g", "pending\n")
	// A checkpoint of the pending root seals what the file actions wrote.
	ck2 := mustCheckpoint(t, s)
	write("/w/g", "after ck2\n")
	if rootDev() != dev {
		t.Fatal("a restore and a checkpoint with nothing running swapped the root in")
	}

	// A command swaps it in, with what the file actions did.
	if out := sh(t, s, "cat /w/f /w/g; ls /dev/null /proc/self/status; ls /dev /proc | grep -c '^x$' || true"); out != "one\nafter ck2\n/dev/null\n/proc/self/status\n0\n" {
		t.Fatalf("the first command saw %q", out)
	}
	if rootDev() == dev {
		t.Fatal("the command ran in the old root")
	}
	dev = rootDev()
	for _, p := range intoMounts {
		for _, op := range []string{"write", "read"} {
			if err := probe(op, p); !errors.Is(err, sandbox.ErrInvalid) {
				t.Errorf("%s %s in the swapped-in root: %v, want ErrInvalid", op, p, err)
			}
		}
	}

	// A session and a background process swap it in too.
	if err := s.Restore(ctx, ck2); err != nil {
		t.Fatal(err)
	}
	if err := s.WriteFile(ctx, "/bin/bash", []byte("#!/bin/sh\nexec /bin/busybox ash\n"), 0o755, false); err != nil {
		t.Fatal(err)
	}
	res, err := s.Exec(ctx, sandbox.ExecRequest{Session: "main", Command: "cat /w/g"})
	if err != nil || string(res.Stdout) != "pending\n" {
		t.Fatalf("session after a restore: %q %v", res.Stdout, err)
	}
	if rootDev() == dev {
		t.Fatal("the session runs in the old root")
	}
	dev = rootDev()
	if err := s.Restore(ctx, ck2); err != nil {
		t.Fatal(err)
	}
	if _, err := s.Exec(ctx, sandbox.ExecRequest{Command: "echo bg > /w/bg", Background: true}); err != nil {
		t.Fatal(err)
	}
	if rootDev() == dev {
		t.Fatal("the background process runs in the old root")
	}
	for deadline := time.Now().Add(5 * time.Second); ; time.Sleep(10 * time.Millisecond) {
		if data, _, err := s.ReadFile(ctx, "/w/bg", 0, 0); err == nil && string(data) == "bg\n" {
			break
		}
		if time.Now().After(deadline) {
			t.Fatal("the background process's write never showed")
		}
	}

	// Destroyed with a root pending: nothing of it stays (TestNoLeaks
	// counts mounts and layers).
	if err := s.Restore(ctx, ck); err != nil {
		t.Fatal(err)
	}
	write("/w/h", "x")
	if err := s.Destroy(ctx); err != nil {
		t.Fatal(err)
	}
}
