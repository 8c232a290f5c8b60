package procstate

import (
	"errors"
	"fmt"
	"os"
	"slices"
	"time"
	"unsafe"

	"golang.org/x/sys/unix"

	"github.com/deltagym/deltagym/sandbox/cgroup"
	"github.com/deltagym/deltagym/sandbox/initproc"
	"github.com/deltagym/deltagym/sandbox/ptfork"
)

// SpawnCopies brings back the processes of c's templates into the live
// state, after the root swap: the copies forked ahead after c's previous
// restore if there are any (ahead.go), or copies forked now. Called with op
// held; the command group is empty, and the processes the restore killed
// may still be exiting (waited for before copies are forked or run). start
// is when the restore began; again says whether the restore before it
// restored c too (forkAhead).
func (ps *State) SpawnCopies(c *Checkpoint, start time.Time, again bool) error {
	a := ps.takeAhead(c) // before run, which its job holds
	ps.run.Lock()
	defer ps.run.Unlock()
	if err := ps.spawnCopiesLocked(c, a, start, again); err != nil {
		return err
	}
	// Once the copies are detached and the templates frozen again: what
	// comes before the next restore is the agent's.
	ps.mu.Lock()
	ps.restoredAt = time.Now()
	ps.mu.Unlock()
	return nil
}

// spawnCopiesLocked is SpawnCopies once the copies forked ahead for c (a,
// or nil) are taken and run is held.
// +checklocks:ps.run
func (ps *State) spawnCopiesLocked(c *Checkpoint, a *aheadCopies, start time.Time, again bool) error {
	ps.mu.Lock()
	tg := ps.tpls[c.ID]
	ps.mu.Unlock()
	if tg == nil {
		if a != nil {
			ps.endAhead(a, true)
		}
		return fmt.Errorf("%w: the templates of checkpoint %s were released", ErrProcesses, c.ID)
	}
	tr := ptfork.NewSession()
	copies, thawed, err := ps.readyCopies(tr, c, tg, a)
	if err == nil {
		// The copies may share sockets with the templates (a listening
		// one several processes hold, a connected unix one), and so did
		// the processes the restore killed: one of those, not exiting
		// yet, could accept a connection meant for the restored state and
		// reset it as it dies. They exit while the copies are readied;
		// settleKilled then waits, if need be, until they are past that
		// (or gone).
		ps.h.SettleKilled(c.Procs)
		// A copy listens where a killed process may have: once that one
		// has let go of the address (settleKilled waits for the killed
		// that hold sockets no template holds, but for the listening
		// ones the restore shut down before the kill).
		if err = listenAll(copies); err == nil {
			err = ps.letRun(copies)
		}
	}
	if err == nil {
		ps.foldOnce(c)
		ps.forkAhead(c, start, again)
	} else {
		for _, lc := range copies {
			lc.cp.Kill()
			closeFiles(lc.stdio[:])
		}
	}
	// Marked frozen again before the templates are detached (tr.Close),
	// after failed copies are ended.
	if thawed {
		if ferr := ps.setTplFrozen(tg, true); ferr != nil {
			err = errors.Join(err, ferr)
		}
	}
	if cerr := tr.Close(); cerr != nil {
		err = errors.Join(err, cerr)
	}
	return err
}

// readyCopies returns a fixed-up copy of each template of c, stopped under
// ptrace in its group: the copies forked ahead (a, if not nil) if they
// serve, else copies forked now from the templates in group tg. thawed
// says whether it thawed tg (forkCopies). Copies made are returned even on
// error, for the caller to end.
// +checklocks:ps.run
func (ps *State) readyCopies(tr *ptfork.Session, c *Checkpoint, tg *cgroup.Cgroup, a *aheadCopies) (copies []liveCopy, thawed bool, err error) {
	ahead := false
	if a != nil {
		copies = ps.useAhead(tr, c, a)
		ahead = copies != nil
	}
	for {
		if copies == nil {
			// Forking counts against the pids and memory limits, which
			// the killed processes count in until they are gone.
			ps.h.SettleKilled(c.Procs)
			if copies, thawed, err = ps.forkCopies(tr, c, tg); err != nil {
				return copies, thawed, err
			}
		}
		if err = fixUpAll(copies); err == nil || !ahead {
			return copies, thawed, err
		}
		// Parked, a copy is within the agent's reach (prlimit, say):
		// fresh copies instead.
		ps.h.Log().Debug("template copies forked ahead could not be fixed up; forking new ones", "sandbox", ps.h.ID(), "checkpoint", c.ID, "err", err)
		ps.endCopies(copies)
		copies, ahead = nil, false
	}
}

