//go:build linux && amd64

package ptfork

import (
	"bufio"
	"bytes"
	"encoding/binary"
	"errors"
	"fmt"
	"os"
	"slices"
	"strconv"
	"strings"
	"unsafe"

	"golang.org/x/sys/unix"
)

// A copy of a process tree cannot be made by forking each process's
// template: a fork's parent is the process that forks (or, with
// CLONE_PARENT, that one's parent), so a copy of a child is never a child
// of a copy of its parent. A copy of a parent with one child is made the
// other way round: the child's template is forked (X), X forks the child's
// copy, its own child, and then X becomes the parent (Become): its memory
// is replaced by the parent's, and so are its registers, thread state,
// signal actions and the rest of what a process has of its own. The child,
// the larger process as a rule (a shell and the program it runs), costs a
// fork; the parent costs the copy of the pages it wrote.

const (
	kcmpFile = 0
	atFdcwd  = ^uintptr(99) // AT_FDCWD, -100
)

// ErrBecome: a process cannot become another: the two differ in what Become
// does not carry (credentials, descriptors, shared memory).
var ErrBecome = errors.New("cannot take on the process")

// ErrPartial: a copy lacks memory of the process it copies, which the
// process marked MADV_DONTFORK (marked MADV_DOFORK for the fork, it would
// be copied).
var ErrPartial = errors.New("the copy lacks memory the process marked not to be forked")

// ForkChild is Fork with the copy the stopped process's own child (a clone
// without CLONE_PARENT). The process must have one thread.
func (p *Proc) ForkChild() (*Proc, int, error) {
	if p.group != nil || len(p.threads) > 0 {
		return nil, 0, fmt.Errorf("%w: ForkChild is for a process of one thread", ErrThreads)
	}
	return p.forkWith(uintptr(unix.SIGCHLD))
}

// ForkOrphan is ForkChild with the copy given to the init of the process's
// pid namespace (or to the nearest subreaper above it): the process forks
// a middle child, which forks the copy and is killed, and the process
// reaps the middle child at once. The middle child sends the process no
// signal when it ends (its exit signal is none), and is reaped by a
// waitpid injected into the process, so the process sees nothing of it.
// A copy of a process of a tree made this way is in no part of the tree:
// a dump of the tree does not meet it.
func (p *Proc) ForkOrphan() (*Proc, int, error) {
	if p.group != nil || len(p.threads) > 0 {
		return nil, 0, fmt.Errorf("%w: ForkOrphan is for a process of one thread", ErrThreads)
	}
	// A subreaper would adopt the copy: refused before anything is made.
	if sub, err := p.Subreaper(); err != nil || sub {
		return nil, 0, errors.Join(err, fmt.Errorf("%w: pid %d is a subreaper", ErrBecome, p.Pid))
	}
	mid, midNs, err := p.forkWith(0)
	if err != nil {
		return nil, 0, err
	}
	c, nsPid, err := mid.forkWith(uintptr(unix.SIGCHLD))
	mid.Kill()
	// The middle child is a zombie of p's now, which only a wait for
	// children of any exit signal (__WALL) reaps.
	if _, werr := p.Syscall(unix.SYS_WAIT4, uintptr(midNs), 0, unix.WALL, 0); werr != nil {
		err = errors.Join(err, fmt.Errorf("reaping the middle child %d of pid %d: %w", mid.Pid, p.Pid, werr))
	}
	if err == nil {
		err = orphanWhole(p.Pid, c.Pid)
	}
	if err != nil {
		if c != nil {
			c.Kill()
		}
		return nil, 0, err
	}
	return c, nsPid, nil
}

// Subreaper reports whether stopped process p is a child subreaper
// (PR_SET_CHILD_SUBREAPER): an orphan below it goes to it, not to the init.
func (p *Proc) Subreaper() (bool, error) {
	sp := p.Scratch()
	a, err := sp.Put("")
	if err == nil {
		const prGetChildSubreaper = 37
		_, err = p.Syscall(unix.SYS_PRCTL, prGetChildSubreaper, a)
	}
	var v [4]byte
	if err == nil {
		err = p.Read(a, v[:])
	}
	if rerr := sp.Release(); err == nil {
		err = rerr
	}
	if err != nil {
		return false, fmt.Errorf("reading the subreaper flag of pid %d: %w", p.Pid, err)
	}
	return v != [4]byte{}, nil
}

// orphanWhole checks that c, p's ForkOrphan copy, was not adopted by p (a
// subreaper) and has all of p's memory (a fork leaves out what is marked
// MADV_DONTFORK).
func orphanWhole(p, c int) error {
	if ppid, err := parent(c); err != nil || ppid == p {
		return fmt.Errorf("%w: pid %d, a subreaper, adopted its copy", ErrBecome, p)
	}
	if a, b := VMSize(p), VMSize(c); a == 0 || a != b {
		return fmt.Errorf("%w: pid %d: %w", ErrBecome, p, ErrPartial)
	}
	return nil
}

// VMSize is the size of pid's address space in pages (statm), 0 if it
// cannot be read: a fork's is smaller when the process marked memory
// MADV_DONTFORK.
func VMSize(pid int) uint64 {
	b, err := os.ReadFile("/proc/" + strconv.Itoa(pid) + "/statm")
	if err != nil {
		return 0
	}
	f := strings.Fields(string(b))
	if len(f) == 0 {
		return 0
	}
	n, _ := strconv.ParseUint(f[0], 10, 64)
	return n
}

// vma is one line of /proc/<pid>/maps.
type vma struct {
	start, end uint64
	perms      string // rwxp
	off        uint64
	ino        uint64
	path       string
}

