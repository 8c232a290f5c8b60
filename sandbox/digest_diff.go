package sandbox

import (
	"bytes"
	"cmp"
	"context"
	"errors"
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
	// diffLookupCost is what each directory lookup of finding a file in the layers counts
	// against diffReadBytes: a path of hundreds of components in many layers costs its
	// lookups, not only its bytes.
	diffLookupCost = 256
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
	var na, nb int
	if ch.OldType == TypeFile {
		if a, na, err = ra.read(ch.Path); err != nil {
			return nil, err
		}
	}
	if ch.NewType == TypeFile {
		if b, nb, err = rb.read(ch.Path); err != nil {
			return nil, err
		}
	}
	bu.read -= len(a) + len(b) + diffReadCost + (na+nb)*diffLookupCost
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
	// dirs is, for each of roots, the last directory a read walked to: the files of a diff
	// come sorted, so the next file is most often in it.
	dirs []layerDir
	shm  int
	sn   ckSnapshot
	r    *Runtime
}

// layerDir is where walking a directory's path in one layer ended: at the directory (fd), or
// before it (fd -1), settled when the layer then decides that nothing below it shows.
type layerDir struct {
	path    string
	fd      int
	opaque  bool
	settled bool
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
		f.dirs = append(f.dirs, layerDir{path: "\x00", fd: -1})
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
	for _, d := range f.dirs {
		if d.fd >= 0 {
			unix.Close(d.fd)
		}
	}
	f.dirs = nil
	if f.shm >= 0 {
		unix.Close(f.shm)
	}
	f.roots, f.shm = nil, -1
	f.r.unrefSnapshot(f.sn)
}

const layerResolve = unix.RESOLVE_BENEATH | unix.RESOLVE_NO_SYMLINKS | unix.RESOLVE_NO_MAGICLINKS | unix.RESOLVE_NO_XDEV

// read returns up to diffTextBytes+1 bytes of regular file p (absolute in the sandbox) as the
// checkpoint shows it: from its /dev/shm layer below /dev/shm, else from the topmost layer
// holding it, unless a whiteout, a non-directory or an opaque directory on its way hides it;
// and the lookups it made, for the diff's budget. Each layer is walked one component at a time
// from a descriptor of the directory above, so a path of depth d costs d lookups a layer, not
// the d²/2 of resolving each of its prefixes from the layer's root.
func (f *ckFiles) read(p string) (data []byte, lookups int, err error) {
	rel := strings.TrimPrefix(p, "/")
	if rest, ok := strings.CutPrefix(rel, "dev/shm/"); ok {
		if f.shm < 0 {
			return nil, 1, nil
		}
		data, err := readBeneath(f.shm, rest)
		return data, strings.Count(rest, "/") + 1, err
	}
	comps := strings.Split(rel, "/")
	parent := strings.Join(comps[:len(comps)-1], "/")
	for i := len(f.roots) - 1; i >= 0; i-- {
		if f.dirs[i].path != parent {
			n := f.walkDir(i, comps[:len(comps)-1])
			f.dirs[i].path = parent
			lookups += n
		}
		d := f.dirs[i]
		if d.fd < 0 && len(comps) > 1 {
			if d.settled {
				return nil, lookups, nil
			}
			continue
		}
		dir := f.roots[i]
		if len(comps) > 1 {
			dir = d.fd
		}
		lookups++
		data, settled, err := readLast(dir, comps[len(comps)-1], d.opaque)
		if err != nil || settled {
			return data, lookups, err
		}
	}
	return nil, lookups, nil
}

// walkDir walks directory comps in layer i, a component at a time from a descriptor of the
// directory above, and keeps where it ended in f.dirs[i] (its path is the caller's to set);
// it returns its lookups.
func (f *ckFiles) walkDir(i int, comps []string) (n int) {
	d := &f.dirs[i]
	if d.fd >= 0 {
		unix.Close(d.fd)
	}
	*d = layerDir{fd: -1}
	dir := f.roots[i]
	for _, c := range comps {
		n++
		fd, err := unix.Openat2(dir, c, &unix.OpenHow{Flags: unix.O_RDONLY | unix.O_DIRECTORY | unix.O_NOFOLLOW | unix.O_CLOEXEC, Resolve: layerResolve})
		if dir != f.roots[i] {
			unix.Close(dir)
		}
		switch {
		case errors.Is(err, unix.ENOTDIR) || errors.Is(err, unix.ELOOP):
			d.settled = true // a whiteout, a file or a link hides what is below
			return n
		case err != nil:
			d.settled = d.opaque // not in this layer: below shows through, unless opaque
			return n
		}
		dir = fd
		var buf [4]byte
		if m, err := unix.Fgetxattr(fd, opaqueMark, buf[:]); err == nil && m == 1 && buf[0] == 'y' {
			d.opaque = true
		}
	}
	if dir != f.roots[i] {
		d.fd = dir
	}
	return n
}

// readLast reads file name in directory dir of a layer: settled when the layer decides what
// the checkpoint shows there (the file, or nothing: a whiteout or a special file; or, absent
// below an opaque directory, nothing); not settled when what is below shows through.
func readLast(dir int, name string, opaque bool) (data []byte, settled bool, err error) {
	var st unix.Stat_t
	if err := statBeneath(dir, name, &st); err != nil {
		return nil, opaque, nil
	}
	if whiteout(&st) || st.Mode&unix.S_IFMT != unix.S_IFREG {
		return nil, true, nil
	}
	data, err = readBeneath(dir, name)
	return data, true, err
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
