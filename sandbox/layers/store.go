// Package layers keeps the filesystem deltas of sandboxes: writable uppers
// and the immutable layers they become when sealed.
//
// Each delta layer is its own small tmpfs, mounted in the server's mount
// namespace at <dir>/<id>, holding up/ (the overlay upper), work/
// (overlayfs's work dir) and, once sealed, fs/ (the layer, a lower of later
// overlays), which until then is fs.spare/, so that sealing needs no inode
// of those the layer's limit leaves its writer. A tmpfs per layer gives three things at once:
// the size limit of a sandbox's writable layer (size=), a discard that is one
// lazy unmount instead of an rm of every file, and sealing that the kernel
// enforces: a sealed layer's superblock is remounted read-only, so nothing —
// not a stale fd, not a process whose cwd is in an old root — can change a
// checkpoint afterwards.
//
// The mounts outlive the server process, so checkpoints survive a restart;
// Reconcile adopts them and discards the ones no checkpoint needs. Layers are
// reference counted by their users (checkpoints and live sandboxes); the last
// Unref discards the layer in the background.
package layers

import (
	"bytes"
	"crypto/rand"
	"encoding/binary"
	"encoding/hex"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"sync"
	"sync/atomic"

	"golang.org/x/sys/unix"
)

// Store holds the delta layers under one directory.
type Store struct {
	dir string

	mu sync.Mutex
	// +checklocks:mu
	refs map[string]int
	// sizes holds the bytes used by each sealed layer.
	// +checklocks:mu
	sizes map[string]int64
	// digests holds the digest of each sealed layer whose transfer stream
	// was hashed (Export, Digest, Import): a sealed layer never changes, so
	// it holds until the layer is discarded or unsealed. byDigest maps each
	// such digest to one layer (LayerByDigest).
	// +checklocks:mu
	digests map[string]string
	// +checklocks:mu
	byDigest map[string]string
	// hashing are the layers Digest is hashing, each channel closed when it is done, so that
	// a second Digest of one layer waits for the first instead of reading it again.
	// +checklocks:mu
	hashing map[string]chan struct{}
	// unseals counts Unseal calls: a digest computed across one is not
	// kept.
	// +checklocks:mu
	unseals uint64
	wg      sync.WaitGroup // discards in flight

	pending atomic.Int64 // discards in flight, for Pending
}

// New opens (creating if needed) the store at dir.
func New(dir string) (*Store, error) {
	if err := os.MkdirAll(dir, 0o700); err != nil {
		return nil, fmt.Errorf("creating layer store: %w", err)
	}
	return &Store{dir: dir, refs: map[string]int{}, sizes: map[string]int64{},
		digests: map[string]string{}, byDigest: map[string]string{}}, nil
}

// Dir returns the directory of layer id (holding up/, work/ and fs/).
func (s *Store) Dir(id string) string { return filepath.Join(s.dir, id) }

// Path returns the filesystem directory of sealed layer id: a lower.
func (s *Store) Path(id string) string { return filepath.Join(s.dir, id, "fs") }

// UpperDir and WorkDir are the overlay's upper and work directories of a
// writable layer, relative to its Dir.
const (
	UpperDir = "up"
	WorkDir  = "work"
)

// spareDir is the directory a new layer keeps for the root of the layer it
// becomes (fs/): made with the layer, it takes the inode the root needs
// before a sandbox can fill its upper, so that a sandbox that used all its
// inodes can still be sealed. The root is the spare renamed (makeRoot), and
// an unsealed layer's root goes back to being its spare.
const spareDir = "fs.spare"

// makeRoot makes fs/ of layer directory d: its spare renamed, or, in a layer
// without one (made by an earlier version), a new directory. mode is the new
// directory's.
func makeRoot(d string, mode uint32) error {
	fs := filepath.Join(d, "fs")
	err := unix.Rename(filepath.Join(d, spareDir), fs)
	if errors.Is(err, unix.ENOENT) {
		err = unix.Mkdir(fs, mode)
	} else if err == nil {
		err = unix.Chmod(fs, mode)
	}
	if err != nil {
		return &os.PathError{Op: "mkdir", Path: fs, Err: err}
	}
	return nil
}

// UpperPath returns the upper directory of writable layer id.
func (s *Store) UpperPath(id string) string { return filepath.Join(s.dir, id, UpperDir) }

func newID() string {
	var b [8]byte
	_, _ = rand.Read(b[:])
	return "l" + hex.EncodeToString(b[:])
}

