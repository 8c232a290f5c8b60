package sandbox

import (
	"errors"
	"fmt"
	"os"
	"strconv"
	"strings"
	"sync/atomic"
	"time"

	"golang.org/x/sys/unix"

	"github.com/deltagym/deltagym/sandbox/fscred"
	"github.com/deltagym/deltagym/sandbox/launch"
	"github.com/deltagym/deltagym/sandbox/procstate"
)

// The sandbox's /dev/shm in its checkpoints. Each sandbox has a tmpfs of
// its own on /dev/shm (the init mounts it: initproc's setup_mounts), where
// POSIX shared memory and semaphores live. A checkpoint carries what it
// holds, taken at the instant of its files and processes: a sealed layer of
// its own (checkpoint.Shm), made only when /dev/shm is not empty. A restore,
// a fork and a sandbox made from the checkpoint after a restart give the
// sandbox exactly that /dev/shm.
//
// Files are carried with their names, types (regular files, directories,
// symlinks, FIFOs; sockets and device nodes are left out), modes, owners
// (stored relative to the sandbox's id range, as layers store them),
// access and modification times, and contents (holes stay holes). A
// restore rewrites in place a regular file that still has its name and no
// other (the inode a frozen template maps stays the one the name reaches)
// and replaces everything else; what the sandbox added since is removed.
//
// Nothing is read or written while /dev/shm is known: shmState remembers
// what it held when last seen (empty, or a copy of a layer), until a
// process of the sandbox may run. So a checkpoint or restore of a sandbox
// whose /dev/shm stayed empty, and in which no process ran since, costs no
// system call.

// The bounds of a sandbox's /dev/shm, which init.c's setup_mounts mounts
// with them, and of the depth of directories a checkpoint copies.
const (
	shmBytes  = 64 << 20
	shmInodes = 16384
	shmDepth  = 64
)

// shmState is what the sandbox's /dev/shm is known to hold.
type shmState struct {
	// dirty: a process of the sandbox may have run since known was set.
	// Set before any command, session or restored process starts.
	dirty atomic.Bool
	// known, while not dirty: "" for an empty /dev/shm, else the layer
	// whose copy it holds. Guarded by Sandbox.op (written under the write
	// lock; read under either), as are the fields below.
	known string
	// pending is the checkpoint whose /dev/shm a restore of template
	// copies writes back once the processes it killed are settled, before
	// the copies run (settleShm); err is how that went.
	pending *checkpoint
	err     error
}

// shmMayChange marks the sandbox's /dev/shm unknown: a process is about to
// run.
func (s *Sandbox) shmMayChange() { s.shm.dirty.Store(true) }

// shmSeen records that the sandbox's /dev/shm holds layer (or nothing,
// for ""), and whether processes run on that may change it. Called with op
// held (write).
func (s *Sandbox) shmSeen(layer string, running bool) {
	s.shm.known = layer
	s.shm.dirty.Store(running)
}

// shmUsed returns the bytes the sandbox's /dev/shm holds, for admission.
// Called with op held.
func (s *Sandbox) shmUsed() int64 {
	if !s.shm.dirty.Load() {
		if s.shm.known == "" {
			return 0
		}
		n, _ := s.rt.layers.SealedSize(s.shm.known)
		return n
	}
	var st unix.Statfs_t
	if unix.Statfs(s.shmPath(), &st) != nil {
		return 0 // the capture that follows fails too
	}
	return int64(st.Blocks-st.Bfree) * st.Bsize
}

// shmMounts is the number of layers a checkpoint may make to copy the
// sandbox's /dev/shm (one, unless it is known). Called with op held.
func (s *Sandbox) shmMounts() int {
	if s.shm.dirty.Load() {
		return 1
	}
	return 0
}

// shmPath is the sandbox's /dev/shm seen from the server: through its
// init's root, which holds /dev whatever root is pending.
func (s *Sandbox) shmPath() string {
	return "/proc/" + strconv.Itoa(s.init.Pid) + "/root/dev/shm"
}

