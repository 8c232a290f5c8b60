//go:build linux && amd64

// Package ptfork copies running, unmodified, single-threaded processes by
// ptrace injection: the process is seized and interrupted, a
// clone(CLONE_PARENT|SIGCHLD) is executed in its own context at a `syscall`
// instruction of its vDSO, and the copy is given the registers the process
// had when it stopped. The copy shares the process's memory copy-on-write,
// its open file descriptions, root and cwd; the caller fixes up what must not
// be shared by injecting further system calls into the stopped copy (Proc.Syscall)
// before it lets the copy run.
//
// Every system call is made by the traced process itself, so it meets that
// process's seccomp filter, capabilities and credentials: nothing here needs
// the target to be privileged. The tracer needs CAP_SYS_PTRACE over the
// target (the server runs as host root) and must make every ptrace request of
// one attachment from the same OS thread: a Session locks the calling
// goroutine to its thread until Close.
//
// A multithreaded process is copied whole: each of its threads is seized,
// and the copy gets one thread per thread of the process (threads.go). The
// target's children are not copied (a process tree is the caller's
// business).
//
// One injected system call costs two ptrace stops. What a copy costs, with
// the tracer and the process on one CPU and across two (see Session), is
// BenchmarkFork8MB's, in docs/PERFORMANCE.md.
package ptfork

import (
	"bytes"
	"encoding/binary"
	"errors"
	"fmt"
	"os"
	"runtime"
	"strconv"
	"strings"
	"sync"
	"time"
	"unsafe"

	"golang.org/x/sys/unix"

	"github.com/deltagym/deltagym/sandbox/cpupin"
)

// Sentinel errors.
var (
	// ErrThreads: the threads of a process cannot be copied: more than
	// MaxThreads, or its main thread has exited while others run.
	ErrThreads = errors.New("threads cannot be copied")
	// ErrGone: the process no longer exists.
	ErrGone = errors.New("process is gone")
	// ErrStop: the process did not stop as expected.
	ErrStop = errors.New("unexpected ptrace stop")
	// ErrNoStop: a seized process did not stop within the time given.
	ErrNoStop = errors.New("process did not stop")
)

// Kernel values not in x/sys/unix under these names.
const (
	ptraceEventStop      = 128
	ptraceOTraceSysgood  = 1
	kcmpVM               = 1
	erestartsys          = 512
	erestartnointr       = 513
	erestartnohand       = 514
	erestartRestartblock = 516
)

// Session is one thread's set of attachments. All methods must be called
// from the goroutine that called NewSession, and Close must be called.
//
// A session runs on one CPU: its thread, and each process it seizes for as
// long as it is attached. Every ptrace request is a round trip between the
// tracer and the tracee, and a copy is born where its parent runs: on one
// CPU each hand-over is a plain switch, while across CPUs it wakes an idle
// CPU first, which on a VM goes through the hypervisor and costs more than
// the request itself (BenchmarkFork8MB). Pinning is best effort (a cpuset
// that excludes the CPU leaves the process where it is); each process gets
// its own CPU mask back when it is detached, a copy its parent's.
type Session struct {
	procs  map[int]*Proc
	cpu    unix.CPUSet // the session's CPU, if pinned
	old    unix.CPUSet // the thread's mask before
	pinned bool
	// stuck: a tracee could not be detached (it never stopped). The
	// thread stays locked so that it ends with its goroutine, and the
	// kernel detaches its tracees then.
	stuck bool
	// unfollowed: the processes seized do not take the children they fork
	// into the session (Unfollowed).
	unfollowed bool
}

// Unfollowed makes the session's seizes leave a tracee's new children
// alone (no PTRACE_O_TRACEFORK or TRACECLONE), for a session that injects
// no fork and finds new processes by listing them: a child attached at
// its birth stays stopped, and keeps its parent in a vfork, until the
// session takes it up. It returns s.
func (s *Session) Unfollowed() *Session {
	s.unfollowed = true
	return s
}

// init keeps the main goroutine on the main thread (an init's
// LockOSThread does), so no session runs there: the main thread never ends,
// and a session whose tracee would not stop relies on its thread ending
// (Close).
func init() { runtime.LockOSThread() }

// NewSession locks the calling goroutine to its OS thread and pins the
// thread to the CPU it runs on.
func NewSession() *Session {
	runtime.LockOSThread()
	s := &Session{procs: map[int]*Proc{}}
	if cpu, err := cpupin.Current(); err == nil && unix.SchedGetaffinity(0, &s.old) == nil {
		s.cpu = cpupin.Set(cpu)
		s.pinned = unix.SchedSetaffinity(0, &s.cpu) == nil
	}
	return s
}

// pin moves p onto the session's CPU, keeping its mask for unpin.
func (s *Session) pin(p *Proc) {
	if !s.pinned || unix.SchedGetaffinity(p.Pid, &p.mask) != nil {
		return
	}
	p.pinned = unix.SchedSetaffinity(p.Pid, &s.cpu) == nil
}

