package procstate

import (
	"errors"
	"fmt"
	"os"
	"slices"
	"strconv"
	"strings"
	"sync/atomic"

	"golang.org/x/sys/unix"

	"github.com/deltagym/deltagym/sandbox/cgroup"
	"github.com/deltagym/deltagym/sandbox/ptfork"
)

// A tree of two processes, a shell and the program it runs (`sh -c 'python3
// app.py; echo done'`), is dumped by CRIU, which its forks, durable
// checkpoints and restores after a restart need, and gets templates too: a
// restore in place copies it from them, keeping its pids, in about a
// millisecond where criu takes tens.
//
// Both templates are children of the sandbox's init, in no part of the
// tree (ptfork.ForkOrphan for the child's): a later dump of the tree must
// not meet them. A copy (copyTree) is made the way ptfork.Become describes:
// the child's template forks X, which takes the root's pid
// (Host.NextPid), leads a session of its own, forks the child's copy with
// the child's pid, and becomes the root. The child's template holds the
// root's memory too, out of the way (ptfork.Stash): X becomes the root by
// moving those pages where they belong, which copies none, and the
// child's copy unmaps them; the root then needs no template of its own
// (where the sandbox has not the room for the stash, it has one, and a
// copy's pages are copied from it). Where the copy cannot be made (the
// pids are taken, the template was killed), the tree's images serve.

// treeTemplate is the pair of templates of a tree of two processes.
type treeTemplate struct {
	// root is the root's template, or its record alone (HostPid 0) when
	// the child's template holds its memory (like has a stash).
	root, child Template
	tg          *cgroup.Cgroup // frozen, theirs alone
	src         *ptfork.Source // the root (or its template), read for Become
	like        *ptfork.Layout // the child's template, what a fork of it has
	folded      atomic.Bool    // the child's template was handed to the huge-page worker
	// rootFiles are the root's files its child does not share, opened
	// again in the copy of the root (a shell's own stdout, saved at fd
	// 10 while its child's goes to a log).
	rootFiles []File
}

// treeCopyable says why tree u gets no templates ("" if it does): it is
// not a root that leads its session and group and one child in both, each
// of one thread, a template on its own but for the tree.
func (u procTree) treeCopyable() string {
	if len(u.procs) != 2 {
		return "more than two processes"
	}
	root, child := u.procs[0], u.procs[1]
	switch {
	case root.reason != "":
		return root.reason
	case child.reason != "":
		return child.reason
	case !root.tpl.Leader:
		return "its root does not lead its session"
	case root.tpl.Session != "" || child.tpl.Session != "":
		return "a session's shell"
	case root.tpl.Threads > 1 || child.tpl.Threads > 1:
		return "a process of several threads"
	case root.tpl.Shares != "" || child.tpl.Shares != "":
		return "it shares memory with its templates"
	case len(root.tpl.Private) > 0:
		return "its root holds descriptions a copy gets its own of"
	case root.tpl.Itimer != [4]int64{}:
		return "its root has an interval timer"
	}
	ids, err := statIDs(child.tpl.HostPid)
	if err != nil || ids[1] != root.tpl.HostPid || ids[2] != root.tpl.HostPid {
		return "its child is not in its root's process group"
	}
	return ""
}

// nsPids is err's message with the host pids of tree u's processes as the
// sandbox numbers them, and any other host pid left out (scrubPids).
func nsPids(err error, u procTree) string {
	msg := err.Error()
	for _, p := range u.procs {
		msg = strings.ReplaceAll(msg, "pid "+strconv.Itoa(p.tpl.HostPid)+" ", "process "+strconv.Itoa(p.tpl.NSPid)+" ("+p.tpl.Comm+") ")
	}
	return scrubPids{errors.New(msg)}.Error()
}

// statIDs reads pid's parent, process group and session (host pids).
func statIDs(pid int) ([3]int, error) {
	st, err := os.ReadFile("/proc/" + strconv.Itoa(pid) + "/stat")
	if err != nil {
		return [3]int{}, err
	}
	i := strings.LastIndexByte(string(st), ')')
	f := strings.Fields(string(st[i+1:]))
	if len(f) < 4 {
		return [3]int{}, fmt.Errorf("stat of pid %d", pid)
	}
	var ids [3]int
	var errs [3]error
	for k := range ids {
		ids[k], errs[k] = strconv.Atoi(f[1+k])
	}
	return ids, errors.Join(errs[:]...)
}