// openShm opens the sandbox's /dev/shm, and returns how its root looks.
// The sandbox cannot replace it or anything on its path (/dev is a
// read-only bind of a tree of the host's root, /dev/shm a mount on it, and
// mounts are refused to its processes); it is checked to be a mount's root
// all the same, never the shared /dev tree's mount point. Two system calls
// and a close: a restore of template copies makes them whenever processes
// ran.
func (s *Sandbox) openShm() (int, unix.Statx_t, error) {
	var st unix.Statx_t
	fd, err := unix.Open(s.shmPath(), unix.O_RDONLY|unix.O_DIRECTORY|unix.O_NOFOLLOW|unix.O_CLOEXEC, 0)
	if errors.Is(err, unix.ENOENT) || errors.Is(err, unix.ESRCH) {
		return -1, st, fmt.Errorf("%w: the sandbox's init went away", ErrClosed)
	}
	if err != nil {
		return -1, st, fmt.Errorf("opening the sandbox's /dev/shm: %w", err)
	}
	if err := unix.Statx(fd, "", unix.AT_EMPTY_PATH, unix.STATX_BASIC_STATS, &st); err != nil || st.Attributes&unix.STATX_ATTR_MOUNT_ROOT == 0 {
		unix.Close(fd)
		return -1, st, fmt.Errorf("opening the sandbox's /dev/shm: %w", errors.Join(err, errShmNotMounted))
	}
	return fd, st, nil
}

var errShmNotMounted = errors.New("not the sandbox's own tmpfs")

// captureShm records the sandbox's /dev/shm in c (c.Shm, and its bytes in
// c.Size): a copy sealed as a layer of its own, none if it is empty, the
// known layer if it holds one and no process ran since. Nothing in the
// sandbox runs meanwhile (its processes are stopped, or there are none);
// called with op held (write).
func (s *Sandbox) captureShm(c *checkpoint) error {
	r := s.rt
	if !s.shm.dirty.Load() {
		if s.shm.known == "" {
			return nil
		}
		if r.layers.Ref(s.shm.known) == nil {
			c.Shm = s.shm.known
			n, _ := r.layers.SealedSize(c.Shm)
			c.Size += n
			return nil
		}
		// Released since: copy what the sandbox holds.
	}
	src, st, err := s.openShm()
	if err != nil {
		return err
	}
	defer unix.Close(src)
	if empty, err := s.shmEmpty(src, &st); err != nil || empty {
		return err
	}
	id, err := r.layers.NewUpper(shmBytes, shmInodes)
	if err != nil {
		return fmt.Errorf("copying /dev/shm: %w", err)
	}
	var size int64
	err = s.copyShmInto(src, r.layers.Path(id))
	if err == nil {
		size, err = r.layers.Seal(id)
	}
	if err != nil {
		r.layers.Unref(id)
		return err
	}
	c.Shm = id
	c.Size += size
	return nil
}

// shmEmpty reports whether the sandbox's /dev/shm (fd, its root looking as
// st says) is as its init made it: no entry, mode 1777, owned by the
// sandbox's root.
func (s *Sandbox) shmEmpty(fd int, st *unix.Statx_t) (bool, error) {
	if st.Mode != unix.S_IFDIR|0o1777 || st.Uid != uint32(s.hostID) || st.Gid != uint32(s.hostID) {
		return false, nil
	}
	names, err := dirNamesHere(fd) // just opened: from the start
	if err != nil {
		return false, fmt.Errorf("reading /dev/shm: %w", err)
	}
	return len(names) == 0, nil
}

// copyShmInto copies the sandbox's /dev/shm (src) into dir, a new directory
// of a layer's tmpfs, with owners made relative to the sandbox's range.
func (s *Sandbox) copyShmInto(src int, dir string) error {
	if err := unix.Mkdir(dir, 0o700); err != nil {
		return fmt.Errorf("copying /dev/shm: %w", err)
	}
	dst, err := unix.Open(dir, unix.O_RDONLY|unix.O_DIRECTORY|unix.O_NOFOLLOW|unix.O_CLOEXEC, 0)
	if err != nil {
		return fmt.Errorf("copying /dev/shm: %w", err)
	}
	defer unix.Close(dst)
	sy := &shmSync{shift: -int64(s.hostID), deep: true, top: -1}
	if err := sy.tree(src, dst, 0); err != nil {
		return fmt.Errorf("copying /dev/shm: %w", err)
	}
	return nil
}

