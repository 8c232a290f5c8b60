package sandbox

import (
	"bytes"
	"errors"
	"fmt"
	"os"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"golang.org/x/sys/unix"

	"github.com/deltagym/deltagym/sandbox/cgroup"
	"github.com/deltagym/deltagym/sandbox/procstate"
)

// Command groups are used again. Each restore with processes kills the
// command group and needs a new one at once, for the copies: a new group is
// a mkdir in the tracking hierarchy (made ahead, takeWorkGroup) and the
// killed one an rmdir, with its exec groups (one more of each once the
// restored sandbox runs a command): CPU spent on every restore, on a
// machine that back-to-back restores keep busy. So once the killed group's
// processes are gone, retireWork offers it, with its idle exec groups and
// its kept files, to a later restore instead (reuseW, one at a time: one
// offered while another waits there is removed). The one waiting stays
// until a restore takes it or the sandbox is destroyed.
//
// A group is used again only if it is empty, not frozen (a checkpoint that
// copies the upper freezes the command group, copyUpper; a thaw that failed
// would leave it so), and has no sub-group but its idle exec groups (a
// session's group, a CRIU tree's, a background command's all make it
// removed instead), and the restore that takes it forgets it among the
// killed groups it waits for.

// cmdGroups are the sandbox's command groups: the group every command,
// session and background process runs in (work), the groups killAll ended
// whose processes may still be exiting (killed), and the groups made ahead
// or kept to serve again. mu guards them; work changes only under op
// (write), so that under op (read) the group read stays the group.
type cmdGroups struct {
	mu sync.Mutex
	// work holds every command, session and background process.
	// +checklocks:mu
	work *cgroup.Cgroup
	// wf holds control files of work kept open.
	// +checklocks:mu
	wf workFiles
	// idle holds empty exec groups of work, for reuse.
	// +checklocks:mu
	idle []*execGroup
	// kept holds exec groups kept for the processes their commands left
	// running (keepExecGroup), and keptLeft how many the last sweep left.
	// +checklocks:mu
	kept []*execGroup
	// +checklocks:mu
	keptLeft int
	// spareW is the next command group, made ahead.
	// +checklocks:mu
	spareW chan workGroup
	// reuseW holds a killed command group, empty, to serve again
	// (retireWork).
	reuseW chan workGroup
	// boost raises the sandbox's CPU weight during a checkpoint or restore
	// with processes (boostCPU); nil without a cpu controller. Opened on
	// first use.
	// +checklocks:mu
	boost *cgroup.CPUBoost
	// +checklocks:mu
	boostTried bool
	// killed holds the command groups killAll ended whose processes may
	// still be exiting (at most maxKilled).
	// +checklocks:mu
	killed []*cgroup.Cgroup
	// killedSettled: the processes of killed are past harming the copies a
	// restore lets run (settleKilled), though not gone.
	// +checklocks:mu
	killedSettled bool
	// disarmed holds the keys ("socket:[inode]") of the listening sockets
	// the last restore shut down before it killed their processes
	// (disarmListeners).
	// +checklocks:mu
	disarmed map[string]bool
	// killPending: killed may still hold processes; the next command waits
	// for them (beginExec), unless a wait found them gone (waitKilled).
	killPending atomic.Bool
	// foldPending: killed groups were found empty while the huge-page
	// worker was folding a process of the sandbox; the next command waits
	// for it to let go (beginExec, foldReleased).
	foldPending atomic.Bool
	// stragglers: killed processes were given up on (no longer in killed)
	// before they were seen gone; one could still write, and keepRoot no
	// longer keeps a root.
	stragglers atomic.Bool
}

// killAll ends every process of the sandbox but the init, sessions included.
// The command group is killed without waiting and replaced by another
// (takeWorkGroup): its processes die in the background while the caller
// goes on (they can run no code of their own; what a dying process's last
// system call writes lands in the upper being discarded). A background job
// offers the old group for use again once it is empty, or removes it
// (retireWork).
func (s *Sandbox) killAll() error { return s.killFor(nil) }

