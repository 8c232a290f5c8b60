package sandbox

import (
	"context"
	"errors"
	"fmt"
	"os"
	"slices"
	"strings"
	"time"

	"golang.org/x/sys/unix"
)

// The tree actions (ListDir, Stat, Remove, MakeDir, and Upload and Download
// in files_tar.go) resolve a path's parents as the other file actions do
// (fileOp: in the sandbox's root, as its user) and then work below that
// parent's descriptor one name at a time: each step down opens a single name
// with beneath (no "..", no symlink, no other mount), and each change is an
// *at call relative to a directory descriptor. A name a racing process swaps
// for a symlink is then the symlink itself (unlinked, listed, refused as a
// parent), never what it points to.

// Limits of the tree actions.
const (
	// MaxListEntries bounds the entries a ListDir returns.
	MaxListEntries = 10000
	// MaxTreeDepth bounds how many directories deep a walk goes: it holds a
	// descriptor per level.
	MaxTreeDepth = 256
)

// raceHook, set only by tests, runs where a walk has checked a name of a
// directory and is about to open it: a test swaps the name there, as a
// racing process of the sandbox could.
var raceHook func(dir int, name string)

// beneath resolves one name below a directory descriptor: no "..", no
// symlink, no other mount.
const beneath = unix.RESOLVE_BENEATH | unix.RESOLVE_NO_SYMLINKS | unix.RESOLVE_NO_XDEV | unix.RESOLVE_NO_MAGICLINKS

// FileType is the type of a path in a sandbox.
type FileType int

// File types.
const (
	TypeFile FileType = iota + 1
	TypeDir
	TypeSymlink
	TypeOther // a FIFO, a socket or a device
)

// FileInfo describes a path in a sandbox, as lstat sees it.
type FileInfo struct {
	// Path is relative to the listed directory (ListDir), or as asked (Stat).
	Path string
	Type FileType
	Size int64
	// Mode holds the permission bits with setuid, setgid and sticky (07777).
	Mode    uint32
	ModTime time.Time
	// Target is a symlink's target.
	Target string
}

// fileInfo describes the file st, named path; a symlink's target is read
// by name from the directory dir.
func fileInfo(path string, st *unix.Stat_t, dir int, name string) FileInfo {
	fi := FileInfo{Path: path, Size: st.Size, Mode: st.Mode & 0o7777, ModTime: time.Unix(st.Mtim.Unix())}
	switch st.Mode & unix.S_IFMT {
	case unix.S_IFREG:
		fi.Type = TypeFile
	case unix.S_IFDIR:
		fi.Type = TypeDir
	case unix.S_IFLNK:
		fi.Type = TypeSymlink
		fi.Target, _ = readlinkAt(dir, name)
	default:
		fi.Type = TypeOther
	}
	return fi
}

// readlinkAt reads the target of the symlink name in dir.
func readlinkAt(dir int, name string) (string, error) {
	buf := make([]byte, 4096)
	n, err := unix.Readlinkat(dir, name, buf)
	if err != nil {
		return "", err
	}
	return string(buf[:n]), nil
}

// splitLast splits rel (relative to the root, not empty) into its parent,
// resolved in the root, and its last name, which is not followed. A last
// name of "." or ".." names no entry of its parent: ErrInvalid
// (CheckEntryPath).
func splitLast(shown, rel string) (parent, name string, err error) {
	rel = strings.TrimRight(rel, "/")
	parent, name = ".", rel
	if i := strings.LastIndexByte(rel, '/'); i >= 0 {
		parent, name = rel[:i], rel[i+1:]
	}
	if name == "." || name == ".." || name == "" {
		return "", "", fmt.Errorf("%w: path %.80q ends in %q: name the entry itself", ErrInvalid, shown, name)
	}
	return parent, name, nil
}

// CheckEntryPath refuses, as Remove, MakeDir and Download would whatever the
// sandbox holds, a path that names no entry of a directory: one ending in "."
// or "..", or the root.
func CheckEntryPath(path string) error {
	if err := CheckPath(path); err != nil {
		return err
	}
	rel := strings.TrimRight(path, "/")
	if rel == "" {
		return fmt.Errorf("%w: the sandbox's root itself: name an entry below it", ErrInvalid)
	}
	_, _, err := splitLast(path, rel)
	return err
}

