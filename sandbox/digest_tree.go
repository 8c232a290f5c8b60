package sandbox

import (
	"bytes"
	"crypto/sha256"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"os"
	"slices"
	"strings"
	"sync"
	"sync/atomic"

	"golang.org/x/sys/unix"

	"github.com/deltagym/deltagym/sandbox/launch"
)

// The files index of a state digest.
//
// A checkpoint's merged tree is indexed as a Merkle tree of dnodes: each entry's hash covers
// its type, permission bits, owner, group, extended attributes and content (a file's data, a
// symlink's target, a device's number), a directory's also its entries' trie (digest_dir.go:
// a Merkle hash over its names and their hashes). Times and inode numbers are left out, so two
// trees that show the same files hash the same however they were reached. Trees are immutable
// once built: a checkpoint's tree is its parent's (or the image's) with the paths its own
// layers hold replaced, copying only the directories on the way to them, and of each only the
// trie nodes on the way to the entries changed; everything else is shared.

// dnode is one entry of an index. Immutable once its tree is built.
type dnode struct {
	hash [32]byte // the entry with everything below it
	attr [32]byte // type, permission bits, owner, group, xattrs
	data [32]byte // content: a file's data, a symlink's target, a device's number
	mode uint32   // st_mode: type and permission bits
	size int64
	kids *hnode // a directory's entries (nil: none)
}

// isDir reports whether n is a directory.
func (n *dnode) isDir() bool { return n.mode&unix.S_IFMT == unix.S_IFDIR }

// ftype is n's FileType.
func (n *dnode) ftype() FileType {
	switch n.mode & unix.S_IFMT {
	case unix.S_IFREG:
		return TypeFile
	case unix.S_IFDIR:
		return TypeDir
	case unix.S_IFLNK:
		return TypeSymlink
	}
	return TypeOther
}

// seal computes n's hash from its attributes, content and entries.
func (n *dnode) seal() {
	h := sha256.New()
	h.Write(n.attr[:])
	h.Write(n.data[:])
	if n.isDir() {
		n.kids.seal()
		t := trieHash(n.kids)
		h.Write(t[:])
	}
	h.Sum(n.hash[:0])
}

// overflowID is the id a sandbox sees for a stored owner outside its range.
const overflowID = 65534

// sandboxID is the owner the sandbox sees for a stored one: layers store image-relative ids
// (idmapped mounts shift them by the sandbox's host range), and the sandbox's user namespace
// maps only launch.IDRange of them.
func sandboxID(id uint32) uint32 {
	if id >= launch.IDRange {
		return overflowID
	}
	return id
}

// attrHash hashes an entry's type, permission bits, owner and group as the sandbox sees
// them, and its xattrs (sorted, overlayfs's own marks left out: overlayMark).
func attrHash(st *unix.Stat_t, xattrs []xattrKV) [32]byte {
	var b [16]byte
	binary.LittleEndian.PutUint32(b[0:], st.Mode&(unix.S_IFMT|0o7777))
	binary.LittleEndian.PutUint32(b[4:], sandboxID(st.Uid))
	binary.LittleEndian.PutUint32(b[8:], sandboxID(st.Gid))
	binary.LittleEndian.PutUint32(b[12:], uint32(len(xattrs)))
	h := sha256.New()
	h.Write(b[:])
	var n [8]byte
	for _, x := range xattrs {
		binary.LittleEndian.PutUint64(n[:], uint64(len(x.name)))
		h.Write(n[:])
		io.WriteString(h, x.name)
		binary.LittleEndian.PutUint64(n[:], uint64(len(x.value)))
		h.Write(n[:])
		h.Write(x.value)
	}
	var out [32]byte
	h.Sum(out[:0])
	return out
}

type xattrKV struct {
	name  string
	value []byte
}

// overlayMark reports whether xattr name is overlayfs's own bookkeeping (the opaque mark,
// origins, impurity), not the sandbox's. The runtime's overlays keep their marks in the
// trusted namespace (no mount is userxattr), which a sandbox cannot write; a user.overlay.*
// xattr is the sandbox's own, which overlayfs shows and does not act on, so it is hashed like
// any other and hides nothing.
func overlayMark(name string) bool {
	return strings.HasPrefix(name, overlayPrefix)
}

// overlayPrefix is the namespace of overlayfs's marks on the runtime's layers; opaqueMark is
// its opaque directory's.
const (
	overlayPrefix = "trusted.overlay."
	opaqueMark    = overlayPrefix + "opaque"
)

