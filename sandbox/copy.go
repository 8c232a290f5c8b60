package sandbox

import (
	"context"
	"errors"
	"fmt"
	"os"
	"path"
	"strconv"
	"strings"

	"golang.org/x/sys/unix"

	"github.com/deltagym/deltagym/sandbox/fscred"
)

// Copies between sandboxes (CopyFrom) and into a sandbox from a host directory (CopyDirIn)
// run in the server, on descriptors: a source entry is opened O_PATH|O_NOFOLLOW below its
// parent's descriptor with RESOLVE_NO_SYMLINKS, RESOLVE_NO_XDEV and RESOLVE_BENEATH, its type
// is read with fstat on that descriptor, and a regular file or directory is then read by
// reopening that descriptor (/proc/self/fd), never by its name again: a name swapped for a
// symlink, FIFO or device after the check still reads the inode that was checked. Only
// regular files and directories are copied; anything else, a symlink on the way to a path,
// or a copy past its limits is refused with ErrUncopyable. The destination is written as
// the destination sandbox's user (its host ids as fsuid and fsgid), as the file actions
// write, with its file capabilities so that every source file can be read.

// Default limits of a copy (CopyLimits).
const (
	DefaultCopyBytes   = 64 << 20
	DefaultCopyEntries = 10000
	// maxCopyDepth bounds the nesting of a copied tree: the walk holds two descriptors per
	// level.
	maxCopyDepth = 64
)

// CopyLimits bounds one copy. Zero means the default.
type CopyLimits struct {
	MaxBytes   int64
	MaxEntries int
}

// CopyStats is what a copy copied.
type CopyStats struct {
	Bytes   int64
	Entries int
}

// CopyFrom copies each of paths (absolute, as src sees them) from src's filesystem to the
// same path in s, replacing what s has there and creating missing parents. A path src lacks
// is skipped, leaving s's as it is. The caller keeps src's commands from changing it in the
// meantime if it needs a consistent copy; the copy itself is safe whatever they do.
func (s *Sandbox) CopyFrom(ctx context.Context, src *Sandbox, paths []string, lim CopyLimits) (CopyStats, error) {
	rels := make([]string, len(paths))
	for i, p := range paths {
		rel, err := copyRel(p)
		if err != nil {
			return CopyStats{}, err
		}
		rels[i] = rel
	}
	// Both ops before either root (the package's lock order), the source's first.
	if _, err := src.beginExec(); err != nil {
		src.op.RUnlock()
		return CopyStats{}, err
	}
	defer src.op.RUnlock()
	if _, err := s.beginExec(); err != nil {
		s.op.RUnlock()
		return CopyStats{}, err
	}
	defer s.op.RUnlock()
	c := s.copier(lim)
	err := src.withRootFor("", func(sroot int) error {
		return s.copyInto(func(droot int) error {
			for i, rel := range rels {
				if err := ctx.Err(); err != nil {
					return err
				}
				fd, err := unix.Openat2(sroot, rel, &unix.OpenHow{Flags: unix.O_PATH | unix.O_NOFOLLOW | unix.O_CLOEXEC, Resolve: copyResolve})
				switch {
				case errors.Is(err, unix.ENOENT), errors.Is(err, unix.ENOTDIR):
					continue
				case errors.Is(err, unix.ELOOP), errors.Is(err, unix.EXDEV):
					return fmt.Errorf("%s: a symbolic link or another filesystem on its way: %w", paths[i], ErrUncopyable)
				case err != nil:
					return fmt.Errorf("opening %s: %w", paths[i], err)
				}
				err = c.top(fd, droot, rel, paths[i])
				unix.Close(fd)
				if err != nil {
					return err
				}
			}
			return nil
		})
	})
	return c.stats, err
}

// CopyDirIn copies the tree of the host directory dir (any descriptor of it) to dst (an
// absolute path) in s, replacing what s has there.
func (s *Sandbox) CopyDirIn(ctx context.Context, dir *os.File, dst string, lim CopyLimits) (CopyStats, error) {
	rel, err := copyRel(dst)
	if err != nil {
		return CopyStats{}, err
	}
	fd, err := unix.Openat2(int(dir.Fd()), ".", &unix.OpenHow{Flags: unix.O_PATH | unix.O_DIRECTORY | unix.O_CLOEXEC})
	if err != nil {
		return CopyStats{}, fmt.Errorf("opening the directory to copy: %w", err)
	}
	defer unix.Close(fd)
	if _, err := s.beginExec(); err != nil {
		s.op.RUnlock()
		return CopyStats{}, err
	}
	defer s.op.RUnlock()
	c := s.copier(lim)
	err = s.copyInto(func(droot int) error {
		if err := ctx.Err(); err != nil {
			return err
		}
		return c.top(fd, droot, rel, dst)
	})
	return c.stats, err
}