// listenAll gives each of copies its listening sockets (listenAnew).
func listenAll(copies []liveCopy) error {
	for _, lc := range copies {
		if lc.mem == nil {
			continue
		}
		if err := listenAnew(lc.cp, lc.t, lc.mem); err != nil {
			return fmt.Errorf("%w: the copy of %s: %w", ErrProcesses, lc.t.name(), err)
		}
	}
	return nil
}

// letRun detaches the ready copies, which then run: a session's shell
// becomes its session's (its stdio is cleared from copies, the session's
// now). Every copy is remembered as seen live (liveSeen), for the
// huge-page folding. Called with the sandbox's state changes serialised.
func (ps *State) letRun(copies []liveCopy) error {
	for i, lc := range copies {
		exit := lc.exit
		if lc.t.Session != "" && exit == nil {
			exit = ps.h.Watch(lc.nsPid)
		}
		if err := lc.cp.Detach(); err != nil {
			return err
		}
		if lc.t.Session != "" {
			ps.h.AdoptSession(lc.t.Session, lc.t.Attached, lc.cg, lc.cp.Pid, lc.stdio, exit)
			copies[i].stdio = [3]*os.File{} // the session's now
		}
	}
	ps.mu.Lock()
	defer ps.mu.Unlock()
	if ps.liveSeen == nil {
		ps.liveSeen = map[int]uint64{}
	}
	for _, lc := range copies {
		ps.liveSeen[lc.cp.Pid] = 0
		ps.waits = append(ps.waits, lc.t.Waits...)
	}
	return nil
}

// liveCopy is a copy of a template on its way into the live state: stopped
// under ptrace, in its group.
type liveCopy struct {
	cp    *ptfork.Proc
	nsPid int
	t     Template
	cg    *cgroup.Cgroup
	stdio [3]*os.File               // session: the server's ends
	exit  <-chan initproc.ExitEvent // set if the server reaps it
	led   bool                      // it leads its session already (aheadProc.led)
	// mem is the copy's scratch page, kept mapped by fixUp for
	// listenAnew when the copy listens anew.
	mem *ptfork.Scratch
}

// copyGroup returns the group a copy of t goes to: the command group, or a
// new group of its own under it for a session's shell (a timeout kills what
// it runs). The copy is in the template's limit groups, the sandbox's: only
// its place in the tracking hierarchy changes.
func (ps *State) copyGroup(t Template) (*cgroup.Cgroup, error) {
	if t.Session == "" {
		return ps.h.WorkGroup(), nil
	}
	g, err := ps.h.Subgroup("s")
	if err != nil {
		return nil, fmt.Errorf("creating cgroup: %w", err)
	}
	return g, nil
}

// forkCopies forks a copy of each template of c (in group tg) and moves it
// into its group. It thaws tg (the templates stop in ptrace first: they are
// seized with an interrupt pending); thawed says whether it did, for the
// caller to freeze it again before the templates are detached. Copies made
// are returned even on error.
// +checklocks:ps.run
func (ps *State) forkCopies(tr *ptfork.Session, c *Checkpoint, tg *cgroup.Cgroup) (copies []liveCopy, thawed bool, err error) {
	tpls := make([]*ptfork.Proc, len(c.Procs))
	for i, t := range c.Procs {
		if tpls[i], err = tr.Seize(t.HostPid); err != nil {
			if errors.Is(err, ptfork.ErrGone) || dying(t.HostPid) {
				return nil, false, lostTemplate(c, t)
			}
			return nil, false, fmt.Errorf("%w: %s: %w", ErrProcesses, t.name(), err)
		}
	}
	if err := ps.setTplFrozen(tg, false); err != nil {
		return nil, false, err
	}
	for i, t := range c.Procs {
		if err := tpls[i].Wait(); err != nil {
			if errors.Is(err, ptfork.ErrGone) {
				return copies, true, lostTemplate(c, t)
			}
			return copies, true, fmt.Errorf("%w: stopping template of %s: %w", ErrProcesses, t.name(), err)
		}
		cp, nsPid, err := copyTemplate(tpls[i], t)
		if err != nil {
			return copies, true, ps.copyError(t.name(), err)
		}
		lc := liveCopy{cp: cp, nsPid: nsPid, t: t, exit: reapIfOurs(cp.Pid)}
		if lc.cg, err = ps.copyGroup(t); err == nil {
			err = ps.h.MoveCopy(lc.cg, cp.Pid)
		}
		if err == nil {
			// Born in its template's held memory group (see
			// cgroup.HoldMemory): its own memory is the sandbox's.
			err = lc.cg.JoinMemory(cp.Pid)
		}
		copies = append(copies, lc)
		if err != nil {
			return copies, true, err
		}
	}
	return copies, true, nil
}