func (v vma) special() bool {
	return v.path == "[vdso]" || v.path == "[vvar]" || v.path == "[vvar_vclock]" || v.path == "[vsyscall]"
}

func (v vma) prot() uintptr {
	var p uintptr
	if v.perms[0] == 'r' {
		p |= unix.PROT_READ
	}
	if v.perms[1] == 'w' {
		p |= unix.PROT_WRITE
	}
	if v.perms[2] == 'x' {
		p |= unix.PROT_EXEC
	}
	return p
}

// anon: a mapping of no file (the heap, the stack, an anonymous mmap).
func (v vma) anon() bool { return v.ino == 0 }

func readMaps(pid int) ([]vma, error) {
	f, err := os.Open("/proc/" + strconv.Itoa(pid) + "/maps")
	if err != nil {
		return nil, fmt.Errorf("%w: %w", ErrGone, err)
	}
	defer f.Close()
	var out []vma
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		line := sc.Text()
		fs := strings.Fields(line)
		if len(fs) < 5 {
			return nil, fmt.Errorf("maps of pid %d: bad line %q", pid, line)
		}
		lo, hi, _ := strings.Cut(fs[0], "-")
		var v vma
		var e [4]error
		v.start, e[0] = strconv.ParseUint(lo, 16, 64)
		v.end, e[1] = strconv.ParseUint(hi, 16, 64)
		v.off, e[2] = strconv.ParseUint(fs[2], 16, 64)
		v.ino, e[3] = strconv.ParseUint(fs[4], 10, 64)
		if err := errors.Join(e[:]...); err != nil || len(fs[1]) != 4 {
			return nil, fmt.Errorf("maps of pid %d: bad line %q", pid, line)
		}
		v.perms = fs[1]
		if len(fs) > 5 {
			// The path is the rest of the line after the fifth field,
			// spaces and all.
			rest := line
			for range 5 {
				rest = strings.TrimLeft(rest, " ")
				rest = rest[strings.IndexByte(rest, ' '):]
			}
			v.path = strings.TrimLeft(rest, " ")
		}
		out = append(out, v)
	}
	return out, sc.Err()
}

// Source is what Become reads of the process it copies: read once, it
// serves for as many copies as the process stays stopped, unchanged.
type Source struct {
	Layout
	written [][]span
	regs    unix.PtraceRegs
	restart bool
	rest    Rest
	state   *threadState
	brk     uint64
	stat    []string // /proc/<pid>/stat fields, 1-based as proc(5) numbers them, [0] unused
	auxv    []byte
	actions map[int][32]byte // struct kernel_sigaction of each caught signal
	ignored uint64
	umask   uint64
	rlimits [unix.RLIMIT_RTTIME + 1]unix.Rlimit
}

// Layout is what Become reads of the process it changes: its mappings,
// descriptors and status. x, a copy of a stopped process, has the layout
// of that process, which is read once for every copy.
type Layout struct {
	pid     int
	maps    []vma
	fds     map[int]bool // open descriptor: its close-on-exec flag
	status  map[string]string
	persona uint64
	stash   *stash // the memory of another process, if Stash placed it here
}

// ReadLayout reads the layout of process pid, stopped.
func ReadLayout(pid int) (*Layout, error) {
	l := &Layout{pid: pid}
	var err error
	if l.maps, err = readMaps(pid); err != nil {
		return nil, err
	}
	if l.fds, err = fdFlags(pid); err != nil {
		return nil, err
	}
	if l.status, err = procStatus(pid); err != nil {
		return nil, err
	}
	persona, err := os.ReadFile("/proc/" + strconv.Itoa(pid) + "/personality")
	if err != nil {
		return nil, fmt.Errorf("%w: %w", ErrGone, err)
	}
	if l.persona, err = strconv.ParseUint(strings.TrimSpace(string(persona)), 16, 64); err != nil {
		return nil, fmt.Errorf("personality of pid %d: %w", pid, err)
	}
	return l, nil
}

// ReadSource reads all Become needs of stopped process src, injecting the
// calls only src can answer.
func (src *Proc) ReadSource() (*Source, error) {
	if len(src.threads) > 0 || src.group != nil {
		return nil, fmt.Errorf("%w: pid %d has more than one thread", ErrBecome, src.Pid)
	}
	l, err := ReadLayout(src.Pid)
	if err != nil {
		return nil, err
	}
	s := &Source{Layout: *l, regs: src.Regs, restart: src.restartBlock, rest: src.rest}
	for _, v := range s.maps {
		switch {
		case v.perms[3] == 's' && v.perms[1] == 'w' || v.perms[3] == 's' && v.anon():
			return nil, fmt.Errorf("%w: pid %d maps %#x-%#x shared and writable", ErrBecome, src.Pid, v.start, v.end)
		case !v.anon() && !strings.HasPrefix(v.path, "/"), strings.HasSuffix(v.path, " (deleted)"):
			return nil, fmt.Errorf("%w: pid %d maps %q, which has no path to open", ErrBecome, src.Pid, v.path)
		}
	}
	caught, err := s.readProc()
	if err != nil {
		return nil, err
	}
	if s.written, err = writtenPages(src.Pid, s.maps); err != nil {
		return nil, err
	}
	sp := src.Scratch()
	scratch, err := sp.Put("")
	if err != nil {
		return nil, err
	}
	err = s.readInjected(src, scratch, caught)
	return s, errors.Join(err, sp.Release())
}

