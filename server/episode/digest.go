package episode

import (
	"context"
	"errors"
	"fmt"
	"maps"
	"path"
	"time"

	"github.com/deltagym/deltagym/internal/errdefs"
	"github.com/deltagym/deltagym/sandbox"
	"github.com/deltagym/deltagym/server/ledger"
)

// Diff bounds: DiffRequest.MaxPaths's default and cap.
const (
	DefaultDiffPaths = 10_000
	MaxDiffPaths     = 100_000
)

// taken is a checkpoint that a Checkpoint or a step took, once settled: the one kept (the one
// taken, or with dedupe the one found holding the same state), the sandbox's previous
// checkpoint, and the digest when it was waited for.
type taken struct {
	info   sandbox.CheckpointInfo
	parent string
	digest sandbox.StateDigest
	dup    bool
}

// settle records checkpoint info, just taken of b at p, and with wait waits for its state
// digest; with dedupe it also looks for an existing checkpoint of the same env (and task)
// holding the same state (dedupe). Called in b's turn, so b's state is still info's. An error
// is the digest's or the look's: the checkpoint taken is kept (and recorded) unless it says
// so, and the zero taken is returned with it, for the caller to answer the checkpoint taken.
func (c *Core) settle(ctx context.Context, info sandbox.CheckpointInfo, p Place, wait, dedupe bool) (taken, error) {
	t := taken{info: info, parent: info.Parent}
	if !wait && !dedupe {
		c.recordCheckpoint(ledger.KindUser, info, p)
		return t, nil
	}
	if !dedupe {
		c.recordCheckpoint(ledger.KindUser, info, p)
	}
	octx, done := c.cfg.Observe(ctx, "state_digest")
	d, err := c.rt.StateDigest(octx, info.ID)
	done(err)
	if err != nil {
		if dedupe {
			c.recordCheckpoint(ledger.KindUser, info, p) // kept: nothing was looked for
		}
		return taken{}, fmt.Errorf("waiting for the state digest of checkpoint %s: %w", info.ID, err)
	}
	t.digest = d
	if !dedupe {
		return t, nil
	}
	return c.dedupe(ctx, t, p)
}

// dedupe looks for a checkpoint of p's env and task other than t's holding t's state (its
// digest, computed) and, found, answers it instead of t's, which is released: the sandbox's
// next checkpoint descends from the one found, and the ledger links the sandbox's previous
// checkpoint to it (CheckpointEdge). t's checkpoint is recorded only if kept.
//
// The runtime matches on the image; another env may run the same image (its pool checkpoints
// then hold the same first state), so the match also asks for p's env and task. Releases
// through the core wait while it runs (relMu), so the one found is held when it is answered.
func (c *Core) dedupe(ctx context.Context, t taken, p Place) (taken, error) {
	// The env of a checkpoint that keeps no place in its labels is its image's first env
	// (placeOfInfo); every candidate has t's image, so that env is looked up once, here, as the
	// match runs under the runtime's lock and must not call into the pools.
	imageEnv := ""
	if env, err := c.pools.EnvForImage(t.info.Image); err == nil {
		imageEnv = env.Name()
	}
	// A durable checkpoint is answered only by a durable one: the one found must bring its
	// processes back after a restart as t's would.
	durable := savedAll(t.info)
	match := func(o sandbox.CheckpointInfo) bool {
		op, ok := placeOf(o.Labels)
		if !ok {
			op = Place{Env: imageEnv}
		}
		return op.Env == p.Env && sameTask(op, p) && (!durable || savedAll(o))
	}
	c.relMu.RLock()
	defer c.relMu.RUnlock()
	octx, done := c.cfg.Observe(ctx, "dedupe")
	found, dup, err := c.rt.Dedupe(octx, t.info.ID, match)
	done(err)
	switch {
	case err != nil:
		if _, held := c.placeHeld(t.info.ID); held {
			c.recordCheckpoint(ledger.KindUser, t.info, p)
		}
		return taken{}, fmt.Errorf("looking for a checkpoint holding the state of checkpoint %s: %w", t.info.ID, err)
	case !dup:
		c.recordCheckpoint(ledger.KindUser, t.info, p)
		return t, nil
	}
	if t.parent != "" && t.parent != found.ID && t.parent != found.Parent && c.rec != nil {
		c.ledgerErr(c.rec.CheckpointEdge(ledger.CheckpointEdge{ChildID: found.ID, ParentID: t.parent, CreatedAt: time.Now()}))
	}
	parent := t.parent
	if parent == found.ID {
		// Nothing changed since the sandbox's previous checkpoint, which is the one found: its
		// own parent is the answer's, as no checkpoint is its own parent.
		parent = found.Parent
	}
	return taken{info: found, parent: parent, digest: t.digest, dup: true}, nil
}

// placeHeld is where checkpoint id, held by the runtime, was taken; false if it is not held.
func (c *Core) placeHeld(id string) (Place, bool) {
	info, err := c.rt.Checkpoint(id)
	if err != nil {
		return Place{}, false
	}
	return c.placeOfInfo(info), true
}

