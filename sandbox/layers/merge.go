package layers

import (
	"errors"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"slices"
	"strings"

	"golang.org/x/sys/unix"
)

const opaqueXattr = "trusted.overlay.opaque"

// Merge squashes overlay layers srcs (bottom first) into the empty directory
// dst, so that dst over the layers below (bottom first: the image's) shows
// what srcs over them show:
//
//   - a whiteout (0:0 char device) removes what dst has at its path, and
//     stays a whiteout only where it hides something: where a layer below
//     has the path, and not inside an opaque directory. A whiteout that
//     hides nothing must go: overlayfs lists a directory that only one layer
//     has (or an opaque one) as it is, whiteouts included;
//   - an opaque directory replaces what dst has and stays opaque;
//   - a directory over a whiteout or a non-directory becomes opaque (nothing
//     below showed through); over an opaque one it stays opaque;
//   - any other entry replaces what dst has at its path.
//
// Owners, modes, times, xattrs (but overlay's own bookkeeping xattrs other
// than the opaque mark) and hard links within a layer are kept.
func Merge(dst string, srcs, below []string) error {
	m := merger{dst: dst, below: below}
	for _, src := range srcs {
		m.src = src
		m.links = map[[2]uint64]string{}
		if err := m.dir("", false); err != nil {
			return fmt.Errorf("merging layer %s: %w", src, err)
		}
	}
	return nil
}

type merger struct {
	src, dst string
	below    []string
	links    map[[2]uint64]string
}

// hidesSomething reports whether a layer below has rel (not as a whiteout).
func (m *merger) hidesSomething(rel string) bool {
	for _, b := range m.below {
		var st unix.Stat_t
		if unix.Lstat(filepath.Join(b, rel), &st) == nil && (st.Mode&unix.S_IFMT != unix.S_IFCHR || st.Rdev != 0) {
			return true
		}
	}
	return false
}

func (m *merger) dir(rel string, inOpaque bool) error {
	return mergeDir(m, m.src, m.dst, rel, m.links, inOpaque)
}

func mergeDir(m *merger, srcRoot, dstRoot, rel string, links map[[2]uint64]string, inOpaque bool) error {
	entries, err := os.ReadDir(filepath.Join(srcRoot, rel))
	if err != nil {
		return err
	}
	for _, e := range entries {
		me := mergeEntry{m: m, srcRoot: srcRoot, dstRoot: dstRoot, rel: filepath.Join(rel, e.Name()), links: links, inOpaque: inOpaque}
		if err := me.merge(); err != nil {
			return err
		}
	}
	return nil
}

// mergeEntry is one entry of a layer merged onto the layer below it.
type mergeEntry struct {
	m                *merger
	srcRoot, dstRoot string
	rel              string
	links            map[[2]uint64]string // first name merged of each hard-linked file
	inOpaque         bool                 // under an opaque directory or a whiteout
	src, dst         string
	st, dt           unix.Stat_t // of src; of dst if dstExists
	dstExists        bool
}

// merge puts the entry at its place in the destination: a whiteout kept
// only where it hides something, a directory merged into the one there,
// anything else copied over what is there (or linked to its first name).
func (e *mergeEntry) merge() error {
	e.src = filepath.Join(e.srcRoot, e.rel)
	e.dst = filepath.Join(e.dstRoot, e.rel)
	if err := unix.Lstat(e.src, &e.st); err != nil {
		return err
	}
	e.dstExists = unix.Lstat(e.dst, &e.dt) == nil
	switch e.st.Mode & unix.S_IFMT {
	case unix.S_IFCHR:
		if e.st.Rdev == 0 {
			return e.whiteout()
		}
	case unix.S_IFDIR:
		return e.dir()
	}
	return e.file()
}

// whiteout removes what the destination has at the entry, and keeps the
// whiteout itself only if a layer below still has something there.
func (e *mergeEntry) whiteout() error {
	if err := removeAll(e.dst, e.dstExists); err != nil {
		return err
	}
	if e.inOpaque || !e.m.hidesSomething(e.rel) {
		return nil
	}
	if err := unix.Mknod(e.dst, unix.S_IFCHR, 0); err != nil {
		return err
	}
	return copyMeta(e.src, e.dst, &e.st, false)
}