// readXattrs returns p's xattrs, sorted by name, but overlayfs's marks; never follows a
// symlink.
func readXattrs(p string) ([]xattrKV, error) {
	return xattrsBy(func(b []byte) (int, error) { return unix.Llistxattr(p, b) },
		func(name string, b []byte) (int, error) { return unix.Lgetxattr(p, name, b) })
}

// fdXattrs is readXattrs of an open file.
func fdXattrs(fd int) ([]xattrKV, error) {
	return xattrsBy(func(b []byte) (int, error) { return unix.Flistxattr(fd, b) },
		func(name string, b []byte) (int, error) { return unix.Fgetxattr(fd, name, b) })
}

func xattrsBy(list func([]byte) (int, error), get func(string, []byte) (int, error)) ([]xattrKV, error) {
	var stack [256]byte
	buf := stack[:]
	var size int
	for {
		n, err := list(buf)
		if errors.Is(err, unix.ERANGE) {
			m, err := list(nil)
			if err != nil {
				return nil, err
			}
			buf = make([]byte, m+64)
			continue
		}
		if errors.Is(err, unix.ENOTSUP) {
			return nil, nil
		}
		if err != nil {
			return nil, err
		}
		size = n
		break
	}
	if size == 0 {
		return nil, nil
	}
	var out []xattrKV
	for _, name := range strings.Split(strings.TrimRight(string(buf[:size]), "\x00"), "\x00") {
		if name == "" || overlayMark(name) {
			continue
		}
		val := make([]byte, 256)
		for {
			n, err := get(name, val)
			if errors.Is(err, unix.ERANGE) {
				m, err := get(name, nil)
				if err != nil {
					return nil, err
				}
				val = make([]byte, m+64)
				continue
			}
			if errors.Is(err, unix.ENODATA) {
				val = nil
				break
			}
			if err != nil {
				return nil, err
			}
			val = val[:n]
			break
		}
		if val != nil {
			out = append(out, xattrKV{name: name, value: val})
		}
	}
	slices.SortFunc(out, func(a, b xattrKV) int { return strings.Compare(a.name, b.name) })
	return out, nil
}

// chunkSize is the unit of a file's content hash: a file hashes as its size and the hashes of
// its chunks that are not all zeros, so a hole and written zeros hash the same and a sparse
// file costs what it holds.
const chunkSize = 64 << 10

// contentHash hashes the regular file fd of size bytes by chunks (chunkSize), reading only
// its data extents (SEEK_DATA).
// read counts the bytes read.
func contentHash(fd int, size int64, buf []byte, read *int64) ([32]byte, error) {
	h := sha256.New()
	var b [8]byte
	binary.LittleEndian.PutUint64(b[:], uint64(size))
	h.Write(b[:])
	var rec [40]byte
	off := int64(0)
	for off < size {
		if size > chunkSize {
			d, err := unix.Seek(fd, off, unix.SEEK_DATA)
			if errors.Is(err, unix.ENXIO) {
				break
			}
			if err != nil {
				return [32]byte{}, err
			}
			off = d / chunkSize * chunkSize
			if off >= size {
				break
			}
		}
		n := int(min(chunkSize, size-off))
		got, err := preadFull(fd, buf[:n], off)
		if err != nil {
			return [32]byte{}, err
		}
		*read += int64(got)
		if got < n {
			clear(buf[got:n]) // shrank meanwhile: layers are sealed, so only a host's doing
		}
		if !allZero(buf[:n]) {
			binary.LittleEndian.PutUint64(rec[:8], uint64(off/chunkSize))
			s := sha256.Sum256(buf[:n])
			copy(rec[8:], s[:])
			h.Write(rec[:])
		}
		off += int64(n)
	}
	var out [32]byte
	h.Sum(out[:0])
	return out, nil
}

func allZero(b []byte) bool {
	for len(b) >= 8 {
		if binary.LittleEndian.Uint64(b) != 0 {
			return false
		}
		b = b[8:]
	}
	return bytes.Count(b, []byte{0}) == len(b)
}

// layerWalk builds index entries from one layer directory.
type layerWalk struct {
	buf []byte
	// e is the batch the walk's tries are built in (one per layer applied).
	e *edit
	// links are the entries of the regular files with more than one link met in the walk,
	// by device and inode: each is hashed once however many names it has, in the layers of
	// the walk (sealed and held meanwhile, so an inode is not reused).
	links map[[2]uint64]*dnode
	// hashed counts the bytes of file content read.
	hashed int64
	// canceled is polled between entries; an error from it ends the walk.
	canceled func() error
	n        int
}

