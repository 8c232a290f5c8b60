package layers

import (
	"bytes"
	"crypto/sha256"
	"encoding/binary"
	"encoding/hex"
	"errors"
	"fmt"
	"io"
	"math/rand/v2"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"testing"

	"golang.org/x/sys/unix"

	"github.com/deltagym/deltagym/internal/errdefs"
)

// node is a second store on the same machine: the node a layer is sent to.
func node(t *testing.T) *Store { return newStore(t) }

// assertEmpty fails unless store s holds nothing: no layer, no mount, no
// directory left by a failed import.
func assertEmpty(t *testing.T, s *Store) {
	t.Helper()
	s.Wait()
	if n := s.Mounts(); n != 0 {
		t.Errorf("the store holds %d layers, want none", n)
	}
	if es, err := os.ReadDir(s.dir); err != nil || len(es) != 0 {
		t.Errorf("the store's directory holds %d entries (%v), want none", len(es), err)
	}
	mi, err := os.ReadFile("/proc/self/mountinfo")
	if err != nil {
		t.Fatal(err)
	}
	if bytes.Contains(mi, []byte(" "+s.dir+"/")) {
		t.Errorf("a mount below the store is left:\n%s", mi)
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	if len(s.digests) != 0 || len(s.byDigest) != 0 {
		t.Errorf("the store keeps digests %v / %v of layers it no longer holds", s.digests, s.byDigest)
	}
}

func digestBytes(b []byte) string {
	sum := sha256.Sum256(b)
	return "sha256:" + hex.EncodeToString(sum[:])
}

const (
	gib      = 1 << 30
	deepness = 20 // levels of 200-byte names: a path far past PATH_MAX
)

var longName = strings.Repeat("n", 255)

// richUpper makes a writable layer holding every kind of entry a layer
// holds: whiteouts, an opaque directory, user.* and trusted.* xattrs,
// owners, a hard-link group of three names, a 1 GiB sparse file with data at
// both ends, a symlink, a FIFO, a socket, set-id and sticky modes, an empty
// directory, a path deeper than PATH_MAX, a 255-byte name, times to the
// nanosecond.
func richUpper(t *testing.T, s *Store) string {
	t.Helper()
	id, err := s.NewUpper(0, 0)
	if err != nil {
		t.Fatal(err)
	}
	up := s.UpperPath(id)
	must := func(err error) {
		t.Helper()
		if err != nil {
			s.Unref(id)
			t.Fatal(err)
		}
	}
	at := func(p string) string { return filepath.Join(up, p) }
	for _, d := range []string{"etc", "opq", "a", "b", "empty", "sticky", "sgid"} {
		must(os.Mkdir(at(d), 0o755))
	}
	must(unix.Mknod(at("etc/gone"), unix.S_IFCHR, 0))
	must(unix.Mknod(at("gone-too"), unix.S_IFCHR, 0))
	must(os.WriteFile(at("opq/inside"), []byte("kept under an opaque dir"), 0o644))
	must(unix.Lsetxattr(at("opq"), opaqueXattr, []byte("y"), 0))
	must(os.WriteFile(at("etc/conf"), []byte(strings.Repeat("config\n", 1000)), 0o640))
	must(unix.Lsetxattr(at("etc/conf"), "user.mime", []byte("text/plain"), 0))
	must(unix.Lsetxattr(at("etc/conf"), "trusted.dg.label", []byte{0, 1, 2, 255}, 0))
	must(unix.Lsetxattr(at("etc"), "user.dir", []byte("d"), 0))
	must(os.WriteFile(at("a/h1"), []byte("three names, one inode"), 0o644))
	must(os.Link(at("a/h1"), at("b/h2")))
	must(os.Link(at("a/h1"), at("h3")))
	// Sparse: a page of data at 0 and at 1 GiB - 4 KiB, holes between.
	f, err := os.Create(at("sparse"))
	must(err)
	page := bytes.Repeat([]byte{'s'}, 4096)
	_, err = f.WriteAt(page, 0)
	must(err)
	_, err = f.WriteAt(page, gib-4096)
	must(err)
	must(f.Close())
	must(os.WriteFile(at("odd-size"), bytes.Repeat([]byte{'o'}, 5000), 0o644))
	must(os.WriteFile(at("empty-file"), nil, 0o644))
	must(os.Symlink("../nowhere", at("link")))
	must(unix.Lsetxattr(at("link"), "trusted.dg.onlink", []byte("l"), 0))
	must(unix.Mkfifo(at("fifo"), 0o620))
	must(unix.Mknod(at("sock"), unix.S_IFSOCK|0o755, 0))
	must(os.WriteFile(at("suid"), []byte("#!/bin/true\n"), 0o755))
	must(os.WriteFile(at(longName), []byte("a 255-byte name"), 0o644))
	must(os.WriteFile(at("sgid/f"), []byte("in a set-gid dir"), 0o644))

	// Owners, modes and times, children before their directories.
	type m struct {
		p        string
		uid, gid int
		mode     uint32 // 0: leave
	}
	metas := []m{
		{"etc/gone", 0, 0, 0}, {"gone-too", 1000, 1000, 0}, {"opq/inside", 1000, 1000, 0},
		{"etc/conf", 0, 65534, 0o640}, {"a/h1", 1000, 1000, 0o600}, {"sparse", 65534, 65534, 0o644},
		{"odd-size", 0, 0, 0o644}, {"empty-file", 1000, 0, 0o444}, {"link", 1000, 1000, 0},
		{"fifo", 65534, 65534, 0o620}, {"sock", 1000, 1000, 0o755}, {"suid", 0, 0, 0o4755},
		{longName, 0, 0, 0o644}, {"sgid/f", 0, 1000, 0o664},
		{"etc", 0, 0, 0o755}, {"opq", 1000, 1000, 0o750}, {"a", 0, 0, 0o755}, {"b", 0, 0, 0o711},
		{"empty", 65534, 65534, 0o700}, {"sticky", 0, 0, 0o1777}, {"sgid", 0, 1000, 0o2775},
	}
	for i, e := range metas {
		must(unix.Lchown(at(e.p), e.uid, e.gid))
		if e.mode != 0 {
			must(unix.Chmod(at(e.p), e.mode))
		}
		ts := unix.Timespec{Sec: 1_700_000_000 + int64(i), Nsec: 123_456_789 + int64(i)}
		must(unix.UtimesNanoAt(unix.AT_FDCWD, at(e.p), []unix.Timespec{ts, ts}, unix.AT_SYMLINK_NOFOLLOW))
	}
	must(deepPath(up))
	return id
}

// deepPath makes deepness levels of directories with 200-byte names under
// dir, a file at the bottom, by descriptors (the path is past PATH_MAX),
// and sets their times bottom up.
func deepPath(dir string) error {
	fd, err := unix.Open(dir, unix.O_RDONLY|unix.O_DIRECTORY, 0)
	if err != nil {
		return err
	}
	fds := []int{fd}
	defer func() {
		for _, fd := range fds {
			unix.Close(fd)
		}
	}()
	name := func(i int) string { return fmt.Sprintf("%03d", i) + strings.Repeat("d", 197) }
	for i := range deepness {
		if err := unix.Mkdirat(fds[i], name(i), 0o755); err != nil {
			return err
		}
		fd, err := unix.Openat(fds[i], name(i), unix.O_RDONLY|unix.O_DIRECTORY, 0)
		if err != nil {
			return err
		}
		fds = append(fds, fd)
	}
	bottom := fds[deepness]
	f, err := unix.Openat(bottom, "bottom", unix.O_WRONLY|unix.O_CREAT, 0o644)
	if err != nil {
		return err
	}
	unix.Write(f, []byte("deep"))
	unix.Close(f)
	ts := []unix.Timespec{{Sec: 1_600_000_000, Nsec: 1}, {Sec: 1_600_000_000, Nsec: 1}}
	if err := unix.UtimesNanoAt(bottom, "bottom", ts, 0); err != nil {
		return err
	}
	for i := deepness - 1; i >= 0; i-- {
		ts[1].Nsec = int64(i + 2)
		if err := unix.UtimesNanoAt(fds[i], name(i), ts, 0); err != nil {
			return err
		}
	}
	return nil
}

// fileInfo is what a walk of a layer sees of an entry.
type fileInfo struct {
	typ      uint32
	mode     uint32
	uid, gid uint32
	mtime    unix.Timespec
	size     int64
	blocks   int64 // regular files: the pages the tmpfs holds
	sum      [32]byte
	target   string
	rdev     uint64
	xattrs   string
	links    string // the other names of a file's inode, sorted
}

// walkTree reads every entry of the tree at root by descriptors (paths may
// be past PATH_MAX): types, modes, owners, mtimes, sizes, contents, blocks,
// symlink targets, device numbers, every xattr, hard-link groups.
func walkTree(t *testing.T, root string) map[string]fileInfo {
	t.Helper()
	out := map[string]fileInfo{}
	inodes := map[uint64][]string{}
	rfd, err := unix.Open(root, unix.O_RDONLY|unix.O_DIRECTORY|unix.O_NOFOLLOW, 0)
	if err != nil {
		t.Fatal(err)
	}
	var walk func(dirfd int, name, rel string)
	walk = func(dirfd int, name, rel string) {
		var st unix.Stat_t
		if err := unix.Fstatat(dirfd, name, &st, unix.AT_SYMLINK_NOFOLLOW); err != nil {
			t.Fatalf("stat %s: %v", rel, err)
		}
		fi := fileInfo{typ: st.Mode & unix.S_IFMT, mode: st.Mode & 0o7777, uid: st.Uid, gid: st.Gid, mtime: st.Mtim}
		var keys []string
		var err error
		switch fi.typ {
		case unix.S_IFDIR, unix.S_IFREG:
			fd, oerr := unix.Openat(dirfd, name, unix.O_RDONLY|unix.O_NOFOLLOW, 0)
			if oerr != nil {
				t.Fatalf("open %s: %v", rel, oerr)
			}
			defer unix.Close(fd)
			src := fdXattrs(fd)
			keys, err = xattrKeys(src)
			fi.xattrs = xattrString(t, src, keys)
			if fi.typ == unix.S_IFREG {
				fi.size, fi.blocks, fi.sum = st.Size, st.Blocks, contentSum(t, fd, st.Size)
				inodes[st.Ino] = append(inodes[st.Ino], rel)
			} else {
				names, lerr := readNames(fd)
				if lerr != nil {
					t.Fatal(lerr)
				}
				for _, n := range names {
					walk(fd, n, filepath.Join(rel, n))
				}
			}
		default:
			src := pathXattrs(dirfd, name)
			keys, err = xattrKeys(src)
			fi.xattrs = xattrString(t, src, keys)
			if fi.typ == unix.S_IFLNK {
				buf := make([]byte, 4096)
				n, lerr := unix.Readlinkat(dirfd, name, buf)
				if lerr != nil {
					t.Fatal(lerr)
				}
				fi.target = string(buf[:n])
			}
			fi.rdev = st.Rdev
		}
		if err != nil {
			t.Fatalf("xattrs of %s: %v", rel, err)
		}
		out[rel] = fi
	}
	walk(rfd, ".", ".")
	unix.Close(rfd)
	for _, group := range inodes {
		for _, p := range group {
			fi := out[p]
			fi.links = strings.Join(slices.DeleteFunc(slices.Sorted(slices.Values(group)), func(q string) bool { return q == p }), ",")
			out[p] = fi
		}
	}
	return out
}

// preader reads a descriptor at offsets, leaving it open.
type preader int

func (fd preader) ReadAt(p []byte, off int64) (int, error) {
	n, err := unix.Pread(int(fd), p, off)
	if err == nil && n == 0 && len(p) > 0 {
		return 0, io.EOF
	}
	return n, err
}

// contentSum hashes a file's data extents, where they are and what they
// hold (holes read as zeros: the extents and the size say it all), without
// reading a sparse file's holes.
func contentSum(t *testing.T, fd int, size int64) [32]byte {
	t.Helper()
	exts, err := dataExtents(fd, size, nil)
	if err != nil {
		t.Fatal(err)
	}
	h := sha256.New()
	for _, x := range exts {
		fmt.Fprintf(h, "%d+%d:", x.off, x.len)
		if _, err := io.Copy(h, io.NewSectionReader(preader(fd), x.off, x.len)); err != nil {
			t.Fatal(err)
		}
	}
	return [32]byte(h.Sum(nil))
}

func xattrString(t *testing.T, src xattrSource, keys []string) string {
	t.Helper()
	var parts []string
	buf := make([]byte, maxXattrValue)
	for _, k := range keys {
		n, err := src.get(k, buf)
		if err != nil {
			t.Fatalf("xattr %s: %v", k, err)
		}
		parts = append(parts, k+"="+strconv.Quote(string(buf[:n])))
	}
	return strings.Join(parts, " ")
}

// diffTrees lists how got differs from want, entry by entry.
func diffTrees(want, got map[string]fileInfo) []string {
	var out []string
	for _, p := range slices.Sorted(func(yield func(string) bool) {
		for p := range want {
			if !yield(p) {
				return
			}
		}
		for p := range got {
			if _, ok := want[p]; !ok && !yield(p) {
				return
			}
		}
	}) {
		a, inA := want[p]
		b, inB := got[p]
		switch {
		case !inA:
			out = append(out, fmt.Sprintf("%s: not wanted, got %+v", p, b))
		case !inB:
			out = append(out, fmt.Sprintf("%s: missing, want %+v", p, a))
		case a != b:
			out = append(out, fmt.Sprintf("%s:\n\twant %+v\n\tgot  %+v", p, a, b))
		}
	}
	return out
}

func sealedRich(t *testing.T, s *Store) string {
	t.Helper()
	id := richUpper(t, s)
	if _, err := s.Seal(id); err != nil {
		s.Unref(id)
		t.Fatal(err)
	}
	return id
}

func exportBytes(t *testing.T, s *Store, id string) ([]byte, string) {
	t.Helper()
	var buf bytes.Buffer
	d, err := s.Export(&buf, id)
	if err != nil {
		t.Fatal(err)
	}
	return buf.Bytes(), d
}

// failingReader fails the test if read: a call that must not read.
type failingReader struct{ t *testing.T }

func (r failingReader) Read([]byte) (int, error) {
	r.t.Error("the stream was read")
	return 0, io.ErrUnexpectedEOF
}

// TestXferRoundTrip: a layer holding every kind of entry, exported and
// imported into another store, is the same tree to the last attribute; its
// stream is the same each time it is exported, on either node.
func TestXferRoundTrip(t *testing.T) {
	a, b := newStore(t), node(t)
	src := sealedRich(t, a)
	stream, d := exportBytes(t, a, src)
	if d != digestBytes(stream) {
		t.Fatalf("Export's digest %s, the stream's %s", d, digestBytes(stream))
	}
	again, d2 := exportBytes(t, a, src)
	if d2 != d || !bytes.Equal(again, stream) {
		t.Fatalf("a second export differs: digest %s, then %s", d, d2)
	}
	if got, err := a.Digest(src); err != nil || got != d {
		t.Fatalf("Digest: %s (%v), want %s", got, err, d)
	}
	if len(stream) > 1<<20 {
		t.Fatalf("the stream of a layer with a 1 GiB sparse file is %d bytes: its holes travelled", len(stream))
	}

	dst, err := b.Import(bytes.NewReader(stream), d, 64<<20)
	if err != nil {
		t.Fatal(err)
	}
	want, got := walkTree(t, a.Path(src)), walkTree(t, b.Path(dst))
	if diff := diffTrees(want, got); len(diff) > 0 {
		t.Fatalf("the imported layer differs:\n%s", strings.Join(diff, "\n"))
	}
	// The walk compared blocks too; say plainly what the sparse file costs.
	if sp := got["sparse"]; sp.size != gib || sp.blocks*512 > 64<<10 {
		t.Fatalf("imported sparse file: size %d, %d bytes of blocks, want 1 GiB in at most 64 KiB", sp.size, sp.blocks*512)
	}
	for _, p := range []string{"a/h1", "b/h2", "h3"} {
		if n := strings.Count(got[p].links, ",") + 1; got[p].links == "" || n != 2 {
			t.Fatalf("%s: other names %q, want the other two of its group", p, got[p].links)
		}
	}
	if _, sealed := b.SealedSize(dst); !sealed {
		t.Fatal("the imported layer is not sealed")
	}
	if err := os.WriteFile(filepath.Join(b.Path(dst), "new"), nil, 0o644); !errors.Is(err, unix.EROFS) {
		t.Fatalf("writing into the imported layer: %v, want EROFS", err)
	}
	if got, err := b.Digest(dst); err != nil || got != d {
		t.Fatalf("the imported layer's digest: %s (%v), want %s", got, err, d)
	}
	// Exported again from the node that imported it: the same bytes.
	if re, _ := exportBytes(t, b, dst); !bytes.Equal(re, stream) {
		t.Fatal("the imported layer exports other bytes than it came as")
	}

	// The node finds it by digest, and a second import of it is the same
	// layer, the stream unread.
	byD, err := b.LayerByDigest(d)
	if err != nil || byD != dst {
		t.Fatalf("LayerByDigest: %s (%v), want %s", byD, err, dst)
	}
	second, err := b.Import(failingReader{t}, d, 64<<20)
	if err != nil || second != dst {
		t.Fatalf("a second import: %s (%v), want %s", second, err, dst)
	}
	for range 2 {
		b.Unref(dst)
	}
	b.Wait()
	if !IsMount(b.Dir(dst)) {
		t.Fatal("the imported layer went with references left")
	}
	b.Unref(dst)
	if _, err := b.LayerByDigest(d); !errors.Is(err, ErrNotFound) {
		t.Fatalf("LayerByDigest after the last reference: %v, want ErrNotFound", err)
	}
	a.Unref(src)
	assertEmpty(t, a)
	assertEmpty(t, b)
}

// TestXferDigestMismatchDiscards: a stream whose digest is not the one asked
// for leaves nothing, and the error names both.
func TestXferDigestMismatchDiscards(t *testing.T) {
	a, b := newStore(t), node(t)
	src := sealedRich(t, a)
	defer a.Unref(src)
	stream, d := exportBytes(t, a, src)
	wrong := "sha256:" + strings.Repeat("0", 64)
	_, err := b.Import(bytes.NewReader(stream), wrong, 64<<20)
	if !errors.Is(err, ErrDigestMismatch) || !errors.Is(err, errdefs.ErrInvalidArgument) {
		t.Fatalf("import under a wrong digest: %v, want ErrDigestMismatch", err)
	}
	if !strings.Contains(err.Error(), d) || !strings.Contains(err.Error(), wrong) {
		t.Fatalf("the error %q does not name both digests", err)
	}
	assertEmpty(t, b)
	for _, bad := range []string{"", "sha256:", "md5:" + strings.Repeat("0", 32), "sha256:" + strings.Repeat("A", 64), "sha256:" + strings.Repeat("g", 64)} {
		if _, err := b.Import(bytes.NewReader(stream), bad, 64<<20); !errors.Is(err, ErrBadDigest) {
			t.Errorf("import under digest %q: %v, want ErrBadDigest", bad, err)
		}
	}
	if _, err := b.Import(bytes.NewReader(stream), d, 0); !errors.Is(err, errdefs.ErrInvalidArgument) {
		t.Errorf("import with no size: %v, want an invalid argument", err)
	}
	assertEmpty(t, b)
}

// TestXferExportRefuses: only sealed layers travel, and not with a device.
func TestXferExportRefuses(t *testing.T) {
	s := newStore(t)
	up, err := s.NewUpper(0, 0)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := s.Export(io.Discard, up); !errors.Is(err, ErrNotSealed) {
		t.Fatalf("export of a writable layer: %v, want ErrNotSealed", err)
	}
	if _, err := s.Digest(up); !errors.Is(err, ErrNotSealed) {
		t.Fatalf("digest of a writable layer: %v, want ErrNotSealed", err)
	}
	if err := unix.Mknod(filepath.Join(s.UpperPath(up), "null"), unix.S_IFCHR|0o666, int(unix.Mkdev(1, 3))); err != nil {
		t.Fatal(err)
	}
	if _, err := s.Seal(up); err != nil {
		t.Fatal(err)
	}
	if _, err := s.Export(io.Discard, up); !errors.Is(err, ErrUntransferable) || !strings.Contains(err.Error(), "/null") {
		t.Fatalf("export of a layer holding /dev/null's device: %v, want ErrUntransferable naming it", err)
	}
	if _, err := s.Export(io.Discard, "lnothere"); !errors.Is(err, ErrNotFound) {
		t.Fatalf("export of an unknown layer: %v, want ErrNotFound", err)
	}
	s.Unref(up)
	assertEmpty(t, s)
}

// TestXferDigestCache: a digest is kept while its layer is sealed and held,
// dropped at an unseal and at the last reference; of two layers with one
// digest, the one left is found once the other goes.
func TestXferDigestCache(t *testing.T) {
	s := newStore(t)
	l := &layerSpec{entries: map[string]*entrySpec{
		"f": {kind: 'f', mode: 0o644, data: []byte("same"), mtime: 1e18},
	}}
	same := func() string {
		id := upperWith(t, s, l)
		ts := []unix.Timespec{{Sec: 1}, {Sec: 1}}
		if err := unix.UtimesNano(s.UpperPath(id), ts); err != nil {
			t.Fatal(err)
		}
		if _, err := s.Seal(id); err != nil {
			t.Fatal(err)
		}
		return id
	}
	one, two := same(), same()
	d1, err := s.Digest(one)
	if err != nil {
		t.Fatal(err)
	}
	if d2, err := s.Digest(two); err != nil || d2 != d1 {
		t.Fatalf("digests of two equal layers: %s, %s (%v)", d1, d2, err)
	}
	if got, err := s.LayerByDigest(d1); err != nil || got != one {
		t.Fatalf("LayerByDigest: %s (%v), want %s", got, err, one)
	}
	s.Unref(one) // LayerByDigest's
	s.Unref(one)
	got, err := s.LayerByDigest(d1)
	if err != nil || got != two {
		t.Fatalf("LayerByDigest once the first is gone: %s (%v), want %s", got, err, two)
	}
	s.Unref(two)
	if err := s.Unseal(two); err != nil {
		t.Fatal(err)
	}
	if _, err := s.LayerByDigest(d1); !errors.Is(err, ErrNotFound) {
		t.Fatalf("LayerByDigest of an unsealed layer: %v, want ErrNotFound", err)
	}
	if err := os.WriteFile(filepath.Join(s.UpperPath(two), "f"), []byte("changed"), 0o644); err != nil {
		t.Fatal(err)
	}
	if _, err := s.Seal(two); err != nil {
		t.Fatal(err)
	}
	if d, err := s.Digest(two); err != nil || d == d1 {
		t.Fatalf("the digest of a layer changed while unsealed: %s (%v), want another than %s", d, err, d1)
	}
	s.Unref(two)
	assertEmpty(t, s)
}

// streamBuilder writes streams by hand, well formed or not, and records
// where each entry ends.
type streamBuilder struct {
	b      []byte
	bounds []int
}

func newStream() *streamBuilder {
	sb := &streamBuilder{b: []byte(xferMagic)}
	sb.mark()
	return sb
}

func (sb *streamBuilder) mark() *streamBuilder {
	sb.bounds = append(sb.bounds, len(sb.b))
	return sb
}

func (sb *streamBuilder) u8(v byte) *streamBuilder { sb.b = append(sb.b, v); return sb }
func (sb *streamBuilder) u16(v uint16) *streamBuilder {
	sb.b = binary.BigEndian.AppendUint16(sb.b, v)
	return sb
}

func (sb *streamBuilder) u32(v uint32) *streamBuilder {
	sb.b = binary.BigEndian.AppendUint32(sb.b, v)
	return sb
}

func (sb *streamBuilder) u64(v uint64) *streamBuilder {
	sb.b = binary.BigEndian.AppendUint64(sb.b, v)
	return sb
}
func (sb *streamBuilder) raw(p []byte) *streamBuilder { sb.b = append(sb.b, p...); return sb }

func (sb *streamBuilder) hdr(kind byte, depth int, name string) *streamBuilder {
	return sb.u8(kind).u16(uint16(depth)).u8(byte(len(name))).raw([]byte(name))
}

// meta writes mode, owner 0:0, mtime and xattrs.
func (sb *streamBuilder) meta(mode uint32, xs ...xattr) *streamBuilder {
	sb.u32(mode).u32(0).u32(0).u64(1_700_000_000).u32(5).u16(uint16(len(xs)))
	for _, x := range xs {
		sb.u8(byte(len(x.key))).raw([]byte(x.key)).u32(uint32(len(x.value))).raw(x.value)
	}
	return sb
}

func (sb *streamBuilder) root() *streamBuilder { return sb.hdr(kindDir, 0, "").meta(0o755).mark() }
func (sb *streamBuilder) dir(depth int, name string) *streamBuilder {
	return sb.hdr(kindDir, depth, name).meta(0o755).mark()
}

func (sb *streamBuilder) file(depth int, name string, data []byte) *streamBuilder {
	sb.hdr(kindFile, depth, name).meta(0o644).u64(uint64(len(data)))
	if len(data) == 0 {
		return sb.u32(0).mark()
	}
	return sb.u32(1).u64(0).u64(uint64(len(data))).raw(data).mark()
}

func (sb *streamBuilder) link(depth int, name string, to uint64) *streamBuilder {
	return sb.hdr(kindLink, depth, name).u64(to).mark()
}

func (sb *streamBuilder) symlink(depth int, name, target string) *streamBuilder {
	return sb.hdr(kindSymlink, depth, name).meta(0o777).u16(uint16(len(target))).raw([]byte(target)).mark()
}

func (sb *streamBuilder) end() []byte { return append(sb.b, kindEnd) }

// goodStream is a small well-formed stream: a directory, files, a hard link,
// a symlink, a whiteout.
func goodStream() *streamBuilder {
	sb := newStream().root()
	sb.dir(1, "d").file(2, "f", []byte("data")).hdr(kindWhiteout, 2, "w").meta(0).mark()
	sb.link(1, "g", 2).symlink(1, "l", "d/f")
	return sb
}

// TestXferHostileStreams: each stream that breaks the format is refused with
// a clear error, and nothing of it is left, in the store or outside it.
func TestXferHostileStreams(t *testing.T) {
	s := newStore(t)
	outside := t.TempDir()
	cases := []struct {
		name   string
		stream func() []byte
		want   error
	}{
		{"not a stream", func() []byte { return []byte("hello, this is not a layer") }, ErrBadStream},
		{"first entry not the root", func() []byte { return newStream().dir(1, "d").end() }, ErrBadStream},
		{"second root", func() []byte { return newStream().root().root().end() }, ErrBadStream},
		{"traversal", func() []byte { return newStream().root().file(1, "..", []byte("x")).end() }, ErrBadStream},
		{"dot", func() []byte { return newStream().root().dir(1, ".").end() }, ErrBadStream},
		{"absolute path", func() []byte { return newStream().root().file(1, "/etc/passwd", []byte("x")).end() }, ErrBadStream},
		{"slash in a name", func() []byte { return newStream().root().dir(1, "d").file(1, "d/../../x", []byte("x")).end() }, ErrBadStream},
		{"NUL in a name", func() []byte { return newStream().root().file(1, "a\x00b", []byte("x")).end() }, ErrBadStream},
		{"empty name", func() []byte { return newStream().root().file(1, "", []byte("x")).end() }, ErrBadStream},
		{"duplicate", func() []byte { return newStream().root().file(1, "a", nil).file(1, "a", nil).end() }, ErrBadStream},
		{"duplicate directory", func() []byte { return newStream().root().dir(1, "a").dir(1, "a").end() }, ErrBadStream},
		{"out of order", func() []byte { return newStream().root().file(1, "b", nil).file(1, "a", nil).end() }, ErrBadStream},
		// A directory once left cannot be entered again: after b, a name
		// of depth 1 must follow b, so a cannot come back.
		{"back into a closed directory", func() []byte {
			return newStream().root().dir(1, "a").dir(1, "b").file(2, "x", nil).dir(1, "a").file(2, "y", nil).end()
		}, ErrBadStream},
		{"depth skipped", func() []byte { return newStream().root().file(2, "x", nil).end() }, ErrBadStream},
		{"under a file", func() []byte { return newStream().root().file(1, "f", nil).file(2, "x", nil).end() }, ErrBadStream},
		{"under a symlink to outside", func() []byte {
			return newStream().root().symlink(1, "l", outside).file(2, "x", []byte("escaped")).end()
		}, ErrBadStream},
		{"link to a later entry", func() []byte { return newStream().root().link(1, "a", 2).file(1, "b", nil).end() }, ErrBadStream},
		{"link to itself", func() []byte { return newStream().root().link(1, "a", 1).end() }, ErrBadStream},
		{"link to a directory", func() []byte { return newStream().root().dir(1, "d").link(1, "e", 1).end() }, ErrBadStream},
		{"link to the root", func() []byte { return newStream().root().link(1, "e", 0).end() }, ErrBadStream},
		{"link to a symlink", func() []byte { return newStream().root().symlink(1, "l", "/").link(1, "m", 1).end() }, ErrBadStream},
		{"device 1:3", func() []byte {
			return newStream().root().hdr('c', 1, "null").meta(0o666).u32(1).u32(3).mark().end()
		}, ErrBadStream},
		{"block device", func() []byte { return newStream().root().hdr('b', 1, "sda").meta(0o660).u32(8).u32(0).mark().end() }, ErrBadStream},
		{"oversize xattr", func() []byte {
			return newStream().root().hdr(kindFile, 1, "f").meta(0o644, xattr{"user.big", make([]byte, maxXattrValue+1)}).u64(0).u32(0).mark().end()
		}, ErrBadStream},
		{"xattrs past their total", func() []byte {
			v := make([]byte, maxXattrValue)
			return newStream().root().hdr(kindFile, 1, "f").meta(0o644, xattr{"user.a", v}, xattr{"user.b", v}, xattr{"user.c", v}).u64(0).u32(0).mark().end()
		}, ErrBadStream},
		{"xattrs out of order", func() []byte {
			return newStream().root().hdr(kindDir, 1, "d").meta(0o755, xattr{"user.b", nil}, xattr{"user.a", nil}).mark().end()
		}, ErrBadStream},
		{"xattr repeated", func() []byte {
			return newStream().root().hdr(kindDir, 1, "d").meta(0o755, xattr{"user.a", nil}, xattr{"user.a", nil}).mark().end()
		}, ErrBadStream},
		{"xattr of no namespace", func() []byte {
			return newStream().root().hdr(kindDir, 1, "d").meta(0o755, xattr{"nonamespace", []byte("v")}).mark().end()
		}, ErrBadStream},
		{"mode beyond 07777", func() []byte { return newStream().root().hdr(kindDir, 1, "d").meta(0o40755).mark().end() }, ErrBadStream},
		{"symlink mode", func() []byte {
			return newStream().root().hdr(kindSymlink, 1, "l").meta(0o755).u16(1).raw([]byte("x")).mark().end()
		}, ErrBadStream},
		{"owner -1", func() []byte {
			return newStream().root().hdr(kindDir, 1, "d").u32(0o755).u32(0xffffffff).u32(0).u64(0).u32(0).u16(0).mark().end()
		}, ErrBadStream},
		{"nanoseconds past a second", func() []byte {
			return newStream().root().hdr(kindDir, 1, "d").u32(0o755).u32(0).u32(0).u64(0).u32(1e9).u16(0).mark().end()
		}, ErrBadStream},
		{"empty symlink target", func() []byte { return newStream().root().symlink(1, "l", "").end() }, ErrBadStream},
		{"extent past the size", func() []byte {
			return newStream().root().hdr(kindFile, 1, "f").meta(0o644).u64(10).u32(1).u64(0).u64(11).raw(make([]byte, 11)).mark().end()
		}, ErrBadStream},
		{"extent off a page", func() []byte {
			return newStream().root().hdr(kindFile, 1, "f").meta(0o644).u64(10000).u32(1).u64(100).u64(10).raw(make([]byte, 10)).mark().end()
		}, ErrBadStream},
		{"empty extent", func() []byte {
			return newStream().root().hdr(kindFile, 1, "f").meta(0o644).u64(4096).u32(1).u64(0).u64(0).mark().end()
		}, ErrBadStream},
		{"extents overlapping", func() []byte {
			return newStream().root().hdr(kindFile, 1, "f").meta(0o644).u64(16384).u32(2).
				u64(0).u64(8192).raw(make([]byte, 8192)).u64(4096).u64(4096).raw(make([]byte, 4096)).mark().end()
		}, ErrBadStream},
		{"extents with no hole between", func() []byte {
			return newStream().root().hdr(kindFile, 1, "f").meta(0o644).u64(16384).u32(2).
				u64(0).u64(4096).raw(make([]byte, 4096)).u64(4096).u64(4096).raw(make([]byte, 4096)).mark().end()
		}, ErrBadStream},
		{"size 2^63", func() []byte {
			return newStream().root().hdr(kindFile, 1, "f").meta(0o644).u64(1 << 63).u32(0).mark().end()
		}, ErrBadStream},
		{"unknown kind", func() []byte { return newStream().root().hdr('x', 1, "x").meta(0o644).mark().end() }, ErrBadStream},
		{"data after the end", func() []byte { return append(goodStream().end(), 0) }, ErrBadStream},
		{"no end", func() []byte { return goodStream().b }, ErrBadStream},
		{"past the size", func() []byte { return newStream().root().file(1, "big", make([]byte, 2<<20)).end() }, ErrLayerFull},
		{"past the inodes", func() []byte {
			sb := newStream().root()
			for i := range 20 {
				sb.file(1, fmt.Sprintf("f%02d", i), nil)
			}
			return sb.end()
		}, ErrLayerFull},
		{"links past the inodes", func() []byte {
			sb := newStream().root().file(1, "a", nil)
			for i := range 20 {
				sb.link(1, fmt.Sprintf("b%02d", i), 1)
			}
			return sb.end()
		}, ErrLayerFull},
		{"xattrs past the size", func() []byte {
			// trusted.* xattrs are kernel memory the tmpfs does not
			// count: the import's budget does.
			sb := newStream().root()
			v := make([]byte, 60000)
			for i := range 9 {
				sb.hdr(kindDir, 1, fmt.Sprintf("d%d", i)).meta(0o755, xattr{"trusted.a", v}, xattr{"trusted.b", v}).mark()
			}
			return sb.end()
		}, ErrLayerFull},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			stream := c.stream()
			// Its own digest: the stream's form is what is refused.
			_, err := s.Import(bytes.NewReader(stream), digestBytes(stream), 1<<20, WithInodes(10))
			if !errors.Is(err, c.want) {
				t.Fatalf("import: %v, want %v", err, c.want)
			}
			assertEmpty(t, s)
			if es, _ := os.ReadDir(outside); len(es) != 0 {
				t.Fatalf("the stream wrote outside its layer: %v", es)
			}
		})
	}

	// A well-formed stream cut at each entry's end, and within its
	// entries, is a truncated stream.
	good := goodStream()
	full := good.end()
	if _, err := s.Import(bytes.NewReader(full), digestBytes(full), 1<<20); err != nil {
		t.Fatalf("the well-formed stream: %v", err)
	}
	cuts := slices.Clone(good.bounds)
	for i := 0; i < len(full); i += 7 {
		cuts = append(cuts, i)
	}
	for _, n := range cuts {
		part := full[:n]
		if _, err := s.Import(bytes.NewReader(part), digestBytes(part), 1<<20); !errors.Is(err, ErrBadStream) {
			t.Fatalf("the stream cut at byte %d of %d: %v, want ErrBadStream", n, len(full), err)
		}
	}
	s.mu.Lock()
	var held []string
	for id := range s.refs {
		held = append(held, id)
	}
	s.mu.Unlock()
	for _, id := range held {
		s.Unref(id)
	}
	assertEmpty(t, s)
}

