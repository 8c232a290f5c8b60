package procstate

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"os"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"time"

	"golang.org/x/sys/unix"

	"github.com/deltagym/deltagym/sandbox/cgroup"
	"github.com/deltagym/deltagym/sandbox/ptfork"
)

// Groups returns the sandbox's template groups.
func (ps *State) Groups() []*cgroup.Cgroup {
	ps.mu.Lock()
	defer ps.mu.Unlock()
	out := make([]*cgroup.Cgroup, 0, len(ps.tpls))
	for _, tg := range ps.tpls {
		out = append(out, tg)
	}
	return out
}

// Capture captures the sandbox's live processes — templates for
// what the fast path can copy, CRIU images for the other trees (or for all
// of them with allCRIU) — and calls copyFS while every one of them is
// stopped, so that the files and the processes are captured at the same
// instant. Called with the sandbox's state changes serialised, its
// pending root (if any) swapped in.
//
// Processes are stopped by ptrace, not by the freezer: each, every thread
// of it, is seized and interrupted, and the command group is listed again until
// no new process appears (a stopped process cannot fork). Trees for CRIU
// are released from ptrace and dumped by criu, which leaves them stopped.
func (ps *State) Capture(ctx context.Context, c *Checkpoint, allCRIU bool, copyFS func() error) (err error) {
	rootMnt, err := mntID("/proc/" + strconv.Itoa(ps.h.InitPid()) + "/root")
	if err != nil {
		return err
	}
	tr := ptfork.NewSession()
	defer func() {
		// The originals go on (if templates were made, they are detached
		// by now, into their frozen group).
		if cerr := tr.Close(); cerr != nil {
			err = errors.Join(err, cerr)
		}
	}()
	stop, err := ps.stopAll(tr)
	if err != nil {
		return err
	}
	procs, err := ps.inspectAll(stop, rootMnt)
	if err != nil {
		return err
	}
	shareListeners(procs, ps.TemplatesListen)
	tplProcs, trees, err := ps.planCapture(splitTrees(procs), allCRIU)
	if err != nil {
		return err
	}
	// Templates of trees too, made while they are stopped here: criu
	// releases them running.
	var tts []*treeTemplate
	if !allCRIU {
		tts = ps.makeTreeTemplates(trees, stop.seized)
	}
	defer func() {
		if err != nil {
			_ = endTrees(tts)
		}
	}()
	if len(trees) > 0 {
		resume, err := ps.dumpTrees(ctx, c, trees, stop)
		defer func() { err = resume(err) }()
		if err != nil {
			return err
		}
	}
	if err := copyFS(); err != nil {
		return err
	}
	if len(tplProcs) > 0 {
		if err := ps.makeTemplates(c, tplProcs, stop.seized); err != nil {
			return err
		}
	}
	ps.keepTrees(c.ID, tts)
	return nil
}

// stopSet is what stopAll stopped: the processes of the command group in
// the order they were found.
type stopSet struct {
	seized   map[int]*ptfork.Proc // in ptrace-stop
	threaded map[int]string       // cannot be seized (why): they go on until criu stops them
	order    []int
}

// stopWait bounds how long stopAll waits for the command group to stop:
// a process seized just as it called vfork stops only once its child has
// called exec.
const stopWait = 10 * time.Second

// stopAll seizes and stops every process of the command group, each of
// its threads, listing the group again until no new process appears: once
// it returns, nothing in the group can fork but the processes whose
// threads it could not take (ptfork.ErrThreads), which criu stops. A process that exits meanwhile is left out.
//
// A child of vfork that has not called exec yet is left to run until it
// does, and so is its parent, which waits for it in the kernel where no
// ptrace stop reaches it: stopping the child would hold both forever.
func (ps *State) stopAll(tr *ptfork.Session) (stopSet, error) {
	stop := stopSet{seized: map[int]*ptfork.Proc{}, threaded: map[int]string{}}
	limit := stopWait
	if ps.cfg.StopWait != nil {
		limit = cmp.Or(ps.cfg.StopWait(), stopWait)
	}
	deadline := time.Now().Add(limit)
	pause := 20 * time.Microsecond
	for round := 0; ; {
		pids, err := ps.h.WorkPids()
		if err != nil {
			return stop, err
		}
		held, why, err := stop.vforkHeld(pids)
		if err != nil {
			return stop, err
		}
		fresh, more, err := stop.seizeNew(tr, pids, held)
		if err != nil {
			return stop, err
		}
		if len(fresh) == 0 && !more {
			if len(held) == 0 {
				return stop, nil
			}
			if time.Now().After(deadline) {
				return stop, fmt.Errorf("%w: %s for %v; checkpoint files only (process mode filesystem), or let it call exec", ErrProcesses, why, limit)
			}
			time.Sleep(pause) // the child runs to its exec; nothing tells when
			pause = min(2*pause, 5*time.Millisecond)
			continue
		}
		if round++; round > 10 {
			return stop, fmt.Errorf("%w: processes keep starting (a fork loop?); checkpoint files only (process mode filesystem)", ErrProcesses)
		}
		for _, p := range fresh {
			if err := p.WaitFor(time.Until(deadline)); err != nil {
				if errors.Is(err, ptfork.ErrGone) {
					delete(stop.seized, p.Pid)
					continue // it exited
				}
				return stop, fmt.Errorf("%w: stopping the sandbox's processes: %s: %w; checkpoint files only (process mode filesystem)", ErrProcesses, sandboxName(p.Pid), scrubPids{err})
			}
			stop.order = append(stop.order, p.Pid)
		}
	}
}

