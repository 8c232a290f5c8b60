package sandbox

import (
	"context"
	"errors"
	"fmt"
	"io"
	"math"
	"os"
	"slices"
	"time"

	"github.com/deltagym/deltagym/internal/errdefs"
	"github.com/deltagym/deltagym/sandbox/layers"
	"github.com/deltagym/deltagym/sandbox/procstate"
)

// A checkpoint moves between nodes of a cluster as a manifest (CheckpointManifest: its image,
// its layers by digest, its labels, its processes' images by digest) and the layers the
// receiving node lacks, each in the layer transfer format (layers.Store.Export), verified
// against its digest as it is imported (layers.Store.Import), with its processes' CRIU images
// (transfer_images.go). The receiving node holds the checkpoint under the same ID, as it
// holds its own: restores and forks of it there use its copy, the layers count against its
// checkpoint caps, and it is released by its checkpoint TTL (or a release) like any other.

// transferState is what moving checkpoints between nodes keeps.
type transferState struct {
	// adopting serialises the adoptions of one checkpoint of another node, and the imports
	// of one of its layers, by key.
	adopting keyedLocks
	// ahead are the layers to hash in the background (Config.DigestAhead); nil without.
	ahead chan string
}

// digestQueue bounds the layers waiting to be hashed ahead.
const digestQueue = 256

// digestAhead queues the layers c added (its top delta, its /dev/shm layer) to be hashed in
// the background, unless the queue is full.
func (r *Runtime) digestAhead(c *checkpoint) {
	if r.xfer.ahead == nil || len(c.Layers) == 0 {
		return
	}
	for _, l := range []string{c.Layers[len(c.Layers)-1], c.Shm} {
		if l == "" {
			continue
		}
		select {
		case r.xfer.ahead <- l:
		default:
		}
	}
}

// digestLoop hashes the queued layers, one at a time, until the runtime closes. A layer
// discarded meanwhile is skipped (Digest fails).
func (r *Runtime) digestLoop() {
	defer r.wg.Done()
	for {
		select {
		case <-r.done:
			return
		case l := <-r.xfer.ahead:
			_, _ = r.layers.Digest(l)
		}
	}
}

// LayerRef names a sealed layer by its content: the digest of its transfer stream and the
// bytes it holds.
type LayerRef struct {
	Digest string
	Bytes  int64
}

// CheckpointManifest is what a node needs to hold a checkpoint made on another: everything
// but the layers' contents.
type CheckpointManifest struct {
	ID     string
	Parent string
	// Image is the name of the checkpoint's image and ImageDigest its digest: the receiving
	// node must hold the same image under that name.
	Image, ImageDigest string
	// Layers are the checkpoint's delta layers, bottom first: the shortest equivalent stack
	// (a flattened checkpoint's merged layers).
	Layers []LayerRef
	// Shm is the layer of the sandbox's /dev/shm, nil when it was empty.
	Shm     *LayerRef
	Labels  map[string]string
	Created time.Time
	// Processes counts the live processes the checkpoint captured.
	Processes int
	// Units are the CRIU images of those processes (transfer_images.go), each Dir the name of
	// its directory below the checkpoint's images directory, ImagesDigest the digest of their
	// stream (ExportImages) and ImagesBytes its files' bytes; none when the processes could
	// not be saved, ProcessesWhy saying why.
	Units        []procstate.Unit
	ImagesDigest string
	ImagesBytes  int64
	ProcessesWhy string
}

// ErrProcessesStay means a checkpoint's processes cannot be moved to another node: their CRIU
// images could not be had (CheckpointManifest.ProcessesWhy says why).
var ErrProcessesStay = fmt.Errorf("a checkpoint's processes stay on their node: %w", errdefs.ErrFailedPrecondition)

