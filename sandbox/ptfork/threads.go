//go:build linux && amd64

package ptfork

import (
	"bytes"
	"encoding/binary"
	"errors"
	"fmt"
	"os"
	"slices"
	"strconv"
	"time"
	"unsafe"

	"golang.org/x/sys/unix"
)

// A multithreaded process is seized thread by thread (Seize): each thread
// is a Proc of the session, stopped on its own, and the leader's Proc lists
// the others. A copy (Fork) is the leader's clone, to which one thread is
// added per other thread of the original by a clone(CLONE_THREAD) injected
// into the copy; each added thread is given, before it runs, what is its
// own in the original: its registers (fs_base, the TLS pointer, among
// them), its FPU and vector state, its signal mask, its registration of a
// restartable sequence area, its robust futex list, the address the kernel
// clears at its exit (pthread_join waits on it), its alternate signal
// stack and its name. What threads share — memory, descriptors, cwd,
// signal handlers — the copy shares among its own threads, as one clone.
//
// Thread ids are new: the kernel hands them out, and a process cannot
// choose its own. A thread stopped in a system call that restarts with
// restart_syscall (a relative sleep, a futex wait with a relative timeout)
// sees EINTR in a copy instead: the restart's arguments are kept in the
// thread's kernel state, which a new thread has from the one that cloned
// it, not from the thread it copies.

// Kernel values not in x/sys/unix.
const (
	ptraceGetSigmask    = 0x420a
	ptraceSetSigmask    = 0x420b
	ptraceGetRseqConfig = 0x420f
	ntX86Xstate         = 0x202
	prGetTIDAddress     = 40
	xstateMax           = 16 << 10 // larger than any x86 XSAVE area
	ssOnstack           = 1
	ssDisable           = 2
)

// MaxThreads is the most threads Seize takes in one process. A copy costs
// a few injected calls per thread (BenchmarkForkThreads); a process with
// hundreds of threads is a job for a dump, not a copy at every restore.
const MaxThreads = 64

// threadCloneFlags are the flags of the clone that adds a thread to a copy:
// those of glibc's pthread_create, with the TLS and the clear-at-exit
// address given by the call.
const threadCloneFlags = unix.CLONE_VM | unix.CLONE_FS | unix.CLONE_FILES | unix.CLONE_SIGHAND |
	unix.CLONE_THREAD | unix.CLONE_SYSVSEM | unix.CLONE_SETTLS | unix.CLONE_CHILD_CLEARTID

// threadState is what a thread has of its own beyond its general
// registers, read from a stopped thread (readState) and given to a new one
// (setState).
type threadState struct {
	xstate   []byte // the XSAVE area (PTRACE_GETREGSET NT_X86_XSTATE)
	sigmask  uint64
	rseq     rseqConfig
	robust   [2]uint64 // head, length
	clearTID uint64
	altstack altStack
	comm     []byte
}

// rseqConfig is struct ptrace_rseq_configuration.
type rseqConfig struct {
	Pointer   uint64
	Size      uint32
	Signature uint32
	Flags     uint32
	Pad       uint32
}

// altStack is stack_t.
type altStack struct {
	Sp    uint64
	Flags int32
	_     int32
	Size  uint64
}

// Threads is the number of threads of the seized process p: 1, or 1 and
// those Seize listed.
func (p *Proc) Threads() int { return 1 + len(p.threads) }

// ThreadStates are the states of a copy's threads beyond their registers,
// by thread id: what Fork gave them. A copy that never runs (a template)
// keeps them, so a later Fork of it is given them (UseStates) instead of
// reading them from its threads again, which takes injected calls.
type ThreadStates map[int]*threadState

// States returns the states Fork gave copy c's threads.
func (c *Proc) States() ThreadStates {
	if len(c.threads) == 0 {
		return nil
	}
	st := make(ThreadStates, len(c.threads))
	for _, t := range c.threads {
		st[t.Pid] = t.state
	}
	return st
}

// UseStates gives seized process p the states of its threads, as States
// returned them when p was made and p has not run since: Fork reads only
// those of threads st lacks.
func (p *Proc) UseStates(st ThreadStates) {
	for _, t := range p.threads {
		if s := st[t.Pid]; s != nil {
			t.state = s
		}
	}
}

