package sandbox

import (
	"bufio"
	"context"
	"crypto/sha256"
	"encoding/binary"
	"encoding/hex"
	"errors"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"runtime"
	"slices"
	"sync"

	"golang.org/x/sys/unix"

	"github.com/deltagym/deltagym/sandbox/layers"
)

// State digests are computed off the checkpoint's path: addCheckpoint queues the checkpoint,
// and digestWorkers (at most two goroutines, the runtime's) compute each one's files index
// from the index of the longest prefix of its stack already known (its parent's, usually)
// plus its own new layers, then its processes' digest, within a procBudget. A worker takes the
// oldest queued checkpoint of the sandbox with the fewest digests being computed, so one
// sandbox's checkpoints queued by the dozen, or a job that runs to its deadline, hold back
// another sandbox's by one job at most. The digest is kept in the checkpoint's
// record, so a restarted runtime has it at once; the per-path index is memory only, rebuilt
// when next needed (a diff, a child's digest) from the image's index, cached on disk per
// image, and the checkpoint's layers.

// digestRec is a state digest as a checkpoint's record keeps it.
type digestRec struct {
	Files     string `json:"files"`
	Processes string `json:"processes,omitempty"`
}

// ckDigest is what the runtime knows of one checkpoint's state digest. Its fields but done, d,
// err and stop are guarded by stateDigests.mu (checklocks cannot name another type's lock).
type ckDigest struct {
	// done is closed once d (or err) is set; they do not change after.
	done chan struct{}
	d    StateDigest
	err  error
	// stop is closed when the checkpoint is released: its computation stops.
	stop chan struct{}
	// finished: done is closed. closed: the checkpoint was released (stop is closed).
	finished bool
	closed   bool
	// files is the index of its layers (without /dev/shm), shm of its /dev/shm layer; nil
	// until computed (after a restart: until needed).
	files *dnode
	shm   *dnode
	procs []procSum
	// keys are the stacks (stackKey) whose index is files, registered in stateDigests.stacks.
	keys []string
	// aliases are other stacks of the checkpoint's state (its merged stack, a sandbox's
	// shortened stack restored from it) named before files was known: registered with it.
	aliases []string
}

// stackIndex is the index of one stack of layers, and how many checkpoints register it.
type stackIndex struct {
	root *dnode
	refs int
}

// stateDigests are the runtime's state digests and per-path indexes.
type stateDigests struct {
	mu sync.Mutex
	// +checklocks:mu
	ckpts map[string]*ckDigest
	// stacks are the indexes of held checkpoints' stacks (Layers, Flat), by stackKey.
	// +checklocks:mu
	stacks map[string]*stackIndex
	// images are the indexes of images, by imageKey.
	// +checklocks:mu
	images map[string]*dnode
	// queue holds the checkpoints whose digests are to compute, oldest first; running counts
	// the digests being computed, by sandbox.
	// +checklocks:mu
	queue []digestJob
	// +checklocks:mu
	running map[string]int
	kick    chan struct{}
}

// digestJob is a checkpoint whose digest is to compute, and its sandbox's id.
type digestJob struct{ id, sandbox string }

func newStateDigests() *stateDigests {
	return &stateDigests{ckpts: map[string]*ckDigest{}, stacks: map[string]*stackIndex{}, images: map[string]*dnode{},
		running: map[string]int{}, kick: make(chan struct{}, 1)}
}

// add registers checkpoint id of sandbox sandbox; with rec (a record's digest) it is known
// already, else it is queued.
func (sd *stateDigests) add(id, sandbox string, rec *digestRec) {
	ck := &ckDigest{done: make(chan struct{}), stop: make(chan struct{})}
	sd.mu.Lock()
	defer sd.mu.Unlock()
	if old := sd.ckpts[id]; old != nil {
		sd.dropLocked(id, old)
	}
	sd.ckpts[id] = ck
	if rec != nil {
		ck.d = StateDigest{Files: rec.Files, Processes: rec.Processes}
		ck.finishLocked()
		return
	}
	sd.queue = append(sd.queue, digestJob{id: id, sandbox: sandbox})
	select {
	case sd.kick <- struct{}{}:
	default:
	}
}

