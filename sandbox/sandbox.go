package sandbox

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"golang.org/x/sys/unix"

	"github.com/deltagym/deltagym/sandbox/cgroup"
	"github.com/deltagym/deltagym/sandbox/launch"
	"github.com/deltagym/deltagym/sandbox/layers"
	"github.com/deltagym/deltagym/sandbox/overlay"
)

// Sandbox is one live sandbox. Its methods are safe for concurrent use:
// Exec, ReadFile and WriteFile run side by side; Checkpoint, Restore and
// Destroy run alone, and Restore and Destroy first abort running execs.
type Sandbox struct {
	rt      *Runtime
	id      string
	spec    Spec
	img     *imageRec
	hostID  int
	netns   int
	init    *launch.Init
	cg      *cgroup.Cgroup
	work    *cgroup.Cgroup // every command, session and background process
	userns  int
	created time.Time

	// op serialises state changes (write lock) against commands and file
	// actions (read lock).
	op sync.RWMutex
	// Guarded by op (write), read under op (read).
	idmapped map[string]int // layer directory -> idmapped clone fd
	stack    []string       // delta layers under the upper, bottom first (refs held)
	upper    string         // live upper layer (ref held)
	upperFD  int            // idmapped clone of the upper's layer directory, or -1
	// upperAt is how the upper's directory looked when it became the
	// upper (keepRoot); ok is false if it could not be read.
	upperAt struct {
		st upperState
		ok bool
	}
	head string
	// spare is the next upper, prepared in the background after each root
	// switch so that the next checkpoint or restore need not make one.
	spare      chan spareUpper
	spareReady bool

	// root is the sandbox's root while it is not yet the root of the
	// init's mount namespace: a detached mount, or -1. A restore or a
	// checkpoint that leaves no process running does not swap the new
	// root in; file actions use it as it is, and the first command or
	// process to need the namespace swaps it in (materialize). A rollback
	// loop of restores and file actions never swaps. nsUpper is the upper
	// of the namespace's root meanwhile (stale, reachable by nothing).
	// Guarded by op (write), or by op (read) with rootMu; read under op
	// (read) with rootMu (read).
	rootMu  sync.RWMutex
	root    int
	nsUpper spareUpper
	// covered says whether root has its covers (overlay.Covers): they are
	// put on when a file action could reach their directories (coverRoot).
	// Set under coverMu; cleared with a new root, under op (write).
	coverMu sync.Mutex
	covered atomic.Bool

	// tpls holds the process templates of this sandbox's checkpoints, one
	// frozen cgroup per checkpoint (procs.go).
	tplMu sync.Mutex
	tpls  map[string]*cgroup.Cgroup
	// folded holds the checkpoints whose templates were handed to the
	// huge-page worker, on their first restore (hugepages.go).
	folded map[string]bool
	// tplRun is held while templates are copied (one ptrace tracer at a
	// time).
	tplRun sync.Mutex
	// ahead holds the copies forked ahead for the next restore of the
	// checkpoint restored last (ahead.go). Guarded by tplMu.
	ahead *aheadCopies
	// aheadEnding holds copies forked ahead being ended in the background
	// after a checkpoint's release (endAhead). Guarded by tplMu.
	aheadEnding []*aheadCopies
	// aheadFree is an empty, frozen group for the next copies forked ahead:
	// the group the last ones were taken from. Guarded by tplRun.
	aheadFree *cgroup.Cgroup
	// tplFreeze is the cgroup.freeze of the template group written last,
	// kept open (setTplFrozen). Guarded by tplRun.
	tplFreeze struct {
		of *cgroup.Cgroup
		k  *cgroup.Control
	}
	// forkMu is held while a copy is forked ahead, and while the root is
	// swapped: a task being cloned during a swap would keep the old root.
	forkMu  sync.Mutex
	spareTG chan spareGroup // the next template group, made ahead
	spareW  chan workGroup  // the next command group, made ahead (op)
	// reuseW holds a killed command group, empty, to serve again (retireWork).
	reuseW chan workGroup
	// wf holds control files of the command group kept open (op).
	wf workFiles
	// boost raises the group's CPU weight during a checkpoint or restore
	// with processes (boostCPU); nil without a cpu controller. Opened on
	// first use (op).
	boost      *cgroup.CPUBoost
	boostTried bool
	// lastRestore is the checkpoint the last restore restored (op).
	lastRestore string
	// restoredAt is when the last restore that brought back template
	// copies returned (op); aheadTook how long the last job forking copies
	// ahead took (ahead.go).
	restoredAt time.Time
	aheadTook  atomic.Int64
	// liveSeen holds the live processes checkpointed since the last
	// restore, and the copies it made: host pid -> start time (0 for a
	// copy, whose start time is not read). A process not in it is folded
	// into huge pages at its first checkpoint (hugepages.go). Guarded by
	// op.
	liveSeen map[int]uint64

	bg sync.WaitGroup // background retirements of killed command groups, spare groups
	// killed holds the command groups killAll ended whose processes may
	// still be exiting (at most maxKilled). Guarded by op.
	killed []*cgroup.Cgroup
	// killedSettled: the processes of killed are past harming the copies a
	// restore lets run (settleKilled), though not gone. Guarded by op.
	killedSettled bool
	// killPending: killed may still hold processes; the next command waits
	// for them (beginExec), unless a wait found them gone (waitKilled).
	killPending atomic.Bool
	// stragglers: killed processes were given up on (no longer in killed)
	// before they were seen gone; one could still write, and keepRoot no
	// longer keeps a root.
	stragglers atomic.Bool

	mu       sync.Mutex // guards the fields below
	gen      context.Context
	abort    context.CancelFunc
	sessions map[string]*session
	idle     []*execGroup // empty command cgroups, for reuse
	seq      int
	closed   bool
	done     chan struct{}
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
	s.op.RLock()
	defer s.op.RUnlock()
	return len(s.stack)
}