// vforkHeld names the processes of pids that share their memory with their
// parent (a vfork child before its exec) and the parents of those: stopAll
// leaves both to run. why describes one such pair. A process already
// stopped is not looked at: it was not such a child when it was seized,
// and a stopped process does not vfork.
func (stop *stopSet) vforkHeld(pids []int) (held map[int]bool, why string, err error) {
	for _, pid := range pids {
		if _, ok := stop.threaded[pid]; ok || stop.seized[pid] != nil {
			continue
		}
		ppid, shared, err := ptfork.SharesParentMemory(pid)
		if errors.Is(err, ptfork.ErrGone) {
			continue
		}
		if err != nil {
			return nil, "", fmt.Errorf("%w: %w", ErrProcesses, err)
		}
		if !shared {
			continue
		}
		if held == nil {
			held = map[int]bool{}
		}
		held[pid], held[ppid] = true, true
		why = fmt.Sprintf("pid %d shares its memory with its parent %d (a vfork child that has not called exec, or a clone(CLONE_VM) child)", pid, ppid)
	}
	return held, why, nil
}

// seizeNew seizes the processes of pids not seen before, but those held.
// It returns those seized (not yet stopped) and whether it found a new
// threaded process.
func (stop *stopSet) seizeNew(tr *ptfork.Session, pids []int, held map[int]bool) (fresh []*ptfork.Proc, more bool, err error) {
	for _, pid := range pids {
		if _, ok := stop.threaded[pid]; ok || stop.seized[pid] != nil || held[pid] {
			continue
		}
		p, err := tr.Seize(pid)
		if errors.Is(err, ptfork.ErrGone) {
			continue
		}
		if errors.Is(err, ptfork.ErrThreads) {
			stop.threaded[pid], more = threadsReason(pid), true
			stop.order = append(stop.order, pid)
			continue
		}
		if err != nil {
			return nil, false, fmt.Errorf("%w: %s cannot be stopped to be copied (%w); checkpoint files only (process mode filesystem)", ErrProcesses, sandboxName(pid), scrubPids{err})
		}
		stop.seized[pid] = p
		fresh = append(fresh, p)
	}
	return fresh, more, nil
}

// sandboxName names host process pid as the sandbox sees it: "pid N
// (comm)", or "a process" once it is gone.
func sandboxName(pid int) string {
	b, err := os.ReadFile("/proc/" + strconv.Itoa(pid) + "/status")
	if err != nil {
		return "a process"
	}
	t := Template{Comm: "?"}
	readStatus(string(b), &t)
	if k, v, ok := strings.Cut(strings.SplitN(string(b), "\n", 2)[0], ":"); ok && k == "Name" {
		t.Comm = strings.TrimSpace(v)
	}
	return t.name()
}

// threadsReason says why the threads of process pid, refused by Seize
// (ptfork.ErrThreads), cannot be copied, in the sandbox's terms.
func threadsReason(pid int) string {
	n := 0
	if ents, err := os.ReadDir("/proc/" + strconv.Itoa(pid) + "/task"); err == nil {
		n = len(ents)
	}
	if n > ptfork.MaxThreads {
		return fmt.Sprintf("it has %d threads (template copies take at most %d)", n, ptfork.MaxThreads)
	}
	return "its main thread has exited while its other threads run"
}

