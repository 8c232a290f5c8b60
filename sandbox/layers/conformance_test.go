package layers

// The store's conformance suite: what every layer the store hands out promises, whatever the
// tree in it. A sealed layer is read-only; references keep a layer until the last goes; a copy
// (CopyInto) is the layer its source seals into; and a merged layer (Flatten) over the image
// looks exactly like the stack of layers it merged, mounted as overlayfs mounts it. The last two
// are property tests over random trees — files, directories, symlinks, hard links, FIFOs,
// devices, whiteouts, opaque directories, xattrs, owners, modes and times, across several
// layers — with one fixed seed by default and more on demand:
//
//	go test ./sandbox/layers/ -run Conformance -layers.seeds=200 [-layers.seed=N]
//
// (or DELTAGYM_LAYERS_SEEDS=200; the default runs the fixed seeds 1 to 20, in well under a
// second). A failure names its seed.

import (
	"crypto/sha256"
	"errors"
	"flag"
	"fmt"
	"math/rand/v2"
	"os"
	"path"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"testing"

	"golang.org/x/sys/unix"
)

var (
	seedFirst = flag.Uint64("layers.seed", 1, "first seed of the layer store's property tests")
	seedCount = flag.Int("layers.seeds", envInt("DELTAGYM_LAYERS_SEEDS", 20), "number of seeds of the layer store's property tests (default $DELTAGYM_LAYERS_SEEDS, else 20)")
)

func envInt(name string, def int) int {
	if n, err := strconv.Atoi(os.Getenv(name)); err == nil && n > 0 {
		return n
	}
	return def
}

// forSeeds runs fn once per seed, as subtests named by the seed.
func forSeeds(t *testing.T, fn func(t *testing.T, rng *rand.Rand)) {
	for i := range uint64(*seedCount) {
		seed := *seedFirst + i
		t.Run("seed="+strconv.FormatUint(seed, 10), func(t *testing.T) {
			fn(t, rand.New(rand.NewPCG(seed, seed^0x9e3779b97f4a7c15)))
		})
	}
}

// TestConformanceSealIsReadOnly: nothing changes a sealed layer, through any call.
func TestConformanceSealIsReadOnly(t *testing.T) {
	s := newStore(t)
	forSeeds(t, func(t *testing.T, rng *rand.Rand) {
		id := upperWith(t, s, genLayer(rng, nil, true))
		defer s.Unref(id)
		if _, err := s.Seal(id); err != nil {
			t.Fatal(err)
		}
		before := snapshot(t, s.Path(id), true)
		var file, dir string
		for p, e := range before.entries {
			switch {
			case e.typ == unix.S_IFREG && file == "":
				file = p
			case e.typ == unix.S_IFDIR && p != "." && dir == "":
				dir = p
			}
		}
		root := s.Path(id)
		attempts := map[string]func() error{
			"create":  func() error { return os.WriteFile(filepath.Join(root, "new"), nil, 0o644) },
			"mkdir":   func() error { return unix.Mkdir(filepath.Join(root, "newdir"), 0o755) },
			"symlink": func() error { return unix.Symlink("x", filepath.Join(root, "newlink")) },
			"mknod":   func() error { return unix.Mknod(filepath.Join(root, "wh"), unix.S_IFCHR, 0) },
			"chmod":   func() error { return unix.Chmod(root, 0o700) },
			"chown":   func() error { return unix.Lchown(root, 1000, 1000) },
			"utimes":  func() error { return unix.UtimesNano(root, []unix.Timespec{{}, {}}) },
			"setxattr": func() error {
				return unix.Lsetxattr(root, "trusted.overlay.opaque", []byte("y"), 0)
			},
		}
		if file != "" {
			f := filepath.Join(root, file)
			attempts["write"] = func() error {
				fd, err := unix.Open(f, unix.O_WRONLY, 0)
				if err == nil {
					unix.Close(fd)
				}
				return err
			}
			attempts["truncate"] = func() error { return unix.Truncate(f, 0) }
			attempts["unlink"] = func() error { return unix.Unlink(f) }
			attempts["link"] = func() error { return unix.Link(f, filepath.Join(root, "hard")) }
			attempts["rename"] = func() error { return unix.Rename(f, filepath.Join(root, "moved")) }
			attempts["removexattr"] = func() error { return unix.Lremovexattr(f, "user.k") }
		}
		if dir != "" {
			attempts["rmdir"] = func() error { return os.RemoveAll(filepath.Join(root, dir)) }
		}
		for name, try := range attempts {
			if err := try(); !errors.Is(err, unix.EROFS) {
				t.Errorf("%s in a sealed layer: %v, want EROFS", name, err)
			}
		}
		if d := before.diff(snapshot(t, s.Path(id), true), true); len(d) > 0 {
			t.Fatalf("the sealed layer changed:\n%s", strings.Join(d, "\n"))
		}
	})
}

