package sandbox_test

import (
	"bytes"
	"context"
	"fmt"
	"math/rand/v2"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/deltagym/deltagym/internal/benchq"
	"github.com/deltagym/deltagym/sandbox"
)

// lat records latencies and reports p50, p99 and the maximum in milliseconds
// (benchq).
type lat []time.Duration

func (l *lat) time(f func()) {
	t := time.Now()
	f()
	*l = append(*l, time.Since(t))
}

func (l lat) report(b *testing.B, prefix string) {
	benchq.Report(b, l, prefix)
}

func must(b testing.TB, err error) {
	b.Helper()
	if err != nil {
		b.Fatal(err)
	}
}

// benchSandbox creates a sandbox at stack depth `depth` with `procs` live
// background processes.
func benchSandbox(b *testing.B, bb *bundle, depth, procs int) *sandbox.Sandbox {
	s := bb.create(b, sandbox.Spec{})
	ctx := context.Background()
	for i := range depth - 1 {
		must(b, s.WriteFile(ctx, fmt.Sprintf("/layer/%d", i), []byte("x"), 0, false))
		_, err := s.Checkpoint(ctx)
		must(b, err)
	}
	for range procs {
		_, err := s.Exec(ctx, sandbox.ExecRequest{Command: "while true; do sleep 1; done", Background: true})
		must(b, err)
	}
	return s
}

// BenchmarkCheckpoint: a 4 KiB file changed, then a checkpoint; at stack
// depth 1, 10 and 100, with 0 and 20 live background processes.
func BenchmarkCheckpoint(b *testing.B) {
	for _, depth := range []int{1, 10, 100} {
		for _, procs := range []int{0, 20} {
			b.Run(fmt.Sprintf("depth=%d/procs=%d", depth, procs), func(b *testing.B) {
				bb := setup(b, filesOnly) // the shell loops are trees: the frozen-copy path
				s := benchSandbox(b, bb, depth, procs)
				ctx := context.Background()
				base, err := s.Checkpoint(ctx)
				must(b, err)
				payload := make([]byte, 4096)
				var l lat
				b.ResetTimer()
				for i := 0; i < b.N; i++ {
					must(b, s.WriteFile(ctx, "/f", payload, 0, false))
					var ck sandbox.CheckpointInfo
					l.time(func() { ck, err = s.Checkpoint(ctx) })
					must(b, err)
					// Stay at the same depth: go back to base, drop the new one.
					b.StopTimer()
					must(b, s.Restore(ctx, base.ID))
					must(b, bb.rt.ReleaseCheckpoint(ck.ID))
					b.StartTimer()
				}
				l.report(b, "")
			})
		}
	}
}

// BenchmarkRollback restores to random nodes of a 1,000-checkpoint tree
// (each node one 4 KiB write away from its parent).
func BenchmarkRollback(b *testing.B) {
	bb := setup(b)
	s := bb.create(b, sandbox.Spec{})
	ctx := context.Background()
	rng := rand.New(rand.NewPCG(1, 2))
	nodes := make([]string, 0, 1000)
	payload := make([]byte, 4096)
	for i := range 1000 {
		if len(nodes) > 0 && rng.IntN(4) == 0 {
			must(b, s.Restore(ctx, nodes[rng.IntN(len(nodes))]))
		}
		must(b, s.WriteFile(ctx, fmt.Sprintf("/n/%d", i%50), payload, 0, false))
		ck, err := s.Checkpoint(ctx)
		must(b, err)
		nodes = append(nodes, ck.ID)
	}
	var l lat
	b.ResetTimer()
	for i := 0; i < b.N; i++ {
		id := nodes[rng.IntN(len(nodes))]
		var err error
		l.time(func() { err = s.Restore(ctx, id) })
		must(b, err)
	}
	l.report(b, "")
	b.ReportMetric(float64(s.Depth()), "depth")
}

