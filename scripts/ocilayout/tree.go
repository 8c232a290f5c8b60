package main

import (
	"archive/tar"
	"errors"
	"fmt"
	"io"
	"maps"
	"os"
	"path"
	"path/filepath"
	"slices"
	"strings"
	"time"

	"golang.org/x/sys/unix"
)

// paxXattr prefixes the PAX records that carry an entry's xattrs, as GNU tar and the OCI
// importers (sandbox/image among them) read them.
const paxXattr = "SCHILY.xattr."

// mapping places the tree (or the single file) src at the image path dest.
type mapping struct {
	dest string // absolute and clean: "/", "/opt/deltagym"
	src  string // absolute
}

// parseMapping reads DEST=SRC.
func parseMapping(s string) (mapping, error) {
	dest, src, ok := strings.Cut(s, "=")
	if !ok || dest == "" || src == "" {
		return mapping{}, fmt.Errorf("tree %q: want DEST=SRC, DEST an absolute path in the image", s)
	}
	if !path.IsAbs(dest) {
		return mapping{}, fmt.Errorf("tree %q: DEST %q is not an absolute path in the image", s, dest)
	}
	abs, err := filepath.Abs(src)
	if err != nil {
		return mapping{}, fmt.Errorf("tree %q: %w", s, err)
	}
	return mapping{dest: path.Clean(dest), src: abs}, nil
}

// treeOptions say how entries are written.
type treeOptions struct {
	// epoch is the latest modification time written: later ones are clamped to it.
	epoch time.Time
	// chown, when set, owns every entry by uid chown[0], gid chown[1] instead of the file's.
	chown *[2]int
	// exclude holds image paths left out, with what is below them.
	exclude map[string]bool
}

// treeWriter writes the merged trees of a layer as one tar, in a fixed order: depth first,
// the entries of each directory sorted by name.
type treeWriter struct {
	tw     *tar.Writer
	opts   treeOptions
	mounts map[string]string // image path → source
	// links maps each file with more than one link to the name it was first written under;
	// later names become hard links to it.
	links map[fileID]string
}

type fileID struct{ dev, ino uint64 }

// writeTree writes the tar of trees, merged, to w.
func writeTree(w io.Writer, trees []mapping, opts treeOptions) error {
	t := &treeWriter{tw: tar.NewWriter(w), opts: opts, mounts: map[string]string{}, links: map[fileID]string{}}
	for _, m := range trees {
		if _, dup := t.mounts[m.dest]; dup {
			return fmt.Errorf("two trees at %s", m.dest)
		}
		t.mounts[m.dest] = m.src
	}
	root := t.mounts["/"]
	if root != "" {
		fi, err := os.Stat(root)
		if err != nil {
			return err
		}
		if !fi.IsDir() {
			return fmt.Errorf("the tree at / (%s) is not a directory", root)
		}
	}
	if err := t.dir("/", root); err != nil {
		return err
	}
	return t.tw.Close()
}

// dir writes what is below the image directory dest, whose source is the directory src (""
// for a directory made only to hold a tree mapped below it).
func (t *treeWriter) dir(dest, src string) error {
	names, inSrc, err := t.children(dest, src)
	if err != nil {
		return err
	}
	for _, name := range names {
		d := path.Join(dest, name)
		if t.opts.exclude[d] {
			continue
		}
		s := ""
		if m, ok := t.mounts[d]; ok {
			s = m
		} else if inSrc[name] {
			s = filepath.Join(src, name)
		}
		isDir, err := t.entry(d, s)
		if err != nil {
			return err
		}
		if isDir {
			if err := t.dir(d, s); err != nil {
				return err
			}
		} else if t.mountedBelow(d) {
			return fmt.Errorf("a tree is mapped below %s, which %s makes a non-directory", d, s)
		}
	}
	return nil
}

// children returns the sorted names below the image directory dest: src's entries and the
// first component of each tree mapped further down. inSrc says which src holds.
func (t *treeWriter) children(dest, src string) ([]string, map[string]bool, error) {
	inSrc := map[string]bool{}
	if src != "" {
		f, err := os.Open(src)
		if err != nil {
			return nil, nil, err
		}
		names, err := f.Readdirnames(-1)
		_ = f.Close()
		if err != nil {
			return nil, nil, fmt.Errorf("listing %s: %w", src, err)
		}
		for _, n := range names {
			inSrc[n] = true
		}
	}
	all := maps.Clone(inSrc)
	for d := range t.mounts {
		if rest, ok := below(d, dest); ok {
			first, _, _ := strings.Cut(rest, "/")
			all[first] = true
		}
	}
	return slices.Sorted(maps.Keys(all)), inSrc, nil
}

// below returns p relative to dir when p is strictly below it.
func below(p, dir string) (string, bool) {
	prefix := strings.TrimSuffix(dir, "/") + "/"
	if !strings.HasPrefix(p, prefix) || p == prefix {
		return "", false
	}
	return p[len(prefix):], true
}

// mountedBelow reports whether a tree is mapped strictly below the image path d.
func (t *treeWriter) mountedBelow(d string) bool {
	for m := range t.mounts {
		if _, ok := below(m, d); ok {
			return true
		}
	}
	return false
}