// StopOnDetach has Detach leave stopped process p stopped (SIGSTOP),
// every thread of it: each is detached with the signal pending, so none
// runs an instruction of its own before the group stops.
func (p *Proc) StopOnDetach() {
	p.Signal = unix.SIGSTOP
	for _, t := range p.threads {
		t.Signal = unix.SIGSTOP
	}
}

// Rest is where a thread was when it stopped, as far as what the kernel
// writes into its memory goes: the system call the stop interrupted, and
// its restartable-sequences area.
type Rest struct {
	Tid int // host thread id
	// Nr is the system call the stop interrupted (-1: none), with its
	// arguments. A call the kernel had restarted before by restart_syscall
	// (a relative sleep an earlier stop interrupted) is SYS_RESTART_SYSCALL:
	// which call it restarts the kernel alone knows, and its arguments are
	// those still in the registers (the restarted call's, as the kernel leaves them).
	Nr   int64
	Args [6]uint64
	// Rip and Rsp are the instruction and stack pointers at the stop.
	Rip, Rsp uint64
	// Rseq is the address of the thread's rseq area and RseqSize its size
	// (0: none registered).
	Rseq     uint64
	RseqSize uint32
}

// Rests returns where each thread of stopped process p was at its stop,
// the leader first.
func (p *Proc) Rests() ([]Rest, error) {
	out := make([]Rest, 0, 1+len(p.threads))
	for _, t := range append([]*Proc{p}, p.threads...) {
		if !t.stopped {
			return nil, fmt.Errorf("%w: thread %d is not stopped", ErrStop, t.Pid)
		}
		r := t.rest
		var rc rseqConfig
		if t.state != nil {
			rc = t.state.rseq
		} else if err := ptracePtr(ptraceGetRseqConfig, t.Pid, unsafe.Sizeof(rc), unsafe.Pointer(&rc)); err != nil {
			return nil, fmt.Errorf("reading the rseq registration of thread %d: %w", t.Pid, err)
		}
		r.Tid, r.Rseq, r.RseqSize = t.Pid, rc.Pointer, rc.Size
		out = append(out, r)
	}
	return out, nil
}

// tasks lists pid's threads, the leader first.
func tasks(pid int) ([]int, error) {
	f, err := os.Open("/proc/" + strconv.Itoa(pid) + "/task")
	if err != nil {
		return nil, fmt.Errorf("%w: pid %d: %w", ErrGone, pid, err)
	}
	defer f.Close()
	names, err := f.Readdirnames(-1)
	if err != nil {
		return nil, fmt.Errorf("%w: pid %d: %w", ErrGone, pid, err)
	}
	tids := []int{pid}
	for _, n := range names {
		if tid, err := strconv.Atoi(n); err == nil && tid != pid {
			tids = append(tids, tid)
		}
	}
	if len(names) == 0 {
		return nil, fmt.Errorf("%w: pid %d has no threads left", ErrGone, pid)
	}
	return tids, nil
}

// seizeThreads seizes the threads of the group whose leader p is, but the
// leader, as p's threads.
func (p *Proc) seizeThreads(tids []int) error {
	for _, tid := range tids[1:] {
		if err := p.addSeized(tid); err != nil {
			return err
		}
	}
	return nil
}

// addSeized seizes thread tid of p's group (or takes it as the session
// attached it at its birth) into p's threads. A thread gone meanwhile is
// left out.
func (p *Proc) addSeized(tid int) error {
	t := p.s.procs[tid]
	if t == nil || !t.attached {
		var err error
		if t, err = p.s.seize(tid); err != nil {
			if errors.Is(err, ErrGone) {
				return nil
			}
			return err
		}
	}
	t.group = p
	p.threads = append(p.threads, t)
	return nil
}

// waitThreads waits, until deadline, for each of p's threads to stop, and
// takes in the threads the group gained meanwhile (a thread that had not
// stopped yet may have started one), until a listing finds none new.
// Threads that ended are dropped.
func (p *Proc) waitThreads(deadline time.Time) error {
	for {
		for i := 0; i < len(p.threads); i++ {
			t := p.threads[i]
			if t.stopped {
				continue
			}
			if err := t.WaitFor(time.Until(deadline)); err != nil {
				if !errors.Is(err, ErrGone) {
					return err
				}
				p.threads = slices.Delete(p.threads, i, i+1)
				i--
			}
		}
		tids, err := tasks(p.Pid)
		if err != nil {
			return err
		}
		fresh := false
		for _, tid := range tids[1:] {
			if !slices.ContainsFunc(p.threads, func(t *Proc) bool { return t.Pid == tid }) {
				if err := p.addSeized(tid); err != nil {
					return err
				}
				fresh = true
			}
		}
		if !fresh {
			return nil
		}
		if len(p.threads)+1 > MaxThreads {
			return fmt.Errorf("%w: pid %d started threads while stopping, past %d", ErrThreads, p.Pid, MaxThreads)
		}
	}
}