// inspectAll inspects the stopped processes, in order, naming the session
// whose shell each is. A threaded process that ended meanwhile is left
// out; any other failure fails the capture.
func (ps *State) inspectAll(stop stopSet, rootMnt uint64) ([]procInfo, error) {
	sessionOf := ps.h.SessionShells()
	procs := make([]procInfo, 0, len(stop.order))
	for _, pid := range stop.order {
		pi, err := inspect(pid, rootMnt)
		why, threaded := stop.threaded[pid]
		if err != nil {
			if threaded {
				continue // it ended meanwhile
			}
			return nil, fmt.Errorf("inspecting pid %d: %w", pid, err)
		}
		if threaded && pi.reason == "" {
			pi.reason = why
		}
		if sh, ok := sessionOf[pid]; ok {
			pi.tpl.Session, pi.tpl.Attached, pi.tpl.sessionPipes = sh.Name, sh.Attached, sh.Pipes
			if fd := pipeElsewhere(pid, sh.Pipes); fd >= 0 && pi.reason == "" {
				// A copy gets fresh pipes on fds 0, 1 and 2 only.
				pi.reason = fmt.Sprintf("its shell holds a pipe of session %s on fd %d (an interactive command's redirection runs)", sh.Name, fd)
			}
		}
		procs = append(procs, pi)
	}
	return procs, nil
}

// pipeElsewhere returns an fd above 2 on which process pid holds one of the
// pipes keys, -1 if none.
func pipeElsewhere(pid int, keys [3]string) int {
	if keys[0] == "" {
		return -1
	}
	ents, err := os.ReadDir(fmt.Sprintf("/proc/%d/fd", pid))
	if err != nil {
		return -1
	}
	for _, e := range ents {
		fd, err := strconv.Atoi(e.Name())
		if err != nil || fd <= 2 {
			continue
		}
		if link, err := os.Readlink(fmt.Sprintf("/proc/%d/fd/%d", pid, fd)); err == nil && slices.Contains(keys[:], link) {
			return fd
		}
	}
	return -1
}

// planCapture sorts the process trees into those copied as templates (one
// process each, returned as tplProcs) and those CRIU dumps (trees, each
// with its reason). It refuses what neither path brings back: an open
// deleted file, a session's shell below the root of its tree.
func (ps *State) planCapture(units []procTree, allCRIU bool) (tplProcs []procInfo, trees []procTree, err error) {
	full, err := ps.templatesFull(units, allCRIU)
	if err != nil {
		return nil, nil, err
	}
	for _, u := range units {
		why := u.criuReason(allCRIU)
		if why == "" && full != "" {
			why = full
		}
		if why == "" {
			tplProcs = append(tplProcs, u.procs[0])
			continue
		}
		if err := u.criuCapturable(); err != nil {
			return nil, nil, err
		}
		u.why = why
		trees = append(trees, u)
	}
	return tplProcs, trees, nil
}

// dumpTrees releases trees from ptrace and has criu dump each into c's
// images, which leaves them stopped. It returns resume, which the caller
// calls with its result once the files are copied and the templates made:
// it lets everything criu stopped go on, and on failure removes c's CRIU
// directory. resume is never nil: the caller calls it even if dumpTrees
// fails.
func (ps *State) dumpTrees(ctx context.Context, c *Checkpoint, trees []procTree, stop stopSet) (resume func(error) error, err error) {
	resume = func(err error) error {
		// Everything criu stopped goes on (trees may have grown while
		// not stopped: list the group, not the trees).
		pids, lerr := ps.h.WorkPids()
		err = errors.Join(err, lerr)
		var cont []int
		for _, p := range pids {
			if stop.seized[p] == nil {
				cont = append(cont, p)
			}
		}
		resumeTrees(cont)
		if err != nil {
			_ = os.RemoveAll(ps.cfg.CRIUDir(c.ID))
		}
		return err
	}
	// Until criu is at work, nothing is left stopped but what ptrace
	// holds (which tr.Close releases).
	none := func(err error) error { return err }
	ps.h.Settled() // criu joins the namespace
	mounts, err := mountIDs(ps.h.InitPid())
	if err != nil {
		return none, err
	}
	// Released from ptrace, dumped, left stopped by criu.
	for _, u := range trees {
		for _, p := range u.procs {
			if sp := stop.seized[p.tpl.HostPid]; sp != nil {
				delete(stop.seized, p.tpl.HostPid)
				if err := sp.Detach(); err != nil {
					return none, fmt.Errorf("%w: releasing %s for CRIU: %w", ErrProcesses, p.tpl.name(), err)
				}
			}
		}
	}
	dctx := context.WithoutCancel(ctx) // never leave a tree half-dumped
	for i, u := range trees {
		cu, err := ps.dumpTree(dctx, c, i, u.procs[0].tpl.HostPid, u.procs, u.why, mounts)
		if err != nil {
			return resume, err
		}
		c.Images = append(c.Images, cu)
	}
	return resume, nil
}