// unpin gives p its own mask back.
func (p *Proc) unpin() error {
	if !p.pinned {
		return nil
	}
	p.pinned = false
	if err := unix.SchedSetaffinity(p.Pid, &p.mask); err != nil && !errors.Is(err, unix.ESRCH) {
		return fmt.Errorf("restoring the CPU mask of pid %d: %w", p.Pid, err)
	}
	return nil
}

// Close detaches from every process still attached (restoring the
// registers each had when it stopped) and unlocks the thread. Errors are
// joined. If a process would not stop to be detached, the thread stays
// locked to the goroutine: it ends with it, and the kernel detaches the
// process then.
func (s *Session) Close() error {
	var errs []error
	for _, p := range s.procs {
		errs = append(errs, p.Detach())
	}
	if s.pinned {
		if err := unix.SchedSetaffinity(0, &s.old); err != nil {
			// A thread stuck on one CPU must not go back to the runtime.
			return errors.Join(append(errs, fmt.Errorf("restoring the tracer's CPU mask: %w", err))...)
		}
	}
	if !s.stuck {
		runtime.UnlockOSThread()
	}
	return errors.Join(errs...)
}

// Proc is a process stopped under a Session.
type Proc struct {
	s   *Session
	Pid int // host pid
	// Regs are the registers at the stop, with an interrupted system call
	// rewound so that it restarts when these registers are resumed.
	Regs unix.PtraceRegs
	// Signal is a signal that was being delivered when the process stopped;
	// Detach delivers it.
	Signal   unix.Signal
	sysAddr  uint64
	attached bool
	stopped  bool // its registers are saved
	pinned   bool
	mask     unix.CPUSet // its own, while pinned
	// threads are the other threads of a process seized whole (Seize),
	// each stopped on its own; group is a thread's leader.
	threads []*Proc
	group   *Proc
	// restartBlock: Regs restart the interrupted call with restart_syscall.
	restartBlock bool
	// rest is where the thread was at the stop (Rests).
	rest Rest
	// state is a thread's own state beyond its registers, once read or
	// given (threads.go).
	state *threadState
}

// Attach seizes the process and waits for it to stop. The process must be
// runnable (not frozen by a cgroup) for the stop to come; for a frozen one
// call Seize, thaw, then Wait.
func (s *Session) Attach(pid int) (*Proc, error) {
	p, err := s.Seize(pid)
	if err != nil {
		return nil, err
	}
	if err := p.Wait(); err != nil {
		p.attached = false
		_ = unix.PtraceDetach(pid)
		delete(s.procs, pid)
		return nil, err
	}
	return p, nil
}

// Seize attaches to pid and asks it to stop, without waiting: every thread
// of it, each a Proc of the session, listed by the leader's (Threads). A
// child the session attached when a tracee forked is returned as it is:
// its first stop is already on its way.
func (s *Session) Seize(pid int) (*Proc, error) {
	if p := s.procs[pid]; p != nil && p.attached && !p.stopped {
		return p, nil
	}
	tids, err := tasks(pid)
	if err != nil {
		return nil, err
	}
	if len(tids) > MaxThreads {
		return nil, fmt.Errorf("%w: pid %d has %d threads, more than %d", ErrThreads, pid, len(tids), MaxThreads)
	}
	if len(tids) > 1 {
		// A zombie leader cannot be seized (EPERM), nor run the clone.
		if st, err := State(pid); err == nil && st == 'Z' {
			return nil, fmt.Errorf("%w: the main thread of pid %d has exited and its other threads run on", ErrThreads, pid)
		}
	}
	p, err := s.seize(pid)
	if err != nil {
		return nil, err
	}
	if len(tids) > 1 {
		if err := p.seizeThreads(tids); err != nil {
			return nil, errors.Join(err, p.Detach())
		}
	}
	return p, nil
}

// SeizeLeader is Seize for a process of any number of threads: it attaches
// to the thread-group leader only, so calls injected run in that thread
// while the others go on (or stay in a stop of their own). Fork is not for
// such a Proc: a copy would have the leader's thread alone. A child the
// session attached when a tracee forked is returned as it is, as by Seize.
func (s *Session) SeizeLeader(pid int) (*Proc, error) {
	if p := s.procs[pid]; p != nil && p.attached && !p.stopped {
		return p, nil
	}
	return s.seize(pid)
}