// Create starts a sandbox from an image or a checkpoint.
func (r *Runtime) Create(ctx context.Context, spec Spec) (_ *Sandbox, err error) {
	if err := spec.validate(); err != nil {
		return nil, err
	}
	src, err := r.createSource(ctx, spec)
	if err != nil {
		return nil, err
	}
	s := &Sandbox{
		rt: r, id: newID("sb-"), spec: spec, img: src.img, netns: -1, userns: -1, upperFD: -1, root: -1,
		reuseW:   make(chan workGroup, 1),
		idmapped: map[string]int{}, sessions: map[string]*session{}, done: make(chan struct{}),
		tpls:    map[string]*cgroup.Cgroup{},
		created: time.Now(),
	}
	s.gen, s.abort = context.WithCancel(context.Background())
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
	if err = s.startRoot(src.ck, &undo); err != nil {
		return nil, err
	}
	if src.ck != nil && !spec.FilesOnly {
		if err = s.startProcesses(ctx, src); err != nil {
			return nil, err
		}
	}
	if err = r.register(s); err != nil {
		return nil, err
	}
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
	tplUnits []criuUnit
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
	s.id, s.hostID, s.netns, s.cg, s.work, s.init, s.userns = w.id, w.hostID, w.netns, w.cg, w.work, w.init, w.userns
	w.userns = -1 // the sandbox's now: closeFDs closes it
	undo.add(func() error { w.free(r); return nil })
	l := s.spec.Limits
	lim := cgroup.Limits{MemoryBytes: l.MemoryBytes, Pids: l.Pids, CPUQuota: l.CPUs}
	if lim != (cgroup.Limits{}) {
		if err = s.cg.SetLimits(lim); err != nil {
			return fmt.Errorf("setting limits: %w", err)
		}
	}
	undo.add(s.closeFDs)
	return nil
}

// startRoot makes the sandbox's root: a fresh upper over checkpoint ck's
// layers (none for an image), with a fresh seed if the spec asks.
func (s *Sandbox) startRoot(ck *checkpoint, undo *undoList) error {
	r := s.rt
	var stack []string
	if ck != nil {
		stack = r.shorten(ck.Layers)
		s.head = ck.ID
	}
	if err := refAll(r, stack); err != nil {
		return fmt.Errorf("%w: checkpoint %s was released", ErrNotFound, s.spec.Checkpoint)
	}
	s.stack = slices.Clone(stack)
	undo.add(func() error { s.unrefStack(); return nil })
	if err := s.switchRoot(stack, false, false); err != nil {
		return err
	}
	undo.add(func() error { s.dropSpare(); s.releaseUpper(); return nil })
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
	return s.restoreTrees(ctx, src.ck, units)
}

// register records the sandbox and makes it the runtime's, unless the
// runtime is shutting down.
func (r *Runtime) register(s *Sandbox) error {
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
	return nil
}