// drop forgets checkpoint id: a computation in progress stops, waiters get ErrNotFound, and
// its indexes are freed unless another checkpoint shares them.
func (sd *stateDigests) drop(id string) {
	sd.mu.Lock()
	defer sd.mu.Unlock()
	if ck := sd.ckpts[id]; ck != nil {
		sd.dropLocked(id, ck)
	}
}

// +checklocks:sd.mu
func (sd *stateDigests) dropLocked(id string, ck *ckDigest) {
	delete(sd.ckpts, id)
	if ck.closed {
		return
	}
	ck.closed = true
	close(ck.stop)
	if !ck.finished {
		ck.err = fmt.Errorf("%w: checkpoint %q: released", ErrNotFound, id)
		ck.finishLocked()
	}
	for _, k := range ck.keys {
		sd.unregisterLocked(k)
	}
	ck.keys, ck.aliases, ck.files, ck.shm, ck.procs = nil, nil, nil, nil, nil
}

// finishLocked closes done, once. Called with stateDigests.mu held.
func (ck *ckDigest) finishLocked() {
	if !ck.finished {
		ck.finished = true
		close(ck.done)
	}
}

// +checklocks:sd.mu
func (sd *stateDigests) registerLocked(ck *ckDigest, key string, root *dnode) {
	if key == "" || slices.Contains(ck.keys, key) {
		return
	}
	ck.keys = append(ck.keys, key)
	if si := sd.stacks[key]; si != nil {
		si.refs++
		return
	}
	sd.stacks[key] = &stackIndex{root: root, refs: 1}
}

// +checklocks:sd.mu
func (sd *stateDigests) unregisterLocked(key string) {
	if si := sd.stacks[key]; si != nil {
		if si.refs--; si.refs <= 0 {
			delete(sd.stacks, key)
		}
	}
}

// alias registers stack key (another stack of its state: its flattened stack, or one a
// sandbox restored from it sits on) as checkpoint id's: now if its index is known, else when
// it becomes known. A child's digest built on that stack then finds its prefix, whichever
// of the flattening and the digest finished first.
func (sd *stateDigests) alias(id, key string) {
	sd.mu.Lock()
	defer sd.mu.Unlock()
	ck := sd.ckpts[id]
	switch {
	case ck == nil || ck.closed:
	case ck.files != nil:
		sd.registerLocked(ck, key, ck.files)
	case !slices.Contains(ck.aliases, key):
		ck.aliases = append(ck.aliases, key)
	}
}

// setIndexLocked records ck's index, computed from snapshot sn, and registers it under sn's
// stacks and the aliases named meanwhile.
// +checklocks:sd.mu
func (sd *stateDigests) setIndexLocked(ck *ckDigest, sn ckSnapshot, files, shm *dnode, procs []procSum) {
	ck.files, ck.shm, ck.procs = files, shm, procs
	sd.registerLocked(ck, stackKey(sn.layers), files)
	if len(sn.flat) > 0 {
		sd.registerLocked(ck, stackKey(sn.flat), files)
	}
	for _, k := range ck.aliases {
		sd.registerLocked(ck, k, files)
	}
	ck.aliases = nil
}

// pop takes the oldest queued job of the sandbox with the fewest jobs running, and counts it
// running until finished; false if none is queued.
func (sd *stateDigests) pop() (digestJob, bool) {
	sd.mu.Lock()
	defer sd.mu.Unlock()
	if len(sd.queue) == 0 {
		sd.queue = nil // let a long queue's array go
		return digestJob{}, false
	}
	best := 0
	for i, j := range sd.queue {
		if sd.running[sd.queue[best].sandbox] == 0 {
			break
		}
		if sd.running[j.sandbox] < sd.running[sd.queue[best].sandbox] {
			best = i
		}
	}
	j := sd.queue[best]
	sd.queue = slices.Delete(sd.queue, best, best+1)
	sd.running[j.sandbox]++
	return j, true
}

// finished counts job j no longer running.
func (sd *stateDigests) finished(j digestJob) {
	sd.mu.Lock()
	defer sd.mu.Unlock()
	if sd.running[j.sandbox]--; sd.running[j.sandbox] <= 0 {
		delete(sd.running, j.sandbox)
	}
}

func (sd *stateDigests) get(id string) *ckDigest {
	sd.mu.Lock()
	defer sd.mu.Unlock()
	return sd.ckpts[id]
}

// digestWorkers is how many checkpoints' digests are computed at once.
func digestWorkers() int { return min(2, runtime.NumCPU()) }

