package sandbox

import (
	"bytes"
	"cmp"
	"context"
	"fmt"
	"path"
	"slices"
	"strings"
	"unicode/utf8"

	"golang.org/x/sys/unix"

	"github.com/deltagym/deltagym/sandbox/textdiff"
)

// Diffs of checkpoints compare their indexes, descending only where two directories' hashes
// differ; file contents are read only for DiffLines and DiffUnified, from the checkpoints'
// sealed layers (the topmost layer holding the path, below whiteouts), read-only, by
// descriptors that follow no symlink.
//
// What one diff costs is bounded as a whole, not only per file, since the sandbox chooses the
// files: the paths listed (count and bytes), the file content read, the line diffs' search
// work and the unified text returned each have a budget per request. Files whose pair of
// contents (by their content hashes) was diffed already reuse that result, so a thousand
// names of one pair cost one diff. Past a budget, the files left get no line counts or
// unified diff (Diff.DetailsTruncated).

const (
	// diffTextBytes is the largest file whose lines are counted.
	diffTextBytes = 64 << 10
	// defaultDiffPaths and maxDiffPaths bound DiffOptions.MaxPaths.
	defaultDiffPaths = 10_000
	maxDiffPaths     = 100_000
	// diffPathBytes bounds the bytes of the paths a diff lists (Diff.Truncated past it).
	diffPathBytes = 16 << 20
	// diffReadBytes bounds the file content a diff reads; each file read counts a page more,
	// for finding it in the layers.
	diffReadBytes = 64 << 20
	diffReadCost  = 4 << 10
	// diffWork bounds the line diffs' search work, all files together (textdiff.Budget): ten
	// files' worth of the bound of one.
	diffWork = 40_000_000
	// diffUnifiedBytes bounds the unified diffs' text, all files together.
	diffUnifiedBytes = 16 << 20
)

// DiffCheckpoints compares checkpoint id against base (both held by the runtime, of the same
// image): ErrNotFound for an unknown one, ErrInvalid for checkpoints of different images or a
// bad path.
func (r *Runtime) DiffCheckpoints(ctx context.Context, base, id string, opt DiffOptions) (Diff, error) {
	comps, err := diffPath(opt.Path)
	if err != nil {
		return Diff{}, err
	}
	if opt.Detail < DiffPaths || opt.Detail > DiffUnified {
		return Diff{}, fmt.Errorf("%w: diff detail %d", ErrInvalid, opt.Detail)
	}
	if opt.MaxPaths < 0 {
		return Diff{}, fmt.Errorf("%w: max paths %d is negative", ErrInvalid, opt.MaxPaths)
	}
	limit := cmp.Or(opt.MaxPaths, defaultDiffPaths)
	limit = min(limit, maxDiffPaths)
	cb, err := r.lookup(base)
	if err != nil {
		return Diff{}, err
	}
	ct, err := r.lookup(id)
	if err != nil {
		return Diff{}, err
	}
	if cb.Image != ct.Image {
		return Diff{}, fmt.Errorf("%w: checkpoints %s and %s are of different images (%s, %s)", ErrInvalid, base, id, cb.Image, ct.Image)
	}
	ta, pa, da, err := r.indexOf(ctx, base)
	if err != nil {
		return Diff{}, err
	}
	tb, pb, db, err := r.indexOf(ctx, id)
	if err != nil {
		return Diff{}, err
	}
	dw := treeDiff{limit: limit, sums: map[string][2][32]byte{}}
	prefix := "/" + strings.Join(comps, "/")
	dw.diff(prefix, lookupNode(ta, comps), lookupNode(tb, comps))
	slices.SortFunc(dw.out, func(a, b PathChange) int { return strings.Compare(a.Path, b.Path) })
	out := Diff{Paths: dw.out, Truncated: dw.truncated, Base: da, Target: db, Processes: diffProcs(pa, pb)}
	if len(out.Paths) > limit {
		out.Paths, out.Truncated = out.Paths[:limit], true
	}
	if opt.Detail >= DiffLines {
		if out.DetailsTruncated, err = r.diffContents(ctx, cb, ct, out.Paths, dw.sums, opt.Detail); err != nil {
			return Diff{}, err
		}
	}
	return out, nil
}