// CheckpointManifest describes checkpoint id for another node. The first call hashes each of
// its layers (layers.Store.Digest: a read of the layer, kept with it afterwards). A checkpoint
// with processes gets their CRIU images, made from its templates now if need be (the sandbox
// that holds them must be alive, or they must have been saved), and hashed.
func (r *Runtime) CheckpointManifest(ctx context.Context, id string) (CheckpointManifest, error) {
	r.mu.Lock()
	c := r.ckpts[id]
	if c == nil {
		r.mu.Unlock()
		return CheckpointManifest{}, fmt.Errorf("%w: checkpoint %q: unknown or released checkpoint", ErrNotFound, id)
	}
	stack := slices.Clone(c.Layers)
	if len(c.Flat) > 0 {
		stack = slices.Clone(c.Flat)
	}
	m := CheckpointManifest{ID: c.ID, Parent: c.Parent, Image: c.Image, Labels: cloneLabels(c.Labels), Created: c.Created,
		Processes: len(c.Procs)}
	for _, u := range c.Images {
		m.Processes += len(u.Procs)
	}
	shm := c.Shm
	if im := r.images[c.Image]; im != nil {
		m.ImageDigest = im.info.Digest
	}
	// The layers stay while the references are held: a release meanwhile leaves them be.
	held := slices.Clone(stack)
	if shm != "" {
		held = append(held, shm)
	}
	for _, l := range held {
		_ = r.layers.Ref(l)
	}
	r.mu.Unlock()
	defer unrefAll(r, held)
	ref := func(l string) (LayerRef, error) {
		d, err := r.layers.Digest(l)
		if err != nil {
			return LayerRef{}, fmt.Errorf("hashing a layer of checkpoint %s: %w", id, err)
		}
		n, _ := r.layers.SealedSize(l)
		return LayerRef{Digest: d, Bytes: n}, nil
	}
	for _, l := range stack {
		lr, err := ref(l)
		if err != nil {
			return CheckpointManifest{}, err
		}
		m.Layers = append(m.Layers, lr)
	}
	if shm != "" {
		lr, err := ref(shm)
		if err != nil {
			return CheckpointManifest{}, err
		}
		m.Shm = &lr
	}
	if m.Processes > 0 {
		r.describeImages(ctx, c, &m)
	}
	return m, nil
}

// describeImages fills in m's process images, those of c, or why there are none.
func (r *Runtime) describeImages(ctx context.Context, c *checkpoint, m *CheckpointManifest) {
	units, err := r.portableUnits(ctx, c)
	if err == nil {
		m.ImagesDigest, err = writeImages(io.Discard, r.criuDir(c.ID), units)
	}
	if err != nil {
		m.ProcessesWhy = err.Error()
		return
	}
	m.Units = units
	for _, u := range units {
		m.ImagesBytes += u.Bytes
	}
}

// ExportLayer writes the sealed layer of digest to w in the transfer format. Only layers whose
// digest the runtime knows are found: those of the checkpoints CheckpointManifest described,
// and those imported.
func (r *Runtime) ExportLayer(w io.Writer, digest string) error {
	id, err := r.layers.LayerByDigest(digest)
	if err != nil {
		return fmt.Errorf("%w: layer %s: not held by this node", ErrNotFound, digest)
	}
	defer r.layers.Unref(id)
	got, err := r.layers.Export(w, id)
	if err != nil {
		return err
	}
	if got != digest {
		return fmt.Errorf("layer %s exported as %s", digest, got)
	}
	return nil
}

// LayerFetcher opens the transfer stream of a layer from the node that holds it.
type LayerFetcher func(ctx context.Context, l LayerRef) (io.ReadCloser, error)

// adoptLimits are the size and inode limits of the filesystem of an imported layer that holds
// n bytes on its node: as much as a sandbox's writable layer gets by default, or n and some
// slack when more (a tmpfs counts its directories' and small files' blocks a little
// differently on each node); a layer of whiteouts holds no bytes but an inode each. The
// digest, checked at the end, bounds what a stream may write anyway.
func (r *Runtime) adoptLimits(n int64) (size, inodes int64) {
	size = max(n+n/8+4<<20, r.cfg.DefaultDiskBytes)
	inodes = max(r.cfg.DefaultInodes, size/inodeBytes, minInodes)
	return size, inodes
}

// AdoptCheckpoint makes the runtime hold checkpoint m, made on another node: the layers it
// lacks are fetched and imported (each verified against its digest), the ones it has (an
// earlier adoption, a layer of its own) are shared; its processes' CRIU images, when it has
// processes, are fetched with fetchImages and checked against their digest, and serve every
// restore and fork of it here. It fails with ErrProcessesStay for a checkpoint whose processes
// have no images (the manifest says why) and ErrMismatch when the runtime lacks its image or
// holds another of that name; on any error nothing is left. Adopting a checkpoint the runtime
// holds already is a no-op.
func (r *Runtime) AdoptCheckpoint(ctx context.Context, m CheckpointManifest, fetch LayerFetcher, fetchImages ImagesFetcher) (CheckpointInfo, error) {
	if info, err := r.Checkpoint(m.ID); err == nil {
		return info, nil
	}
	unlock, err := r.xfer.adopting.lock(ctx, "checkpoint "+m.ID)
	if err != nil {
		return CheckpointInfo{}, err
	}
	defer unlock()
	if info, err := r.Checkpoint(m.ID); err == nil {
		return info, nil // adopted while this call waited
	}
	if err := r.adoptable(m, fetchImages != nil); err != nil {
		return CheckpointInfo{}, err
	}
	c := &checkpoint{Image: m.Image, Created: m.Created, Labels: cloneLabels(m.Labels)}
	c.ID = m.ID
	ok := false
	defer func() {
		if !ok {
			c.unrefFiles(r)
		}
	}()
	if err := r.adoptLayers(ctx, c, m, fetch); err != nil {
		return CheckpointInfo{}, err
	}
	if len(m.Units) > 0 {
		units, err := r.adoptImages(ctx, m, fetchImages)
		if err != nil {
			return CheckpointInfo{}, err
		}
		c.Images = units
	}
	if err := r.addCheckpoint(c); err != nil {
		if len(c.Images) > 0 {
			_ = os.RemoveAll(r.criuDir(c.ID))
		}
		return CheckpointInfo{}, err
	}
	ok = true
	r.mu.Lock()
	defer r.mu.Unlock()
	return c.info(), nil
}