// openParent opens the parent of rel (splitLast) as an O_PATH directory.
func openParent(root int, parent string) (int, error) {
	return unix.Openat2(root, parent, &unix.OpenHow{Flags: unix.O_PATH | unix.O_DIRECTORY | unix.O_CLOEXEC, Resolve: resolve})
}

// Stat describes path without following a final symlink; a missing path
// (or one below a file) is not an error: ok is false. A path ending in "."
// or ".." describes the directory it resolves to.
func (s *Sandbox) Stat(ctx context.Context, path string) (fi FileInfo, ok bool, err error) {
	err = s.fileOpIn(path, true, func(root int, rel string) error {
		var st unix.Stat_t
		if strings.Trim(rel, "/") == "" {
			if err := unix.Fstat(root, &st); err != nil {
				return err
			}
			fi, ok = fileInfo(path, &st, root, ""), true
			return nil
		}
		parent, name, err := splitLast(path, rel)
		if err != nil {
			// A path ending in "." or "..": the directory it resolves to.
			parent, name = strings.TrimRight(rel, "/"), "."
		}
		dir, err := openParent(root, parent)
		if errors.Is(err, unix.ENOENT) || errors.Is(err, unix.ENOTDIR) {
			return nil
		}
		if err != nil {
			return err
		}
		defer unix.Close(dir)
		err = unix.Fstatat(dir, name, &st, unix.AT_SYMLINK_NOFOLLOW)
		if errors.Is(err, unix.ENOENT) || errors.Is(err, unix.ENOTDIR) {
			return nil
		}
		if err != nil {
			return err
		}
		fi, ok = fileInfo(path, &st, dir, name), true
		return nil
	})
	return fi, ok, err
}

// ListDir lists the directory path (a final symlink resolved in the root,
// as `ls path/` would) down to depth levels (0 and 1: its own entries), at
// most max entries (0 or more than MaxListEntries: MaxListEntries), sorted
// by path. Entries are described as lstat sees them: symlinks are listed,
// never followed, and mount points are listed but not entered. truncated
// says entries were left out.
func (s *Sandbox) ListDir(ctx context.Context, path string, depth, max int) (entries []FileInfo, truncated bool, err error) {
	if depth < 0 || max < 0 {
		return nil, false, fmt.Errorf("%w: negative depth or max_entries", ErrInvalid)
	}
	if depth > MaxTreeDepth {
		return nil, false, fmt.Errorf("%w: depth %d: at most %d", ErrInvalid, depth, MaxTreeDepth)
	}
	if max == 0 || max > MaxListEntries {
		max = MaxListEntries
	}
	err = s.fileOpIn(path, true, func(root int, rel string) error {
		fd, err := unix.Openat2(root, cmpDot(rel), &unix.OpenHow{Flags: unix.O_RDONLY | unix.O_DIRECTORY | unix.O_CLOEXEC, Resolve: resolve})
		if errors.Is(err, unix.ENOTDIR) {
			return &FileError{Path: path, Errno: unix.ENOTDIR, Msg: "not a directory"}
		}
		if err != nil {
			return err
		}
		defer unix.Close(fd)
		l := &lister{ctx: ctx, max: max, depth: max1(depth)}
		err = l.list(fd, "", 1)
		entries, truncated = l.entries, l.truncated
		return err
	})
	if err != nil {
		return nil, false, err
	}
	slices.SortFunc(entries, func(a, b FileInfo) int { return strings.Compare(a.Path, b.Path) })
	return entries, truncated, nil
}

// cmpDot is rel, or "." for the root.
func cmpDot(rel string) string {
	if rel = strings.Trim(rel, "/"); rel == "" {
		return "."
	}
	return rel
}

func max1(n int) int { return max(n, 1) }

// lister is one ListDir's walk.
type lister struct {
	ctx       context.Context
	max       int
	depth     int
	entries   []FileInfo
	truncated bool
}

