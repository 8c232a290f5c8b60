package sandbox_test

import (
	"os"
	"strconv"
	"strings"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/deltagym/deltagym/sandbox"
)

// sparsePy maps 64 GiB of memory it does not reserve (0x4000: MAP_NORESERVE), writes one page
// of it and sleeps.
const sparsePy = `
import mmap, time
m = mmap.mmap(-1, 64 << 30, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | 0x4000, prot=mmap.PROT_READ | mmap.PROT_WRITE)
m[12345 << 20] = 1
time.sleep(1000)
`

// vmPTE returns the page tables' size (VmPTE) of host process pid, in KiB.
func vmPTE(t *testing.T, pid int) int {
	t.Helper()
	st, err := os.ReadFile("/proc/" + strconv.Itoa(pid) + "/status")
	if err != nil {
		t.Fatal(err)
	}
	for l := range strings.SplitSeq(string(st), "\n") {
		if v, ok := strings.CutPrefix(l, "VmPTE:"); ok {
			n, err := strconv.Atoi(strings.TrimSpace(strings.TrimSuffix(strings.TrimSpace(v), "kB")))
			if err != nil {
				t.Fatal(err)
			}
			return n
		}
	}
	t.Fatalf("no VmPTE in\n%s", st)
	return 0
}

// A process with a 64 GiB mapping, one page of it written: its checkpoints' digests come back,
// equal (the process at rest), the template's page tables do not grow with the mapping, and
// another sandbox's digest, asked for at the same time, comes back too.
func TestStateDigestSparseMapping(t *testing.T) {
	b := setup(t)
	img := defaultImage(t, b)
	s := b.create(t, sandbox.Spec{Image: img})
	other := b.create(t, sandbox.Spec{Image: img})
	ctx := t.Context()
	sh(t, other, "echo x > /tmp/x")
	res, err := s.Exec(ctx, sandbox.ExecRequest{Argv: []string{"python3", "-c", sparsePy}, Background: true})
	if err != nil {
		t.Fatal(err)
	}
	restingIn(t, s, res.Pid, unix.SYS_CLOCK_NANOSLEEP)
	var ds []sandbox.StateDigest
	for i := range 2 {
		start := time.Now()
		ck, err := s.Checkpoint(ctx)
		if err != nil {
			t.Fatal(err)
		}
		ock, err := other.Checkpoint(ctx)
		if err != nil {
			t.Fatal(err)
		}
		pids := b.rt.TemplatePids(ck.ID)
		if len(pids) != 1 {
			t.Fatalf("templates %v", pids)
		}
		before := vmPTE(t, pids[0])
		d, err := b.rt.StateDigest(ctx, ck.ID)
		if err != nil {
			t.Fatal(err)
		}
		ready := time.Since(start)
		if _, err := b.rt.StateDigest(ctx, ock.ID); err != nil {
			t.Fatal(err)
		}
		t.Logf("checkpoint %d: digest of the 64 GiB process %v after the checkpoint began, the other sandbox's %v", i+1, ready, time.Since(start))
		if after := vmPTE(t, pids[0]); after-before > 1024 {
			t.Fatalf("the template's page tables grew from %d to %d KiB", before, after)
		}
		ds = append(ds, d)
	}
	if ds[0] != ds[1] || ds[0].Processes == "" {
		t.Fatalf("at rest: %v then %v", ds[0], ds[1])
	}
}

// One sandbox's checkpoints queued by the half-dozen, each hashing 256 MiB of its process's
// memory, hold another sandbox's digest back by the jobs already running at most.
func TestStateDigestFairAcrossSandboxes(t *testing.T) {
	b := setup(t)
	img := defaultImage(t, b)
	busy := b.create(t, sandbox.Spec{Image: img})
	other := b.create(t, sandbox.Spec{Image: img})
	ctx := t.Context()
	res, err := busy.Exec(ctx, sandbox.ExecRequest{Argv: []string{"python3", "-c", "import os, time\nx = os.urandom(1 << 20) * 256\ntime.sleep(1000)"}, Background: true})
	if err != nil {
		t.Fatal(err)
	}
	restingIn(t, busy, res.Pid, unix.SYS_CLOCK_NANOSLEEP)
	ckDigest(t, b, other) // the image's index, which no job below then builds
	sh(t, other, "echo x > /tmp/x")
	var ids []string
	for range 8 {
		ck, err := busy.Checkpoint(ctx)
		if err != nil {
			t.Fatal(err)
		}
		ids = append(ids, ck.ID)
	}
	ready := func() int {
		n := 0
		for _, id := range ids {
			if _, ok := b.rt.StateDigestReady(id); ok {
				n++
			}
		}
		return n
	}
	start := time.Now()
	ck, err := other.Checkpoint(ctx)
	if err != nil {
		t.Fatal(err)
	}
	queued := ready()
	if queued > 4 {
		t.Fatalf("%d of 8 digests were ready before the other sandbox's checkpoint: too few queued to tell", queued)
	}
	if _, err := b.rt.StateDigest(ctx, ck.ID); err != nil {
		t.Fatal(err)
	}
	after := ready()
	t.Logf("the other sandbox's digest came back in %v; the busy sandbox's digests ready: %d of 8 at its checkpoint, %d when it came back", time.Since(start), queued, after)
	if after-queued > 3 {
		t.Fatalf("%d of the busy sandbox's digests came back before the other's, which was queued after %d of them", after-queued, queued)
	}
	var first sandbox.StateDigest
	for i, id := range ids {
		d, err := b.rt.StateDigest(ctx, id)
		if err != nil {
			t.Fatal(err)
		}
		if i == 0 {
			first = d
		} else if d != first {
			t.Fatalf("checkpoint %d at rest: %v, first %v", i+1, d, first)
		}
	}
}