// placeOfInfo is where checkpoint info was taken: its labels', else its image's first env.
func (c *Core) placeOfInfo(info sandbox.CheckpointInfo) Place {
	if p, ok := placeOf(info.Labels); ok {
		return p
	}
	if env, err := c.pools.EnvForImage(info.Image); err == nil {
		return Place{Env: env.Name()}
	}
	return Place{}
}

// sameTask says whether a and b are of one task (the same variables, or none).
func sameTask(a, b Place) bool {
	var ta, tb map[string]string
	if a.task != nil {
		ta = *a.task
	}
	if b.task != nil {
		tb = *b.task
	}
	return maps.Equal(ta, tb)
}

// StateDigest is the runtime's hook (sandbox.Config.OnStateDigest) for a checkpoint's digest,
// once computed: the ledger records it.
func (c *Core) StateDigest(id string, d sandbox.StateDigest) {
	if c.rec != nil {
		c.ledgerErr(c.rec.CheckpointDigest(id, ledger.Digest{Files: d.Files, Processes: d.Processes}))
	}
}

// DiffRequest compares checkpoint ID against checkpoint Base, both of one env.
type DiffRequest struct {
	Base   string
	ID     string
	Detail sandbox.DiffDetail
	// Path keeps the changes at this absolute path and below; "": all.
	Path string
	// MaxPaths is the most path changes returned: 0 means DefaultDiffPaths, past MaxDiffPaths
	// it is capped, negative is ErrInvalid.
	MaxPaths int
}

// DiffCheckpoints compares two checkpoints of one env. ID must be held here (another node's is
// ErrWrongNode); Base, if another node's, is fetched from it as a Restore's would be.
func (c *Core) DiffCheckpoints(ctx context.Context, req DiffRequest) (sandbox.Diff, error) {
	switch {
	case req.Base == "":
		return sandbox.Diff{}, fmt.Errorf("base_checkpoint_id is required: %w", ErrInvalid)
	case req.ID == "":
		return sandbox.Diff{}, fmt.Errorf("checkpoint_id is required: %w", ErrInvalid)
	case req.MaxPaths < 0:
		return sandbox.Diff{}, fmt.Errorf("max_paths %d is negative: %w", req.MaxPaths, ErrInvalid)
	case req.Detail < sandbox.DiffPaths || req.Detail > sandbox.DiffUnified:
		return sandbox.Diff{}, fmt.Errorf("detail %d is not one of DIFF_DETAIL_PATHS, DIFF_DETAIL_LINES or DIFF_DETAIL_UNIFIED: %w", req.Detail, ErrInvalid)
	}
	if req.Path != "" && (!path.IsAbs(req.Path) || path.Clean(req.Path) != req.Path) {
		return sandbox.Diff{}, about(fmt.Errorf("path %q is not an absolute, clean path: %w", req.Path, ErrInvalid), "path", req.Path)
	}
	if err := checkID("checkpoint_id", req.ID); err != nil {
		return sandbox.Diff{}, err
	}
	info, err := c.rt.Checkpoint(req.ID)
	if err != nil {
		return sandbox.Diff{}, c.checkpointErr(err, req.ID)
	}
	bp, err := c.CheckpointPlace(ctx, req.Base)
	if err != nil {
		return sandbox.Diff{}, err
	}
	if p := c.placeOfInfo(info); p.Env != bp.Env {
		return sandbox.Diff{}, errdefs.WithDetail(fmt.Errorf("checkpoint %s is of env %s, base checkpoint %s of env %s: a diff compares checkpoints of one env: %w",
			req.ID, p.Env, req.Base, bp.Env, ErrInvalid), "CHECKPOINT_OF_OTHER_ENV", "checkpoint_id", req.ID, "base_checkpoint_id", req.Base)
	}
	opt := sandbox.DiffOptions{Detail: req.Detail, Path: req.Path, MaxPaths: min(req.MaxPaths, MaxDiffPaths)}
	if opt.MaxPaths == 0 {
		opt.MaxPaths = DefaultDiffPaths
	}
	octx, done := c.cfg.Observe(ctx, "diff_checkpoints")
	d, err := c.rt.DiffCheckpoints(octx, req.Base, req.ID, opt)
	done(err)
	if err != nil {
		if errors.Is(err, sandbox.ErrNotFound) {
			// Released meanwhile: say which.
			if _, berr := c.rt.Checkpoint(req.Base); berr != nil {
				return sandbox.Diff{}, c.checkpointErr(berr, req.Base)
			}
			return sandbox.Diff{}, c.checkpointErr(err, req.ID)
		}
		return sandbox.Diff{}, callErr(ctx, err)
	}
	return d, nil
}

// savedAll reports whether every process of checkpoint info has an image (a durable
// checkpoint's, or one with none).
func savedAll(info sandbox.CheckpointInfo) bool {
	for _, pc := range info.Processes {
		if !pc.Saved {
			return false
		}
	}
	return true
}