// killFor is killAll for a restore of c (nil for none), which first
// disarms the listeners the copies of c are to listen anew on.
func (s *Sandbox) killFor(c *procstate.Checkpoint) error {
	s.mu.Lock()
	sessions := s.sessions
	s.sessions = map[string]*session{}
	s.mu.Unlock()
	for _, se := range sessions {
		se.closePipes() // their shells die with the group
	}
	if len(sessions) == 0 {
		// Nothing to end: keep the group and its idle command groups (a
		// rollback loop without processes should not pay for cgroups).
		if live, err := s.hasProcesses(); err == nil && !live {
			return nil
		}
	}
	s.cmds.mu.Lock()
	defer s.cmds.mu.Unlock()
	s.cmds.disarmed = nil
	if c != nil {
		s.disarmListeners(c)
	}
	return s.replaceWork()
}

// replaceWork kills the command group without waiting and makes another
// (takeWorkGroup) the command group; the killed one joins killed and is
// retired in the background (retireWork).
// +checklocks:s.cmds.mu
func (s *Sandbox) replaceWork() error {
	// The group is retired with its idle exec groups and kept files.
	old := workGroup{cg: s.cmds.work, wf: *s.workFilesNow(), idle: s.cmds.idle}
	s.cmds.idle = nil
	s.cmds.wf = workFiles{}
	var err error
	if k := old.wf.kill; k != nil {
		err = k.Write("1")
	} else {
		err = old.cg.SignalKill()
	}
	if err != nil {
		old.close()
		return fmt.Errorf("ending the sandbox's processes: %w", err)
	}
	s.procs.ForgetLive()
	w := s.takeWorkGroup()
	if w.err != nil {
		old.close()
		return fmt.Errorf("creating cgroup: %w", w.err)
	}
	s.cmds.work, s.cmds.wf, s.cmds.idle = w.cg, w.wf, w.idle
	if !s.cmds.killPending.Load() {
		s.cmds.killed = s.cmds.killed[:0] // waited for since (beginExec)
	}
	if len(s.cmds.killed) >= maxKilled {
		// Restores in a row whose killed processes outlive them: the
		// oldest must be gone by now, or nearly.
		s.waitKilledLocked()
		if len(s.cmds.killed) >= maxKilled {
			s.cmds.killed = s.cmds.killed[1:]
			s.cmds.stragglers.Store(true) // no longer waited for (keepRoot)
		}
	}
	s.cmds.killed = append(s.cmds.killed, old.cg)
	s.cmds.killedSettled = false
	s.cmds.killPending.Store(true)
	s.bg.Add(1)
	go s.retireWork(old)
	return nil
}

// workGroup is a command group on its way in or out: made ahead, retired,
// or retired and ready to serve again.
type workGroup struct {
	cg  *cgroup.Cgroup
	err error
	wf  workFiles // its kept files (wf.of is cg)
	// idle are its empty exec groups, their files open, which serve it
	// again with it.
	idle []*execGroup
}

// close closes the group's files.
func (g workGroup) close() {
	g.wf.close()
	closeExecGroups(g.idle)
}

// recycleWait bounds how long retireWork waits for a killed group's processes
// to be gone before it removes the group instead.
const recycleWait = 2 * time.Second

// retireWork offers killed command group g for use again once its processes
// are gone, or else removes it. It runs in the background (s.bg).
func (s *Sandbox) retireWork(g workGroup) {
	defer s.bg.Done()
	if s.reusable(g) {
		// A group made at once (the first, or when the one made ahead
		// failed) has no kept control files yet: opened here, off the
		// restore's path.
		g.wf.openControls()
		s.cmds.mu.Lock()
		if s.cold.Load() {
			g.closeFiles() // a cold sandbox keeps none (hot.go)
		}
		select {
		case s.cmds.reuseW <- g:
			s.cmds.mu.Unlock()
			return
		default: // one is waiting already
		}
		s.cmds.mu.Unlock()
	}
	g.close()
	if err := g.cg.Delete(); err != nil && !errors.Is(err, cgroup.ErrNotExist) {
		s.rt.log.Warn("removing a killed command group", "sandbox", s.id, "err", err)
	}
}

// reusable reports whether killed command group g, once empty, can serve
// again: it is not frozen, and its only sub-groups are its idle exec
// groups.
func (s *Sandbox) reusable(g workGroup) bool {
	if g.cg.WaitEmpty(recycleWait) != nil {
		return false
	}
	if frozen, err := g.cg.SelfFrozen(); err != nil || frozen {
		return false
	}
	subs, err := g.cg.SubGroups()
	if err != nil || len(subs) != len(g.idle) {
		return false
	}
	for _, eg := range g.idle {
		if !slices.Contains(subs, eg.cg.Name()) {
			return false
		}
	}
	return true
}

