package layers

import (
	"bufio"
	"bytes"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"math"
	"os"
	"slices"
	"strings"

	"golang.org/x/sys/unix"

	"github.com/deltagym/deltagym/internal/errdefs"
)

// ImportOption adjusts an Import.
type ImportOption func(*importOptions)

type importOptions struct {
	inodes int64
}

// WithInodes sets the inode limit of the imported layer's tmpfs: the files,
// directories, other nodes and hard links (tmpfs counts each further name
// of a file as an inode) the stream may make, its root included. The
// default is one per ImportInodeBytes of the layer's size, at least
// MinImportInodes: what a sandbox's writable layer gets unless its env says
// otherwise, so that any layer such a sandbox wrote fits.
func WithInodes(n int64) ImportOption { return func(o *importOptions) { o.inodes = n } }

// The default inode limit of an imported layer (WithInodes).
const (
	ImportInodeBytes = 8 << 10
	MinImportInodes  = 4096
)

// Import reads a layer stream (the transfer format, xfer.go) from r into a
// new sealed layer of at most sizeBytes, and returns it with one reference
// held by the caller. The stream is hashed as it is read; unless its digest
// is wantDigest, the layer is discarded and the error (ErrDigestMismatch)
// says both. r must end where the stream does.
//
// The stream is untrusted: it may come from a compromised node or a
// corrupted transfer. Every entry is made by a call relative to the
// descriptor of its parent directory, one the stream made, with a single
// name and without following symlinks, so nothing lands outside the layer;
// the format's bounds and order are checked as the entries come (out of
// order, repeated or unsafe names, devices, links to anything but an earlier
// regular file, oversized names and xattrs, truncation are ErrBadStream); a
// stream past the layer's size or inode limit fails with ErrLayerFull. On
// any error nothing is left: no mount, no directory.
//
// A layer of the same digest that the store already holds (LayerByDigest)
// is returned instead, with a new reference, without reading r; so is one
// that a concurrent import of the same digest finished first.
func (s *Store) Import(r io.Reader, wantDigest string, sizeBytes int64, opts ...ImportOption) (string, error) {
	if err := checkDigest(wantDigest); err != nil {
		return "", fmt.Errorf("importing a layer: %w", err)
	}
	if sizeBytes <= 0 {
		return "", fmt.Errorf("importing layer %s: %w: size %d, want a positive size", wantDigest, errdefs.ErrInvalidArgument, sizeBytes)
	}
	o := importOptions{inodes: max(sizeBytes/ImportInodeBytes, MinImportInodes)}
	for _, opt := range opts {
		opt(&o)
	}
	if o.inodes <= 0 {
		return "", fmt.Errorf("importing layer %s: %w: inode limit %d, want a positive limit", wantDigest, errdefs.ErrInvalidArgument, o.inodes)
	}
	if id, err := s.LayerByDigest(wantDigest); err == nil {
		return id, nil
	}
	id, err := s.NewUpper(sizeBytes, o.inodes)
	if err != nil {
		return "", fmt.Errorf("importing layer %s: %w", wantDigest, err)
	}
	err = s.importInto(id, r, wantDigest, sizeBytes)
	if err == nil {
		_, err = s.Seal(id)
	}
	if err != nil {
		s.drop(id)
		return "", fmt.Errorf("importing layer %s: %w", wantDigest, err)
	}
	s.mu.Lock()
	if other, ok := s.byDigest[wantDigest]; ok {
		s.refs[other]++
		s.mu.Unlock()
		s.drop(id)
		return other, nil
	}
	s.remember(id, wantDigest)
	s.mu.Unlock()
	return id, nil
}

// drop discards layer id at once, whatever its references: for a layer
// that never left the call that made it.
func (s *Store) drop(id string) {
	s.mu.Lock()
	delete(s.refs, id)
	delete(s.sizes, id)
	s.forgetDigest(id)
	s.mu.Unlock()
	s.discard(id)
}

