package overlay

import (
	"encoding/hex"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path"
	"path/filepath"
	"sync"

	"golang.org/x/sys/unix"
)

// Links keeps hard links whole across checkpoints.
//
// A file with several names in a lower layer is copied up by name: a write
// to one name copies that name alone into the upper. With the overlay's
// index (index=on) the copy is recorded in work/index under the lower
// inode's file handle, and the mount shows every other name of the inode
// as the copy, still linked. The index lives only as long as that upper is
// mounted over those lowers, though; once the upper is sealed into a layer
// and stacked under a fresh upper, the other names would show the old
// inode again. Before an upper is sealed, Materialize puts every other
// visible name of each indexed inode into the upper too, as a link to the
// copy, so that the sealed layer holds the whole link group.
//
// Links caches, per lower directory, the names of its inodes that have
// several; lower layers never change, so each is walked once, and only
// when one of its linked files has been copied up. Entries of directories
// that are gone (released layers) are dropped as the cache grows.
type Links struct {
	mu sync.Mutex
	// +checklocks:mu
	names map[string]linkedDir
}

type linkedDir struct {
	dev   uint64
	byIno map[uint64][]string
}

// NewLinks returns an empty cache.
func NewLinks() *Links { return &Links{names: map[string]linkedDir{}} }

// Materialize links the other names of every inode the overlay's index
// (its work/index directory) records into the upper, through the overlay
// itself: root is a directory fd of the overlay's root, lowers its lower
// directories (host paths), top first. Nothing may run in the overlay
// meanwhile. It returns the number of names it linked.
func (l *Links) Materialize(root int, index string, lowers []string) (int, error) {
	seen := map[string]bool{}
	linked := 0
	// A link-up makes no new index entry, unless a name that looked like
	// the inode's was another linked file: go round until none is new.
	for range 4 {
		names, err := listDir(index)
		if errors.Is(err, unix.ENOENT) {
			return linked, nil // no index: the overlay had none
		}
		if err != nil {
			return linked, fmt.Errorf("reading the overlay's index: %w", err)
		}
		fresh := false
		for _, n := range names {
			if seen[n] {
				continue
			}
			seen[n], fresh = true, true
			k, err := l.linkUp(root, filepath.Join(index, n), n, lowers)
			if err != nil {
				return linked, err
			}
			linked += k
		}
		if !fresh {
			break
		}
	}
	return linked, nil
}

// linkUp handles one index entry, named after the hex of the origin's
// file handle in overlayfs's format (struct ovl_fb: version, magic 0xfb,
// length, flags, handle type, the filesystem's uuid, then the handle).
func (l *Links) linkUp(root int, entry, name string, lowers []string) (int, error) {
	var est unix.Stat_t
	if err := unix.Lstat(entry, &est); err != nil {
		if errors.Is(err, unix.ENOENT) {
			return 0, nil
		}
		return 0, &os.PathError{Op: "lstat", Path: entry, Err: err}
	}
	if est.Mode&unix.S_IFMT == unix.S_IFDIR || est.Mode&unix.S_IFMT == unix.S_IFCHR && est.Rdev == 0 {
		return 0, nil // a directory's entry, or every name gone (a whiteout)
	}
	raw, err := hex.DecodeString(name)
	const hdr = 21 // version, magic, len, flags, type, 16-byte uuid
	if err != nil || len(raw) < hdr || raw[1] != 0xfb || int(raw[2]) > len(raw) || int(raw[2]) < hdr {
		return 0, fmt.Errorf("overlay index entry %q: not a file handle this version knows", name)
	}
	handle := unix.NewFileHandle(int32(raw[4]), raw[hdr:raw[2]])
	dir, ino, ok, err := l.origin(handle, lowers)
	if err != nil || !ok {
		return 0, err
	}
	names, err := l.linkedNames(dir)
	if err != nil {
		return 0, err
	}
	n := 0
	for _, p := range names[ino] {
		pfd, err := unix.Openat2(root, path.Dir(p), &unix.OpenHow{
			Flags:   unix.O_PATH | unix.O_DIRECTORY | unix.O_CLOEXEC,
			Resolve: unix.RESOLVE_IN_ROOT | unix.RESOLVE_NO_SYMLINKS | unix.RESOLVE_NO_MAGICLINKS | unix.RESOLVE_NO_XDEV,
		})
		if err != nil {
			continue // gone, or shadowed by something that is not a directory
		}
		base := path.Base(p)
		var st unix.Stat_t
		err = unix.Fstatat(pfd, base, &st, unix.AT_SYMLINK_NOFOLLOW)
		// overlayfs reports a copied-up inode with its origin's number:
		// a name showing another number is another file over this one.
		if err == nil && st.Ino == ino && st.Mode&unix.S_IFMT == est.Mode&unix.S_IFMT {
			// A change of nothing (owner -1, -1) is still a setattr:
			// the overlay copies the name up, as a link to the copy.
			err = unix.Fchownat(pfd, base, -1, -1, unix.AT_SYMLINK_NOFOLLOW)
			if err != nil {
				unix.Close(pfd)
				return n, fmt.Errorf("linking /%s into the upper: %w", p, err)
			}
			n++
		}
		unix.Close(pfd)
	}
	return n, nil
}