// readProc reads what /proc and prlimit tell of s's process, and returns
// the set of signals it catches.
func (s *Source) readProc() (caught uint64, err error) {
	pid := s.pid
	dir := "/proc/" + strconv.Itoa(pid) + "/"
	f, err := statFields(pid)
	if err != nil {
		return 0, err
	}
	s.stat = append([]string{"", "", ""}, f...)
	if len(s.stat) < 52 {
		return 0, fmt.Errorf("stat of pid %d: %d fields", pid, len(s.stat))
	}
	if s.auxv, err = os.ReadFile(dir + "auxv"); err != nil {
		return 0, err
	}
	caught, err1 := strconv.ParseUint(s.status["SigCgt"], 16, 64)
	ignored, err2 := strconv.ParseUint(s.status["SigIgn"], 16, 64)
	umask, err3 := strconv.ParseUint(s.status["Umask"], 8, 32)
	if err := errors.Join(err1, err2, err3); err != nil {
		return 0, fmt.Errorf("status of pid %d: %w", pid, err)
	}
	s.ignored, s.umask = ignored, umask
	for r := range s.rlimits {
		if err := unix.Prlimit(pid, r, nil, &s.rlimits[r]); err != nil {
			return 0, fmt.Errorf("reading limit %d of pid %d: %w", r, pid, err)
		}
	}
	return caught, nil
}

// readInjected reads, by calls injected into src through its scratch page,
// what only src can tell: its thread's state, its break and the actions
// of the signals it catches.
func (s *Source) readInjected(src *Proc, scratch uintptr, caught uint64) error {
	var err error
	if s.state, err = src.readState(scratch); err != nil {
		return err
	}
	brk, err := src.Syscall(unix.SYS_BRK, 0)
	if err != nil {
		return fmt.Errorf("reading the break of pid %d: %w", src.Pid, err)
	}
	s.brk = uint64(brk)
	s.actions = map[int][32]byte{}
	for sig := 1; sig <= 64; sig++ {
		if caught&(1<<(sig-1)) == 0 {
			continue
		}
		if _, err := src.Syscall(unix.SYS_RT_SIGACTION, uintptr(sig), 0, scratch, 8); err != nil {
			return fmt.Errorf("reading the action of signal %d of pid %d: %w", sig, src.Pid, err)
		}
		var act [32]byte
		if err := src.Read(scratch, act[:]); err != nil {
			return err
		}
		s.actions[sig] = act
	}
	return nil
}

// procStatus is /proc/<pid>/status, key to value.
func procStatus(pid int) (map[string]string, error) {
	b, err := os.ReadFile("/proc/" + strconv.Itoa(pid) + "/status")
	if err != nil {
		return nil, fmt.Errorf("%w: %w", ErrGone, err)
	}
	m := map[string]string{}
	for _, line := range strings.Split(string(b), "\n") {
		k, v, ok := strings.Cut(line, ":")
		if ok {
			m[k] = strings.TrimSpace(v)
		}
	}
	return m, nil
}

// fdFlags lists pid's open descriptors with their close-on-exec flags.
func fdFlags(pid int) (map[int]bool, error) {
	dir := "/proc/" + strconv.Itoa(pid) + "/fdinfo/"
	ents, err := os.ReadDir(dir)
	if err != nil {
		return nil, fmt.Errorf("%w: %w", ErrGone, err)
	}
	out := map[int]bool{}
	for _, e := range ents {
		fd, err := strconv.Atoi(e.Name())
		if err != nil {
			continue
		}
		b, err := os.ReadFile(dir + e.Name())
		if err != nil {
			continue // closed since the listing: the process is not stopped
		}
		for _, line := range strings.Split(string(b), "\n") {
			if v, ok := strings.CutPrefix(line, "flags:"); ok {
				fl, err := strconv.ParseUint(strings.TrimSpace(v), 8, 64)
				if err != nil {
					return nil, fmt.Errorf("fdinfo %d of pid %d: %w", fd, pid, err)
				}
				out[fd] = fl&unix.O_CLOEXEC != 0
			}
		}
	}
	return out, nil
}

// sameIdentity checks that x, of layout a, holds the credentials,
// capabilities and seccomp filters of src: Become carries none of them.
func sameIdentity(a *Layout, src *Source) error {
	for _, k := range []string{"Uid", "Gid", "Groups", "CapInh", "CapPrm", "CapEff", "CapBnd", "CapAmb", "NoNewPrivs", "Seccomp", "Seccomp_filters"} {
		if a.status[k] != src.status[k] {
			return fmt.Errorf("%w: pid %d has %s %q, pid %d %q", ErrBecome, a.pid, k, a.status[k], src.pid, src.status[k])
		}
	}
	return nil
}