// digestLoopWorker computes queued digests until the runtime closes.
func (r *Runtime) stateDigestLoop() {
	defer r.wg.Done()
	for {
		select {
		case <-r.done:
			return
		case <-r.jobs.digests.kick:
		}
		for {
			select {
			case <-r.done:
				return
			default:
			}
			j, ok := r.jobs.digests.pop()
			if !ok {
				break
			}
			r.computeDigest(j.id)
			r.jobs.digests.finished(j)
		}
	}
}

// ckSnapshot is what a digest's computation reads of a checkpoint, taken under Runtime.mu,
// with a reference held on each layer.
type ckSnapshot struct {
	id, image string
	layers    []string
	flat      []string
	// long are longer stacks of the same state (longFormsLocked), whose prefixes may be
	// indexed when those of layers and flat are not.
	long  [][]string
	shm   string
	procs []procInput
	// memLimit is the sandbox's memory limit (0: none).
	memLimit int64
}

// snapshot takes c's layers (a reference each) and what its processes' digest reads.
// +checklocks:r.mu
func (r *Runtime) snapshotLocked(c *checkpoint) (ckSnapshot, error) {
	sn := ckSnapshot{id: c.ID, image: c.Image, layers: slices.Clone(c.Layers), flat: slices.Clone(c.Flat), shm: c.Shm}
	all := slices.Concat(sn.layers, sn.flat)
	if sn.shm != "" {
		all = append(all, sn.shm)
	}
	if err := refAll(r, all); err != nil {
		return ckSnapshot{}, err
	}
	for _, l := range r.longFormsLocked(sn.layers) {
		// The checkpoints a long form names hold its layers (Runtime.mu is held).
		if refAll(r, l) == nil {
			sn.long = append(sn.long, l)
		}
	}
	s := r.sandboxes[c.SandboxID]
	sn.procs = procInputs(c, s != nil)
	if s != nil {
		sn.memLimit = s.spec.Limits.MemoryBytes
	}
	return sn, nil
}

func (r *Runtime) unrefSnapshot(sn ckSnapshot) {
	unrefAll(r, slices.Concat(sn.layers, sn.flat))
	for _, l := range sn.long {
		unrefAll(r, l)
	}
	if sn.shm != "" {
		r.layers.Unref(sn.shm)
	}
}

// maxLongForms bounds the long forms of a stack (longFormsLocked): a stack sits on as many
// merged layers as flattenings followed one another under it.
const maxLongForms = 4

// longFormsLocked returns stacks of stack's state, each longer than the last: stack with
// its longest prefix that a held flattened checkpoint's merged stack (Flat) is replaced by
// that checkpoint's Layers, then the same of the result. A sandbox's stack shortened by a
// flattening that finished while it went on, or by a restore, is a merged stack under
// layers its checkpoints were indexed without: its long form's prefixes are theirs.
// +checklocks:r.mu
func (r *Runtime) longFormsLocked(stack []string) [][]string {
	var out [][]string
	for range maxLongForms {
		var by *checkpoint
		for _, o := range r.flat {
			if n := len(o.Flat); n <= len(stack) && (by == nil || n > len(by.Flat)) && slices.Equal(o.Flat, stack[:n]) {
				by = o
			}
		}
		if by == nil {
			break
		}
		stack = slices.Concat(by.Layers, stack[len(by.Flat):])
		out = append(out, stack)
	}
	return out
}

