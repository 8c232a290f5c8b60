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
	"io/fs"
	"os"
	"path/filepath"
	"sort"
	"strings"
	"time"

	"golang.org/x/sys/unix"
)

// openArchive opens a docker save tarball for random access. A gzip-compressed one is
// decompressed into an unlinked temporary file in staging first.
func openArchive(src, staging string) (*os.File, error) {
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
	if _, err := io.Copy(tmp, gz); err != nil {
		tmp.Close()
		return nil, fmt.Errorf("decompressing image tarball: %w", err)
	}
	return tmp, nil
}

// importRootfs copies a plain root filesystem directory into one layer, staging/0. Contents
// of other filesystems mounted below src are not copied (their mount points are).
func importRootfs(ctx context.Context, src, staging string) (*Imported, error) {
	root, err := filepath.EvalSymlinks(src)
	if err != nil {
		return nil, err
	}
	var rootSt unix.Stat_t
	if err := unix.Lstat(root, &rootSt); err != nil {
		return nil, err
	}
	dir := filepath.Join(staging, "0")
	if err := os.Mkdir(dir, 0o755); err != nil {
		return nil, fmt.Errorf("creating layer: %w", err)
	}
	w, err := openLayerWriter(dir, false)
	if err != nil {
		return nil, err
	}
	defer w.Close()

	type inode struct{ dev, ino uint64 }
	links := map[inode]string{}
	digest := sha256.New()
	io.WriteString(digest, "deltagym-rootfs-v1\n")

	walk := func(p string, d fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		if err := ctx.Err(); err != nil {
			return err
		}
		rel, err := filepath.Rel(root, p)
		if err != nil {
			return err
		}
		rel = filepath.ToSlash(rel)
		var st unix.Stat_t
		if err := unix.Lstat(p, &st); err != nil {
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
		var content io.Reader
		var skipDir bool
		typ := st.Mode & unix.S_IFMT
		if typ != unix.S_IFDIR && st.Nlink > 1 {
			key := inode{st.Dev, st.Ino}
			if first, ok := links[key]; ok {
				hdr.Typeflag, hdr.Linkname = tar.TypeLink, first
				writeDigest(digest, hdr, nil)
				return w.apply(hdr, nil)
			}
			links[key] = rel
		}
		switch typ {
		case unix.S_IFDIR:
			hdr.Typeflag = tar.TypeDir
			skipDir = st.Dev != rootSt.Dev
		case unix.S_IFREG:
			hdr.Typeflag, hdr.Size = tar.TypeReg, st.Size
			f, err := os.OpenFile(p, os.O_RDONLY|unix.O_NOFOLLOW, 0)
			if err != nil {
				return err
			}
			defer f.Close()
			content = f
		case unix.S_IFLNK:
			hdr.Typeflag = tar.TypeSymlink
			if hdr.Linkname, err = os.Readlink(p); err != nil {
				return err
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
		xa, err := listXattrs(p)
		if err != nil {
			return fmt.Errorf("reading xattrs of %s: %w", rel, err)
		}
		if len(xa) > 0 {
			hdr.PAXRecords = map[string]string{}
			for k, v := range xa {
				hdr.PAXRecords[paxXattr+k] = v
			}
		}
		writeDigest(digest, hdr, xa)
		if content != nil {
			content = io.TeeReader(content, digest)
		}
		if err := w.apply(hdr, content); err != nil {
			return err
		}
		if skipDir {
			return fs.SkipDir
		}
		return nil
	}
	if err := filepath.WalkDir(root, walk); err != nil {
		return nil, fmt.Errorf("copying rootfs: %w", err)
	}
	if err := w.finish(); err != nil {
		return nil, err
	}
	if err := w.Close(); err != nil {
		return nil, err
	}
	return &Imported{Layers: []string{dir}, Digest: "sha256:" + hex.EncodeToString(digest.Sum(nil))}, nil
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
