package sandbox

import (
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"golang.org/x/sys/unix"

	"github.com/deltagym/deltagym/sandbox/cgroup"
	"github.com/deltagym/deltagym/sandbox/criu"
	"github.com/deltagym/deltagym/sandbox/egress"
	"github.com/deltagym/deltagym/sandbox/launch"
	"github.com/deltagym/deltagym/sandbox/procstate"
)

// Sandbox is one live sandbox. Its methods are safe for concurrent use:
// Exec, ReadFile and WriteFile run side by side; Checkpoint, Restore and
// Destroy run alone, and Restore and Destroy first abort running execs.
//
// Its state is in three parts, each with its own lock (doc.go gives the
// order): the root filesystem (fs), the command groups (cmds) and the
// process state (procs, sandbox/procstate). op serialises the sandbox's state changes
// against its commands and file actions.
type Sandbox struct {
	rt     *Runtime
	id     string
	spec   Spec
	img    *imageRec
	hostID int
	// init is the sandbox's init, whose control socket is the one
	// descriptor of the server an idle sandbox holds: its namespaces are
	// opened through it when needed (launch.Init.NS), and the rest of
	// what a sandbox in use keeps open is given up when it goes cold
	// (hot.go).
	init    *launch.Init
	cg      *cgroup.Cgroup
	created time.Time
	// egress serves the sandbox's egress listener (Spec.Egress); set by
	// Create, ended by Destroy.
	egress io.Closer

	// op serialises state changes (write lock) against commands and file
	// actions (read lock).
	op sync.RWMutex
	// head is the checkpoint the live state descends from (Head).
	// +checklocks:op
	head string
	// lastRestore is the checkpoint the last restore restored.
	// +checklocks:op
	lastRestore string

	fs    rootFS
	cmds  cmdGroups
	procs *procstate.State
	// shm is what the sandbox's /dev/shm is known to hold (shm.go).
	shm shmState

	bg sync.WaitGroup // background retirements of killed command groups, spare groups

	mu sync.Mutex // guards the fields below
	// +checklocks:mu
	// +checklocks:op
	gen context.Context
	// +checklocks:mu
	abort context.CancelFunc
	// +checklocks:mu
	sessions map[string]*session
	// +checklocks:mu
	seq int
	// +checklocks:mu
	closed bool
	done   chan struct{}

	// tearOnce runs the teardown (Destroy, or the runtime's retirement
	// after Close) once; tearErr is its result, read after tearOnce.Do.
	tearOnce sync.Once
	tearErr  error

	// live: registered and not torn down; only a live sandbox joins the
	// runtime's hot set (hot.go).
	live atomic.Bool
	// cold: the sandbox gave up its kept descriptors (set under cmds.mu
	// by coolCmds, cleared when it joins the hot set again).
	cold atomic.Bool
}

// ID returns the sandbox's id.
func (s *Sandbox) ID() string { return s.id }

// Image returns the name of the sandbox's image.
func (s *Sandbox) Image() string { return s.img.info.Name }

// Created returns when the sandbox was created.
func (s *Sandbox) Created() time.Time { return s.created }

// Done is closed when the sandbox is destroyed or its init has died.
func (s *Sandbox) Done() <-chan struct{} { return s.done }

// Head returns the checkpoint the live state descends from: the last one
// taken or restored ("" for a sandbox made from an image and never
// checkpointed).
func (s *Sandbox) Head() string {
	s.op.RLock()
	defer s.op.RUnlock()
	return s.head
}

// InitPid returns the host pid of the sandbox's init.
func (s *Sandbox) InitPid() int { return s.init.Pid }

// Depth returns the number of delta layers under the sandbox's upper.
func (s *Sandbox) Depth() int {
	s.fs.mu.RLock()
	defer s.fs.mu.RUnlock()
	return len(s.fs.stack)
}

// Create starts a sandbox from an image or a checkpoint.
func (r *Runtime) Create(ctx context.Context, spec Spec) (*Sandbox, error) {
	if err := spec.validate(); err != nil {
		return nil, err
	}
	if err := r.admitSandboxes(1); err != nil {
		return nil, err
	}
	return r.create(ctx, spec)
}

