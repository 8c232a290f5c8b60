package procstate

import (
	"slices"

	"golang.org/x/sys/unix"

	"github.com/deltagym/deltagym/sandbox/ptfork"
)

// Span is a range of a process's memory: Len bytes at Addr.
type Span struct {
	Addr uint64 `json:"addr"`
	Len  uint64 `json:"len"`
}

// What the kernel writes into a captured process's memory that is not the
// program's state, so that a process at rest captured twice holds the same
// memory but for these bytes (sandbox's processes digest leaves them out):
//
//   - Each thread's rseq area: the kernel writes the CPU, NUMA node and
//     concurrency id the thread runs on (cpu_id_start, cpu_id, node_id,
//     mm_cid) whenever it returns to user space after a migration or a
//     preemption, so the capture's own stop (and the CPU a ptrace session
//     pins its tracees to) changes them. rseq_cs and flags are the
//     program's and stay.
//   - The time left that a sleep or wait the capture's stop interrupted
//     writes back into its caller's struct: a relative nanosleep or
//     clock_nanosleep's rem, select's timeval, pselect6's and ppoll's
//     timespec. The stop wrote it, and it is the clock's reading, not
//     something the program did.

// rseq field offsets of struct rseq (uapi linux/rseq.h).
const (
	rseqCPUEnd  = 8  // cpu_id_start, cpu_id
	rseqNodeOff = 20 // node_id, mm_cid
	rseqNodeEnd = 28
)

// Wait is a sleep or wait with a time left that a thread of a captured
// process rested in: the call, its arguments, and the instruction and stack
// pointers it rested at. A later capture that finds a thread in
// restart_syscall at the same pointers with the same arguments (the same
// wait, restarted after the earlier stop, in the process or in a copy of
// its template) knows the call by it.
type Wait struct {
	Nr   int64     `json:"nr"`
	Args [6]uint64 `json:"args"`
	Rip  uint64    `json:"rip"`
	Rsp  uint64    `json:"rsp"`
}

// kernelWrites returns the spans the kernel wrote of a process stopped
// with rests (ptfork.Proc.Rests), sorted, and the waits with a time left
// its threads rest in; a thread in restart_syscall is known by a wait of
// known that matches it.
func kernelWrites(rests []ptfork.Rest, known []Wait) ([]Span, []Wait) {
	var out []Span
	var waits []Wait
	for _, r := range rests {
		if r.Rseq != 0 {
			out = append(out, Span{Addr: r.Rseq, Len: min(uint64(r.RseqSize), rseqCPUEnd)})
			if r.RseqSize >= rseqNodeEnd {
				out = append(out, Span{Addr: r.Rseq + rseqNodeOff, Len: rseqNodeEnd - rseqNodeOff})
			}
		}
		w := Wait{Nr: r.Nr, Args: r.Args, Rip: r.Rip, Rsp: r.Rsp}
		if w.Nr == unix.SYS_RESTART_SYSCALL {
			if i := slices.IndexFunc(known, func(k Wait) bool {
				return k.Rip == w.Rip && k.Rsp == w.Rsp && k.Args == w.Args
			}); i >= 0 {
				w.Nr = known[i].Nr
			}
		}
		if a := timeLeftArg(w); a != 0 {
			out = append(out, Span{Addr: a, Len: 16}) // struct timespec or timeval
			waits = append(waits, w)
		}
	}
	slices.SortFunc(out, func(a, b Span) int {
		if a.Addr < b.Addr {
			return -1
		}
		if a.Addr > b.Addr {
			return 1
		}
		return 0
	})
	return slices.Compact(out), waits
}

// timeLeftArg is the address at which call w writes the time it had left
// when a stop interrupted it (0: none).
func timeLeftArg(w Wait) uint64 {
	switch w.Nr {
	case unix.SYS_NANOSLEEP:
		return w.Args[1]
	case unix.SYS_CLOCK_NANOSLEEP:
		if w.Args[1]&unix.TIMER_ABSTIME == 0 {
			return w.Args[3]
		}
	case unix.SYS_SELECT, unix.SYS_PSELECT6:
		return w.Args[4]
	case unix.SYS_PPOLL:
		return w.Args[2]
	}
	return 0
}

// noteKernelWrites records in t the spans the kernel wrote of stopped
// process p and the waits it rests in. Rests that cannot be read (a kernel
// without PTRACE_GET_RSEQ_CONFIGURATION) leave t without spans: its
// memory is hashed whole.
func (ps *State) noteKernelWrites(p *ptfork.Proc, t *Template) {
	rests, err := p.Rests()
	if err != nil {
		return
	}
	ps.mu.Lock()
	known := ps.waits
	ps.mu.Unlock()
	t.KernelWrites, t.Waits = kernelWrites(rests, known)
}