func (s *Session) seize(pid int) (*Proc, error) {
	// Onto the session's CPU first, while it sleeps: the interrupt then
	// wakes it here, and nothing has to migrate a running task.
	p := &Proc{s: s, Pid: pid}
	s.pin(p)
	opts := uintptr(ptraceOTraceSysgood)
	if !s.unfollowed {
		opts |= unix.PTRACE_O_TRACEFORK | unix.PTRACE_O_TRACECLONE
	}
	if err := ptrace(unix.PTRACE_SEIZE, pid, 0, opts); err != nil {
		_ = p.unpin()
		if errors.Is(err, unix.ESRCH) || errors.Is(err, unix.EPERM) && exited(pid) {
			return nil, fmt.Errorf("%w: pid %d", ErrGone, pid)
		}
		return nil, fmt.Errorf("seizing pid %d: %w", pid, err)
	}
	if err := ptrace(unix.PTRACE_INTERRUPT, pid, 0, 0); err != nil {
		_ = unix.PtraceDetach(pid)
		_ = p.unpin()
		return nil, fmt.Errorf("interrupting pid %d: %w", pid, err)
	}
	p.attached = true
	s.procs[pid] = p
	return p, nil
}

// Wait waits for a seized process, every thread of it, to stop and saves
// their registers.
func (p *Proc) Wait() error {
	for {
		ws, err := wait(p.Pid)
		if err != nil {
			return err
		}
		if done, err := p.settle(ws); done {
			if err != nil || len(p.threads) == 0 {
				return err
			}
			return p.waitThreads(time.Now().Add(24 * time.Hour))
		}
	}
}

// WaitFor is Wait for at most d. A process that does not stop by then
// (one in a vfork whose child has not called exec, or in an uninterruptible
// sleep) fails with ErrNoStop, naming its state; it stays seized, and its
// stop is still pending.
//
// It polls: no wait call takes a time limit. The first polls yield the CPU,
// which goes to the process when both are pinned to the session's CPU, so
// a prompt stop is seen at once; then the pauses double up to a millisecond.
func (p *Proc) WaitFor(d time.Duration) error {
	deadline := time.Now().Add(d)
	pause := time.Duration(0)
	for tries := 0; ; tries++ {
		var ws unix.WaitStatus
		wpid, err := unix.Wait4(p.Pid, &ws, unix.WALL|unix.WNOHANG, nil)
		switch {
		case err == unix.EINTR:
			continue
		case err != nil:
			return fmt.Errorf("waiting for pid %d: %w", p.Pid, err)
		case wpid == p.Pid:
			if done, err := p.settle(ws); done {
				if err != nil || len(p.threads) == 0 {
					return err
				}
				return p.waitThreads(deadline)
			}
			continue
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("%w: pid %d, %s, within %v", ErrNoStop, p.Pid, describe(p.Pid), d)
		}
		if tries < 32 {
			_, _, _ = unix.RawSyscall(unix.SYS_SCHED_YIELD, 0, 0, 0)
			continue
		}
		pause = min(max(2*pause, 20*time.Microsecond), time.Millisecond)
		time.Sleep(pause)
	}
}

// settle handles one wait status of a process Wait waits for: done once
// it has stopped (its registers saved) or ended (ErrGone). A fork, vfork
// or clone stop (PTRACE_O_TRACEFORK and CLONE are set for injection) leaves
// the new child attached to the session: it is recorded, so that Seize
// returns it and Close detaches it.
func (p *Proc) settle(ws unix.WaitStatus) (bool, error) {
	if ws.Exited() || ws.Signaled() {
		p.attached = false
		delete(p.s.procs, p.Pid)
		return true, fmt.Errorf("%w: pid %d ended while stopping", ErrGone, p.Pid)
	}
	if !ws.Stopped() {
		return false, nil
	}
	sig := ws.StopSignal()
	switch c := ws.TrapCause(); {
	case c == unix.PTRACE_EVENT_FORK || c == unix.PTRACE_EVENT_VFORK || c == unix.PTRACE_EVENT_CLONE:
		if msg, err := unix.PtraceGetEventMsg(p.Pid); err == nil && msg > 0 && p.s.procs[int(msg)] == nil {
			c := &Proc{s: p.s, Pid: int(msg), attached: true}
			p.s.procs[c.Pid] = c
		}
	case c == ptraceEventStop || sig == unix.SIGTRAP:
	default:
		// A signal-delivery stop: the signal was dequeued; deliver it on
		// detach. The process is stopped all the same.
		p.Signal = sig
	}
	return true, p.saveRegs()
}

// describe is pid's state and the kernel function it sleeps in, for an
// error message.
func describe(pid int) string {
	state := "state unknown"
	if f, err := statFields(pid); err == nil {
		state = "state " + f[0]
	}
	if w, err := os.ReadFile("/proc/" + strconv.Itoa(pid) + "/wchan"); err == nil && len(w) > 0 && string(w) != "0" {
		state += " in " + string(w)
	}
	return state
}

// Scratch is a page of a stopped tracee's memory for the arguments of the
// system calls injected into it, mapped when first needed (not on the
// stack: the tracee may run on a stack of its own making, with live data
// below its stack pointer), and unmapped by Release.
type Scratch struct {
	p    *Proc
	addr uintptr
	ok   bool // mapped
}

const scratchSize = 4096

