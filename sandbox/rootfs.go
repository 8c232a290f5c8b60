package sandbox

import (
	"errors"
	"fmt"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"golang.org/x/sys/unix"

	"github.com/deltagym/deltagym/sandbox/layers"
	"github.com/deltagym/deltagym/sandbox/overlay"
)

// Keeping the root. A restore with processes swaps in a new root over the
// checkpoint's layers with an empty upper. When the root it would replace
// is over the same layers and its upper is still empty, the two hold the
// same files, and the restore keeps the root instead: no overlay mounted,
// no swap by the init, no old root detached, and none of the expedited RCU
// grace period its teardown costs (the overlay's private layer mounts).
// That is the case of a checkpoint restored again before anything wrote a
// file: a rollback loop whose agent's steps only read, a tree search that
// tries one move from a node after another, a process that keeps its state
// in memory. BenchmarkRollbackVsCRIU's template path shows what it spares,
// files=kept against files=written (a new root each restore). The upper
// counts as empty only if its directory has no entry (no file, directory,
// whiteout or copied-up ancestor) and looks as it did when it became the
// upper: mode, owner, times, size, link count and extended attributes, so
// that a chmod, touch or setxattr of / itself, or a directory made and
// removed again, is seen too. It is read once the processes the restore
// killed are gone: a dying process's last system call could still write. So
// a restore also swaps when the killed processes are not gone or exiting
// within keepWait, after a restore with fresh entropy (its seed file is in
// the upper), when a template has a file open for writing (its copy reopens
// it, which copies it up), and for good once a killed process was given up
// on before it was seen gone.

// rootFS is the sandbox's root filesystem: the delta layers of the
// checkpoint it descends from (stack), the live upper over them, the next
// upper prepared ahead (spare), and a root not yet swapped into the init's
// mount namespace (root) with its covers. State changes hold mu (write)
// under op (write); file actions hold it (read) under op (read), and so
// does the swap of a pending root (materialize, write) under op (read).
type rootFS struct {
	mu sync.RWMutex
	// idmapped maps a layer directory to its idmapped clone's fd.
	// +checklocks:mu
	idmapped map[string]int
	// stack holds the delta layers under the upper, bottom first (refs
	// held).
	// +checklocks:mu
	stack []string
	// upper is the live upper layer (ref held).
	// +checklocks:mu
	upper string
	// upperFD is the idmapped clone of the upper's layer directory, or -1
	// (given up when the sandbox goes cold; opened again when the upper is
	// next mounted).
	// +checklocks:mu
	upperFD int
	// upperAt is how the upper's directory looked when it became the
	// upper (keepRoot); ok is false if it could not be read.
	// +checklocks:mu
	upperAt struct {
		st upperState
		ok bool
	}
	// spare is the next upper, prepared in the background after each root
	// switch so that the next checkpoint or restore need not make one.
	// +checklocks:mu
	spare chan spareUpper
	// +checklocks:mu
	spareReady bool
	// root is the sandbox's root while it is not yet the root of the
	// init's mount namespace: a detached mount, or -1. A restore or a
	// checkpoint that leaves no process running does not swap the new
	// root in; file actions use it as it is, and the first command or
	// process to need the namespace swaps it in (materialize). A rollback
	// loop of restores and file actions never swaps. nsUpper is the upper
	// of the namespace's root meanwhile (stale, reachable by nothing).
	// +checklocks:mu
	root int
	// +checklocks:mu
	nsUpper spareUpper
	// covered says whether root has its covers (overlay.Covers): they are
	// put on when a file action could reach their directories (coverRoot).
	// Set under coverMu (with mu read-held); cleared with a new root, under
	// mu (write).
	// +checklocks:mu
	coverMu sync.Mutex
	// +checklocks:mu
	covered atomic.Bool
}

// userNS opens the user namespace of the sandbox's init, which idmapped
// clones of layer directories map onto.
func (s *Sandbox) userNS() (int, error) {
	fd, err := s.init.NS(unix.PIDFD_GET_USER_NAMESPACE)
	if err != nil {
		return -1, fmt.Errorf("%w: sandbox %s: %w", ErrClosed, s.id, err)
	}
	return fd, nil
}