// entry writes the image path dest from the file src ("": a directory of mode 0755 owned by
// root) and reports whether it is a directory.
func (t *treeWriter) entry(dest, src string) (bool, error) {
	name := strings.TrimPrefix(dest, "/")
	if src == "" {
		hdr := &tar.Header{Typeflag: tar.TypeDir, Name: name + "/", Mode: 0o755, ModTime: t.opts.epoch}
		t.own(hdr)
		return true, t.tw.WriteHeader(hdr)
	}
	var st unix.Stat_t
	if err := unix.Lstat(src, &st); err != nil {
		return false, fmt.Errorf("reading %s: %w", src, err)
	}
	hdr, err := t.header(name, src, &st)
	if err != nil {
		return false, err
	}
	if err := t.tw.WriteHeader(hdr); err != nil {
		return false, fmt.Errorf("writing %s: %w", dest, err)
	}
	if hdr.Typeflag == tar.TypeReg && hdr.Size > 0 {
		if err := t.contents(src, hdr.Size); err != nil {
			return false, err
		}
	}
	return hdr.Typeflag == tar.TypeDir, nil
}

// header makes the tar header of the file src (stat st), named name in the image.
func (t *treeWriter) header(name, src string, st *unix.Stat_t) (*tar.Header, error) {
	mtime := time.Unix(st.Mtim.Sec, 0)
	if mtime.After(t.opts.epoch) {
		mtime = t.opts.epoch
	}
	hdr := &tar.Header{Name: name, Mode: int64(st.Mode & 0o7777), Uid: int(st.Uid), Gid: int(st.Gid), ModTime: mtime}
	t.own(hdr)
	switch st.Mode & unix.S_IFMT {
	case unix.S_IFDIR:
		hdr.Typeflag, hdr.Name = tar.TypeDir, name+"/"
	case unix.S_IFREG:
		if st.Nlink > 1 {
			id := fileID{dev: st.Dev, ino: st.Ino}
			if first, ok := t.links[id]; ok {
				hdr.Typeflag, hdr.Linkname = tar.TypeLink, first
				return hdr, nil
			}
			t.links[id] = name
		}
		hdr.Typeflag, hdr.Size = tar.TypeReg, st.Size
	case unix.S_IFLNK:
		target, err := os.Readlink(src)
		if err != nil {
			return nil, err
		}
		hdr.Typeflag, hdr.Linkname = tar.TypeSymlink, target
	case unix.S_IFCHR, unix.S_IFBLK:
		hdr.Typeflag = tar.TypeChar
		if st.Mode&unix.S_IFMT == unix.S_IFBLK {
			hdr.Typeflag = tar.TypeBlock
		}
		hdr.Devmajor, hdr.Devminor = int64(unix.Major(st.Rdev)), int64(unix.Minor(st.Rdev))
	case unix.S_IFIFO:
		hdr.Typeflag = tar.TypeFifo
	default:
		return nil, fmt.Errorf("%s is a socket or of an unknown type (mode %o), which a layer cannot hold", src, st.Mode)
	}
	recs, err := xattrs(src)
	if err != nil {
		return nil, err
	}
	hdr.PAXRecords = recs
	return hdr, nil
}

// own applies the chown option.
func (t *treeWriter) own(hdr *tar.Header) {
	if t.opts.chown != nil {
		hdr.Uid, hdr.Gid = t.opts.chown[0], t.opts.chown[1]
	}
}

// contents copies size bytes of the regular file src into the tar.
func (t *treeWriter) contents(src string, size int64) error {
	f, err := os.OpenFile(src, os.O_RDONLY|unix.O_NOFOLLOW, 0)
	if err != nil {
		return err
	}
	defer f.Close()
	if _, err := io.CopyN(t.tw, f, size); err != nil {
		return fmt.Errorf("copying %s (did it change while read?): %w", src, err)
	}
	return nil
}

// skipXattr reports whether the xattr attr belongs to the build host rather than to the file:
// overlayfs's own (a layer expresses whiteouts with .wh. entries) and SELinux labels.
func skipXattr(attr string) bool {
	return strings.HasPrefix(attr, "trusted.overlay.") || strings.HasPrefix(attr, "user.overlay.") || attr == "security.selinux"
}

// xattrs returns the xattrs of p (not followed) as PAX records, or nil.
func xattrs(p string) (map[string]string, error) {
	list, err := readXattr(func(b []byte) (int, error) { return unix.Llistxattr(p, b) })
	if errors.Is(err, unix.ENOTSUP) {
		return nil, nil
	}
	if err != nil {
		return nil, fmt.Errorf("listing xattrs of %s: %w", p, err)
	}
	var recs map[string]string
	for _, attr := range strings.Split(string(list), "\x00") {
		if attr == "" || skipXattr(attr) {
			continue
		}
		v, err := readXattr(func(b []byte) (int, error) { return unix.Lgetxattr(p, attr, b) })
		if errors.Is(err, unix.ENODATA) {
			continue // removed since listed
		}
		if err != nil {
			return nil, fmt.Errorf("reading xattr %s of %s: %w", attr, p, err)
		}
		if recs == nil {
			recs = map[string]string{}
		}
		recs[paxXattr+attr] = string(v)
	}
	return recs, nil
}

// readXattr calls get with a buffer large enough for what it returns.
func readXattr(get func([]byte) (int, error)) ([]byte, error) {
	for {
		n, err := get(nil)
		if err != nil || n == 0 {
			return nil, err
		}
		b := make([]byte, n)
		n, err = get(b)
		if errors.Is(err, unix.ERANGE) {
			continue // grew since sized
		}
		if err != nil {
			return nil, err
		}
		return b[:n], nil
	}
}