// BenchmarkRollbackLoop is the rollback load test's loop in one sandbox,
// without the RPCs: restore the same checkpoint, read the file written
// before it (and check it), write it again. cpu-us/op is the CPU the process
// spent per loop (the background work the loop starts included), the
// figure the load test's throughput on 2 cores follows; machine-cpu-us/op
// is all CPUs' busy time per loop, whoever spent it: it adds the kernel
// threads' share (RCU grace periods and callbacks after each unmount) and
// whatever else the machine runs meanwhile.
func BenchmarkRollbackLoop(b *testing.B) {
	bb := setup(b)
	s := bb.create(b, sandbox.Spec{})
	ctx := context.Background()
	orig := bytes.Repeat([]byte("c"), 4096)
	changed := bytes.Repeat([]byte("x"), 4096)
	must(b, s.WriteFile(ctx, "/work/state.txt", orig, 0, false))
	ck, err := s.Checkpoint(ctx)
	must(b, err)
	must(b, s.WriteFile(ctx, "/work/state.txt", changed, 0, false))
	var l lat
	cpu0, busy0 := processCPU(), machineBusy()
	b.ResetTimer()
	for i := 0; i < b.N; i++ {
		l.time(func() {
			must(b, s.Restore(ctx, ck.ID))
			got, _, err := s.ReadFile(ctx, "/work/state.txt", 0, 0)
			must(b, err)
			if !bytes.Equal(got, orig) {
				b.Fatalf("read %.8q after the restore", got)
			}
			must(b, s.WriteFile(ctx, "/work/state.txt", changed, 0, false))
		})
	}
	b.StopTimer()
	l.report(b, "")
	b.ReportMetric(float64((processCPU()-cpu0).Microseconds())/float64(b.N), "cpu-us/op")
	b.ReportMetric(float64((machineBusy()-busy0).Microseconds())/float64(b.N), "machine-cpu-us/op")
}

// machineBusy returns the time all CPUs have spent not idle (/proc/stat:
// user, nice, system, irq and softirq), counted in /proc/stat's 10 ms ticks.
func machineBusy() time.Duration {
	b, err := os.ReadFile("/proc/stat")
	if err != nil {
		return 0
	}
	line, _, _ := strings.Cut(string(b), "\n")
	var busy time.Duration
	for i, f := range strings.Fields(line)[1:] {
		v, _ := strconv.ParseUint(f, 10, 64)
		if i != 3 && i != 4 && i < 7 { // user, nice, system, irq, softirq
			busy += time.Duration(v) * 10 * time.Millisecond
		}
	}
	return busy
}

// processCPU returns the user and system CPU time this process has used.
func processCPU() time.Duration {
	var ru syscall.Rusage
	_ = syscall.Getrusage(syscall.RUSAGE_SELF, &ru)
	return time.Duration(ru.Utime.Nano() + ru.Stime.Nano())
}

// BenchmarkRollbackDepth: rollback at depth 1, 10 and 100 with 0 and 20
// live processes (which the rollback ends).
func BenchmarkRollbackDepth(b *testing.B) {
	for _, depth := range []int{1, 10, 100} {
		for _, procs := range []int{0, 20} {
			b.Run(fmt.Sprintf("depth=%d/procs=%d", depth, procs), func(b *testing.B) {
				bb := setup(b)
				s := benchSandbox(b, bb, depth, 0)
				ctx := context.Background()
				ck, err := s.Checkpoint(ctx)
				must(b, err)
				var l lat
				b.ResetTimer()
				for i := 0; i < b.N; i++ {
					b.StopTimer()
					must(b, s.WriteFile(ctx, "/f", []byte("changed"), 0, false))
					for range procs {
						_, err := s.Exec(ctx, sandbox.ExecRequest{Command: "while true; do sleep 1; done", Background: true})
						must(b, err)
					}
					b.StartTimer()
					l.time(func() { err = s.Restore(ctx, ck.ID) })
					must(b, err)
				}
				l.report(b, "")
			})
		}
	}
}

// BenchmarkFork64 forks 64 sandboxes from one checkpoint and destroys them.
func BenchmarkFork64(b *testing.B) {
	bb := setup(b)
	s := bb.create(b, sandbox.Spec{})
	ctx := context.Background()
	must(b, s.WriteFile(ctx, "/state", []byte("x"), 0, false))
	ck, err := s.Checkpoint(ctx)
	must(b, err)
	var fork, cold, cleanup lat
	b.ResetTimer()
	for i := 0; i < b.N; i++ {
		// Every other fan-out finds the warm-init pool full (steady
		// state, the pool refilled between fan-outs), the others find it
		// empty (a burst right after another).
		warm := i%2 == 1 // the first fan-out sets the pool's size
		b.StopTimer()
		for deadline := time.Now().Add(time.Minute); warm && bb.rt.WarmInits() < 64; {
			if time.Now().After(deadline) {
				b.Fatalf("the warm-init pool holds %d inits after a minute", bb.rt.WarmInits())
			}
			time.Sleep(10 * time.Millisecond) // the pool refills in the background
		}
		b.StartTimer()
		var kids []*sandbox.Sandbox
		l := &fork
		if !warm {
			l = &cold
		}
		l.time(func() { kids, err = bb.rt.Fork(ctx, ck.ID, 64, sandbox.Spec{}) })
		must(b, err)
		cleanup.time(func() {
			for _, k := range kids {
				must(b, k.Destroy(ctx))
			}
		})
	}
	fork.report(b, "fork-")
	cold.report(b, "fork-cold-")
	cleanup.report(b, "destroy-")
}