// Become makes x, a stopped process of one thread, a copy of s's process,
// another: x's memory is replaced by that process's (its mappings at their
// addresses, files mapped again from their paths as x sees them, the pages
// it wrote copied), and x takes its registers, thread state, signal
// actions, memory layout fields (brk, arguments, environment, auxiliary
// vector), umask, personality and limits. x keeps its own pid, parent and
// children, and its executable's link (/proc/<pid>/exe).
//
// If like holds a stash of s's process's memory (Stash), x is a fork of
// the process like was read of and that process is no longer needed: what
// was checked when the stash was made holds for x.
//
// What it does not carry must already be the same, or it fails with
// ErrBecome: credentials, capabilities and seccomp filters, and every
// descriptor the process has must be the same open file at the same
// number in x (x's others are closed). Its process group and session are
// the caller's (x may call setsid before). Nor does it carry interval
// timers, POSIX timers or the working directory. The process may not map
// memory shared and writable, nor a file that has no path. It must still
// be stopped, as it was when s was read. x is unusable if Become fails
// (kill it).
//
// The calls are injected in a few batches (Batch) from pages Become maps
// where neither process has a mapping, and unmaps at the end.
func (x *Proc) Become(s *Source, like *Layout) error {
	if len(x.threads) > 0 || x.group != nil {
		return fmt.Errorf("%w: pid %d has more than one thread", ErrBecome, x.Pid)
	}
	like, err := x.checkBecome(s, like)
	if err != nil {
		return err
	}
	own := like.maps
	base, err := x.placeScratch(own, s.maps)
	if err != nil {
		return err
	}
	b := &batch{x: x, data: base, code: base + 2*scratchSize}
	// Batch 1: descriptors, rseq, x's memory out, the vDSO where s's is.
	if err := b.fixFds(s, like); err != nil {
		return err
	}
	if err := b.dropRseq(); err != nil {
		return err
	}
	b.unmapAllBut(own, base, like.stash)
	if err := b.moveSpecials(own, s.maps, base, like.stash); err != nil {
		return err
	}
	if like.stash != nil {
		// s's memory is at hand: moved, in the same batch.
		if err := b.takeStash(s, like.stash); err != nil {
			return err
		}
	} else if err := b.mapAnew(s); err != nil {
		return err
	}
	// The last batch: the rest of the process and the thread.
	b.setMM(s)
	if err := b.setActions(s, like); err != nil {
		return err
	}
	b.setThread(s, like)
	if _, err := b.run(); err != nil {
		return err
	}
	if err := setLimits(x.Pid, s); err != nil {
		return err
	}
	if _, err := x.Syscall(unix.SYS_MUNMAP, base, 3*scratchSize); err != nil {
		return fmt.Errorf("unmapping the scratch pages of pid %d: %w", x.Pid, err)
	}
	return x.takeRegs(s)
}

// mapAnew runs the batch so far, then makes s's mappings in x and copies
// in the pages s's process wrote.
func (b *batch) mapAnew(s *Source) error {
	if _, err := b.run(); err != nil {
		return err
	}
	// A batch opens the files to map, the next maps them.
	paths := b.openFiles(s.maps)
	fds, err := b.run()
	if err != nil {
		return err
	}
	b.mapLike(s, paths, fds, nil)
	if _, err := b.run(); err != nil {
		return err
	}
	return copyWritten(s.pid, b.x.Pid, s.maps, s.written, nil)
}

const (
	pageSize          = 4096
	madvPopulateWrite = 23
)

// userTop is the top of a 47-bit user address space (its last page is
// never mapped); a process maps above it (5-level page tables) only if it
// asks for such an address.
const userTop = 1<<47 - scratchSize

// Fits checks that a copy of the process of layout like can become s's:
// Become's checks, made once ahead.
func (s *Source) Fits(like *Layout) error {
	if err := sameIdentity(like, s); err != nil {
		return err
	}
	if err := sameFilters(like.pid, s.pid); err != nil {
		return err
	}
	_, err := fdsToClose(s, like.pid, like.fds)
	return err
}

// SameFilters is sameFilters for the server's checks ahead.
func SameFilters(a, b int) error { return sameFilters(a, b) }

// sameFilters checks that stopped tracees a and b have the same seccomp
// filters, program for program (Become carries none): as many as each
// other is not enough.
func sameFilters(a, b int) error {
	const ptraceSeccompGetFilter = 0x420c
	for i := 0; ; i++ {
		var prog [2][]byte
		for k, pid := range []int{a, b} {
			n, _, e := unix.Syscall6(unix.SYS_PTRACE, ptraceSeccompGetFilter, uintptr(pid), uintptr(i), 0, 0, 0)
			if e == unix.ENOENT || e == unix.EINVAL && i == 0 {
				continue // no filter at that index; no filter at all
			}
			if e != 0 {
				return fmt.Errorf("reading seccomp filter %d of pid %d: %w", i, pid, e)
			}
			prog[k] = make([]byte, n*8) // struct sock_filter
			if n > 0 {
				if _, _, e := unix.Syscall6(unix.SYS_PTRACE, ptraceSeccompGetFilter, uintptr(pid), uintptr(i), uintptr(unsafe.Pointer(&prog[k][0])), 0, 0); e != 0 {
					return fmt.Errorf("reading seccomp filter %d of pid %d: %w", i, pid, e)
				}
			}
		}
		if prog[0] == nil && prog[1] == nil {
			return nil
		}
		if !bytes.Equal(prog[0], prog[1]) || prog[0] == nil || prog[1] == nil {
			return fmt.Errorf("%w: pids %d and %d differ in seccomp filter %d", ErrBecome, a, b, i)
		}
	}
}

// checkBecome checks what Become does not carry, and returns x's layout
// (like, or read now if nil).
func (x *Proc) checkBecome(s *Source, like *Layout) (*Layout, error) {
	if like == nil {
		var err error
		if like, err = ReadLayout(x.Pid); err != nil {
			return nil, err
		}
	}
	if err := sameIdentity(like, s); err != nil {
		return nil, err
	}
	// A stash was made for a process that Fits, and s's may be gone
	// since: x is a fork of that one.
	if like.stash == nil {
		if err := sameFilters(x.Pid, s.pid); err != nil {
			return nil, err
		}
	}
	for _, v := range like.maps {
		if v.start >= userTop && v.path != "[vsyscall]" {
			return nil, fmt.Errorf("%w: pid %d maps %#x, above 47 bits", ErrBecome, x.Pid, v.start)
		}
	}
	return like, nil
}

// batch gathers calls for Batch and the data they point to: data is two
// pages of x's, code a third (readable, writable and executable).
type batch struct {
	x     *Proc
	data  uintptr
	code  uintptr
	buf   []byte
	calls []Call
}

func (b *batch) add(nr uintptr, args ...uintptr) {
	c := Call{Nr: nr}
	copy(c.Args[:], args)
	b.calls = append(b.calls, c)
}