// dir merges a directory into the destination's, replacing what is there
// if it is not a directory or the source is opaque.
func (e *mergeEntry) dir() error {
	srcOpaque := isOpaque(e.src)
	dstDir := e.dstExists && e.dt.Mode&unix.S_IFMT == unix.S_IFDIR
	// Below a whiteout or an opaque dir, nothing of the lower stack shows
	// through: keep it hidden.
	opaque := srcOpaque || (e.dstExists && !dstDir) || (dstDir && isOpaque(e.dst))
	if srcOpaque || (e.dstExists && !dstDir) {
		if err := removeAll(e.dst, e.dstExists); err != nil {
			return err
		}
		dstDir = false
	}
	if !dstDir {
		if err := unix.Mkdir(e.dst, 0o700); err != nil {
			return err
		}
	}
	if err := mergeDir(e.m, e.srcRoot, e.dstRoot, e.rel, e.links, e.inOpaque || opaque); err != nil {
		return err
	}
	// overlayfs shows a merged directory with the upper copy's xattrs alone: those of a
	// lower copy go.
	if dstDir {
		if err := dropXattrsNotIn(e.src, e.dst); err != nil {
			return err
		}
	}
	if err := copyMeta(e.src, e.dst, &e.st, false); err != nil {
		return err
	}
	if opaque {
		return unix.Lsetxattr(e.dst, opaqueXattr, []byte("y"), 0)
	}
	return nil
}

// file replaces what the destination has at the entry with a copy of it,
// or a hard link to the copy of a file with the same inode.
func (e *mergeEntry) file() error {
	if err := removeAll(e.dst, e.dstExists); err != nil {
		return err
	}
	key := [2]uint64{e.st.Dev, e.st.Ino}
	if first, ok := e.links[key]; ok && e.st.Nlink > 1 {
		return unix.Link(filepath.Join(e.dstRoot, first), e.dst)
	}
	if err := copyEntry(e.src, e.dst, &e.st, false); err != nil {
		return err
	}
	if e.st.Nlink > 1 {
		e.links[key] = e.rel
	}
	return nil
}

// copySparse copies in to out, leaving holes where in has blocks of zeros.
func copySparse(out, in *os.File) error {
	buf := make([]byte, 64<<10)
	for {
		n, err := in.Read(buf)
		if n > 0 {
			if allZero(buf[:n]) {
				if _, serr := out.Seek(int64(n), io.SeekCurrent); serr != nil {
					return serr
				}
			} else if _, werr := out.Write(buf[:n]); werr != nil {
				return werr
			}
		}
		if err == io.EOF {
			return nil
		}
		if err != nil {
			return err
		}
	}
}

func allZero(b []byte) bool {
	for _, c := range b {
		if c != 0 {
			return false
		}
	}
	return true
}

func removeAll(p string, exists bool) error {
	if !exists {
		return nil
	}
	return os.RemoveAll(p)
}

func isOpaque(p string) bool {
	buf := make([]byte, 4)
	n, err := unix.Lgetxattr(p, opaqueXattr, buf)
	return err == nil && n == 1 && buf[0] == 'y'
}

// copyEntry copies one non-directory entry with its metadata (see copyMeta).
func copyEntry(src, dst string, st *unix.Stat_t, overlayMarks bool) error {
	switch st.Mode & unix.S_IFMT {
	case unix.S_IFREG:
		in, err := os.Open(src)
		if err != nil {
			return err
		}
		defer in.Close()
		out, err := os.OpenFile(dst, os.O_WRONLY|os.O_CREATE|os.O_EXCL, 0o600)
		if err != nil {
			return err
		}
		err = copySparse(out, in)
		if err == nil {
			// Holes at the end leave the size short: set it.
			err = out.Truncate(st.Size)
		}
		if cerr := out.Close(); err == nil {
			err = cerr
		}
		if err != nil {
			return err
		}
	case unix.S_IFLNK:
		target, err := os.Readlink(src)
		if err != nil {
			return err
		}
		if err := os.Symlink(target, dst); err != nil {
			return err
		}
	case unix.S_IFCHR, unix.S_IFBLK, unix.S_IFIFO, unix.S_IFSOCK:
		if err := unix.Mknod(dst, st.Mode, int(st.Rdev)); err != nil {
			return err
		}
	default:
		return fmt.Errorf("%s: unknown file type %o", src, st.Mode&unix.S_IFMT)
	}
	return copyMeta(src, dst, st, overlayMarks)
}