// BenchmarkExec runs `true`.
func BenchmarkExec(b *testing.B) {
	bb := setup(b)
	s := bb.create(b, sandbox.Spec{})
	ctx := context.Background()
	var l lat
	b.ResetTimer()
	for i := 0; i < b.N; i++ {
		var err error
		l.time(func() { _, err = s.Exec(ctx, sandbox.ExecRequest{Argv: []string{"/bin/true"}}) })
		must(b, err)
	}
	l.report(b, "")
}

// BenchmarkSessionExec runs `true` in a session's shell: the sentinel's round trip, and the
// wait for the shell to be back at its read of stdin before the exec returns (session.go,
// atRest).
func BenchmarkSessionExec(b *testing.B) {
	bb := setup(b)
	s := bb.create(b, sandbox.Spec{Image: defaultImage(b, bb)}) // its bash
	ctx := context.Background()
	_, err := s.Exec(ctx, sandbox.ExecRequest{Session: "main", Command: "true"})
	must(b, err)
	var l lat
	b.ResetTimer()
	for range b.N {
		l.time(func() { _, err = s.Exec(ctx, sandbox.ExecRequest{Session: "main", Command: "true"}) })
		must(b, err)
	}
	l.report(b, "")
}

// BenchmarkExecLeftover is an exec whose command leaves a process running
// (`sleep 1000 & true` through the shell): the exec returns once the shell
// has exited and the sleep holds /dev/null instead of the exec's pipes
// (leftovers.go). Each leftover is ended outside the timing. Against
// BenchmarkExec's figures: the shell's cost and the handover.
func BenchmarkExecLeftover(b *testing.B) {
	bb := setup(b)
	s := bb.create(b, sandbox.Spec{})
	ctx := context.Background()
	var l lat
	b.ResetTimer()
	for range b.N {
		var err error
		l.time(func() { _, err = s.Exec(ctx, sandbox.ExecRequest{Command: "sleep 1000 & true"}) })
		must(b, err)
		b.StopTimer()
		_, err = s.Exec(ctx, sandbox.ExecRequest{Command: "pkill -x sleep; true"})
		must(b, err)
		b.StartTimer()
	}
	l.report(b, "")
}

// BenchmarkCold is the first operation of a sandbox that has gone cold
// (given up its kept descriptors, hot.go), which opens them again: exec
// runs `/bin/true`, rollback restores a checkpoint after a file write. Its
// figures against BenchmarkExec's and BenchmarkRollback's are the reopen's
// cost.
func BenchmarkCold(b *testing.B) {
	for _, op := range []string{"exec", "rollback"} {
		b.Run("op="+op, func(b *testing.B) {
			bb := setup(b)
			s := bb.create(b, sandbox.Spec{})
			ctx := context.Background()
			ck, err := s.Checkpoint(ctx)
			must(b, err)
			var l lat
			b.ResetTimer()
			for range b.N {
				b.StopTimer()
				if op == "rollback" {
					must(b, s.WriteFile(ctx, "/f", []byte("x"), 0, false))
				}
				if !s.Cool() {
					b.Fatal("an idle sandbox did not cool")
				}
				b.StartTimer()
				l.time(func() {
					if op == "exec" {
						_, err = s.Exec(ctx, sandbox.ExecRequest{Argv: []string{"/bin/true"}})
					} else {
						err = s.Restore(ctx, ck.ID)
					}
				})
				must(b, err)
			}
			l.report(b, "")
		})
	}
}

