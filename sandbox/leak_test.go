package sandbox_test

import (
	"context"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"runtime"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/deltagym/deltagym/sandbox"
)

// resources counts what a runtime can leak. Mounts, cgroups and processes
// are counted for this test's runtime only (its data directory, its cgroup
// root, descendants of this process): other tests may run on the host.
type resources struct {
	mounts, cgroups, inits, fds, goroutines, layers, metaFiles int
}

func (r resources) String() string {
	return fmt.Sprintf("mounts %d, cgroups %d, dg-init processes %d, fds %d, goroutines %d, layers %d, metadata files %d",
		r.mounts, r.cgroups, r.inits, r.fds, r.goroutines, r.layers, r.metaFiles)
}

func countResources(t *testing.T, b *bundle) resources {
	t.Helper()
	var r resources
	// Not /proc/self: the process's main thread may sit in another mount
	// namespace (see the report on launch's spawn namespace); the layers
	// are mounted in the namespace of the runtime's other threads.
	runtime.LockOSThread()
	mi, err := os.ReadFile("/proc/thread-self/mountinfo")
	runtime.UnlockOSThread()
	if err != nil {
		t.Fatal(err)
	}
	for _, line := range strings.Split(string(mi), "\n") {
		if strings.Contains(line, " "+b.dir+"/") {
			r.mounts++
		}
	}
	for _, h := range []string{"unified", "memory", "pids", "cpu", "freezer"} {
		root := filepath.Join("/sys/fs/cgroup", h, b.cfg.CgroupRoot)
		_ = filepath.WalkDir(root, func(p string, d fs.DirEntry, err error) error {
			if err == nil && d.IsDir() && p != root {
				r.cgroups++
			}
			return nil
		})
	}
	r.inits = countInits(os.Getpid())
	fds, err := os.ReadDir("/proc/self/fd")
	if err != nil {
		t.Fatal(err)
	}
	r.fds = len(fds)
	r.goroutines = runtime.NumGoroutine()
	store := filepath.Join(b.cfg.DataDir, "store")
	if ls, err := os.ReadDir(filepath.Join(store, "layers")); err == nil {
		r.layers = len(ls)
	}
	// Checkpoint and sandbox records, wherever the store keeps them.
	_ = filepath.WalkDir(store, func(p string, d fs.DirEntry, err error) error {
		if err != nil {
			return nil
		}
		switch rel, _ := filepath.Rel(store, p); {
		case d.IsDir() && (rel == "images" || rel == "skel" || rel == "layers"):
			return filepath.SkipDir
		case !d.IsDir():
			r.metaFiles++
		}
		return nil
	})
	return r
}

// countInits counts the dg-init processes that descend from pid.
func countInits(pid int) int {
	entries, _ := os.ReadDir("/proc")
	parent := map[int]int{}
	comm := map[int]string{}
	for _, e := range entries {
		p, err := strconv.Atoi(e.Name())
		if err != nil {
			continue
		}
		stat, err := os.ReadFile("/proc/" + e.Name() + "/stat")
		if err != nil {
			continue
		}
		// pid (comm) state ppid ...; comm may hold spaces and parens.
		s := string(stat)
		i, j := strings.IndexByte(s, '('), strings.LastIndexByte(s, ')')
		if i < 0 || j < i {
			continue
		}
		f := strings.Fields(s[j+1:])
		if len(f) < 2 {
			continue
		}
		pp, _ := strconv.Atoi(f[1])
		parent[p], comm[p] = pp, s[i+1:j]
	}
	n := 0
	for p, c := range comm {
		if c != "dg-init" {
			continue
		}
		for q := parent[p]; q > 1; q = parent[q] {
			if q == pid {
				n++
				break
			}
		}
	}
	return n
}