// makeTreeTemplates makes the templates of each tree of trees that
// treeCopyable takes, from its stopped processes (seized), before criu
// dumps it, and says so in the tree's reason. A tree of two whose
// templates are not made is left to its images, as others, and its reason
// says why.
func (ps *State) makeTreeTemplates(trees []procTree, seized map[int]*ptfork.Proc) []*treeTemplate {
	var out []*treeTemplate
	for i, u := range trees {
		if len(u.procs) != 2 {
			continue
		}
		notCopied := func(why string) {
			trees[i].why = fmt.Sprintf("%s, with %s a child of it, a tree: not copied from templates (%s); brought back from this image, "+
				"in a restore in place too (docs/PROCESS-SHAPES.md)", u.procs[0].tpl.name(), u.procs[1].tpl.name(), why)
		}
		if why := u.treeCopyable(); why != "" {
			notCopied(why)
			continue
		}
		tt, err := ps.makeTreeTemplate(u, seized)
		if err != nil {
			ps.h.Log().Info("a process tree gets no templates; its images serve", "sandbox", ps.h.ID(), "tree", u.procs[0].tpl.name(), "err", err)
			notCopied(nsPids(err, u))
			continue
		}
		trees[i].why = fmt.Sprintf("%s, with %s a child of it, a tree: copied from templates in a restore in place, "+
			"brought back from this image in a fork or after a restart (docs/PROCESS-SHAPES.md)", tt.root.name(), tt.child.name())
		out = append(out, tt)
	}
	return out
}

func (ps *State) makeTreeTemplate(u procTree, seized map[int]*ptfork.Proc) (*treeTemplate, error) {
	rp, cp := seized[u.procs[0].tpl.HostPid], seized[u.procs[1].tpl.HostPid]
	if rp == nil || cp == nil {
		return nil, errors.New("not stopped")
	}
	// Checked before anything is made: a root that is a subreaper would
	// adopt the child's template (ForkOrphan checks the child), and a
	// child with seccomp filters of its own might refuse ForkOrphan's
	// wait4, leaving it a zombie.
	if sub, err := rp.Subreaper(); err != nil || sub {
		return nil, errors.Join(err, errors.New("its root is a subreaper"))
	}
	if err := ptfork.SameFilters(rp.Pid, cp.Pid); err != nil {
		return nil, err
	}
	tg, err := ps.frozenGroup("t")
	if err != nil {
		return nil, err
	}
	tt := &treeTemplate{root: u.procs[0].tpl, child: u.procs[1].tpl, tg: tg}
	var made []*ptfork.Proc
	fail := func(err error) (*treeTemplate, error) {
		for _, t := range made {
			t.Kill()
		}
		_ = tg.Delete()
		return nil, err
	}
	rt, stash, err := ps.treeRoot(tt, rp)
	if rt != nil {
		made = append(made, rt)
	}
	if err != nil {
		return fail(err)
	}
	ct, err := ps.treeChild(tt, cp, rp.Pid, stash)
	if ct != nil {
		made = append(made, ct)
	}
	if err != nil {
		return fail(err)
	}
	if err := tt.src.Fits(tt.like); err != nil {
		return fail(err)
	}
	for _, t := range made {
		if err := t.Detach(); err != nil {
			return fail(err)
		}
	}
	return tt, nil
}

// treeRoot reads what Become needs of the tree's root rp, stopped, into
// tt, and says whether the root is to be stashed in the child's template
// (treeChild), which copies then need alone: the root gets no template.
// Unlike a template, a stash is memory of its own, taken at the
// checkpoint: where the sandbox has not the room, the root gets a
// template (rt), which its copies' pages are copied from at each
// restore.
func (ps *State) treeRoot(tt *treeTemplate, rp *ptfork.Proc) (rt *ptfork.Proc, stash bool, err error) {
	src, err := rp.ReadSource()
	if err != nil {
		return nil, false, err
	}
	if src.StashCost() < ps.h.MemoryRoom() {
		tt.src = src
		return nil, true, rootRecord(rp, &tt.root)
	}
	// The root's template reads what Become needs before it freezes.
	rt, err = forkTemplateWith(rp, &tt.root, tt.tg, forkWhole, func(t *ptfork.Proc) error {
		var err error
		tt.src, err = t.ReadSource()
		return err
	})
	return rt, false, err
}

