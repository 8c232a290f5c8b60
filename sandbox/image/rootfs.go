package image

import (
	"archive/tar"
	"bytes"
	"compress/gzip"
	"context"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"hash"
	"io"
	"os"
	"path"
	"path/filepath"
	"sort"
	"strings"
	"time"

	"golang.org/x/sys/unix"
)

// openArchive opens a docker save tarball for random access. A gzip-compressed one is
// decompressed into an unlinked temporary file in staging first, charged to b.
func openArchive(src, staging string, b *budget) (*os.File, error) {
	f, err := os.Open(src)
	if err != nil {
		return nil, err
	}
	magic := make([]byte, 4)
	n, _ := io.ReadFull(f, magic)
	magic = magic[:n]
	switch {
	case bytes.HasPrefix(magic, []byte{0x1f, 0x8b}):
	case bytes.HasPrefix(magic, []byte{0x28, 0xb5, 0x2f, 0xfd}):
		f.Close()
		return nil, fmt.Errorf("zstd-compressed image tarball (decompress it first): %w", ErrUnsupportedCompression)
	default:
		return f, nil
	}
	defer f.Close()
	if _, err := f.Seek(0, io.SeekStart); err != nil {
		return nil, err
	}
	gz, err := gzip.NewReader(f)
	if err != nil {
		return nil, fmt.Errorf("opening gzip stream: %w", err)
	}
	tmp, err := os.CreateTemp(staging, "archive-*.tar")
	if err != nil {
		return nil, err
	}
	if err := os.Remove(tmp.Name()); err != nil {
		tmp.Close()
		return nil, err
	}
	var r io.Reader = gz
	if left := b.remaining(); left >= 0 {
		r = io.LimitReader(gz, left+1)
	}
	copied, cerr := io.Copy(tmp, r)
	if cerr == nil {
		cerr = b.take(copied)
	}
	if err := cerr; err != nil {
		tmp.Close()
		return nil, fmt.Errorf("decompressing image tarball: %w", err)
	}
	return tmp, nil
}

// importRootfs copies a plain root filesystem directory into one layer, staging/0. Contents
// of other filesystems mounted below src are not copied (their mount points are).
//
// The tree is walked by directory descriptors, each entry looked up in its parent without
// following symlinks, so that a directory swapped for a symlink while the copy runs is copied
// as the symlink it became and nothing outside src is ever read.
func importRootfs(ctx context.Context, src, staging string, b *budget) (*Imported, error) {
	rootfd, err := unix.Open(src, unix.O_RDONLY|unix.O_DIRECTORY|unix.O_CLOEXEC, 0)
	if err != nil {
		return nil, &os.PathError{Op: "open", Path: src, Err: err}
	}
	defer unix.Close(rootfd)
	dir := filepath.Join(staging, "0")
	if err := os.Mkdir(dir, 0o755); err != nil {
		return nil, fmt.Errorf("creating layer: %w", err)
	}
	w, err := openLayerWriter(dir, false, b)
	if err != nil {
		return nil, err
	}
	defer w.Close()
	c := &rootfsCopy{ctx: ctx, w: w, links: map[inode]string{}, digest: sha256.New()}
	io.WriteString(c.digest, "deltagym-rootfs-v1\n")
	var rootSt unix.Stat_t
	if err := unix.Fstat(rootfd, &rootSt); err != nil {
		return nil, err
	}
	c.dev = rootSt.Dev
	if err := c.entry(rootfd, ".", ".", &rootSt); err != nil {
		return nil, fmt.Errorf("copying rootfs: %w", err)
	}
	if err := w.finish(); err != nil {
		return nil, err
	}
	if err := w.Close(); err != nil {
		return nil, err
	}
	return &Imported{Layers: []string{dir}, Digest: "sha256:" + hex.EncodeToString(c.digest.Sum(nil))}, nil
}

type inode struct{ dev, ino uint64 }

