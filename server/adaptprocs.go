package server

import (
	"context"
	"log/slog"
	"runtime"
	"sync/atomic"
	"time"
)

// adaptProcs gives the Go scheduler twice its Ps (GOMAXPROCS, which follows
// the CPUs and any cgroup CPU limit) while requests queue, and its own number
// back once they stop.
//
// A rollback's system calls often wait in the kernel (overlay mounts on the
// mount namespace lock, the root swap's worker on RCU grace periods, file
// operations on copy-up), and a thread waiting in a system call keeps its P
// until the runtime's monitor takes it back, about every 0.5 ms here. With
// one P per CPU a CPU then sits idle while requests wait to run: under the
// rollback load test (64 sandboxes on 2 CPUs) a goroutine dump showed 115
// handlers runnable while 15% of the machine was idle, at 940–1,120
// rollbacks/s; with two Ps per CPU it was 96% busy, at 1,190–1,290. (Moving
// the longest wait, the old root's detach, out to a separate process
// instead did not help: the many shorter ones add up.) With few requests the extra Ps
// cost instead: idle ones wake threads that compete with the work, and a
// single client's Step or Restore took 10–15% longer. So the Ps are doubled
// only while more RPCs are in flight than there are Ps, for a few samples
// in a row, and given back after a second with no queue.
func adaptProcs(ctx context.Context, inflight *atomic.Int64, log *slog.Logger) {
	const (
		tick  = 20 * time.Millisecond
		raise = 3  // busy ticks in a row before doubling
		lower = 50 // calm ticks in a row before going back
	)
	base := runtime.GOMAXPROCS(0)
	t := time.NewTicker(tick)
	defer t.Stop()
	high, busy, calm := false, 0, 0
	for {
		select {
		case <-ctx.Done():
			if high {
				runtime.GOMAXPROCS(base)
			}
			return
		case <-t.C:
		}
		queued := inflight.Load() > int64(base)
		switch {
		case !high && queued:
			if busy++; busy >= raise {
				runtime.GOMAXPROCS(2 * base)
				high, busy = true, 0
				log.Debug("requests queue: more Go Ps", "procs", 2*base)
			}
		case !high:
			busy = 0
		case queued:
			calm = 0
		default:
			if calm++; calm >= lower {
				runtime.GOMAXPROCS(base)
				high, calm = false, 0
				log.Debug("no queue: Go Ps back", "procs", base)
			}
		}
	}
}