// takeWorkGroup returns a command group for the live processes: a killed
// one whose processes are gone, if retireWork offers one, else a new one made
// ahead in the background with its cgroup.procs and cgroup.kill opened (or
// made now, without them, if there is none), and then it starts making the
// next: a mkdir in the tracking hierarchy, with its CPU and its wait, and
// two opens of control files (see cgroup.Control for what an open costs),
// that a restore with processes would pay otherwise. (Made at the end of a
// restore instead, the next restore back to back would wait for it.) Called
// with op held.
// +checklocks:s.cmds.mu
func (s *Sandbox) takeWorkGroup() workGroup {
	select {
	case g := <-s.cmds.reuseW:
		// Its processes are gone: none to wait for.
		s.cmds.killed = slices.DeleteFunc(s.cmds.killed, func(k *cgroup.Cgroup) bool { return k == g.cg })
		return g
	default:
	}
	var g workGroup
	if ch := s.cmds.spareW; ch != nil {
		g = <-ch
	}
	if g.cg == nil {
		if g.cg, g.err = s.cg.Sub(s.groupName("w")); g.err != nil {
			s.cmds.spareW = nil
			return g
		}
		g.wf.of = g.cg
	}
	next := make(chan workGroup, 1)
	s.cmds.spareW = next
	s.bg.Add(1) // Destroy waits for it before it removes the sandbox's group
	go func() {
		defer s.bg.Done()
		g, err := s.cg.Sub(s.groupName("w"))
		w := workGroup{cg: g, err: err, wf: workFiles{of: g}}
		if err == nil {
			w.wf.openControls()
		}
		next <- w
	}()
	return g
}

// dropSpareWork closes the files of the command groups made ahead or
// retired for use again, which Destroy removes with the sandbox's group.
// Called with op held, after s.bg.Wait.
func (s *Sandbox) dropSpareWork() {
	s.cmds.mu.Lock()
	defer s.cmds.mu.Unlock()
	if ch := s.cmds.spareW; ch != nil {
		(<-ch).close()
		s.cmds.spareW = nil
	}
	select {
	case g := <-s.cmds.reuseW:
		g.close()
	default:
	}
}

// workFiles are control files of the command group of, kept open while it is
// the command group, so that reading them again opens nothing: its
// cgroup.events (hasProcesses, at every restore; nil on cgroup v1) and its
// process list (checkpoints with processes).
type workFiles struct {
	of      *cgroup.Cgroup
	evTried bool
	ev      *cgroup.Events
	pids    *cgroup.PidList
	// procs and kill are its cgroup.procs (copies of templates are moved
	// in) and cgroup.kill (the next restore), opened ahead with the group
	// (takeWorkGroup) or when it is retired to serve again (retireWork);
	// nil for a group made at once until then, or on cgroup v1.
	procs, kill *cgroup.Control
}

// closeControls closes the controls that are open.
func closeControls(ks ...*cgroup.Control) {
	for _, k := range ks {
		if k != nil {
			k.Close()
		}
	}
}

// workFilesNow returns the kept files of the current command group. Called
// with op held.
// +checklocks:s.cmds.mu
func (s *Sandbox) workFilesNow() *workFiles {
	if s.cmds.wf.of != s.cmds.work {
		s.closeWorkFiles()
		s.cmds.wf.of = s.cmds.work
	}
	return &s.cmds.wf
}

// closeWorkFiles closes the kept files of the command group. Called with op
// held.
// +checklocks:s.cmds.mu
func (s *Sandbox) closeWorkFiles() {
	s.cmds.wf.close()
	s.cmds.wf = workFiles{}
}

// openControls opens the group's cgroup.procs and cgroup.kill where they
// are not open yet; they stay nil on cgroup v1, or if they cannot be opened
// (the group's methods serve then).
func (w *workFiles) openControls() {
	if w.procs == nil {
		w.procs, _ = w.of.OpenControl("cgroup.procs")
	}
	if w.kill == nil {
		w.kill, _ = w.of.OpenControl("cgroup.kill")
	}
}