// rootfsCopy is one walk of importRootfs. Entries are visited in the order of
// filepath.WalkDir (a directory, then its entries sorted by name, depth first), which the
// image digest depends on.
type rootfsCopy struct {
	ctx    context.Context
	w      *layerWriter
	dev    uint64 // the source root's filesystem
	links  map[inode]string
	digest hash.Hash
}

// entry copies the entry base of directory pfd (pfd itself when base is "."), whose lstat is
// st, as rel; a directory's entries follow.
func (c *rootfsCopy) entry(pfd int, base, rel string, st *unix.Stat_t) error {
	if err := c.ctx.Err(); err != nil {
		return err
	}
	hdr := &tar.Header{
		Name:       rel,
		Mode:       int64(st.Mode & 0o7777),
		Uid:        int(st.Uid),
		Gid:        int(st.Gid),
		ModTime:    time.Unix(st.Mtim.Unix()),
		AccessTime: time.Unix(st.Atim.Unix()),
	}
	typ := st.Mode & unix.S_IFMT
	if typ != unix.S_IFDIR && st.Nlink > 1 {
		key := inode{st.Dev, st.Ino}
		if first, ok := c.links[key]; ok {
			hdr.Typeflag, hdr.Linkname = tar.TypeLink, first
			writeDigest(c.digest, hdr, nil)
			return c.w.apply(hdr, nil)
		}
		c.links[key] = rel
	}
	var (
		content *os.File
		dirfd   = -1
		err     error
	)
	switch typ {
	case unix.S_IFDIR:
		hdr.Typeflag = tar.TypeDir
		if dirfd, err = openEntry(pfd, base, unix.O_DIRECTORY, st); err != nil {
			return err
		}
		defer unix.Close(dirfd)
	case unix.S_IFREG:
		hdr.Typeflag, hdr.Size = tar.TypeReg, st.Size
		fd, err := openEntry(pfd, base, 0, st)
		if err != nil {
			return err
		}
		content = os.NewFile(uintptr(fd), rel)
		defer content.Close()
	case unix.S_IFLNK:
		hdr.Typeflag = tar.TypeSymlink
		if hdr.Linkname, err = readlinkat(pfd, base); err != nil {
			return fmt.Errorf("reading symlink %s: %w", rel, err)
		}
	case unix.S_IFCHR, unix.S_IFBLK:
		hdr.Typeflag = tar.TypeChar
		if typ == unix.S_IFBLK {
			hdr.Typeflag = tar.TypeBlock
		}
		hdr.Devmajor, hdr.Devminor = int64(unix.Major(st.Rdev)), int64(unix.Minor(st.Rdev))
	case unix.S_IFIFO:
		hdr.Typeflag = tar.TypeFifo
	default:
		return nil // sockets are runtime artefacts
	}
	xa, err := listXattrs(procPath(pfd, base))
	if err != nil {
		return fmt.Errorf("reading xattrs of %s: %w", rel, err)
	}
	if len(xa) > 0 {
		hdr.PAXRecords = map[string]string{}
		for k, v := range xa {
			hdr.PAXRecords[paxXattr+k] = v
		}
	}
	writeDigest(c.digest, hdr, xa)
	var r io.Reader
	if content != nil {
		// A file that grows while it is copied is cut at the size it was listed with; one
		// that shrinks fails the copy.
		r = io.TeeReader(io.LimitReader(content, hdr.Size), c.digest)
	}
	if err := c.w.apply(hdr, r); err != nil {
		return err
	}
	if dirfd < 0 || st.Dev != c.dev {
		return nil
	}
	return c.children(dirfd, rel)
}

// children copies the entries of directory dirfd, sorted by name.
func (c *rootfsCopy) children(dirfd int, rel string) error {
	names, err := readDirNames(dirfd)
	if err != nil {
		return fmt.Errorf("reading directory %s: %w", rel, err)
	}
	for _, name := range names {
		var st unix.Stat_t
		if err := unix.Fstatat(dirfd, name, &st, unix.AT_SYMLINK_NOFOLLOW); err != nil {
			if errors.Is(err, unix.ENOENT) {
				continue // removed while the copy ran
			}
			return fmt.Errorf("reading %s: %w", path.Join(rel, name), err)
		}
		child := name
		if rel != "." {
			child = rel + "/" + name
		}
		if err := c.entry(dirfd, name, child, &st); err != nil {
			return err
		}
	}
	return nil
}