// create makes a sandbox of a valid spec, admitted already: it takes one
// of the runtime's reservations (admitSandboxes), which register turns into
// the live sandbox, or gives it back if it fails before.
func (r *Runtime) create(ctx context.Context, spec Spec) (_ *Sandbox, err error) {
	registered := false
	defer func() {
		if !registered {
			r.unreserve(1)
		}
	}()
	src, err := r.createSource(ctx, spec)
	if err != nil {
		return nil, err
	}
	gen, abort := context.WithCancel(context.Background())
	head := ""
	if src.ck != nil {
		head = src.ck.ID
	}
	s := &Sandbox{
		rt: r, id: r.newID("sb"), spec: spec, img: src.img,
		fs:   rootFS{upperFD: -1, root: -1, idmapped: map[string]int{}},
		cmds: cmdGroups{reuseW: make(chan workGroup, 1)},
		gen:  gen, abort: abort, head: head,
		sessions: map[string]*session{}, done: make(chan struct{}),
		created: time.Now(),
	}
	s.procs = procstate.New((*procHost)(s), r.procConfig())
	var undo undoList
	defer func() {
		if err != nil {
			if e := undo.run(); e != nil {
				r.log.Warn("cleaning up a failed sandbox", "sandbox", s.id, "err", e)
			}
		}
	}()
	if err = s.adoptInit(&undo); err != nil {
		return nil, err
	}
	if err = s.startEgress(&undo); err != nil {
		return nil, err
	}
	if err = s.startRoot(src.ck, &undo); err != nil {
		return nil, err
	}
	if src.ck != nil {
		// The init's /dev/shm is empty: the checkpoint's, before its
		// processes (CRIU opens their files by path).
		if err = s.restoreShm(src.ck, false, false); err != nil {
			return nil, err
		}
	}
	if src.ck != nil && !spec.FilesOnly {
		if err = s.startProcesses(ctx, src); err != nil {
			return nil, err
		}
	}
	if err = r.register(s, head); err != nil {
		return nil, err
	}
	registered = true
	// What making its root opened stays open until the sandbox is among
	// the least recently used (hot.go): closing the idmapped clones costs
	// an RCU grace period each, which a fork fan-out would wait for.
	r.hot.touch(s)
	go s.watch()
	if spec.FreshEntropy && src.ck != nil && !spec.FilesOnly {
		// Sessions brought back from CRIU images share their $RANDOM.
		if err := s.reseedSessions(ctx); err != nil {
			_ = s.Destroy(context.WithoutCancel(ctx))
			return nil, err
		}
	}
	return s, nil
}

// undoList is the cleanup of a half-made sandbox, run last step first.
type undoList []func() error

func (u *undoList) add(f func() error) { *u = append(*u, f) }

func (u undoList) run() error {
	var errs []error
	for i := len(u) - 1; i >= 0; i-- {
		errs = append(errs, u[i]())
	}
	return errors.Join(errs...)
}

// createSource is what a new sandbox starts from: its image, and the
// checkpoint (nil for an image) with the CRIU images of its templates
// (tplUnits), which a new sandbox restores since templates serve only
// their own sandbox.
type createSource struct {
	img      *imageRec
	ck       *checkpoint
	tplUnits []procstate.Unit
}

// createSource resolves spec's checkpoint and image; it fails if the
// runtime is shutting down.
func (r *Runtime) createSource(ctx context.Context, spec Spec) (createSource, error) {
	var src createSource
	imgName := spec.Image
	if spec.Checkpoint != "" {
		ck, err := r.lookup(spec.Checkpoint)
		if err != nil {
			return src, err
		}
		ck.used.Store(time.Now().UnixNano()) // for CheckpointTTL
		if imgName != "" && imgName != ck.Image {
			return src, fmt.Errorf("%w: checkpoint %s is of image %s, not %s", ErrMismatch, ck.ID, ck.Image, imgName)
		}
		imgName, src.ck = ck.Image, ck
		if len(ck.Procs) > 0 && !spec.FilesOnly && !spec.SkipTemplates {
			// Templates are born in their sandbox's pid namespace: a new
			// sandbox gets their CRIU images.
			if src.tplUnits, err = r.imagesForTemplates(ctx, ck); err != nil {
				return src, err
			}
		}
	}
	r.mu.Lock()
	src.img = r.images[imgName]
	closed := r.closed
	r.mu.Unlock()
	if closed {
		return src, fmt.Errorf("%w: runtime is shutting down", ErrClosed)
	}
	if src.img == nil {
		return src, fmt.Errorf("%w: image %q", ErrNotFound, imgName)
	}
	return src, nil
}