// restoreShm gives the sandbox's /dev/shm what checkpoint c holds (nothing
// if c has no layer of it), unless it is known to hold it already; running:
// processes run on it next. Unless settled (settleKilled has let the
// copies run), the processes a restore killed are waited for first, until
// they make no system call again: one still running could write after the
// copy. Called with op held (write), after killAll and before any process
// of c runs.
func (s *Sandbox) restoreShm(c *checkpoint, settled, running bool) error {
	if !s.shm.dirty.Load() && s.shm.known == c.Shm {
		s.shm.dirty.Store(running)
		return nil
	}
	if !settled && !s.killedQuiet(time.Now().Add(keepWait)) {
		s.waitKilled()
	}
	dst, st, err := s.openShm()
	if err != nil {
		return err
	}
	defer unix.Close(dst)
	if c.Shm == "" {
		// The common case, processes ran and left /dev/shm empty: one
		// directory read.
		if empty, err := s.shmEmpty(dst, &st); err == nil && empty {
			s.shmSeen("", running)
			return nil
		}
	}
	src := -1
	if c.Shm != "" {
		if src, err = unix.Open(s.rt.layers.Path(c.Shm), unix.O_RDONLY|unix.O_DIRECTORY|unix.O_NOFOLLOW|unix.O_CLOEXEC, 0); err != nil {
			return fmt.Errorf("%w: checkpoint %s: its /dev/shm is gone", ErrNotFound, c.ID)
		}
		defer unix.Close(src)
	}
	// The sandbox's tmpfs takes new files only from ids its user namespace
	// maps: the work runs as the sandbox's root, with the server's
	// capabilities.
	err = fscred.Run(s.hostID, s.hostID, true, func() error {
		sy := &shmSync{shift: int64(s.hostID), top: dst}
		return sy.tree(src, dst, 0)
	})
	if err != nil {
		return fmt.Errorf("restoring /dev/shm: %w", err)
	}
	s.shmSeen(c.Shm, running)
	return nil
}

// deferShm has the /dev/shm of c, whose template copies a restore brings
// back, written back by settleShm: once the killed processes are settled,
// which the restore waits for anyway while the copies are readied, so the
// wait overlaps with that work as it would without /dev/shm. Called with
// op held (write).
func (s *Sandbox) deferShm(c *checkpoint) {
	s.shm.pending, s.shm.err = c, nil
}

// settleShm writes back the /dev/shm deferred by deferShm, if any, the
// killed processes settled (procstate.Host.SettleKilled). Called with op
// held (write).
func (s *Sandbox) settleShm() {
	if c := s.shm.pending; c != nil {
		s.shm.pending = nil
		s.shm.err = s.restoreShm(c, true, true)
	}
}

// shmDeferred returns how writing back the deferred /dev/shm went, writing
// it back now if nothing settled the killed processes (the copies failed
// before). Called with op held (write).
func (s *Sandbox) shmDeferred() error {
	if c := s.shm.pending; c != nil {
		s.shm.pending = nil
		s.shm.err = s.restoreShm(c, false, true)
	}
	err := s.shm.err
	s.shm.err = nil
	return err
}

// shmUnsaved says why CRIU image u, of process nsPid (comm), does not
// restore anywhere, or "": tpl says whether the image is of a template.
// procstate marks an image whose process has a file of /dev/shm open or
// mapped (Unit.Local); the checkpoint carries /dev/shm, so the image
// restores in any sandbox, unless the file was removed while held
// (Python's multiprocessing removes its semaphores at once): criu keeps
// such a file as a ghost file, which it cannot link back into a sandbox's
// /dev/shm at restore. Only images so marked are looked at.
func shmUnsaved(u procstate.Unit, nsPid int, comm string, tpl bool) string {
	if u.Local == "" {
		return ""
	}
	ents, err := os.ReadDir(u.Dir)
	if err != nil {
		return u.Local
	}
	for _, e := range ents {
		if strings.HasPrefix(e.Name(), "ghost-file-") {
			why := fmt.Sprintf("pid %d (%s) holds a file of /dev/shm that was removed (a POSIX semaphore or shared memory unlinked while in use): CRIU keeps it as a ghost file, which it cannot restore in a sandbox", nsPid, comm)
			if tpl {
				return why + ", so the process comes back only as its template, in this sandbox"
			}
			return why + ", so the checkpoint cannot bring the process back (take it with process mode template, or filesystem)"
		}
	}
	return ""
}

// idRange is the size of a sandbox's uid and gid range.
const idRange = launch.IDRange
