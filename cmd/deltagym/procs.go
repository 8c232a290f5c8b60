package main

import (
	"context"
	"log/slog"
	"os"
	"runtime"
	"runtime/metrics"
	"time"
)

// adaptProcs gives the Go scheduler twice its default Ps (GOMAXPROCS, which
// follows the CPUs and any cgroup CPU limit) while goroutines queue for
// them, and the default back once they stop. It returns when ctx ends,
// with the default restored. A GOMAXPROCS setting in the environment turns
// it off.
//
// A rollback's system calls often wait in the kernel (overlay mounts on the
// mount namespace lock, the root swap's worker on RCU grace periods, file
// operations on copy-up), and a thread waiting in a system call keeps its P
// until the runtime's monitor takes it back. With one P per CPU a CPU then
// sits idle while requests wait to run: under the rollback load test (64
// sandboxes on 2 CPUs) a goroutine dump shows handlers runnable while part
// of the machine is idle, and two Ps per CPU keep it busy and serve more
// rollbacks a second (docs/PERFORMANCE.md, "The server process" and
// "Figures behind design choices"). Moving the longest wait, the old root's
// detach, out of the server would not help: the many shorter ones add up.
// With few requests, extra Ps cost instead: idle ones wake threads that
// compete with the work, and a single client's restore takes longer with
// the Ps always doubled.
func adaptProcs(ctx context.Context, log *slog.Logger) {
	if os.Getenv("GOMAXPROCS") != "" {
		return
	}
	sample := []metrics.Sample{{Name: "/sched/goroutines/runnable:goroutines"}}
	var p procsPolicy
	t := time.NewTicker(procsTick)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			if p.high {
				runtime.SetDefaultGOMAXPROCS()
			}
			return
		case <-t.C:
		}
		metrics.Read(sample)
		var runnable uint64
		if sample[0].Value.Kind() == metrics.KindUint64 {
			runnable = sample[0].Value.Uint64()
		}
		switch p.step(runnable, runtime.GOMAXPROCS(0)) {
		case procsRaise:
			n := 2 * runtime.GOMAXPROCS(0)
			runtime.GOMAXPROCS(n)
			log.Debug("goroutines queue: more Go Ps", "procs", n)
		case procsLower:
			runtime.SetDefaultGOMAXPROCS()
			log.Debug("no queue: default Go Ps", "procs", runtime.GOMAXPROCS(0))
		}
	}
}

// procsTick is how often adaptProcs samples the run queue.
const procsTick = 20 * time.Millisecond

// procsPolicy decides, from samples of the number of runnable goroutines,
// when to double the Ps and when to go back: doubled after procsRaiseAfter
// samples in a row with at least as many runnable goroutines as Ps, back
// after procsLowerAfter samples in a row with fewer than the default's.
type procsPolicy struct {
	high       bool
	busy, calm int
	base       int // the default, while doubled
}

const (
	procsRaiseAfter = 3  // 60 ms of queue
	procsLowerAfter = 50 // a calm second
)

type procsChange int

const (
	procsKeep procsChange = iota
	procsRaise
	procsLower
)

// step takes one sample: runnable goroutines, with procs Ps now.
func (p *procsPolicy) step(runnable uint64, procs int) procsChange {
	if !p.high {
		if runnable < uint64(procs) {
			p.busy = 0
			return procsKeep
		}
		if p.busy++; p.busy < procsRaiseAfter {
			return procsKeep
		}
		p.high, p.busy, p.calm, p.base = true, 0, 0, procs
		return procsRaise
	}
	if runnable >= uint64(p.base) {
		p.calm = 0
		return procsKeep
	}
	if p.calm++; p.calm < procsLowerAfter {
		return procsKeep
	}
	p.high, p.calm = false, 0
	return procsLower
}
