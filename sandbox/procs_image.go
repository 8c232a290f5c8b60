package sandbox

import (
	"context"
	"errors"
	"fmt"
	"sync"

	"github.com/deltagym/deltagym/sandbox/criu"
	"github.com/deltagym/deltagym/sandbox/procstate"
)

// CRIU images made from templates (see docs/ARCHITECTURE.md).
//
// A template can only be copied in its own sandbox's pid namespace. For
// everything else — a fork into new sandboxes, a restore in another
// sandbox, a restore after the template was lost, a checkpoint that must
// outlive its sandbox or the server — the runtime turns each template into
// a CRIU image, once per checkpoint, and keeps it with the checkpoint
// (store/criu/<checkpoint>/t<n>):
//
//  1. a copy is forked from the template, as for a restore, and fixed up
//     in the sandbox's live root (cwd, reopened files, a session's fresh
//     pipes); it is detached with SIGSTOP pending, so it stops before it
//     runs any code of its own, in a group of its own beside the command
//     group (a checkpoint taken meanwhile does not see it);
//  2. criu dumps the stopped copy — the files it maps from the root the
//     process was first started in are external (procstate.ExtFile) — and kills it.
//
// The image records a stopped task: criu restores it stopped and the
// restore sends SIGCONT. The copy has a pid of its own, which the image
// keeps. Files the copy reopened are checked by criu against the restored
// root's (size and mode): one changed in the live state since the
// checkpoint, still open, fails the making of the image.
//
// When: on demand, the first time a checkpoint's processes are needed away
// from their templates (Create from it, Restore in another sandbox); in the
// background right after a checkpoint taken with CheckpointOptions.Durable;
// and when the sandbox holding the templates is destroyed (closed, reaped,
// or at a clean shutdown of the runtime), so that its checkpoints keep
// their processes; and by the next server after a crash (readopt.go). A
// template lost before any of these (an agent's kill -9 -1, the sandbox's
// init killed) takes its process with it, unless the checkpoint was taken
// durable.

// tplImages returns the images made from c's templates, if any.
func (r *Runtime) tplImages(c *checkpoint) []procstate.Unit {
	r.mu.Lock()
	defer r.mu.Unlock()
	return c.TplImages
}

// imagesForTemplates returns CRIU images of c's templates, making them if
// need be; the sandbox holding the templates must be alive then.
func (r *Runtime) imagesForTemplates(ctx context.Context, c *checkpoint) ([]procstate.Unit, error) {
	if len(c.Procs) == 0 {
		return nil, nil
	}
	if imgs := r.tplImages(c); len(imgs) > 0 {
		return imgs, nil
	}
	unlock, err := r.pimg.tplLocks.lock(ctx, c.ID)
	if err != nil {
		return nil, fmt.Errorf("waiting for the images of checkpoint %s being made: %w", c.ID, err)
	}
	defer unlock()
	if imgs := r.tplImages(c); len(imgs) > 0 {
		return imgs, nil
	}
	if c.imageErr != nil {
		return nil, c.imageErr
	}
	r.mu.Lock()
	owner := r.sandboxes[c.SandboxID]
	r.mu.Unlock()
	if owner == nil {
		return nil, fmt.Errorf("%w: checkpoint %s holds live processes (%s) as frozen copies in sandbox %s, which ended without saving them (its init was killed, a template was found thawed after a crash, or CRIU was missing then); its files can still be restored or forked, without those processes; take checkpoints durable to keep processes whatever happens to the sandbox",
			ErrProcesses, c.ID, procstate.Names(c.Procs), c.SandboxID)
	}
	imgs, err := owner.procs.Image(ctx, &c.Checkpoint, func(u []procstate.Unit) error { return r.recordTplImages(c, u) })
	if errors.Is(err, criu.ErrRequest) {
		c.imageErr = err
	}
	return imgs, err
}

// recordTplImages records units as the images of c's templates, unless c
// was released meanwhile.
func (r *Runtime) recordTplImages(c *checkpoint, units []procstate.Unit) error {
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.ckpts[c.ID] != c {
		return fmt.Errorf("%w: checkpoint %s was released", ErrNotFound, c.ID)
	}
	c.TplImages = units
	if err := r.writeCheckpoint(c); err != nil {
		c.TplImages = nil
		return err
	}
	for _, u := range units {
		r.pimg.bytes.Add(u.Bytes)
	}
	return nil
}

// startImaging counts a background save of images (procImages.making) unless
// the runtime is closing (its sandboxes save their templates as they end).
// Under mu, so that no Add races Close's Wait.
func (r *Runtime) startImaging() bool {
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.closed {
		return false
	}
	r.pimg.making.Add(1)
	return true
}

// ckptLive reports whether c is still a checkpoint of the runtime.
func (r *Runtime) ckptLive(c *checkpoint) bool {
	r.mu.Lock()
	defer r.mu.Unlock()
	return r.ckpts[c.ID] == c
}

// imageAllTemplates saves the templates of every checkpoint the sandbox
// holds as CRIU images, before it is destroyed (closed, reaped, or ended by
// a clean shutdown), so that those checkpoints keep their processes; once
// ctx is done it saves no more (the checkpoints left keep their files).
// Called with op held.
func (s *Sandbox) imageAllTemplates(ctx context.Context) {
	for _, id := range s.procs.IDs() {
		c, err := s.rt.lookup(id)
		if err != nil {
			continue // released meanwhile: nothing to save
		}
		if ctx.Err() != nil {
			s.rt.log.Warn("a checkpoint's processes are not saved before its sandbox ends: out of time", "sandbox", s.id, "checkpoint", id)
			continue
		}
		if _, err := s.rt.imagesForTemplates(ctx, c); err != nil && s.rt.ckptLive(c) {
			s.rt.log.Warn("saving a checkpoint's processes before its sandbox ends", "sandbox", s.id, "checkpoint", id, "err", err)
		}
	}
}

// keyedLocks holds one lock for each key in use: images are made once per
// checkpoint, and those of other checkpoints meanwhile (each sandbox's
// one at a time, under its process state's lock).
type keyedLocks struct {
	mu sync.Mutex
	// held maps a key locked to a channel closed when it is unlocked.
	// +checklocks:mu
	held map[string]chan struct{}
}

// lock takes key's lock, waiting while another holds it, until ctx is
// done; unlock releases it.
func (k *keyedLocks) lock(ctx context.Context, key string) (unlock func(), err error) {
	for {
		k.mu.Lock()
		busy, ok := k.held[key]
		if !ok {
			if k.held == nil {
				k.held = map[string]chan struct{}{}
			}
			mine := make(chan struct{})
			k.held[key] = mine
			k.mu.Unlock()
			return func() {
				k.mu.Lock()
				delete(k.held, key)
				k.mu.Unlock()
				close(mine)
			}, nil
		}
		k.mu.Unlock()
		select {
		case <-busy:
		case <-ctx.Done():
			return nil, context.Cause(ctx)
		}
	}
}