// Scratch returns p's scratch page, not mapped yet.
func (p *Proc) Scratch() *Scratch { return &Scratch{p: p} }

// Put writes s, NUL-terminated, at the start of the page and returns its
// address in the tracee.
func (m *Scratch) Put(s string) (uintptr, error) {
	b := append([]byte(s), 0)
	if len(b) > scratchSize {
		return 0, fmt.Errorf("path too long: %q", s)
	}
	if !m.ok {
		a, err := m.p.Syscall(unix.SYS_MMAP, 0, scratchSize, unix.PROT_READ|unix.PROT_WRITE, unix.MAP_PRIVATE|unix.MAP_ANONYMOUS, ^uintptr(0), 0)
		if err != nil {
			return 0, fmt.Errorf("mapping scratch memory: %w", err)
		}
		m.addr, m.ok = a, true
	}
	return m.addr, m.p.Write(m.addr, b)
}

// Release unmaps the page, if it was mapped.
func (m *Scratch) Release() error {
	if !m.ok {
		return nil
	}
	m.ok = false
	if _, err := m.p.Syscall(unix.SYS_MUNMAP, m.addr, scratchSize); err != nil {
		return fmt.Errorf("unmapping scratch memory: %w", err)
	}
	return nil
}

// exited reports whether pid has exited (a zombie, or gone): ptrace
// refuses to attach to an exiting task with EPERM.
func exited(pid int) bool {
	st, err := State(pid)
	return err != nil || st == 'Z' || st == 'X'
}

// State is pid's state letter in /proc/<pid>/stat (R, S, D, T, Z, …);
// ErrGone once it is gone.
func State(pid int) (byte, error) {
	f, err := statFields(pid)
	if err != nil {
		return 0, err
	}
	return f[0][0], nil
}

// statFields are the fields of /proc/<pid>/stat after the command name:
// state, ppid, and on.
func statFields(pid int) ([]string, error) {
	b, err := os.ReadFile("/proc/" + strconv.Itoa(pid) + "/stat")
	if err != nil {
		return nil, fmt.Errorf("%w: pid %d: %w", ErrGone, pid, err)
	}
	i := bytes.LastIndexByte(b, ')')
	if i < 0 {
		return nil, fmt.Errorf("malformed /proc/%d/stat", pid)
	}
	f := strings.Fields(string(b[i+1:]))
	if len(f) < 2 {
		return nil, fmt.Errorf("malformed /proc/%d/stat", pid)
	}
	return f, nil
}

// parent is pid's parent, from a pidfd (PIDFD_GET_INFO, Linux 6.13: a
// fraction of the cost of formatting /proc/<pid>/stat), else from stat.
func parent(pid int) (int, error) {
	fd, err := unix.PidfdOpen(pid, 0)
	if err != nil {
		return 0, fmt.Errorf("%w: pid %d: %w", ErrGone, pid, err)
	}
	info := unix.PidfdInfo{Mask: unix.PIDFD_INFO_PID}
	err = unix.IoctlPidfdInfo(fd, &info)
	unix.Close(fd)
	if err == nil {
		return int(info.Ppid), nil
	}
	f, err := statFields(pid)
	if err != nil {
		return 0, err
	}
	return strconv.Atoi(f[1])
}

// SharesParentMemory reports whether pid shares its memory with its parent,
// which it names: a child of vfork that has not yet called exec (its
// parent cannot stop until it does), or of clone(CLONE_VM). ptrace can
// neither stop the parent of the first nor copy either faithfully.
func SharesParentMemory(pid int) (ppid int, shared bool, err error) {
	if ppid, err = parent(pid); err != nil || ppid <= 0 {
		return ppid, false, err
	}
	r, _, e := unix.Syscall6(unix.SYS_KCMP, uintptr(pid), uintptr(ppid), kcmpVM, 0, 0, 0)
	if e != 0 {
		if e == unix.ESRCH {
			return ppid, false, nil // one of them ended: nothing is shared now
		}
		return ppid, false, fmt.Errorf("comparing the memory of pid %d and its parent %d: %w", pid, ppid, e)
	}
	return ppid, r == 0, nil
}

func (p *Proc) saveRegs() error {
	if err := unix.PtraceGetRegs(p.Pid, &p.Regs); err != nil {
		return fmt.Errorf("reading registers of pid %d: %w", p.Pid, err)
	}
	p.rest = restOf(&p.Regs)
	p.restartBlock = rewind(&p.Regs)
	p.stopped = true
	return nil
}

// restOf is where a thread stopped with registers r was: the call the stop
// interrupted, if any, before rewind.
func restOf(r *unix.PtraceRegs) Rest {
	st := Rest{Nr: -1, Rip: r.Rip, Rsp: r.Rsp}
	if int64(r.Orig_rax) < 0 {
		return st
	}
	switch -int64(r.Rax) {
	case erestartsys, erestartnointr, erestartnohand, erestartRestartblock:
		st.Nr = int64(r.Orig_rax)
		st.Args = [6]uint64{r.Rdi, r.Rsi, r.Rdx, r.R10, r.R8, r.R9}
	}
	return st
}