// leakCycle runs one create/checkpoint/rollback/destroy cycle; every
// tenth takes its checkpoint with a live background process (the frozen
// copy path) and forks it.
func leakCycle(ctx context.Context, b *bundle, i int) error {
	s, err := b.rt.Create(ctx, sandbox.Spec{Image: "busybox"})
	if err != nil {
		return fmt.Errorf("create: %w", err)
	}
	var cks []string
	defer func() {
		for _, id := range cks {
			_ = b.rt.ReleaseCheckpoint(id)
		}
	}()
	defer s.Destroy(context.WithoutCancel(ctx))
	run := func(cmd string) error {
		res, err := s.Exec(ctx, sandbox.ExecRequest{Command: cmd, Timeout: 10 * time.Second})
		if err == nil && res.ExitCode != 0 {
			err = fmt.Errorf("exit %d: %s", res.ExitCode, res.Stderr)
		}
		if err != nil {
			return fmt.Errorf("exec %q: %w", cmd, err)
		}
		return nil
	}
	if err := run(fmt.Sprintf("echo %d > /root/n; mkdir -p /w; rm /bin/true", i)); err != nil {
		return err
	}
	if err := s.WriteFile(ctx, "/w/f", []byte("cycle"), 0, false); err != nil {
		return fmt.Errorf("write: %w", err)
	}
	if i%10 == 0 {
		if _, err := s.Exec(ctx, sandbox.ExecRequest{Command: "sleep 1000", Background: true}); err != nil {
			return fmt.Errorf("background: %w", err)
		}
	}
	ck, err := s.Checkpoint(ctx)
	if err != nil {
		return fmt.Errorf("checkpoint: %w", err)
	}
	cks = append(cks, ck.ID)
	if err := run("echo changed > /root/n; rm -rf /w"); err != nil {
		return err
	}
	ck2, err := s.Checkpoint(ctx)
	if err != nil {
		return fmt.Errorf("second checkpoint: %w", err)
	}
	cks = append(cks, ck2.ID)
	if err := s.Restore(ctx, ck.ID); err != nil {
		return fmt.Errorf("restore: %w", err)
	}
	if err := run(fmt.Sprintf("[ \"$(cat /root/n)\" = %d ] && [ \"$(cat /w/f)\" = cycle ] && [ ! -e /bin/true ]", i)); err != nil {
		return fmt.Errorf("after restore: %w", err)
	}
	if i%10 == 0 {
		kids, err := b.rt.Fork(ctx, ck2.ID, 2, sandbox.Spec{})
		if err != nil {
			return fmt.Errorf("fork: %w", err)
		}
		for _, k := range kids {
			if err := k.Destroy(ctx); err != nil {
				return fmt.Errorf("destroying a fork: %w", err)
			}
		}
	}
	if i%10 == 5 {
		// A session (busybox has no bash: ash stands in) lives until Destroy.
		if err := s.WriteFile(ctx, "/bin/bash", []byte("#!/bin/sh\nexec /bin/busybox ash\n"), 0o755, false); err != nil {
			return fmt.Errorf("write: %w", err)
		}
		res, err := s.Exec(ctx, sandbox.ExecRequest{Session: "main", Command: "cd /tmp; export X=1", Timeout: 10 * time.Second})
		if err != nil || res.ExitCode != 0 {
			return fmt.Errorf("session: %v %+v", err, res)
		}
	}
	if i%10 == 3 || i%10 == 8 {
		// The same checkpoint again, and again: the root of the next
		// restore is built ahead. A third restore uses it (3); a
		// restore of another checkpoint drops it (8); the last one
		// built is left for Destroy (both).
		read := func(path string) string {
			b, _, err := s.ReadFile(ctx, path, 0, 100)
			if err != nil {
				return "error: " + err.Error()
			}
			return string(b)
		}
		for range 2 {
			if err := s.Restore(ctx, ck.ID); err != nil {
				return fmt.Errorf("restore again: %w", err)
			}
			if got, want := read("/root/n"), fmt.Sprintf("%d\n", i); got != want || read("/w/f") != "cycle" {
				return fmt.Errorf("restored again: /root/n %q (want %q), /w/f %q", got, want, read("/w/f"))
			}
			if err := s.WriteFile(ctx, "/root/n", []byte("dirty"), 0, false); err != nil {
				return fmt.Errorf("write: %w", err)
			}
		}
		if i%10 == 8 {
			// Twice: the other, on two layers, is merged in the
			// background (hot), and released with the cycle's
			// checkpoints, maybe before the merge is done.
			for range 2 {
				if err := s.Restore(ctx, ck2.ID); err != nil {
					return fmt.Errorf("restore the other: %w", err)
				}
				if got := read("/root/n"); got != "changed\n" {
					return fmt.Errorf("restored the other: /root/n %q", got)
				}
			}
			if err := s.Restore(ctx, ck.ID); err != nil {
				return fmt.Errorf("restore back: %w", err)
			}
		}
		if err := s.Restore(ctx, ck.ID); err != nil {
			return fmt.Errorf("restore once more: %w", err)
		}
		if got := read("/root/n"); got != fmt.Sprintf("%d\n", i) {
			return fmt.Errorf("restored once more: /root/n %q", got)
		}
	}
	if i%10 == 7 {
		// Destroyed with its root not swapped in yet: a restore, then
		// file actions only.
		if err := s.Restore(ctx, ck2.ID); err != nil {
			return fmt.Errorf("restore: %w", err)
		}
		if err := s.WriteFile(ctx, "/w/g", []byte("pending"), 0, false); err != nil {
			return fmt.Errorf("write: %w", err)
		}
	}
	return s.Destroy(ctx)
}