// hasProcesses reports whether anything but the init runs in the sandbox.
func (s *Sandbox) hasProcesses() (bool, error) {
	s.cmds.mu.Lock()
	defer s.cmds.mu.Unlock()
	w := s.workFilesNow()
	if !w.evTried {
		// nil on cgroup v1, or if it cannot be opened: read the group's
		// files each time then.
		w.ev, _ = s.cmds.work.OpenEvents()
		w.evTried = true
	}
	if w.ev == nil {
		return s.cmds.work.Populated()
	}
	return w.ev.Populated()
}

// workPidsNow lists the processes of the command group. Called with op
// held.
func (s *Sandbox) workPidsNow() ([]int, error) {
	s.cmds.mu.Lock()
	defer s.cmds.mu.Unlock()
	return s.workPidsLocked()
}

// workPidsLocked is workPidsNow with s.cmds.mu held.
// +checklocks:s.cmds.mu
func (s *Sandbox) workPidsLocked() ([]int, error) {
	w := s.workFilesNow()
	if w.pids == nil {
		l, err := s.cmds.work.OpenPids()
		if err != nil {
			return nil, err
		}
		w.pids = l
	}
	return w.pids.Pids()
}

// boostCPU raises the sandbox's CPU weight (cgroup.CPUBoost) and returns
// what sets it back. A restore or checkpoint with processes holds it: what
// it waits for runs in the sandbox's group (the killed processes' exit, the
// ptrace stops, the clones and fix-ups made in the processes' own context,
// CRIU's parasite and restorer), and on CPUs busy with other sandboxes each
// of those steps would otherwise queue behind all of them. The agent's own
// processes are dying or stopped for most of it; those it brings back run
// raised from their start until it returns (a CRIU tree restored before
// another, copies once detached). Called with op held.
func (s *Sandbox) boostCPU() (unboost func()) {
	s.cmds.mu.Lock()
	defer s.cmds.mu.Unlock()
	if !s.cmds.boostTried {
		s.cmds.boostTried = true
		b, err := s.cg.OpenCPUBoost()
		if err != nil {
			s.rt.log.Warn("opening the sandbox's CPU weight; checkpoints and restores run at its normal weight", "sandbox", s.id, "err", err)
		}
		s.cmds.boost = b
	}
	b := s.cmds.boost
	if b == nil {
		return func() {}
	}
	if err := b.Set(true); err != nil {
		s.rt.log.Warn("raising the sandbox's CPU weight", "sandbox", s.id, "err", err)
		return func() {}
	}
	if s.rt.hooks.onBoost != nil {
		s.rt.hooks.onBoost()
	}
	return func() {
		if err := b.Set(false); err != nil {
			s.rt.log.Warn("setting the sandbox's CPU weight back", "sandbox", s.id, "err", err)
		}
	}
}

// maxKilled bounds the killed command groups a sandbox remembers (killed).
const maxKilled = 8

// waitKilled waits, for up to 2 s, until the processes of the command
// groups killAll ended have exited. Once they have, later calls return at
// once: a restore with processes waits, and its next command then opens
// the groups' cgroup.events no more (see cgroup.Events for what an open
// costs). Called with op held.
func (s *Sandbox) waitKilled() {
	s.cmds.mu.Lock()
	defer s.cmds.mu.Unlock()
	s.waitKilledLocked()
}

// waitKilledLocked is waitKilled for a caller holding cmds.mu.
// +checklocks:s.cmds.mu
func (s *Sandbox) waitKilledLocked() {
	if !s.cmds.killPending.Load() {
		return
	}
	if waitKilledGroups(s.cmds.killed, 2*time.Second) {
		s.foldReleased(2 * time.Second)
		s.cmds.killed = nil
		s.cmds.killPending.Store(false)
	}
}

// forgetKilled forgets the killed groups, found empty. If the huge-page
// worker is folding a process of the sandbox, the next command waits for it
// to let go (beginExec, foldReleased); the restore does not.
// +checklocks:s.cmds.mu
func (s *Sandbox) forgetKilled() {
	if s.rt.folds.Folding(s.id) != nil {
		s.cmds.foldPending.Store(true)
	}
	s.cmds.killed = nil
	s.cmds.killPending.Store(false)
}

