package procstate

import (
	"errors"
	"fmt"
	"slices"
	"sync"
	"sync/atomic"
	"time"

	"golang.org/x/sys/unix"

	"github.com/deltagym/deltagym/sandbox/cgroup"
	"github.com/deltagym/deltagym/sandbox/initproc"
	"github.com/deltagym/deltagym/sandbox/ptfork"
)

// Copies forked ahead.
//
// A restore of a checkpoint with templates forks a copy of each template:
// the kernel copies the template's page tables, a good part of a process's
// rollback. A checkpoint restored once is likely to be restored again (a
// rollback loop, a GRPO group's next try, a search going back to a node),
// so after each in-place restore a background job forks the next copies of
// the same templates at once, while the restored copies run, and parks
// them, frozen, in a group of their own (p<n>). The next restore of that
// checkpoint takes them instead of forking: it seizes each, moves it into
// the command group (which thaws it into the ptrace stop the seizure asked
// for) and fixes it up as it would a copy just forked, after the root swap;
// but the job already made the session a copy of a session leader leads
// (setsid does not depend on the root), one round trip to the copy fewer at
// the restore, which the rollback-process load test's copies, with no other
// fix-up, show in their latency.
//
// Why a parked copy is as good as a fresh one: it is a template's copy that
// never ran, with the template's registers and, copy-on-write, its memory
// (the template is frozen and never changes). It is frozen by the cgroup
// freezer, as a template is, so neither a kill of the command group nor a
// crash lets it run (after a crash dg-init ends it: it keeps t<n> and i<n>
// groups only). Its root: it is born in the live root, and every pivot_root
// re-points the tasks whose root is the old root, so the swap of the next
// restore moves it into the restored root. A task still being cloned while
// the root is swapped would miss that (its fs struct already copied), so the
// job clones under forkMu, which the swaps hold too. Its cwd and files are
// set by the fix-ups, by path, as for any copy.
//
// What it costs: one more process per template while the sandbox runs
// (frozen: a pid, and page tables, 16 KiB for 8 MB), and the fork's CPU, off
// the restore's path but spent all the same. Only the checkpoint restored
// last keeps copies ahead; a restore of another, a checkpoint's release and
// the sandbox's end drop them. A checkpoint with CRIU trees gets none: a copy
// could hold a pid a tree needs back. Nor does a sandbox with a pids limit
// that the copies would bring within a quarter of.

// aheadCopies are the copies forked ahead for one checkpoint.
type aheadCopies struct {
	ck   string
	done chan struct{} // closed when the job has ended; it sets the fields below
	cg   *cgroup.Cgroup
	// procs are the copies, in the order of the checkpoint's templates.
	procs []aheadProc
	err   error
	// drop asks a job that has not started yet to make nothing.
	drop atomic.Bool
	// endOnce ends the copies and their group once (end).
	endOnce sync.Once
	endErr  error
}

// end makes a job that has not started make nothing, waits for the job,
// and ends the copies: their pidfds, the processes and their group. Once;
// later calls return the first's error.
func (a *aheadCopies) end() error {
	a.drop.Store(true)
	<-a.done
	a.endOnce.Do(func() {
		a.closeFDs()
		if a.cg != nil {
			if err := a.cg.Delete(); err != nil && !errors.Is(err, cgroup.ErrNotExist) {
				a.endErr = err
			}
		}
	})
	return a.endErr
}

type aheadProc struct {
	pid, nsPid int
	// pidfd pins the copy's identity: a copy killed while parked (an
	// agent's kill -9 -1) may have its pid taken by another process by
	// the time a restore comes.
	pidfd int
	exit  <-chan initproc.ExitEvent // set if the server reaps it
	// led: the copy already leads a session of its own (its template's
	// process did), made by the job, so that the restore's fix-ups do not
	// make one more round trip to the copy for it.
	led bool
}

// alive says whether the copy is still there (and so still has its pid).
func (p aheadProc) alive() bool { return unix.PidfdSendSignal(p.pidfd, 0, nil, 0) == nil }