// TestConformanceRefcounts: a layer lives while it has references; the last Unref discards it
// (unmounted, removed) in the background, and a discarded layer cannot be referenced again.
func TestConformanceRefcounts(t *testing.T) {
	s := newStore(t)
	id, err := s.NewUpper(1<<20, 0)
	if err != nil {
		t.Fatal(err)
	}
	if !IsMount(s.Dir(id)) {
		t.Fatal("a new layer is not a mount")
	}
	if err := s.Ref(id); err != nil {
		t.Fatal(err)
	}
	if err := s.Ref(id); err != nil {
		t.Fatal(err)
	}
	if _, err := s.Seal(id); err != nil {
		t.Fatal(err)
	}
	size, sealed := s.SealedSize(id)
	if !sealed || s.SealedBytes() != size {
		t.Fatalf("sealed size %d (%v), store's sealed bytes %d", size, sealed, s.SealedBytes())
	}
	for i := range 2 {
		s.Unref(id)
		s.Wait()
		if !IsMount(s.Dir(id)) {
			t.Fatalf("layer discarded with %d references left", 2-i)
		}
	}
	s.Unref(id)
	s.Wait()
	if s.Pending() != 0 {
		t.Fatalf("%d discards pending after Wait", s.Pending())
	}
	if _, err := os.Lstat(s.Dir(id)); !errors.Is(err, os.ErrNotExist) {
		t.Fatalf("layer after its last reference: %v, want it gone", err)
	}
	if _, sealed := s.SealedSize(id); sealed || s.SealedBytes() != 0 {
		t.Fatal("a discarded layer still counts as sealed")
	}
	if err := s.Ref(id); !errors.Is(err, ErrNotFound) {
		t.Fatalf("Ref of a discarded layer: %v, want ErrNotFound", err)
	}
	s.Unref(id) // a layer the store does not hold: nothing happens
	if err := s.Ref("lnothere"); !errors.Is(err, ErrNotFound) {
		t.Fatalf("Ref of an unknown layer: %v, want ErrNotFound", err)
	}
	// A flattened layer holds its own reference: its sources can go.
	a, b := sealedWith(t, s, genLayer(rand.New(rand.NewPCG(1, 2)), nil, false)), sealedWith(t, s, nil)
	m, err := s.Flatten([]string{a, b}, 0, nil)
	if err != nil {
		t.Fatal(err)
	}
	s.Unref(a)
	s.Unref(b)
	s.Wait()
	if !IsMount(s.Dir(m)) || IsMount(s.Dir(a)) {
		t.Fatal("Flatten's result does not outlive its sources")
	}
	s.Unref(m)
}

// TestConformanceCopyIsItsSeal: CopyInto of an upper gives the layer that upper seals into:
// the same tree, owners, modes, times, xattrs (overlayfs's marks included), whiteouts and hard
// links.
func TestConformanceCopyIsItsSeal(t *testing.T) {
	s := newStore(t)
	forSeeds(t, func(t *testing.T, rng *rand.Rand) {
		src := upperWith(t, s, genLayer(rng, nil, true))
		defer s.Unref(src)
		dst, err := s.NewUpper(0, 0)
		if err != nil {
			t.Fatal(err)
		}
		defer s.Unref(dst)
		if _, err := s.CopyInto(src, dst); err != nil {
			t.Fatal(err)
		}
		if _, err := s.Seal(src); err != nil {
			t.Fatal(err)
		}
		if d := snapshot(t, s.Path(src), true).diff(snapshot(t, s.Path(dst), true), true); len(d) > 0 {
			t.Fatalf("the copy differs from the sealed layer:\n%s", strings.Join(d, "\n"))
		}
	})
}