// origin finds the lower directory that holds the inode handle names, and
// the inode's number.
func (l *Links) origin(handle unix.FileHandle, lowers []string) (dir string, ino uint64, ok bool, err error) {
	tried := map[uint64]bool{}
	for _, d := range lowers {
		var dst unix.Stat_t
		if err := unix.Stat(d, &dst); err != nil {
			return "", 0, false, &os.PathError{Op: "stat", Path: d, Err: err}
		}
		if tried[dst.Dev] {
			continue
		}
		tried[dst.Dev] = true
		mfd, err := unix.Open(d, unix.O_RDONLY|unix.O_DIRECTORY|unix.O_CLOEXEC, 0)
		if err != nil {
			return "", 0, false, &os.PathError{Op: "open", Path: d, Err: err}
		}
		fd, err := unix.OpenByHandleAt(mfd, handle, unix.O_PATH|unix.O_CLOEXEC)
		unix.Close(mfd)
		if err != nil {
			continue // another filesystem's handle
		}
		var st unix.Stat_t
		err = unix.Fstat(fd, &st)
		unix.Close(fd)
		if err != nil || st.Dev != dst.Dev {
			continue
		}
		// The lowers on this filesystem: the one whose walk has the inode.
		for _, c := range lowers {
			var cst unix.Stat_t
			if unix.Stat(c, &cst) != nil || cst.Dev != dst.Dev {
				continue
			}
			names, err := l.linkedNames(c)
			if err != nil {
				return "", 0, false, err
			}
			if len(names[st.Ino]) > 0 {
				return c, st.Ino, true, nil
			}
		}
		return "", 0, false, nil
	}
	return "", 0, false, nil
}

// linkedNames returns the names of dir's non-directories that have more
// than one, by inode (walked once, then cached).
func (l *Links) linkedNames(dir string) (map[uint64][]string, error) {
	var dst unix.Stat_t
	if err := unix.Stat(dir, &dst); err != nil {
		return nil, &os.PathError{Op: "stat", Path: dir, Err: err}
	}
	l.mu.Lock()
	c, ok := l.names[dir]
	l.mu.Unlock()
	if ok && c.dev == dst.Dev {
		return c.byIno, nil
	}
	m := map[uint64][]string{}
	err := filepath.WalkDir(dir, func(p string, e fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		if e.IsDir() {
			return nil
		}
		var st unix.Stat_t
		if err := unix.Lstat(p, &st); err != nil {
			return &os.PathError{Op: "lstat", Path: p, Err: err}
		}
		if st.Nlink > 1 {
			rel, _ := filepath.Rel(dir, p)
			m[st.Ino] = append(m[st.Ino], rel)
		}
		return nil
	})
	if err != nil {
		return nil, fmt.Errorf("listing the hard links of a layer: %w", err)
	}
	l.mu.Lock()
	defer l.mu.Unlock()
	if len(l.names) >= 64 {
		for d, c := range l.names {
			var st unix.Stat_t
			if unix.Stat(d, &st) != nil || st.Dev != c.dev {
				delete(l.names, d)
			}
		}
	}
	l.names[dir] = linkedDir{dev: dst.Dev, byIno: m}
	return m, nil
}

// IndexEmpty reports whether the overlay index directory index (work/index)
// has no entry: no linked file was copied up, nothing to materialize.
func IndexEmpty(index string) bool {
	f, err := os.Open(index)
	if err != nil {
		return errors.Is(err, fs.ErrNotExist)
	}
	defer f.Close()
	names, _ := f.Readdirnames(1)
	return len(names) == 0
}

// listDir lists a directory's names.
func listDir(dir string) ([]string, error) {
	f, err := os.Open(dir)
	if err != nil {
		return nil, err
	}
	defer f.Close()
	return f.Readdirnames(-1)
}