// readState reads the state of stopped thread t that a copy of it needs,
// using scratch, a page of its group's memory, for the two values only the
// thread itself can tell (its clear-at-exit address and its alternate
// signal stack).
func (t *Proc) readState(scratch uintptr) (*threadState, error) {
	st := &threadState{xstate: make([]byte, xstateMax)}
	iov := unix.Iovec{Base: &st.xstate[0], Len: xstateMax}
	if err := ptracePtr(unix.PTRACE_GETREGSET, t.Pid, ntX86Xstate, unsafe.Pointer(&iov)); err != nil {
		return nil, fmt.Errorf("reading the vector state of thread %d: %w", t.Pid, err)
	}
	st.xstate = st.xstate[:iov.Len]
	if err := ptracePtr(ptraceGetSigmask, t.Pid, 8, unsafe.Pointer(&st.sigmask)); err != nil {
		return nil, fmt.Errorf("reading the signal mask of thread %d: %w", t.Pid, err)
	}
	if err := ptracePtr(ptraceGetRseqConfig, t.Pid, unsafe.Sizeof(st.rseq), unsafe.Pointer(&st.rseq)); err != nil {
		return nil, fmt.Errorf("reading the rseq registration of thread %d: %w", t.Pid, err)
	}
	if _, _, e := unix.Syscall(unix.SYS_GET_ROBUST_LIST, uintptr(t.Pid),
		uintptr(unsafe.Pointer(&st.robust[0])), uintptr(unsafe.Pointer(&st.robust[1]))); e != 0 {
		return nil, fmt.Errorf("reading the robust futex list of thread %d: %w", t.Pid, e)
	}
	if _, err := t.Syscall(unix.SYS_PRCTL, prGetTIDAddress, scratch); err != nil {
		return nil, fmt.Errorf("reading the clear-at-exit address of thread %d: %w", t.Pid, err)
	}
	if _, err := t.Syscall(unix.SYS_SIGALTSTACK, 0, scratch+8); err != nil {
		return nil, fmt.Errorf("reading the alternate signal stack of thread %d: %w", t.Pid, err)
	}
	var b [8 + unsafe.Sizeof(altStack{})]byte
	if err := t.Read(scratch, b[:]); err != nil {
		return nil, err
	}
	st.clearTID = binary.NativeEndian.Uint64(b[:8])
	st.altstack = *(*altStack)(unsafe.Pointer(&b[8]))
	st.comm = t.comm()
	return st, nil
}

// comm is the name of stopped thread t (nil if it cannot be read).
func (t *Proc) comm() []byte {
	path := "/proc/" + strconv.Itoa(t.Pid) + "/comm"
	if t.group != nil {
		path = "/proc/" + strconv.Itoa(t.group.Pid) + "/task/" + strconv.Itoa(t.Pid) + "/comm"
	}
	comm, _ := os.ReadFile(path)
	return bytes.TrimSuffix(comm, []byte("\n"))
}

// forkThreads adds to copy c, the clone of p's leader, one thread for each
// of p's other threads, each stopped with that thread's state. On error
// the caller kills c.
func (p *Proc) forkThreads(c *Proc) error {
	if err := p.readStates(); err != nil {
		return err
	}
	cs := c.Scratch()
	defer func() { _ = cs.Release() }()
	inherited := c.comm()
	for _, t := range p.threads {
		nt, err := c.addThread(t, cs, inherited)
		if nt != nil {
			nt.group = c
			c.threads = append(c.threads, nt)
		}
		if err != nil {
			return fmt.Errorf("copying thread %d of pid %d: %w", t.Pid, p.Pid, err)
		}
	}
	return cs.Release()
}