func TestNoLeaks(t *testing.T) {
	b := setup(t, filesOnly) // background commands are process trees
	ctx := t.Context()
	cycles := 1000
	if testing.Short() {
		cycles = 100
	}
	const workers = 2
	// Warm up the pools (net namespaces, spare uppers, threads) first.
	for i := range 4 {
		if err := leakCycle(ctx, b, i); err != nil {
			t.Fatal(err)
		}
	}
	settle(t, b, nil)
	before := countResources(t, b)
	t.Logf("before: %v", before)
	// The counters see a live sandbox and its checkpoint.
	s := b.create(t, sandbox.Spec{})
	ck := mustCheckpoint(t, s)
	// The sandbox took its init from the warm pool, which refills in the
	// background: count again until it has.
	var live resources
	for deadline := time.Now().Add(5 * time.Second); ; {
		live = countResources(t, b)
		if live.mounts > before.mounts && live.cgroups > before.cgroups && live.inits > before.inits &&
			live.layers > before.layers && live.metaFiles > before.metaFiles {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("the counters miss a live sandbox:\n  idle: %v\n  live: %v", before, live)
		}
		time.Sleep(10 * time.Millisecond)
	}
	if err := s.Destroy(ctx); err != nil {
		t.Fatal(err)
	}
	if err := b.rt.ReleaseCheckpoint(ck); err != nil {
		t.Fatal(err)
	}
	t.Logf("one live sandbox: %v", live)

	start := time.Now()
	var wg sync.WaitGroup
	errs := make(chan error, workers)
	for w := range workers {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for i := w; i < cycles; i += workers {
				if err := leakCycle(ctx, b, i); err != nil {
					errs <- fmt.Errorf("cycle %d: %w", i, err)
					return
				}
			}
		}()
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		t.Fatal(err)
	}
	took := time.Since(start)
	after := settle(t, b, &before)
	t.Logf("after %d cycles in %v (%v per cycle, %d workers): %v", cycles, took.Round(time.Millisecond), (took / time.Duration(cycles)).Round(time.Microsecond), workers, after)
	if n := b.rt.Sandboxes(); n != 0 {
		t.Errorf("%d sandboxes still live", n)
	}
	if n := b.rt.Checkpoints(); n != 0 {
		t.Errorf("%d checkpoints still held", n)
	}
}

// settle polls until the resources are back to want (or, with want nil,
// until they stop changing), within a deadline: layer discards, cgroup
// removal and goroutine exits are asynchronous. It returns the last count
// and fails the test with the difference if they never settle.
func settle(t *testing.T, b *bundle, want *resources) resources {
	t.Helper()
	deadline := time.Now().Add(15 * time.Second)
	var prev, cur resources
	for {
		cur = countResources(t, b)
		switch {
		case want == nil && cur == prev:
			return cur
		case want != nil && cur.mounts <= want.mounts && cur.cgroups <= want.cgroups && cur.inits <= want.inits &&
			cur.fds <= want.fds && cur.goroutines <= want.goroutines && cur.layers <= want.layers && cur.metaFiles <= want.metaFiles:
			return cur
		}
		if time.Now().After(deadline) {
			if want != nil {
				t.Errorf("resources leaked:\n  before: %v\n  after:  %v", *want, cur)
			}
			return cur
		}
		prev = cur
		time.Sleep(50 * time.Millisecond) // polling an asynchronous state, not synchronising
	}
}