// treeChild makes the template of the tree's child cp, with the memory of
// the root (host pid root) stashed in it if stash.
func (ps *State) treeChild(tt *treeTemplate, cp *ptfork.Proc, root int, stash bool) (*ptfork.Proc, error) {
	// The child's copies are born in a session the copy of the root
	// makes: its template leads one of its own, not to hold the root's
	// pid as its session's id.
	tt.child.Leader = true
	defer func() { tt.child.Leader = false }()
	return forkTemplateWith(cp, &tt.child, tt.tg, func(p *ptfork.Proc) (*ptfork.Proc, error) {
		orphan := func() (*ptfork.Proc, error) {
			c, _, err := p.ForkOrphan()
			return c, err
		}
		c, err := orphan()
		if errors.Is(err, ptfork.ErrPartial) {
			// Memory marked MADV_DONTFORK (a Node child's heap): marked
			// to be copied for the fork, as forkWhole does.
			c, err = withDoFork(p, orphan)
		}
		if err != nil {
			return nil, err
		}
		// The init's child, out of the tree: not a subreaper's the tree
		// holds, which a dump of the tree would wait for (ForkOrphan
		// checks the child, and that the copy is whole).
		if ids, perr := statIDs(c.Pid); perr != nil || ids[0] != ps.h.InitPid() {
			c.Kill()
			return nil, fmt.Errorf("the child's template is the child of pid %d, not of the init (a subreaper)", ids[0])
		}
		return c, nil
	}, func(t *ptfork.Proc) error {
		var err error
		if tt.like, err = ptfork.ReadLayout(t.Pid); err != nil {
			return err
		}
		if err := tt.rootOwnFiles(root); err != nil {
			return err
		}
		if !stash {
			return nil
		}
		// A copy moves the root's memory in place of its own instead
		// of copying it. The stash is the template's own memory, made
		// in the sandbox's memory group, which it counts against as
		// its checkpoints' templates do (treeRoot found the room for
		// it): so many checkpoints stash no more than the limit holds.
		if tt.like, err = t.Stash(tt.src); err == nil {
			ps.treeStashes.Add(1)
		}
		return err
	})
}

// reopenFiles reopens files in stopped copy cp (reopenFile).
func reopenFiles(cp *ptfork.Proc, files []File) (err error) {
	if len(files) == 0 {
		return nil
	}
	mem := cp.Scratch()
	defer func() { err = errors.Join(err, mem.Release()) }()
	for _, f := range files {
		if err := reopenFile(cp, f, mem); err != nil {
			return err
		}
	}
	return nil
}

// reopenableDevices are the devices of the sandbox's /dev a descriptor of
// which is the same as another opened anew: they keep no state of a
// description's.
var reopenableDevices = []string{"/dev/null", "/dev/zero", "/dev/full", "/dev/random", "/dev/urandom"}

// rootOwnFiles finds the root's descriptors (of host pid root) that are not
// its child's (its template's, tt.like), which the copy of the root opens
// again by path (tt.rootFiles): files of the sandbox's root, and stateless
// devices. Become then leaves them out. Any other (a pipe, a socket of the
// root's alone) fails the tree's templates: a copy cannot have it.
func (tt *treeTemplate) rootOwnFiles(root int) error {
	fds, err := tt.src.Unshared(tt.like)
	if err != nil {
		return err
	}
	var files []File
	for _, fd := range fds {
		if i := slices.IndexFunc(tt.root.Files, func(f File) bool { return f.FD == fd }); i >= 0 {
			files = append(files, tt.root.Files[i])
			continue
		}
		dir := "/proc/" + strconv.Itoa(root) + "/"
		link, err := os.Readlink(dir + "fd/" + strconv.Itoa(fd))
		if err != nil {
			return err
		}
		info, err := os.ReadFile(dir + "fdinfo/" + strconv.Itoa(fd))
		if err != nil {
			return err
		}
		if !slices.Contains(reopenableDevices, link) {
			return fmt.Errorf("the root's descriptor %d (%s) is not its child's, nor a file a copy can open again", fd, link)
		}
		flags, _ := strconv.ParseInt(fdinfoField(string(info), "flags"), 8, 64)
		files = append(files, File{FD: fd, Path: link, Flags: int(flags)})
	}
	tt.src.Without(fds)
	tt.rootFiles = files
	return nil
}