// openEntry opens base in pfd ("." for pfd itself) without following a symlink or blocking on
// a FIFO, and checks that it is still the inode st describes.
func openEntry(pfd int, base string, flags int, st *unix.Stat_t) (int, error) {
	fd, err := unix.Openat(pfd, base, unix.O_RDONLY|unix.O_NOFOLLOW|unix.O_NONBLOCK|unix.O_CLOEXEC|flags, 0)
	if err != nil {
		return -1, fmt.Errorf("opening %s: %w", base, err)
	}
	var now unix.Stat_t
	if err := unix.Fstat(fd, &now); err != nil {
		unix.Close(fd)
		return -1, err
	}
	if now.Dev != st.Dev || now.Ino != st.Ino {
		unix.Close(fd)
		return -1, fmt.Errorf("%s changed while it was copied: %w", base, ErrInvalidImage)
	}
	return fd, nil
}

func readlinkat(pfd int, base string) (string, error) {
	for n := 256; ; n *= 2 {
		b := make([]byte, n)
		got, err := unix.Readlinkat(pfd, base, b)
		if err != nil {
			return "", err
		}
		if got < n {
			return string(b[:got]), nil
		}
	}
}

// readDirNames returns the names in directory fd, sorted, without "." and "..".
func readDirNames(fd int) ([]string, error) {
	dup, err := unix.Openat(fd, ".", unix.O_RDONLY|unix.O_DIRECTORY|unix.O_CLOEXEC, 0)
	if err != nil {
		return nil, err
	}
	f := os.NewFile(uintptr(dup), ".")
	defer f.Close()
	names, err := f.Readdirnames(-1)
	if err != nil {
		return nil, err
	}
	sort.Strings(names)
	return names, nil
}

func writeDigest(h hash.Hash, hdr *tar.Header, xattrs map[string]string) {
	fmt.Fprintf(h, "%q %c %o %d %d %d %q %d %d\n", hdr.Name, hdr.Typeflag, hdr.Mode, hdr.Uid, hdr.Gid,
		hdr.Size, hdr.Linkname, hdr.Devmajor, hdr.Devminor)
	keys := make([]string, 0, len(xattrs))
	for k := range xattrs {
		keys = append(keys, k)
	}
	sort.Strings(keys)
	for _, k := range keys {
		fmt.Fprintf(h, "xattr %q %q\n", k, xattrs[k])
	}
}

// listXattrs returns the xattrs of p (not following a symlink), without overlayfs' own.
func listXattrs(p string) (map[string]string, error) {
	names, err := xattrCall(func(b []byte) (int, error) { return unix.Llistxattr(p, b) })
	if errors.Is(err, unix.ENOTSUP) {
		return nil, nil
	}
	if err != nil || len(names) == 0 {
		return nil, err
	}
	out := map[string]string{}
	for _, name := range strings.Split(strings.TrimRight(string(names), "\x00"), "\x00") {
		if name == "" || isOverlayXattr(name) {
			continue
		}
		v, err := xattrCall(func(b []byte) (int, error) { return unix.Lgetxattr(p, name, b) })
		if errors.Is(err, unix.ENODATA) {
			continue
		}
		if err != nil {
			return nil, err
		}
		out[name] = string(v)
	}
	return out, nil
}

// xattrCall runs a size-then-fetch xattr call, retrying if the value grew in between.
func xattrCall(call func([]byte) (int, error)) ([]byte, error) {
	for {
		n, err := call(nil)
		if err != nil || n == 0 {
			return nil, err
		}
		buf := make([]byte, n)
		n, err = call(buf)
		if errors.Is(err, unix.ERANGE) {
			continue
		}
		if err != nil {
			return nil, err
		}
		return buf[:n], nil
	}
}