func (sp Spec) validate() error {
	if sp.Image == "" && sp.Checkpoint == "" {
		return fmt.Errorf("%w: a sandbox needs an image or a checkpoint", ErrInvalid)
	}
	l := sp.Limits
	if l.MemoryBytes < 0 || l.Pids < 0 || l.CPUs < 0 || l.DiskBytes < 0 {
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

// lowerFD returns the idmapped clone of a layer directory for this sandbox.
func (s *Sandbox) lowerFD(dir string) (int, error) {
	if fd, ok := s.idmapped[dir]; ok {
		return fd, nil
	}
	fd, err := overlay.IDMapped(dir, s.userns, true)
	if err != nil {
		return -1, err
	}
	s.idmapped[dir] = fd
	return fd, nil
}

// switchRoot makes a fresh upper over stack (delta layers, bottom first) the
// sandbox's root. Unless pending is set, it becomes the root of the init's
// mount namespace now; with pending set (the caller knows that no process
// runs) it waits for materialize. On success the sandbox's old upper (if
// any) is released and the new one is s.upper; stack references are the
// caller's business.
//
// With again set (a restore of the checkpoint restored last), the root of
// the next restore is built ahead over the same stack, on the upper this
// switch retires (retire).
func (s *Sandbox) switchRoot(stack []string, pending, again bool) error {
	sp, err := s.takeSpareFor(stack)
	if err != nil {
		return err
	}
	mfd := sp.root
	if !sp.built {
		mfd, err = s.buildRoot(stack, sp.fd)
	}
	// How the new upper looks (keepRoot), read while no process can reach
	// it: the root is still a detached mount.
	var upperAt upperState
	var upperErr error
	if err == nil {
		upperAt, upperErr = readUpperState(s.rt.layers.UpperPath(sp.id))
	}
	if err == nil && !pending {
		if err = s.swap(mfd); err != nil {
			unix.Close(mfd)
			// The swap may have changed the namespace half-way.
			s.upperAt.ok = false
		}
	}
	if err != nil {
		unix.Close(sp.fd)
		s.rt.layers.Unref(sp.id)
		return fmt.Errorf("switching root: %w", err)
	}
	var next *nextRoot
	if again {
		next, _ = s.planRoot(stack) // nil: the next restore builds its own
	}
	// old becomes the upper of the namespace's root.
	old := spareUpper{id: s.upper, fd: s.upperFD}
	s.upper, s.upperFD = sp.id, sp.fd
	s.upperAt.st, s.upperAt.ok = upperAt, upperErr == nil
	if s.root >= 0 {
		// A root that was pending goes with its fd, its upper follows;
		// the namespace's root is still nsUpper's. Nothing but file
		// actions, all done (op is held), ever used it: once the fd is
		// closed, no overlay holds the upper.
		s.retireUnused(old, s.closeRoot(), next)
		old, s.nsUpper = s.nsUpper, spareUpper{}
		next = nil
	}
	if pending {
		s.root, s.nsUpper = mfd, old
		s.covered.Store(false)
		return nil
	}
	unix.Close(mfd) // it is attached: the namespace holds it
	s.retire(old, s.init.OldRootGone(), next)
	return nil
}

// nextRoot is what building a root ahead needs: the stack and the fds of
// its lower directories (from the sandbox's cache, valid until Destroy,
// which waits for the spare first).
type nextRoot struct {
	stack  []string
	lowers []int
}

// planRoot gathers what a root over stack needs. Called with op held.
func (s *Sandbox) planRoot(stack []string) (*nextRoot, error) {
	dirs := s.lowerDirs(stack)
	n := &nextRoot{stack: slices.Clone(stack), lowers: make([]int, len(dirs))}
	for i, d := range dirs {
		fd, err := s.lowerFD(d)
		if err != nil {
			return nil, err
		}
		n.lowers[i] = fd
	}
	return n, nil
}

// mount makes the overlay of n with upper ufd (layers.UpperDir and WorkDir
// in it), as the sandbox's host root.
func (n *nextRoot) mount(hostID, ufd int) (int, error) {
	return overlay.Mount(overlay.Spec{Lowers: n.lowers, UpperFD: ufd, UpperDir: layers.UpperDir, WorkDir: layers.WorkDir, MounterID: hostID})
}

// closeRoot drops the pending root. It returns a channel closed once the
// mount is gone: closing the last fd of a detached mount unmounts it, and
// waits for an RCU grace period, on its own thread.
func (s *Sandbox) closeRoot() <-chan struct{} {
	fd := s.root
	s.root = -1
	gone := make(chan struct{})
	go func() {
		unix.Close(fd)
		close(gone)
	}()
	return gone
}

// retire releases old, the upper of a root that goes away once gone is
// closed: an upper that was not sealed (a restore's, not a checkpoint's)
// becomes the next spare once emptied (no new tmpfs, no discard), unless a
// spare is already there; with next, the next root is built on it. Called
// with op held (write), or (read) with rootMu.
func (s *Sandbox) retire(old spareUpper, gone <-chan struct{}, next *nextRoot) {
	s.retireAs(old, gone, next, true)
}

// retireUnused is retire for the upper of a root no process ever had: once
// gone is closed, no overlay holds it, and its reset skips the check
// (layers.Store.ResetUnused).
func (s *Sandbox) retireUnused(old spareUpper, gone <-chan struct{}, next *nextRoot) {
	s.retireAs(old, gone, next, false)
}

func (s *Sandbox) retireAs(old spareUpper, gone <-chan struct{}, next *nextRoot, check bool) {
	// A new sandbox gets its spare at its first checkpoint or restore, not
	// now: a fork fan-out would make one per child, competing for the CPU
	// with the fan-out, for children that may never switch again.
	if old.id == "" {
		return
	}
	if s.spareReady {
		unix.Close(old.fd)
		s.rt.layers.Unref(old.id)
		return
	}
	if s.rt.layers.Reclaim(old.id) {
		s.prepareSpareFrom(old, gone, next, check)
		return
	}
	unix.Close(old.fd)
	s.prepareSpare()
}

// materialize makes a pending root (s.root) the root of the init's mount
// namespace, before anything runs in the sandbox. Called with op held.
func (s *Sandbox) materialize() error {
	s.rootMu.Lock()
	defer s.rootMu.Unlock()
	if s.root < 0 {
		return nil
	}
	if err := s.swap(s.root); err != nil {
		return fmt.Errorf("switching root: %w", err)
	}
	unix.Close(s.root) // attached: the namespace holds it
	s.root = -1
	old := s.nsUpper
	s.nsUpper = spareUpper{}
	s.retire(old, s.init.OldRootGone(), nil)
	return nil
}

// swap makes root the root of the init's mount namespace (launch.Init.Swap),
// while no copy is being forked ahead (ahead.go).
func (s *Sandbox) swap(root int) error {
	s.forkMu.Lock()
	defer s.forkMu.Unlock()
	return s.init.Swap(root)
}

// withRoot calls fn with an fd of the sandbox's root: the pending one, with
// its covers, or the init's. Called with op held.
func (s *Sandbox) withRoot(fn func(root int) error) error {
	return s.withRootFor("", fn)
}

// withRootFor is withRoot for a file action on rel (relative to the root):
// a pending root gets its covers only if rel could reach their directories.
// An empty rel always covers.
func (s *Sandbox) withRootFor(rel string, fn func(root int) error) error {
	s.rootMu.RLock()
	defer s.rootMu.RUnlock()
	if s.root >= 0 {
		if !s.covered.Load() && (rel == "" || s.rt.covers.Needed(s.root, rel)) {
			if err := s.coverRoot(); err != nil {
				return err
			}
		}
		return fn(s.root)
	}
	root, err := unix.Open("/proc/"+strconv.Itoa(s.init.Pid)+"/root", unix.O_PATH|unix.O_DIRECTORY|unix.O_CLOEXEC, 0)
	if err != nil {
		return fmt.Errorf("%w: the sandbox's init went away", ErrClosed)
	}
	defer unix.Close(root)
	return fn(root)
}

// coverRoot puts the covers on the pending root, once. Called with rootMu
// held (read or write).
func (s *Sandbox) coverRoot() error {
	s.coverMu.Lock()
	defer s.coverMu.Unlock()
	if s.covered.Load() {
		return nil
	}
	if err := s.rt.covers.Apply(s.root); err != nil {
		return err
	}
	s.covered.Store(true)
	return nil
}

// releaseUpper drops the live upper and its idmapped clone, and a pending
// root with the namespace's.
func (s *Sandbox) releaseUpper() {
	if s.root >= 0 {
		<-s.closeRoot()
	}
	if s.nsUpper.id != "" {
		unix.Close(s.nsUpper.fd)
		s.rt.layers.Unref(s.nsUpper.id)
		s.nsUpper = spareUpper{}
	}
	if s.upperFD >= 0 {
		unix.Close(s.upperFD)
		s.upperFD = -1
	}
	if s.upper != "" {
		s.rt.layers.Unref(s.upper)
		s.upper = ""
	}
	s.upperAt.ok = false
}

// spareUpper is an empty upper with its idmapped clone for this sandbox.
type spareUpper struct {
	id  string
	fd  int
	err error
	// built: root is an overlay made ahead on this upper over stack
	// (nextRoot), without covers.
	built bool
	root  int
	stack []string
}

func (s *Sandbox) newSpare() spareUpper {
	id, err := s.rt.layers.NewUpper(s.diskBytes())
	if err != nil {
		return spareUpper{err: err}
	}
	fd, err := overlay.IDMapped(s.rt.layers.Dir(id), s.userns, false)
	if err != nil {
		s.rt.layers.Unref(id)
		return spareUpper{err: err}
	}
	return spareUpper{id: id, fd: fd}
}

// prepareSpare starts making the next upper. Called with op held.
func (s *Sandbox) prepareSpare() {
	s.spare = make(chan spareUpper, 1)
	s.spareReady = true
	ch := s.spare
	go func() { ch <- s.newSpare() }()
}

// prepareSpareFrom makes a reclaimed upper (layers.Store.Reclaim) the next
// spare, emptied in the background once the root it was the upper of is
// detached (gone); with next, the next root is built on it there too: the
// overlay's creation (150 µs of CPU, most of it the kernel's probes of the
// upper and work directories) then leaves the next restore's path, when it
// restores the same checkpoint again. Called with op held.
func (s *Sandbox) prepareSpareFrom(old spareUpper, gone <-chan struct{}, next *nextRoot, check bool) {
	s.spare = make(chan spareUpper, 1)
	s.spareReady = true
	ch := s.spare
	go func() {
		if gone != nil {
			<-gone
		}
		reset := s.rt.layers.Reset
		if !check {
			reset = s.rt.layers.ResetUnused
		}
		if err := reset(old.id); err != nil {
			// Its old overlay lives on (templates hold their roots): a
			// new upper instead, as without reuse.
			unix.Close(old.fd)
			s.rt.layers.Unref(old.id)
			ch <- s.newSpare()
			return
		}
		if next != nil {
			if mfd, err := next.mount(s.hostID, old.fd); err == nil {
				old.built, old.root, old.stack = true, mfd, next.stack
			}
		}
		ch <- old
	}()
}

// takeSpare returns the prepared upper, or makes one. Called with op held.
func (s *Sandbox) takeSpare() (spareUpper, error) { return s.takeSpareFor(nil) }

// takeSpareFor is takeSpare for a root over stack: the spare comes with the
// root built ahead if it was built over stack. A root built over another
// stack is dropped, and its upper with it (reusable only once the overlay
// is gone); a new upper serves instead.
func (s *Sandbox) takeSpareFor(stack []string) (spareUpper, error) {
	var sp spareUpper
	if s.spareReady {
		sp = <-s.spare
		s.spareReady = false
	} else {
		sp = s.newSpare()
	}
	if sp.built && (stack == nil || !slices.Equal(sp.stack, stack)) {
		s.dropBuilt(sp)
		sp = s.newSpare()
	}
	return sp, sp.err
}

// dropBuilt releases a spare with a root built ahead, in the background.
func (s *Sandbox) dropBuilt(sp spareUpper) {
	s.bg.Add(1)
	go func() {
		defer s.bg.Done()
		unix.Close(sp.root) // unmounts it, after a grace period
		unix.Close(sp.fd)
		s.rt.layers.Unref(sp.id)
	}()
}

// dropSpare releases a prepared upper. Called with op held.
func (s *Sandbox) dropSpare() {
	if !s.spareReady {
		return
	}
	sp := <-s.spare
	s.spareReady = false
	if sp.built {
		unix.Close(sp.root)
	}
	if sp.err == nil {
		unix.Close(sp.fd)
		s.rt.layers.Unref(sp.id)
	}
}

// lowerDirs returns the lower directories of an overlay over stack (delta
// layers, bottom first), top first: the deltas, the image's layers, the
// skeleton if the image needs it.
func (s *Sandbox) lowerDirs(stack []string) []string {
	dirs := make([]string, 0, len(stack)+len(s.img.layers)+1)
	for i := len(stack) - 1; i >= 0; i-- {
		dirs = append(dirs, s.rt.layers.Path(stack[i]))
	}
	for i := len(s.img.layers) - 1; i >= 0; i-- {
		dirs = append(dirs, s.img.layers[i])
	}
	if !s.img.skel {
		return dirs
	}
	return append(dirs, s.rt.skel)
}

func (s *Sandbox) buildRoot(stack []string, ufd int) (int, error) {
	n, err := s.planRoot(stack)
	if err != nil {
		return -1, err
	}
	return n.mount(s.hostID, ufd)
}

// maxStack bounds the lowers of a sandbox's overlay, below the kernel's 500.
const maxStack = overlay.MaxLowers - 20

// refAll takes a reference on every layer of stack, or none.
func refAll(r *Runtime, stack []string) error {
	for i, l := range stack {
		if err := r.layers.Ref(l); err != nil {
			unrefAll(r, stack[:i])
			return err
		}
	}
	return nil
}

func unrefAll(r *Runtime, stack []string) {
	for _, l := range stack {
		r.layers.Unref(l)
	}
}

func (s *Sandbox) unrefStack() {
	for _, l := range s.stack {
		s.rt.layers.Unref(l)
	}
	s.stack = nil
}

func (s *Sandbox) closeFDs() error {
	s.closeWorkFiles()
	s.tplRun.Lock()
	closeControls(s.tplFreeze.k)
	s.tplFreeze.of, s.tplFreeze.k = nil, nil
	s.tplRun.Unlock()
	if s.boost != nil {
		s.boost.Close()
		s.boost = nil
	}
	for k, fd := range s.idmapped {
		unix.Close(fd)
		delete(s.idmapped, k)
	}
	if s.userns >= 0 {
		unix.Close(s.userns)
		s.userns = -1
	}
	return nil
}

// beginOp aborts running execs when abort is set, then takes the write
// lock. It fails if the sandbox is closed.
func (s *Sandbox) beginOp(abort bool) error {
	if abort {
		s.mu.Lock()
		s.abort()
		s.mu.Unlock()
	}
	s.op.Lock()
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.closed {
		s.op.Unlock()
		return fmt.Errorf("%w: sandbox %s", ErrClosed, s.id)
	}
	if abort {
		s.gen, s.abort = context.WithCancel(context.Background())
	}
	return nil
}

// Destroy ends every process of the sandbox and frees what it holds; its
// checkpoints stay. Running execs return ErrAborted. Destroy is idempotent.
func (s *Sandbox) Destroy(ctx context.Context) error {
	if err := s.beginOp(true); err != nil {
		if errors.Is(err, ErrClosed) {
			return nil
		}
		return err
	}
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
	s.closed = true
	s.abort()
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
	s.tplMu.Lock()
	for id, tg := range s.tpls {
		errs = append(errs, tg.Delete())
		delete(s.tpls, id)
	}
	s.tplMu.Unlock()
	errs = append(errs, s.endAheadNow())
	errs = append(errs, s.init.Stop())
	s.dropExecGroups()
	s.bg.Wait()                        // removals of killed command groups
	errs = append(errs, s.cg.Delete()) // templates too
	s.tplMu.Lock()
	clear(s.tpls)
	s.tplMu.Unlock()
	s.dropSpare()
	s.dropSpareWork()
	s.closeFDs()
	s.rt.net.Put(s.netns) // the init is gone: nothing of the sandbox is left in it
	s.unrefStack()
	s.releaseUpper()
	s.rt.putRange(s.hostID)
	s.rt.mu.Lock()
	delete(s.rt.sandboxes, s.id)
	s.rt.mu.Unlock()
	_ = os.Remove(filepath.Join(s.rt.store, "meta", "sandboxes", s.id))
	close(s.done)
	return errors.Join(errs...)
}

// Freeze stops every process of the sandbox (the init included) until Thaw.
func (s *Sandbox) Freeze() error {
	if err := s.beginOp(false); err != nil {
		return err
	}
	defer s.op.Unlock()
	// A job forking copies ahead stops for nothing but the sandbox's own
	// freezer: frozen mid-fork, it would hold the templates until Thaw.
	s.waitAhead()
	if err := s.cg.Freeze(); err != nil {
		return fmt.Errorf("freezing sandbox %s: %w", s.id, err)
	}
	return nil
}

// Thaw resumes a frozen sandbox.
func (s *Sandbox) Thaw() error {
	if err := s.beginOp(false); err != nil {
		return err
	}
	defer s.op.Unlock()
	if err := s.cg.Thaw(); err != nil {
		return fmt.Errorf("thawing sandbox %s: %w", s.id, err)
	}
	return nil
}

// killAll ends every process of the sandbox but the init, sessions included.
// The command group is killed without waiting and replaced by another
// (takeWorkGroup): its processes die in the background while the caller
// goes on (they can run no code of their own; what a dying process's last
// system call writes lands in the upper being discarded). A background job
// offers the old group for use again once it is empty, or removes it
// (retireWork).
func (s *Sandbox) killAll() error {
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
	// The group is retired with its idle exec groups and kept files.
	old := workGroup{cg: s.work, wf: *s.workFilesNow(), idle: s.takeExecGroups()}
	s.wf = workFiles{}
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
	s.liveSeen = nil
	w := s.takeWorkGroup()
	if w.err != nil {
		old.close()
		return fmt.Errorf("creating cgroup: %w", w.err)
	}
	s.work, s.wf = w.cg, w.wf
	s.mu.Lock()
	s.idle = w.idle
	s.mu.Unlock()
	if !s.killPending.Load() {
		s.killed = s.killed[:0] // waited for since (beginExec)
	}
	if len(s.killed) >= maxKilled {
		// Restores in a row whose killed processes outlive them: the
		// oldest must be gone by now, or nearly.
		s.waitKilled()
		if len(s.killed) >= maxKilled {
			s.killed = s.killed[1:]
			s.stragglers.Store(true) // no longer waited for (keepRoot)
		}
	}
	s.killed = append(s.killed, old.cg)
	s.killedSettled = false
	s.killPending.Store(true)
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

// Command groups are used again. Each restore with processes kills the
// command group and needs a new one at once, for the copies: a new group
// is a mkdir in the tracking hierarchy (made ahead, takeWorkGroup) and the
// killed one an rmdir, with its exec groups (one more of each once the
// restored sandbox runs a command). Together that was about 110 µs of CPU
// per restore, on a machine that back-to-back restores keep busy. So once
// the killed group's processes are gone, retireWork offers it, with its idle
// exec groups and its kept files, to a later restore instead (reuseW, one
// at a time: one offered while another waits there is removed). The one
// waiting stays until a restore takes it or the sandbox is destroyed.
//
// A group is used again only if it is empty, not frozen (a checkpoint
// freezes the command group; a thaw that failed would leave it so), and
// has no sub-group but its idle exec groups (a session's group, a CRIU
// tree's, a background command's all make it removed instead), and the
// restore that takes it forgets it among the killed groups it waits for.
// Restoring an 8 MB python3 back to back, in alternating blocks of 10
// restores with and without reuse in one run, reuse took 0.94–0.98 of the
// p50 (five runs).

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
		select {
		case s.reuseW <- g:
			return
		default: // one is waiting already
		}
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
// next: a mkdir in the tracking hierarchy, 35 µs of CPU and more of waiting,
// and two opens of 8.5 µs each, that a restore with processes would pay
// otherwise. (Made at the end of a restore
// instead, the next one would wait for it: 1.09–1.15 against 0.98–1.02 ms
// p50 for an 8 MB template restore.) Called with op held.
func (s *Sandbox) takeWorkGroup() workGroup {
	select {
	case g := <-s.reuseW:
		// Its processes are gone: none to wait for.
		s.killed = slices.DeleteFunc(s.killed, func(k *cgroup.Cgroup) bool { return k == g.cg })
		return g
	default:
	}
	var g workGroup
	if ch := s.spareW; ch != nil {
		g = <-ch
	}
	if g.cg == nil {
		if g.cg, g.err = s.cg.Sub(s.groupName("w")); g.err != nil {
			s.spareW = nil
			return g
		}
		g.wf.of = g.cg
	}
	next := make(chan workGroup, 1)
	s.spareW = next
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
	if ch := s.spareW; ch != nil {
		(<-ch).close()
		s.spareW = nil
	}
	select {
	case g := <-s.reuseW:
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

// workFilesNow returns the kept files of the current command group. Called
// with op held.
func (s *Sandbox) workFilesNow() *workFiles {
	if s.wf.of != s.work {
		s.closeWorkFiles()
		s.wf.of = s.work
	}
	return &s.wf
}

// closeWorkFiles closes the kept files of the command group. Called with op
// held.
func (s *Sandbox) closeWorkFiles() {
	s.wf.close()
	s.wf = workFiles{}
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

func (w workFiles) close() {
	if w.ev != nil {
		w.ev.Close()
	}
	if w.pids != nil {
		w.pids.Close()
	}
	closeControls(w.procs, w.kill)
}

// hasProcesses reports whether anything but the init runs in the sandbox.
func (s *Sandbox) hasProcesses() (bool, error) {
	w := s.workFilesNow()
	if !w.evTried {
		// nil on cgroup v1, or if it cannot be opened: read the group's
		// files each time then.
		w.ev, _ = s.work.OpenEvents()
		w.evTried = true
	}
	if w.ev == nil {
		return s.work.Populated()
	}
	return w.ev.Populated()
}

// workPidsNow lists the processes of the command group. Called with op
// held.
func (s *Sandbox) workPidsNow() ([]int, error) {
	w := s.workFilesNow()
	if w.pids == nil {
		l, err := s.work.OpenPids()
		if err != nil {
			return nil, err
		}
		w.pids = l
	}
	return w.pids.Pids()
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
	if err := s.beginOp(false); err != nil {
		return CheckpointInfo{}, err
	}
	defer s.op.Unlock()
	// A restore after this one is not the same as the last restore
	// again: a loop of restore, steps and checkpoint would have its
	// checkpoints drop the roots built ahead (switchRoot).
	s.lastRestore = ""
	r := s.rt
	if b := r.cfg.CheckpointBudgetBytes; b > 0 {
		if need := r.CheckpointBytes() + r.layers.Used(s.upper); need > b {
			return CheckpointInfo{}, fmt.Errorf("%w: checkpoint storage budget of %d bytes (layers and process images) would be exceeded (%d needed); release checkpoints", ErrBudget, b, need)
		}
	}
	c := &checkpoint{ID: newID("ck-"), Parent: s.head, Image: s.img.info.Name, SandboxID: s.id, Created: time.Now()}
	if err := s.capture(ctx, c, mode); err != nil {
		// A step after the files were copied failed (a template's fork,
		// say): the copy's references go (none were taken otherwise).
		unrefAll(r, c.Layers)
		return CheckpointInfo{}, err
	}
	if err := r.addCheckpoint(c); err != nil {
		unrefAll(r, c.Layers)
		s.dropTemplates(c.ID)
		if len(c.Images) > 0 {
			_ = os.RemoveAll(r.criuDir(c.ID))
		}
		return CheckpointInfo{}, err
	}
	s.head = c.ID
	r.maybeFlatten(c)
	// Under the runtime's lock, as other readers: once added, the
	// checkpoint's layers and images (TplImages) change under it.
	r.mu.Lock()
	info := c.info()
	r.mu.Unlock()
	if o.Durable && len(c.Procs) > 0 && r.startImaging() {
		go func() {
			defer r.imaging.Done()
			if _, err := r.imagesForTemplates(context.Background(), c); err != nil && r.ckptLive(c) {
				r.log.Warn("saving a durable checkpoint's processes", "checkpoint", c.ID, "err", err)
			}
		}()
	}
	return info, nil
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
	switch {
	case !live:
		err = s.sealAndSwap(c)
		if errors.Is(err, unix.EBUSY) {
			err = s.copyUpper(c)
		}
	case mode == ProcessesTemplate, mode == ProcessesCRIU:
		// As for a restore (boostCPU): each process must get a CPU to
		// stop, to clone itself, and (CRIU) to run the parasite.
		unboost := s.boostCPU()
		// Its clones count against the pids and memory limits, which the
		// processes a restore just killed may still count in.
		s.waitKilled()
		err = s.captureProcesses(ctx, c, mode, func() error { return s.copyUpperFrozen(c) })
		unboost()
		if err != nil && !errors.Is(err, ErrProcesses) {
			err = fmt.Errorf("capturing processes: %w", err)
		}
	default:
		err = s.copyUpper(c)
	}
	return err
}

// sealAndSwap is the fast path: the upper itself becomes the checkpoint's
// top layer, under a fresh upper.
func (s *Sandbox) sealAndSwap(c *checkpoint) error {
	r := s.rt
	if err := s.linkUp(); err != nil {
		return err
	}
	size, err := r.layers.Seal(s.upper)
	if err != nil {
		return err
	}
	old := s.upper
	stack := r.shorten(append(slices.Clone(s.stack), old))
	if len(stack)+len(s.img.layers)+1 > maxStack {
		// The background flattener fell behind: merge now rather than
		// hit the kernel's limit.
		f, err := r.layers.Flatten(stack, 0, r.imageLowers(s.img.info.Name))
		if err != nil {
			_ = r.layers.Unseal(old)
			return err
		}
		defer r.layers.Unref(f) // the stack's reference is taken below
		stack = []string{f}
	}
	// The new stack's references (switchRoot drops the upper's, and the
	// old stack's are dropped below).
	if err := refAll(r, stack); err != nil {
		return err
	}
	// No process runs (the caller checked): the new root waits.
	if err := s.switchRoot(stack, true, false); err != nil {
		unrefAll(r, stack)
		if uerr := r.layers.Unseal(old); uerr != nil {
			return errors.Join(err, uerr)
		}
		return err
	}
	s.unrefStack()
	s.stack = stack
	_ = refAll(r, stack) // the checkpoint's references; all exist
	c.Layers = slices.Clone(stack)
	c.Size = size
	return nil
}

// linkUp puts into the upper the other names of every hard-linked lower
// file the overlay copied up (overlay.Links), so that the layer the upper
// becomes keeps the file's link group. Nothing runs in the sandbox.
func (s *Sandbox) linkUp() error {
	index := filepath.Join(s.rt.layers.Dir(s.upper), layers.WorkDir, "index")
	if overlay.IndexEmpty(index) {
		return nil
	}
	return s.withRoot(func(root int) error {
		if _, err := s.rt.links.Materialize(root, index, s.lowerDirs(s.stack)); err != nil {
			return fmt.Errorf("keeping hard links whole: %w", err)
		}
		return nil
	})
}

// copyUpper is the path for a sandbox with live processes: freeze, seal a
// copy of the upper, thaw.
func (s *Sandbox) copyUpper(c *checkpoint) error {
	if err := s.work.Freeze(); err != nil {
		return fmt.Errorf("freezing sandbox: %w", err)
	}
	err := s.copyUpperFrozen(c)
	if terr := s.work.Thaw(); terr != nil {
		err = errors.Join(err, fmt.Errorf("thawing sandbox: %w", terr))
	}
	return err
}

// copyUpperFrozen seals a copy of the upper; the sandbox's commands are
// frozen.
func (s *Sandbox) copyUpperFrozen(c *checkpoint) error {
	r := s.rt
	// The spare upper (an empty tmpfs, made in the background) receives
	// the copy; another is prepared for the next root switch.
	sp, err := s.takeSpare()
	if err != nil {
		return err
	}
	unix.Close(sp.fd)
	id := sp.id
	err = s.linkUp()
	var size int64
	if err == nil {
		size, err = r.layers.CopyInto(s.upper, id)
	}
	s.prepareSpare()
	if err != nil {
		r.layers.Unref(id)
		return err
	}
	for _, l := range s.stack {
		_ = r.layers.Ref(l)
	}
	c.Layers = append(slices.Clone(s.stack), id)
	c.Size = size
	return nil
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
	if c.Image != s.img.info.Name {
		return fmt.Errorf("%w: checkpoint %s is of image %s, the sandbox of %s", ErrMismatch, id, c.Image, s.img.info.Name)
	}
	units, copies, err := s.restorePlan(ctx, c)
	if err != nil {
		return err
	}
	if err := s.beginOp(true); err != nil {
		return err
	}
	defer s.op.Unlock()
	start := time.Now()
	if copies || len(units) > 0 {
		defer s.boostCPU()()
	}
	switch {
	case len(units) > 0:
		// Kept for another checkpoint (one with CRIU trees gets none):
		// ended now, as they could hold pids the trees need back.
		if err := s.endAheadNow(); err != nil {
			s.rt.log.Warn("ending template copies forked ahead", "sandbox", s.id, "err", err)
		}
	case !copies:
		s.dropAhead("", true) // kept for a checkpoint restored before
	}
	if err := s.killAll(); err != nil {
		return err
	}
	// A checkpoint restored twice in a row (no checkpoint in between) is
	// taken to be restored again: its next root is built ahead.
	again := id == s.lastRestore
	s.lastRestore = id
	if err := s.restoreRoot(c, again, len(units) == 0 && !copies, copies && len(units) == 0); err != nil {
		return err
	}
	if o.FreshEntropy {
		if err := s.writeSeed(newSeed()); err != nil {
			return err
		}
	}
	return s.restoreProcesses(ctx, c, units, copies, start, again)
}

// restorePlan says how the processes of c come back in this sandbox: as
// copies of its templates (copies), which serve only in their own sandbox
// and while alive, and from CRIU units (c's trees, and images of its
// templates where those do not serve, made now if need be and possible).
func (s *Sandbox) restorePlan(ctx context.Context, c *checkpoint) (units []criuUnit, copies bool, err error) {
	units, copies = c.Images, len(c.Procs) > 0
	if copies && (c.SandboxID != s.id || s.checkTemplates(c) != nil) {
		imgs, err := s.rt.imagesForTemplates(ctx, c)
		if err != nil {
			return nil, false, err
		}
		units, copies = slices.Concat(c.Images, imgs), false
	}
	return units, copies, nil
}

// restoreRoot puts checkpoint c's files in the sandbox's root: a new root
// over its layers, or the root as it is when it holds them already
// (keepRoot, tried only when mayKeep: copies alone come back). With
// pending (no process to bring back), nothing runs until the next
// command, which swaps the root in then. Called with op held, after
// killAll.
func (s *Sandbox) restoreRoot(c *checkpoint, again, pending, mayKeep bool) error {
	r := s.rt
	stack := slices.Clone(r.shorten(c.Layers))
	if again {
		r.maybeFlattenHot(c)
	}
	if !mayKeep || !s.keepRoot(stack) {
		if err := refAll(r, stack); err != nil {
			return fmt.Errorf("%w: checkpoint %s was released", ErrNotFound, c.ID)
		}
		if err := s.switchRoot(stack, pending, again); err != nil {
			unrefAll(r, stack)
			return err
		}
		s.unrefStack()
		s.stack = stack
	}
	s.head = c.ID
	return nil
}

// restoreProcesses brings back c's processes: its CRIU units first (they
// need the pids they had, which the template copies' new pids could take),
// then copies of its templates; copies that fail end everything, and the
// templates' images serve instead where c has them. Called with op held,
// the root restored.
func (s *Sandbox) restoreProcesses(ctx context.Context, c *checkpoint, units []criuUnit, copies bool, start time.Time, again bool) error {
	if len(units) > 0 {
		if err := s.restoreTrees(ctx, c, units); err != nil {
			_ = s.killAll()
			return err
		}
	}
	if !copies {
		return nil
	}
	err := s.spawnCopies(c, start, again)
	if err == nil {
		// Once the copies are detached and the templates frozen again:
		// what comes before the next restore is the agent's.
		s.restoredAt = time.Now()
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
	if ierr := s.restoreTrees(ctx, c, imgs); ierr != nil {
		_ = s.killAll()
		return errors.Join(err, ierr)
	}
	return nil
}

// Keeping the root. A restore with processes swaps in a new root over the
// checkpoint's layers with an empty upper. When the root it would replace is
// over the same layers and its upper is still empty, the two hold the same
// files, and the restore keeps the root instead: no overlay mounted, no
// swap by the init, no old root detached, and none of the expedited RCU
// grace period its teardown costs (the overlay's private layer mounts).
// That is the case of a checkpoint restored again before anything wrote a
// file: a rollback loop whose agent's steps only read, a tree search that
// tries one move from a node after another, a process that keeps its state
// in memory. Restoring an 8 MB python3 back to back, in alternating blocks
// of 10 in one run, it took the p50 from 1.17–1.37 to 0.83–0.93 ms (0.68–0.71
// of it, four runs). The upper counts as empty only if its directory has no
// entry (no file, directory, whiteout or copied-up ancestor) and looks as it
// did when it became the upper: mode, owner, times, size, link count and
// extended attributes, so that a chmod, touch or setxattr of / itself, or a
// directory made and removed again, is seen too. It is read once the
// processes the restore killed are gone: a dying process's last system call
// could still write. So a restore also swaps when the killed processes
// are not gone or exiting within keepWait, after a restore with fresh
// entropy (its seed file is in the upper), when a template has a file open
// for writing (its copy reopens it, which copies it up), and for good once
// a killed process was given up on before it was seen gone.

// upperState is what an upper's directory looks like: a change to the root
// directory's own attributes shows in it, and so does any entry made in it
// (a tmpfs directory's size and link count count them).
type upperState struct {
	attributes   uint64 // chattr's flags
	mode         uint16
	uid, gid     uint32
	nlink        uint32
	size         uint64
	mtime, ctime unix.StatxTimestamp
	xattrs       string // names and values
}

// readUpperState reads the state of upper directory dir.
func readUpperState(dir string) (upperState, error) {
	var st unix.Statx_t
	if err := unix.Statx(unix.AT_FDCWD, dir, unix.AT_SYMLINK_NOFOLLOW, unix.STATX_BASIC_STATS, &st); err != nil {
		return upperState{}, err
	}
	u := upperState{attributes: st.Attributes, mode: st.Mode, uid: st.Uid, gid: st.Gid, nlink: st.Nlink, size: st.Size, mtime: st.Mtime, ctime: st.Ctime}
	var names [4096]byte
	n, err := unix.Llistxattr(dir, names[:])
	if err != nil {
		return upperState{}, err
	}
	var b strings.Builder
	for name := range strings.SplitSeq(string(names[:n]), "\x00") {
		if name == "" {
			continue
		}
		var v [4096]byte
		m, err := unix.Lgetxattr(dir, name, v[:])
		if err != nil {
			return upperState{}, err
		}
		b.WriteString(name + "=" + string(v[:m]) + "\x00")
	}
	u.xattrs = b.String()
	return u, nil
}

// keepRoot reports whether the sandbox's root already holds the files of a
// checkpoint over stack, so that a restore with processes keeps it: it is
// the namespace's root (not pending), over stack, and its upper is as it
// was when it became the upper, with no entry. The upper is read again
// once every process killAll ended is gone or in its exit (it makes no
// system call again), which it waits up to keepWait for; and never while
// killed processes that were given up on may still run (stragglers).
// Called with op held, after killAll.
func (s *Sandbox) keepRoot(stack []string) bool {
	if s.root >= 0 || !s.upperAt.ok || s.stragglers.Load() || !slices.Equal(s.stack, stack) {
		return false
	}
	dir := s.rt.layers.UpperPath(s.upper)
	unchanged := func() bool {
		st, err := readUpperState(dir)
		return err == nil && st == s.upperAt.st && dirEmpty(dir)
	}
	if !unchanged() {
		return false
	}
	wait := keepWait
	if g := s.rt.killedGrace; g > 0 {
		wait = g
	}
	deadline := time.Now().Add(wait)
	for pause := 20 * time.Microsecond; s.killPending.Load(); pause = min(2*pause, 200*time.Microsecond) {
		gone, tids := s.killedState()
		if gone {
			s.killed = nil
			s.killPending.Store(false)
			s.settled("gone")
			break
		}
		if tids != nil {
			break // all exiting; settleKilled decides when the copies run
		}
		if time.Now().After(deadline) {
			return false
		}
		nap(pause)
	}
	return unchanged()
}

// keepWait bounds how long keepRoot waits for the killed processes to be
// gone or exiting (an 8 MB python3 is gone within about 0.3 ms here); past
// it the restore swaps, and settleKilled waits for them as before.
const keepWait = 500 * time.Microsecond

// dirEmpty reports whether directory dir has no entry but . and ..
func dirEmpty(dir string) bool {
	fd, err := unix.Open(dir, unix.O_RDONLY|unix.O_DIRECTORY|unix.O_CLOEXEC, 0)
	if err != nil {
		return false
	}
	defer unix.Close(fd)
	var buf [1024]byte
	n, err := unix.Getdents(fd, buf[:])
	if err != nil {
		return false
	}
	_, _, names := unix.ParseDirent(buf[:n], -1, nil)
	return len(names) == 0
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
	if !s.boostTried {
		s.boostTried = true
		b, err := s.cg.OpenCPUBoost()
		if err != nil {
			s.rt.log.Warn("opening the sandbox's CPU weight; checkpoints and restores run at its normal weight", "sandbox", s.id, "err", err)
		}
		s.boost = b
	}
	if s.boost == nil {
		return func() {}
	}
	if err := s.boost.Set(true); err != nil {
		s.rt.log.Warn("raising the sandbox's CPU weight", "sandbox", s.id, "err", err)
		return func() {}
	}
	if s.rt.onBoost != nil {
		s.rt.onBoost()
	}
	return func() {
		if err := s.boost.Set(false); err != nil {
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
	if !s.killPending.Load() {
		return
	}
	if s.waitKilledGroups(2 * time.Second) {
		s.killed = nil
		s.killPending.Store(false)
	}
}

// waitKilledGroups waits, for up to timeout, until the processes of the
// killed groups have exited, and reports whether they have. It changes
// nothing: beginExec calls it holding op shared.
func (s *Sandbox) waitKilledGroups(timeout time.Duration) bool {
	deadline := time.Now().Add(timeout)
	for _, g := range s.killed {
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
// memory first as it exits, and a process with hundreds of megabytes of its
// own takes tens of milliseconds to (31 ms for 512 MB here): waiting for
// that made a restore after an agent's process grew as slow.
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
//   - The dying count in the sandbox's memory and pids limits until gone.
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
func (s *Sandbox) settleKilled(c *checkpoint) {
	if !s.killPending.Load() || s.killedSettled {
		return
	}
	// Killed processes with little memory of their own are gone within a
	// fraction of a millisecond (an 8 MB python3: about 0.1 ms; a few under
	// load, the sandbox's CPU weight raised), sooner than their threads can
	// be listed and looked at.
	before, memErr := s.cg.MemoryCurrent()
	grace := killedGrace
	if g := s.rt.killedGrace; g > 0 {
		grace = g
	}
	if s.waitKilledGroups(grace) {
		s.killed = nil
		s.killPending.Store(false)
		s.settled("gone")
		return
	}
	// Still there. Going on without them pays only while they free memory
	// (killedFreeing in the grace): a killed process that is slow to go
	// because it waits for a CPU gets one sooner now, its CPU weight raised
	// with the restore's, than once the restore has returned, when the
	// next command and the group's removal would poll for it meanwhile.
	if after, err := s.cg.MemoryCurrent(); memErr != nil || err != nil || before-after < killedFreeing {
		s.waitKilled()
		s.settled("slow")
		return
	}
	deadline := time.Now().Add(2 * time.Second)
	for pause, first := 50*time.Microsecond, true; ; pause, first = min(2*pause, time.Millisecond), false {
		gone, tids := s.killedState()
		switch {
		case gone:
			s.killed = nil
			s.killPending.Store(false)
			s.settled("gone")
			return
		// The room is judged once, while the killed still hold most of
		// what they had: as they exit it grows.
		case first && !s.limitsRoom(len(c.Procs)):
			s.waitKilled()
			s.settled("waited")
			return
		case tids != nil && ownSockets(tids, c):
			s.waitKilled()
			s.settled("sockets")
			return
		case tids != nil:
			s.killedSettled = true
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
// loadtest-process` (64 sandboxes, an 8 MB python3 each, both CPUs busy)
// going on after a grace of 150 µs, whatever the killed copy was doing,
// took the server 5.9–6.2 → 8.6–9.2 ms of CPU per iteration (the next
// command and the group's removal each polling its cgroup.events while the
// copy, no longer raised, waited for a CPU to exit) and 74–77 → 62–65
// rollbacks/s; after 2 ms, still 8.1–8.4 against 6.7–7.2. See
// docs/ARCHITECTURE.md (known limits).
const killedGrace = 2 * time.Millisecond

// settled tells the test hook (onSettle) how settleKilled returned.
func (s *Sandbox) settled(how string) {
	if s.rt.onSettle != nil {
		s.rt.onSettle(how)
	}
}

// killedState reports whether the processes of the killed groups are all
// gone, and else lists their threads if every one is exiting (nil if one
// is not yet, or they could not be listed).
func (s *Sandbox) killedState() (gone bool, exiting []int) {
	gone, exiting = true, []int{}
	for _, g := range s.killed {
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
		if s.rt.onRoom != nil && err == nil {
			s.rt.onRoom(lim, cur)
		}
		if err != nil || lim-cur < lim/4 {
			return false
		}
	}
	return s.pidRoom(n)
}

// ownSockets reports whether one of threads tids holds a socket that no
// template of c holds (or its files cannot be read).
func ownSockets(tids []int, c *checkpoint) bool {
	var shared map[string]bool
	for _, tid := range tids {
		own, err := socketLinks(tid)
		if err != nil {
			return true
		}
		for _, l := range own {
			if shared == nil {
				shared = map[string]bool{}
				for _, t := range c.Procs {
					ls, err := socketLinks(t.HostPid)
					if err != nil {
						return true
					}
					for _, l := range ls {
						shared[l] = true
					}
				}
			}
			if !shared[l] {
				return true
			}
		}
	}
	return false
}

// socketLinks lists the sockets thread tid holds open ("socket:[inode]");
// none for a thread gone.
func socketLinks(tid int) ([]string, error) {
	dir := "/proc/" + strconv.Itoa(tid) + "/fd/"
	ents, err := os.ReadDir(dir)
	if errors.Is(err, os.ErrNotExist) || errors.Is(err, unix.ESRCH) {
		return nil, nil
	}
	if err != nil {
		return nil, err
	}
	var out []string
	for _, e := range ents {
		l, err := os.Readlink(dir + e.Name())
		if err == nil && strings.HasPrefix(l, "socket:") {
			out = append(out, l)
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