// adoptInit takes a warm init (its namespaces and cgroups) for the sandbox
// and sets the sandbox's limits on its group.
func (s *Sandbox) adoptInit(undo *undoList) error {
	r := s.rt
	w, err := r.takeInit(s.spec.Hostname)
	if err != nil {
		return err
	}
	s.id, s.hostID, s.cg, s.init = w.id, w.hostID, w.cg, w.init
	s.cmds.mu.Lock()
	s.cmds.work = w.work
	s.cmds.mu.Unlock()
	undo.add(func() error { w.free(r); return nil })
	l := s.spec.Limits
	// The warm init's group has the runtime's CPU weight already (warm.go).
	lim := cgroup.Limits{MemoryBytes: l.MemoryBytes, Pids: l.Pids, CPUQuota: l.CPUs, CPUWeight: r.cfg.CPUWeight}
	if lim != (cgroup.Limits{CPUWeight: r.cfg.CPUWeight}) {
		if err = s.cg.SetLimits(lim); err != nil {
			return fmt.Errorf("setting limits: %w", err)
		}
	}
	undo.add(s.closeFDs)
	return nil
}

// startEgress serves the egress proxy inside the sandbox's net namespace when
// its spec asks; a sandbox without egress pays nothing.
func (s *Sandbox) startEgress(undo *undoList) error {
	if s.spec.Egress == nil {
		return nil
	}
	netns, err := s.init.NS(unix.PIDFD_GET_NET_NAMESPACE)
	if err != nil {
		return fmt.Errorf("starting the egress proxy: %w", err)
	}
	ln, err := egress.Listen(netns)
	unix.Close(netns)
	if err != nil {
		return fmt.Errorf("starting the egress proxy: %w", err)
	}
	s.egress = s.spec.Egress.ServeEgress(ln, s.id)
	undo.add(s.stopEgress)
	return nil
}

// stopEgress ends the egress service, if any: its listener and connections
// belong to the net namespace, which goes back to the pool after.
func (s *Sandbox) stopEgress() error {
	if s.egress == nil {
		return nil
	}
	err := s.egress.Close()
	s.egress = nil
	return err
}

// startRoot makes the sandbox's root: a fresh upper over checkpoint ck's
// layers (none for an image), with a fresh seed if the spec asks.
func (s *Sandbox) startRoot(ck *checkpoint, undo *undoList) error {
	r := s.rt
	var stack []string
	if ck != nil {
		stack = r.stackOf(ck)
	}
	if err := refAll(r, stack); err != nil {
		return fmt.Errorf("%w: checkpoint %s was released", ErrNotFound, s.spec.Checkpoint)
	}
	s.fs.mu.Lock()
	s.fs.stack = slices.Clone(stack)
	undo.add(func() error {
		s.fs.mu.Lock()
		defer s.fs.mu.Unlock()
		s.unrefStack()
		return nil
	})
	err := s.switchRoot(stack, false, false)
	s.fs.mu.Unlock()
	if err != nil {
		return err
	}
	undo.add(func() error {
		s.fs.mu.Lock()
		defer s.fs.mu.Unlock()
		s.dropSpare()
		s.releaseUpper()
		return nil
	})
	if s.spec.FreshEntropy {
		return s.writeSeed(newSeed())
	}
	return nil
}

// startProcesses restores the checkpoint's CRIU trees and the images of
// its templates into the new sandbox.
func (s *Sandbox) startProcesses(ctx context.Context, src createSource) error {
	units := slices.Concat(src.ck.Images, src.tplUnits)
	if len(units) == 0 {
		return nil
	}
	unboost := s.boostCPU() // as a restore does
	defer unboost()
	s.shmMayChange()
	return s.procs.RestoreTrees(ctx, &src.ck.Checkpoint, units)
}