// computeDigest computes checkpoint id's state digest and records it.
func (r *Runtime) computeDigest(id string) {
	sd := r.jobs.digests
	ck := sd.get(id)
	if ck == nil {
		return
	}
	r.mu.Lock()
	c := r.ckpts[id]
	var sn ckSnapshot
	var err error
	if c != nil {
		sn, err = r.snapshotLocked(c)
	}
	r.mu.Unlock()
	if c == nil || err != nil {
		return // released meanwhile
	}
	defer r.unrefSnapshot(sn)
	budget := newProcBudget(sn.memLimit)
	canceled := func() error {
		select {
		case <-ck.stop:
			return context.Canceled
		case <-r.done:
			return ErrClosed
		default:
			return nil
		}
	}
	files, shm, err := r.filesIndex(sn, canceled)
	var procs []procSum
	var pd string
	if err == nil {
		procs, pd, err = processDigest(sn.procs, budget, canceled)
		if errors.Is(err, errOverBudget) {
			r.log.Warn("leaving a checkpoint's processes digest unequal to any other", "checkpoint", id, "err", err)
			err = nil
		}
	}
	if err != nil {
		if canceled() == nil {
			r.log.Warn("computing a checkpoint's state digest", "checkpoint", id, "err", err)
			sd.mu.Lock()
			if !ck.finished {
				ck.err = fmt.Errorf("computing the state digest of checkpoint %s: %w", id, err)
				ck.finishLocked()
			}
			sd.mu.Unlock()
		}
		return
	}
	d := StateDigest{Files: layers.DigestOf(hashOf(withShm(files, shm).hash)), Processes: pd}
	r.mu.Lock()
	if r.ckpts[id] == c {
		c.Digest = &digestRec{Files: d.Files, Processes: d.Processes}
		if err := r.writeCheckpoint(c); err != nil {
			r.log.Warn("recording a checkpoint's state digest", "checkpoint", id, "err", err)
		}
	}
	r.mu.Unlock()
	sd.mu.Lock()
	if ck.closed {
		sd.mu.Unlock()
		return
	}
	// A flattening recorded after sn was taken named its stack (alias): registered here.
	ck.d = d
	sd.setIndexLocked(ck, sn, files, shm, procs)
	sd.mu.Unlock()
	// The hook first: whoever waits for the digest finds it recorded there too.
	if r.cfg.OnStateDigest != nil {
		r.cfg.OnStateDigest(id, d)
	}
	sd.mu.Lock()
	ck.finishLocked()
	sd.mu.Unlock()
}

// hashOf is a hash.Hash whose Sum is b, for layers.DigestOf.
type hashOf [32]byte

func (h hashOf) Write(p []byte) (int, error) { return len(p), nil }
func (h hashOf) Sum(b []byte) []byte         { return append(b, h[:]...) }
func (h hashOf) Reset()                      {}
func (h hashOf) Size() int                   { return 32 }
func (h hashOf) BlockSize() int              { return 64 }

// filesIndex returns the index of sn's layers over its image, from the longest prefix of its
// stack (Layers, Flat or a long form) whose index is known, and that of its /dev/shm layer.
func (r *Runtime) filesIndex(sn ckSnapshot, canceled func() error) (files, shm *dnode, err error) {
	w := &layerWalk{buf: make([]byte, chunkSize), canceled: canceled}
	stack, base, from := r.bestPrefix(slices.Concat([][]string{sn.layers, sn.flat}, sn.long)...)
	if base == nil {
		if base, err = r.imageIndex(sn.image, w); err != nil {
			return nil, nil, err
		}
	}
	files, walked := base, w.n
	for _, l := range stack[from:] {
		if files, err = w.applyLayer(files, r.layers.Path(l)); err != nil {
			return nil, nil, err
		}
	}
	if r.hooks.onDigestWalk != nil {
		r.hooks.onDigestWalk(sn.id, len(stack)-from, w.n-walked)
	}
	if sn.shm != "" {
		if shm, err = w.applyLayer(nil, r.layers.Path(sn.shm)); err != nil {
			return nil, nil, err
		}
	}
	return files, shm, nil
}

// bestPrefix returns, of the candidate stacks of one state (Layers, Flat, long forms), the
// one with the fewest layers left to apply over the longest prefix whose index is known: that
// index and the prefix's length. base is nil when no prefix is known: the shortest stack is
// applied whole over the image's index.
func (r *Runtime) bestPrefix(cands ...[]string) (stack []string, base *dnode, from int) {
	sd := r.jobs.digests
	sd.mu.Lock()
	defer sd.mu.Unlock()
	stack = cands[0]
	left := -1
	for _, c := range cands {
		if len(c) == 0 {
			continue
		}
		for n := len(c); n >= 1; n-- {
			if si := sd.stacks[stackKey(c[:n])]; si != nil {
				if left < 0 || len(c)-n < left {
					stack, base, from, left = c, si.root, n, len(c)-n
				}
				break
			}
		}
	}
	if base == nil {
		for _, c := range cands {
			if len(c) > 0 && len(c) < len(stack) {
				stack = c
			}
		}
	}
	return stack, base, from
}