// useAhead takes the copies forked ahead for c (a): each is seized, then
// moved into its group, which thaws it into its ptrace stop. It returns nil
// if they cannot serve (one was killed: an agent's kill -9 -1, say), having
// ended them; the caller forks copies instead.
// +checklocks:ps.run
func (ps *State) useAhead(tr *ptfork.Session, c *Checkpoint, a *aheadCopies) []liveCopy {
	copies, err := ps.seizeAhead(tr, c, a)
	if err == nil {
		// The group, now empty, serves the next copies forked ahead.
		ps.aheadFree = a.cg
		a.closeFDs()
		return copies
	}
	ps.h.Log().Debug("template copies forked ahead are lost; forking new ones", "sandbox", ps.h.ID(), "checkpoint", c.ID, "err", err)
	ps.endCopies(copies)
	ps.endAhead(a, true)
	return nil
}

// seizeAhead seizes each copy forked ahead for c (a) and moves it into its
// group, which thaws it into its ptrace stop. It fails if one ended or was
// sent a signal while parked; the copies seized are returned even then.
func (ps *State) seizeAhead(tr *ptfork.Session, c *Checkpoint, a *aheadCopies) ([]liveCopy, error) {
	copies := make([]liveCopy, 0, len(a.procs))
	for i, p := range a.procs {
		if !p.alive() {
			return copies, fmt.Errorf("pid %d ended", p.pid)
		}
		cp, err := tr.Seize(p.pid)
		if err != nil {
			return copies, err
		}
		lc := liveCopy{cp: cp, nsPid: p.nsPid, t: c.Procs[i], exit: p.exit, led: p.led}
		if lc.cg, err = ps.copyGroup(lc.t); err == nil {
			err = ps.h.MoveCopy(lc.cg, cp.Pid)
		}
		copies = append(copies, lc)
		if err != nil {
			return copies, err
		}
	}
	for _, lc := range copies {
		if err := lc.cp.Wait(); err != nil {
			return copies, err
		}
		// Parked, a copy is a process of the sandbox an agent can signal
		// (pkill, kill -STOP); a fresh copy has no signal pending, and
		// neither may this one.
		pending, err := lc.cp.SignalsPending()
		if err == nil && (pending || lc.cp.Signal != 0) {
			err = errors.New("a signal was sent to a copy")
		}
		if err != nil {
			return copies, err
		}
	}
	return copies, nil
}

// endCopies ends copies that will not run, and the groups made for them.
func (ps *State) endCopies(copies []liveCopy) {
	for _, lc := range copies {
		lc.cp.Kill()
		closeFiles(lc.stdio[:])
		if lc.cg != nil && lc.cg != ps.h.WorkGroup() {
			_ = lc.cg.Delete() // a session's, made for it
		}
	}
}

// fixUpAll fixes up each of copies (fixUp).
func fixUpAll(copies []liveCopy) error {
	for i := range copies {
		lc := &copies[i]
		var err error
		t := lc.t
		t.Leader = t.Leader && !lc.led
		if lc.stdio, lc.mem, err = fixUp(lc.cp, t, false); err != nil {
			return fmt.Errorf("%w: fixing up the copy of %s: %w", ErrProcesses, lc.t.name(), err)
		}
	}
	return nil
}

// lostTemplate is the error of a restore of c whose template of t is gone.
func lostTemplate(c *Checkpoint, t Template) error {
	return fmt.Errorf("%w: the frozen copy of %s kept by checkpoint %s was lost (killed after the checkpoint); the checkpoint can no longer bring it back; restore another checkpoint instead (one taken with process mode \"files\" keeps no processes)", ErrProcesses, t.name(), c.ID)
}