// whiteout reports whether st is overlayfs's whiteout (a 0:0 character device).
func whiteout(st *unix.Stat_t) bool {
	return st.Mode&unix.S_IFMT == unix.S_IFCHR && st.Rdev == 0
}

// file makes the index entry of regular file name in dirfd (its directory entry's type):
// opened without following a symlink or blocking, and checked to be a regular file, so a
// FIFO or a device is never read.
func (w *layerWalk) file(dirfd int, name, p string) (*dnode, error) {
	fd, st, err := openFile(dirfd, name, p)
	if err != nil {
		return nil, err
	}
	defer unix.Close(fd)
	var ino [2]uint64
	if st.Nlink > 1 {
		ino = [2]uint64{st.Dev, st.Ino}
		if n := w.links[ino]; n != nil {
			return n, nil
		}
	}
	n, err := fileNode(fd, &st, p, w.buf, &w.hashed)
	if err != nil {
		return nil, err
	}
	if st.Nlink > 1 {
		if w.links == nil {
			w.links = map[[2]uint64]*dnode{}
		}
		w.links[ino] = n
	}
	return n, nil
}

// openFile opens regular file name in dirfd (never a FIFO's or device's open, never through a
// link) and stats it.
func openFile(dirfd int, name, p string) (int, unix.Stat_t, error) {
	var st unix.Stat_t
	fd, err := unix.Openat(dirfd, name, unix.O_RDONLY|unix.O_NOFOLLOW|unix.O_NONBLOCK|unix.O_NOCTTY|unix.O_CLOEXEC, 0)
	if err != nil {
		return -1, st, fmt.Errorf("opening %s: %w", p, err)
	}
	if err := unix.Fstat(fd, &st); err != nil || st.Mode&unix.S_IFMT != unix.S_IFREG {
		unix.Close(fd)
		return -1, st, fmt.Errorf("opening %s: %w", p, cmpErr(err, unix.ESTALE))
	}
	return fd, st, nil
}

// fileNode makes the index entry of the regular file open as fd, whose stat is st, reading it
// with buf and counting what it reads in read.
func fileNode(fd int, st *unix.Stat_t, p string, buf []byte, read *int64) (*dnode, error) {
	xs, err := fdXattrs(fd)
	if err != nil {
		return nil, fmt.Errorf("reading xattrs of %s: %w", p, err)
	}
	n := &dnode{attr: attrHash(st, xs), mode: st.Mode & (unix.S_IFMT | 0o7777), size: st.Size}
	if n.data, err = contentHash(fd, st.Size, buf, read); err != nil {
		return nil, fmt.Errorf("reading %s: %w", p, err)
	}
	n.seal()
	return n, nil
}

// aheadFiles is how many regular files a directory needs for its files to be hashed ahead on
// two goroutines (hashAhead): a delta of many files gets its digest in about half the time
// on an idle machine.
const aheadFiles = 32

// fileOf is regular file name's entry: the one made ahead, else made now (file).
func (w *layerWalk) fileOf(ahead map[string]*dnode, dirfd int, name, p string) (*dnode, error) {
	if k := ahead[name]; k != nil {
		return k, nil
	}
	return w.file(dirfd, name, p)
}

// filesAhead is, for a directory of at least aheadFiles regular files, the entries hashAhead
// made of them, by name; nil for a smaller one.
func (w *layerWalk) filesAhead(dirfd int, p string, ents []os.DirEntry) map[string]*dnode {
	var files []string
	for _, e := range ents {
		if e.Type().IsRegular() {
			files = append(files, e.Name())
		}
	}
	if len(files) < aheadFiles {
		return nil
	}
	made := w.hashAhead(dirfd, p, files)
	ahead := make(map[string]*dnode, len(files))
	for i, name := range files {
		if made[i] != nil {
			ahead[name] = made[i]
		}
	}
	return ahead
}