// rewind makes an interrupted, restartable system call start again when
// the registers resume, and clears orig_rax so the kernel does not restart
// it a second time. It reports whether the call restarts by
// restart_syscall.
func rewind(r *unix.PtraceRegs) (restartBlock bool) {
	if int64(r.Orig_rax) >= 0 {
		switch -int64(r.Rax) {
		case erestartsys, erestartnointr, erestartnohand:
			r.Rax = r.Orig_rax
			r.Rip -= 2
		case erestartRestartblock:
			r.Rax = unix.SYS_RESTART_SYSCALL
			r.Rip -= 2
			restartBlock = true
		}
	}
	r.Orig_rax = ^uint64(0)
	return restartBlock
}

// Syscall runs one system call in the stopped process's own context and
// returns its result (a negative result is returned as an errno).
func (p *Proc) Syscall(nr uintptr, args ...uintptr) (uintptr, error) {
	r, _, err := p.syscall(nr, args)
	return r, err
}

func (p *Proc) syscall(nr uintptr, args []uintptr) (uintptr, int, error) {
	if p.sysAddr == 0 {
		a, err := syscallInsn(p.Pid)
		if err != nil {
			return 0, 0, err
		}
		p.sysAddr = a
	}
	var a [6]uint64
	for i, v := range args {
		a[i] = uint64(v)
	}
	regs := p.Regs
	regs.Rax = uint64(nr)
	regs.Orig_rax = ^uint64(0)
	regs.Rip = p.sysAddr
	regs.Rdi, regs.Rsi, regs.Rdx, regs.R10, regs.R8, regs.R9 = a[0], a[1], a[2], a[3], a[4], a[5]
	if err := unix.PtraceSetRegs(p.Pid, &regs); err != nil {
		return 0, 0, fmt.Errorf("setting registers of pid %d: %w", p.Pid, err)
	}
	child, steps := 0, 0
	for {
		if err := unix.PtraceSingleStep(p.Pid); err != nil {
			return 0, 0, fmt.Errorf("stepping pid %d: %w", p.Pid, err)
		}
		ws, err := wait(p.Pid)
		if err != nil {
			return 0, 0, err
		}
		if ws.Exited() || ws.Signaled() {
			p.attached = false
			delete(p.s.procs, p.Pid)
			return 0, 0, fmt.Errorf("%w: pid %d ended during an injected system call %d", ErrGone, p.Pid, nr)
		}
		if !ws.Stopped() {
			continue
		}
		if c := ws.TrapCause(); c == unix.PTRACE_EVENT_FORK || c == unix.PTRACE_EVENT_CLONE {
			msg, err := unix.PtraceGetEventMsg(p.Pid)
			if err != nil {
				return 0, 0, fmt.Errorf("reading the new pid from pid %d: %w", p.Pid, err)
			}
			child = int(msg)
			continue
		}
		if sig := ws.StopSignal(); sig != unix.SIGTRAP {
			if steps++; steps > maxSteps || faulted(p.Pid, sig) {
				// The instruction at sysAddr faults (a vDSO the
				// process rewrote, or unmapped): stepping it again
				// would fault again, forever.
				return 0, child, fmt.Errorf("%w: pid %d took %s at an injected system call %d", ErrStop, p.Pid, unix.SignalName(sig), nr)
			}
			// A signal arrived while stepping: keep it for detach and
			// step on (data 0 suppresses it now).
			p.Signal = sig
			continue
		}
		break
	}
	var out unix.PtraceRegs
	if err := unix.PtraceGetRegs(p.Pid, &out); err != nil {
		return 0, child, fmt.Errorf("reading registers of pid %d: %w", p.Pid, err)
	}
	if out.Rip != p.sysAddr+2 {
		return 0, child, fmt.Errorf("%w: pid %d stopped at %#x after an injected system call", ErrStop, p.Pid, out.Rip)
	}
	if r := int64(out.Rax); r < 0 && r > -4096 {
		return 0, child, unix.Errno(-r)
	}
	return uintptr(out.Rax), child, nil
}

// maxSteps bounds the signals one injected call lets by before it gives up:
// more than any number of other processes' signals can queue distinct.
const maxSteps = 1024

// faulted reports whether signal sig, which stopped tracee pid, is a fault
// of its own instruction (the kernel's, si_code > 0), not one sent to it.
func faulted(pid int, sig unix.Signal) bool {
	switch sig {
	case unix.SIGSEGV, unix.SIGBUS, unix.SIGILL, unix.SIGFPE:
	default:
		return false
	}
	var si [128]byte // siginfo_t: si_signo, si_errno, si_code
	if _, _, e := unix.Syscall6(unix.SYS_PTRACE, unix.PTRACE_GETSIGINFO, uintptr(pid), 0, uintptr(unsafe.Pointer(&si[0])), 0, 0); e != 0 {
		return true
	}
	return int32(binary.NativeEndian.Uint32(si[8:])) > 0
}