// NewUpper creates an empty writable layer of at most sizeBytes and inodes
// files, directories and links (0: no limit), with one reference held by
// the caller. Without an inode limit, a layer of small files could take
// the kernel memory of an inode each far beyond its size in bytes.
func (s *Store) NewUpper(sizeBytes, inodes int64) (string, error) {
	id := newID()
	d := s.Dir(id)
	if err := os.Mkdir(d, 0o700); err != nil {
		return "", fmt.Errorf("creating layer %s: %w", id, err)
	}
	// The tmpfs's root, the upper and work directories and the spare take four.
	opts := "mode=755,nr_inodes=0"
	if inodes > 0 {
		opts = "mode=755,nr_inodes=" + strconv.FormatInt(inodes+4, 10)
	}
	if sizeBytes > 0 {
		opts += ",size=" + strconv.FormatInt(sizeBytes, 10)
	}
	if err := unix.Mount("dg-layer", d, "tmpfs", unix.MS_NOSUID|unix.MS_NODEV, opts); err != nil {
		os.Remove(d)
		return "", fmt.Errorf("mounting layer %s: %w", id, err)
	}
	for _, sub := range []string{UpperDir, WorkDir, spareDir} {
		if err := os.Mkdir(filepath.Join(d, sub), 0o755); err != nil {
			s.discard(id)
			return "", fmt.Errorf("creating layer %s: %w", id, err)
		}
	}
	s.mu.Lock()
	s.refs[id] = 1
	s.mu.Unlock()
	return id, nil
}

// Seal makes layer id immutable: its upper's entries move into fs/, its
// tmpfs is remounted read-only (which the kernel refuses while any file in
// it is open for writing), and the overlay index's links to hard-linked
// files are dropped. It returns the bytes the layer uses.
//
// The entries move because the upper directory itself stays locked by its
// overlay until that overlay's last user is gone (a process still inside
// it, a frozen template), and overlayfs with an index refuses a lower that
// another overlay holds as its upper (EBUSY). fs/ is a directory no overlay
// ever wrote through. The index's links go because they would count in the
// files' link counts once the layer is a lower.
func (s *Store) Seal(id string) (int64, error) {
	d := s.Dir(id)
	moved, err := moveUpper(d)
	if err != nil {
		return 0, fmt.Errorf("sealing layer %s: %w", id, err)
	}
	// The work dir stays: the live overlay still holds work/work, and
	// removing it under the overlay makes the remount fail with EBUSY (an
	// unlinked directory in use) and breaks the overlay's later whiteouts
	// and renames with EIO.
	if err := remount(d, true); err != nil {
		if moved {
			if uerr := unmoveUpper(d); uerr != nil {
				err = errors.Join(err, uerr)
			}
		}
		return 0, fmt.Errorf("sealing layer %s: %w", id, err)
	}
	// Only now that the seal holds: a failed one leaves the overlay in use,
	// index and all.
	var links []string
	index := filepath.Join(d, WorkDir, "index")
	if moved {
		links = indexLinks(index)
	}
	if len(links) > 0 {
		err := remount(d, false)
		for _, n := range links {
			if err != nil {
				break
			}
			if err = unix.Unlink(filepath.Join(index, n)); errors.Is(err, unix.ENOENT) {
				err = nil
			}
		}
		if rerr := remount(d, true); err == nil {
			err = rerr
		}
		if err != nil {
			return 0, fmt.Errorf("sealing layer %s: dropping the overlay's index: %w", id, err)
		}
	}
	size := used(d)
	s.mu.Lock()
	s.sizes[id] = size
	s.mu.Unlock()
	return size, nil
}

func remount(d string, readOnly bool) error {
	flags := uintptr(unix.MS_REMOUNT | unix.MS_NOSUID | unix.MS_NODEV)
	if readOnly {
		flags |= unix.MS_RDONLY
	}
	return unix.Mount("", d, "", flags, "")
}

// Unseal makes a sealed layer writable again, its entries back in the
// upper; only for undoing a Seal whose checkpoint could not be completed.
func (s *Store) Unseal(id string) error {
	d := s.Dir(id)
	if err := remount(d, false); err != nil {
		return fmt.Errorf("unsealing layer %s: %w", id, err)
	}
	if err := unmoveUpper(d); err != nil {
		return fmt.Errorf("unsealing layer %s: %w", id, err)
	}
	s.mu.Lock()
	delete(s.sizes, id)
	s.forgetDigest(id)
	s.unseals++
	s.mu.Unlock()
	return nil
}

// SealedSize returns the bytes sealed layer id uses; sealed is false for
// a layer not sealed (or not known).
func (s *Store) SealedSize(id string) (n int64, sealed bool) {
	s.mu.Lock()
	defer s.mu.Unlock()
	n, sealed = s.sizes[id]
	return n, sealed
}

// Used returns the bytes layer id uses now.
func (s *Store) Used(id string) int64 { return used(s.Dir(id)) }