// foldReleased waits, for up to timeout, until the huge-page worker has let
// go of the process of the sandbox it is folding, if any: a killed process
// whose address space it holds has left its cgroup, but its memory counts in
// the sandbox's until the worker frees it (procstate.Folder.Folding). Called
// once the killed groups are empty.
func (s *Sandbox) foldReleased(timeout time.Duration) {
	done := s.rt.folds.Folding(s.id)
	if done == nil {
		return
	}
	t := time.NewTimer(timeout)
	defer t.Stop()
	select {
	case <-done:
	case <-t.C:
	}
}

// killedGroups returns the killed groups. Under op (read) they may be
// forgotten, not added to.
func (s *Sandbox) killedGroups() []*cgroup.Cgroup {
	s.cmds.mu.Lock()
	defer s.cmds.mu.Unlock()
	return s.cmds.killed
}

// waitKilledGroups waits, for up to timeout, until the processes of the
// killed groups have exited, and reports whether they have. It changes
// nothing: beginExec calls it holding op shared.
func waitKilledGroups(killed []*cgroup.Cgroup, timeout time.Duration) bool {
	deadline := time.Now().Add(timeout)
	for _, g := range killed {
		if g.WaitEmpty(max(time.Until(deadline), 0)) != nil {
			// Removed while it was watched (the background Delete, once
			// it was empty), its cgroup.events reads fail.
			if pop, err := g.Populated(); err != nil || pop {
				return false
			}
		}
	}
	return true
}

// settleKilled returns once the processes killAll ended can no longer get
// in the way of the copies of c's templates a restore is about to fork or
// let run, which need not be once they are gone. A killed process frees its
// memory first as it exits, which for hundreds of megabytes of its own
// lasts far longer than a restore: waiting for that would make a restore
// after an agent's process grew as slow (such restores are what
// BenchmarkRollbackAfterAllocWithProcess measures).
//
// What matters to the copies:
//   - A killed thread still inside a system call could complete it: one in
//     accept(2) on a socket the copies share (through their template)
//     takes a connection meant for them, then resets it as it dies. Once
//     in the kernel's exit path (PF_EXITING in /proc/<tid>/stat) it makes
//     no system call again.
//   - A dying process keeps its files open until its memory is freed
//     (exit_files comes after exit_mm). A socket of its own, one no
//     template holds, can still take connections without it (a listener
//     in an SO_REUSEPORT group with the copies', say, resets them at the
//     close) and keeps its port or name from the copies.
//   - The dying count in the sandbox's pids limit until gone, and in its
//     memory limit until their address spaces are freed: by their exit,
//     or later, by whatever held one and let go of it last (the huge-page
//     worker, which the next command waits for; a reader of its /proc).
//
// So it returns at once when they are gone (waiting up to killedGrace for
// that: the common case); if they freed killedFreeing meanwhile (their exit
// is long for the memory it frees), as soon as every thread of theirs is
// exiting if they hold no socket of their own and the sandbox keeps a
// quarter of its memory and pids limits free beside them and the copies;
// and else when they are gone (waitKilled). The next command still waits
// for them to be gone (beginExec). Copies that write memory faster than the
// dying free theirs could still meet the memory limit; a quarter of it free
// makes that unlikely. Called with op held.
func (s *Sandbox) settleKilled(tpls []procstate.Template) {
	s.cmds.mu.Lock()
	defer s.cmds.mu.Unlock()
	if !s.cmds.killPending.Load() || s.cmds.killedSettled {
		return
	}
	// Killed processes with little memory of their own are gone within a
	// fraction of a millisecond (a few under load, the sandbox's CPU weight
	// raised), sooner than their threads can be listed and looked at.
	before, memErr := s.cg.MemoryCurrent()
	grace := killedGrace
	if g := s.rt.hooks.killedGrace; g > 0 {
		grace = g
	}
	if waitKilledGroups(s.cmds.killed, grace) {
		s.forgetKilled()
		s.settled("gone")
		return
	}
	// Still there. Going on without them pays only while they free memory
	// (killedFreeing in the grace): a killed process that is slow to go
	// because it waits for a CPU gets one sooner while its CPU weight is
	// raised with the restore's than once the restore has returned, when the
	// next command and the group's removal would poll for it meanwhile.
	if after, err := s.cg.MemoryCurrent(); memErr != nil || err != nil || before-after < killedFreeing {
		s.waitKilledLocked()
		s.settled("slow")
		return
	}
	deadline := time.Now().Add(2 * time.Second)
	for pause, first := 50*time.Microsecond, true; ; pause, first = min(2*pause, time.Millisecond), false {
		gone, tids := s.killedState()
		switch {
		case gone:
			s.forgetKilled()
			s.settled("gone")
			return
		// The room is judged once, while the killed still hold most of
		// what they had: as they exit it grows.
		case first && !s.limitsRoom(len(tpls)):
			s.waitKilledLocked()
			s.settled("waited")
			return
		case tids != nil && s.ownSockets(tids, tpls):
			s.waitKilledLocked()
			s.settled("sockets")
			return
		case tids != nil:
			s.cmds.killedSettled = true
			s.settled("exiting")
			return
		case time.Now().After(deadline):
			s.settled("timeout") // as waitKilled: the next command waits again
			return
		}
		nap(pause)
	}
}