// diffPath checks a diff's path (absolute, clean, without ..) and returns its components.
func diffPath(p string) ([]string, error) {
	if p == "" || p == "/" {
		return nil, nil
	}
	if !strings.HasPrefix(p, "/") || path.Clean(p) != p || strings.Contains(p, "\x00") {
		return nil, fmt.Errorf("%w: diff path %q: must be absolute and clean (no trailing /, //, . or ..)", ErrInvalid, p)
	}
	comps := strings.Split(p[1:], "/")
	if slices.Contains(comps, "..") {
		return nil, fmt.Errorf("%w: diff path %q: must not hold a .. component", ErrInvalid, p)
	}
	return comps, nil
}

// treeDiff collects the path changes between two indexes.
type treeDiff struct {
	limit     int
	out       []PathChange
	truncated bool
	pathBytes int
	// sums are the content hashes of the regular files among the changes, by path: base's
	// and target's (zero for a side that is not a regular file).
	sums map[string][2][32]byte
}

// full reports whether the diff has more changes than it returns (one past the limit is
// collected, to know that it was passed), or paths of more bytes than diffPathBytes.
func (t *treeDiff) full() bool {
	if len(t.out) > t.limit {
		t.truncated = true
	}
	return t.truncated
}

// add adds change ch between entries a and b (either nil), unless its path would take the
// paths past diffPathBytes.
func (t *treeDiff) add(ch PathChange, a, b *dnode) {
	if t.pathBytes += len(ch.Path); t.pathBytes > diffPathBytes {
		t.truncated = true
		return
	}
	t.out = append(t.out, ch)
	if ch.OldType == TypeFile || ch.NewType == TypeFile {
		var sum [2][32]byte
		if ch.OldType == TypeFile {
			sum[0] = a.data
		}
		if ch.NewType == TypeFile {
			sum[1] = b.data
		}
		t.sums[ch.Path] = sum
	}
}

func side(n *dnode) (FileType, int64, uint32) {
	if n == nil {
		return 0, 0, 0
	}
	size := n.size
	if n.isDir() {
		size = 0
	}
	return n.ftype(), size, n.mode & 0o7777
}

// diff compares entries a (base) and b at p, either nil for absent.
func (t *treeDiff) diff(p string, a, b *dnode) {
	if t.full() || a == b || a != nil && b != nil && a.hash == b.hash {
		return
	}
	ch := PathChange{Path: p}
	ch.OldType, ch.OldSize, ch.OldMode = side(a)
	ch.NewType, ch.NewSize, ch.NewMode = side(b)
	switch {
	case a == nil:
		ch.Kind = ChangeAdded
		t.add(ch, a, b)
		t.all(p, b, ChangeAdded)
		return
	case b == nil:
		ch.Kind = ChangeRemoved
		t.add(ch, a, b)
		t.all(p, a, ChangeRemoved)
		return
	}
	ch.Kind = ChangeModified
	if !a.isDir() || !b.isDir() {
		ch.MetadataOnly = a.mode&unix.S_IFMT == b.mode&unix.S_IFMT && a.data == b.data && a.size == b.size
		t.add(ch, a, b)
		if a.isDir() {
			t.all(p, a, ChangeRemoved)
		}
		if b.isDir() {
			t.all(p, b, ChangeAdded)
		}
		return
	}
	if a.attr != b.attr {
		ch.MetadataOnly = true
		t.add(ch, a, b)
	}
	names := diffNames(a.kids, b.kids, nil)
	slices.Sort(names)
	for _, n := range names {
		t.diff(join(p, n), a.kids.get(n), b.kids.get(n))
	}
}