// register records the sandbox and makes it the runtime's, unless the
// runtime is shutting down.
func (r *Runtime) register(s *Sandbox, head string) error {
	if err := r.writeSandboxRecord(s); err != nil {
		return err
	}
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.closed {
		os.Remove(filepath.Join(r.store, "meta", "sandboxes", s.id))
		return fmt.Errorf("%w: runtime is shutting down", ErrClosed)
	}
	r.sandboxes[s.id] = s
	s.live.Store(true)
	r.adm.mu.Lock()
	defer r.adm.mu.Unlock()
	r.adm.reserved--
	r.adm.fdsMade++
	if head != "" {
		r.adm.heads[head]++
	}
	return nil
}

func (sp Spec) validate() error {
	if sp.Image == "" && sp.Checkpoint == "" {
		return fmt.Errorf("%w: a sandbox needs an image or a checkpoint", ErrInvalid)
	}
	l := sp.Limits
	if l.MemoryBytes < 0 || l.Pids < 0 || l.CPUs < 0 || l.DiskBytes < 0 || l.Inodes < 0 {
		return fmt.Errorf("%w: negative limit", ErrInvalid)
	}
	if len(sp.Hostname) > 64 || strings.ContainsAny(sp.Hostname, "\x00/ ") {
		return fmt.Errorf("%w: host name %q: at most 64 characters, no spaces or slashes", ErrInvalid, sp.Hostname)
	}
	if sp.UID >= launch.IDRange || sp.GID >= launch.IDRange {
		return fmt.Errorf("%w: uid and gid must be below %d", ErrInvalid, launch.IDRange)
	}
	return nil
}

// watch destroys the sandbox if its init dies on its own.
func (s *Sandbox) watch() {
	select {
	case <-s.init.Done():
		s.mu.Lock()
		closed := s.closed
		s.mu.Unlock()
		if !closed {
			s.rt.log.Warn("sandbox init died; destroying the sandbox", "sandbox", s.id, "exit", s.init.ExitErr())
			_ = s.Destroy(context.Background())
		}
	case <-s.done:
	}
}

func (s *Sandbox) diskBytes() int64 {
	if s.spec.Limits.DiskBytes > 0 {
		return s.spec.Limits.DiskBytes
	}
	return s.rt.cfg.DefaultDiskBytes
}

// inodes is the writable layer's inode limit.
func (s *Sandbox) inodes() int64 {
	if s.spec.Limits.Inodes > 0 {
		return s.spec.Limits.Inodes
	}
	if n := s.rt.cfg.DefaultInodes; n > 0 {
		return n
	}
	return max(s.diskBytes()/inodeBytes, minInodes)
}

// The default inode limit of a writable layer: one per inodeBytes of its
// size, at least minInodes.
const (
	inodeBytes = 8 << 10
	minInodes  = 4096
)

// closeFDs closes the files the sandbox keeps open: the command group's
// controls, the template group's freezer, the CPU weight, the idmapped
// layers and the user namespace.
func (s *Sandbox) closeFDs() error {
	s.cmds.mu.Lock()
	s.closeWorkFiles()
	if s.cmds.boost != nil {
		s.cmds.boost.Close()
		s.cmds.boost = nil
	}
	s.cmds.mu.Unlock()
	s.procs.Close()
	s.fs.mu.Lock()
	for k, fd := range s.fs.idmapped {
		unix.Close(fd)
		delete(s.fs.idmapped, k)
	}
	s.fs.mu.Unlock()
	return nil
}

// beginOp aborts running execs when abort is set, then takes the write
// lock, which the caller releases whatever it returns. It fails if the
// sandbox is closed.
// +checklocksacquire:s.op
func (s *Sandbox) beginOp(abort bool) error {
	s.rt.hot.touch(s)
	if abort {
		s.mu.Lock()
		s.abort()
		s.mu.Unlock()
	}
	s.op.Lock()
	s.mu.Lock()
	closed := s.closed
	if !closed && abort {
		s.gen, s.abort = context.WithCancel(context.Background())
	}
	s.mu.Unlock()
	if closed {
		return fmt.Errorf("%w: sandbox %s", ErrClosed, s.id)
	}
	return nil
}