// CloneFlags are the flags of the clone Fork injects: a sibling (CLONE_PARENT)
// whose end its parent learns by SIGCHLD. They hold no namespace flag: the
// sandbox's seccomp filter, which the process may carry, refuses those
// (sandbox/initproc/csrc/SECCOMP.md).
const CloneFlags = unix.CLONE_PARENT | uintptr(unix.SIGCHLD)

// Fork makes a copy of the stopped process with clone(CloneFlags): the copy
// is a sibling (its parent reaps it), stopped and attached to this session
// with the registers the original had when it stopped, and a thread for
// each of the original's other threads (threads.go). It returns the copy
// and its pid as the original's pid namespace sees it.
func (p *Proc) Fork() (*Proc, int, error) {
	if p.group != nil {
		return nil, 0, fmt.Errorf("%w: thread %d is not its process's leader %d", ErrStop, p.Pid, p.group.Pid)
	}
	c, nsPid, err := p.forkLeader()
	if err != nil || len(p.threads) == 0 {
		return c, nsPid, err
	}
	if err := p.forkThreads(c); err != nil {
		c.Kill()
		return nil, 0, err
	}
	return c, nsPid, nil
}

// forkLeader is Fork for the leader alone.
func (p *Proc) forkLeader() (*Proc, int, error) { return p.forkWith(CloneFlags) }

// forkWith is forkLeader with the clone's flags given.
func (p *Proc) forkWith(flags uintptr) (*Proc, int, error) {
	nsPid, child, err := p.syscall(unix.SYS_CLONE, []uintptr{flags, 0, 0, 0, 0})
	if err != nil {
		if child > 0 {
			_ = unix.Kill(child, unix.SIGKILL)
		}
		return nil, 0, fmt.Errorf("cloning pid %d: %w", p.Pid, err)
	}
	if child <= 0 {
		return nil, 0, fmt.Errorf("%w: clone in pid %d reported no child", ErrStop, p.Pid)
	}
	c := &Proc{s: p.s, Pid: child, attached: true, stopped: true, sysAddr: p.sysAddr, Regs: p.Regs,
		pinned: p.pinned, mask: p.mask} // born on the session's CPU
	p.s.procs[child] = c
	if err := c.awaitBirth(); err != nil {
		return nil, 0, fmt.Errorf("copy of pid %d: %w", p.Pid, err)
	}
	if err := unix.PtraceSetRegs(child, &c.Regs); err != nil {
		return nil, 0, fmt.Errorf("setting registers of copy %d: %w", child, err)
	}
	return c, int(nsPid), nil
}

// awaitBirth waits for the first stop of new tracee c, a copy or a thread
// auto-attached at its birth (a PTRACE_EVENT_STOP).
func (c *Proc) awaitBirth() error {
	for {
		ws, err := wait(c.Pid)
		if err != nil {
			return err
		}
		if ws.Exited() || ws.Signaled() {
			c.attached = false
			delete(c.s.procs, c.Pid)
			return fmt.Errorf("%w: %d ended at birth", ErrGone, c.Pid)
		}
		if ws.Stopped() {
			return nil
		}
	}
}

// detachWait bounds Detach's wait for a process seized but not yet
// stopped: it is either stopping now or blocked in the kernel.
const detachWait = time.Second

// Detach restores the registers saved at the stop and lets the process go
// (or, in a frozen cgroup, stay frozen), every thread of it. It is
// idempotent.
func (p *Proc) Detach() error {
	var errs []error
	for _, t := range p.threads {
		errs = append(errs, t.Detach())
	}
	return errors.Join(append(errs, p.detach())...)
}

func (p *Proc) detach() error {
	if !p.attached {
		return nil
	}
	if !p.stopped {
		// Seized but never waited for: its stop is pending (or it has
		// ended); only a stopped tracee can be detached. One that will not
		// stop is left to the end of the session's thread (Close).
		if err := p.WaitFor(detachWait); err != nil {
			if errors.Is(err, ErrNoStop) {
				p.s.stuck = true
				return errors.Join(err, p.unpin())
			}
			p.attached = false
			delete(p.s.procs, p.Pid)
			if errors.Is(err, ErrGone) {
				return nil
			}
			return errors.Join(err, p.unpin())
		}
	}
	p.attached = false
	delete(p.s.procs, p.Pid)
	serr := unix.PtraceSetRegs(p.Pid, &p.Regs)
	err := p.unpin()
	switch derr := ptrace(unix.PTRACE_DETACH, p.Pid, 0, uintptr(p.Signal)); {
	case errors.Is(derr, unix.ESRCH):
		// Killed in its stop (an OOM kill, a SIGKILL): ending, it is no
		// longer stopped, and stays a zombie its parent cannot reap until
		// its tracer waits for it.
		p.waitGone()
	case derr != nil:
		err = errors.Join(err, serr, fmt.Errorf("detaching pid %d: %w", p.Pid, derr))
	default:
		err = errors.Join(err, serr)
	}
	return err
}