// importInto writes the stream into fs/ of new layer id and checks its
// digest.
func (s *Store) importInto(id string, r io.Reader, want string, budget int64) error {
	if err := makeRoot(s.Dir(id), 0o700); err != nil {
		return fmt.Errorf("creating the layer's root: %w", err)
	}
	dfd, err := unix.Open(s.Dir(id), unix.O_PATH|unix.O_DIRECTORY|unix.O_NOFOLLOW|unix.O_CLOEXEC, 0)
	if err != nil {
		return fmt.Errorf("opening the layer: %w", err)
	}
	defer unix.Close(dfd)
	rootfd, err := unix.Openat(dfd, "fs", unix.O_RDONLY|unix.O_DIRECTORY|unix.O_NOFOLLOW|unix.O_CLOEXEC, 0)
	if err != nil {
		return fmt.Errorf("opening the layer's root: %w", err)
	}
	ah := newAsyncHash()
	defer ah.close()
	im := importer{
		// Everything read from r is hashed; the stream is accepted only
		// if nothing follows its end, so that is the stream's digest.
		in:     &streamReader{r: bufio.NewReaderSize(io.TeeReader(r, ah), 256<<10)},
		owner:  [2]uint32{uint32(os.Geteuid()), uint32(os.Getegid())},
		left:   budget,
		root:   rootfd,
		files:  map[uint64]string{},
		data:   make([]byte, 1<<20),
		xbuf:   make([]byte, maxXattrValue),
		page:   int64(os.Getpagesize()),
		layerd: dfd,
	}
	defer im.close()
	if err := im.run(); err != nil {
		return err
	}
	if got := ah.digest(); got != want {
		return fmt.Errorf("%w: the stream's digest is %s, want %s", ErrDigestMismatch, got, want)
	}
	return nil
}

// importer writes one stream's entries.
type importer struct {
	in    *streamReader
	owner [2]uint32 // of what the import creates, before its chown
	// left is what remains of the budget for the kernel memory that the
	// tmpfs's size and inode limit do not count: names, symlink targets,
	// extended attributes (trusted.* ones are not charged to the tmpfs).
	left   int64
	root   int // fs/
	layerd int // the layer's directory, fs/'s parent
	// stack holds the directories the next entry may go into: the root,
	// and the last directory entered at each depth below it.
	stack []*openDir
	n     uint64 // entries read
	// files holds every regular file read, by entry number: what a hard
	// link may name.
	files map[uint64]string
	data  []byte
	xbuf  []byte
	page  int64
}

// openDir is a directory of the stack: its metadata is applied once every
// entry in it is written (creating an entry changes its mtime; its set-gid
// bit and default ACL would shape the entries made in it).
type openDir struct {
	fd   int
	pfd  int    // its parent (the layer's directory for the root)
	name string // its name in pfd
	path string // in the layer, "" for the root
	last string // the greatest name entered in it so far
	meta meta
}

type meta struct {
	mode     uint32
	uid, gid uint32
	mtime    unix.Timespec
	xattrs   []xattr
}

func (im *importer) close() {
	for _, d := range im.stack {
		unix.Close(d.fd)
	}
	im.stack = nil
	if im.root >= 0 {
		unix.Close(im.root)
		im.root = -1
	}
}

func badf(format string, args ...any) error {
	return fmt.Errorf("%w: %s", ErrBadStream, fmt.Sprintf(format, args...))
}

// charge takes n bytes from the budget.
func (im *importer) charge(n int64) error {
	if n > im.left {
		return fmt.Errorf("%w: its names, symlink targets and xattrs take more than the layer's size", ErrLayerFull)
	}
	im.left -= n
	return nil
}

func (im *importer) run() error {
	var magic [len(xferMagic)]byte
	if err := im.in.full(magic[:]); err != nil {
		return err
	}
	if string(magic[:]) != xferMagic {
		return badf("not a layer stream (magic %q)", magic[:])
	}
	kind, err := im.u8()
	if err != nil {
		return err
	}
	depth, name, err := im.header()
	if err != nil {
		return err
	}
	if kind != kindDir || depth != 0 || name != "" {
		return badf("the first entry is not the layer's root")
	}
	m, err := im.meta(kindDir, "")
	if err != nil {
		return err
	}
	im.stack = append(im.stack, &openDir{fd: im.root, pfd: im.layerd, name: "fs", meta: m})
	im.root = -1 // the stack's now
	im.n = 1
	for {
		kind, err := im.u8()
		if err != nil {
			return err
		}
		if kind == kindEnd {
			if err := im.popTo(0); err != nil {
				return err
			}
			return im.atEOF()
		}
		if err := im.entry(kind); err != nil {
			return err
		}
	}
}

// atEOF checks that nothing follows the end entry.
func (im *importer) atEOF() error {
	var b [1]byte
	n, err := io.ReadFull(im.in.r, b[:])
	if n > 0 {
		return badf("data after the end entry, at byte %d", im.in.n)
	}
	if err != io.EOF {
		return fmt.Errorf("reading the layer stream: %w", err)
	}
	return nil
}