// copyResolve resolves a copy's source paths: no symlink, no other mount, nothing above.
const copyResolve = unix.RESOLVE_BENEATH | unix.RESOLVE_NO_SYMLINKS | unix.RESOLVE_NO_XDEV | unix.RESOLVE_NO_MAGICLINKS

// copyRel checks an absolute path of a copy and returns it relative to the root.
func copyRel(p string) (string, error) {
	if !strings.HasPrefix(p, "/") || strings.IndexByte(p, 0) >= 0 || len(p) > 4096 || path.Clean(p) != p || p == "/" {
		return "", fmt.Errorf("%w: copy path %q is not a clean absolute path below /", ErrInvalid, p)
	}
	return p[1:], nil
}

// copier creates a copy's state with s's user as the owner of what it writes.
func (s *Sandbox) copier(lim CopyLimits) *copier {
	if lim.MaxBytes <= 0 {
		lim.MaxBytes = DefaultCopyBytes
	}
	if lim.MaxEntries <= 0 {
		lim.MaxEntries = DefaultCopyEntries
	}
	return &copier{lim: lim, buf: make([]byte, 64<<10)}
}

// copyInto runs fn with a descriptor of s's root, on a thread with s's user's fsuid and
// fsgid and the file capabilities (to read any source file). The caller holds s.op (read,
// beginExec), which keeps s alive throughout.
func (s *Sandbox) copyInto(fn func(root int) error) error {
	uid, gid := s.hostID+int(s.spec.UID), s.hostID+int(s.spec.GID)
	err := s.withRootFor("", func(root int) error {
		return fscred.Run(uid, gid, true, func() error { return fn(root) })
	})
	if errors.Is(err, unix.ENOSPC) || errors.Is(err, unix.EDQUOT) {
		return fmt.Errorf("the destination's writable layer is full: %w", ErrUncopyable)
	}
	return err
}

// copier is one copy's walk: its limits and what it copied so far.
type copier struct {
	lim   CopyLimits
	stats CopyStats
	buf   []byte
}

// top copies the source src (an O_PATH descriptor) to rel below droot (the destination's
// root), replacing what is there; shown names the source in errors.
func (c *copier) top(src, droot int, rel, shown string) error {
	parent, name := path.Split(rel)
	dir := droot
	if parent = strings.TrimSuffix(parent, "/"); parent != "" {
		if err := mkdirAll(droot, rel); err != nil {
			return fmt.Errorf("creating the parents of /%s: %w", rel, err)
		}
		fd, err := unix.Openat2(droot, parent, &unix.OpenHow{Flags: unix.O_PATH | unix.O_DIRECTORY | unix.O_CLOEXEC, Resolve: resolve})
		if err != nil {
			return fmt.Errorf("opening /%s: %w", parent, err)
		}
		defer unix.Close(fd)
		dir = fd
	}
	if err := removeAt(dir, name, 0); err != nil {
		return fmt.Errorf("removing /%s: %w", rel, err)
	}
	return c.entry(src, dir, name, shown, 0)
}

// entry copies src (an O_PATH descriptor) to name in the destination directory dir.
func (c *copier) entry(src, dir int, name, shown string, depth int) error {
	var st unix.Stat_t
	if err := unix.Fstat(src, &st); err != nil {
		return fmt.Errorf("%s: %w", shown, err)
	}
	c.stats.Entries++
	if c.stats.Entries > c.lim.MaxEntries {
		return fmt.Errorf("more than %d files and directories: %w", c.lim.MaxEntries, ErrUncopyable)
	}
	mode := uint32(st.Mode & 0o777)
	switch st.Mode & unix.S_IFMT {
	case unix.S_IFREG:
		return c.file(src, &st, dir, name, shown, mode)
	case unix.S_IFDIR:
		if depth >= maxCopyDepth {
			return fmt.Errorf("%s: nested more than %d directories deep: %w", shown, maxCopyDepth, ErrUncopyable)
		}
		return c.dir(src, dir, name, shown, mode, depth)
	}
	return fmt.Errorf("%s is %s, not a regular file or directory: %w", shown, fileType(st.Mode), ErrUncopyable)
}

// reopen opens what the O_PATH descriptor src holds, by the descriptor, and checks it is
// still the inode st describes.
func reopen(src int, st *unix.Stat_t, flags int) (int, error) {
	fd, err := unix.Open("/proc/self/fd/"+strconv.Itoa(src), flags|unix.O_CLOEXEC|unix.O_NOCTTY|unix.O_NONBLOCK, 0)
	if err != nil {
		return -1, err
	}
	var now unix.Stat_t
	if err := unix.Fstat(fd, &now); err != nil || now.Dev != st.Dev || now.Ino != st.Ino {
		unix.Close(fd)
		return -1, fmt.Errorf("reopened a different file: %w", unix.ESTALE)
	}
	return fd, nil
}