// list adds the entries of the directory fd, named prefix (relative to the
// listed one), which is level levels below it, and of its subdirectories.
func (l *lister) list(fd int, prefix string, level int) error {
	names, more, err := readNamesMax(fd, l.max+1-len(l.entries))
	if err != nil {
		return err
	}
	l.truncated = l.truncated || more
	slices.Sort(names)
	for _, name := range names {
		if err := l.ctx.Err(); err != nil {
			return err
		}
		if len(l.entries) == l.max {
			l.truncated = true
			return nil
		}
		var st unix.Stat_t
		if err := unix.Fstatat(fd, name, &st, unix.AT_SYMLINK_NOFOLLOW); err != nil {
			if errors.Is(err, unix.ENOENT) { // removed since it was listed
				continue
			}
			return err
		}
		l.entries = append(l.entries, fileInfo(prefix+name, &st, fd, name))
		if st.Mode&unix.S_IFMT != unix.S_IFDIR || level >= l.depth {
			continue
		}
		sub, err := unix.Openat2(fd, name, &unix.OpenHow{Flags: unix.O_RDONLY | unix.O_DIRECTORY | unix.O_NOFOLLOW | unix.O_CLOEXEC, Resolve: beneath})
		switch {
		case errors.Is(err, unix.EXDEV), errors.Is(err, unix.ELOOP), errors.Is(err, unix.ENOTDIR),
			errors.Is(err, unix.ENOENT), errors.Is(err, unix.EACCES):
			continue // a mount point, a name swapped since, or one the user may not read: listed, not entered
		case err != nil:
			return err
		}
		err = l.list(sub, prefix+name+"/", level+1)
		unix.Close(sub)
		if err != nil {
			return err
		}
	}
	return nil
}

// readNamesMax lists up to n names of the directory open as fd, without "."
// and "..", and says whether it has more.
func readNamesMax(fd, n int) (names []string, more bool, err error) {
	buf := make([]byte, 8<<10)
	for {
		k, err := unix.ReadDirent(fd, buf)
		if err == unix.EINTR {
			continue
		}
		if err != nil {
			return nil, false, err
		}
		if k <= 0 {
			return names, false, nil
		}
		if len(names) >= n {
			return names, true, nil
		}
		_, _, names = unix.ParseDirent(buf[:k], -1, names)
		if len(names) > n {
			return names[:n], true, nil
		}
	}
}

// Remove removes path (a final symlink is removed, not followed): a file, a
// symlink, an empty directory, or with recursive a directory with its tree.
// A missing path is not an error: it returns 0. It returns how many paths it
// removed. The sandbox's root cannot be removed (ErrInvalid).
func (s *Sandbox) Remove(ctx context.Context, path string, recursive bool) (removed int64, err error) {
	err = s.fileOpIn(path, true, func(root int, rel string) error {
		if strings.Trim(rel, "/") == "" {
			return fmt.Errorf("%w: the sandbox's root cannot be removed", ErrInvalid)
		}
		parent, name, err := splitLast(path, rel)
		if err != nil {
			return err
		}
		dir, err := openParent(root, parent)
		if errors.Is(err, unix.ENOENT) {
			return nil
		}
		if err != nil {
			return err
		}
		defer unix.Close(dir)
		r := &remover{ctx: ctx, recursive: recursive}
		err = r.remove(dir, name, 0)
		removed = r.removed
		return withPath(path, err)
	})
	return removed, err
}

// A directory is emptied removeBatch names at a time, at most maxRemoveRounds
// times (4M entries).
const (
	removeBatch     = 1024
	maxRemoveRounds = 4096
)

// remover is one Remove's walk.
type remover struct {
	ctx       context.Context
	recursive bool
	removed   int64
}