// all lists everything below directory n at p as kind.
func (t *treeDiff) all(p string, n *dnode, kind ChangeKind) {
	if !n.isDir() {
		return
	}
	for _, name := range n.kids.names() {
		if t.full() {
			return
		}
		k := n.kids.get(name)
		ch := PathChange{Path: join(p, name), Kind: kind}
		if kind == ChangeAdded {
			ch.NewType, ch.NewSize, ch.NewMode = side(k)
			t.add(ch, nil, k)
		} else {
			ch.OldType, ch.OldSize, ch.OldMode = side(k)
			t.add(ch, k, nil)
		}
		t.all(ch.Path, k, kind)
	}
}

func join(dir, name string) string {
	if dir == "/" {
		return "/" + name
	}
	return dir + "/" + name
}

// diffProcs compares two checkpoints' processes by pid.
func diffProcs(a, b []procSum) []ProcessChange {
	byPid := func(ps []procSum) map[int]procSum {
		m := make(map[int]procSum, len(ps))
		for _, p := range ps {
			m[p.pid] = p
		}
		return m
	}
	ma, mb := byPid(a), byPid(b)
	var out []ProcessChange
	for pid, p := range ma {
		if _, ok := mb[pid]; !ok {
			out = append(out, ProcessChange{Kind: ChangeRemoved, Pid: pid, Command: p.command})
		}
	}
	for pid, q := range mb {
		p, ok := ma[pid]
		if !ok {
			out = append(out, ProcessChange{Kind: ChangeAdded, Pid: pid, Command: q.command})
			continue
		}
		var det []string
		if p.command != q.command {
			det = append(det, fmt.Sprintf("command %s -> %s", p.command, q.command))
		}
		if p.cwd != q.cwd {
			det = append(det, fmt.Sprintf("cwd %s -> %s", p.cwd, q.cwd))
		}
		if p.file != q.file {
			det = append(det, "open files")
		}
		if p.mem != q.mem {
			det = append(det, "memory")
		}
		if len(det) > 0 {
			out = append(out, ProcessChange{Kind: ChangeModified, Pid: pid, Command: q.command, Details: det})
		}
	}
	slices.SortFunc(out, func(x, y ProcessChange) int { return cmp.Or(x.Pid-y.Pid, int(x.Kind)-int(y.Kind)) })
	return out
}

// fileDetail is what a diff says of a pair of text contents (or of a binary one).
type fileDetail struct {
	binary         bool
	added, removed int
	hunks          string // DiffUnified
}

// diffBudget is what is left of one diff's budgets for file details.
type diffBudget struct {
	read, unified int
	work          textdiff.Budget
}

// diffContents fills in line counts (and unified diffs) of the regular files among changes,
// whose content hashes are sums, reading them from the layers of base and target, held
// meanwhile. It reports whether a budget ran out, leaving files without details.
func (r *Runtime) diffContents(ctx context.Context, base, target *checkpoint, changes []PathChange, sums map[string][2][32]byte, detail DiffDetail) (truncated bool, err error) {
	ra, err := r.openFiles(base)
	if err != nil {
		return false, err
	}
	defer ra.close()
	rb, err := r.openFiles(target)
	if err != nil {
		return false, err
	}
	defer rb.close()
	bu := diffBudget{read: diffReadBytes, unified: diffUnifiedBytes, work: textdiff.Budget{Work: diffWork}}
	memo := map[[2][32]byte]*fileDetail{}
	for i := range changes {
		ch := &changes[i]
		if ch.OldType != TypeFile && ch.NewType != TypeFile || ch.MetadataOnly {
			continue
		}
		if err := ctx.Err(); err != nil {
			return false, err
		}
		if ch.OldSize > diffTextBytes || ch.NewSize > diffTextBytes {
			ch.Binary = true
			continue
		}
		sum := sums[ch.Path]
		det := memo[sum]
		if det == nil {
			if bu.read <= 0 || bu.work.Spent() {
				truncated = true
				continue
			}
			if det, err = fileDiff(ra, rb, ch, detail, &bu); err != nil {
				return false, err
			}
			memo[sum] = det
		}
		ch.Binary, ch.LinesAdded, ch.LinesRemoved = det.binary, det.added, det.removed
		if det.hunks == "" {
			continue
		}
		oldName, newName := "a"+ch.Path, "b"+ch.Path
		if ch.OldType != TypeFile {
			oldName = "/dev/null"
		}
		if ch.NewType != TypeFile {
			newName = "/dev/null"
		}
		u := textdiff.Header(oldName, newName) + det.hunks
		if len(u) > bu.unified {
			// Past the budget: no unified diff from here on.
			bu.unified, truncated = 0, true
			continue
		}
		bu.unified -= len(u)
		ch.Unified = u
	}
	return truncated, nil
}

