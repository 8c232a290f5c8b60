package episode

import (
	"context"
	"errors"
	"fmt"
	"maps"
	"strconv"
	"time"

	"github.com/deltagym/deltagym/envpool"
	"github.com/deltagym/deltagym/sandbox"
	"github.com/deltagym/deltagym/server/ledger"
)

// Place is where a checkpoint was taken: its env and, for one taken in an episode, the episode
// (with its run and group) and how many steps led there.
type Place struct {
	Env     string
	Episode string
	Run     string
	Group   string
	// Own is the episode's own steps when the checkpoint was taken (the ledger's step_index).
	Own int
	// Steps is the steps on its path: the index of the next step after restoring it.
	Steps int
	// Agent is the agent's steps among Steps (the rest set the task up): what an episode
	// that starts there has spent of its env's max_steps.
	Agent int
	// task is the variables of the task its sandbox worked on (envpool.Lease.Task; nil for
	// none): a sandbox restored to it, or forked from it, works on that task. A pointer keeps
	// Place comparable.
	task *map[string]string
}

// withTask returns p with task's variables (none for an empty task).
func (p Place) withTask(task map[string]string) Place {
	if len(task) > 0 {
		p.task = &task
	}
	return p
}

// The labels that keep a Place in a checkpoint's record.
const (
	labelEnv     = "deltagym.env"
	labelEpisode = "deltagym.episode"
	labelRun     = "deltagym.run"
	labelGroup   = "deltagym.group"
	labelOwn     = "deltagym.own_steps"
	labelSteps   = "deltagym.steps"
	labelAgent   = "deltagym.agent_steps"
)

// labels encodes p as checkpoint labels.
func (p Place) labels() map[string]string {
	m := map[string]string{labelEnv: p.Env}
	if p.Episode != "" {
		m[labelEpisode], m[labelOwn], m[labelSteps] = p.Episode, strconv.Itoa(p.Own), strconv.Itoa(p.Steps)
		m[labelAgent] = strconv.Itoa(p.Agent)
	}
	if p.Run != "" {
		m[labelRun] = p.Run
	}
	if p.Group != "" {
		m[labelGroup] = p.Group
	}
	if p.task != nil {
		maps.Copy(m, envpool.TaskLabels(*p.task))
	}
	return m
}

// placeOf decodes the Place that labels keep; false when they keep none.
func placeOf(labels map[string]string) (Place, bool) {
	p := Place{Env: labels[labelEnv], Episode: labels[labelEpisode], Run: labels[labelRun], Group: labels[labelGroup]}
	p = p.withTask(envpool.TaskOf(labels))
	if p.Env == "" {
		return Place{}, false
	}
	// Labels may come from another node's manifest: a negative count would lengthen budgets.
	p.Own, _ = strconv.Atoi(labels[labelOwn])
	p.Steps, _ = strconv.Atoi(labels[labelSteps])
	p.Own, p.Steps = max(p.Own, 0), max(p.Steps, 0)
	p.Agent = p.Steps // labelled before setup steps existed: every step was the agent's
	if a, err := strconv.Atoi(labels[labelAgent]); err == nil && a >= 0 && a <= p.Steps {
		p.Agent = a
	}
	return p, true
}

// CheckpointPlace returns where checkpoint id was taken. A checkpoint the core neither took
// nor labelled (one made through the runtime by a tool in the same process) is on no episode's
// path; its env is the first one on its image.
func (c *Core) CheckpointPlace(ctx context.Context, id string) (Place, error) {
	if err := checkID("checkpoint_id", id); err != nil {
		return Place{}, err
	}
	info, err := c.rt.Checkpoint(id)
	if err != nil && errors.Is(err, sandbox.ErrNotFound) && c.fetchable(id) {
		// Another node's, not held here yet: fetched from it (Config.Fetch), on every Restore
		// and Fork of it, which look it up here first.
		if ferr := c.cfg.Fetch(ctx, id); ferr != nil {
			return Place{}, ferr
		}
		info, err = c.rt.Checkpoint(id)
	}
	if err != nil {
		return Place{}, c.checkpointErr(err, id)
	}
	if p, ok := placeOf(info.Labels); ok {
		return p, nil
	}
	env, err := c.pools.EnvForImage(info.Image)
	if err != nil {
		return Place{}, err
	}
	return Place{Env: env.Name()}, nil
}

// restorable checks that checkpoint id exists and can be restored in b's sandbox, and returns
// where it was taken.
func (c *Core) restorable(ctx context.Context, b *box, id string) (Place, error) {
	p, err := c.CheckpointPlace(ctx, id)
	if err != nil {
		return Place{}, err
	}
	if env := b.lease.Env().Name(); p.Env != env {
		return Place{}, about(fmt.Errorf("checkpoint %s is of env %s, sandbox %s of env %s: %w", id, p.Env, b.lease.ID(), env, ErrOtherEnv),
			"checkpoint_id", id, "sandbox_id", b.lease.ID())
	}
	return p, nil
}