// killedFreeing is how much memory the killed processes must free during
// killedGrace for settleKilled to go on without them.
const killedFreeing = 8 << 20

// killedGrace is how long settleKilled waits for the killed processes to be
// gone before it looks at how fast they free memory. Under `make
// loadtest-process` (64 sandboxes, both CPUs busy) a shorter grace costs
// the server more CPU per iteration and fewer rollbacks a second: a killed
// copy not yet exiting finishes its exit at the normal CPU weight, after
// the restore, while the next command and the group's removal each poll
// its cgroup.events. See docs/ARCHITECTURE.md ("Settling the killed", and
// "Known limits").
const killedGrace = 2 * time.Millisecond

// settled tells the test hook (onSettle) how settleKilled returned.
func (s *Sandbox) settled(how string) {
	if s.rt.hooks.onSettle != nil {
		s.rt.hooks.onSettle(how)
	}
}

// killedState reports whether the processes of the killed groups are all
// gone, and else lists their threads if every one is exiting (nil if one
// is not yet, or they could not be listed).
// +checklocks:s.cmds.mu
func (s *Sandbox) killedState() (gone bool, exiting []int) {
	gone, exiting = true, []int{}
	for _, g := range s.cmds.killed {
		// One read of cgroup.events tells an empty group, where listing
		// its threads costs several.
		if pop, err := g.Populated(); err != nil || !pop {
			if err != nil {
				return false, nil
			}
			continue
		}
		tids, err := g.Threads()
		if errors.Is(err, cgroup.ErrNotExist) {
			continue // emptied and removed meanwhile
		}
		if err != nil {
			return false, nil
		}
		gone = gone && len(tids) == 0
		for _, tid := range tids {
			if !threadExiting(tid) {
				return false, nil
			}
		}
		exiting = append(exiting, tids...)
	}
	return gone, exiting
}

// limitsRoom reports whether the sandbox keeps at least a quarter of its
// memory and pids limits (each it has) free, with n more tasks for the
// copies.
func (s *Sandbox) limitsRoom(n int) bool {
	if lim := s.spec.Limits.MemoryBytes; lim > 0 {
		cur, err := s.cg.MemoryCurrent()
		if s.rt.hooks.onRoom != nil && err == nil {
			s.rt.hooks.onRoom(lim, cur)
		}
		if err != nil || lim-cur < lim/4 {
			return false
		}
	}
	return procstate.PidRoom(s.spec.Limits.Pids, s.cg, n)
}

// ownSockets reports whether one of threads tids holds a socket that no
// template of tpls holds (or its files cannot be read), other than the
// listening sockets the restore shut down before it killed them
// (disarmListeners).
// +checklocks:s.cmds.mu
func (s *Sandbox) ownSockets(tids []int, tpls []procstate.Template) bool {
	var shared map[string]bool
	for _, tid := range tids {
		own, err := socketFDs(tid)
		if err != nil {
			return true
		}
		for _, sk := range own {
			if shared == nil {
				shared = map[string]bool{}
				for _, t := range tpls {
					ls, err := socketFDs(t.HostPid)
					if err != nil {
						return true
					}
					for _, l := range ls {
						shared[l.key] = true
					}
				}
			}
			if !shared[sk.key] && !s.cmds.disarmed[sk.key] {
				return true
			}
		}
	}
	return false
}