// TestConformanceMergeIsTheStack: a layer Flatten merges from several, mounted over the image,
// looks exactly like those layers stacked over the image.
func TestConformanceMergeIsTheStack(t *testing.T) {
	s := newStore(t)
	forSeeds(t, func(t *testing.T, rng *rand.Rand) {
		var all []*layerSpec
		image := genLayer(rng, nil, false)
		all = append(all, image)
		base := sealedWith(t, s, image)
		defer s.Unref(base)
		var ids []string
		for range 2 + rng.IntN(4) {
			l := genLayer(rng, all, true)
			all = append(all, l)
			id := sealedWith(t, s, l)
			defer s.Unref(id)
			ids = append(ids, id)
		}
		merged, err := s.Flatten(ids, 0, []string{s.Path(base)})
		if err != nil {
			t.Fatal(err)
		}
		defer s.Unref(merged)
		stack := []string{s.Path(base)}
		for _, id := range ids {
			stack = append(stack, s.Path(id))
		}
		want := snapshot(t, mountStack(t, stack), false)
		got := snapshot(t, mountStack(t, []string{s.Path(base), s.Path(merged)}), false)
		if len(got.ghosts) > 0 {
			t.Errorf("the merged view lists names it has not (whiteouts kept where they hide nothing): %v", got.ghosts)
		}
		if d := want.diff(got, false); len(d) > 0 {
			t.Fatalf("the merged layer's view differs from the stack's (%d layers):\n%s", len(ids), strings.Join(d, "\n"))
		}
	})
}

// mountStack mounts layers (bottom first) as a read-only overlay, unmounted at cleanup, and
// returns where.
func mountStack(t *testing.T, layers []string) string {
	t.Helper()
	top := slices.Clone(layers)
	slices.Reverse(top)
	dir := t.TempDir()
	opts := "lowerdir=" + strings.Join(top, ":") + ",redirect_dir=off,metacopy=off,xino=off"
	if err := unix.Mount("overlay", dir, "overlay", unix.MS_RDONLY, opts); err != nil {
		t.Fatalf("mounting the overlay of %d layers: %v", len(layers), err)
	}
	t.Cleanup(func() {
		if err := unix.Unmount(dir, unix.MNT_DETACH); err != nil {
			t.Errorf("unmounting %s: %v", dir, err)
		}
	})
	return dir
}

// A random layer: entries by path (relative, slash-separated).
type layerSpec struct {
	entries map[string]*entrySpec
}

type entrySpec struct {
	kind     byte // 'f' file, 'd' dir, 'l' symlink, 'h' hard link, 'w' whiteout, 'p' fifo, 'c' device
	data     []byte
	target   string // a symlink's target, or the file a hard link names
	mode     uint32
	uid, gid int
	opaque   bool
	xattrs   map[string]string
	mtime    int64
}

var (
	fileModes  = []uint32{0o644, 0o600, 0o755, 0o400, 0o444, 0o4755, 0o2755, 0o640}
	dirModes   = []uint32{0o755, 0o700, 0o711, 0o1777, 0o2775, 0o750}
	owners     = []int{0, 0, 0, 1000, 65534}
	entryNames = []string{"a", "b", "c", "d", "etc", "usr", "x.txt", "lib", ".hidden", "z"}
)

// genLayer makes a random layer. below are the layers it will sit on (bottom first); it mostly
// touches their paths. delta allows whiteouts and opaque directories.
func genLayer(rng *rand.Rand, below []*layerSpec, delta bool) *layerSpec {
	var known []string // paths of the layers below, and of this one
	for _, l := range below {
		for p := range l.entries {
			known = append(known, p)
		}
	}
	slices.Sort(known)
	l := &layerSpec{entries: map[string]*entrySpec{}}
	for range 10 + rng.IntN(30) {
		var p string
		if len(known) > 0 && rng.IntN(10) < 6 {
			p = known[rng.IntN(len(known))]
		} else {
			parent := ""
			if len(known) > 0 && rng.IntN(3) > 0 {
				parent = path.Dir(known[rng.IntN(len(known))] + "/x")
			}
			p = path.Join(parent, entryNames[rng.IntN(len(entryNames))])
		}
		e := genEntry(rng, l, delta)
		if l.add(p, e) {
			known = append(known, p)
		}
	}
	return l
}