// indexFormat versions the image index cache's files.
const indexFormat = "deltagym-index-2"

// imageIndex returns image's index: the skeleton (if it needs it) and its layers, from memory,
// from its cache file, or computed and cached.
func (r *Runtime) imageIndex(image string, w *layerWalk) (*dnode, error) {
	r.mu.Lock()
	im := r.images[image]
	var lowers []string
	var key string
	if im != nil {
		if im.skel {
			lowers = append(lowers, r.skel)
		}
		lowers = append(lowers, im.layers...)
		sum := sha256.Sum256(fmt.Appendf(nil, "%s\x00%s\x00%v\x00%s", indexFormat, im.info.Digest, im.skel, image))
		key = hex.EncodeToString(sum[:16])
	}
	r.mu.Unlock()
	if im == nil {
		return nil, fmt.Errorf("%w: image %q", ErrNotFound, image)
	}
	sd := r.jobs.digests
	sd.mu.Lock()
	root := sd.images[key]
	sd.mu.Unlock()
	if root != nil {
		return root, nil
	}
	cache := filepath.Join(r.store, "digests", key)
	if root, err := readIndex(cache); err == nil {
		sd.mu.Lock()
		sd.images[key] = root
		sd.mu.Unlock()
		return root, nil
	}
	var err error
	for _, l := range lowers {
		if root, err = w.applyLayer(root, l); err != nil {
			return nil, fmt.Errorf("indexing image %s: %w", image, err)
		}
	}
	if root == nil {
		st := unix.Stat_t{Mode: unix.S_IFDIR | 0o755}
		root = &dnode{attr: attrHash(&st, nil), mode: st.Mode}
		root.seal()
	}
	if err := writeIndex(cache, root); err != nil {
		r.log.Warn("caching an image's index", "image", image, "err", err)
	}
	sd.mu.Lock()
	sd.images[key] = root
	sd.mu.Unlock()
	return root, nil
}

// writeIndex writes the tree at root to file p (a temporary file renamed): each entry depth
// first, its name, mode, size, attribute and content hashes, and a directory's entry count,
// then its entries sorted by name.
func writeIndex(p string, root *dnode) error {
	if err := os.MkdirAll(filepath.Dir(p), 0o700); err != nil {
		return err
	}
	f, err := os.CreateTemp(filepath.Dir(p), ".index-")
	if err != nil {
		return err
	}
	defer os.Remove(f.Name())
	bw := bufio.NewWriterSize(f, 1<<16)
	io.WriteString(bw, indexFormat+"\n")
	var enc func(name string, n *dnode)
	enc = func(name string, n *dnode) {
		var b [20]byte
		binary.LittleEndian.PutUint32(b[0:], uint32(len(name)))
		binary.LittleEndian.PutUint32(b[4:], n.mode)
		binary.LittleEndian.PutUint64(b[8:], uint64(n.size))
		binary.LittleEndian.PutUint32(b[16:], uint32(n.kids.size()))
		bw.Write(b[:])
		io.WriteString(bw, name)
		bw.Write(n.attr[:])
		bw.Write(n.data[:])
		if n.isDir() {
			for _, k := range n.kids.names() {
				enc(k, n.kids.get(k))
			}
		}
	}
	enc("", root)
	bw.Write(root.hash[:])
	if err := errors.Join(bw.Flush(), f.Close()); err != nil {
		return err
	}
	return os.Rename(f.Name(), p)
}