// header reads an entry's depth and name.
func (im *importer) header() (int, string, error) {
	depth, err := im.u16()
	if err != nil {
		return 0, "", err
	}
	nlen, err := im.u8()
	if err != nil {
		return 0, "", err
	}
	name := make([]byte, nlen)
	if err := im.in.full(name); err != nil {
		return 0, "", err
	}
	return int(depth), string(name), nil
}

// entry reads and writes one entry (kind read already) but the root.
func (im *importer) entry(kind byte) error {
	depth, name, err := im.header()
	if err != nil {
		return err
	}
	if err := checkName(name); err != nil {
		return err
	}
	if depth < 1 || depth > len(im.stack) {
		return badf("entry %q at depth %d, below no directory of the stream", name, depth)
	}
	if err := im.popTo(depth); err != nil {
		return err
	}
	parent := im.stack[depth-1]
	p := joinPath(parent.path, name)
	if name <= parent.last {
		return badf("entry /%s after /%s: out of order or repeated", p, joinPath(parent.path, parent.last))
	}
	parent.last = name
	if err := im.charge(int64(len(name))); err != nil {
		return err
	}
	num := im.n
	im.n++
	if kind == kindLink {
		return im.link(parent, name, p)
	}
	m, err := im.meta(kind, p)
	if err != nil {
		return err
	}
	switch kind {
	case kindDir:
		return im.dir(parent, name, p, depth, m)
	case kindFile:
		return im.file(parent, name, p, num, m)
	case kindSymlink:
		return im.symlink(parent, name, p, m)
	case kindFIFO, kindSocket, kindWhiteout:
		return im.node(parent, name, p, kind, m)
	}
	return badf("entry /%s of unknown kind %#x", p, kind)
}

func joinPath(dir, name string) string {
	if dir == "" {
		return name
	}
	return dir + "/" + name
}

// checkName refuses what is not a single file name.
func checkName(name string) error {
	if name == "" || name == "." || name == ".." || strings.ContainsAny(name, "/\x00") {
		return badf("entry name %q is not a file name", name)
	}
	return nil
}

// popTo closes the stack's directories down to depth entries, applying each
// one's metadata now that its entries are written.
func (im *importer) popTo(depth int) error {
	for len(im.stack) > depth {
		d := im.stack[len(im.stack)-1]
		im.stack = im.stack[:len(im.stack)-1]
		err := im.applyFD(d.fd, d.pfd, d.name, "/"+d.path, &d.meta)
		unix.Close(d.fd)
		if err != nil {
			return err
		}
	}
	return nil
}

// meta reads an entry's metadata, for an entry of kind at p.
func (im *importer) meta(kind byte, p string) (meta, error) {
	var m meta
	var err error
	if m.mode, err = im.u32(); err != nil {
		return m, err
	}
	if m.uid, err = im.u32(); err != nil {
		return m, err
	}
	if m.gid, err = im.u32(); err != nil {
		return m, err
	}
	sec, err := im.u64()
	if err != nil {
		return m, err
	}
	nsec, err := im.u32()
	if err != nil {
		return m, err
	}
	nx, err := im.u16()
	if err != nil {
		return m, err
	}
	switch {
	case m.mode&^0o7777 != 0:
		return m, badf("/%s: mode %#o has bits beyond 07777", p, m.mode)
	case kind == kindSymlink && m.mode != 0o777:
		return m, badf("/%s: a symlink of mode %#o, not 0777", p, m.mode)
	case m.uid == math.MaxUint32 || m.gid == math.MaxUint32:
		return m, badf("/%s: owner %d:%d is not an id", p, m.uid, m.gid)
	case nsec >= 1e9:
		return m, badf("/%s: mtime nanoseconds %d", p, nsec)
	}
	m.mtime = unix.Timespec{Sec: int64(sec), Nsec: int64(nsec)}
	m.xattrs, err = im.xattrs(int(nx), p)
	return m, err
}