// goneWait bounds waitGone: a killed process's end can wait for another
// thread of it, a zombie someone else traces and never reaps.
const goneWait = 2 * time.Second

// waitGone waits, as its tracer, for tracee p, killed, to end, so that its
// parent may reap it. Past goneWait it gives up and leaves it to the end
// of the session's thread (stuck), which the kernel takes for its
// tracer's.
func (p *Proc) waitGone() {
	deadline := time.Now().Add(goneWait)
	pause := 50 * time.Microsecond
	for {
		var ws unix.WaitStatus
		n, err := unix.Wait4(p.Pid, &ws, unix.WALL|unix.WNOHANG, nil)
		switch {
		case err == unix.EINTR:
			continue
		case err != nil, n == p.Pid && (ws.Exited() || ws.Signaled()):
			return
		case time.Now().After(deadline):
			p.s.stuck = true
			return
		}
		time.Sleep(pause)
		pause = min(2*pause, 10*time.Millisecond)
	}
}

// Kill ends a stopped process (a copy that could not be fixed up), every
// thread of it.
func (p *Proc) Kill() {
	_ = unix.Kill(p.Pid, unix.SIGKILL)
	for _, t := range p.threads {
		t.reap()
	}
	p.reap()
}

// reap waits for killed tracee p to end.
func (p *Proc) reap() {
	if p.attached {
		p.attached = false
		delete(p.s.procs, p.Pid)
		p.waitGone()
	}
}

// SignalsPending reports whether a signal is pending for the stopped
// process (to it, to one of its threads, or to its thread group; a
// thread's stop that dequeued one counts), besides Signal, the one the
// leader's stop dequeued: detached, it would act on them. It
// reads the pending sets from /proc (a signal queued without its siginfo,
// past RLIMIT_SIGPENDING, is in them too).
func (p *Proc) SignalsPending() (bool, error) {
	if pending, err := p.signalsPending(); err != nil || pending {
		return pending, err
	}
	for _, t := range p.threads {
		if pending, err := t.signalsPending(); err != nil || pending || t.Signal != 0 {
			return true, err
		}
	}
	return false, nil
}

func (p *Proc) signalsPending() (bool, error) {
	path := "/proc/" + strconv.Itoa(p.Pid) + "/status"
	if p.group != nil {
		path = "/proc/" + strconv.Itoa(p.group.Pid) + "/task/" + strconv.Itoa(p.Pid) + "/status"
	}
	b, err := os.ReadFile(path)
	if err != nil {
		return false, err
	}
	n := 0
	for line := range strings.Lines(string(b)) {
		k, v, ok := strings.Cut(line, ":")
		if !ok || k != "SigPnd" && k != "ShdPnd" {
			continue
		}
		n++
		if strings.Trim(strings.TrimSpace(v), "0") != "" {
			return true, nil
		}
	}
	if n != 2 {
		return false, fmt.Errorf("no SigPnd and ShdPnd in %s", path)
	}
	return false, nil
}

// Write copies b into the process's memory at addr.
func (p *Proc) Write(addr uintptr, b []byte) error {
	n, err := unix.ProcessVMWritev(p.Pid, []unix.Iovec{{Base: &b[0], Len: uint64(len(b))}},
		[]unix.RemoteIovec{{Base: addr, Len: len(b)}}, 0)
	if err == nil && n != len(b) {
		err = fmt.Errorf("short write (%d of %d bytes)", n, len(b))
	}
	if err != nil {
		return fmt.Errorf("writing memory of pid %d: %w", p.Pid, err)
	}
	return nil
}

// Read copies len(b) bytes at addr out of the process's memory.
func (p *Proc) Read(addr uintptr, b []byte) error {
	n, err := unix.ProcessVMReadv(p.Pid, []unix.Iovec{{Base: &b[0], Len: uint64(len(b))}},
		[]unix.RemoteIovec{{Base: addr, Len: len(b)}}, 0)
	if err == nil && n != len(b) {
		err = fmt.Errorf("short read (%d of %d bytes)", n, len(b))
	}
	if err != nil {
		return fmt.Errorf("reading memory of pid %d: %w", p.Pid, err)
	}
	return nil
}

func ptrace(req int, pid int, addr, data uintptr) error {
	_, _, e := unix.Syscall6(unix.SYS_PTRACE, uintptr(req), uintptr(pid), addr, data, 0, 0)
	if e != 0 {
		return e
	}
	return nil
}