// makeTemplates has each stopped process of tplProcs clone itself into a
// template, in a frozen group of c's own, and records them in c. On
// success every template is detached into its frozen group (it never
// runs) before the originals go on; on failure none is left.
func (ps *State) makeTemplates(c *Checkpoint, tplProcs []procInfo, seized map[int]*ptfork.Proc) error {
	tg, err := ps.takeTemplateGroup()
	if err != nil {
		return err
	}
	live := make([]Template, len(tplProcs))
	for i := range tplProcs {
		live[i] = tplProcs[i].tpl
	}
	var made []*ptfork.Proc
	fail := func(err error) error {
		for _, t := range made {
			t.Kill()
		}
		_ = tg.Delete()
		return err
	}
	var waits []Wait
	for i, pi := range tplProcs {
		ps.noteKernelWrites(seized[pi.tpl.HostPid], &tplProcs[i].tpl)
		waits = append(waits, tplProcs[i].tpl.Waits...)
		t, err := forkTemplate(seized[pi.tpl.HostPid], &tplProcs[i].tpl, tg)
		if t != nil {
			made = append(made, t)
		}
		if err != nil {
			return fail(ps.copyError(pi.tpl.name(), err))
		}
	}
	// Into their frozen group before the originals go on.
	for _, t := range made {
		if err := t.Detach(); err != nil {
			return fail(err)
		}
	}
	c.Procs = make([]Template, len(tplProcs))
	for i := range tplProcs {
		c.Procs[i] = tplProcs[i].tpl
	}
	c.TplGroup = tg.Name()
	var held []string
	for _, t := range c.Procs {
		for _, p := range t.Private {
			if p.Kind == "listen" && p.link != "" {
				held = append(held, p.link)
			}
		}
	}
	ps.mu.Lock()
	if len(held) > 0 {
		ps.listenHeld[c.ID] = held
	}
	ps.tpls[c.ID] = tg
	ps.waits = waits
	ps.mu.Unlock()
	ps.foldLive(live)
	return nil
}

// forkTemplate has stopped process p clone itself into a template in group
// tg: a session leader of its own, non-dumpable (guardTemplate), still in
// ptrace-stop. It updates t to describe the template (its pid and start
// time). The template, if one was forked, is returned even on error.
func forkTemplate(p *ptfork.Proc, t *Template, tg *cgroup.Cgroup) (*ptfork.Proc, error) {
	return forkTemplateWith(p, t, tg, forkWhole, nil)
}

// forkTemplateWith is forkTemplate with the fork given, and before, if not
// nil, called with the template before it joins its frozen group.
func forkTemplateWith(p *ptfork.Proc, t *Template, tg *cgroup.Cgroup, fork func(*ptfork.Proc) (*ptfork.Proc, error), before func(*ptfork.Proc) error) (*ptfork.Proc, error) {
	if err := readItimer(p, t); err != nil {
		return nil, err
	}
	cp, err := fork(p)
	if err != nil {
		return nil, err
	}
	t.threads = cp.States()
	reapIfOurs(cp.Pid)
	if t.Leader {
		// Born in the process's session and group, the template would
		// keep their id, the process's pid, taken after the process ends:
		// a CRIU tree that had that pid could not be restored. (Before it
		// joins its frozen group: a frozen task runs no injected call.)
		if _, serr := cp.Syscall(unix.SYS_SETSID); serr != nil {
			return cp, fmt.Errorf("setsid: %w", serr)
		}
	}
	if err := guardTemplate(cp, t); err != nil {
		return cp, err
	}
	if err := freeListeners(cp, *t); err != nil {
		return cp, err
	}
	if before != nil {
		if err := before(cp); err != nil {
			return cp, err
		}
	}
	if err := tg.Add(cp.Pid); err != nil {
		return cp, err
	}
	// Out of the sandbox's OOM killer's choice (cgroup.HoldMemory): a
	// command may raise the template's oom_score_adj.
	if err := tg.HoldMemory(cp.Pid); err != nil {
		return cp, err
	}
	t.HostPid = cp.Pid
	if start, err := StartTime(cp.Pid); err == nil {
		t.Start = start
	}
	return cp, nil
}