// xattrs reads n extended attributes of the entry at p.
func (im *importer) xattrs(n int, p string) ([]xattr, error) {
	var xs []xattr
	total := 0
	for range n {
		klen, err := im.u8()
		if err != nil {
			return nil, err
		}
		key := make([]byte, klen)
		if err := im.in.full(key); err != nil {
			return nil, err
		}
		vlen, err := im.u32()
		if err != nil {
			return nil, err
		}
		k := string(key)
		switch {
		case k == "" || strings.IndexByte(k, 0) >= 0:
			return nil, badf("/%s: xattr key %q", p, k)
		case len(xs) > 0 && k <= xs[len(xs)-1].key:
			return nil, badf("/%s: xattr %s out of order or repeated", p, k)
		case vlen > maxXattrValue:
			return nil, badf("/%s: xattr %s of %d bytes, more than %d", p, k, vlen, maxXattrValue)
		}
		total += len(k) + int(vlen)
		if total > maxEntryXattrBytes {
			return nil, badf("/%s: xattrs of more than %d bytes", p, maxEntryXattrBytes)
		}
		if err := im.charge(int64(len(k)) + int64(vlen)); err != nil {
			return nil, err
		}
		v := make([]byte, vlen)
		if err := im.in.full(v); err != nil {
			return nil, err
		}
		xs = append(xs, xattr{key: k, value: v})
	}
	return xs, nil
}

// dir makes a directory and enters it; its metadata waits for popTo.
func (im *importer) dir(parent *openDir, name, p string, depth int, m meta) error {
	if err := unix.Mkdirat(parent.fd, name, 0o700); err != nil {
		return storeErr("creating", p, err)
	}
	fd, err := unix.Openat(parent.fd, name, unix.O_RDONLY|unix.O_DIRECTORY|unix.O_NOFOLLOW|unix.O_CLOEXEC, 0)
	if err != nil {
		return storeErr("opening", p, err)
	}
	if depth >= maxDepth {
		// Entries in it would be deeper than the bound: none may come,
		// so it is done.
		err := im.applyFD(fd, parent.fd, name, "/"+p, &m)
		unix.Close(fd)
		return err
	}
	im.stack = append(im.stack, &openDir{fd: fd, pfd: parent.fd, name: name, path: p, meta: m})
	return nil
}

// file makes a regular file from its extents.
func (im *importer) file(parent *openDir, name, p string, num uint64, m meta) error {
	size64, err := im.u64()
	if err != nil {
		return err
	}
	next, err := im.u32()
	if err != nil {
		return err
	}
	if size64 > math.MaxInt64 {
		return badf("/%s: size %d", p, size64)
	}
	size := int64(size64)
	fd, err := unix.Openat(parent.fd, name, unix.O_WRONLY|unix.O_CREAT|unix.O_EXCL|unix.O_NOFOLLOW|unix.O_CLOEXEC, 0o600)
	if err != nil {
		return storeErr("creating", p, err)
	}
	defer unix.Close(fd)
	end := int64(-1) // of the last extent
	for i := range next {
		if end, err = im.extent(fd, p, i, size, end); err != nil {
			return err
		}
	}
	if end != size {
		if err := unix.Ftruncate(fd, size); err != nil {
			return storeErr("sizing", p, err)
		}
	}
	if err := im.applyFD(fd, parent.fd, name, "/"+p, &m); err != nil {
		return err
	}
	im.files[num] = p
	return nil
}

// extent reads extent i of the file fd at p, of size bytes, and writes it.
// It returns where the extent ends; the previous one ended at end.
func (im *importer) extent(fd int, p string, i uint32, size, end int64) (int64, error) {
	off64, err := im.u64()
	if err != nil {
		return 0, err
	}
	len64, err := im.u64()
	if err != nil {
		return 0, err
	}
	size64 := uint64(size)
	switch {
	case off64 >= size64 || len64 == 0 || len64 > size64-off64:
		return 0, badf("/%s: extent %d (%d bytes at %d) outside its size %d or empty", p, i, len64, off64, size64)
	case int64(off64)%im.page != 0 || (int64(off64+len64)%im.page != 0 && off64+len64 != size64):
		return 0, badf("/%s: extent %d (%d bytes at %d) not on page boundaries", p, i, len64, off64)
	case int64(off64) <= end:
		return 0, badf("/%s: extent %d (at %d) not after a hole", p, i, off64)
	}
	off, n := int64(off64), int64(len64)
	for done := int64(0); done < n; {
		chunk := im.data[:min(n-done, int64(len(im.data)))]
		if err := im.in.full(chunk); err != nil {
			return 0, err
		}
		for len(chunk) > 0 {
			w, err := unix.Pwrite(fd, chunk, off+done)
			if err == nil && w == 0 {
				err = unix.EIO
			}
			if err != nil {
				return 0, storeErr("writing", p, err)
			}
			chunk = chunk[w:]
			done += int64(w)
		}
	}
	return off + n, nil
}

