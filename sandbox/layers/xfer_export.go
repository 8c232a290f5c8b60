package layers

import (
	"bufio"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"path"
	"slices"
	"strconv"
	"strings"

	"golang.org/x/sys/unix"
)

// Export writes sealed layer id to w in the transfer format (xfer.go) and
// returns the layer's digest. The same layer always gives the same bytes.
// The store holds a reference to the layer while it reads it. A digest the
// store does not know yet is computed from the bytes written and kept (see
// Digest); one it knows is not computed again.
//
// A layer that is not sealed is refused with ErrNotSealed, one the format
// cannot carry (a device node) with ErrUntransferable.
func (s *Store) Export(w io.Writer, id string) (string, error) {
	s.mu.Lock()
	if _, ok := s.refs[id]; !ok {
		s.mu.Unlock()
		return "", fmt.Errorf("exporting: %w", notFound(id))
	}
	if _, sealed := s.sizes[id]; !sealed {
		s.mu.Unlock()
		return "", fmt.Errorf("exporting layer %s: %w", id, ErrNotSealed)
	}
	s.refs[id]++
	known, haveDigest := s.digests[id]
	gen := s.unseals
	s.mu.Unlock()
	defer s.Unref(id)

	var ah *asyncHash
	out := w
	if !haveDigest {
		ah = newAsyncHash()
		defer ah.close()
		if w == io.Discard {
			out = ah
		} else {
			out = io.MultiWriter(w, ah)
		}
	}
	bw := bufio.NewWriterSize(out, 256<<10)
	e := exporter{w: bw, links: map[[2]uint64]uint64{}, data: make([]byte, 1<<20), xbuf: make([]byte, maxXattrValue)}
	err := e.layer(s.Path(id))
	if err == nil {
		err = bw.Flush()
	}
	if err != nil {
		return "", fmt.Errorf("exporting layer %s: %w", id, err)
	}
	d := known
	if !haveDigest {
		d = ah.digest()
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	if _, sealed := s.sizes[id]; !sealed || s.unseals != gen {
		// Unsealed while it was read: what was written may be torn.
		return "", fmt.Errorf("exporting layer %s: %w (unsealed while exported)", id, ErrNotSealed)
	}
	if !haveDigest {
		s.remember(id, d)
	}
	return d, nil
}

// exporter writes one layer's stream.
type exporter struct {
	w     *bufio.Writer
	frame []byte // the entry being encoded
	n     uint64 // entries written
	// links maps the inode of each regular file with several names to the
	// number of the entry of its first name.
	links map[[2]uint64]uint64
	data  []byte // file contents being copied
	xbuf  []byte // an extended attribute's value being read
	exts  []extent
}

type extent struct{ off, len int64 }

// layer writes the stream of the tree at root.
func (e *exporter) layer(root string) error {
	fd, err := unix.Open(root, unix.O_RDONLY|unix.O_DIRECTORY|unix.O_NOFOLLOW|unix.O_CLOEXEC, 0)
	if err != nil {
		return fmt.Errorf("opening the layer: %w", err)
	}
	defer unix.Close(fd)
	var st unix.Stat_t
	if err := unix.Fstat(fd, &st); err != nil {
		return fmt.Errorf("reading the layer's root: %w", err)
	}
	xs, err := e.xattrs(fdXattrs(fd))
	if err != nil {
		return fmt.Errorf("reading the layer's root: %w", err)
	}
	if _, err := e.w.WriteString(xferMagic); err != nil {
		return err
	}
	if err := e.entry(kindDir, 0, "", &st, xs, nil); err != nil {
		return err
	}
	if err := e.dir(fd, 1, ""); err != nil {
		return err
	}
	return e.w.WriteByte(kindEnd)
}

// dir writes the entries of directory fd, at depth depth, path rel.
func (e *exporter) dir(fd, depth int, rel string) error {
	names, err := readNames(fd)
	if err != nil {
		return fmt.Errorf("listing /%s: %w", rel, err)
	}
	slices.Sort(names)
	for _, name := range names {
		p := path.Join(rel, name)
		if depth > maxDepth {
			return fmt.Errorf("%w: /%s is deeper than %d directories", ErrUntransferable, p, maxDepth)
		}
		var st unix.Stat_t
		if err := unix.Fstatat(fd, name, &st, unix.AT_SYMLINK_NOFOLLOW); err != nil {
			return fmt.Errorf("reading /%s: %w", p, err)
		}
		if err := e.child(fd, depth, name, p, &st); err != nil {
			return err
		}
	}
	return nil
}

// child writes entry name of directory fd, and a directory's entries.
func (e *exporter) child(fd, depth int, name, p string, st *unix.Stat_t) error {
	switch st.Mode & unix.S_IFMT {
	case unix.S_IFDIR:
		cfd, err := unix.Openat(fd, name, unix.O_RDONLY|unix.O_DIRECTORY|unix.O_NOFOLLOW|unix.O_CLOEXEC, 0)
		if err != nil {
			return fmt.Errorf("opening /%s: %w", p, err)
		}
		defer unix.Close(cfd)
		xs, err := e.xattrs(fdXattrs(cfd))
		if err != nil {
			return fmt.Errorf("reading /%s: %w", p, err)
		}
		if err := e.entry(kindDir, depth, name, st, xs, nil); err != nil {
			return err
		}
		return e.dir(cfd, depth+1, p)
	case unix.S_IFREG:
		key := [2]uint64{st.Dev, st.Ino}
		if st.Nlink > 1 {
			if first, ok := e.links[key]; ok {
				return e.link(depth, name, first)
			}
			e.links[key] = e.n
		}
		return e.file(fd, depth, name, p, st)
	case unix.S_IFLNK:
		buf := e.data[:maxTarget+1]
		n, err := unix.Readlinkat(fd, name, buf)
		if err != nil {
			return fmt.Errorf("reading /%s: %w", p, err)
		}
		if n == 0 || n > maxTarget {
			return fmt.Errorf("%w: /%s: a symlink target of %d bytes", ErrUntransferable, p, n)
		}
		target := string(buf[:n])
		xs, err := e.xattrs(pathXattrs(fd, name))
		if err != nil {
			return fmt.Errorf("reading /%s: %w", p, err)
		}
		return e.entry(kindSymlink, depth, name, st, xs, func(b []byte) []byte {
			b = binary.BigEndian.AppendUint16(b, uint16(len(target)))
			return append(b, target...)
		})
	case unix.S_IFCHR, unix.S_IFBLK, unix.S_IFIFO, unix.S_IFSOCK:
		kind, ok := nodeKind(st)
		if !ok {
			return fmt.Errorf("%w: /%s is a device node (%d:%d)", ErrUntransferable, p, unix.Major(st.Rdev), unix.Minor(st.Rdev))
		}
		xs, err := e.xattrs(pathXattrs(fd, name))
		if err != nil {
			return fmt.Errorf("reading /%s: %w", p, err)
		}
		return e.entry(kind, depth, name, st, xs, nil)
	}
	return fmt.Errorf("%w: /%s has file type %#o", ErrUntransferable, p, st.Mode&unix.S_IFMT)
}

// nodeKind returns the kind of a special file, ok false for a device.
func nodeKind(st *unix.Stat_t) (kind byte, ok bool) {
	switch st.Mode & unix.S_IFMT {
	case unix.S_IFIFO:
		return kindFIFO, true
	case unix.S_IFSOCK:
		return kindSocket, true
	case unix.S_IFCHR:
		if st.Rdev == 0 {
			return kindWhiteout, true
		}
	}
	return 0, false
}

// entry writes an entry with its meta and, after it, what more appends.
func (e *exporter) entry(kind byte, depth int, name string, st *unix.Stat_t, xs []xattr, more func([]byte) []byte) error {
	b := appendHeader(e.frame[:0], kind, depth, name)
	b = binary.BigEndian.AppendUint32(b, st.Mode&0o7777)
	b = binary.BigEndian.AppendUint32(b, st.Uid)
	b = binary.BigEndian.AppendUint32(b, st.Gid)
	b = binary.BigEndian.AppendUint64(b, uint64(st.Mtim.Sec))
	b = binary.BigEndian.AppendUint32(b, uint32(st.Mtim.Nsec))
	b = binary.BigEndian.AppendUint16(b, uint16(len(xs)))
	for _, x := range xs {
		b = append(b, byte(len(x.key)))
		b = append(b, x.key...)
		b = binary.BigEndian.AppendUint32(b, uint32(len(x.value)))
		b = append(b, x.value...)
	}
	if more != nil {
		b = more(b)
	}
	e.frame = b
	e.n++
	_, err := e.w.Write(b)
	return err
}

func appendHeader(b []byte, kind byte, depth int, name string) []byte {
	b = append(b, kind)
	b = binary.BigEndian.AppendUint16(b, uint16(depth))
	b = append(b, byte(len(name)))
	return append(b, name...)
}

// link writes a hard link to entry first.
func (e *exporter) link(depth int, name string, first uint64) error {
	b := appendHeader(e.frame[:0], kindLink, depth, name)
	b = binary.BigEndian.AppendUint64(b, first)
	e.frame = b
	e.n++
	_, err := e.w.Write(b)
	return err
}

// file writes regular file name of directory dirfd: its entry, its extents
// and their data.
func (e *exporter) file(dirfd, depth int, name, p string, st *unix.Stat_t) error {
	fd, err := unix.Openat(dirfd, name, unix.O_RDONLY|unix.O_NOFOLLOW|unix.O_NOCTTY|unix.O_CLOEXEC, 0)
	if err != nil {
		return fmt.Errorf("opening /%s: %w", p, err)
	}
	defer unix.Close(fd)
	xs, err := e.xattrs(fdXattrs(fd))
	if err != nil {
		return fmt.Errorf("reading /%s: %w", p, err)
	}
	exts, err := dataExtents(fd, st.Size, e.exts[:0])
	e.exts = exts
	if err != nil {
		return fmt.Errorf("reading /%s: %w", p, err)
	}
	err = e.entry(kindFile, depth, name, st, xs, func(b []byte) []byte {
		b = binary.BigEndian.AppendUint64(b, uint64(st.Size))
		return binary.BigEndian.AppendUint32(b, uint32(len(exts)))
	})
	if err != nil {
		return err
	}
	for _, x := range exts {
		var hdr [16]byte
		binary.BigEndian.PutUint64(hdr[:8], uint64(x.off))
		binary.BigEndian.PutUint64(hdr[8:], uint64(x.len))
		if _, err := e.w.Write(hdr[:]); err != nil {
			return err
		}
		for done := int64(0); done < x.len; {
			n, err := unix.Pread(fd, e.data[:min(x.len-done, int64(len(e.data)))], x.off+done)
			if err != nil {
				return fmt.Errorf("reading /%s: %w", p, err)
			}
			if n == 0 {
				return fmt.Errorf("reading /%s: it ends before its size", p)
			}
			if _, err := e.w.Write(e.data[:n]); err != nil {
				return err
			}
			done += int64(n)
		}
	}
	return nil
}

// dataExtents appends to exts the data of file fd of size bytes, as
// SEEK_DATA and SEEK_HOLE find it.
func dataExtents(fd int, size int64, exts []extent) ([]extent, error) {
	for off := int64(0); off < size; {
		d, err := unix.Seek(fd, off, unix.SEEK_DATA)
		if errors.Is(err, unix.ENXIO) {
			break
		}
		if err != nil {
			return exts, err
		}
		if d >= size {
			break
		}
		h, err := unix.Seek(fd, d, unix.SEEK_HOLE)
		if err != nil {
			return exts, err
		}
		h = min(h, size)
		exts = append(exts, extent{off: d, len: h - d})
		off = h
	}
	if len(exts) > 1<<32-1 {
		return exts, fmt.Errorf("%w: %d data extents, more than 2^32-1", ErrUntransferable, len(exts))
	}
	return exts, nil
}

// xattrSource lists an entry's extended attribute keys and reads their
// values, as flistxattr and fgetxattr do.
type xattrSource struct {
	list func(dst []byte) (int, error)
	get  func(key string, dst []byte) (int, error)
}

func fdXattrs(fd int) xattrSource {
	return xattrSource{
		list: func(dst []byte) (int, error) { return unix.Flistxattr(fd, dst) },
		get:  func(key string, dst []byte) (int, error) { return unix.Fgetxattr(fd, key, dst) },
	}
}

// pathXattrs reaches entry name of directory dirfd by its descriptor's
// name in /proc, without following the entry itself: the way to an
// entry's extended attributes where no descriptor of it can be had (a
// symlink, a FIFO not to be opened, a socket, a whiteout).
func pathXattrs(dirfd int, name string) xattrSource {
	p := procEntry(dirfd, name)
	return xattrSource{
		list: func(dst []byte) (int, error) { return unix.Llistxattr(p, dst) },
		get:  func(key string, dst []byte) (int, error) { return unix.Lgetxattr(p, key, dst) },
	}
}

func procEntry(dirfd int, name string) string {
	return "/proc/self/fd/" + strconv.Itoa(dirfd) + "/" + name
}

// xattrs returns the extended attributes of src, sorted by key.
func (e *exporter) xattrs(src xattrSource) ([]xattr, error) {
	keys, err := xattrKeys(src)
	if err != nil || len(keys) == 0 {
		return nil, err
	}
	xs := make([]xattr, 0, len(keys))
	for _, k := range keys {
		n, err := src.get(k, e.xbuf)
		if errors.Is(err, unix.ENODATA) {
			continue
		}
		if err != nil {
			return nil, fmt.Errorf("reading xattr %s: %w", k, err)
		}
		if len(k) > maxXattrKey {
			return nil, fmt.Errorf("%w: xattr key of %d bytes", ErrUntransferable, len(k))
		}
		xs = append(xs, xattr{key: k, value: slices.Clone(e.xbuf[:n])})
	}
	if n := xattrBytes(xs); n > maxEntryXattrBytes || len(xs) > 1<<16-1 {
		return nil, fmt.Errorf("%w: %d xattrs of %d bytes, more than %d", ErrUntransferable, len(xs), n, maxEntryXattrBytes)
	}
	return xs, nil
}

// xattrKeys returns src's extended attribute keys, sorted.
func xattrKeys(src xattrSource) ([]string, error) {
	for {
		size, err := src.list(nil)
		if errors.Is(err, unix.ENOTSUP) {
			return nil, nil
		}
		if err != nil || size == 0 {
			return nil, err
		}
		buf := make([]byte, size)
		size, err = src.list(buf)
		if errors.Is(err, unix.ERANGE) {
			continue // grew in between
		}
		if err != nil {
			return nil, fmt.Errorf("listing xattrs: %w", err)
		}
		var keys []string
		for k := range strings.SplitSeq(string(buf[:size]), "\x00") {
			if k != "" {
				keys = append(keys, k)
			}
		}
		slices.Sort(keys)
		return keys, nil
	}
}
