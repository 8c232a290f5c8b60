package episode

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/deltagym/deltagym/envpool"
	"github.com/deltagym/deltagym/sandbox"
	"github.com/deltagym/deltagym/server/ledger"
)

// MaxFork bounds one Fork's N.
const MaxFork = 1024

// Reset hands over a sandbox of req.Env at the start of a task (envpool.Manager.Reset) and
// starts its episode.
func (c *Core) Reset(ctx context.Context, req ResetRequest) (ResetResult, error) {
	if err := checkReset(&req); err != nil {
		return ResetResult{}, err
	}
	if err := c.CheckLeaseTTL(req.LeaseTTL); err != nil {
		return ResetResult{}, err
	}
	return c.resets.do(ctx, "reset", req.IdempotencyKey, resetPrint(&req), func() (ResetResult, error) {
		return c.reset(ctx, req)
	})
}

func (c *Core) reset(ctx context.Context, req ResetRequest) (ResetResult, error) {
	if err := c.drainErr("reset"); err != nil {
		return ResetResult{}, err
	}
	if req.Env == "" {
		return ResetResult{}, fmt.Errorf("reset needs an env: %w", ErrInvalid)
	}
	env, err := c.pools.Env(req.Env)
	if err != nil {
		return ResetResult{}, about(err, "env", req.Env)
	}
	start := time.Now()
	octx, done := c.cfg.Observe(ctx, "reset")
	l, res, err := c.pools.Reset(octx, env, envpool.ResetParams{Seed: req.Seed, Options: req.Options})
	done(err)
	if err != nil {
		return ResetResult{}, about(err, "env", req.Env)
	}
	if err := c.abandoned(ctx, l); err != nil {
		return ResetResult{}, err
	}
	l.SetTTL(req.LeaseTTL)
	// The pools' checkpoints are on no episode's path: the episode's steps count from 0.
	_, ep := c.handOver(l, begin{run: req.Run, group: req.Group, seed: req.Seed, ckpt: res.Checkpoint})
	if err := c.stored(ctx, nil); err != nil {
		return ResetResult{}, err // the sandbox's lease expires unrenewed
	}
	return ResetResult{SandboxID: l.ID(), EpisodeID: ep, CheckpointID: res.Checkpoint, Env: env.Name(), Task: env.Task(),
		Hook: res.Hook, TaskCached: res.Cached, Took: time.Since(start), LeaseExpires: l.Expires()}, nil
}

// Checkpoint checkpoints sandbox req.SandboxID; the checkpoint keeps where it was taken.
func (c *Core) Checkpoint(ctx context.Context, req CheckpointRequest) (CheckpointResult, error) {
	b, err := c.lookup(req.SandboxID)
	if err != nil {
		return CheckpointResult{}, err
	}
	cctx, end, err := b.lease.Begin(ctx)
	if err != nil {
		return CheckpointResult{}, err
	}
	defer end()
	mode, err := processMode(b.lease.Env(), req.Processes)
	if err != nil {
		return CheckpointResult{}, err
	}
	p := b.place()
	octx, done := c.cfg.Observe(cctx, "checkpoint")
	info, err := b.lease.Sandbox().CheckpointWith(octx, sandbox.CheckpointOptions{Processes: mode, Durable: req.Durable, Labels: p.labels()})
	done(err)
	if err != nil {
		return CheckpointResult{}, callErr(cctx, err)
	}
	t, err := c.settle(cctx, info, p, req.WaitDigest, req.Dedupe)
	if err != nil {
		c.dropTaken(info.ID)
		return CheckpointResult{}, callErr(cctx, err)
	}
	if err := c.stored(ctx, nil); err != nil {
		if !t.dup { // else the one answered is another call's, and this one's is released
			c.dropTaken(t.info.ID)
		}
		return CheckpointResult{}, err
	}
	return CheckpointResult{Info: t.info, Parent: t.parent, Durable: savedAll(t.info), Digest: t.digest, Deduplicated: t.dup}, nil
}

// Restore puts sandbox req.SandboxID, the same sandbox, at checkpoint req.CheckpointID (of its
// env), aborting what runs in it; its episode ends as branched and the next one starts there,
// its steps numbered on from the checkpoint's.
func (c *Core) Restore(ctx context.Context, req RestoreRequest) (RestoreResult, error) {
	if req.CheckpointID == "" {
		return RestoreResult{}, fmt.Errorf("checkpoint_id is required: %w", ErrInvalid)
	}
	b, err := c.lookup(req.SandboxID)
	if err != nil {
		return RestoreResult{}, err
	}
	_, end, err := c.beginTurn(ctx, b, req.CheckpointID, req.FreshEntropy)
	if err != nil {
		return RestoreResult{}, err
	}
	defer end()
	if err := c.stored(ctx, nil); err != nil {
		return RestoreResult{}, err
	}
	cur := b.current()
	return RestoreResult{EpisodeID: cur.id, NextStepIndex: cur.base}, nil
}

