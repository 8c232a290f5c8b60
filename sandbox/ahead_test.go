package sandbox_test

import (
	"bytes"
	"context"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/deltagym/deltagym/sandbox"
	"golang.org/x/sys/unix"
)

// After a checkpoint with processes is restored twice in a row, copies of
// its templates are forked ahead, frozen in a group of their own (not after
// its first restore); the next restore of it
// runs those copies (their pids become the live ones), which bring back the
// checkpoint's memory, cwd, environment and open files as fresh copies do.
// A copy forked ahead that is killed or signalled before it is used is
// replaced by a fresh copy; a restore of another checkpoint, the checkpoint's release and
// the sandbox's end drop the copies.
func TestForkAhead(t *testing.T) {
	b := setup(t)
	b.rt.ForkAheadAlways()
	s := b.create(t, sandbox.Spec{Image: defaultImage(t, b)})
	ctx := t.Context()
	filesOnly, err := s.CheckpointWith(ctx, sandbox.CheckpointOptions{Processes: sandbox.ProcessesNone})
	if err != nil {
		t.Fatal(err)
	}
	startCounter(t, s)
	inSession(t, s, "mkdir -p /work/a && cd /work/a && export FOO=one")
	for i := 1; i <= 5; i++ {
		inc(t, s, i)
	}
	ck, err := s.Checkpoint(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if len(ck.Processes) != 2 {
		t.Fatalf("captured %+v", ck.Processes)
	}
	if pids := s.AheadPids(ck.ID); pids != nil {
		t.Fatalf("copies forked ahead before any restore: %v", pids)
	}
	inc(t, s, 6)
	inSession(t, s, "cd / && export FOO=two")
	check := func(round string) {
		t.Helper()
		if got := sh(t, s, "cat /tmp/count"); got != "5" {
			t.Fatalf("%s: count file after restore %q", round, got)
		}
		inc(t, s, 6) // the process's memory is the checkpoint's
		inc(t, s, 7)
		if got := inSession(t, s, "echo $FOO; pwd"); got != "one\n/work/a\n" {
			t.Fatalf("%s: session after restore: %q", round, got)
		}
		inSession(t, s, "cd / && export FOO=three")
	}
	if err := s.Restore(ctx, ck.ID); err != nil {
		t.Fatal(err)
	}
	check("first restore")
	if pids := s.AheadPids(ck.ID); pids != nil {
		t.Fatalf("copies forked ahead after a first restore: %v", pids)
	}
	if err := s.Restore(ctx, ck.ID); err != nil {
		t.Fatal(err)
	}
	check("second restore")
	ahead := s.AheadPids(ck.ID)
	for round := range 3 {
		name := fmt.Sprintf("restore %d", round)
		if len(ahead) != 2 {
			t.Fatalf("%s: %d copies forked ahead, want 2", name, len(ahead))
		}
		for _, pid := range ahead {
			aheadFrozen(t, pid)
			// Both processes led a session of their own, and so do their
			// copies from the start (the job makes it, not the restore).
			if sid := sessionOf(t, pid); sid != pid {
				t.Fatalf("%s: copy %d forked ahead is in session %d, want its own", name, pid, sid)
			}
		}
		if err := s.Restore(ctx, ck.ID); err != nil {
			t.Fatal(err)
		}
		live := livePid(t, b, s.ID())
		if !slices.Contains(ahead, live) {
			t.Fatalf("%s: the live process is pid %d, not one of the copies forked ahead %v", name, live, ahead)
		}
		if sid := sessionOf(t, live); sid != live {
			t.Fatalf("%s: the live process %d is in session %d, want its own", name, live, sid)
		}
		check(name)
		next := s.AheadPids(ck.ID)
		if len(next) != 2 || slices.Contains(next, ahead[0]) || slices.Contains(next, ahead[1]) {
			t.Fatalf("%s: copies forked ahead next: %v (used: %v)", name, next, ahead)
		}
		ahead = next
	}

	// Killed before use (parked copies, unlike templates, are within a
	// command's reach; here from outside): the restore forks a fresh copy.
	for _, pid := range ahead {
		if err := unix.Kill(pid, unix.SIGKILL); err != nil {
			t.Fatal(err)
		}
	}
	waitAllGone(t, ahead)
	if err := s.Restore(ctx, ck.ID); err != nil {
		t.Fatal(err)
	}
	if live := livePid(t, b, s.ID()); slices.Contains(ahead, live) {
		t.Fatalf("the live process is pid %d, a killed copy", live)
	}
	check("restore after the copies forked ahead were killed")
	ahead = s.AheadPids(ck.ID)
	if len(ahead) != 2 {
		t.Fatalf("%d copies forked ahead after a fallback, want 2", len(ahead))
	}

	// Signalled before use (an agent's kill -STOP reaches them as it
	// reaches the templates; a signal whose default is to terminate, such
	// as SIGTERM, kills them, frozen or not): a fresh copy has no signal
	// pending, so the restore forks fresh copies.
	for _, pid := range ahead {
		if err := unix.Kill(pid, unix.SIGSTOP); err != nil {
			t.Fatal(err)
		}
	}
	if err := s.Restore(ctx, ck.ID); err != nil {
		t.Fatal(err)
	}
	if live := livePid(t, b, s.ID()); slices.Contains(ahead, live) {
		t.Fatalf("the live process is pid %d, a copy signalled before the restore", live)
	}
	waitAllGone(t, ahead)
	check("restore after the copies forked ahead were signalled")
	ahead = s.AheadPids(ck.ID)
	if len(ahead) != 2 {
		t.Fatalf("%d copies forked ahead after a fallback, want 2", len(ahead))
	}

	// Another checkpoint's restore drops them.
	if err := s.Restore(ctx, filesOnly.ID); err != nil {
		t.Fatal(err)
	}
	waitAllGone(t, ahead)
	if got := s.AheadPids(ck.ID); got != nil {
		t.Fatalf("copies forked ahead kept after another checkpoint's restore: %v", got)
	}
	if got := sh(t, s, countCounters); got != "1\n" { // the template
		t.Fatalf("%q counter processes after restoring a checkpoint without them", got)
	}

	// So does the checkpoint's release, the live copy going on. (Restores
	// back to back fork no copies ahead: the checks are a step between.)
	for range 2 {
		if err := s.Restore(ctx, ck.ID); err != nil {
			t.Fatal(err)
		}
		check("restoring again")
	}
	ahead = s.AheadPids(ck.ID)
	if len(ahead) != 2 {
		t.Fatalf("%d copies forked ahead, want 2", len(ahead))
	}
	if err := b.rt.ReleaseCheckpoint(ck.ID); err != nil {
		t.Fatal(err)
	}
	waitAllGone(t, ahead)
	inc(t, s, 8)

	// And the sandbox's end.
	ck2, err := s.Checkpoint(ctx)
	if err != nil {
		t.Fatal(err)
	}
	for range 2 {
		if err := s.Restore(ctx, ck2.ID); err != nil {
			t.Fatal(err)
		}
		inc(t, s, 9)
	}
	ahead = s.AheadPids(ck2.ID)
	if len(ahead) != 2 {
		t.Fatalf("%d copies forked ahead, want 2", len(ahead))
	}
	if err := s.Destroy(ctx); err != nil {
		t.Fatal(err)
	}
	waitAllGone(t, ahead)
}

// Under a ForkAtRestore runtime no copies are forked ahead: each restore
// forks its copies.
func TestForkAtRestore(t *testing.T) {
	b := setup(t, func(c *sandbox.Config) { c.ForkAtRestore = true })
	s, ck := counterCheckpoint(t, b)
	ctx := t.Context()
	for range 2 {
		if err := s.Restore(ctx, ck.ID); err != nil {
			t.Fatal(err)
		}
		if got := s.AheadPids(ck.ID); got != nil {
			t.Fatalf("copies forked ahead under ForkAtRestore: %v", got)
		}
		inc(t, s, 2)
	}
}

// Restores that come back to back (sooner after the last than its job
// took) fork their own copies and start no job; with a step between again,
// copies are forked ahead again.
func TestForkAheadBackToBack(t *testing.T) {
	b := setup(t)
	s, ck := counterCheckpoint(t, b)
	ctx := t.Context()
	restore := func(step bool) {
		t.Helper()
		if err := s.Restore(ctx, ck.ID); err != nil {
			t.Fatal(err)
		}
		if step {
			inc(t, s, 2)
		}
	}
	restore(true)
	restore(true) // restored twice in a row: a job starts
	if n := len(s.AheadPids(ck.ID)); n != 1 {
		t.Fatalf("%d copies forked ahead, want 1", n)
	}
	restore(false) // uses them
	// Whether the restores come back to back is judged against how long
	// the last job took, which a busy machine stretches (a job slower than
	// the step) or a stall between the test's calls can beat: the test
	// sets it, to 100 ms, then 1 ms against a step of a few.
	s.AheadPids(ck.ID)
	s.SetAheadTook(100 * time.Millisecond)
	restore(false) // back to back
	if got := s.AheadPids(ck.ID); got != nil {
		t.Fatalf("copies forked ahead after restores back to back: %v", got)
	}
	inc(t, s, 2)
	s.SetAheadTook(time.Millisecond)
	restore(true)
	if n := len(s.AheadPids(ck.ID)); n != 1 {
		t.Fatalf("%d copies forked ahead with steps between restores again, want 1", n)
	}
}

// A sandbox frozen right after a restore, while its job forks copies ahead,
// is destroyed, its templates saved as CRIU images first (a template forks
// the copy that is saved, so it must be able to run): a Freeze waits for the
// job (frozen mid-fork, it would hold the templates), and Destroy ends what
// a frozen sandbox runs and thaws it before it saves the templates.
func TestForkAheadFreeze(t *testing.T) {
	needCRIU(t)
	b := setup(t)
	b.rt.ForkAheadAlways()
	s, ck := counterCheckpoint(t, b)
	ctx := t.Context()
	for range 2 {
		if err := s.Restore(ctx, ck.ID); err != nil {
			t.Fatal(err)
		}
	}
	// The job runs right after the restore: freeze at once.
	if err := s.Freeze(); err != nil {
		t.Fatal(err)
	}
	done := make(chan error, 1)
	go func() { done <- s.Destroy(context.Background()) }()
	select {
	case err := <-done:
		if err != nil {
			t.Fatal(err)
		}
	case <-time.After(20 * time.Second):
		t.Fatal("Destroy of a sandbox frozen right after a restore did not return in 20 s")
	}
	info, err := b.rt.Checkpoint(ck.ID)
	if err != nil {
		t.Fatal(err)
	}
	if len(info.Processes) != 1 {
		t.Fatalf("the checkpoint lists %+v after its sandbox's end", info.Processes)
	}
	other := b.create(t, sandbox.Spec{Image: s.Image()})
	if err := other.Restore(ctx, ck.ID); err != nil {
		t.Fatal(err)
	}
	if got := sh(t, other, "cat /tmp/count"); got != "1" {
		t.Fatalf("count file in another sandbox %q", got)
	}
	inc(t, other, 2)
}

// aheadFrozen fails unless pid is in a frozen group whose name is that of
// copies forked ahead (p<n>).
func aheadFrozen(t *testing.T, pid int) {
	t.Helper()
	raw, err := os.ReadFile(fmt.Sprintf("/proc/%d/cgroup", pid))
	if err != nil {
		t.Fatalf("copy forked ahead, pid %d: %v", pid, err)
	}
	for line := range strings.Lines(string(raw)) {
		line = strings.TrimSpace(line)
		var dir, file, want string
		if _, p, ok := strings.Cut(line, "::"); ok {
			dir, file, want = filepath.Join("/sys/fs/cgroup", p), "cgroup.freeze", "1"
			if _, err := os.Stat(filepath.Join(dir, file)); err != nil {
				dir = filepath.Join("/sys/fs/cgroup/unified", p)
			}
		} else if _, p, ok := strings.Cut(line, ":freezer:"); ok {
			dir, file, want = filepath.Join("/sys/fs/cgroup/freezer", p), "freezer.state", "FROZEN"
		} else {
			continue
		}
		name := filepath.Base(dir)
		if name[0] != 'p' {
			continue
		}
		got, err := os.ReadFile(filepath.Join(dir, file))
		if err != nil {
			continue
		}
		if strings.TrimSpace(string(got)) != want {
			t.Fatalf("copy forked ahead, pid %d: group %s is not frozen (%s: %q)", pid, dir, file, got)
		}
		return
	}
	t.Fatalf("copy forked ahead, pid %d, is in no frozen group p<n>:\n%s", pid, raw)
}

func waitAllGone(t *testing.T, pids []int) {
	t.Helper()
	for _, pid := range pids {
		waitGone(t, pid, "a copy forked ahead")
	}
}

// No copies are forked ahead when they would bring the sandbox within a
// quarter of its pids limit: a counter and three sleeps, restored twice,
// hold 9 pids (the init, 4 templates, 4 copies); 4 more are 13, over three
// quarters of 16 but not of 64.
func TestForkAheadPidsLimit(t *testing.T) {
	for _, tc := range []struct {
		pids  int64
		ahead int
	}{{16, 0}, {64, 4}} {
		t.Run(fmt.Sprintf("pids=%d", tc.pids), func(t *testing.T) {
			b := setup(t)
			b.rt.ForkAheadAlways()
			s := b.create(t, sandbox.Spec{Image: defaultImage(t, b), Limits: sandbox.Limits{Pids: tc.pids}})
			ctx := t.Context()
			startCounter(t, s)
			for range 3 {
				if _, err := s.Exec(ctx, sandbox.ExecRequest{Argv: []string{"sleep", "1000"}, Background: true}); err != nil {
					t.Fatal(err)
				}
			}
			inc(t, s, 1)
			ck, err := s.Checkpoint(ctx)
			if err != nil {
				t.Fatal(err)
			}
			if len(ck.Processes) != 4 {
				t.Fatalf("captured %+v", ck.Processes)
			}
			for range 2 {
				if err := s.Restore(ctx, ck.ID); err != nil {
					t.Fatal(err)
				}
				inc(t, s, 2)
			}
			if got := len(s.AheadPids(ck.ID)); got != tc.ahead {
				t.Fatalf("%d copies forked ahead under a pids limit of %d, want %d", got, tc.pids, tc.ahead)
			}
		})
	}
}

// sessionOf returns the session of host pid (as the host sees it).
func sessionOf(t *testing.T, pid int) int {
	t.Helper()
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid))
	if err != nil {
		t.Fatal(err)
	}
	// pid (comm) state ppid pgrp session …; comm may hold spaces.
	f := strings.Fields(string(b[bytes.LastIndexByte(b, ')')+1:]))
	sid, err := strconv.Atoi(f[3])
	if err != nil {
		t.Fatalf("/proc/%d/stat: %q", pid, b)
	}
	return sid
}