// hashAhead makes the entries of the regular files names of directory dirfd (path p) on two
// goroutines, the walk's and one more, each with a buffer of its own. A file with more than
// one link is left (nil) for the walk to hash once in order (layerWalk.links), as is one that
// could not be opened or read: the walk meets it again and says why.
func (w *layerWalk) hashAhead(dirfd int, p string, names []string) []*dnode {
	out := make([]*dnode, len(names))
	var next atomic.Int64
	var read atomic.Int64
	work := func(buf []byte) {
		var n int64
		for {
			i := int(next.Add(1) - 1)
			if i >= len(names) {
				break
			}
			if i%256 == 255 && w.canceled != nil && w.canceled() != nil {
				break
			}
			fd, st, err := openFile(dirfd, names[i], p+"/"+names[i])
			if err != nil {
				continue
			}
			if st.Nlink == 1 {
				out[i], _ = fileNode(fd, &st, p+"/"+names[i], buf, &n)
			}
			unix.Close(fd)
		}
		read.Add(n)
	}
	var wg sync.WaitGroup
	wg.Go(func() { work(make([]byte, len(w.buf))) })
	work(w.buf)
	wg.Wait()
	w.hashed += read.Load()
	return out
}

// leaf makes the index entry of non-directory p.
func (w *layerWalk) leaf(dirfd int, name, p string, st *unix.Stat_t) (*dnode, error) {
	if st.Mode&unix.S_IFMT == unix.S_IFREG {
		return w.file(dirfd, name, p)
	}
	xs, err := readXattrs(p)
	if err != nil {
		return nil, fmt.Errorf("reading xattrs of %s: %w", p, err)
	}
	n := &dnode{attr: attrHash(st, xs), mode: st.Mode & (unix.S_IFMT | 0o7777), size: st.Size}
	switch st.Mode & unix.S_IFMT {
	case unix.S_IFLNK:
		target, err := readlinkat(dirfd, name)
		if err != nil {
			return nil, fmt.Errorf("reading link %s: %w", p, err)
		}
		n.data = sha256.Sum256([]byte(target))
	case unix.S_IFCHR, unix.S_IFBLK:
		var b [8]byte
		binary.LittleEndian.PutUint64(b[:], st.Rdev)
		n.data = sha256.Sum256(b[:])
		n.size = 0
	default:
		n.size = 0
	}
	n.seal()
	return n, nil
}

func cmpErr(err, def error) error {
	if err != nil {
		return err
	}
	return def
}

func readlinkat(dirfd int, name string) (string, error) {
	buf := make([]byte, 256)
	for {
		n, err := unix.Readlinkat(dirfd, name, buf)
		if err != nil {
			return "", err
		}
		if n < len(buf) {
			return string(buf[:n]), nil
		}
		buf = make([]byte, len(buf)*2)
	}
}

// dirNode returns a new directory entry for directory p (its attributes; no entries yet).
func dirNode(p string, st *unix.Stat_t) (*dnode, error) {
	xs, err := readXattrs(p)
	if err != nil {
		return nil, fmt.Errorf("reading xattrs of %s: %w", p, err)
	}
	return &dnode{attr: attrHash(st, xs), mode: st.Mode & (unix.S_IFMT | 0o7777)}, nil
}

// isOpaqueDir reports whether directory p is overlayfs-opaque (hides the layers below): it
// has the opaque mark of the runtime's overlays (overlayPrefix), and no other.
func isOpaqueDir(p string) bool {
	var buf [4]byte
	n, err := unix.Lgetxattr(p, opaqueMark, buf[:])
	return err == nil && n == 1 && buf[0] == 'y'
}

// maxDigestDepth bounds the directories a layer walk descends (a descriptor each).
const maxDigestDepth = 512