// put places v in the data pages and returns its address in x, or 0 if it
// does not fit.
func (b *batch) put(v []byte) uintptr {
	off := (len(b.buf) + 7) &^ 7
	if off+len(v) > 2*scratchSize {
		return 0
	}
	b.buf = append(b.buf[:len(b.buf):len(b.buf)], make([]byte, off-len(b.buf))...)
	b.buf = append(b.buf, v...)
	return b.data + uintptr(off)
}

// run writes the data and runs the calls, and starts a new batch.
func (b *batch) run() ([]uintptr, error) {
	defer func() { b.buf, b.calls = b.buf[:0], b.calls[:0] }()
	if len(b.buf) > 0 {
		if err := b.x.Write(b.data, b.buf); err != nil {
			return nil, err
		}
	}
	out, err := b.x.Batch(b.code, b.calls)
	if err != nil {
		return nil, fmt.Errorf("making pid %d a copy: %w", b.x.Pid, err)
	}
	return out, nil
}

// fixFds adds the calls that close x's descriptors (have) that s's
// process does not have, and give each of its the close-on-exec flag it
// has there.
func (b *batch) fixFds(s *Source, like *Layout) error {
	have := like.fds
	extra := fdsBeyond(s, have)
	if like.stash == nil {
		var err error
		if extra, err = fdsToClose(s, b.x.Pid, have); err != nil {
			return err
		}
	}
	for fd, cloexec := range s.fds {
		if have[fd] != cloexec {
			flag := uintptr(0)
			if cloexec {
				flag = unix.FD_CLOEXEC
			}
			b.add(unix.SYS_FCNTL, uintptr(fd), unix.F_SETFD, flag)
		}
	}
	for i := 0; i < len(extra); {
		j := i
		for j+1 < len(extra) && extra[j+1] == extra[j]+1 {
			j++
		}
		b.add(unix.SYS_CLOSE_RANGE, uintptr(extra[i]), uintptr(extra[j]), 0)
		i = j + 1
	}
	return nil
}

// fdsToClose checks that each descriptor of s's process is the same open
// file in process pid, whose descriptors are have, and returns pid's
// others, sorted.
func fdsToClose(s *Source, pid int, have map[int]bool) ([]int, error) {
	for fd := range s.fds {
		same, err := sameFile(s, pid, have, fd)
		if err != nil {
			return nil, err
		}
		if !same {
			return nil, fmt.Errorf("%w: descriptor %d of pid %d is not open in pid %d, or another file there", ErrBecome, fd, s.pid, pid)
		}
	}
	return fdsBeyond(s, have), nil
}

// sameFile reports whether descriptor fd of s's process is the same open
// file in process pid, whose descriptors are have.
func sameFile(s *Source, pid int, have map[int]bool, fd int) (bool, error) {
	if _, ok := have[fd]; !ok {
		return false, nil
	}
	r, _, e := unix.Syscall6(unix.SYS_KCMP, uintptr(pid), uintptr(s.pid), kcmpFile, uintptr(fd), uintptr(fd), 0)
	if e != 0 {
		return false, fmt.Errorf("comparing descriptor %d of pids %d and %d: %w", fd, pid, s.pid, e)
	}
	return r == 0, nil
}

// Unshared lists, sorted, the descriptors of s's process that are not the
// same open file in the stopped process of layout like: Become would refuse
// them (Fits), unless they are left out (Without).
func (s *Source) Unshared(like *Layout) ([]int, error) {
	var out []int
	for fd := range s.fds {
		same, err := sameFile(s, like.pid, like.fds, fd)
		if err != nil {
			return nil, err
		}
		if !same {
			out = append(out, fd)
		}
	}
	slices.Sort(out)
	return out, nil
}

// Without leaves descriptors fds of s's process out of what Become gives
// the process that takes it on: that process's descriptors of those
// numbers are closed, for the caller to open the files again.
func (s *Source) Without(fds []int) {
	for _, fd := range fds {
		delete(s.fds, fd)
	}
}

// fdsBeyond lists the descriptors of have that s's process does not
// have, sorted.
func fdsBeyond(s *Source, have map[int]bool) []int {
	var extra []int
	for fd := range have {
		if _, ok := s.fds[fd]; !ok {
			extra = append(extra, fd)
		}
	}
	slices.Sort(extra)
	return extra
}

// dropRseq unregisters x's restartable sequence area before its memory
// goes: the kernel writes into it at every preemption.
func (b *batch) dropRseq() error {
	var rc rseqConfig
	if err := ptracePtr(ptraceGetRseqConfig, b.x.Pid, unsafe.Sizeof(rc), unsafe.Pointer(&rc)); err != nil {
		return fmt.Errorf("reading the rseq registration of pid %d: %w", b.x.Pid, err)
	}
	if rc.Size > 0 {
		const rseqUnregister = 1
		b.add(unix.SYS_RSEQ, uintptr(rc.Pointer), uintptr(rc.Size), rseqUnregister, uintptr(rc.Signature))
	}
	return nil
}

// placeScratch maps x's three scratch pages where neither x's mappings nor
// src's are, nor will be.
func (x *Proc) placeScratch(own, src []vma) (uintptr, error) {
	used := append(slices.Clone(own), src...)
	slices.SortFunc(used, func(a, b vma) int { return cmpU64(a.start, b.start) })
	const size = 3 * scratchSize
	at := uint64(1 << 20)
	for _, v := range used {
		if v.end <= at {
			continue
		}
		if v.start >= at+size {
			break
		}
		at = v.end
	}
	const mapFixedNoreplace = 0x100000
	a, err := x.Syscall(unix.SYS_MMAP, uintptr(at), size, unix.PROT_READ|unix.PROT_WRITE|unix.PROT_EXEC,
		unix.MAP_PRIVATE|unix.MAP_ANONYMOUS|mapFixedNoreplace, ^uintptr(0), 0)
	if err != nil {
		return 0, fmt.Errorf("mapping scratch pages into pid %d at %#x: %w", x.Pid, at, err)
	}
	return a, nil
}