// Close ends the sandbox for its callers at once and leaves the rest of
// Destroy's work to the runtime, in the background (retire.go): calls from
// now on fail with ErrClosed and running execs return ErrAborted; ending its
// processes, saving the templates of its checkpoints as CRIU images (so that
// those checkpoints keep their processes) and freeing its mounts, groups and
// namespaces follow off the caller's path, and Done is closed once they are
// over. Close never waits for a call in progress, a CRIU dump or the
// kernel: it takes only the sandbox's own small lock. Idempotent; a Destroy
// after it waits for the teardown.
func (s *Sandbox) Close(ctx context.Context) error {
	if s.shut() {
		s.rt.retire(s)
	}
	return nil
}

// Destroy ends every process of the sandbox and frees what it holds, and
// returns once that is done; its checkpoints stay, their templates saved as
// CRIU images first. Running execs return ErrAborted. Destroy is
// idempotent, and waits for a teardown that Close started.
func (s *Sandbox) Destroy(ctx context.Context) error {
	s.shut()
	return s.teardown(ctx)
}

// shut marks the sandbox closed and aborts what runs in it, and reports
// whether this call did: no state change begins after it (beginOp).
func (s *Sandbox) shut() bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.closed {
		return false
	}
	s.closed = true
	s.abort()
	return true
}

// teardown runs tearDown once; later and concurrent calls wait for it and
// return its result.
func (s *Sandbox) teardown(ctx context.Context) error {
	s.tearOnce.Do(func() { s.tearErr = s.tearDown(ctx) })
	return s.tearErr
}

// tearDown is Destroy's work once the sandbox is shut: it waits for the
// state change in progress, if any (aborted by shut), then saves the
// templates, ends the processes and frees everything.
func (s *Sandbox) tearDown(ctx context.Context) error {
	s.live.Store(false)
	s.rt.hot.forget(s)
	s.op.Lock()
	defer s.op.Unlock()
	if frozen, err := s.cg.SelfFrozen(); err == nil && frozen {
		// Frozen (Freeze): the templates could not fork the copies
		// that are saved. What the sandbox runs ends first; the
		// templates stay frozen in groups of their own.
		if err := s.killAll(); err != nil {
			s.rt.log.Warn("ending a frozen sandbox's processes", "sandbox", s.id, "err", err)
		}
		if err := s.cg.Thaw(); err != nil {
			s.rt.log.Warn("thawing a frozen sandbox to end it", "sandbox", s.id, "err", err)
		}
	}
	s.imageAllTemplates(ctx)
	s.mu.Lock()
	sessions := s.sessions
	s.sessions = map[string]*session{}
	s.mu.Unlock()
	for _, se := range sessions {
		se.close()
	}
	var errs []error
	// Templates, then copies forked ahead, first: one killed while frozen
	// (an agent's kill -9 -1) stays half-exited until thawed, and the
	// init's exit waits for every task of its pid namespace. A job forking
	// ahead from a template ends with it.
	errs = append(errs, s.procs.DeleteTemplates())
	errs = append(errs, s.procs.EndAhead())
	// The net namespace, taken from the init while it lives, goes back
	// to the pool once nothing of the sandbox is left in it (below).
	netns, nerr := s.init.NS(unix.PIDFD_GET_NET_NAMESPACE)
	errs = append(errs, s.init.Stop())
	s.dropExecGroups()
	s.bg.Wait()    // removals of killed command groups
	s.procs.Wait() // template groups made ahead, copies forked ahead ended
	errs = append(errs, s.cg.Delete())
	s.fs.mu.Lock()
	s.dropSpare()
	s.fs.mu.Unlock()
	s.dropSpareWork()
	s.closeFDs()
	errs = append(errs, s.stopEgress())
	if nerr == nil {
		s.rt.net.Put(netns) // the init is gone: nothing of the sandbox is left in it
	}
	s.fs.mu.Lock()
	s.unrefStack()
	s.releaseUpper()
	s.fs.mu.Unlock()
	s.rt.putRange(s.hostID)
	s.rt.mu.Lock()
	delete(s.rt.sandboxes, s.id)
	s.rt.mu.Unlock()
	s.rt.adm.mu.Lock()
	s.rt.adm.unpinHeadLocked(s.head)
	s.rt.adm.mu.Unlock()
	_ = os.Remove(filepath.Join(s.rt.store, "meta", "sandboxes", s.id))
	close(s.done)
	s.rt.kickWarm() // its place is free: a pool the caps held short may grow
	return errors.Join(errs...)
}