// wait waits for a change of tracee pid. A tracee killed while another
// thread of its is a zombie that someone else traces and never reaps
// (a process of the sandbox that traced it) does not end until that thread
// is reaped: if the wait lasts goneWait, the tracers of such threads are
// killed (releaseZombies), which the sandbox's init then reaps.
func wait(pid int) (unix.WaitStatus, error) {
	watch := time.AfterFunc(goneWait, func() { releaseZombies(pid) })
	defer watch.Stop()
	var ws unix.WaitStatus
	for {
		_, err := unix.Wait4(pid, &ws, unix.WALL, nil)
		if err == unix.EINTR {
			continue
		}
		if err != nil {
			return 0, fmt.Errorf("waiting for pid %d: %w", pid, err)
		}
		return ws, nil
	}
}

// releaseZombies kills the processes that trace a zombie thread of pid and
// are not this one (see wait).
func releaseZombies(pid int) {
	dir := "/proc/" + strconv.Itoa(pid) + "/task/"
	tasks, err := os.ReadDir(dir)
	if err != nil {
		return
	}
	for _, e := range tasks {
		tid, err := strconv.Atoi(e.Name())
		if err != nil {
			continue
		}
		st, err := procStatus(tid) // a thread's, at its tid
		if err != nil {
			continue
		}
		tracer := st["TracerPid"]
		t, _ := strconv.Atoi(tracer)
		if !strings.HasPrefix(st["State"], "Z") || t <= 0 {
			continue
		}
		if _, err := os.Stat("/proc/self/task/" + tracer); err == nil {
			continue // a thread of ours
		}
		_ = unix.Kill(t, unix.SIGKILL)
	}
}

// vdsoOff is the offset of a `syscall` instruction (0f 05) in the vDSO,
// the same image in every process of this kernel.
var vdsoOff = sync.OnceValues(func() (uint64, error) {
	base, end, err := vdsoRange("self")
	if err != nil {
		return 0, err
	}
	f, err := os.Open("/proc/self/mem")
	if err != nil {
		return 0, err
	}
	defer f.Close()
	mem := make([]byte, end-base)
	if _, err := f.ReadAt(mem, int64(base)); err != nil {
		return 0, fmt.Errorf("reading the vDSO: %w", err)
	}
	for i := 0; i+1 < len(mem); i++ {
		if mem[i] == 0x0f && mem[i+1] == 0x05 {
			return uint64(i), nil
		}
	}
	return 0, errors.New("no syscall instruction in the vDSO")
})

// syscallInsn returns the address of a `syscall` instruction in the stopped
// process pid: in its vDSO, found through its auxiliary vector (a few
// words read), or through its maps when the vDSO is not where the vector
// says (it was moved or unmapped; reading and parsing the maps costs many
// times more).
func syscallInsn(pid int) (uint64, error) {
	off, err := vdsoOff()
	if err != nil {
		return 0, err
	}
	if base, ok := auxvVDSO(pid); ok {
		var insn [2]byte
		if n, err := unix.PtracePeekText(pid, uintptr(base+off), insn[:]); err == nil && n == 2 && insn == [2]byte{0x0f, 0x05} {
			return base + off, nil
		}
	}
	base, _, err := vdsoRange(strconv.Itoa(pid))
	if err != nil {
		return 0, err
	}
	var insn [2]byte
	if n, err := unix.PtracePeekText(pid, uintptr(base+off), insn[:]); err != nil || n != 2 || insn != [2]byte{0x0f, 0x05} {
		return 0, fmt.Errorf("%w: pid %d has no syscall instruction where its vDSO has one (rewritten)", ErrStop, pid)
	}
	return base + off, nil
}

// auxvVDSO reads the vDSO's address (AT_SYSINFO_EHDR) from pid's auxiliary
// vector.
func auxvVDSO(pid int) (uint64, bool) {
	b, err := os.ReadFile("/proc/" + strconv.Itoa(pid) + "/auxv")
	if err != nil {
		return 0, false
	}
	for i := 0; i+16 <= len(b); i += 16 {
		switch binary.NativeEndian.Uint64(b[i:]) {
		case 33: // AT_SYSINFO_EHDR
			return binary.NativeEndian.Uint64(b[i+8:]), true
		case 0: // AT_NULL
			return 0, false
		}
	}
	return 0, false
}

func vdsoRange(pid string) (uint64, uint64, error) {
	b, err := os.ReadFile("/proc/" + pid + "/maps")
	if err != nil {
		return 0, 0, fmt.Errorf("%w: reading maps of pid %s: %w", ErrGone, pid, err)
	}
	for _, line := range strings.Split(string(b), "\n") {
		if !strings.HasSuffix(line, "[vdso]") {
			continue
		}
		lo, hi, _ := strings.Cut(strings.Fields(line)[0], "-")
		l, err1 := strconv.ParseUint(lo, 16, 64)
		h, err2 := strconv.ParseUint(hi, 16, 64)
		if err1 != nil || err2 != nil {
			break
		}
		return l, h, nil
	}
	return 0, 0, fmt.Errorf("pid %s has no vDSO mapping", pid)
}
