package sandbox_test

import (
	"bytes"
	"context"
	"math/rand/v2"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/deltagym/deltagym/sandbox"
)

// BenchmarkFork1000 forks 1,000 sandboxes at once from a files-only
// checkpoint, under the caps derived from the machine (a Fork beyond them
// would be refused), as a trainer forks its groups again and again: each
// fan-out starts once the warm pool has refilled after the last one's
// children were destroyed (fork1000-, p50/p99 of the whole fan-out), the
// first from an empty pool (first-fork1000-). BenchmarkFork1000Cold forks
// without a pool.
func BenchmarkFork1000(b *testing.B) {
	benchFork1000(b, true)
}

// BenchmarkFork1000Cold is BenchmarkFork1000 on a runtime without a warm
// pool: the Fork starts every child's init itself.
func BenchmarkFork1000Cold(b *testing.B) {
	benchFork1000(b, false)
}

func benchFork1000(b *testing.B, pool bool) {
	const n = 1000
	bb := setup(b, func(c *sandbox.Config) {
		if !pool {
			c.InitPool = -1
		}
	})
	warm := make(chan int, 1)
	bb.rt.OnWarm(func(ready int) {
		select {
		case <-warm:
		default:
		}
		warm <- ready
	})
	s := bb.create(b, sandbox.Spec{})
	ctx := context.Background()
	must(b, s.WriteFile(ctx, "/state", []byte("x"), 0, false))
	ck, err := s.CheckpointWith(ctx, sandbox.CheckpointOptions{Processes: sandbox.ProcessesNone})
	must(b, err)
	b.Logf("caps %+v", bb.rt.Caps())
	var first, fork, cleanup lat
	round := func(l *lat) {
		var kids []*sandbox.Sandbox
		l.time(func() { kids, err = bb.rt.Fork(ctx, ck.ID, n, sandbox.Spec{}) })
		must(b, err)
		b.StopTimer()
		cleanup.time(func() {
			for _, k := range kids {
				must(b, k.Destroy(ctx))
			}
		})
		if pool {
			waitWarm(b, bb.rt, warm, n)
		}
		b.StartTimer()
	}
	b.StopTimer()
	round(&first)
	b.StartTimer()
	for range b.N {
		round(&fork)
	}
	if pool {
		first.report(b, "first-fork1000-")
	}
	fork.report(b, "fork1000-")
	cleanup.report(b, "destroy1000-")
}

// waitWarm waits until the warm pool holds n inits, on its reports.
func waitWarm(b *testing.B, rt *sandbox.Runtime, warm <-chan int, n int) {
	watchdog := time.After(5 * time.Minute)
	for rt.WarmInits() < n {
		select {
		case <-warm:
		case <-watchdog:
			b.Fatalf("the warm pool holds %d inits of %d after 5 minutes", rt.WarmInits(), n)
		}
	}
}

// densityN is how many idle sandboxes BenchmarkIdleSandboxes keeps alive
// ($DELTAGYM_DENSITY_N, default 10,000).
func densityN() int {
	if n, err := strconv.Atoi(os.Getenv("DELTAGYM_DENSITY_N")); err == nil && n > 0 {
		return n
	}
	return 10000
}