// BenchmarkRollbackFullCopy is the baseline of copytree-based sandboxes:
// restore by copying the whole root filesystem as it was at the checkpoint.
// The image has 10,000 files; 1,000 files / 50 MB were changed since. The
// upper-only variant copies just the changed files.
func BenchmarkRollbackFullCopy(b *testing.B) {
	if os.Geteuid() != 0 {
		b.Skip("needs root")
	}
	dir := b.TempDir()
	snap := filepath.Join(dir, "snapshot")
	upper := filepath.Join(dir, "upper")
	live := filepath.Join(dir, "live")
	for i := range 10000 {
		p := filepath.Join(snap, fmt.Sprintf("d%02d/f%05d", i%100, i))
		must(b, os.MkdirAll(filepath.Dir(p), 0o755))
		must(b, os.WriteFile(p, make([]byte, 512), 0o644))
	}
	// The checkpointed state: the image with 1,000 files (50 MB) changed.
	big := make([]byte, 50<<20/1000)
	for i := range 1000 {
		name := fmt.Sprintf("d%02d/f%05d", (i*10)%100, i*10)
		for _, root := range []string{snap, upper} {
			p := filepath.Join(root, name)
			must(b, os.MkdirAll(filepath.Dir(p), 0o755))
			must(b, os.WriteFile(p, big, 0o644))
		}
	}
	for _, v := range []struct{ name, src string }{{"whole-root", snap}, {"upper-only", upper}} {
		b.Run(v.name, func(b *testing.B) {
			var l lat
			for i := 0; i < b.N; i++ {
				b.StopTimer()
				must(b, os.RemoveAll(live))
				b.StartTimer()
				l.time(func() {
					out, err := exec.Command("cp", "-a", v.src, live).CombinedOutput()
					if err != nil {
						b.Fatalf("%v: %s", err, out)
					}
				})
			}
			l.report(b, "")
		})
	}
}

// BenchmarkCheckpointWithProcess and BenchmarkRollbackWithProcess: one
// single-threaded python3 process holding 8 MB (its own heap, all touched)
// or 100 MB, captured by the fast path (template fork) and by the general
// path (process mode criu: a criu swrk per call, the sandbox's own
// namespaces, sandbox/criu.DumpTree and RestoreTree), in one run; rollback
// restores it in place, again and again: the timed restores begin after the
// first one, once its templates are in huge pages (hugepages.go).
func BenchmarkCheckpointWithProcess(b *testing.B) {
	for _, path := range processPaths {
		for _, mb := range []int{8, 100} {
			b.Run(fmt.Sprintf("path=%s/rss=%dMB", path.name, mb), func(b *testing.B) {
				path.need(b)
				bb := setup(b)
				s := processSandbox(b, bb, mb)
				ctx := context.Background()
				// A process's first checkpoint hands it to the huge-page
				// worker; timed checkpoints begin once it is done.
				first, err := s.CheckpointWith(ctx, sandbox.CheckpointOptions{Processes: path.mode})
				must(b, err)
				must(b, bb.rt.ReleaseCheckpoint(first.ID))
				waitFolded(b, bb)
				var l lat
				b.ResetTimer()
				for i := 0; i < b.N; i++ {
					var ck sandbox.CheckpointInfo
					var err error
					l.time(func() { ck, err = s.CheckpointWith(ctx, sandbox.CheckpointOptions{Processes: path.mode}) })
					must(b, err)
					b.StopTimer()
					if len(ck.Processes) != 1 || ck.Processes[0].Method.String() != path.name {
						b.Fatalf("captured %+v", ck.Processes)
					}
					must(b, bb.rt.ReleaseCheckpoint(ck.ID))
					b.StartTimer()
				}
				l.report(b, "")
			})
		}
	}
}

// BenchmarkCheckpointDurable is a durable checkpoint of a live python3
// process of 8 or 100 MB: the template, then its CRIU image, made before
// the checkpoint returns. Against CheckpointWithProcess's template path,
// the cost of the image.
func BenchmarkCheckpointDurable(b *testing.B) {
	needCRIU(b)
	for _, mb := range []int{8, 100} {
		b.Run(fmt.Sprintf("rss=%dMB", mb), func(b *testing.B) {
			bb := setup(b)
			s := processSandbox(b, bb, mb)
			ctx := context.Background()
			first, err := s.CheckpointWith(ctx, sandbox.CheckpointOptions{})
			must(b, err)
			must(b, bb.rt.ReleaseCheckpoint(first.ID))
			waitFolded(b, bb)
			var l lat
			b.ResetTimer()
			for range b.N {
				var ck sandbox.CheckpointInfo
				var err error
				l.time(func() { ck, err = s.CheckpointWith(ctx, sandbox.CheckpointOptions{Durable: true}) })
				must(b, err)
				b.StopTimer()
				if len(ck.Processes) != 1 || !ck.Processes[0].Saved {
					b.Fatalf("captured %+v", ck.Processes)
				}
				must(b, bb.rt.ReleaseCheckpoint(ck.ID))
				b.StartTimer()
			}
			l.report(b, "")
		})
	}
}