// adoptable refuses checkpoint m before anything is fetched: processes without images (or
// without a way to fetch them), an image this runtime lacks or holds with another digest, or
// what the checkpoint caps would refuse.
func (r *Runtime) adoptable(m CheckpointManifest, canFetchImages bool) error {
	if m.Processes > 0 && (len(m.Units) == 0 || !canFetchImages) {
		why := m.ProcessesWhy
		if why == "" {
			why = "their node sent no images of them"
		}
		return fmt.Errorf("checkpoint %s holds %d live processes, whose images cannot be had (%s): %w; restore it on its own node, or checkpoint with process mode filesystem",
			m.ID, m.Processes, why, ErrProcessesStay)
	}
	im, err := r.Image(m.Image)
	if err != nil {
		return fmt.Errorf("checkpoint %s is of image %q, which this node does not hold: %w", m.ID, m.Image, ErrMismatch)
	}
	if m.ImageDigest != "" && im.Digest != m.ImageDigest {
		return fmt.Errorf("checkpoint %s is of image %q %s; this node's image of that name is %s: %w", m.ID, m.Image, m.ImageDigest, im.Digest, ErrMismatch)
	}
	// The sizes are the peer's word: their sum saturates rather than wrap past 2^63 into a
	// need the caps would admit.
	var total int64
	add := func(n int64) { total += min(max(n, 0), math.MaxInt64-total) }
	add(m.ImagesBytes)
	for _, l := range m.Layers {
		add(l.Bytes)
	}
	mounts := len(m.Layers)
	if m.Shm != nil {
		add(m.Shm.Bytes)
		mounts++
	}
	return r.admitCheckpoint(total, mounts)
}

// adoptLayers gives c the layers of m, with a reference to each (c.unrefFiles drops them).
func (r *Runtime) adoptLayers(ctx context.Context, c *checkpoint, m CheckpointManifest, fetch LayerFetcher) error {
	for _, l := range m.Layers {
		id, err := r.adoptLayer(ctx, l, fetch)
		if err != nil {
			return fmt.Errorf("checkpoint %s: %w", m.ID, err)
		}
		c.Layers = append(c.Layers, id)
		n, _ := r.layers.SealedSize(id) // what it holds here, not what the peer said
		c.Size += n
	}
	if m.Shm != nil {
		id, err := r.adoptLayer(ctx, *m.Shm, fetch)
		if err != nil {
			return fmt.Errorf("checkpoint %s: /dev/shm: %w", m.ID, err)
		}
		c.Shm = id
	}
	return nil
}

// adoptLayer returns a layer of digest l with a reference held: the runtime's own when it has
// one, else one imported from fetch's stream. Concurrent adoptions of one digest import it
// once.
func (r *Runtime) adoptLayer(ctx context.Context, l LayerRef, fetch LayerFetcher) (string, error) {
	if id, err := r.layers.LayerByDigest(l.Digest); err == nil {
		return id, nil
	}
	unlock, err := r.xfer.adopting.lock(ctx, "layer "+l.Digest)
	if err != nil {
		return "", err
	}
	defer unlock()
	if id, err := r.layers.LayerByDigest(l.Digest); err == nil {
		return id, nil
	}
	rc, err := fetch(ctx, l)
	if err != nil {
		return "", fmt.Errorf("fetching layer %s: %w", l.Digest, err)
	}
	defer rc.Close()
	size, inodes := r.adoptLimits(l.Bytes)
	id, err := r.layers.Import(rc, l.Digest, size, layers.WithInodes(inodes))
	if err != nil {
		if errors.Is(err, context.Canceled) || errors.Is(err, context.DeadlineExceeded) {
			return "", err
		}
		return "", fmt.Errorf("importing layer %s: %w", l.Digest, err)
	}
	return id, nil
}