// rootRecord reads into t, the record of stopped root p of a tree that
// gets no template of its own, what a template's making reads of its
// process and a copy is given back (fixUp): its interval timer and its
// dumpable flag.
func rootRecord(p *ptfork.Proc, t *Template) error {
	if err := readItimer(p, t); err != nil {
		return err
	}
	d, err := p.Syscall(unix.SYS_PRCTL, unix.PR_GET_DUMPABLE)
	if err != nil {
		return fmt.Errorf("reading the dumpable flag: %w", err)
	}
	t.Dumpable = int(d)
	t.HostPid, t.Start = 0, 0 // no template
	return nil
}

// keepTrees records tts as checkpoint id's tree templates.
func (ps *State) keepTrees(id string, tts []*treeTemplate) {
	if len(tts) == 0 {
		return
	}
	ps.mu.Lock()
	defer ps.mu.Unlock()
	ps.trees[id] = tts
}

// endTrees ends the templates of tts (their groups).
func endTrees(tts []*treeTemplate) error {
	var errs []error
	for _, tt := range tts {
		errs = append(errs, tt.tg.Delete())
	}
	return errors.Join(errs...)
}

// treeOf returns the tree templates of checkpoint c for unit u, nil if it
// has none.
func (ps *State) treeOf(c *Checkpoint, u Unit) *treeTemplate {
	ps.mu.Lock()
	defer ps.mu.Unlock()
	for _, tt := range ps.trees[c.ID] {
		if len(u.Procs) == 2 && u.Procs[0].NSPid == tt.root.NSPid && u.Procs[1].NSPid == tt.child.NSPid {
			return tt
		}
	}
	return nil
}

// TreeCopies is the number of process trees restored by copies of their
// templates.
func (ps *State) TreeCopies() int64 { return ps.treeCopies.Load() }

// TreeStashes is the number of tree templates made with the root's memory
// stashed in the child's.
func (ps *State) TreeStashes() int64 { return ps.treeStashes.Load() }

// copyTree brings back the tree of tt by a copy of its templates, its pids
// free. On error nothing of the copy is left.
func (ps *State) copyTree(tt *treeTemplate) error {
	ps.run.Lock()
	defer ps.run.Unlock()
	return ps.copyTreeLocked(tt)
}

// copyTreeLocked is copyTree with run held.
// +checklocks:ps.run
func (ps *State) copyTreeLocked(tt *treeTemplate) error {
	tr := ptfork.NewSession()
	defer tr.Close()
	tpls := []Template{tt.child}
	if tt.root.HostPid != 0 {
		tpls = append(tpls, tt.root) // no stash: its pages are copied
	}
	seized := make([]*ptfork.Proc, len(tpls))
	for i, t := range tpls {
		var err error
		if seized[i], err = tr.Seize(t.HostPid); err != nil {
			return err
		}
	}
	// Seized, a pid is held: the processes are the templates if their
	// start times are.
	for _, t := range tpls {
		if start, err := StartTime(t.HostPid); err != nil || start != t.Start {
			return fmt.Errorf("the template of %s is gone", t.name())
		}
	}
	if err := ps.setTplFrozen(tt.tg, false); err != nil {
		return err
	}
	err := ps.copyThawed(tt, seized)
	// Frozen again before the templates are detached (tr.Close).
	if err = errors.Join(err, ps.setTplFrozen(tt.tg, true)); err == nil {
		ps.foldTree(tt)
	}
	return err
}

// foldTree hands the child's template of tt, which every copy forks twice
// and which holds the root's memory too, to the huge-page worker the first
// time tt is copied (fold.go): its forks then copy a page table entry for
// each 2 MiB, and the root's stashed pages move into place in huge pages
// (Stash keeps them aligned alike).
func (ps *State) foldTree(tt *treeTemplate) {
	if ps.cfg.SmallPages || tt.folded.Swap(true) {
		return
	}
	ps.h.QueueFold(tt.child.HostPid, "a tree's template of "+tt.child.name())
}