func closeFiles(fs []*os.File) {
	for _, f := range fs {
		if f != nil {
			f.Close()
		}
	}
}

// fixUp makes a stopped copy belong to the restored state, by system calls
// it makes itself. For a session's shell it returns the server's ends of its
// new stdin, stdout and stderr pipes. A copy to be saved as an image
// (forImage) is made in the live sandbox, beside the live process.
func fixUp(cp *ptfork.Proc, t Template, forImage bool) (stdio [3]*os.File, later *ptfork.Scratch, err error) {
	mem := cp.Scratch()
	if !forImage && listens(t) {
		later = mem // for listenAnew, which releases it
	} else {
		defer func() {
			if uerr := mem.Release(); uerr != nil && err == nil {
				err = uerr
			}
		}()
	}
	if err := fixUpIdentity(cp, t); err != nil {
		return stdio, later, err
	}
	if err := fixUpFiles(cp, t, mem); err != nil {
		return stdio, later, err
	}
	if err := fixUpPrivate(cp, t, mem, forImage); err != nil {
		return stdio, later, err
	}
	if t.Session == "" {
		return stdio, later, nil
	}
	a, err := mem.Put("") // room for pipe2's result
	if err != nil {
		return stdio, later, err
	}
	stdio, err = sessionPipes(cp, a)
	return stdio, later, err
}

// ListensOnTCP reports whether copies of c's templates listen anew on a
// TCP port (private.go).
func (c *Checkpoint) ListensOnTCP() bool {
	return slices.ContainsFunc(c.Procs, func(t Template) bool {
		return slices.ContainsFunc(t.Private, func(p Private) bool { return p.Kind == "tcplisten" })
	})
}

// listens reports whether copies of t listen anew on a socket (private.go).
func listens(t Template) bool {
	return slices.ContainsFunc(t.Private, Private.listensAnew)
}

// fixUpIdentity gives the copy back what its template was made not to
// have: the process's dumpable flag and the lead of a session of its own.
func fixUpIdentity(cp *ptfork.Proc, t Template) error {
	// A copy is born non-dumpable, as its template is kept; the process it
	// copies was dumpable (1: the flag a process can set itself; 2, set by
	// the kernel for some credential changes, cannot be, and stays 0).
	if t.Dumpable == 1 {
		if _, err := cp.Syscall(unix.SYS_PRCTL, unix.PR_SET_DUMPABLE, 1); err != nil {
			return fmt.Errorf("making the copy dumpable: %w", err)
		}
	}
	// A copy is born in its template's session; the process it copies led
	// one of its own.
	if t.Leader {
		if _, err := cp.Syscall(unix.SYS_SETSID); err != nil {
			return fmt.Errorf("setsid: %w", err)
		}
	}
	return nil
}

// fixUpFiles points the copy's working directory and the files it has open
// in the sandbox's root at the restored root: each file is reopened by path
// with the same flags, on the same fd, at the same offset.
func fixUpFiles(cp *ptfork.Proc, t Template, mem *ptfork.Scratch) error {
	// A cwd at the root needs nothing: the root swap re-pointed the
	// template's, and the copy inherits it.
	if t.Cwd != "/" {
		a, err := mem.Put(t.Cwd)
		if err != nil {
			return err
		}
		if _, err := cp.Syscall(unix.SYS_CHDIR, a); err != nil {
			return fmt.Errorf("chdir %s: %w", t.Cwd, err)
		}
	}
	for _, f := range t.Files {
		if err := reopenFile(cp, f, mem); err != nil {
			return err
		}
	}
	return nil
}