// file copies the regular file src to a new file name in dir.
func (c *copier) file(src int, st *unix.Stat_t, dir int, name, shown string, mode uint32) error {
	if c.stats.Bytes+st.Size > c.lim.MaxBytes {
		return fmt.Errorf("more than %d bytes (at %s): %w", c.lim.MaxBytes, shown, ErrUncopyable)
	}
	in, err := reopen(src, st, unix.O_RDONLY)
	if err != nil {
		return fmt.Errorf("opening %s: %w", shown, err)
	}
	defer unix.Close(in)
	out, err := unix.Openat(dir, name, unix.O_WRONLY|unix.O_CREAT|unix.O_EXCL|unix.O_NOFOLLOW|unix.O_CLOEXEC, 0o600)
	if err != nil {
		return fmt.Errorf("creating the copy of %s: %w", shown, err)
	}
	defer unix.Close(out)
	for {
		n, err := unix.Read(in, c.buf)
		if err == unix.EINTR {
			continue
		}
		if err != nil {
			return fmt.Errorf("reading %s: %w", shown, err)
		}
		if n == 0 {
			break
		}
		// The file may grow while it is read: the cap holds for what is read.
		if c.stats.Bytes += int64(n); c.stats.Bytes > c.lim.MaxBytes {
			return fmt.Errorf("more than %d bytes (at %s): %w", c.lim.MaxBytes, shown, ErrUncopyable)
		}
		if err := writeFull(out, c.buf[:n]); err != nil {
			return fmt.Errorf("writing the copy of %s: %w", shown, err)
		}
	}
	return unix.Fchmod(out, mode)
}

// dir copies the directory src, and its tree, to a new directory name in dir.
func (c *copier) dir(src, dir int, name, shown string, mode uint32, depth int) error {
	var st unix.Stat_t
	if err := unix.Fstat(src, &st); err != nil {
		return err
	}
	in, err := reopen(src, &st, unix.O_RDONLY|unix.O_DIRECTORY)
	if err != nil {
		return fmt.Errorf("opening %s: %w", shown, err)
	}
	names, err := readNames(in)
	unix.Close(in)
	if err != nil {
		return fmt.Errorf("listing %s: %w", shown, err)
	}
	if err := unix.Mkdirat(dir, name, 0o700); err != nil {
		return fmt.Errorf("creating the copy of %s: %w", shown, err)
	}
	out, err := unix.Openat(dir, name, unix.O_PATH|unix.O_DIRECTORY|unix.O_NOFOLLOW|unix.O_CLOEXEC, 0)
	if err != nil {
		return fmt.Errorf("opening the copy of %s: %w", shown, err)
	}
	defer unix.Close(out)
	for _, n := range names {
		fd, err := unix.Openat2(src, n, &unix.OpenHow{Flags: unix.O_PATH | unix.O_NOFOLLOW | unix.O_CLOEXEC, Resolve: copyResolve})
		if errors.Is(err, unix.ENOENT) { // removed since it was listed
			continue
		}
		if err != nil {
			return fmt.Errorf("opening %s/%s: %w", shown, n, err)
		}
		err = c.entry(fd, out, n, strings.TrimSuffix(shown, "/")+"/"+n, depth+1)
		unix.Close(fd)
		if err != nil {
			return err
		}
	}
	return unix.Fchmodat(dir, name, mode, 0)
}

// readNames lists the directory open as fd, without "." and "..".
func readNames(fd int) ([]string, error) {
	var names []string
	buf := make([]byte, 8<<10)
	for {
		n, err := unix.ReadDirent(fd, buf)
		if err == unix.EINTR {
			continue
		}
		if err != nil {
			return nil, err
		}
		if n <= 0 {
			return names, nil
		}
		_, _, names = unix.ParseDirent(buf[:n], -1, names)
	}
}

// removeAt removes name from the directory dir, with its tree if it is a directory. Nothing
// there is not an error.
func removeAt(dir int, name string, depth int) error {
	err := unix.Unlinkat(dir, name, 0)
	if err == nil || errors.Is(err, unix.ENOENT) {
		return nil
	}
	if !errors.Is(err, unix.EISDIR) {
		return err
	}
	if depth >= 4096 {
		return fmt.Errorf("a tree nested too deep to remove: %w", unix.ELOOP)
	}
	fd, err := unix.Openat(dir, name, unix.O_RDONLY|unix.O_DIRECTORY|unix.O_NOFOLLOW|unix.O_CLOEXEC, 0)
	if err != nil {
		return err
	}
	names, err := readNames(fd)
	if err == nil {
		for _, n := range names {
			if err = removeAt(fd, n, depth+1); err != nil {
				break
			}
		}
	}
	unix.Close(fd)
	if err != nil {
		return err
	}
	return unix.Unlinkat(dir, name, unix.AT_REMOVEDIR)
}