// copyTemplate forks a copy of seized, stopped template p of t.
func copyTemplate(p *ptfork.Proc, t Template) (*ptfork.Proc, int, error) {
	p.UseStates(t.threads)
	return p.Fork()
}

// guardTemplate makes a new template non-dumpable, recording the process's
// own flag in t. The template lives in the sandbox's pid namespace with the
// process's credentials: dumpable, it would be open to the sandbox's own
// commands through ptrace, /proc/PID/mem and process_vm_writev, and a write
// into its memory would change every later restore and fork of the
// checkpoint. Non-dumpable, only a holder of CAP_SYS_PTRACE over the
// sandbox's user namespace reaches it: the server, never a command. (Before
// the template joins its frozen group: a frozen task runs no injected call.)
func guardTemplate(p *ptfork.Proc, t *Template) error {
	d, err := p.Syscall(unix.SYS_PRCTL, unix.PR_GET_DUMPABLE)
	if err != nil {
		return fmt.Errorf("reading the dumpable flag: %w", err)
	}
	t.Dumpable = int(d)
	if d == 0 {
		return nil
	}
	if _, err := p.Syscall(unix.SYS_PRCTL, unix.PR_SET_DUMPABLE, 0); err != nil {
		return fmt.Errorf("making the template non-dumpable: %w", err)
	}
	return nil
}

// copyError is the error of a failed copy of process name (a template's,
// or a template's copy): ErrBudget if the pids limit refused it
// (PidsError), else ErrProcesses.
func (ps *State) copyError(name string, err error) error {
	if perr := PidsError(err, ps.h.PidsLimit(), ps.h.Cgroup()); perr != err {
		return fmt.Errorf("copying %s: %w", name, perr)
	}
	return fmt.Errorf("%w: copying %s: %w", ErrProcesses, name, scrubPids{err})
}

// hostPid matches the host pids sandbox/ptfork's errors name.
var hostPid = regexp.MustCompile(`\b(pid|thread|copy|tid) [0-9]+`)

// scrubPids is an error whose message names no host pid (the sandbox's
// pids differ; the host's are not the client's business), unwrapping to
// the error it scrubs.
type scrubPids struct{ err error }

func (e scrubPids) Error() string {
	return hostPid.ReplaceAllString(e.err.Error(), "$1 of the sandbox")
}
func (e scrubPids) Unwrap() error { return e.err }

// templatesFull says why the processes of units that a checkpoint in mode
// would copy as templates go to CRIU instead, if they do: frozen copies
// count against the sandbox's pids limit, and once the pids in use (live
// processes, the init, frozen copies) and the new copies would pass three
// quarters of it, the rest is left to the live processes (a sandbox whose
// checkpoints hold all its pids could not even start a command). CRIU
// images hold no pid. Without CRIU, such a checkpoint fails with ErrBudget.
func (ps *State) templatesFull(units []procTree, allCRIU bool) (string, error) {
	lim := ps.h.PidsLimit()
	n := 0
	for _, u := range units {
		if u.criuReason(allCRIU) == "" {
			n += max(1, u.procs[0].tpl.Threads) // a pid per thread
		}
	}
	if lim <= 0 || n == 0 {
		return "", nil
	}
	cur, err := ps.h.Cgroup().PidsCurrent()
	if err != nil || (cur+int64(n))*4 <= lim*3 {
		return "", nil
	}
	why := fmt.Sprintf("frozen copies would take the sandbox past three quarters of its pids limit (%d in use, %d new, limit %d; live processes and the frozen copies checkpoints keep count): a quarter is kept for the live processes; release checkpoints no longer needed, or end processes, to have processes template-copied again", cur, n, lim)
	if _, err := ps.h.CRIU(); err != nil {
		return "", fmt.Errorf("%w: %s, and CRIU, which would save them holding no pid, is not available (%w)", ErrBudget, why, err)
	}
	return why, nil
}

// takeTemplateGroup returns an empty, frozen cgroup for the templates of
// one checkpoint, made ahead in the background.
func (ps *State) takeTemplateGroup() (*cgroup.Cgroup, error) {
	ps.mu.Lock()
	ch := ps.spareTG
	ps.spareTG = nil
	ps.mu.Unlock()
	var tg *cgroup.Cgroup
	var err error
	if ch != nil {
		r := <-ch
		tg, err = r.cg, r.err
	} else {
		tg, err = ps.newTemplateGroup()
	}
	if err != nil {
		return nil, fmt.Errorf("creating template cgroup: %w", err)
	}
	next := make(chan spareGroup, 1)
	ps.mu.Lock()
	ps.spareTG = next
	ps.mu.Unlock()
	ps.bg.Add(1) // the sandbox's end waits for it (Wait) before it removes its group
	go func() {
		defer ps.bg.Done()
		g, err := ps.newTemplateGroup()
		next <- spareGroup{cg: g, err: err}
	}()
	return tg, nil
}