// readStates reads the state of each of p's threads that has none yet,
// through a scratch page of p's memory.
func (p *Proc) readStates() error {
	var sp *Scratch
	var scratch uintptr
	for _, t := range p.threads {
		if t.state != nil {
			continue
		}
		if sp == nil {
			sp = p.Scratch()
			var err error
			if scratch, err = sp.Put(""); err != nil {
				return err
			}
		}
		if t.sysAddr == 0 {
			t.sysAddr = p.sysAddr // one address space
		}
		st, err := t.readState(scratch)
		if err != nil {
			return errors.Join(err, sp.Release())
		}
		t.state = st
	}
	if sp == nil {
		return nil
	}
	return sp.Release()
}

// addThread clones a thread into copy c, gives it t's registers and the
// rest of its state, and returns it stopped (inherited is c's name, which
// the thread is born with). It is returned, if it was
// made, even on error.
func (c *Proc) addThread(t *Proc, cs *Scratch, inherited []byte) (*Proc, error) {
	st := t.state
	regs := t.Regs
	if t.restartBlock {
		// The restart would run c's restart block, not t's: return EINTR.
		regs.Rip += 2
		eintr := -int64(unix.EINTR)
		regs.Rax = uint64(eintr)
	}
	_, tid, err := c.syscall(unix.SYS_CLONE, []uintptr{threadCloneFlags, uintptr(regs.Rsp), 0, uintptr(st.clearTID), uintptr(regs.Fs_base)})
	if tid > 0 {
		nt := &Proc{s: c.s, Pid: tid, attached: true, stopped: true, sysAddr: c.sysAddr, Regs: regs, pinned: c.pinned, mask: c.mask, state: st}
		c.s.procs[tid] = nt
		if err != nil {
			return nt, err
		}
		return nt, nt.takeState(st, cs, inherited)
	}
	if err == nil {
		err = fmt.Errorf("%w: thread clone in pid %d reported no thread", ErrStop, c.Pid)
	}
	return nil, err
}

// takeState waits for new thread nt's first stop and gives it its
// registers and st; its name is inherited, the one set only if it
// differs.
func (nt *Proc) takeState(st *threadState, cs *Scratch, inherited []byte) error {
	if err := nt.awaitBirth(); err != nil {
		return err
	}
	iov := unix.Iovec{Base: &st.xstate[0], Len: uint64(len(st.xstate))}
	if err := ptracePtr(unix.PTRACE_SETREGSET, nt.Pid, ntX86Xstate, unsafe.Pointer(&iov)); err != nil {
		return fmt.Errorf("setting the vector state: %w", err)
	}
	if err := ptracePtr(ptraceSetSigmask, nt.Pid, 8, unsafe.Pointer(&st.sigmask)); err != nil {
		return fmt.Errorf("setting the signal mask: %w", err)
	}
	if st.rseq.Size > 0 {
		if _, err := nt.Syscall(unix.SYS_RSEQ, uintptr(st.rseq.Pointer), uintptr(st.rseq.Size), 0, uintptr(st.rseq.Signature)); err != nil {
			return fmt.Errorf("registering its rseq area: %w", err)
		}
	}
	if st.robust[0] != 0 {
		if _, err := nt.Syscall(unix.SYS_SET_ROBUST_LIST, uintptr(st.robust[0]), uintptr(st.robust[1])); err != nil {
			return fmt.Errorf("setting its robust futex list: %w", err)
		}
	}
	if st.altstack.Flags&ssDisable == 0 {
		ss := st.altstack
		ss.Flags &^= ssOnstack // a state sigaltstack reports, not a flag it takes
		b := unsafe.Slice((*byte)(unsafe.Pointer(&ss)), unsafe.Sizeof(ss))
		a, err := cs.Put(string(b))
		if err == nil {
			_, err = nt.Syscall(unix.SYS_SIGALTSTACK, a, 0)
		}
		if err != nil {
			return fmt.Errorf("setting its alternate signal stack: %w", err)
		}
	}
	if len(st.comm) > 0 && !bytes.Equal(st.comm, inherited) {
		a, err := cs.Put(string(st.comm))
		if err == nil {
			_, err = nt.Syscall(unix.SYS_PRCTL, unix.PR_SET_NAME, a)
		}
		if err != nil {
			return fmt.Errorf("setting its name: %w", err)
		}
	}
	return unix.PtraceSetRegs(nt.Pid, &nt.Regs)
}

func ptracePtr(req, pid int, addr uintptr, data unsafe.Pointer) error {
	if _, _, e := unix.Syscall6(unix.SYS_PTRACE, uintptr(req), uintptr(pid), addr, uintptr(data), 0, 0); e != 0 {
		return e
	}
	return nil
}