// fileDiff reads change ch's two sides and diffs them within budget bu.
func fileDiff(ra, rb *ckFiles, ch *PathChange, detail DiffDetail, bu *diffBudget) (*fileDetail, error) {
	var a, b []byte
	var err error
	if ch.OldType == TypeFile {
		if a, err = ra.read(ch.Path); err != nil {
			return nil, err
		}
	}
	if ch.NewType == TypeFile {
		if b, err = rb.read(ch.Path); err != nil {
			return nil, err
		}
	}
	bu.read -= len(a) + len(b) + diffReadCost
	if !isText(a) || !isText(b) {
		return &fileDetail{binary: true}, nil
	}
	det := &fileDetail{}
	if detail < DiffUnified {
		det.added, det.removed = bu.work.Stat(string(a), string(b))
	} else {
		det.hunks, det.added, det.removed = bu.work.Hunks(string(a), string(b), 3)
	}
	return det, nil
}

// isText reports whether b is text: valid UTF-8 without a NUL byte (and within the size read).
func isText(b []byte) bool {
	return len(b) <= diffTextBytes && bytes.IndexByte(b, 0) < 0 && utf8.Valid(b)
}

// ckFiles reads files of one checkpoint from its layers, each a descriptor of its root, bottom
// first: the image's lowers, then its stack; shm is its /dev/shm layer's (-1: none).
type ckFiles struct {
	roots []int
	shm   int
	sn    ckSnapshot
	r     *Runtime
}

func (r *Runtime) openFiles(c *checkpoint) (*ckFiles, error) {
	r.mu.Lock()
	var sn ckSnapshot
	var err error
	if r.ckpts[c.ID] == c {
		sn, err = r.snapshotLocked(c)
	} else {
		err = fmt.Errorf("%w: checkpoint %q: unknown or released checkpoint", ErrNotFound, c.ID)
	}
	r.mu.Unlock()
	if err != nil {
		return nil, err
	}
	f := &ckFiles{shm: -1, sn: sn, r: r}
	stack := sn.layers
	if len(sn.flat) > 0 {
		stack = sn.flat
	}
	var paths []string
	paths = append(paths, r.imageLowers(c.Image)...)
	for _, l := range stack {
		paths = append(paths, r.layers.Path(l))
	}
	for _, p := range paths {
		fd, err := unix.Open(p, unix.O_PATH|unix.O_DIRECTORY|unix.O_NOFOLLOW|unix.O_CLOEXEC, 0)
		if err != nil {
			f.close()
			return nil, fmt.Errorf("opening a layer of checkpoint %s: %w", c.ID, err)
		}
		f.roots = append(f.roots, fd)
	}
	if sn.shm != "" {
		fd, err := unix.Open(r.layers.Path(sn.shm), unix.O_PATH|unix.O_DIRECTORY|unix.O_NOFOLLOW|unix.O_CLOEXEC, 0)
		if err != nil {
			f.close()
			return nil, fmt.Errorf("opening the /dev/shm layer of checkpoint %s: %w", c.ID, err)
		}
		f.shm = fd
	}
	return f, nil
}

func (f *ckFiles) close() {
	for _, fd := range f.roots {
		unix.Close(fd)
	}
	if f.shm >= 0 {
		unix.Close(f.shm)
	}
	f.roots, f.shm = nil, -1
	f.r.unrefSnapshot(f.sn)
}