// remove removes name from the directory dir, with its tree when recursive;
// depth is dir's below the removed path's parent.
func (r *remover) remove(dir int, name string, depth int) error {
	err := unix.Unlinkat(dir, name, 0)
	switch {
	case err == nil:
		r.removed++
		return nil
	case errors.Is(err, unix.ENOENT) && depth == 0:
		return nil
	case !errors.Is(err, unix.EISDIR):
		return err
	}
	if !r.recursive {
		if err := unix.Unlinkat(dir, name, unix.AT_REMOVEDIR); err != nil {
			return err
		}
		r.removed++
		return nil
	}
	if depth >= MaxTreeDepth {
		return &FileError{Errno: unix.ELOOP, Msg: fmt.Sprintf("nested more than %d directories deep: remove its deepest part first", MaxTreeDepth)}
	}
	if raceHook != nil {
		raceHook(dir, name)
	}
	// O_NOFOLLOW with beneath: a name swapped for a symlink since the
	// unlink is refused (ELOOP, ENOTDIR), not followed.
	fd, err := unix.Openat2(dir, name, &unix.OpenHow{Flags: unix.O_RDONLY | unix.O_DIRECTORY | unix.O_NOFOLLOW | unix.O_CLOEXEC, Resolve: beneath})
	if err != nil {
		return err
	}
	defer unix.Close(fd)
	for round := 0; ; round++ {
		if err := r.ctx.Err(); err != nil {
			return err
		}
		if round == maxRemoveRounds {
			// A process of the sandbox filling it as fast as it is emptied.
			return &FileError{Errno: unix.ENOTEMPTY, Msg: "kept filling while it was removed"}
		}
		names, more, err := readNamesMax(fd, removeBatch)
		if err != nil {
			return err
		}
		for _, n := range names {
			if err := r.remove(fd, n, depth+1); err != nil && !errors.Is(err, unix.ENOENT) {
				return err
			}
		}
		if !more {
			break
		}
		if _, err := unix.Seek(fd, 0, 0); err != nil { // the names read are gone: read afresh
			return err
		}
	}
	if err := unix.Unlinkat(dir, name, unix.AT_REMOVEDIR); err != nil {
		return err
	}
	r.removed++
	return nil
}

// MakeDir creates the directory path with mode (0: 0755; permission bits,
// setgid and sticky). With parents, missing parents are created (0755) and
// an existing directory is no error. created says path did not exist.
func (s *Sandbox) MakeDir(ctx context.Context, path string, mode os.FileMode, parents bool) (created bool, err error) {
	perm, err := dirMode(mode)
	if err != nil {
		return false, err
	}
	err = s.fileOpIn(path, true, func(root int, rel string) error {
		if strings.Trim(rel, "/") == "" {
			if parents {
				return nil
			}
			return unix.EEXIST
		}
		parent, name, err := splitLast(path, rel)
		if err != nil {
			return err
		}
		if parents {
			if err := mkdirAll(root, parent+"/"+name); err != nil {
				return err
			}
		}
		dir, err := openParent(root, parent)
		if err != nil {
			return err
		}
		defer unix.Close(dir)
		if err = unix.Mkdirat(dir, name, 0o700); errors.Is(err, unix.EEXIST) && parents {
			// What exists is a directory if it opens as one, a symlink
			// resolved in the root as the sandbox would.
			fd, err := unix.Openat2(root, parent+"/"+name, &unix.OpenHow{Flags: unix.O_PATH | unix.O_DIRECTORY | unix.O_CLOEXEC, Resolve: resolve})
			if errors.Is(err, unix.ENOTDIR) {
				return &FileError{Path: path, Errno: unix.EEXIST, Msg: "exists, not as a directory"}
			}
			if err == nil {
				unix.Close(fd)
			}
			return err
		}
		if err != nil {
			return err
		}
		created = true
		return chmodDirAt(dir, name, perm)
	})
	return created, err
}

// withPath gives a *FileError of err that names no path the path.
func withPath(path string, err error) error {
	var fe *FileError
	if errors.As(err, &fe) && fe.Path == "" {
		fe.Path = path
	}
	return err
}

// dirMode checks a directory's mode: permission bits, setgid and sticky.
func dirMode(mode os.FileMode) (uint32, error) {
	if mode == 0 {
		return 0o755, nil
	}
	m := uint32(mode.Perm())
	rest := mode &^ os.ModePerm
	if rest&os.ModeSetgid != 0 {
		m |= unix.S_ISGID
	}
	if rest&os.ModeSticky != 0 {
		m |= unix.S_ISVTX
	}
	if rest&^(os.ModeSetgid|os.ModeSticky) != 0 {
		return 0, fmt.Errorf("%w: mode %v has bits other than permissions, setgid and sticky", ErrInvalid, mode)
	}
	return m, nil
}

// chmodDirAt sets the mode of the directory name in dir, through a
// descriptor of it (fchmodat would follow a name swapped for a symlink).
func chmodDirAt(dir int, name string, mode uint32) error {
	fd, err := unix.Openat2(dir, name, &unix.OpenHow{Flags: unix.O_RDONLY | unix.O_DIRECTORY | unix.O_NOFOLLOW | unix.O_CLOEXEC, Resolve: beneath})
	if err != nil {
		return err
	}
	defer unix.Close(fd)
	return unix.Fchmod(fd, mode)
}
