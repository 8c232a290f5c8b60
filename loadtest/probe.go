package loadtest

import (
	"crypto/sha256"
	"runtime"

	"golang.org/x/sys/unix"
)

// speedProbe times a fixed task on one thread, for the timeline: how fast the machine runs
// user-space code, whatever the server does. A virtual machine's speed drifts with what its
// neighbours on the host do (the 2-vCPU VM deltagym is developed on varies by a third within
// minutes), and in a sustained run that reads as the server slowing down. The server's CPU
// per iteration and the probe's time rising together point at the machine; the first alone
// at the server. The probe is user-space work only: much of the server's cost is the
// kernel's (mounts, RCU, credentials), which a slower host can slow by another factor.
//
// The task hashes 1 MiB (SHA-256) and copies 8 MiB, through buffers bigger than the
// caches' share of a small machine, so that both the cores and the memory are measured. Its
// time is the thread's CPU time (CLOCK_THREAD_CPUTIME_ID): waiting for a CPU does not count,
// but what shares a physical core or the caches with it does, the run's own load included,
// so the probe compares like with like only while that load is steady.
type speedProbe struct {
	hash     []byte
	src, dst []byte
}

func newSpeedProbe() *speedProbe {
	p := &speedProbe{hash: make([]byte, 1<<20), src: make([]byte, 4<<20), dst: make([]byte, 4<<20)}
	for i := range p.src {
		p.src[i] = byte(i * 7)
	}
	copy(p.hash, p.src)
	p.run() // the buffers' first touch costs page faults
	return p
}

// run does the task and returns the CPU seconds it took; -1 when the thread's clock cannot
// be read.
func (p *speedProbe) run() float64 {
	runtime.LockOSThread()
	defer runtime.UnlockOSThread()
	var t0, t1 unix.Timespec
	if unix.ClockGettime(unix.CLOCK_THREAD_CPUTIME_ID, &t0) != nil {
		return -1
	}
	sum := sha256.Sum256(p.hash)
	p.dst[0] = sum[0]
	copy(p.dst, p.src)
	copy(p.src, p.dst)
	if unix.ClockGettime(unix.CLOCK_THREAD_CPUTIME_ID, &t1) != nil {
		return -1
	}
	return float64(t1.Nano()-t0.Nano()) / 1e9
}