// idmap makes an idmapped clone of layer directory dir for this sandbox
// (overlay.IDMapped).
func (s *Sandbox) idmap(dir string, readOnly bool) (int, error) {
	userns, err := s.userNS()
	if err != nil {
		return -1, err
	}
	defer unix.Close(userns)
	return overlay.IDMapped(dir, userns, readOnly)
}

// switchRoot makes a fresh upper over stack (delta layers, bottom first) the
// sandbox's root. Unless pending is set, it becomes the root of the init's
// mount namespace now; with pending set (the caller knows that no process
// runs) it waits for materialize. On success the sandbox's old upper (if
// any) is released and the new one is s.fs.upper; stack references are the
// caller's business.
//
// With again set (a restore of the checkpoint restored last), the root of
// the next restore is built ahead over the same stack, on the upper this
// switch retires (retire).
// +checklocks:s.fs.mu
func (s *Sandbox) switchRoot(stack []string, pending, again bool) error {
	sp, err := s.takeSpareFor(stack)
	if err != nil {
		return err
	}
	mfd := sp.root
	if !sp.built && sp.fd < 0 {
		// A spare reclaimed while the sandbox was cold (coolFS).
		sp.fd, err = s.idmap(s.rt.layers.Dir(sp.id), false)
	}
	if err == nil && !sp.built {
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
			s.fs.upperAt.ok = false
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
	old := spareUpper{id: s.fs.upper, fd: s.fs.upperFD}
	s.fs.upper, s.fs.upperFD = sp.id, sp.fd
	s.fs.upperAt.st, s.fs.upperAt.ok = upperAt, upperErr == nil
	if s.fs.root >= 0 {
		// A root that was pending goes with its fd, its upper follows;
		// the namespace's root is still nsUpper's. Nothing but file
		// actions, all done (op is held), ever used it: once the fd is
		// closed, no overlay holds the upper.
		s.retireUnused(old, s.closeRoot(), next)
		old, s.fs.nsUpper = s.fs.nsUpper, spareUpper{}
		next = nil
	}
	if pending {
		s.fs.root, s.fs.nsUpper = mfd, old
		s.fs.covered.Store(false)
		return nil
	}
	unix.Close(mfd) // it is attached: the namespace holds it
	s.retire(old, s.init.OldRootGone(), next)
	return nil
}

// nextRoot is what building a root ahead needs: the stack and the fds of
// its lower directories (from the sandbox's cache, valid until Destroy or
// until the sandbox goes cold (coolFS), each of which waits for the spare
// first).
type nextRoot struct {
	stack  []string
	lowers []int
}

// planRoot gathers what a root over stack needs. Called with op held.
// +checklocks:s.fs.mu
func (s *Sandbox) planRoot(stack []string) (*nextRoot, error) {
	dirs := s.lowerDirs(stack)
	n := &nextRoot{stack: slices.Clone(stack), lowers: make([]int, len(dirs))}
	userns := -1 // opened for the clones not cached (a cold sandbox's)
	var err error
	for i, d := range dirs {
		fd, ok := s.fs.idmapped[d]
		if !ok {
			if userns < 0 {
				if userns, err = s.userNS(); err != nil {
					break
				}
			}
			if fd, err = overlay.IDMapped(d, userns, true); err != nil {
				break
			}
			s.fs.idmapped[d] = fd
		}
		n.lowers[i] = fd
	}
	if userns >= 0 {
		unix.Close(userns)
	}
	if err != nil {
		return nil, err
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
// +checklocks:s.fs.mu
func (s *Sandbox) closeRoot() <-chan struct{} {
	fd := s.fs.root
	s.fs.root = -1
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
// spare is already there; with next, the next root is built on it.
// +checklocks:s.fs.mu
func (s *Sandbox) retire(old spareUpper, gone <-chan struct{}, next *nextRoot) {
	s.retireAs(old, gone, next, true)
}

// retireUnused is retire for the upper of a root no process ever had: once
// gone is closed, no overlay holds it, and its reset skips the check
// (layers.Store.ResetUnused).
// +checklocks:s.fs.mu
func (s *Sandbox) retireUnused(old spareUpper, gone <-chan struct{}, next *nextRoot) {
	s.retireAs(old, gone, next, false)
}

// +checklocks:s.fs.mu
func (s *Sandbox) retireAs(old spareUpper, gone <-chan struct{}, next *nextRoot, check bool) {
	// A new sandbox gets its spare at its first checkpoint or restore, not
	// now: a fork fan-out would make one per child, competing for the CPU
	// with the fan-out, for children that may never switch again.
	if old.id == "" {
		return
	}
	if s.fs.spareReady {
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

// materialize makes a pending root (s.fs.root) the root of the init's mount
// namespace, before anything runs in the sandbox. Called with op held.
func (s *Sandbox) materialize() error {
	s.fs.mu.Lock()
	defer s.fs.mu.Unlock()
	if s.fs.root < 0 {
		return nil
	}
	if err := s.swap(s.fs.root); err != nil {
		return fmt.Errorf("switching root: %w", err)
	}
	unix.Close(s.fs.root) // attached: the namespace holds it
	s.fs.root = -1
	old := s.fs.nsUpper
	s.fs.nsUpper = spareUpper{}
	s.retire(old, s.init.OldRootGone(), nil)
	return nil
}

// swap makes root the root of the init's mount namespace (launch.Init.Swap),
// while no copy is being forked ahead (ahead.go).
func (s *Sandbox) swap(root int) error {
	return s.procs.WithoutForks(func() error { return s.init.Swap(root) })
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
	s.fs.mu.RLock()
	defer s.fs.mu.RUnlock()
	return s.withRootHeld(rel, fn)
}

// withRootHeld is withRootFor for a caller that holds fs.mu.
// +checklocksread:s.fs.mu
func (s *Sandbox) withRootHeld(rel string, fn func(root int) error) error {
	if s.fs.root >= 0 {
		if !s.fs.covered.Load() && (rel == "" || s.rt.ovl.covers.Needed(s.fs.root, rel)) {
			if err := s.coverRoot(); err != nil {
				return err
			}
		}
		return fn(s.fs.root)
	}
	// Until the last swap's old root is detached, it sits on the root's
	// "/" (launch.Init.Swap): a resolution that steps onto "/" by ".."
	// (a path's, or a relative link's such as /etc/os-release's) would
	// cross it, which RESOLVE_NO_XDEV refuses with EXDEV.
	s.init.Settled()
	root, err := unix.Open("/proc/"+strconv.Itoa(s.init.Pid)+"/root", unix.O_PATH|unix.O_DIRECTORY|unix.O_CLOEXEC, 0)
	if err != nil {
		return fmt.Errorf("%w: the sandbox's init went away", ErrClosed)
	}
	defer unix.Close(root)
	return fn(root)
}

// coverRoot puts the covers on the pending root, once.
// +checklocksread:s.fs.mu
func (s *Sandbox) coverRoot() error {
	s.fs.coverMu.Lock()
	defer s.fs.coverMu.Unlock()
	if s.fs.covered.Load() {
		return nil
	}
	if err := s.rt.ovl.covers.Apply(s.fs.root); err != nil {
		return err
	}
	s.fs.covered.Store(true)
	return nil
}

// releaseUpper drops the live upper and its idmapped clone, and a pending
// root with the namespace's.
// +checklocks:s.fs.mu
func (s *Sandbox) releaseUpper() {
	if s.fs.root >= 0 {
		<-s.closeRoot()
	}
	if s.fs.nsUpper.id != "" {
		unix.Close(s.fs.nsUpper.fd)
		s.rt.layers.Unref(s.fs.nsUpper.id)
		s.fs.nsUpper = spareUpper{}
	}
	if s.fs.upperFD >= 0 {
		unix.Close(s.fs.upperFD)
		s.fs.upperFD = -1
	}
	if s.fs.upper != "" {
		s.rt.layers.Unref(s.fs.upper)
		s.fs.upper = ""
	}
	s.fs.upperAt.ok = false
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
	id, err := s.rt.layers.NewUpper(s.diskBytes(), s.inodes())
	if err != nil {
		return spareUpper{err: err}
	}
	fd, err := s.idmap(s.rt.layers.Dir(id), false)
	if err != nil {
		s.rt.layers.Unref(id)
		return spareUpper{err: err}
	}
	return spareUpper{id: id, fd: fd}
}

// prepareSpare starts making the next upper. Called with op held.
// +checklocks:s.fs.mu
func (s *Sandbox) prepareSpare() {
	s.fs.spare = make(chan spareUpper, 1)
	s.fs.spareReady = true
	ch := s.fs.spare
	go func() { ch <- s.newSpare() }()
}

// prepareSpareFrom makes a reclaimed upper (layers.Store.Reclaim) the next
// spare, emptied in the background once the root it was the upper of is
// detached (gone); with next, the next root is built on it there too: the
// overlay's creation (mostly the kernel's probes of the upper and work
// directories) then leaves the next restore's path, when it restores the
// same checkpoint again. Called with op held.
// +checklocks:s.fs.mu
func (s *Sandbox) prepareSpareFrom(old spareUpper, gone <-chan struct{}, next *nextRoot, check bool) {
	s.fs.spare = make(chan spareUpper, 1)
	s.fs.spareReady = true
	ch := s.fs.spare
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
		if next != nil && old.fd < 0 {
			// The upper of a sandbox that went cold: its clone again.
			old.fd, _ = s.idmap(s.rt.layers.Dir(old.id), false)
		}
		if next != nil && old.fd >= 0 {
			if mfd, err := next.mount(s.hostID, old.fd); err == nil {
				old.built, old.root, old.stack = true, mfd, next.stack
			}
		}
		ch <- old
	}()
}

// takeSpare returns the prepared upper, or makes one. Called with op held.
// +checklocks:s.fs.mu
func (s *Sandbox) takeSpare() (spareUpper, error) { return s.takeSpareFor(nil) }

// takeSpareFor is takeSpare for a root over stack: the spare comes with the
// root built ahead if it was built over stack. A root built over another
// stack is dropped, and its upper with it (reusable only once the overlay
// is gone); a new upper serves instead.
// +checklocks:s.fs.mu
func (s *Sandbox) takeSpareFor(stack []string) (spareUpper, error) {
	var sp spareUpper
	if s.fs.spareReady {
		sp = <-s.fs.spare
		s.fs.spareReady = false
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
// +checklocks:s.fs.mu
func (s *Sandbox) dropSpare() {
	if !s.fs.spareReady {
		return
	}
	sp := <-s.fs.spare
	s.fs.spareReady = false
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

// +checklocks:s.fs.mu
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

// +checklocks:s.fs.mu
func (s *Sandbox) unrefStack() {
	for _, l := range s.fs.stack {
		s.rt.layers.Unref(l)
	}
	s.fs.stack = nil
}

// sealAndSwap is the fast path: the upper itself becomes the checkpoint's
// top layer, under a fresh upper.
func (s *Sandbox) sealAndSwap(c *checkpoint) error {
	r := s.rt
	s.fs.mu.Lock()
	defer s.fs.mu.Unlock()
	if err := s.linkUp(); err != nil {
		return err
	}
	size, err := r.layers.Seal(s.fs.upper)
	if err != nil {
		return err
	}
	old := s.fs.upper
	stack := r.shorten(append(slices.Clone(s.fs.stack), old))
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
	s.fs.stack = stack
	_ = refAll(r, stack) // the checkpoint's references; all exist
	c.Layers = slices.Clone(stack)
	c.Size += size
	return nil
}

// linkUp puts into the upper the other names of every hard-linked lower
// file the overlay copied up (overlay.Links), so that the layer the upper
// becomes keeps the file's link group. Nothing runs in the sandbox.
// +checklocks:s.fs.mu
func (s *Sandbox) linkUp() error {
	index := filepath.Join(s.rt.layers.Dir(s.fs.upper), layers.WorkDir, "index")
	if overlay.IndexEmpty(index) {
		return nil
	}
	lowers := s.lowerDirs(s.fs.stack)
	return s.withRootHeld("", func(root int) error {
		if _, err := s.rt.ovl.links.Materialize(root, index, lowers); err != nil {
			return fmt.Errorf("keeping hard links whole: %w", err)
		}
		return nil
	})
}

// copyUpper is the path for a sandbox with live processes: freeze, copy the
// files (files: a copy of the upper sealed, and /dev/shm's), thaw.
func (s *Sandbox) copyUpper(files func() error) error {
	work := s.workGroup()
	if err := work.Freeze(); err != nil {
		return fmt.Errorf("freezing sandbox: %w", err)
	}
	err := files()
	if terr := work.Thaw(); terr != nil {
		err = errors.Join(err, fmt.Errorf("thawing sandbox: %w", terr))
	}
	return err
}

// copyUpperFrozen seals a copy of the upper; the sandbox's commands are
// stopped (frozen by copyUpper, or seized by procstate.State.Capture).
func (s *Sandbox) copyUpperFrozen(c *checkpoint) error {
	r := s.rt
	s.fs.mu.Lock()
	defer s.fs.mu.Unlock()
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
		size, err = r.layers.CopyInto(s.fs.upper, id)
	}
	s.prepareSpare()
	if err != nil {
		r.layers.Unref(id)
		return err
	}
	for _, l := range s.fs.stack {
		_ = r.layers.Ref(l)
	}
	c.Layers = append(slices.Clone(s.fs.stack), id)
	c.Size += size
	return nil
}

// restoreRoot puts checkpoint c's files in the sandbox's root: a new root
// over its layers, or the root as it is when it holds them already
// (keepRoot, tried only when mayKeep: copies alone come back). With
// pending (no process to bring back), nothing runs until the next
// command, which swaps the root in then. Called with op held, after
// killAll.
// +checklocks:s.op
func (s *Sandbox) restoreRoot(c *checkpoint, again, pending, mayKeep bool) error {
	r := s.rt
	s.fs.mu.Lock()
	defer s.fs.mu.Unlock()
	stack := slices.Clone(r.stackOf(c))
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
		s.fs.stack = stack
	}
	r.moveHead(s.head, c.ID)
	s.head = c.ID
	return nil
}

// upperUsed returns the bytes the upper holds.
func (s *Sandbox) upperUsed() int64 {
	s.fs.mu.RLock()
	defer s.fs.mu.RUnlock()
	return s.rt.layers.Used(s.fs.upper)
}

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
// +checklocks:s.fs.mu
func (s *Sandbox) keepRoot(stack []string) bool {
	if s.fs.root >= 0 || !s.fs.upperAt.ok || s.cmds.stragglers.Load() || !slices.Equal(s.fs.stack, stack) {
		return false
	}
	dir, was := s.rt.layers.UpperPath(s.fs.upper), s.fs.upperAt.st
	if !upperUnchanged(dir, was) {
		return false
	}
	wait := keepWait
	if g := s.rt.hooks.killedGrace; g > 0 {
		wait = g
	}
	if !s.killedQuiet(time.Now().Add(wait)) {
		return false
	}
	return upperUnchanged(dir, was)
}

// upperUnchanged reports whether upper directory dir has no entry and
// looks as it did (was).
func upperUnchanged(dir string, was upperState) bool {
	st, err := readUpperState(dir)
	return err == nil && st == was && dirEmpty(dir)
}

// keepWait bounds how long keepRoot waits for the killed processes to be
// gone or exiting (a small process is gone well within it); past it the
// restore swaps, and settleKilled waits for them as for any swap.
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