// copyMeta copies owner, xattrs (overlayfs's trusted.overlay.* marks only if
// overlayMarks), mode and times from src to dst. The owner goes first:
// chown drops security.capability and set-id bits.
func copyMeta(src, dst string, st *unix.Stat_t, overlayMarks bool) error {
	if err := unix.Lchown(dst, int(st.Uid), int(st.Gid)); err != nil {
		return err
	}
	if err := copyXattrs(src, dst, overlayMarks); err != nil {
		return err
	}
	if st.Mode&unix.S_IFMT != unix.S_IFLNK {
		if err := unix.Chmod(dst, st.Mode&0o7777); err != nil {
			return err
		}
	}
	ts := []unix.Timespec{st.Atim, st.Mtim}
	return unix.UtimesNanoAt(unix.AT_FDCWD, dst, ts, unix.AT_SYMLINK_NOFOLLOW)
}

// listXattrs returns the names of p's xattrs (not following a symlink).
func listXattrs(p string) ([]string, error) {
	for {
		size, err := unix.Llistxattr(p, nil)
		if err != nil || size == 0 {
			if errors.Is(err, unix.ENOTSUP) {
				return nil, nil
			}
			return nil, err
		}
		buf := make([]byte, size)
		size, err = unix.Llistxattr(p, buf)
		if errors.Is(err, unix.ERANGE) {
			continue // grew in between
		}
		if err != nil {
			return nil, err
		}
		var names []string
		for _, name := range strings.Split(strings.TrimRight(string(buf[:size]), "\x00"), "\x00") {
			if name != "" {
				names = append(names, name)
			}
		}
		return names, nil
	}
}

// dropXattrsNotIn removes from dst the xattrs src lacks, but overlayfs's own marks.
func dropXattrsNotIn(src, dst string) error {
	have, err := listXattrs(dst)
	if err != nil || len(have) == 0 {
		return err
	}
	keep, err := listXattrs(src)
	if err != nil {
		return err
	}
	for _, name := range have {
		if strings.HasPrefix(name, "trusted.overlay.") || slices.Contains(keep, name) {
			continue
		}
		if err := unix.Lremovexattr(dst, name); err != nil && !errors.Is(err, unix.ENODATA) {
			return fmt.Errorf("removing xattr %s from %s: %w", name, dst, err)
		}
	}
	return nil
}

func copyXattrs(src, dst string, overlayMarks bool) error {
	size, err := unix.Llistxattr(src, nil)
	if err != nil || size == 0 {
		if errors.Is(err, unix.ENOTSUP) {
			return nil
		}
		return err
	}
	buf := make([]byte, size)
	size, err = unix.Llistxattr(src, buf)
	if err != nil {
		return err
	}
	for _, name := range strings.Split(strings.TrimRight(string(buf[:size]), "\x00"), "\x00") {
		if name == "" || !overlayMarks && strings.HasPrefix(name, "trusted.overlay.") {
			continue // overlay's own marks; the opaque mark is set by Merge
		}
		vsize, err := unix.Lgetxattr(src, name, nil)
		if err != nil {
			continue
		}
		val := make([]byte, vsize)
		if vsize, err = unix.Lgetxattr(src, name, val); err != nil {
			continue
		}
		if err := unix.Lsetxattr(dst, name, val[:vsize], 0); err != nil {
			return fmt.Errorf("setting xattr %s on %s: %w", name, dst, err)
		}
	}
	return nil
}

// Flatten merges layers ids (bottom first) into a new sealed layer and
// returns it with one reference held by the caller. below are the layers
// the result will sit on (the image's), bottom first.
func (s *Store) Flatten(ids []string, sizeBytes int64, below []string) (string, error) {
	id, err := s.NewUpper(sizeBytes, 0)
	if err != nil {
		return "", err
	}
	srcs := make([]string, len(ids))
	for i, l := range ids {
		srcs[i] = s.Path(l)
	}
	if err := makeRoot(s.Dir(id), 0o755); err != nil {
		s.Unref(id)
		return "", fmt.Errorf("flattening: %w", err)
	}
	if err := Merge(s.Path(id), srcs, below); err != nil {
		s.Unref(id)
		return "", err
	}
	if _, err := s.Seal(id); err != nil {
		s.Unref(id)
		return "", err
	}
	return id, nil
}