func genEntry(rng *rand.Rand, l *layerSpec, delta bool) *entrySpec {
	e := &entrySpec{uid: owners[rng.IntN(len(owners))], gid: owners[rng.IntN(len(owners))],
		mtime: 1_600_000_000_000_000_000 + rng.Int64N(1e17)}
	switch r := rng.IntN(100); {
	case r < 35:
		e.kind, e.mode = 'f', fileModes[rng.IntN(len(fileModes))]
		e.data = genData(rng)
	case r < 55:
		e.kind, e.mode = 'd', dirModes[rng.IntN(len(dirModes))]
		e.opaque = delta && rng.IntN(4) == 0
	case r < 65:
		e.kind, e.target = 'l', []string{"a", "../b", "/etc/passwd", "nowhere", "c/d"}[rng.IntN(5)]
	case r < 75:
		var files []string
		for p, x := range l.entries {
			if x.kind == 'f' {
				files = append(files, p)
			}
		}
		if len(files) == 0 {
			return genEntry(rng, l, delta)
		}
		slices.Sort(files)
		e.kind, e.target = 'h', files[rng.IntN(len(files))]
	case r < 92 && delta:
		e.kind = 'w'
	case r < 96:
		e.kind, e.mode = 'p', 0o644
	default:
		e.kind, e.mode = 'c', 0o600
	}
	if (e.kind == 'f' || e.kind == 'd') && rng.IntN(3) == 0 {
		e.xattrs = map[string]string{"user.k": strconv.Itoa(rng.IntN(100))}
		if rng.IntN(3) == 0 {
			e.xattrs["trusted.dg"] = "t" + strconv.Itoa(rng.IntN(10))
		}
	}
	return e
}

// genData returns file contents: empty, short, or with blocks of zeros (holes in a copy).
func genData(rng *rand.Rand) []byte {
	switch rng.IntN(6) {
	case 0:
		return nil
	case 1:
		b := make([]byte, 3*64<<10+rng.IntN(100))
		b[0], b[len(b)/2] = 'x', 'y'
		if rng.IntN(2) == 0 {
			b[len(b)-1] = 'z' // else it ends in zeros: a hole up to its size
		}
		return b
	}
	b := make([]byte, rng.IntN(200))
	for i := range b {
		b[i] = byte('a' + rng.IntN(26))
	}
	return b
}

// add puts e at p, with plain directories for any parent the layer lacks, unless that clashes
// with what the layer has (a parent that is not a directory, a directory with entries below).
func (l *layerSpec) add(p string, e *entrySpec) bool {
	for a := path.Dir(p); a != "."; a = path.Dir(a) {
		if x, ok := l.entries[a]; ok && x.kind != 'd' {
			return false
		}
	}
	if e.kind == 'h' && (e.target == p || strings.HasPrefix(e.target, p+"/")) {
		return false
	}
	if x, ok := l.entries[p]; ok && x.kind == 'd' && e.kind != 'd' {
		for q := range l.entries {
			if strings.HasPrefix(q, p+"/") {
				return false
			}
		}
	}
	for a := path.Dir(p); a != "."; a = path.Dir(a) {
		if _, ok := l.entries[a]; !ok {
			l.entries[a] = &entrySpec{kind: 'd', mode: 0o755, mtime: e.mtime}
		}
	}
	l.entries[p] = e
	return true
}

// upperWith makes a writable layer holding l in its upper.
func upperWith(t *testing.T, s *Store, l *layerSpec) string {
	t.Helper()
	id, err := s.NewUpper(0, 0)
	if err != nil {
		t.Fatal(err)
	}
	if l != nil {
		if err := l.write(s.UpperPath(id)); err != nil {
			s.Unref(id)
			t.Fatalf("writing a layer: %v", err)
		}
	}
	return id
}

