package sandbox

import (
	"errors"
	"fmt"
	"os"
	"slices"
	"strconv"
	"strings"
	"time"

	"golang.org/x/sys/unix"

	"github.com/deltagym/deltagym/sandbox/cgroup"
	"github.com/deltagym/deltagym/sandbox/ptfork"
)

// Leftovers: the processes a command started that outlive it (`server &`,
// `nohup … &`, a daemon). An exec ends when its own process exits, as in
// a terminal: what it left running runs on as background processes of the
// sandbox, in the command's group (kept, as a background command's is),
// counted against the pids limit, until they exit or the sandbox is
// restored or destroyed. The timeout still ends them all, as does a
// restore or Close that cuts the command short.
//
// Their later output goes where background output goes, the null device:
// each leftover that holds one of the command's pipes (stdin, stdout,
// stderr, at any descriptor) gets the null device in its place, by calls
// injected into it under ptrace (its leader thread, for a threaded one:
// the descriptor table is the process's). Then the exec's output ends with
// its own process, no leftover has a descriptor of the server's (a process
// checkpoint, template or CRIU, takes them as it takes any background
// command), and none dies writing into a pipe no one reads.

// leftoverRounds bounds the passes over the group: a leftover that forks
// while it is handled has its child found in the next pass.
const leftoverRounds = 64

// leftoverStop bounds the wait for one leftover to stop. A process asleep
// in the kernel where no ptrace stop reaches it (a vfork parent) is passed
// over until its next pass instead.
const leftoverStop = time.Second

// leftoverWait bounds the whole handover (many processes, each with a
// table of many descriptors on the pipes), and then the wait for the
// output's end: past it the command's group is ended as a whole.
const leftoverWait = 2 * time.Second

// errLeftovers says the leftovers could not all be given the null device:
// the command's group is ended as a whole instead.
var errLeftovers = errors.New("the processes the command left running could not be detached from its output")

// releaseLeftovers gives every process of cg that holds one of the pipes
// (inodes) the null device in its place. It reports whether processes are
// left in cg (an empty group stays empty: only its processes could add
// one). The ptrace session runs on a thread of its own.
func releaseLeftovers(cg *cgroup.Cgroup, inodes []uint64) (left bool, err error) {
	if pop, err := cg.Populated(); err != nil || !pop {
		return false, err // the common case: nothing left
	}
	done := make(chan error, 1)
	deadline := time.Now().Add(leftoverWait)
	go func() { done <- redirectLeftovers(cg, inodes, deadline) }()
	if err := <-done; err != nil {
		return true, fmt.Errorf("%w: %w", errLeftovers, err)
	}
	return cg.Populated()
}

// redirectLeftovers passes over cg until no process of it holds one of the
// pipes, each holder given the null device (nullAt), by deadline.
func redirectLeftovers(cg *cgroup.Cgroup, inodes []uint64, deadline time.Time) error {
	tr := ptfork.NewSession().Unfollowed() // each pass lists the group's processes again
	defer tr.Close()
	pause := 50 * time.Microsecond
	for range leftoverRounds {
		pids, err := cg.Pids()
		if err != nil {
			return err
		}
		holders, passed := 0, 0
		for _, pid := range pids {
			if time.Now().After(deadline) {
				return fmt.Errorf("not done within %v", leftoverWait)
			}
			fds, err := heldPipes(pid, inodes)
			if err != nil || len(fds) == 0 {
				continue // gone, or nothing of the command's
			}
			holders++
			if !stoppable(pid) {
				passed++
				continue
			}
			if err := nullAt(tr, pid, inodes); err != nil && !errors.Is(err, ptfork.ErrGone) {
				return fmt.Errorf("pid %d: %w", pid, err)
			}
		}
		if holders == 0 {
			return nil
		}
		if passed == holders {
			time.Sleep(pause) // a vfork child runs to its exec; nothing tells when
			pause = min(2*pause, 5*time.Millisecond)
		}
	}
	return errors.New("processes keep starting with the command's pipes (a fork loop?)")
}

// stoppable reports whether pid can be stopped now: not a child of vfork
// before its exec (it shares its parent's memory), nor a process asleep
// in the kernel where a ptrace stop does not reach it (such a child's
// parent).
func stoppable(pid int) bool {
	if _, shared, err := ptfork.SharesParentMemory(pid); err != nil || shared {
		return false
	}
	st, err := ptfork.State(pid)
	return err == nil && st != 'D'
}