func cmpU64(a, b uint64) int {
	switch {
	case a < b:
		return -1
	case a > b:
		return 1
	}
	return 0
}

// unmapAllBut unmaps every mapping of x but its vDSO, vvar pages,
// vsyscall page, the scratch pages and the stash st (if not nil): a munmap
// for each gap between those, whatever it holds.
func (b *batch) unmapAllBut(own []vma, base uintptr, st *stash) {
	keep := []vma{{start: uint64(base), end: uint64(base) + 3*scratchSize}}
	if st != nil {
		keep = append(keep, vma{start: st.lo, end: st.hi})
	}
	for _, v := range own {
		if v.special() && v.path != "[vsyscall]" {
			keep = append(keep, v)
		}
	}
	slices.SortFunc(keep, func(a, b vma) int { return cmpU64(a.start, b.start) })
	at := uint64(os.Getpagesize())
	for _, k := range append(keep, vma{start: userTop, end: userTop}) {
		if k.start > at {
			b.add(unix.SYS_MUNMAP, uintptr(at), uintptr(k.start-at))
		}
		at = max(at, k.end)
	}
}

// moveSpecials moves x's vDSO and vvar pages to where src has them (code
// of src's caches their addresses), through a free range first when the
// two places overlap (above the scratch pages and the stash st).
func (b *batch) moveSpecials(own, src []vma, base uintptr, st *stash) error {
	x := b.x
	type move struct{ from, to, size uint64 }
	var moves []move
	for _, w := range src {
		if w.special() && w.path != "[vsyscall]" && !slices.ContainsFunc(own, func(v vma) bool { return v.path == w.path }) {
			return fmt.Errorf("%w: the other process has %s, pid %d not", ErrBecome, w.path, x.Pid)
		}
	}
	for _, v := range own {
		if !v.special() || v.path == "[vsyscall]" {
			continue
		}
		i := slices.IndexFunc(src, func(w vma) bool { return w.path == v.path })
		if i < 0 {
			return fmt.Errorf("%w: pid %d has %s, the other process not", ErrBecome, x.Pid, v.path)
		}
		if src[i].end-src[i].start != v.end-v.start {
			return fmt.Errorf("%w: %s differs in size", ErrBecome, v.path)
		}
		if src[i].start != v.start {
			moves = append(moves, move{v.start, src[i].start, v.end - v.start})
		}
	}
	overlap := false
	for _, a := range moves {
		for _, c := range moves {
			if a.to < c.from+c.size && c.from < a.to+a.size {
				overlap = true
			}
		}
	}
	remap := func(from, to, size uint64) {
		b.add(unix.SYS_MREMAP, uintptr(from), uintptr(size), uintptr(size), unix.MREMAP_MAYMOVE|unix.MREMAP_FIXED, uintptr(to))
		if x.sysAddr >= from && x.sysAddr < from+size {
			x.sysAddr = x.sysAddr - from + to
		}
	}
	if overlap {
		// All but the scratch pages, the stash and the specials is
		// unmapped by then: 1 GiB above the scratch pages and the stash
		// is free of them.
		park := uint64(base) + 3*scratchSize
		if st != nil {
			park = max(park, st.hi)
		}
		park += 1 << 30
		for i, m := range moves {
			remap(m.from, park, m.size)
			moves[i].from = park
			park += m.size
		}
	}
	for _, m := range moves {
		remap(m.from, m.to, m.size)
	}
	return nil
}

// openFiles adds an open of each file src maps, and returns their paths
// in the order of the calls.
func (b *batch) openFiles(src []vma) []string {
	var paths []string
	for _, v := range src {
		if v.special() || v.anon() || slices.Contains(paths, v.path) {
			continue
		}
		paths = append(paths, v.path)
	}
	for _, p := range paths {
		// Not blocking: a FIFO put at the path since would hold the copy
		// in its open (its map then fails, and so does Become).
		b.add(unix.SYS_OPENAT, atFdcwd, b.put(append([]byte(p), 0)), unix.O_RDONLY|unix.O_CLOEXEC|unix.O_NONBLOCK)
	}
	return paths
}

// mapLike adds the calls that map s's mappings into x, at their addresses
// (or mapping k at at[k], if at is not nil) with their protections:
// anonymous ones anew, files from the descriptors fds opened (paths),
// which it then closes. A private file mapping the
// process wrote to and then made read-only (relocations, RELRO) is mapped
// writable and then made read-only too: the kernel keeps such a mapping
// apart from its neighbours, and so the copy's maps read as the process's.
func (b *batch) mapLike(s *Source, paths []string, fds []uintptr, at []uint64) {
	const mapFixedNoreplace = 0x100000
	for k, v := range s.maps {
		if v.special() {
			continue
		}
		start := v.start
		if at != nil {
			start = at[k]
		}
		size := uintptr(v.end - v.start)
		prot := v.prot()
		relro := !v.anon() && v.perms[3] == 'p' && prot&unix.PROT_WRITE == 0 && len(s.written[k]) > 0
		flags := uintptr(unix.MAP_PRIVATE | mapFixedNoreplace)
		fd, off := ^uintptr(0), uintptr(0)
		if v.anon() {
			flags |= unix.MAP_ANONYMOUS
			if v.path == "[stack]" {
				flags |= unix.MAP_GROWSDOWN
			}
		} else {
			if v.perms[3] == 's' {
				flags = unix.MAP_SHARED | mapFixedNoreplace
			}
			fd, off = fds[slices.Index(paths, v.path)], uintptr(v.off)
		}
		first := prot
		if relro {
			first |= unix.PROT_WRITE
		}
		b.add(unix.SYS_MMAP, uintptr(start), size, first, flags, fd, off)
		if relro {
			b.add(unix.SYS_MPROTECT, uintptr(start), size, prot)
		}
		if prot&unix.PROT_WRITE != 0 {
			// The pages to copy in, allocated in one call each run
			// rather than one fault each. Not asked for in huge pages:
			// a run of one page would take 512 (and the mapping would
			// keep the flag, which the process never set).
			for _, r := range s.written[k] {
				b.add(unix.SYS_MADVISE, uintptr(start+r.lo*pageSize), uintptr((r.hi-r.lo)*pageSize), madvPopulateWrite)
			}
		}
	}
	for _, fd := range fds {
		b.add(unix.SYS_CLOSE, fd)
	}
}