// copyThawed makes the copy of tt once its templates, seized (the
// child's first), are thawed into their stops.
func (ps *State) copyThawed(tt *treeTemplate, seized []*ptfork.Proc) error {
	for _, t := range seized {
		if err := t.Wait(); err != nil {
			return err
		}
	}
	ct := seized[0]
	var made []*ptfork.Proc
	x, c2, err := ps.forkTree(tt, ct, &made)
	if err == nil {
		err = ps.readyTree(tt, x, c2)
	}
	if err == nil {
		err = errors.Join(c2.Detach(), x.Detach())
	}
	if err != nil {
		for _, p := range made {
			_ = unix.Kill(p.Pid, unix.SIGKILL) // detached or not
			p.Kill()
		}
		return err
	}
	ps.treeCopies.Add(1)
	return nil
}

// forkTree forks the two processes of the copy of tt from the child's
// template ct, with the tree's pids, into the command group; made lists
// what it forked, for the caller to end on error.
func (ps *State) forkTree(tt *treeTemplate, ct *ptfork.Proc, made *[]*ptfork.Proc) (x, c2 *ptfork.Proc, err error) {
	fork := func(from *ptfork.Proc, t Template, child bool) (*ptfork.Proc, error) {
		// The kernel hands out the pid after the last one: a child whose
		// pid follows the root's gets it with no word to the zygote.
		if !child || t.NSPid != tt.root.NSPid+1 {
			if err := ps.h.NextPid(t.NSPid); err != nil {
				return nil, err
			}
		}
		var p *ptfork.Proc
		var nsPid int
		var err error
		if child {
			p, nsPid, err = from.ForkChild()
		} else {
			p, nsPid, err = from.Fork()
		}
		if err != nil {
			return nil, ps.copyError(t.name(), err)
		}
		*made = append(*made, p)
		if nsPid != t.NSPid {
			return nil, fmt.Errorf("%w: the copy of %s got pid %d, not its own (taken)", ErrProcesses, t.name(), nsPid)
		}
		if err := ps.h.MoveCopy(ps.h.WorkGroup(), p.Pid); err != nil {
			return nil, err
		}
		return p, ps.h.WorkGroup().JoinMemory(p.Pid)
	}
	if x, err = fork(ct, tt.root, false); err != nil {
		return nil, nil, err
	}
	// The root leads its session and group, which its child is in.
	if _, err := x.Syscall(unix.SYS_SETSID); err != nil {
		return nil, nil, fmt.Errorf("setsid: %w", err)
	}
	// The child's files are reopened in X before it forks the child's
	// copy, which so shares them with X: the root's files are the child's
	// (Fits), and the two go on sharing their offsets (a log both write).
	if err := reopenFiles(x, tt.child.Files); err != nil {
		return nil, nil, fmt.Errorf("%w: the copy of %s: %w", ErrProcesses, tt.root.name(), err)
	}
	if c2, err = fork(x, tt.child, true); err != nil {
		return nil, nil, err
	}
	return x, c2, nil
}

// readyTree fixes up the child's copy c2 as a copy of its template, and
// makes x the root's.
func (ps *State) readyTree(tt *treeTemplate, x, c2 *ptfork.Proc) error {
	if err := c2.DropStash(tt.like); err != nil {
		return fmt.Errorf("%w: the copy of %s: %w", ErrProcesses, tt.child.name(), err)
	}
	child := tt.child
	child.Files = nil // reopened in X, before the fork (forkTree)
	_, later, err := fixUp(c2, child, false)
	if err != nil {
		return fmt.Errorf("%w: fixing up the copy of %s: %w", ErrProcesses, tt.child.name(), err)
	}
	if err := x.Become(tt.src, tt.like); err != nil {
		return fmt.Errorf("%w: copying %s: %w", ErrProcesses, tt.root.name(), err)
	}
	root := tt.root
	root.Leader = false       // it called setsid
	root.Files = tt.rootFiles // the rest are the child's, reopened in X before the fork
	if root.Cwd == "/" && tt.child.Cwd != "/" {
		root.Cwd = "/." // chdir even so: x has the child's
	}
	if _, _, err := fixUp(x, root, false); err != nil {
		return fmt.Errorf("%w: fixing up the copy of %s: %w", ErrProcesses, tt.root.name(), err)
	}
	if later == nil {
		return nil
	}
	ps.h.SettleKilled([]Template{tt.root, tt.child})
	if err := listenAnew(c2, tt.child, later); err != nil {
		return fmt.Errorf("%w: the copy of %s: %w", ErrProcesses, tt.child.name(), err)
	}
	return nil
}