// recordCheckpoint records in the ledger a checkpoint taken at p (whose labels keep p).
func (c *Core) recordCheckpoint(kind ledger.CheckpointKind, info sandbox.CheckpointInfo, p Place) {
	if c.rec == nil {
		return
	}
	c.ledgerErr(c.rec.Checkpoint(ledger.CheckpointRow{ID: info.ID, ParentID: info.Parent, Kind: kind, Env: p.Env,
		Sandbox: info.SandboxID, EpisodeID: p.Episode, StepIndex: p.Own, CreatedAt: info.Created}))
}

// labelCheckpoint labels a checkpoint someone else took (the pools) with p, and records it.
func (c *Core) labelCheckpoint(kind ledger.CheckpointKind, info sandbox.CheckpointInfo, p Place) {
	if err := c.rt.SetCheckpointLabels(info.ID, p.labels()); err != nil {
		c.log.Warn("labelling a checkpoint with where it was taken", "checkpoint", info.ID, "err", err)
	}
	c.recordCheckpoint(kind, info, p)
}

// PoolCheckpoint is the pools' hook (envpool.Config.OnCheckpoint) for the checkpoints they take:
// pool and task ones are labelled with their env and recorded; evaluate ones are left to
// Evaluate, which knows their episode.
func (c *Core) PoolCheckpoint(env string, kind envpool.CheckpointKind, info sandbox.CheckpointInfo) {
	if kind == envpool.KindEvaluate {
		return
	}
	c.labelCheckpoint(ledger.CheckpointKind(kind), info, Place{Env: env})
}

// CheckpointExpired is the runtime's hook (sandbox.Config.OnCheckpointExpired) for a checkpoint
// its TTL released: the ledger records the release as it does ReleaseCheckpoint's.
func (c *Core) CheckpointExpired(id string) {
	if c.rec != nil {
		c.ledgerErr(c.rec.CheckpointReleased(id, time.Now()))
	}
}

// ReleaseCheckpoint releases checkpoint id (with its labels) and records the release.
func (c *Core) ReleaseCheckpoint(id string) error {
	if id == "" {
		return fmt.Errorf("checkpoint_id is required: %w", ErrInvalid)
	}
	c.relMu.Lock()
	err := c.rt.ReleaseCheckpoint(id)
	c.relMu.Unlock()
	if err != nil {
		return c.checkpointErr(err, id)
	}
	if c.rec != nil {
		c.ledgerErr(c.rec.CheckpointReleased(id, time.Now()))
	}
	return nil
}

// dropTaken releases checkpoint id, which a call took and then failed after: the error names
// no checkpoint, so no caller learns its ID, and kept it would be held until its TTL. One no
// longer held (a deduplicating checkpoint's, released already) is left as it is.
func (c *Core) dropTaken(id string) {
	if _, err := c.rt.Checkpoint(id); err != nil {
		return
	}
	if err := c.ReleaseCheckpoint(id); err != nil {
		c.log.Warn("releasing the checkpoint of a call that failed", "checkpoint", id, "err", err)
	}
}

// PlaceFinder looks up where a checkpoint was taken in a record other than the checkpoint's own
// (the ledger); found is false when it has none.
type PlaceFinder func(ctx context.Context, id string) (p Place, found bool, err error)

// LabelFrom labels each checkpoint that keeps no place in its labels (one taken by a server
// that kept places only in its ledger) with the place find knows, and returns how many it
// labelled. A checkpoint find knows nothing of is left as it is: its env is its image's.
func (c *Core) LabelFrom(ctx context.Context, find PlaceFinder) (int, error) {
	n := 0
	for _, id := range c.rt.CheckpointsWithout(labelEnv) {
		p, found, err := find(ctx, id)
		if err != nil {
			return n, fmt.Errorf("looking up the place of checkpoint %s: %w", id, err)
		}
		if !found || p.Env == "" {
			continue
		}
		if err := c.rt.SetCheckpointLabels(id, p.labels()); err != nil && !errors.Is(err, sandbox.ErrNotFound) {
			return n, fmt.Errorf("labelling checkpoint %s: %w", id, err)
		}
		n++
	}
	return n, nil
}

// CheckpointFilter selects checkpoints by where they were taken; an empty field matches any.
type CheckpointFilter struct {
	Env, Run, Group, Episode string
}

// CheckpointDesc is a checkpoint the runtime holds and where it was taken.
type CheckpointDesc struct {
	Info  sandbox.CheckpointInfo
	Place Place
	// Digest is its state digest, zero until computed.
	Digest sandbox.StateDigest
}

// Checkpoints lists the checkpoints the runtime holds that match f, oldest first: the ones
// clients took, and the pools' own (pinned), so that an operator at the checkpoint cap sees what
// holds it.
func (c *Core) Checkpoints(f CheckpointFilter) []CheckpointDesc {
	var out []CheckpointDesc
	for _, info := range c.rt.ListCheckpoints() {
		p, ok := placeOf(info.Labels)
		if !ok {
			if env, err := c.pools.EnvForImage(info.Image); err == nil {
				p = Place{Env: env.Name()}
			}
		}
		if (f.Env != "" && p.Env != f.Env) || (f.Run != "" && p.Run != f.Run) || (f.Group != "" && p.Group != f.Group) ||
			(f.Episode != "" && p.Episode != f.Episode) {
			continue
		}
		d, _ := c.rt.StateDigestReady(info.ID)
		out = append(out, CheckpointDesc{Info: info, Place: p, Digest: d})
	}
	return out
}