// Bits of a /proc/<pid>/pagemap entry.
const (
	pmPresent = 1 << 63
	pmSwapped = 1 << 62
	pmFile    = 1 << 61
)

// span is a run of pages of a mapping, as page numbers from its start.
type span struct{ lo, hi uint64 }

// writtenPages lists, for each of src's mappings, the runs of its pages
// that are not a file's own: anonymous pages, and those it wrote of
// private file mappings. Pages never touched read zero, or the file.
func writtenPages(src int, maps []vma) ([][]span, error) {
	pm, err := os.Open("/proc/" + strconv.Itoa(src) + "/pagemap")
	if err != nil {
		return nil, fmt.Errorf("%w: %w", ErrGone, err)
	}
	defer pm.Close()
	page := uint64(os.Getpagesize())
	out := make([][]span, len(maps))
	for k, v := range maps {
		if v.special() {
			continue
		}
		n := (v.end - v.start) / page
		ents := make([]byte, n*8)
		if _, err := pm.ReadAt(ents, int64(v.start/page*8)); err != nil {
			return nil, fmt.Errorf("reading the page map of pid %d: %w", src, err)
		}
		start := int64(-1)
		for i := uint64(0); i <= n; i++ {
			own := false
			if i < n {
				e := binary.NativeEndian.Uint64(ents[i*8:])
				own = e&pmSwapped != 0 || e&pmPresent != 0 && e&pmFile == 0
			}
			switch {
			case own && start < 0:
				start = int64(i)
			case !own && start >= 0:
				out[k] = append(out[k], span{uint64(start), i})
				start = -1
			}
		}
	}
	return out, nil
}

// copyWritten copies the written pages of src's mappings into dst, mapped
// as src is (mapping k at at[k], if at is not nil): with process_vm_readv
// and process_vm_writev where dst may write, through /proc/<pid>/mem
// elsewhere.
func copyWritten(src, dst int, maps []vma, written [][]span, at []uint64) error {
	page := uint64(os.Getpagesize())
	var buf []byte
	var forced [][3]uint64 // address in src, in dst, size
	for k, v := range maps {
		shift := uint64(0)
		if at != nil {
			shift = at[k] - v.start
		}
		if v.perms[1] != 'w' {
			for _, r := range written[k] {
				a := v.start + r.lo*page
				forced = append(forced, [3]uint64{a, a + shift, (r.hi - r.lo) * page})
			}
			continue
		}
		for _, r := range written[k] {
			size := int((r.hi - r.lo) * page)
			if cap(buf) < size {
				buf = make([]byte, size)
			}
			b := buf[:size]
			a := uintptr(v.start + r.lo*page)
			local := []unix.Iovec{{Base: &b[0], Len: uint64(size)}}
			remote := []unix.RemoteIovec{{Base: a, Len: size}}
			if n, err := unix.ProcessVMReadv(src, local, remote, 0); err != nil || n != size {
				return fmt.Errorf("reading %#x+%d of pid %d: %d bytes, %v", a, size, src, n, err)
			}
			remote[0].Base += uintptr(shift)
			if n, err := unix.ProcessVMWritev(dst, local, remote, 0); err != nil || n != size {
				return fmt.Errorf("writing %#x+%d of pid %d: %d bytes, %v", remote[0].Base, size, dst, n, err)
			}
		}
	}
	if len(forced) == 0 {
		return nil
	}
	from, err := os.Open("/proc/" + strconv.Itoa(src) + "/mem")
	if err != nil {
		return fmt.Errorf("%w: %w", ErrGone, err)
	}
	defer from.Close()
	// As a debugger writes: pages the mapping does not let the process
	// write (code it relocated, RELRO).
	to, err := os.OpenFile("/proc/"+strconv.Itoa(dst)+"/mem", os.O_WRONLY, 0)
	if err != nil {
		return fmt.Errorf("%w: %w", ErrGone, err)
	}
	defer to.Close()
	for _, f := range forced {
		if cap(buf) < int(f[2]) {
			buf = make([]byte, f[2])
		}
		b := buf[:f[2]]
		if _, err := from.ReadAt(b, int64(f[0])); err != nil {
			return fmt.Errorf("reading %#x+%d of pid %d: %w", f[0], f[2], src, err)
		}
		if _, err := to.WriteAt(b, int64(f[1])); err != nil {
			return fmt.Errorf("writing %#x+%d of pid %d: %w", f[1], f[2], dst, err)
		}
	}
	return nil
}

// prctlMMMap is struct prctl_mm_map.
type prctlMMMap struct {
	StartCode, EndCode, StartData, EndData, StartBrk, Brk, StartStack uint64
	ArgStart, ArgEnd, EnvStart, EnvEnd                                uint64
	Auxv                                                              uint64
	AuxvSize                                                          uint32
	ExeFd                                                             uint32
}