// disarmListeners shuts down, from the server, the listening TCP sockets
// of the sandbox's processes that no template holds, before a restore
// kills the processes, and remembers them (ownSockets): a copy of c that
// listens on one's address (procstate's listenTCP) can then bind it at
// once, where the socket would otherwise keep it until its process has
// exited, which for a large process takes milliseconds
// (procstate.DisarmListener). Done only for a checkpoint whose copies
// listen on TCP ports anew; it costs a look at each process's descriptors.
// A process killed right after loses nothing it would not have lost.
// +checklocks:s.cmds.mu
func (s *Sandbox) disarmListeners(c *procstate.Checkpoint) {
	if !c.ListensOnTCP() {
		return
	}
	pids, err := s.workPidsLocked()
	if err != nil {
		return
	}
	seen := map[string]bool{}
	for _, pid := range pids {
		own, err := socketFDs(pid)
		if err != nil {
			continue
		}
		for _, sk := range own {
			if seen[sk.key] || s.procs.TemplatesListen(sk.key) {
				continue
			}
			seen[sk.key] = true
			if procstate.DisarmListener(pid, sk.fd, sk.key) {
				if s.cmds.disarmed == nil {
					s.cmds.disarmed = map[string]bool{}
				}
				s.cmds.disarmed[sk.key] = true
			}
		}
	}
}

// socketFD is an fd of a socket, and the socket's key ("socket:[inode]").
type socketFD struct {
	fd  int
	key string
}

// socketFDs lists the sockets thread tid holds open; none for a thread
// gone.
func socketFDs(tid int) ([]socketFD, error) {
	dir := "/proc/" + strconv.Itoa(tid) + "/fd/"
	ents, err := os.ReadDir(dir)
	if errors.Is(err, os.ErrNotExist) || errors.Is(err, unix.ESRCH) {
		return nil, nil
	}
	if err != nil {
		return nil, err
	}
	var out []socketFD
	for _, e := range ents {
		fd, err := strconv.Atoi(e.Name())
		if err != nil {
			continue
		}
		if l, err := os.Readlink(dir + e.Name()); err == nil && strings.HasPrefix(l, "socket:") {
			out = append(out, socketFD{fd: fd, key: l})
		}
	}
	return out, nil
}

// pfExiting is the kernel's PF_EXITING task flag: the task is in do_exit.
const pfExiting = 0x4

// threadExiting reports whether thread tid is in the kernel's exit path,
// a zombie, or gone.
func threadExiting(tid int) bool {
	b, err := os.ReadFile("/proc/" + strconv.Itoa(tid) + "/stat")
	if err != nil {
		return errors.Is(err, os.ErrNotExist) || errors.Is(err, unix.ESRCH)
	}
	// pid (comm) state ppid pgrp session tty_nr tpgid flags ...; comm may
	// hold spaces and parentheses.
	i := bytes.LastIndexByte(b, ')')
	if i < 0 {
		return false
	}
	f := bytes.Fields(b[i+1:])
	if len(f) < 7 {
		return false
	}
	if f[0][0] == 'Z' || f[0][0] == 'X' {
		return true
	}
	flags, err := strconv.ParseUint(string(f[6]), 10, 64)
	return err == nil && flags&pfExiting != 0
}

// nap sleeps for d on the calling thread: an idle Go runtime's time.Sleep
// lasts at least a millisecond.
func nap(d time.Duration) {
	ts := unix.NsecToTimespec(int64(d))
	for unix.Nanosleep(&ts, &ts) == unix.EINTR {
	}
}

// killedQuiet waits until the processes of the killed groups are gone (it
// then forgets the groups) or all exiting, and reports whether they got
// there by deadline: once they are, none can write a file again.
func (s *Sandbox) killedQuiet(deadline time.Time) bool {
	s.cmds.mu.Lock()
	defer s.cmds.mu.Unlock()
	for pause := 20 * time.Microsecond; s.cmds.killPending.Load(); pause = min(2*pause, 200*time.Microsecond) {
		gone, tids := s.killedState()
		if gone {
			s.forgetKilled()
			s.settled("gone")
			return true
		}
		if tids != nil {
			return true // all exiting; settleKilled decides when the copies run
		}
		if time.Now().After(deadline) {
			return false
		}
		nap(pause)
	}
	return true
}

// workGroup returns the command group. Under op (read or write) it stays
// the command group.
func (s *Sandbox) workGroup() *cgroup.Cgroup {
	s.cmds.mu.Lock()
	defer s.cmds.mu.Unlock()
	return s.cmds.work
}