// link makes another name of an earlier regular file.
func (im *importer) link(parent *openDir, name, p string) error {
	num, err := im.u64()
	if err != nil {
		return err
	}
	target, ok := im.files[num]
	if !ok {
		return badf("/%s: a hard link to entry %d, not an earlier regular file", p, num)
	}
	dir, base := "", target
	if i := strings.LastIndexByte(target, '/'); i >= 0 {
		dir, base = target[:i], target[i+1:]
	}
	tfd, err := im.openDirPath(dir)
	if err != nil {
		return storeErr("linking", p, err)
	}
	defer func() {
		if tfd != im.stack[0].fd {
			unix.Close(tfd)
		}
	}()
	// The names were made by this import and nothing else writes the
	// layer; checking the inode on both sides of the link is defence in
	// depth.
	var tst, st unix.Stat_t
	if err := unix.Fstatat(tfd, base, &tst, unix.AT_SYMLINK_NOFOLLOW); err != nil {
		return storeErr("linking", p, err)
	}
	if tst.Mode&unix.S_IFMT != unix.S_IFREG {
		return badf("/%s: a hard link to /%s, not a regular file", p, target)
	}
	if err := unix.Linkat(tfd, base, parent.fd, name, 0); err != nil {
		return storeErr("linking", p, err)
	}
	if err := unix.Fstatat(parent.fd, name, &st, unix.AT_SYMLINK_NOFOLLOW); err != nil {
		return storeErr("reading", p, err)
	}
	if st.Ino != tst.Ino {
		return badf("/%s: the hard link does not reach /%s", p, target)
	}
	return nil
}

// openDirPath opens directory dir (in the layer; "" is its root) one name
// at a time, never following a symlink: the caller closes it unless it is
// the root's.
func (im *importer) openDirPath(dir string) (int, error) {
	fd := im.stack[0].fd
	if dir == "" {
		return fd, nil
	}
	for name := range strings.SplitSeq(dir, "/") {
		next, err := unix.Openat(fd, name, unix.O_PATH|unix.O_DIRECTORY|unix.O_NOFOLLOW|unix.O_CLOEXEC, 0)
		if fd != im.stack[0].fd {
			unix.Close(fd)
		}
		if err != nil {
			return -1, err
		}
		fd = next
	}
	return fd, nil
}

// symlink makes a symbolic link.
func (im *importer) symlink(parent *openDir, name, p string, m meta) error {
	tlen, err := im.u16()
	if err != nil {
		return err
	}
	if tlen == 0 || tlen > maxTarget {
		return badf("/%s: a symlink target of %d bytes", p, tlen)
	}
	target := make([]byte, tlen)
	if err := im.in.full(target); err != nil {
		return err
	}
	if bytes.IndexByte(target, 0) >= 0 {
		return badf("/%s: a symlink target holding NUL", p)
	}
	if err := im.charge(int64(tlen)); err != nil {
		return err
	}
	if err := unix.Symlinkat(string(target), parent.fd, name); err != nil {
		return storeErr("creating", p, err)
	}
	return im.applyAt(parent.fd, name, "/"+p, kindSymlink, &m)
}

// node makes a FIFO, a socket or a whiteout.
func (im *importer) node(parent *openDir, name, p string, kind byte, m meta) error {
	mode := map[byte]uint32{kindFIFO: unix.S_IFIFO, kindSocket: unix.S_IFSOCK, kindWhiteout: unix.S_IFCHR}[kind]
	if err := unix.Mknodat(parent.fd, name, mode, 0); err != nil {
		return storeErr("creating", p, err)
	}
	return im.applyAt(parent.fd, name, "/"+p, kind, &m)
}

// applyFD sets the metadata of fd, entry name of directory pfd: owner
// first (a chown drops set-id bits and file capabilities), then xattrs,
// mode and times.
func (im *importer) applyFD(fd, pfd int, name, p string, m *meta) error {
	// What the import creates is its own (no directory it writes into is
	// set-gid yet: their modes come last).
	if m.uid != im.owner[0] || m.gid != im.owner[1] {
		if err := unix.Fchown(fd, int(m.uid), int(m.gid)); err != nil {
			return storeErr("setting the owner of", p, err)
		}
	}
	for _, x := range m.xattrs {
		if err := unix.Fsetxattr(fd, x.key, x.value, 0); err != nil {
			return xattrErr(p, x.key, err)
		}
	}
	if err := unix.Fchmod(fd, m.mode); err != nil {
		return storeErr("setting the mode of", p, err)
	}
	if err := setMtime(pfd, name, m.mtime); err != nil {
		return storeErr("setting the times of", p, err)
	}
	if len(m.xattrs) > 0 {
		return im.checkXattrs(fdXattrs(fd), p, m.xattrs)
	}
	return nil
}