// TestXferConcurrentImports: imports of one digest at once end as one
// layer, each with a reference.
func TestXferConcurrentImports(t *testing.T) {
	s := newStore(t)
	full := goodStream().end()
	d := digestBytes(full)
	const n = 4
	ids := make(chan string, n)
	errs := make(chan error, n)
	for range n {
		go func() {
			id, err := s.Import(bytes.NewReader(full), d, 1<<20)
			ids <- id
			errs <- err
		}()
	}
	var got []string
	for range n {
		if err := <-errs; err != nil {
			t.Fatal(err)
		}
		got = append(got, <-ids)
	}
	slices.Sort(got)
	if got = slices.Compact(got); len(got) != 1 {
		t.Fatalf("concurrent imports of one digest made layers %v, want one", got)
	}
	s.Wait()
	if m := s.Mounts(); m != 1 {
		t.Fatalf("%d layers after concurrent imports of one digest, want 1", m)
	}
	for range n {
		s.Unref(got[0])
	}
	assertEmpty(t, s)
}

// FuzzImport feeds Import arbitrary streams, each under its own digest:
// either the stream is refused and nothing is left, or it is imported and
// exports back as the very same bytes (the format is canonical).
//
//	go test ./sandbox/layers/ -run '^$' -fuzz FuzzImport -fuzztime 60s
func FuzzImport(f *testing.F) {
	f.Add(goodStream().end())
	f.Add(newStream().root().end())
	f.Add(newStream().root().dir(1, "a").dir(2, "b").file(3, "c", []byte("x")).link(1, "d", 3).end())
	f.Add(newStream().root().hdr(kindFile, 1, "s").meta(0o644, xattr{"trusted.x", []byte("v")}, xattr{"user.y", nil}).
		u64(1 << 20).u32(2).u64(0).u64(4096).raw(make([]byte, 4096)).u64(8192).u64(100).raw([]byte(strings.Repeat("z", 100))).mark().end())
	f.Fuzz(func(t *testing.T, stream []byte) {
		s := newStore(t)
		id, err := s.Import(bytes.NewReader(stream), digestBytes(stream), 4<<20, WithInodes(64))
		if err != nil {
			if !errors.Is(err, ErrBadStream) && !errors.Is(err, ErrLayerFull) {
				t.Fatalf("a refusal of another class: %v", err)
			}
			assertEmpty(t, s)
			return
		}
		var out bytes.Buffer
		if _, err := s.Export(&out, id); err != nil {
			t.Fatalf("exporting an imported layer: %v", err)
		}
		if !bytes.Equal(out.Bytes(), stream) {
			t.Fatalf("an imported stream exports as other bytes:\n in %x\nout %x", stream, out.Bytes())
		}
		s.Unref(id)
		assertEmpty(t, s)
	})
}

// TestConformanceTransferIsTheLayer: random layers (every kind of entry but
// devices, which do not travel) come out of a transfer as they went in, and
// export again as the same bytes.
func TestConformanceTransferIsTheLayer(t *testing.T) {
	a, b := newStore(t), node(t)
	forSeeds(t, func(t *testing.T, rng *rand.Rand) {
		l := genLayer(rng, nil, true)
		for _, e := range l.entries {
			if e.kind == 'c' {
				e.kind = 'p'
			}
		}
		src := sealedWith(t, a, l)
		defer a.Unref(src)
		stream, d := exportBytes(t, a, src)
		dst, err := b.Import(bytes.NewReader(stream), d, 64<<20)
		if err != nil {
			t.Fatal(err)
		}
		defer b.Unref(dst)
		if diff := diffTrees(walkTree(t, a.Path(src)), walkTree(t, b.Path(dst))); len(diff) > 0 {
			t.Fatalf("the imported layer differs:\n%s", strings.Join(diff, "\n"))
		}
		if re, _ := exportBytes(t, b, dst); !bytes.Equal(re, stream) {
			t.Fatal("the imported layer exports other bytes than it came as")
		}
	})
}