// restoreIn restores b's sandbox to checkpoint id, taken at from (checked by restorable), and
// starts the episode that begins there, ending the current one as branched. Called in b's turn.
func (c *Core) restoreIn(ctx context.Context, b *box, id string, from Place, fresh bool) error {
	octx, done := c.cfg.Observe(ctx, "restore")
	err := b.lease.Sandbox().RestoreWith(octx, id, sandbox.RestoreOptions{FreshEntropy: fresh})
	done(err)
	if err != nil {
		return err
	}
	c.endEpisode(b, ended{status: ledger.StatusBranched})
	cur := b.current()
	c.startEpisode(b, begin{run: cur.run, group: cur.group, seed: cur.seed, ckpt: id, from: from})
	return nil
}

// Fork makes req.N sandboxes at a checkpoint, or at a sandbox's current state (checkpointed
// first, its processes too; one that cannot be captured leaves the children its files only),
// and starts an episode in each that continues the checkpoint's path.
func (c *Core) Fork(ctx context.Context, req ForkRequest) (ForkResult, error) {
	if err := checkFork(&req); err != nil {
		return ForkResult{}, err
	}
	if err := c.CheckLeaseTTL(req.LeaseTTL); err != nil {
		return ForkResult{}, err
	}
	return c.forks.do(ctx, "fork", req.IdempotencyKey, forkPrint(&req), func() (ForkResult, error) {
		return c.fork(ctx, req)
	})
}

func (c *Core) fork(ctx context.Context, req ForkRequest) (_ ForkResult, err error) {
	if err := c.drainErr("fork"); err != nil {
		return ForkResult{}, err
	}
	if req.N < 1 || req.N > MaxFork {
		return ForkResult{}, fmt.Errorf("fork n %d is not between 1 and %d: %w", req.N, MaxFork, ErrInvalid)
	}
	// Refused by the runtime's caps before the checkpoint of a sandbox is taken to fork from
	// (the runtime checks again as it makes the children, all n or none).
	if err := c.rt.CheckAdmission(req.N); err != nil {
		return ForkResult{}, err
	}
	ckpt, from, skipWhy, err := c.forkSource(ctx, &req)
	if err != nil {
		return ForkResult{}, err
	}
	if req.SandboxID != "" {
		defer func() {
			if err != nil { // the checkpoint taken to fork from, which only the answer names
				c.dropTaken(ckpt)
			}
		}()
	}
	env, err := c.pools.Env(from.Env)
	if err != nil {
		return ForkResult{}, about(err, "env", from.Env)
	}
	octx, done := c.cfg.Observe(ctx, "fork")
	// Processes kept as templates reach the children through CRIU images made from the
	// templates (once per checkpoint). If that cannot be done (the templates' sandbox is gone,
	// a process CRIU refuses), the children start from the files and the result says why.
	leases, err := c.pools.Fork(octx, env, ckpt, req.N, envpool.ForkOptions{FreshEntropy: req.FreshEntropy})
	if errors.Is(err, sandbox.ErrProcesses) {
		skipTpl := err.Error()
		leases, err = c.pools.Fork(octx, env, ckpt, req.N, envpool.ForkOptions{FreshEntropy: req.FreshEntropy, SkipTemplates: true})
		skipWhy = cmp.Or(skipWhy, skipTpl)
	}
	done(err)
	if err != nil {
		return ForkResult{}, err
	}
	if err := c.abandoned(ctx, leases...); err != nil {
		return ForkResult{}, err
	}
	res := ForkResult{CheckpointID: ckpt, Processes: c.forkProcesses(ckpt, skipWhy)}
	s := begin{run: cmp.Or(req.Run, from.Run), group: cmp.Or(req.Group, from.Group), ckpt: ckpt, from: from}
	for _, l := range leases {
		l.SetTTL(req.LeaseTTL)
		_, ep := c.handOver(l, s)
		res.Children = append(res.Children, Child{SandboxID: l.ID(), EpisodeID: ep})
	}
	if err := c.stored(ctx, nil); err != nil {
		return ForkResult{}, err // the children's leases expire unrenewed
	}
	return res, nil
}