// sealedWith makes a sealed layer of l.
func sealedWith(t *testing.T, s *Store, l *layerSpec) string {
	t.Helper()
	id := upperWith(t, s, l)
	if _, err := s.Seal(id); err != nil {
		s.Unref(id)
		t.Fatal(err)
	}
	return id
}

// write creates the layer's entries under root: every entry, then the hard links, then the
// metadata, children before their directories (whose times their creation changes).
func (l *layerSpec) write(root string) error {
	ps := slices.Sorted(func(yield func(string) bool) {
		for p := range l.entries {
			if !yield(p) {
				return
			}
		}
	})
	for _, p := range ps {
		if e := l.entries[p]; e.kind != 'h' {
			if err := e.create(filepath.Join(root, p)); err != nil {
				return err
			}
		}
	}
	for _, p := range ps {
		e := l.entries[p]
		if e.kind != 'h' {
			continue
		}
		if t := l.entries[e.target]; t == nil || t.kind != 'f' {
			// What it named was replaced: a file of its own instead.
			*e = entrySpec{kind: 'f', mode: 0o644, data: []byte(p), mtime: e.mtime}
			if err := e.create(filepath.Join(root, p)); err != nil {
				return err
			}
			continue
		}
		if err := unix.Link(filepath.Join(root, e.target), filepath.Join(root, p)); err != nil {
			return fmt.Errorf("linking %s: %w", p, err)
		}
	}
	slices.SortFunc(ps, func(a, b string) int { return strings.Count(b, "/") - strings.Count(a, "/") })
	for _, p := range ps {
		if e := l.entries[p]; e.kind != 'h' {
			if err := e.meta(filepath.Join(root, p)); err != nil {
				return err
			}
		}
	}
	return nil
}

func (e *entrySpec) create(p string) error {
	var err error
	switch e.kind {
	case 'f':
		err = os.WriteFile(p, e.data, 0o600)
	case 'd':
		err = unix.Mkdir(p, 0o700)
	case 'l':
		err = unix.Symlink(e.target, p)
	case 'w':
		err = unix.Mknod(p, unix.S_IFCHR, 0)
	case 'p':
		err = unix.Mkfifo(p, 0o600)
	case 'c':
		err = unix.Mknod(p, unix.S_IFCHR|0o600, int(unix.Mkdev(1, 3)))
	}
	if err != nil {
		return fmt.Errorf("creating %s: %w", p, err)
	}
	return nil
}

// meta sets owner, xattrs, mode and times, in that order (chown clears set-id bits).
func (e *entrySpec) meta(p string) error {
	if err := unix.Lchown(p, e.uid, e.gid); err != nil {
		return fmt.Errorf("chown %s: %w", p, err)
	}
	for k, v := range e.xattrs {
		if err := unix.Lsetxattr(p, k, []byte(v), 0); err != nil {
			return fmt.Errorf("setxattr %s: %w", p, err)
		}
	}
	if e.opaque {
		if err := unix.Lsetxattr(p, opaqueXattr, []byte("y"), 0); err != nil {
			return fmt.Errorf("marking %s opaque: %w", p, err)
		}
	}
	if e.kind != 'l' && e.kind != 'w' {
		if err := unix.Chmod(p, e.mode); err != nil {
			return fmt.Errorf("chmod %s: %w", p, err)
		}
	}
	ts := []unix.Timespec{unix.NsecToTimespec(e.mtime), unix.NsecToTimespec(e.mtime)}
	if err := unix.UtimesNanoAt(unix.AT_FDCWD, p, ts, unix.AT_SYMLINK_NOFOLLOW); err != nil {
		return fmt.Errorf("utimes %s: %w", p, err)
	}
	return nil
}

// A tree as seen from its root: what a process there could observe of each entry.
type tree struct {
	entries map[string]seen
	// ghosts are names a directory lists that do not resolve (an overlay passes through the
	// listing of a directory only one layer has, whiteouts included).
	ghosts []string
}

type seen struct {
	typ      uint32
	mode     uint32 // permission and set-id bits
	uid, gid uint32
	size     int64 // regular files
	sum      [32]byte
	target   string
	rdev     uint64
	mtime    unix.Timespec
	xattrs   string
	links    string // the other names of a non-directory's inode, sorted
}