// BenchmarkCloseWithProcessCheckpoints closes a sandbox holding 20
// checkpoints of a live python3 process (template path), one sandbox per
// iteration. op=close is Sandbox.Close (what the server's Close and the
// reaper call): the templates are saved as CRIU images in the background.
// op=destroy is Sandbox.Destroy, which saves them before it returns. The
// checkpoints are released after each close, untimed, so the background
// saves of one iteration end soon and load the next only a little.
func BenchmarkCloseWithProcessCheckpoints(b *testing.B) {
	needCRIU(b)
	for _, op := range []string{"close", "destroy"} {
		b.Run("op="+op, func(b *testing.B) {
			bb := setup(b)
			ctx := context.Background()
			var l lat
			for b.Loop() {
				b.StopTimer()
				s := processSandbox(b, bb, 8)
				ids := make([]string, 20)
				for i := range ids {
					ck, err := s.Checkpoint(ctx)
					must(b, err)
					if len(ck.Processes) != 1 {
						b.Fatalf("captured %+v", ck.Processes)
					}
					ids[i] = ck.ID
				}
				b.StartTimer()
				l.time(func() {
					if op == "close" {
						must(b, s.Close(ctx))
					} else {
						must(b, s.Destroy(ctx))
					}
				})
				b.StopTimer()
				for _, id := range ids {
					must(b, bb.rt.ReleaseCheckpoint(id))
				}
				b.StartTimer()
			}
			l.report(b, "")
		})
	}
}

// killPy times 2,000 kill(2) calls of each kind from inside a sandbox: to
// one process by pid (signal 0), and to every process (kill(-1, 0)); it
// prints microseconds per call of each.
const killPy = `
import os, sys, time
pid = int(sys.argv[1])
def per(f, n=2000):
    t = time.perf_counter()
    for _ in range(n):
        f()
    return (time.perf_counter() - t) / n * 1e6
print(per(lambda: os.kill(pid, 0)), per(lambda: os.kill(-1, 0)))
`

// BenchmarkKillInSandbox: what a command's kill(2) costs, to a process by
// pid and to every process (kill -1), in a sandbox that holds a process
// checkpoint (its template is one of the processes kill -1 would reach).
// Each iteration is one run of killPy; the metrics are its averages.
func BenchmarkKillInSandbox(b *testing.B) {
	bb := setup(b)
	s := processSandbox(b, bb, 8)
	ctx := context.Background()
	_, err := s.Checkpoint(ctx)
	must(b, err)
	must(b, s.WriteFile(ctx, "/tmp/kill.py", []byte(killPy), 0o644, false))
	_, err = s.Exec(ctx, sandbox.ExecRequest{Command: "sleep 1000", Background: true})
	must(b, err)
	var byPid, all []float64
	for b.Loop() {
		res, err := s.Exec(ctx, sandbox.ExecRequest{Command: "python3 /tmp/kill.py $(grep -lx sleep /proc/[0-9]*/comm | head -1 | cut -d/ -f3)"})
		must(b, err)
		var p, a float64
		if _, err := fmt.Sscan(string(res.Stdout), &p, &a); err != nil || res.ExitCode != 0 {
			b.Fatalf("kill.py: %q %q", res.Stdout, res.Stderr)
		}
		byPid, all = append(byPid, p), append(all, a)
	}
	slices.Sort(byPid)
	slices.Sort(all)
	b.ReportMetric(byPid[len(byPid)/2], "us/kill-pid")
	b.ReportMetric(all[len(all)/2], "us/kill-all")
}