// Freeze stops every process of the sandbox (the init included) until Thaw.
func (s *Sandbox) Freeze() error {
	err := s.beginOp(false)
	defer s.op.Unlock()
	if err != nil {
		return err
	}
	// A job forking copies ahead stops for nothing but the sandbox's own
	// freezer: frozen mid-fork, it would hold the templates until Thaw.
	s.procs.WaitAhead()
	if err := s.cg.Freeze(); err != nil {
		return fmt.Errorf("freezing sandbox %s: %w", s.id, err)
	}
	return nil
}

// Thaw resumes a frozen sandbox.
func (s *Sandbox) Thaw() error {
	err := s.beginOp(false)
	defer s.op.Unlock()
	if err != nil {
		return err
	}
	if err := s.cg.Thaw(); err != nil {
		return fmt.Errorf("thawing sandbox %s: %w", s.id, err)
	}
	return nil
}

func (w workFiles) close() {
	if w.ev != nil {
		w.ev.Close()
	}
	if w.pids != nil {
		w.pids.Close()
	}
	closeControls(w.procs, w.kill)
}

// Checkpoint records the sandbox's current state as an immutable checkpoint,
// its live processes as the runtime's default process mode says.
// Background processes and sessions keep running.
func (s *Sandbox) Checkpoint(ctx context.Context) (CheckpointInfo, error) {
	return s.CheckpointWith(ctx, CheckpointOptions{})
}

// CheckpointWith is Checkpoint with options.
func (s *Sandbox) CheckpointWith(ctx context.Context, o CheckpointOptions) (CheckpointInfo, error) {
	mode, err := s.processMode(o.Processes)
	if err != nil {
		return CheckpointInfo{}, err
	}
	err = s.beginOp(false)
	defer s.op.Unlock()
	if err != nil {
		return CheckpointInfo{}, err
	}
	// A restore after this one is not the same as the last restore
	// again: a loop of restore, steps and checkpoint would have its
	// checkpoints drop the roots built ahead (switchRoot).
	s.lastRestore = ""
	r := s.rt
	if err := r.admitCheckpoint(s.upperUsed()+s.shmUsed(), s.shmMounts()); err != nil {
		return CheckpointInfo{}, err
	}
	c := &checkpoint{Checkpoint: procstate.Checkpoint{ID: s.rt.newID("ck"), SandboxID: s.id}, Parent: s.head, Image: s.img.info.Name, Created: time.Now(),
		Labels: cloneLabels(o.Labels), Pinned: o.Pinned}
	if err := s.capture(ctx, c, mode); err != nil {
		// A step after the files were copied failed (a template's fork,
		// say): the copy's references go (none were taken otherwise).
		c.unrefFiles(r)
		return CheckpointInfo{}, err
	}
	if err := r.addCheckpoint(c); err != nil {
		c.unrefFiles(r)
		s.procs.Drop(c.ID)
		if len(c.Images) > 0 {
			_ = os.RemoveAll(r.criuDir(c.ID))
		}
		return CheckpointInfo{}, err
	}
	r.moveHead(s.head, c.ID)
	s.head = c.ID
	r.maybeFlatten(c)
	r.digestAhead(c)
	var serr error
	if o.Durable && len(c.Procs) > 0 {
		serr = s.saveDurable(ctx, c)
	}
	// Under the runtime's lock, as other readers: once added, the
	// checkpoint's layers and images (TplImages) change under it.
	r.mu.Lock()
	info := c.info()
	r.mu.Unlock()
	if serr != nil {
		unsavedReasons(info.Processes[:len(c.Procs)], serr)
	}
	return info, nil
}

// saveDurable saves the templates of c, a checkpoint just taken durable,
// as CRIU images, and returns why it could not. The checkpoint stands
// either way: its files and templates are kept.
func (s *Sandbox) saveDurable(ctx context.Context, c *checkpoint) error {
	r := s.rt
	if !r.startImaging() {
		return errors.New("the server is shutting down")
	}
	defer r.pimg.making.Done()
	_, err := r.imagesForTemplates(ctx, c)
	if err != nil {
		r.log.Warn("saving a durable checkpoint's processes", "checkpoint", c.ID, "err", err)
	}
	return err
}