// setMM adds the call that gives x s's memory layout fields: PR_SET_MM_MAP,
// which needs no privilege when the executable is left as it is.
func (b *batch) setMM(s *Source) {
	f := func(n int) uint64 { v, _ := strconv.ParseUint(s.stat[n], 10, 64); return v }
	m := prctlMMMap{
		StartCode: f(26), EndCode: f(27), StartStack: f(28),
		StartData: f(45), EndData: f(46), StartBrk: f(47), Brk: s.brk,
		ArgStart: f(48), ArgEnd: f(49), EnvStart: f(50), EnvEnd: f(51),
		ExeFd: ^uint32(0),
	}
	m.Auxv, m.AuxvSize = uint64(b.put(s.auxv)), uint32(len(s.auxv))
	const prSetMM, prSetMMMap = 35, 14
	b.add(unix.SYS_PRCTL, prSetMM, prSetMMMap, b.put(asBytes(&m)), unsafe.Sizeof(m), 0)
}

func asBytes[T any](v *T) []byte {
	return slices.Clone(unsafe.Slice((*byte)(unsafe.Pointer(v)), unsafe.Sizeof(*v)))
}

// setActions adds the calls that give x s's signal actions: x's handlers
// were in memory that is gone.
func (b *batch) setActions(s *Source, like *Layout) error {
	st := like.status
	caught, err1 := strconv.ParseUint(st["SigCgt"], 16, 64)
	ignored, err2 := strconv.ParseUint(st["SigIgn"], 16, 64)
	if err := errors.Join(err1, err2); err != nil {
		return fmt.Errorf("status of pid %d: %w", b.x.Pid, err)
	}
	var dfl, ign [32]byte
	binary.NativeEndian.PutUint64(ign[:], 1) // SIG_IGN
	dflAt, ignAt := uintptr(0), uintptr(0)
	for sig := 1; sig <= 64; sig++ {
		if sig == int(unix.SIGKILL) || sig == int(unix.SIGSTOP) {
			continue
		}
		bit := uint64(1) << (sig - 1)
		var at uintptr
		switch act, ok := s.actions[sig]; {
		case ok:
			at = b.put(act[:])
		case s.ignored&bit != 0:
			if ignored&bit != 0 {
				continue
			}
			if ignAt == 0 {
				ignAt = b.put(ign[:])
			}
			at = ignAt
		case (caught|ignored)&bit == 0:
			continue // default in both
		default:
			if dflAt == 0 {
				dflAt = b.put(dfl[:])
			}
			at = dflAt
		}
		if at == 0 {
			return fmt.Errorf("%w: too many signal actions", ErrBecome)
		}
		b.add(unix.SYS_RT_SIGACTION, uintptr(sig), at, 0, 8)
	}
	return nil
}

// setThread adds the calls that give x, of layout like, s's umask,
// personality, and the state of its thread only the thread can set.
func (b *batch) setThread(s *Source, like *Layout) {
	st := s.state
	b.add(unix.SYS_UMASK, uintptr(s.umask))
	if s.persona != like.persona {
		// Not otherwise: a sandbox may refuse the call.
		b.add(unix.SYS_PERSONALITY, uintptr(s.persona))
	}
	if st.rseq.Size > 0 {
		b.add(unix.SYS_RSEQ, uintptr(st.rseq.Pointer), uintptr(st.rseq.Size), 0, uintptr(st.rseq.Signature))
	}
	b.add(unix.SYS_SET_ROBUST_LIST, uintptr(st.robust[0]), uintptr(st.robust[1]))
	b.add(unix.SYS_SET_TID_ADDRESS, uintptr(st.clearTID))
	ss := st.altstack
	ss.Flags &^= ssOnstack
	if ss.Flags&ssDisable != 0 {
		ss = altStack{Flags: ssDisable}
	}
	b.add(unix.SYS_SIGALTSTACK, b.put(asBytes(&ss)), 0)
	if len(st.comm) > 0 {
		b.add(unix.SYS_PRCTL, unix.PR_SET_NAME, b.put(append(slices.Clone(st.comm), 0)))
	}
}

// setLimits gives x s's resource limits, from outside.
func setLimits(x int, s *Source) error {
	for r := range s.rlimits {
		var cur unix.Rlimit
		if err := unix.Prlimit(x, r, nil, &cur); err == nil && cur == s.rlimits[r] {
			continue
		}
		if err := unix.Prlimit(x, r, &s.rlimits[r], nil); err != nil {
			return fmt.Errorf("setting limit %d of pid %d: %w", r, x, err)
		}
	}
	return nil
}

// takeRegs gives x s's vector state, signal mask and registers, which
// Detach resumes.
func (x *Proc) takeRegs(s *Source) error {
	st := s.state
	iov := unix.Iovec{Base: &st.xstate[0], Len: uint64(len(st.xstate))}
	if err := ptracePtr(unix.PTRACE_SETREGSET, x.Pid, ntX86Xstate, unsafe.Pointer(&iov)); err != nil {
		return fmt.Errorf("setting the vector state of pid %d: %w", x.Pid, err)
	}
	if err := ptracePtr(ptraceSetSigmask, x.Pid, 8, unsafe.Pointer(&st.sigmask)); err != nil {
		return fmt.Errorf("setting the signal mask of pid %d: %w", x.Pid, err)
	}
	x.Regs, x.rest, x.restartBlock = s.regs, s.rest, s.restart
	if s.restart {
		// The restart would run x's restart block, not s's: EINTR.
		x.Regs.Rip += 2
		eintr := -int64(unix.EINTR)
		x.Regs.Rax = uint64(eintr)
		x.restartBlock = false
	}
	return nil
}