// BenchmarkRollbackWithProcess restores in place, again and again, a
// checkpoint of one process of 8 or 100 MB, by each path. Restores follow
// each other at once; BenchmarkRollbackStepWithProcess runs a command
// between them.
//
// path=template forks the copies of a checkpoint's next restore ahead, in
// the background after each restore (ahead.go), unless restores come back
// to back, as here: then each restore forks its copies.
// path=template-at-restore always does (Config.ForkAtRestore).
func BenchmarkRollbackWithProcess(b *testing.B) {
	rollbackWithProcess(b, nil)
}

// BenchmarkRollbackStepWithProcess is BenchmarkRollbackWithProcess with an
// agent's step between restores, not timed: one command (true) run in the
// sandbox, and 5 ms standing for the model choosing its next action (an LLM
// call takes far longer). The copies forked ahead after a restore are ready
// by the next.
func BenchmarkRollbackStepWithProcess(b *testing.B) {
	rollbackWithProcess(b, func(s *sandbox.Sandbox) {
		res, err := s.Exec(context.Background(), sandbox.ExecRequest{Argv: []string{"true"}})
		must(b, err)
		if res.ExitCode != 0 {
			b.Fatalf("step: %+v", res)
		}
		time.Sleep(5 * time.Millisecond)
	})
}

func rollbackWithProcess(b *testing.B, step func(*sandbox.Sandbox)) {
	paths := slices.Insert(slices.Clone(processPaths), 1, processPaths[0])
	paths[1].name = "template-at-restore"
	for _, path := range paths {
		for _, mb := range []int{8, 100} {
			b.Run(fmt.Sprintf("path=%s/rss=%dMB", path.name, mb), func(b *testing.B) {
				path.need(b)
				bb := setup(b, func(c *sandbox.Config) { c.ForkAtRestore = path.name == "template-at-restore" })
				s := processSandbox(b, bb, mb)
				ctx := context.Background()
				ck, err := s.CheckpointWith(ctx, sandbox.CheckpointOptions{Processes: path.mode})
				must(b, err)
				// The first restore hands the templates to the huge-page
				// worker; timed restores begin once it is done.
				must(b, s.Restore(ctx, ck.ID))
				waitFolded(b, bb)
				var l lat
				b.ResetTimer()
				for i := 0; i < b.N; i++ {
					l.time(func() { err = s.Restore(ctx, ck.ID) })
					must(b, err)
					if step != nil {
						b.StopTimer()
						step(s)
						b.StartTimer()
					}
				}
				l.report(b, "")
			})
		}
	}
}

// BenchmarkRollbackVsCRIU sets the fast path against CRIU under the same
// conditions: one sandbox's process checkpointed by the template path,
// another's by CRIU, both restored in place in alternating blocks of
// vsBlock back-to-back restores, until each path has b.N. Run one after the
// other (BenchmarkRollbackWithProcess), the two paths meet the VM at
// different moments, and its speed drifts by ±30% within minutes here, so
// their ratio moves with it; alternating puts both in every stretch of the
// run. It reports each path's p50 and p99 and the ratio of the p50s
// (criu-p50 / template-p50). A restore forks the copies of the next one
// ahead only if the pause before it was long enough (forkAhead): in each
// template block, the first restore (after the CRIU block) forks at
// restore and has the next one's copies forked ahead, which the second
// takes, waiting for that job if it has not ended; the other eight fork at
// restore, back to back, as in BenchmarkRollbackWithProcess. With
// files=step every restore follows a pause, and all but the first of a
// block take copies forked ahead.
//
// What comes between restores (untimed) is the same for both paths:
//   - files=kept: nothing. The process writes no file, so a template
//     restore keeps the sandbox's root (keepRoot).
//   - files=written: a file written into the sandbox by the server (a file
//     action), so that every restore swaps in a new root, back to back.
//   - files=step: an agent's step, a command that writes a file, then 5 ms
//     standing for the model choosing its next action (an LLM call takes far
//     longer): a new root every time, and the template path's copies forked
//     ahead are ready by the next restore. That is the loop of a trainer.
func BenchmarkRollbackVsCRIU(b *testing.B) {
	for _, mb := range []int{8, 100} {
		for _, files := range []string{"kept", "written", "step"} {
			rollbackVsCRIU(b, mb, files)
		}
	}
}