// closeFDs closes the copies' pidfds, once their job is done.
func (a *aheadCopies) closeFDs() {
	for i := range a.procs {
		if a.procs[i].pidfd >= 0 {
			unix.Close(a.procs[i].pidfd)
			a.procs[i].pidfd = -1
		}
	}
}

// errAheadDropped: the copies were no longer wanted when the job started.
type errAheadDropped struct{}

func (errAheadDropped) Error() string { return "dropped before the job started" }

// forkAhead starts a job that forks copies of c's templates for its next
// restore, in place of those the sandbox kept for another checkpoint (if any).
// Called with the sandbox's state changes serialised, after a restore of c made
// its copies.
//
// Only when c was restored twice in a row (no other restore, nor a
// checkpoint, in between), the sign that it is restored again and again;
// the same sign that builds its next root ahead (prepareSpareFrom). A
// search that moves from node to node would waste the copies and the CPU.
//
// Not when restores come back to back: if this restore began sooner after
// the previous one returned than the last job took, the next one would
// likely find its copies not ready and wait for them, and a restore that
// waits for the job costs more than one that forks (the job's seizures and
// cgroup moves come on top of the fork), while one that finds its copies
// ready costs less (BenchmarkRollbackWithProcess, back to back, and
// BenchmarkRollbackStepWithProcess, with a step between, each against
// path=template-at-restore). The gap is the agent's step: it is counted
// from the previous restore's return, not from before that restore
// detached its copies, which on a busy machine would make restores back to
// back look spaced (TestForkAheadBackToBack).
// start is when this restore began; again says whether the one before it
// restored c too.
func (ps *State) forkAhead(c *Checkpoint, start time.Time, again bool) {
	ps.mu.Lock()
	prev := ps.restoredAt // set once the restore before this one had returned
	ps.mu.Unlock()
	if ps.cfg.ForkAtRestore || !again || len(c.Images) > 0 || len(c.Procs) == 0 ||
		!ps.cfg.AheadAlways() && !prev.IsZero() && start.Sub(prev) < time.Duration(ps.aheadTook.Load()) {
		ps.dropAhead("", true)
		return
	}
	a := &aheadCopies{ck: c.ID, done: make(chan struct{})}
	ps.mu.Lock()
	old := ps.ahead
	ps.ahead = a
	ps.mu.Unlock()
	if old != nil {
		ps.endAhead(old, true)
	}
	ps.bg.Add(1) // the sandbox's end waits for it (Wait) before it removes its group
	began := time.Now()
	go func() {
		defer ps.bg.Done()
		defer close(a.done)
		a.err = ps.forkAheadJob(c, a)
		ps.aheadTook.Store(int64(time.Since(began)))
		if a.err != nil {
			ps.h.Log().Debug("forking template copies ahead", "sandbox", ps.h.ID(), "checkpoint", c.ID, "err", a.err)
		}
	}()
}

// PidRoom says whether n more processes keep a sandbox of group cg within
// three quarters of its pids limit lim (if it has one). A cgroup file costs
// tens of microseconds to read: the job forking ahead reads it off the
// restore's path.
func PidRoom(lim int64, cg *cgroup.Cgroup, n int) bool {
	if lim <= 0 {
		return true
	}
	cur, err := cg.PidsCurrent()
	return err == nil && (cur+int64(n))*4 <= lim*3
}

// forkAheadJob forks a copy of each template of c into a frozen group, a.cg:
// the one the last copies were taken from, or a new one. On error the
// copies made so far are left there, for endAhead.
func (ps *State) forkAheadJob(c *Checkpoint, a *aheadCopies) error {
	ps.run.Lock()
	defer ps.run.Unlock()
	if a.drop.Load() {
		return errAheadDropped{}
	}
	return ps.forkAheadLocked(c, a)
}