// applyAt sets the metadata of entry name of directory pfd, one that cannot
// be opened (a symlink, FIFO, socket or whiteout), as applyFD does, never
// following it.
func (im *importer) applyAt(pfd int, name, p string, kind byte, m *meta) error {
	if err := unix.Fchownat(pfd, name, int(m.uid), int(m.gid), unix.AT_SYMLINK_NOFOLLOW); err != nil {
		return storeErr("setting the owner of", p, err)
	}
	src := pathXattrs(pfd, name)
	if len(m.xattrs) > 0 {
		pe := procEntry(pfd, name)
		for _, x := range m.xattrs {
			if err := unix.Lsetxattr(pe, x.key, x.value, 0); err != nil {
				return xattrErr(p, x.key, err)
			}
		}
	}
	// The entry is the node just made, never a symlink here: fchmodat
	// (which follows one) reaches it.
	if kind != kindSymlink {
		if err := unix.Fchmodat(pfd, name, m.mode, 0); err != nil {
			return storeErr("setting the mode of", p, err)
		}
	}
	if err := setMtime(pfd, name, m.mtime); err != nil {
		return storeErr("setting the times of", p, err)
	}
	if len(m.xattrs) > 0 {
		return im.checkXattrs(src, p, m.xattrs)
	}
	return nil
}

// checkXattrs reads an entry's xattrs back: the kernel stores some values
// in a form of its own (ACLs, file capabilities) and a value it rewrote
// would not export as it came. Such a stream is not canonical.
func (im *importer) checkXattrs(src xattrSource, p string, want []xattr) error {
	keys, err := xattrKeys(src)
	if err != nil {
		return storeErr("reading the xattrs of", p, err)
	}
	if len(keys) != len(want) {
		return badf("%s: xattrs read back as %q, not as sent", p, keys)
	}
	for i, x := range want {
		if keys[i] != x.key {
			return badf("%s: xattrs read back as %q, not as sent", p, keys)
		}
		n, err := src.get(x.key, im.xbuf)
		if err != nil {
			return storeErr("reading the xattrs of", p, err)
		}
		if !bytes.Equal(im.xbuf[:n], x.value) {
			return badf("%s: xattr %s reads back as another value than sent", p, x.key)
		}
	}
	return nil
}

// setMtime sets both times of entry name of pfd to mtime.
func setMtime(pfd int, name string, mtime unix.Timespec) error {
	return unix.UtimesNanoAt(pfd, name, []unix.Timespec{mtime, mtime}, unix.AT_SYMLINK_NOFOLLOW)
}

// storeErr wraps an error writing entry p: the layer full is ErrLayerFull.
func storeErr(op, p string, err error) error {
	if errors.Is(err, unix.ENOSPC) || errors.Is(err, unix.EDQUOT) {
		return fmt.Errorf("%s /%s: %w: %w", op, strings.TrimPrefix(p, "/"), ErrLayerFull, err)
	}
	return fmt.Errorf("%s /%s: %w", op, strings.TrimPrefix(p, "/"), err)
}

// xattrErr wraps an error setting xattr key: one the kernel refuses to
// store (a namespace it does not know, a malformed value) is the stream's
// fault.
func xattrErr(p, key string, err error) error {
	if slices.Contains([]error{unix.EINVAL, unix.EOPNOTSUPP, unix.EPERM, unix.ERANGE, unix.E2BIG}, err) {
		return badf("%s: xattr %s cannot be stored: %v", p, key, err)
	}
	return storeErr("setting xattr "+key+" of", p, err)
}

func (im *importer) u8() (byte, error) {
	var b [1]byte
	err := im.in.full(b[:])
	return b[0], err
}

func (im *importer) u16() (uint16, error) {
	var b [2]byte
	err := im.in.full(b[:])
	return binary.BigEndian.Uint16(b[:]), err
}

func (im *importer) u32() (uint32, error) {
	var b [4]byte
	err := im.in.full(b[:])
	return binary.BigEndian.Uint32(b[:]), err
}

func (im *importer) u64() (uint64, error) {
	var b [8]byte
	err := im.in.full(b[:])
	return binary.BigEndian.Uint64(b[:]), err
}