func rollbackVsCRIU(b *testing.B, mb int, files string) {
	b.Run(fmt.Sprintf("rss=%dMB/files=%s", mb, files), func(b *testing.B) {
		needCRIU(b)
		bb := setup(b)
		ctx := context.Background()
		type side struct {
			s  *sandbox.Sandbox
			ck string
			l  lat
		}
		sides := make([]*side, len(processPaths))
		for i, path := range processPaths {
			s := processSandbox(b, bb, mb)
			ck, err := s.CheckpointWith(ctx, sandbox.CheckpointOptions{Processes: path.mode})
			must(b, err)
			if len(ck.Processes) != 1 || ck.Processes[0].Method.String() != path.name {
				b.Fatalf("captured %+v", ck.Processes)
			}
			// The first restore hands the templates to the huge-page
			// worker; timed restores begin once it is done.
			must(b, s.Restore(ctx, ck.ID))
			sides[i] = &side{s: s, ck: ck.ID}
		}
		waitFolded(b, bb)
		b.ResetTimer()
		for done := 0; done < b.N; done += vsBlock {
			for _, sd := range sides {
				for range min(vsBlock, b.N-done) {
					if files != "kept" {
						b.StopTimer()
					}
					switch files {
					case "written":
						must(b, sd.s.WriteFile(ctx, "/tmp/step", []byte("x"), 0o644, false))
					case "step":
						res, err := sd.s.Exec(ctx, sandbox.ExecRequest{Argv: []string{"sh", "-c", "echo $$ > /tmp/step"}})
						must(b, err)
						if res.ExitCode != 0 {
							b.Fatalf("step: %+v", res)
						}
						time.Sleep(5 * time.Millisecond)
					}
					if files != "kept" {
						b.StartTimer()
					}
					var err error
					sd.l.time(func() { err = sd.s.Restore(ctx, sd.ck) })
					must(b, err)
				}
			}
		}
		b.StopTimer()
		p50 := make([]float64, len(sides))
		for i, sd := range sides {
			sd.l.report(b, processPaths[i].name+"-")
			d := slices.Clone(sd.l)
			slices.Sort(d)
			p50[i] = float64(d[len(d)/2])
		}
		b.ReportMetric(p50[1]/p50[0], "criu/template-p50")
	})
}

// vsBlock is how many restores of one path BenchmarkRollbackVsCRIU makes
// before it turns to the other.
const vsBlock = 10

// BenchmarkRestoreElsewhereWithProcess: a checkpoint whose process is kept
// as a template, restored in another sandbox of the same image — through a
// CRIU image made from the template on the first restore (reported apart as
// image-ms) and reused by every later one.
func BenchmarkRestoreElsewhereWithProcess(b *testing.B) {
	for _, mb := range []int{8, 100} {
		b.Run(fmt.Sprintf("rss=%dMB", mb), func(b *testing.B) {
			needCRIU(b)
			bb := setup(b)
			s := processSandbox(b, bb, mb)
			ctx := context.Background()
			ck, err := s.Checkpoint(ctx)
			must(b, err)
			other := bb.create(b, sandbox.Spec{Image: s.Image()})
			start := time.Now()
			must(b, other.Restore(ctx, ck.ID))
			first := time.Since(start)
			var l lat
			b.ResetTimer()
			for i := 0; i < b.N; i++ {
				l.time(func() { err = other.Restore(ctx, ck.ID) })
				must(b, err)
			}
			l.report(b, "")
			b.ReportMetric(float64(first.Microseconds())/1000, "first-ms")
		})
	}
}

// processPaths are the two ways a process is checkpointed.
var processPaths = []struct {
	name string
	mode sandbox.ProcessMode
	need func(testing.TB)
}{
	{"template", sandbox.ProcessesTemplate, func(testing.TB) {}},
	{"criu", sandbox.ProcessesCRIU, func(t testing.TB) { needCRIU(t) }},
}

// processSandbox starts a python3 process whose resident memory is about
// mb megabytes (python itself is about 8).
func processSandbox(b testing.TB, bb *bundle, mb int) *sandbox.Sandbox {
	s := bb.create(b, sandbox.Spec{Image: defaultImage(b, bb)})
	ctx := context.Background()
	extra := max(mb-8, 0) << 20
	code := fmt.Sprintf("import time\nheap = b'x' * %d\nopen('/tmp/ready', 'w').close()\nwhile True:\n    time.sleep(0.05)\n", extra)
	_, err := s.Exec(ctx, sandbox.ExecRequest{Argv: []string{"python3", "-c", code}, Background: true})
	must(b, err)
	waitFor(b, s, "[ -e /tmp/ready ]")
	return s
}