// apply returns base (a directory entry, nil for none) with the layer directory p over it,
// as overlayfs shows an upper over a lower: whiteouts remove, an opaque directory or one over
// a non-directory replaces, a directory over a directory merges (its own attributes win),
// anything else replaces. base is not changed: the directories apply changes are copies.
// keepAttr keeps base's own attributes (a layer's root directory is not the sandbox's root).
func (w *layerWalk) apply(base *dnode, dirfd int, p string, depth int, keepAttr bool) (*dnode, error) {
	if depth > maxDigestDepth {
		return nil, fmt.Errorf("indexing %s: nested more than %d directories deep", p, maxDigestDepth)
	}
	var st unix.Stat_t
	if err := unix.Fstat(dirfd, &st); err != nil {
		return nil, err
	}
	out, err := dirNode(p, &st)
	if err != nil {
		return nil, err
	}
	switch {
	case base != nil && base.isDir() && !isOpaqueDir(p):
		out.kids = base.kids // shared: changed below in the walk's batch, copying as it goes
		if keepAttr {
			out.attr, out.mode = base.attr, base.mode
		}
	case keepAttr && base != nil:
		out.attr, out.mode = base.attr, base.mode
	}
	ents, err := readDirEntries(dirfd)
	if err != nil {
		return nil, fmt.Errorf("listing %s: %w", p, err)
	}
	ahead := w.filesAhead(dirfd, p, ents)
	for _, e := range ents {
		if err := w.tick(); err != nil {
			return nil, err
		}
		name := e.Name()
		cp := p + "/" + name
		if e.Type().IsRegular() {
			k, err := w.fileOf(ahead, dirfd, name, cp)
			if err != nil {
				return nil, err
			}
			out.kids = out.kids.set(w.e, name, k)
			continue
		}
		var cst unix.Stat_t
		if err := unix.Fstatat(dirfd, name, &cst, unix.AT_SYMLINK_NOFOLLOW); err != nil {
			return nil, fmt.Errorf("indexing %s: %w", cp, err)
		}
		switch {
		case whiteout(&cst):
			out.kids = out.kids.set(w.e, name, nil)
		case cst.Mode&unix.S_IFMT == unix.S_IFDIR:
			cfd, err := unix.Openat(dirfd, name, unix.O_RDONLY|unix.O_DIRECTORY|unix.O_NOFOLLOW|unix.O_CLOEXEC, 0)
			if err != nil {
				return nil, fmt.Errorf("opening %s: %w", cp, err)
			}
			k, err := w.apply(out.kids.get(name), cfd, cp, depth+1, false)
			unix.Close(cfd)
			if err != nil {
				return nil, err
			}
			out.kids = out.kids.set(w.e, name, k)
		default:
			k, err := w.leaf(dirfd, name, cp, &cst)
			if err != nil {
				return nil, err
			}
			out.kids = out.kids.set(w.e, name, k)
		}
	}
	out.seal()
	return out, nil
}

func (w *layerWalk) tick() error {
	if w.n++; w.n%256 == 0 && w.canceled != nil {
		return w.canceled()
	}
	return nil
}

// readDirEntries lists the entries of directory fd, with their types as the directory gives
// them.
func readDirEntries(fd int) ([]os.DirEntry, error) {
	dfd, err := unix.Dup(fd)
	if err != nil {
		return nil, err
	}
	// Dup shares the offset: rewind, so that a directory read twice lists it whole.
	if _, err := unix.Seek(dfd, 0, io.SeekStart); err != nil {
		unix.Close(dfd)
		return nil, err
	}
	f := newDirFile(dfd)
	defer f.Close()
	return f.ReadDir(-1)
}

// applyLayer returns root (nil: none) with layer directory p over it.
func (w *layerWalk) applyLayer(root *dnode, p string) (*dnode, error) {
	fd, err := unix.Open(p, unix.O_RDONLY|unix.O_DIRECTORY|unix.O_NOFOLLOW|unix.O_CLOEXEC, 0)
	if err != nil {
		return nil, fmt.Errorf("opening layer %s: %w", p, err)
	}
	defer unix.Close(fd)
	w.e = newEdit()
	return w.apply(root, fd, p, 0, root != nil)
}

// withShm returns root with dir /dev/shm standing for the sandbox's /dev/shm: the entries of
// shm (nil: empty) under a directory of fixed attributes (the tmpfs's root, mode 1777).
func withShm(root, shm *dnode) *dnode {
	st := unix.Stat_t{Mode: unix.S_IFDIR | 0o1777}
	sd := &dnode{attr: attrHash(&st, nil), mode: st.Mode}
	if shm != nil {
		sd.kids = shm.kids
	}
	sd.seal()
	return replaceAt(root, []string{"dev", "shm"}, sd)
}

// replaceAt returns root with the entry at path comps replaced by n (made with directories of
// mode 0755 where missing), copying the directories on the way.
func replaceAt(root *dnode, comps []string, n *dnode) *dnode {
	if len(comps) == 0 {
		return n
	}
	out := &dnode{}
	if root != nil && root.isDir() {
		*out = *root
	} else {
		st := unix.Stat_t{Mode: unix.S_IFDIR | 0o755}
		out.attr, out.mode = attrHash(&st, nil), st.Mode
	}
	out.kids = out.kids.set(newEdit(), comps[0], replaceAt(out.kids.get(comps[0]), comps[1:], n))
	out.seal()
	return out
}

// lookupNode returns the entry at path comps below root, nil if none.
func lookupNode(root *dnode, comps []string) *dnode {
	n := root
	for _, c := range comps {
		if n == nil || !n.isDir() {
			return nil
		}
		n = n.kids.get(c)
	}
	return n
}