// reopenFile reopens f in the copy, on its fd, at its offset; one that is
// the same open file as a lower descriptor (DupOf, reopened before it) is
// a dup of that one.
func reopenFile(cp *ptfork.Proc, f File, mem *ptfork.Scratch) error {
	if f.DupOf > 0 {
		if _, err := cp.Syscall(unix.SYS_DUP3, uintptr(f.DupOf-1), uintptr(f.FD), uintptr(f.Flags&unix.O_CLOEXEC)); err != nil {
			return fmt.Errorf("dup3 of fd %d onto fd %d: %w", f.DupOf-1, f.FD, err)
		}
		return nil
	}
	a, err := mem.Put(f.Path)
	if err != nil {
		return err
	}
	flags := f.Flags &^ (unix.O_CREAT | unix.O_EXCL | unix.O_TRUNC | unix.O_NOCTTY)
	fdcwd := unix.AT_FDCWD
	nfd, err := cp.Syscall(unix.SYS_OPENAT, uintptr(fdcwd), a, uintptr(flags), 0)
	if err != nil {
		return fmt.Errorf("reopening %s (fd %d): %w", f.Path, f.FD, err)
	}
	// The open takes the lowest free descriptor: f's own, if it is free
	// (a tree's root's that Become closed), which needs no dup.
	if nfd != uintptr(f.FD) {
		if _, err := cp.Syscall(unix.SYS_DUP3, nfd, uintptr(f.FD), uintptr(f.Flags&unix.O_CLOEXEC)); err != nil {
			return fmt.Errorf("dup3 onto fd %d: %w", f.FD, err)
		}
		if _, err := cp.Syscall(unix.SYS_CLOSE, nfd); err != nil {
			return fmt.Errorf("close: %w", err)
		}
	}
	if f.Flags&unix.O_APPEND == 0 && f.Pos > 0 {
		if _, err := cp.Syscall(unix.SYS_LSEEK, uintptr(f.FD), uintptr(f.Pos), 0); err != nil && !errors.Is(err, unix.ESPIPE) {
			return fmt.Errorf("seeking fd %d: %w", f.FD, err)
		}
	}
	return nil
}

// sessionPipes gives a copied shell fresh pipes as fds 0, 1 and 2 and
// returns the server's ends: stdin's write end, stdout's and stderr's read
// ends.
func sessionPipes(cp *ptfork.Proc, mem uintptr) (stdio [3]*os.File, err error) {
	pidfd, err := unix.PidfdOpen(cp.Pid, 0)
	if err != nil {
		return stdio, fmt.Errorf("pidfd_open: %w", err)
	}
	defer unix.Close(pidfd)
	var fds [6]int32 // r0 w0 r1 w1 r2 w2, in the copy
	for i := 0; i < 3; i++ {
		if _, err := cp.Syscall(unix.SYS_PIPE2, mem, unix.O_CLOEXEC); err != nil {
			return stdio, fmt.Errorf("pipe2: %w", err)
		}
		var b [8]byte
		if err := cp.Read(mem, b[:]); err != nil {
			return stdio, err
		}
		fds[2*i] = *(*int32)(unsafe.Pointer(&b[0]))
		fds[2*i+1] = *(*int32)(unsafe.Pointer(&b[4]))
	}
	// The copy's ends become its 0, 1, 2; ours are taken out of its table.
	mine := [3]int32{fds[0], fds[3], fds[5]}
	theirs := [3]int32{fds[1], fds[2], fds[4]}
	for i, fd := range mine {
		if _, err := cp.Syscall(unix.SYS_DUP3, uintptr(fd), uintptr(i), 0); err != nil {
			return stdio, fmt.Errorf("dup3 onto fd %d: %w", i, err)
		}
	}
	names := [3]string{"session stdin", "session stdout", "session stderr"}
	for i, fd := range theirs {
		h, err := unix.PidfdGetfd(pidfd, int(fd), 0)
		if err != nil {
			closeFiles(stdio[:])
			return [3]*os.File{}, fmt.Errorf("pidfd_getfd: %w", err)
		}
		// Non-blocking, so that os.NewFile makes it pollable: the session's reads take
		// deadlines (an interactive command's wait ends at its timeout). The flag is our end's
		// open file description's: the copy's ends are other descriptions.
		if err := unix.SetNonblock(h, true); err != nil {
			unix.Close(h)
			closeFiles(stdio[:])
			return [3]*os.File{}, fmt.Errorf("making the session's pipe non-blocking: %w", err)
		}
		stdio[i] = os.NewFile(uintptr(h), names[i])
	}
	for _, fd := range slices.Concat(mine[:], theirs[:]) {
		if _, err := cp.Syscall(unix.SYS_CLOSE, uintptr(fd)); err != nil {
			closeFiles(stdio[:])
			return [3]*os.File{}, fmt.Errorf("close: %w", err)
		}
	}
	return stdio, nil
}