func used(dir string) int64 {
	var st unix.Statfs_t
	if unix.Statfs(dir, &st) != nil {
		return 0
	}
	return int64(st.Blocks-st.Bfree) * st.Bsize
}

// SealedBytes returns the total size of all sealed layers.
func (s *Store) SealedBytes() int64 {
	s.mu.Lock()
	defer s.mu.Unlock()
	var n int64
	for _, v := range s.sizes {
		n += v
	}
	return n
}

// CopyInto copies layer src into dst, a new empty upper, and seals dst. It
// returns the bytes dst uses.
func (s *Store) CopyInto(src, dst string) (int64, error) {
	if err := makeRoot(s.Dir(dst), 0o755); err != nil {
		return 0, fmt.Errorf("copying layer %s: %w", src, err)
	}
	if err := copyTree(s.UpperPath(src), s.Path(dst)); err != nil {
		return 0, fmt.Errorf("copying layer %s: %w", src, err)
	}
	return s.Seal(dst)
}

// Ref adds a reference to layer id, which must exist.
func (s *Store) Ref(id string) error {
	s.mu.Lock()
	defer s.mu.Unlock()
	if _, ok := s.refs[id]; !ok {
		return notFound(id)
	}
	s.refs[id]++
	return nil
}

// Unref drops a reference; the last one discards the layer in the background.
func (s *Store) Unref(id string) {
	s.mu.Lock()
	n, ok := s.refs[id]
	if !ok {
		s.mu.Unlock()
		return
	}
	if n > 1 {
		s.refs[id] = n - 1
		s.mu.Unlock()
		return
	}
	delete(s.refs, id)
	delete(s.sizes, id)
	s.forgetDigest(id)
	s.wg.Add(1)
	s.pending.Add(1)
	s.mu.Unlock()
	go func() {
		defer s.wg.Done()
		defer s.pending.Add(-1)
		s.discard(id)
	}()
}

// Reclaim drops the caller's reference to layer id, like Unref, except that
// a writable layer (never sealed) whose last reference this is stays in the
// store, still the caller's, and Reclaim returns true: Reset makes it an
// empty upper again, cheaper than a new tmpfs and a discard.
func (s *Store) Reclaim(id string) bool {
	s.mu.Lock()
	n, ok := s.refs[id]
	_, sealed := s.sizes[id]
	if ok && n == 1 && !sealed {
		s.mu.Unlock()
		return true
	}
	s.mu.Unlock()
	s.Unref(id)
	return false
}

// Reset empties a reclaimed writable layer: fresh upper and work
// directories (new inodes: an overlay that still held the old ones keeps
// them locked) on the same tmpfs, with the same size limit.
//
// It fails if the old overlay is still in use (a frozen template's root, a
// process not dead yet): the files it holds, removed, would make this
// tmpfs refuse its seal (EBUSY) for as long as it lives. A read-only
// remount, undone at once, tells.
func (s *Store) Reset(id string) error { return s.reset(id, true) }

// ResetUnused is Reset for a layer the caller knows no overlay holds any
// more: the upper of an overlay that was only ever the caller's (never a
// process's root, cwd or open file) and that the caller unmounted. It skips
// the read-only remount that Reset checks with: two remounts per restore, a
// measurable share of the server's CPU under the rollback load test.
func (s *Store) ResetUnused(id string) error { return s.reset(id, false) }

func (s *Store) reset(id string, check bool) error {
	d := s.Dir(id)
	dfd, err := unix.Open(d, unix.O_PATH|unix.O_DIRECTORY|unix.O_CLOEXEC, 0)
	if err != nil {
		return fmt.Errorf("resetting layer %s: %w", id, err)
	}
	defer unix.Close(dfd)
	for _, sub := range []string{UpperDir, WorkDir} {
		if err := removeTree(dfd, sub); err != nil {
			return fmt.Errorf("resetting layer %s: %w", id, err)
		}
		if err := unix.Mkdirat(dfd, sub, 0o755); err != nil {
			return fmt.Errorf("resetting layer %s: %w", id, err)
		}
	}
	if !check {
		return nil
	}
	if err := remount(d, true); err != nil {
		return fmt.Errorf("resetting layer %s: its old overlay is still in use: %w", id, err)
	}
	if err := remount(d, false); err != nil {
		return fmt.Errorf("resetting layer %s: %w", id, err)
	}
	return nil
}