// unsavedReasons says, of each of tpls (a checkpoint's template
// processes, in order), why saving them failed with err: the process CRIU
// refused gets CRIU's cause and log, the others that they are saved with
// it.
func unsavedReasons(tpls []ProcessCapture, err error) {
	var ie *procstate.ImageError
	if !errors.As(err, &ie) || ie.Index >= len(tpls) {
		for i := range tpls {
			tpls[i].Unsaved = "not saved: " + err.Error()
		}
		return
	}
	why := err.Error()
	if re := (*criu.RequestError)(nil); errors.As(err, &re) {
		why = "CRIU could not save it: " + re.Brief()
	}
	bad := tpls[ie.Index]
	for i := range tpls {
		tpls[i].Unsaved = fmt.Sprintf("not saved: a checkpoint's processes are saved together, and pid %d (%s) could not be", bad.Pid, bad.Command)
	}
	tpls[ie.Index].Unsaved = why
}

// processMode resolves a checkpoint's process mode: the default is the
// runtime's, and the runtime's default templates.
func (s *Sandbox) processMode(mode ProcessMode) (ProcessMode, error) {
	if mode == ProcessesDefault {
		mode = s.rt.cfg.ProcessMode
	}
	if mode == ProcessesDefault {
		mode = ProcessesTemplate
	}
	if mode < ProcessesNone || mode > ProcessesCRIU {
		return 0, fmt.Errorf("%w: process mode %d", ErrInvalid, mode)
	}
	return mode, nil
}

// capture records the sandbox's files, and its live processes as mode
// says, into c: without live processes the upper itself is sealed
// (sealAndSwap), else a copy of it is, taken while the processes are
// stopped. Called with op held.
func (s *Sandbox) capture(ctx context.Context, c *checkpoint, mode ProcessMode) error {
	live, err := s.hasProcesses()
	if err != nil {
		return err
	}
	// The files of a sandbox whose processes are stopped: /dev/shm's, then
	// the upper's.
	files := func() error {
		if err := s.captureShm(c); err != nil {
			return err
		}
		return s.copyUpperFrozen(c)
	}
	switch {
	case !live:
		if err = s.captureShm(c); err != nil {
			break
		}
		err = s.sealAndSwap(c)
		if errors.Is(err, unix.EBUSY) {
			err = s.copyUpper(func() error { return s.copyUpperFrozen(c) })
		}
	case mode == ProcessesTemplate, mode == ProcessesCRIU:
		// As for a restore (boostCPU): each process must get a CPU to
		// stop, to clone itself, and (CRIU) to run the parasite.
		unboost := s.boostCPU()
		// Its clones count against the pids and memory limits, which the
		// processes a restore just killed may still count in.
		s.waitKilled()
		err = s.materialize() // processes run: it is, but be sure
		if err == nil {
			err = s.procs.Capture(ctx, &c.Checkpoint, mode == ProcessesCRIU, files)
		}
		unboost()
		if err != nil && !errors.Is(err, ErrProcesses) {
			err = fmt.Errorf("capturing processes: %w", err)
		}
	default:
		err = s.copyUpper(files)
	}
	if err == nil {
		s.shmSeen(c.Shm, live)
	}
	return err
}

// Restore puts the sandbox at checkpoint id: every process but the init is
// ended (running execs return ErrAborted), and the checkpoint's layers under
// a fresh upper become the root.
func (s *Sandbox) Restore(ctx context.Context, id string) error {
	return s.RestoreWith(ctx, id, RestoreOptions{})
}

// RestoreWith is Restore with options.
func (s *Sandbox) RestoreWith(ctx context.Context, id string, o RestoreOptions) error {
	if err := s.restore(ctx, id, o); err != nil {
		return err
	}
	if o.FreshEntropy {
		return s.reseedSessions(ctx)
	}
	return nil
}

