package procstate

// Processes restored by criu, kept out of the templates' reach.
//
// criu restores a process's seccomp filters but not their listener, and
// every dump has the init's filter's hand-overs to its listener rewritten to
// plain allows (criu.DumpTree): a process criu restored could otherwise
// signal the templates of its sandbox, or change their limits. So criu
// leaves each restored tree stopped before it runs an instruction of its
// own (TreeRestoreOpts.LeaveStopped), and every process of it gets the
// guard filter stacked on its own (initproc.GuardFilter), injected by
// ptrace: the filter's listener, taken out of the process with
// pidfd_getfd, goes to the sandbox's init, which answers its calls as it
// answers its own filter's. Then the processes that ran at the dump go
// on. Processes they fork, and template copies made of them, inherit the
// filter, and with it the init's supervision.

import (
	"encoding/binary"
	"errors"
	"fmt"
	"os"
	"strconv"
	"strings"

	"golang.org/x/sys/unix"

	"github.com/deltagym/deltagym/sandbox/cgroup"
	"github.com/deltagym/deltagym/sandbox/criu"
	"github.com/deltagym/deltagym/sandbox/initproc"
	"github.com/deltagym/deltagym/sandbox/ptfork"
)

// guardTree guards every process of the tree criu restored, stopped, into
// cg from the images in dir, then resumes those that were not stopped at
// the dump (and root too if resumeRoot).
func (ps *State) guardTree(cg *cgroup.Cgroup, dir string, root int, resumeRoot bool) error {
	stopped, err := criu.StoppedTasks(dir)
	if err != nil {
		return fmt.Errorf("reading the task states of the images: %w", err)
	}
	pids, err := cg.Pids()
	if err != nil {
		return err
	}
	if err := guardProcs(ps.h.Guard, pids); err != nil {
		return err
	}
	for _, pid := range pids {
		ns, err := nsPid(pid)
		if err != nil {
			return err
		}
		if !stopped[ns] || resumeRoot && pid == root {
			if err := unix.Kill(pid, unix.SIGCONT); err != nil && !errors.Is(err, unix.ESRCH) {
				return fmt.Errorf("resuming restored pid %d: %w", pid, err)
			}
		}
	}
	return nil
}

// guardProcs stacks the guard filter on each stopped process pids (host
// pids) and hands each one's listener to guard.
func guardProcs(guard func(*os.File) error, pids []int) (err error) {
	tr := ptfork.NewSession()
	defer func() {
		if cerr := tr.Close(); cerr != nil {
			err = errors.Join(err, cerr)
		}
	}()
	for _, pid := range pids {
		if err := guardProc(tr, guard, pid); err != nil {
			return fmt.Errorf("guarding restored pid %d: %w", pid, err)
		}
	}
	return nil
}

// guardProc injects the guard filter into pid with a new listener (on
// every thread of it), takes the listener out of it, and hands it to
// guard before pid is detached.
func guardProc(tr *ptfork.Session, guard func(*os.File) error, pid int) (err error) {
	p, err := tr.SeizeLeader(pid)
	if err != nil {
		return err
	}
	defer func() { err = errors.Join(err, p.Detach()) }()
	if err := p.Wait(); err != nil {
		return err
	}
	prog := initproc.GuardFilter()
	size := uintptr(16 + 8*len(prog)) // struct sock_fprog, then the program
	page := uintptr(os.Getpagesize())
	size = (size + page - 1) &^ (page - 1)
	addr, err := p.Syscall(unix.SYS_MMAP, 0, size, unix.PROT_READ|unix.PROT_WRITE,
		unix.MAP_PRIVATE|unix.MAP_ANONYMOUS, ^uintptr(0), 0)
	if err != nil {
		return fmt.Errorf("mapping the filter: %w", err)
	}
	defer func() {
		if _, uerr := p.Syscall(unix.SYS_MUNMAP, addr, size); uerr != nil {
			err = errors.Join(err, fmt.Errorf("unmapping the filter: %w", uerr))
		}
	}()
	if err := p.Write(addr, fprogBytes(prog, addr+16)); err != nil {
		return err
	}
	flags := uintptr(unix.SECCOMP_FILTER_FLAG_NEW_LISTENER)
	if n, err := taskCount(pid); err != nil {
		return err
	} else if n > 1 {
		// Every thread, or none: a thread left out (its filters not
		// the caller's) fails the call.
		flags |= unix.SECCOMP_FILTER_FLAG_TSYNC | unix.SECCOMP_FILTER_FLAG_TSYNC_ESRCH
	}
	fd, err := p.Syscall(unix.SYS_SECCOMP, unix.SECCOMP_SET_MODE_FILTER, flags, addr)
	if err != nil {
		return fmt.Errorf("installing the guard filter: %w", err)
	}
	listener, err := takeFd(pid, int(fd))
	if _, cerr := p.Syscall(unix.SYS_CLOSE, fd); cerr != nil {
		err = errors.Join(err, fmt.Errorf("closing the listener in the process: %w", cerr))
	}
	if err != nil {
		if listener != nil {
			listener.Close()
		}
		return err
	}
	defer listener.Close()
	return guard(listener)
}

// fprogBytes lays out struct sock_fprog {u16 len; u64 filter} pointing at
// at, followed by the program (placed at at).
func fprogBytes(prog []unix.SockFilter, at uintptr) []byte {
	b := make([]byte, 16, 16+8*len(prog))
	binary.NativeEndian.PutUint16(b[0:], uint16(len(prog)))
	binary.NativeEndian.PutUint64(b[8:], uint64(at))
	for _, f := range prog {
		b = binary.NativeEndian.AppendUint16(b, f.Code)
		b = append(b, f.Jt, f.Jf)
		b = binary.NativeEndian.AppendUint32(b, f.K)
	}
	return b
}

// takeFd copies descriptor fd of process pid into the server.
func takeFd(pid, fd int) (*os.File, error) {
	pfd, err := unix.PidfdOpen(pid, 0)
	if err != nil {
		return nil, fmt.Errorf("opening a pidfd: %w", err)
	}
	defer unix.Close(pfd)
	n, err := unix.PidfdGetfd(pfd, fd, 0)
	if err != nil {
		return nil, fmt.Errorf("taking fd %d: %w", fd, err)
	}
	return os.NewFile(uintptr(n), "fd "+strconv.Itoa(fd)+" of "+strconv.Itoa(pid)), nil
}

// taskCount returns the number of threads of pid.
func taskCount(pid int) (int, error) {
	ts, err := os.ReadDir("/proc/" + strconv.Itoa(pid) + "/task")
	if err != nil {
		return 0, err
	}
	return len(ts), nil
}

// nsPid returns host pid's pid in its innermost pid namespace.
func nsPid(pid int) (int, error) {
	b, err := os.ReadFile("/proc/" + strconv.Itoa(pid) + "/status")
	if err != nil {
		return 0, err
	}
	for line := range strings.Lines(string(b)) {
		if v, ok := strings.CutPrefix(line, "NSpid:"); ok {
			f := strings.Fields(v)
			if len(f) > 0 {
				return strconv.Atoi(f[len(f)-1])
			}
		}
	}
	return 0, fmt.Errorf("no NSpid in /proc/%d/status", pid)
}