// heldPipes lists pid's descriptors that are one of the pipes (inodes).
func heldPipes(pid int, inodes []uint64) ([]int, error) {
	dir := "/proc/" + strconv.Itoa(pid) + "/fd"
	ents, err := os.ReadDir(dir)
	if err != nil {
		return nil, err
	}
	var out []int
	for _, e := range ents {
		link, err := os.Readlink(dir + "/" + e.Name())
		if err != nil || !strings.HasPrefix(link, "pipe:[") {
			continue
		}
		ino, err := strconv.ParseUint(strings.TrimSuffix(strings.TrimPrefix(link, "pipe:["), "]"), 10, 64)
		if err != nil || !slices.Contains(inodes, ino) {
			continue
		}
		if fd, err := strconv.Atoi(e.Name()); err == nil {
			out = append(out, fd)
		}
	}
	return out, nil
}

// fdCloexec reads whether pid's descriptor fd is close-on-exec.
func fdCloexec(pid, fd int) bool {
	raw, err := os.ReadFile("/proc/" + strconv.Itoa(pid) + "/fdinfo/" + strconv.Itoa(fd))
	if err != nil {
		return false
	}
	for line := range strings.Lines(string(raw)) {
		if v, ok := strings.CutPrefix(line, "flags:"); ok {
			flags, err := strconv.ParseUint(strings.TrimSpace(v), 8, 64)
			return err == nil && flags&unix.O_CLOEXEC != 0
		}
	}
	return false
}

// nullAt stops pid and makes each of its descriptors on the pipes
// (inodes) a descriptor of the null device: it opens /dev/null as the
// process sees it (in its root, through a page it maps and unmaps again),
// dup3s it onto each, keeping each one's close-on-exec flag, and closes
// it. The process then goes on where it was. The descriptors are listed
// once it has stopped: a pid that was reused meanwhile, or a descriptor
// changed, holds none of the pipes then.
func nullAt(tr *ptfork.Session, pid int, inodes []uint64) error {
	p, err := tr.SeizeLeader(pid)
	if err != nil {
		return err
	}
	if err := p.WaitFor(leftoverStop); err != nil {
		return errors.Join(err, p.Detach())
	}
	fds, err := heldPipes(pid, inodes)
	if err != nil || len(fds) == 0 {
		return p.Detach() // gone (killed) meanwhile, or nothing of the command's
	}
	return errors.Join(injectNull(p, fds), p.Detach())
}

func injectNull(p *ptfork.Proc, fds []int) (err error) {
	mem := p.Scratch()
	defer func() { err = errors.Join(err, mem.Release()) }()
	path, err := mem.Put("/dev/null")
	if err != nil {
		return err
	}
	fdcwd := unix.AT_FDCWD
	nfd, err := p.Syscall(unix.SYS_OPENAT, uintptr(fdcwd), path, unix.O_RDWR|unix.O_NOCTTY|unix.O_CLOEXEC, 0)
	if err != nil {
		return fmt.Errorf("opening /dev/null: %w", err)
	}
	for _, fd := range fds {
		flags := uintptr(0)
		if fdCloexec(p.Pid, fd) {
			flags = unix.O_CLOEXEC
		}
		if _, err := p.Syscall(unix.SYS_DUP3, nfd, uintptr(fd), flags); err != nil {
			_, _ = p.Syscall(unix.SYS_CLOSE, nfd)
			return fmt.Errorf("dup3 onto fd %d: %w", fd, err)
		}
	}
	if _, err := p.Syscall(unix.SYS_CLOSE, nfd); err != nil {
		return fmt.Errorf("close: %w", err)
	}
	return nil
}

// pipeInodes returns the inodes of the pipes fs are ends of (without
// Fd, which would make a file read by another goroutine blocking).
func pipeInodes(fs ...*os.File) ([]uint64, error) {
	var out []uint64
	for _, f := range fs {
		rc, err := f.SyscallConn()
		if err != nil {
			return nil, err
		}
		var st unix.Stat_t
		var serr error
		if err := rc.Control(func(fd uintptr) { serr = unix.Fstat(int(fd), &st) }); err != nil {
			return nil, err
		}
		if serr != nil {
			return nil, serr
		}
		out = append(out, st.Ino)
	}
	return out, nil
}