// removeTree removes the directory name of dirfd with all it holds. It goes
// by the entry types getdents reports (tmpfs reports them): a file is
// unlinked, a directory removed (and gone into only if not empty), with no
// failed attempt per entry as os.RemoveAll makes: on the upper a rollback
// loop's restore leaves (one changed file, and its work directory:
// BenchmarkReset), far fewer system calls (strace -c counts them).
func removeTree(dirfd int, name string) error {
	fd, err := unix.Openat(dirfd, name, unix.O_RDONLY|unix.O_DIRECTORY|unix.O_NOFOLLOW|unix.O_CLOEXEC, 0)
	if errors.Is(err, unix.ENOENT) {
		return nil
	}
	if err != nil {
		return fmt.Errorf("opening %s: %w", name, err)
	}
	err = removeEntries(fd)
	unix.Close(fd)
	if err != nil {
		return err
	}
	if err := unix.Unlinkat(dirfd, name, unix.AT_REMOVEDIR); err != nil {
		return fmt.Errorf("removing %s: %w", name, err)
	}
	return nil
}

// direntBufs holds getdents buffers: on the stack, one would make Reset's
// fresh goroutine grow its stack, a measurable share of the server's CPU
// under the rollback load test.
var direntBufs = sync.Pool{New: func() any { return new([4096]byte) }}

// removeEntries removes every entry of the directory fd.
func removeEntries(fd int) error {
	buf := direntBufs.Get().(*[4096]byte)
	defer direntBufs.Put(buf)
	for {
		n, err := unix.Getdents(fd, buf[:])
		if err != nil {
			return fmt.Errorf("listing: %w", err)
		}
		if n == 0 {
			return nil
		}
		for b := buf[:n]; len(b) > 0; {
			// struct linux_dirent64: ino, off, reclen, type, name.
			reclen := int(binary.NativeEndian.Uint16(b[16:18]))
			typ := b[18]
			name := b[19:reclen]
			name = name[:bytes.IndexByte(name, 0)]
			b = b[reclen:]
			if string(name) == "." || string(name) == ".." {
				continue
			}
			nm := string(name)
			var err error
			if typ != unix.DT_DIR {
				err = unix.Unlinkat(fd, nm, 0)
			}
			if typ == unix.DT_DIR || errors.Is(err, unix.EISDIR) {
				err = unix.Unlinkat(fd, nm, unix.AT_REMOVEDIR)
				if errors.Is(err, unix.ENOTEMPTY) || errors.Is(err, unix.EEXIST) {
					err = removeTree(fd, nm)
				}
			}
			if err != nil {
				return fmt.Errorf("removing %s: %w", nm, err)
			}
		}
	}
}

// Pending returns the number of background discards in flight: the backlog
// of released layers not yet unmounted and removed.
func (s *Store) Pending() int { return int(s.pending.Load()) }

// Mounts returns the number of layers the store holds, each a tmpfs mounted
// in the server's mount namespace (discards in flight are detached already).
func (s *Store) Mounts() int {
	s.mu.Lock()
	defer s.mu.Unlock()
	return len(s.refs)
}

func (s *Store) discard(id string) {
	d := s.Dir(id)
	// A lazy unmount returns at once; the kernel frees the tmpfs when the
	// last overlay using it goes.
	_ = unix.Unmount(d, unix.MNT_DETACH)
	_ = os.RemoveAll(d)
}

// Reconcile adopts the layers left by an earlier run that are listed in
// keep (each with the number of references it gets) and discards every other
// entry of the store. It returns the kept layers that were missing (their
// tmpfs did not survive, e.g. a reboot).
func (s *Store) Reconcile(keep map[string]int) (missing []string, err error) {
	entries, err := os.ReadDir(s.dir)
	if err != nil {
		return nil, fmt.Errorf("reading layer store: %w", err)
	}
	present := map[string]bool{}
	for _, e := range entries {
		id := e.Name()
		if _, ok := keep[id]; ok && IsMount(s.Dir(id)) {
			present[id] = true
			continue
		}
		s.discard(id)
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	for id, n := range keep {
		if !present[id] {
			missing = append(missing, id)
			continue
		}
		s.refs[id] = n
		s.sizes[id] = used(s.Dir(id))
	}
	return missing, nil
}

// IsMount reports whether dir is a mount point (on another device than
// its parent).
func IsMount(dir string) bool {
	var a, b unix.Stat_t
	if unix.Lstat(dir, &a) != nil || unix.Lstat(filepath.Dir(dir), &b) != nil {
		return false
	}
	return a.Dev != b.Dev
}

// Wait waits for background discards to finish.
func (s *Store) Wait() { s.wg.Wait() }

// Purge unmounts and removes every layer under dir: for tests and for
// wiping a data directory.
func Purge(dir string) error {
	entries, err := os.ReadDir(dir)
	if err != nil {
		if errors.Is(err, os.ErrNotExist) {
			return nil
		}
		return err
	}
	var errs []error
	for _, e := range entries {
		d := filepath.Join(dir, e.Name())
		_ = unix.Unmount(d, unix.MNT_DETACH)
		if err := os.RemoveAll(d); err != nil {
			errs = append(errs, err)
		}
	}
	return errors.Join(errs...)
}