// readIndex reads a tree writeIndex wrote, checking it against the root hash it ends with.
func readIndex(p string) (*dnode, error) {
	f, err := os.Open(p)
	if err != nil {
		return nil, err
	}
	defer f.Close()
	br := bufio.NewReaderSize(f, 1<<16)
	head := make([]byte, len(indexFormat)+1)
	if _, err := io.ReadFull(br, head); err != nil || string(head) != indexFormat+"\n" {
		return nil, errors.New("not an index of this format")
	}
	e := newEdit()
	var dec func(depth int) (string, *dnode, error)
	dec = func(depth int) (string, *dnode, error) {
		if depth > maxDigestDepth {
			return "", nil, errors.New("index nested too deep")
		}
		var b [20]byte
		if _, err := io.ReadFull(br, b[:]); err != nil {
			return "", nil, err
		}
		nl := binary.LittleEndian.Uint32(b[0:])
		if nl > 4096 {
			return "", nil, errors.New("index name too long")
		}
		n := &dnode{mode: binary.LittleEndian.Uint32(b[4:]), size: int64(binary.LittleEndian.Uint64(b[8:]))}
		kids := binary.LittleEndian.Uint32(b[16:])
		name := make([]byte, nl)
		if _, err := io.ReadFull(br, name); err != nil {
			return "", nil, err
		}
		if _, err := io.ReadFull(br, n.attr[:]); err != nil {
			return "", nil, err
		}
		if _, err := io.ReadFull(br, n.data[:]); err != nil {
			return "", nil, err
		}
		if n.isDir() {
			for range kids {
				k, kn, err := dec(depth + 1)
				if err != nil {
					return "", nil, err
				}
				n.kids = n.kids.set(e, k, kn)
			}
		}
		n.seal()
		return string(name), n, nil
	}
	_, root, err := dec(0)
	if err != nil {
		return nil, err
	}
	var want [32]byte
	if _, err := io.ReadFull(br, want[:]); err != nil || want != root.hash {
		return nil, errors.New("index does not match its hash")
	}
	return root, nil
}

// newDirFile wraps directory descriptor fd for Readdirnames; closing it closes fd.
func newDirFile(fd int) *os.File { return os.NewFile(uintptr(fd), "") }

// indexOf returns checkpoint id's files index (with /dev/shm) and process summaries, waiting
// for its digest, and rebuilding the index if it is not in memory (after a restart).
func (r *Runtime) indexOf(ctx context.Context, id string) (*dnode, []procSum, StateDigest, error) {
	d, err := r.StateDigest(ctx, id)
	if err != nil {
		return nil, nil, StateDigest{}, err
	}
	sd := r.jobs.digests
	sd.mu.Lock()
	ck := sd.ckpts[id]
	var files, shm *dnode
	var procs []procSum
	if ck != nil {
		files, shm, procs = ck.files, ck.shm, ck.procs
	}
	sd.mu.Unlock()
	if ck == nil {
		return nil, nil, StateDigest{}, fmt.Errorf("%w: checkpoint %q: unknown or released checkpoint", ErrNotFound, id)
	}
	if files != nil {
		return withShm(files, shm), procs, d, nil
	}
	r.mu.Lock()
	c := r.ckpts[id]
	var sn ckSnapshot
	if c != nil {
		sn, err = r.snapshotLocked(c)
	}
	r.mu.Unlock()
	if c == nil || err != nil {
		return nil, nil, StateDigest{}, fmt.Errorf("%w: checkpoint %q: unknown or released checkpoint", ErrNotFound, id)
	}
	defer r.unrefSnapshot(sn)
	canceled := func() error {
		select {
		case <-ck.stop:
			return fmt.Errorf("%w: checkpoint %q: released", ErrNotFound, id)
		default:
			return ctx.Err()
		}
	}
	files, shm, err = r.filesIndex(sn, canceled)
	if err != nil {
		return nil, nil, StateDigest{}, err
	}
	procs, _, err = processDigest(sn.procs, newProcBudget(sn.memLimit), canceled)
	if err != nil && !errors.Is(err, errOverBudget) {
		return nil, nil, StateDigest{}, err
	}
	sd.mu.Lock()
	if !ck.closed && ck.files == nil {
		sd.setIndexLocked(ck, sn, files, shm, procs)
	}
	sd.mu.Unlock()
	return withShm(files, shm), procs, d, nil
}

// adopt makes checkpoint into hold the stacks checkpoint from registered (from is about to be
// dropped, into holds the same state): their indexes stay known while into is held.
func (sd *stateDigests) adopt(into, from string) {
	sd.mu.Lock()
	defer sd.mu.Unlock()
	ci, cf := sd.ckpts[into], sd.ckpts[from]
	if ci == nil || cf == nil || ci.closed {
		return
	}
	for _, k := range cf.keys {
		if si := sd.stacks[k]; si != nil && !slices.Contains(ci.keys, k) {
			ci.keys = append(ci.keys, k)
			si.refs++
		}
	}
	for _, k := range cf.aliases {
		switch {
		case ci.files != nil:
			sd.registerLocked(ci, k, ci.files)
		case !slices.Contains(ci.aliases, k):
			ci.aliases = append(ci.aliases, k)
		}
	}
}