// spareGroup is a template group made ahead.
type spareGroup struct {
	cg  *cgroup.Cgroup
	err error
}

// closeControls closes the controls that are open.
func closeControls(ks ...*cgroup.Control) {
	for _, k := range ks {
		if k != nil {
			k.Close()
		}
	}
}

// setTplFrozen freezes or thaws template group tg (SetFrozen) through its
// cgroup.freeze kept open: a restore writes it twice, and so does a job
// forking copies ahead. Only the file of the last group written is kept
// (one per sandbox).
// +checklocks:ps.run
func (ps *State) setTplFrozen(tg *cgroup.Cgroup, on bool) error {
	if ps.tplFreeze.of != tg {
		closeControls(ps.tplFreeze.k)
		// nil on cgroup v1, or if it cannot be opened: SetFrozen then.
		k, _ := tg.OpenControl("cgroup.freeze")
		ps.tplFreeze.of, ps.tplFreeze.k = tg, k
	}
	if ps.tplFreeze.k == nil {
		return tg.SetFrozen(on)
	}
	v := "0"
	if on {
		v = "1"
	}
	return ps.tplFreeze.k.Write(v)
}

func (ps *State) newTemplateGroup() (*cgroup.Cgroup, error) { return ps.frozenGroup("t") }

// frozenGroup makes a new frozen sub-group of the sandbox's group, named
// prefix and a number.
func (ps *State) frozenGroup(prefix string) (*cgroup.Cgroup, error) {
	g, err := ps.h.Cgroup().Sub(ps.h.GroupName(prefix))
	if err != nil {
		return nil, err
	}
	if err := g.Freeze(); err != nil {
		_ = g.Delete()
		return nil, err
	}
	return g, nil
}

// Check fails unless every template of c is alive and frozen.
func (ps *State) Check(c *Checkpoint) error {
	if len(c.Procs) == 0 {
		return nil
	}
	if c.SandboxID != ps.h.ID() {
		return fmt.Errorf("%w: checkpoint %s holds live processes (%s) that only sandbox %s can bring back: template copies are born in its pid namespace; restore it there, or take checkpoints with process mode filesystem",
			ErrProcesses, c.ID, Names(c.Procs), c.SandboxID)
	}
	ps.mu.Lock()
	tg := ps.tpls[c.ID]
	ps.mu.Unlock()
	for _, t := range c.Procs {
		start, err := StartTime(t.HostPid)
		if err != nil || start != t.Start || tg == nil {
			return fmt.Errorf("%w: the frozen copy of %s kept by checkpoint %s was lost (killed after the checkpoint); the checkpoint can no longer bring it back; restore another checkpoint instead (one taken with process mode \"files\" keeps no processes)", ErrProcesses, t.name(), c.ID)
		}
	}
	return nil
}

// Drop ends the templates of checkpoint id, if this sandbox holds
// them.
// +checklocksignore: run is taken with TryLock, which checklocks does not follow.
func (ps *State) Drop(id string) {
	ps.dropAhead(id, false)
	ps.mu.Lock()
	tg, tts := ps.tpls[id], ps.trees[id]
	delete(ps.tpls, id)
	delete(ps.trees, id)
	delete(ps.folded, id)
	delete(ps.listenHeld, id)
	ps.mu.Unlock()
	if tg == nil && tts == nil {
		return
	}
	del := func() {
		err := endTrees(tts)
		if tg != nil {
			err = errors.Join(err, tg.Delete())
		}
		if err != nil {
			ps.h.Log().Warn("ending process templates", "sandbox", ps.h.ID(), "checkpoint", id, "err", err)
		}
	}
	// Templates being copied (a restore, an image being made: run held)
	// are ended once that is over: a template group deleted while thawed
	// and seized would leave its killed tracees to a tracer that no
	// longer waits for them, and the init's exit waits for every task of
	// its pid namespace. DeleteTemplates waits for these.
	if !ps.run.TryLock() {
		ps.dropping.Go(func() {
			ps.run.Lock()
			defer ps.run.Unlock()
			del()
		})
		return
	}
	defer ps.run.Unlock()
	del()
}