const layerResolve = unix.RESOLVE_BENEATH | unix.RESOLVE_NO_SYMLINKS | unix.RESOLVE_NO_MAGICLINKS | unix.RESOLVE_NO_XDEV

// read returns up to diffTextBytes+1 bytes of regular file p (absolute in the sandbox) as the
// checkpoint shows it: from its /dev/shm layer below /dev/shm, else from the topmost layer
// holding it, unless a whiteout, a non-directory or an opaque directory on its way hides it.
func (f *ckFiles) read(p string) ([]byte, error) {
	rel := strings.TrimPrefix(p, "/")
	if rest, ok := strings.CutPrefix(rel, "dev/shm/"); ok {
		if f.shm < 0 {
			return nil, nil
		}
		return readBeneath(f.shm, rest)
	}
	comps := strings.Split(rel, "/")
	for i := len(f.roots) - 1; i >= 0; i-- {
		root := f.roots[i]
		hidden := false
		for j := 1; j < len(comps); j++ {
			var st unix.Stat_t
			err := statBeneath(root, strings.Join(comps[:j], "/"), &st)
			if err != nil {
				break // not in this layer: what is below shows through
			}
			if st.Mode&unix.S_IFMT != unix.S_IFDIR {
				return nil, nil // a whiteout or a file hides the path
			}
			if opaqueBeneath(root, strings.Join(comps[:j], "/")) {
				hidden = true
			}
		}
		var st unix.Stat_t
		if err := statBeneath(root, rel, &st); err == nil {
			if whiteout(&st) || st.Mode&unix.S_IFMT != unix.S_IFREG {
				return nil, nil
			}
			return readBeneath(root, rel)
		}
		if hidden {
			return nil, nil
		}
	}
	return nil, nil
}

// statBeneath lstats rel below the directory root without following symlinks.
func statBeneath(root int, rel string, st *unix.Stat_t) error {
	fd, err := unix.Openat2(root, rel, &unix.OpenHow{Flags: unix.O_PATH | unix.O_NOFOLLOW | unix.O_CLOEXEC, Resolve: layerResolve})
	if err != nil {
		return err
	}
	defer unix.Close(fd)
	return unix.Fstat(fd, st)
}

// opaqueBeneath reports whether directory rel below root is overlayfs-opaque (isOpaqueDir).
func opaqueBeneath(root int, rel string) bool {
	fd, err := unix.Openat2(root, rel, &unix.OpenHow{Flags: unix.O_RDONLY | unix.O_DIRECTORY | unix.O_NOFOLLOW | unix.O_CLOEXEC, Resolve: layerResolve})
	if err != nil {
		return false
	}
	defer unix.Close(fd)
	var buf [4]byte
	n, err := unix.Fgetxattr(fd, opaqueMark, buf[:])
	return err == nil && n == 1 && buf[0] == 'y'
}

// readBeneath reads up to diffTextBytes+1 bytes of the regular file rel below root: never
// through a symlink, never a FIFO or device (opened non-blocking, checked before reading).
func readBeneath(root int, rel string) ([]byte, error) {
	fd, err := unix.Openat2(root, rel, &unix.OpenHow{Flags: unix.O_RDONLY | unix.O_NOFOLLOW | unix.O_NONBLOCK | unix.O_NOCTTY | unix.O_CLOEXEC, Resolve: layerResolve})
	if err != nil {
		return nil, fmt.Errorf("reading a checkpoint's file: %w", err)
	}
	defer unix.Close(fd)
	var st unix.Stat_t
	if err := unix.Fstat(fd, &st); err != nil {
		return nil, err
	}
	if st.Mode&unix.S_IFMT != unix.S_IFREG {
		return nil, nil
	}
	buf := make([]byte, min(st.Size, diffTextBytes)+1)
	n, err := preadFull(fd, buf, 0)
	if err != nil {
		return nil, fmt.Errorf("reading a checkpoint's file: %w", err)
	}
	return buf[:n], nil
}