// forkAheadLocked is forkAheadJob for a job still wanted, run held.
// +checklocks:ps.run
func (ps *State) forkAheadLocked(c *Checkpoint, a *aheadCopies) error {
	if !PidRoom(ps.h.PidsLimit(), ps.h.Cgroup(), len(c.Procs)) {
		return errors.New("the sandbox is near its pids limit")
	}
	ps.mu.Lock()
	tg := ps.tpls[c.ID]
	ps.mu.Unlock()
	if tg == nil {
		return fmt.Errorf("the templates of checkpoint %s were released", c.ID)
	}
	// The group the last copies were taken from, if they were: empty and
	// still frozen.
	g := ps.aheadFree
	ps.aheadFree = nil
	if g == nil {
		var err error
		if g, err = ps.frozenGroup("p"); err != nil {
			return fmt.Errorf("creating cgroup: %w", err)
		}
	}
	a.cg = g
	tr := ptfork.NewSession()
	err := ps.seizeTemplates(tr, c, tg, func(tpls []*ptfork.Proc) error { return forkParked(c, a, g, tpls, &ps.forkMu) })
	// The copies are detached into their frozen group, the templates
	// (frozen again first) into theirs.
	if cerr := tr.Close(); cerr != nil {
		err = errors.Join(err, cerr)
	}
	return err
}

// seizeTemplates seizes the templates of c, thaws their group tg (they stop
// in ptrace first: they are seized with an interrupt pending), calls fork
// with them, and freezes tg again; the caller closes tr.
// +checklocks:ps.run
func (ps *State) seizeTemplates(tr *ptfork.Session, c *Checkpoint, tg *cgroup.Cgroup, fork func([]*ptfork.Proc) error) error {
	tpls := make([]*ptfork.Proc, len(c.Procs))
	for i, t := range c.Procs {
		var err error
		if tpls[i], err = tr.Seize(t.HostPid); err != nil {
			return fmt.Errorf("%s: %w", t.name(), err)
		}
	}
	if err := ps.setTplFrozen(tg, false); err != nil {
		return err
	}
	err := fork(tpls)
	if ferr := ps.setTplFrozen(tg, true); ferr != nil {
		err = errors.Join(err, ferr)
	}
	return err
}

// forkParked has each seized template of c (tpls) fork a copy, which it
// moves into group g (frozen) and records in a; a copy of a session
// leader's process is made one too. On error the copies made so far are
// left in g, for endAhead.
func forkParked(c *Checkpoint, a *aheadCopies, g *cgroup.Cgroup, tpls []*ptfork.Proc, forkMu *sync.Mutex) error {
	for i, t := range c.Procs {
		if err := tpls[i].Wait(); err != nil {
			return fmt.Errorf("stopping the template of %s: %w", t.name(), err)
		}
		forkMu.Lock()
		cp, nsPid, err := copyTemplate(tpls[i], t)
		forkMu.Unlock()
		if err != nil {
			return fmt.Errorf("copying %s: %w", t.name(), err)
		}
		exit := reapIfOurs(cp.Pid)
		fd, err := unix.PidfdOpen(cp.Pid, 0)
		if err != nil {
			cp.Kill()
			return fmt.Errorf("pidfd_open: %w", err)
		}
		a.procs = append(a.procs, aheadProc{pid: cp.Pid, nsPid: nsPid, pidfd: fd, exit: exit})
		if t.Leader {
			// Where the restore would, in the copy's own context; a copy
			// that cannot gets its session at the restore instead.
			_, serr := cp.Syscall(unix.SYS_SETSID)
			if cp.Signal != 0 {
				// Sent while it stepped (the agent can signal a copy):
				// detached, it would take it, out of the restore's sight.
				cp.Kill()
				return fmt.Errorf("the copy of %s was sent signal %d as it was made", t.name(), cp.Signal)
			}
			a.procs[len(a.procs)-1].led = serr == nil
		}
		// Out of the template group before it is frozen again: a copy
		// detached there would be a template to a restarted server. Born
		// in its template's held memory group (cgroup.HoldMemory), it
		// joins the sandbox's.
		if err := g.Move(cp.Pid); err != nil {
			cp.Kill()
			return err
		}
		if err := g.JoinMemory(cp.Pid); err != nil {
			cp.Kill()
			return err
		}
	}
	return nil
}