// BenchmarkIdleSandboxes starts densityN idle sandboxes (forks of a
// files-only checkpoint, in fan-outs of 1,000) under the derived caps, then
// reports what each costs and the latency of a command (a Step's exec) in
// sandboxes picked at random among them:
//   - private-KiB: the sum of Private_Clean, Private_Dirty and
//     Private_Hugetlb (smaps_rollup) of a sandbox's processes (its init);
//   - cgroup-KiB: the memory charged to its control group (its page cache,
//     anonymous memory and, on cgroup v1, the kernel memory of its tasks:
//     memory.usage_in_bytes);
//   - kmem-KiB: the kernel memory alone (memory.kmem.usage_in_bytes);
//   - memavail-KiB: the drop of the machine's MemAvailable per sandbox,
//     what it costs the machine in all (net and other namespaces, the
//     server's bookkeeping included);
//   - fds: the server's descriptors per sandbox, the net namespace pool's
//     left out (serverFDs);
//   - make-s: how long making them all took, in seconds.
//
// $DELTAGYM_DENSITY_CAPS=off lifts the sandbox and descriptor caps, to see
// how many the machine holds past them.
func BenchmarkIdleSandboxes(b *testing.B) {
	bb := setup(b, func(c *sandbox.Config) {
		if os.Getenv("DELTAGYM_DENSITY_CAPS") == "off" {
			c.Caps.Sandboxes, c.Caps.Descriptors = -1, -1
		}
	})
	n := densityN()
	s := bb.create(b, sandbox.Spec{})
	ctx := context.Background()
	ck, err := s.CheckpointWith(ctx, sandbox.CheckpointOptions{Processes: sandbox.ProcessesNone})
	must(b, err)
	b.Logf("caps %+v", bb.rt.Caps())
	before, fds := memAvailable(b), serverFDs(b)
	start := time.Now()
	var all []*sandbox.Sandbox
	defer func() {
		for _, k := range all {
			_ = k.Destroy(context.Background())
		}
	}()
	for len(all) < n {
		kids, err := bb.rt.Fork(ctx, ck.ID, min(1000, n-len(all)), sandbox.Spec{})
		must(b, err)
		all = append(all, kids...)
	}
	made := time.Since(start)
	for _, k := range all {
		k.Settle()
	}
	fds = serverFDs(b) - fds
	drop := before - memAvailable(b)
	var priv, cg, kmem int64
	for _, k := range all {
		priv += privateBytes(b, k.InitPid())
		dir := filepath.Join("/sys/fs/cgroup/memory", bb.cfg.CgroupRoot, k.ID())
		cg += readBytes(b, filepath.Join(dir, "memory.usage_in_bytes"))
		kmem += readBytes(b, filepath.Join(dir, "memory.kmem.usage_in_bytes"))
	}
	var step lat
	b.ResetTimer()
	for range b.N {
		k := all[rand.IntN(len(all))]
		step.time(func() {
			if _, err := k.Exec(ctx, sandbox.ExecRequest{Command: "true"}); err != nil {
				b.Fatal(err)
			}
		})
	}
	b.StopTimer()
	step.report(b, "step-")
	per := func(v int64) float64 { return float64(v) / 1024 / float64(n) }
	b.ReportMetric(float64(n), "sandboxes")
	b.ReportMetric(per(priv), "private-KiB")
	b.ReportMetric(per(cg), "cgroup-KiB")
	b.ReportMetric(per(kmem), "kmem-KiB")
	b.ReportMetric(per(drop*1024), "memavail-KiB")
	b.ReportMetric(float64(fds)/float64(n), "fds")
	b.ReportMetric(made.Seconds(), "make-s")
}

// privateBytes sums the Private_* lines of a process's smaps_rollup.
func privateBytes(b *testing.B, pid int) int64 {
	raw, err := os.ReadFile("/proc/" + strconv.Itoa(pid) + "/smaps_rollup")
	must(b, err)
	var n int64
	for _, l := range bytes.Split(raw, []byte{'\n'}) {
		f := strings.Fields(string(l))
		if len(f) == 3 && strings.HasPrefix(f[0], "Private_") {
			kb, _ := strconv.ParseInt(f[1], 10, 64)
			n += kb << 10
		}
	}
	return n
}

func readBytes(b *testing.B, path string) int64 {
	raw, err := os.ReadFile(path)
	must(b, err)
	v, err := strconv.ParseInt(strings.TrimSpace(string(raw)), 10, 64)
	must(b, err)
	return v
}

// memAvailable is the machine's MemAvailable, in KiB.
func memAvailable(b *testing.B) int64 {
	raw, err := os.ReadFile("/proc/meminfo")
	must(b, err)
	for _, l := range strings.Split(string(raw), "\n") {
		if f := strings.Fields(l); len(f) >= 2 && f[0] == "MemAvailable:" {
			v, _ := strconv.ParseInt(f[1], 10, 64)
			return v
		}
	}
	return 0
}