// snapshot reads the tree at root. raw keeps overlayfs's trusted.overlay.* xattrs (a layer's own
// view); an overlay's view has none.
func snapshot(t *testing.T, root string, raw bool) *tree {
	t.Helper()
	tr := &tree{entries: map[string]seen{}}
	inodes := map[[2]uint64][]string{}
	var walk func(rel string)
	walk = func(rel string) {
		p := filepath.Join(root, rel)
		var st unix.Stat_t
		if err := unix.Lstat(p, &st); err != nil {
			if errors.Is(err, unix.ENOENT) && rel != "." {
				tr.ghosts = append(tr.ghosts, rel)
				return
			}
			t.Fatalf("lstat %s: %v", p, err)
		}
		e := seen{typ: st.Mode & unix.S_IFMT, mode: st.Mode & 0o7777, uid: st.Uid, gid: st.Gid, mtime: st.Mtim,
			xattrs: xattrsOf(t, p, raw)}
		switch e.typ {
		case unix.S_IFREG:
			b, err := os.ReadFile(p)
			if err != nil {
				t.Fatal(err)
			}
			e.size, e.sum = st.Size, sha256.Sum256(b)
		case unix.S_IFLNK:
			e.target, _ = os.Readlink(p)
		case unix.S_IFCHR, unix.S_IFBLK:
			e.rdev = st.Rdev
		case unix.S_IFDIR:
			es, err := os.ReadDir(p)
			if err != nil {
				t.Fatal(err)
			}
			for _, c := range es {
				walk(path.Join(rel, c.Name()))
			}
		}
		if e.typ != unix.S_IFDIR {
			k := [2]uint64{st.Dev, st.Ino}
			inodes[k] = append(inodes[k], rel)
		}
		tr.entries[rel] = e
	}
	walk(".")
	for _, group := range inodes {
		for _, p := range group {
			e := tr.entries[p]
			e.links = strings.Join(slices.DeleteFunc(slices.Sorted(slices.Values(group)), func(q string) bool { return q == p }), ",")
			tr.entries[p] = e
		}
	}
	return tr
}

func xattrsOf(t *testing.T, p string, raw bool) string {
	t.Helper()
	n, err := unix.Llistxattr(p, nil)
	if err != nil || n == 0 {
		return ""
	}
	buf := make([]byte, n)
	n, err = unix.Llistxattr(p, buf)
	if err != nil {
		t.Fatalf("listing xattrs of %s: %v", p, err)
	}
	var out []string
	for _, k := range strings.Split(strings.TrimRight(string(buf[:n]), "\x00"), "\x00") {
		if k == "" || !raw && strings.HasPrefix(k, "trusted.overlay.") {
			continue
		}
		v := make([]byte, 256)
		m, err := unix.Lgetxattr(p, k, v)
		if err != nil {
			t.Fatalf("reading xattr %s of %s: %v", k, p, err)
		}
		out = append(out, k+"="+string(v[:m]))
	}
	slices.Sort(out)
	return strings.Join(out, " ")
}

// diff lists how other differs from tr; rootTimes compares the root's times too (a merged
// layer's root is the one Flatten made, not any layer's).
func (tr *tree) diff(other *tree, rootTimes bool) []string {
	var out []string
	for _, p := range slices.Sorted(func(yield func(string) bool) {
		for p := range tr.entries {
			if !yield(p) {
				return
			}
		}
		for p := range other.entries {
			if _, ok := tr.entries[p]; !ok && !yield(p) {
				return
			}
		}
	}) {
		a, inA := tr.entries[p]
		b, inB := other.entries[p]
		switch {
		case !inA:
			out = append(out, fmt.Sprintf("%s: not wanted, got %+v", p, b))
		case !inB:
			out = append(out, fmt.Sprintf("%s: missing, want %+v", p, a))
		default:
			if p == "." && !rootTimes {
				a.mtime, b.mtime = unix.Timespec{}, unix.Timespec{}
			}
			if a != b {
				out = append(out, fmt.Sprintf("%s:\n\twant %+v\n\tgot  %+v", p, a, b))
			}
		}
		if len(out) >= 10 {
			return append(out, "…")
		}
	}
	return out
}