// clearAhead returns the copies the sandbox keeps forked ahead, if any, and
// forgets them.
func (ps *State) clearAhead() *aheadCopies {
	ps.mu.Lock()
	defer ps.mu.Unlock()
	a := ps.ahead
	ps.ahead = nil
	return a
}

// takeAhead returns the copies forked ahead for c, once their job is done,
// or nil; copies kept for another checkpoint are dropped. Called with op
// held.
func (ps *State) takeAhead(c *Checkpoint) *aheadCopies {
	a := ps.clearAhead()
	if a == nil {
		return nil
	}
	if a.ck != c.ID {
		ps.endAhead(a, true)
		return nil
	}
	<-a.done
	if a.err != nil || len(a.procs) != len(c.Procs) {
		ps.endAhead(a, true)
		return nil
	}
	return a
}

// dropAhead drops the copies forked ahead, if they are for checkpoint id
// (any checkpoint: ""). Their job, if running, ends first, in the
// background. Called with the sandbox's state changes serialised, or (tracked
// false) not.
func (ps *State) dropAhead(id string, tracked bool) {
	ps.mu.Lock()
	a := ps.ahead
	if a != nil && (id == "" || a.ck == id) {
		ps.ahead = nil
	} else {
		a = nil
	}
	ps.mu.Unlock()
	if a != nil {
		ps.endAhead(a, tracked)
	}
}

// endAhead ends copies forked ahead that will not be used, in the background.
// With tracked (state changes serialised), the sandbox's end waits for that
// (Wait); a caller outside them (a checkpoint's release) must not add to ps.bg,
// which the sandbox's end may be waiting on: such copies are listed in
// ps.aheadEnding until ended, and the sandbox's end ends them itself
// (EndAhead).
func (ps *State) endAhead(a *aheadCopies, tracked bool) {
	a.drop.Store(true)
	if tracked {
		ps.bg.Add(1)
	} else {
		ps.mu.Lock()
		ps.aheadEnding = append(ps.aheadEnding, a)
		ps.mu.Unlock()
	}
	go func() {
		if tracked {
			defer ps.bg.Done()
		}
		if err := a.end(); err != nil {
			ps.h.Log().Warn("ending template copies forked ahead", "sandbox", ps.h.ID(), "checkpoint", a.ck, "err", err)
		}
		if !tracked {
			ps.mu.Lock()
			ps.aheadEnding = slices.DeleteFunc(ps.aheadEnding, func(x *aheadCopies) bool { return x == a })
			ps.mu.Unlock()
		}
	}()
}

// EndAhead ends the copies forked ahead, those being ended in the
// background after a release included, and returns once they are gone:
// before the sandbox's end, which a frozen process could hold up. Called
// with the sandbox's state changes serialised.
func (ps *State) EndAhead() error {
	ps.mu.Lock()
	all := slices.Clone(ps.aheadEnding)
	if ps.ahead != nil {
		all = append(all, ps.ahead)
		ps.ahead = nil
	}
	ps.mu.Unlock()
	var errs []error
	for _, a := range all {
		errs = append(errs, a.end())
	}
	return errors.Join(errs...)
}

// WaitAhead waits until the job forking copies ahead, if one runs, is done.
// Called with the sandbox's state changes serialised: no new job starts
// meanwhile.
func (ps *State) WaitAhead() {
	ps.mu.Lock()
	a := ps.ahead
	ps.mu.Unlock()
	if a != nil {
		<-a.done
	}
}

// IsAheadGroup says whether name is that of a group of copies forked ahead.
func IsAheadGroup(name string) bool { return numbered(name, 'p') }

// IsTemplateGroup reports whether a sub-group of a sandbox's group named
// name holds templates (frozenGroup's "t" names).
func IsTemplateGroup(name string) bool { return numbered(name, 't') }

// numbered reports whether name is prefix followed by a decimal number.
func numbered(name string, prefix byte) bool {
	if len(name) < 2 || name[0] != prefix {
		return false
	}
	for _, r := range name[1:] {
		if r < '0' || r > '9' {
			return false
		}
	}
	return true
}