// forkSource returns the checkpoint a fork starts from and where it was taken; for a sandbox,
// the checkpoint it takes of it, and why the children run none of its processes ("" if they
// do).
func (c *Core) forkSource(ctx context.Context, req *ForkRequest) (ckpt string, from Place, skipWhy string, err error) {
	switch {
	case (req.CheckpointID == "") == (req.SandboxID == ""):
		return "", Place{}, "", fmt.Errorf("fork needs a checkpoint_id or a sandbox_id: %w", ErrInvalid)
	case req.CheckpointID != "":
		from, err = c.CheckpointPlace(ctx, req.CheckpointID)
		return req.CheckpointID, from, "", err
	}
	b, err := c.lookup(req.SandboxID)
	if err != nil {
		return "", Place{}, "", err
	}
	cctx, end, err := b.lease.Begin(ctx)
	if err != nil {
		return "", Place{}, "", err
	}
	from = b.place()
	box := b.lease.Sandbox()
	info, err := box.CheckpointWith(cctx, sandbox.CheckpointOptions{Labels: from.labels()})
	if errors.Is(err, sandbox.ErrProcesses) {
		skipWhy = err.Error()
		info, err = box.CheckpointWith(cctx, sandbox.CheckpointOptions{Processes: sandbox.ProcessesNone, Labels: from.labels()})
	}
	end()
	if err != nil {
		return "", Place{}, "", callErr(cctx, err)
	}
	c.recordCheckpoint(ledger.KindUser, info, from)
	return info.ID, from, skipWhy, nil
}

// forkProcesses says what became of checkpoint ckpt's processes in its forks.
func (c *Core) forkProcesses(ckpt, skipWhy string) []ProcessNote {
	info, err := c.rt.Checkpoint(ckpt)
	if err != nil {
		return nil
	}
	var out []ProcessNote
	for _, p := range info.Processes {
		n := ProcessNote{Pid: p.Pid, Command: p.Command, Method: CaptureCRIU, Reason: "restored in every child from the checkpoint's CRIU image"}
		if p.Method != sandbox.CaptureCRIU {
			n.Reason = "restored in every child from a CRIU image of its template"
			if p.ImagePid > 0 && skipWhy == "" {
				// The image is a copy's: the children have the process at that copy's pid.
				n.Pid = p.ImagePid
				n.Reason += fmt.Sprintf(", as pid %d (pid %d at the checkpoint)", p.ImagePid, p.Pid)
			}
			if skipWhy != "" {
				n.Method, n.Reason = CaptureNone, "the children run without it: "+skipWhy
			}
		}
		out = append(out, n)
	}
	if skipWhy != "" && len(info.Processes) == 0 {
		out = append(out, ProcessNote{Method: CaptureNone, Reason: "the children start from the sandbox's files only: " + skipWhy})
	}
	return out
}

// Evaluate runs the env's verifier on sandbox id's current state without changing it
// (envpool.Manager.Evaluate) and records the reward on the episode's current step.
func (c *Core) Evaluate(ctx context.Context, id string) (Verdict, error) {
	b, err := c.lookup(id)
	if err != nil {
		return Verdict{}, err
	}
	cctx, end, err := b.lease.Begin(ctx)
	if err != nil {
		return Verdict{}, err
	}
	defer end()
	p := b.place()
	octx, done := c.cfg.Observe(cctx, "evaluate")
	v, err := c.pools.Evaluate(octx, b.lease)
	done(err)
	if v.Checkpoint.ID != "" {
		// Recorded, then released: the verifier's fork is gone, no caller learns its ID, and
		// kept it would wait for the TTL once the sandbox moved on, one per Evaluate.
		c.labelCheckpoint(ledger.KindEvaluate, v.Checkpoint, p)
		if err := c.ReleaseCheckpoint(v.Checkpoint.ID); err != nil {
			c.log.Warn("releasing an evaluate checkpoint", "checkpoint", v.Checkpoint.ID, "err", err)
		}
	}
	if err != nil {
		return Verdict{}, callErr(cctx, err)
	}
	if c.rec != nil {
		own := p.Own
		c.ledgerErr(c.rec.Reward(ledger.RewardRow{EpisodeID: p.Episode, StepIndex: &own, Source: "evaluate", Components: v.Components, Value: v.Reward}))
	}
	if err := c.stored(ctx, nil); err != nil {
		return Verdict{}, err
	}
	return Verdict{Reward: v.Reward, Components: v.Components, Output: v.Output, Took: v.Duration}, nil
}

// abandoned closes leases the pools just handed over when the caller has gone (its context is
// done: a client that gave up waiting will never learn their ids, so they would only wait for
// their lease to expire), and returns the context's error; nil while the caller waits.
func (c *Core) abandoned(ctx context.Context, leases ...*envpool.Lease) error {
	if ctx.Err() == nil {
		return nil
	}
	for _, l := range leases {
		if err := c.pools.CloseLease(context.WithoutCancel(ctx), l); err != nil {
			c.log.Warn("closing a sandbox its caller gave up on", "sandbox", l.ID(), "err", err)
		}
	}
	return fmt.Errorf("the caller went away before its sandboxes were handed over; they are closed: %w", ctx.Err())
}