func (s *Sandbox) restore(ctx context.Context, id string, o RestoreOptions) error {
	r := s.rt
	c, err := r.lookup(id)
	if err != nil {
		return err
	}
	c.used.Store(time.Now().UnixNano()) // for CheckpointTTL
	if c.Image != s.img.info.Name {
		return fmt.Errorf("%w: checkpoint %s is of image %s, the sandbox of %s", ErrMismatch, id, c.Image, s.img.info.Name)
	}
	units, copies, err := s.restorePlan(ctx, c)
	if err != nil {
		return err
	}
	err = s.beginOp(true)
	defer s.op.Unlock()
	if err != nil {
		return err
	}
	start := time.Now()
	if copies || len(units) > 0 {
		defer s.boostCPU()()
	}
	switch {
	case len(units) > 0:
		// Kept for another checkpoint (one with CRIU trees gets none):
		// ended now, as they could hold pids the trees need back.
		if err := s.procs.EndAhead(); err != nil {
			s.rt.log.Warn("ending template copies forked ahead", "sandbox", s.id, "err", err)
		}
	case !copies:
		s.procs.DropAhead() // kept for a checkpoint restored before
	}
	if err := s.killFor(&c.Checkpoint); err != nil {
		return err
	}
	// A checkpoint restored twice in a row (no checkpoint in between) is
	// taken to be restored again: its next root is built ahead.
	again := id == s.lastRestore
	s.lastRestore = id
	if err := s.restoreRoot(c, again, len(units) == 0 && !copies, copies && len(units) == 0); err != nil {
		return err
	}
	// Template copies alone: /dev/shm once the killed are settled.
	deferShm := copies && len(units) == 0
	if !deferShm {
		if err := s.restoreShm(c, false, false); err != nil {
			return err
		}
	}
	if o.FreshEntropy {
		if err := s.writeSeed(newSeed()); err != nil {
			return err
		}
	}
	if deferShm {
		s.deferShm(c)
	}
	return s.restoreProcesses(ctx, c, units, copies, start, again)
}

// restorePlan says how the processes of c come back in this sandbox: as
// copies of its templates (copies), which serve only in their own sandbox
// and while alive, and from CRIU units (c's trees, and images of its
// templates where those do not serve, made now if need be and possible).
func (s *Sandbox) restorePlan(ctx context.Context, c *checkpoint) (units []procstate.Unit, copies bool, err error) {
	units, copies = c.Images, len(c.Procs) > 0
	if copies && (c.SandboxID != s.id || s.procs.Check(&c.Checkpoint) != nil) {
		imgs, err := s.rt.imagesForTemplates(ctx, c)
		if err != nil {
			return nil, false, err
		}
		units, copies = slices.Concat(c.Images, imgs), false
	}
	return units, copies, nil
}

// restoreProcesses brings back c's processes: its CRIU units first (they
// need the pids they had, which the template copies' new pids could take),
// then copies of its templates; copies that fail end everything, and the
// templates' images serve instead where c has them. Called with op held,
// the root restored.
func (s *Sandbox) restoreProcesses(ctx context.Context, c *checkpoint, units []procstate.Unit, copies bool, start time.Time, again bool) error {
	if len(units) > 0 || copies {
		s.shmMayChange()
	}
	if len(units) > 0 {
		if err := s.procs.RestoreTrees(ctx, &c.Checkpoint, units); err != nil {
			_ = s.killAll()
			return err
		}
	}
	if !copies {
		return nil
	}
	err := s.procs.SpawnCopies(&c.Checkpoint, start, again)
	if serr := s.shmDeferred(); err == nil && serr != nil {
		err = serr // the copies run on another /dev/shm: ended below
	}
	if err == nil {
		return nil
	}
	// The filesystem is the checkpoint's; end whatever copies started, so
	// the state is at least consistent.
	_ = s.killAll()
	// A template found dying (killed while frozen) is lost: its image, if
	// the checkpoint has one, serves instead.
	imgs := s.rt.tplImages(c)
	if len(imgs) == 0 {
		return err
	}
	s.waitKilled()
	if serr := s.restoreShm(c, true, true); serr != nil {
		return errors.Join(err, serr)
	}
	if ierr := s.procs.RestoreTrees(ctx, &c.Checkpoint, imgs); ierr != nil {
		_ = s.killAll()
		return errors.Join(err, ierr)
	}
	return nil
}