// BenchmarkRollbackAfterAllocWithProcess restores a checkpoint of an 8 MB
// python3 process after the copy running since the last restore allocated
// and wrote mb megabytes more (untimed): the restore ends a process with
// that much memory of its own, which its exit frees.
func BenchmarkRollbackAfterAllocWithProcess(b *testing.B) {
	for _, mb := range []int{64, 512} {
		b.Run(fmt.Sprintf("alloc=%dMB", mb), func(b *testing.B) {
			bb := setup(b)
			s := bb.create(b, sandbox.Spec{Image: defaultImage(b, bb)})
			ctx := context.Background()
			_, err := s.Exec(ctx, sandbox.ExecRequest{Argv: []string{"python3", "-c", growPy, fmt.Sprint(mb), "none"}, Background: true})
			must(b, err)
			waitFor(b, s, "[ -e /tmp/ready ]")
			ck, err := s.Checkpoint(ctx)
			must(b, err)
			must(b, s.Restore(ctx, ck.ID))
			waitFolded(b, bb)
			var l lat
			b.ResetTimer()
			for i := 0; i < b.N; i++ {
				b.StopTimer()
				sh(b, s, "touch /tmp/grow")
				waitFor(b, s, "[ -e /tmp/grown ]")
				b.StartTimer()
				l.time(func() { err = s.Restore(ctx, ck.ID) })
				must(b, err)
			}
			l.report(b, "")
		})
	}
}

// BenchmarkShm: a checkpoint, then a restore, of a sandbox whose /dev/shm
// holds one 4 KiB segment (a Postgres dynamic shared memory control
// segment's size), one of 8 MiB, or 256 of 4 KiB; a command changes one
// byte of it before each (not timed), so each copies and writes back the
// whole. The empty case is BenchmarkCheckpoint's and BenchmarkRollback's.
func BenchmarkShm(b *testing.B) {
	for _, c := range []struct {
		name        string
		files, size int
	}{{"4KiB", 1, 4 << 10}, {"8MiB", 1, 8 << 20}, {"256x4KiB", 256, 4 << 10}} {
		b.Run("shm="+c.name, func(b *testing.B) {
			bb := setup(b)
			s := bb.create(b, sandbox.Spec{})
			ctx := context.Background()
			fill := fmt.Sprintf("for i in $(seq %d); do dd if=/dev/urandom of=/dev/shm/seg$i bs=%d count=1 2>/dev/null; done", c.files, c.size)
			_, err := s.Exec(ctx, sandbox.ExecRequest{Command: fill})
			must(b, err)
			base, err := s.Checkpoint(ctx)
			must(b, err)
			change := sandbox.ExecRequest{Command: "printf x | dd of=/dev/shm/seg1 conv=notrunc 2>/dev/null"}
			var ck, rs lat
			b.ResetTimer()
			for i := 0; i < b.N; i++ {
				b.StopTimer()
				_, err := s.Exec(ctx, change)
				must(b, err)
				b.StartTimer()
				var info sandbox.CheckpointInfo
				ck.time(func() { info, err = s.Checkpoint(ctx) })
				must(b, err)
				b.StopTimer()
				_, err = s.Exec(ctx, change)
				must(b, err)
				b.StartTimer()
				rs.time(func() { err = s.Restore(ctx, base.ID) })
				must(b, err)
				b.StopTimer()
				must(b, bb.rt.ReleaseCheckpoint(info.ID))
				b.StartTimer()
			}
			ck.report(b, "checkpoint-")
			rs.report(b, "restore-")
		})
	}
}

// BenchmarkShmEmptyCheck: what a restore of template copies adds when
// processes ran and left /dev/shm empty (the common case with processes):
// an open, a statx and a directory read.
func BenchmarkShmEmptyCheck(b *testing.B) {
	bb := setup(b)
	s := bb.create(b, sandbox.Spec{})
	var l lat
	b.ResetTimer()
	for i := 0; i < b.N; i++ {
		var empty bool
		var err error
		l.time(func() { empty, err = s.ShmEmpty() })
		must(b, err)
		if !empty {
			b.Fatal("a new sandbox's /dev/shm is not empty")
		}
	}
	l.report(b, "")
}
