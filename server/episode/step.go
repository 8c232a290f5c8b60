package episode

import (
	"context"
	"errors"
	"fmt"
	"time"

	"golang.org/x/sys/unix"

	deltagymv1 "github.com/deltagym/deltagym/clients/go/gen/deltagym/v1"
	"github.com/deltagym/deltagym/envpool"
	"github.com/deltagym/deltagym/internal/errdefs"
	"github.com/deltagym/deltagym/sandbox"
	"github.com/deltagym/deltagym/server/ledger"
)

// Step performs one step in sandbox req.SandboxID.
//
// Time budget (the env's budgets.max_seconds, counted from the episode's start): a step begun
// with the budget already spent does not perform its action; it is answered (and recorded) as a
// truncated step with no observation and info action_skipped. An exec's timeout is the least of
// the env's step timeout, the action's and the time left in the budget, so a command overruns
// the budget by no more than the time it takes to kill it and collect its output; such an exec
// comes back timed out and its step truncated. (A submit's verifier is not bounded by the
// budget: judging the episode is not the agent's time.) The step budget (budgets.max_steps)
// truncates the agent's step that reaches it.
//
// Setup steps (req.Setup) count against neither budget: one runs whatever the time budget has
// left (within the step timeout), its time is taken out of the episode's for max_seconds, and
// it is not counted for max_steps; it is numbered and recorded as any other, across checkpoints
// too (Place.Agent).
//
// Failures: an action that the sandbox's own state refused (agentError) is the agent's: the
// step answers with Observation.Error, is recorded and counted, and the episode goes on. A
// verifier that fails or prints no reward ends the episode failed with class
// verifier (the step still answers, with info verifier_error); an action that fails because the
// sandbox is gone or the server failed (InfraFailure) ends it failed with class infra, and the
// step returns the error.
func (c *Core) Step(ctx context.Context, req StepRequest) (StepResult, error) {
	if err := validate(req.Action); err != nil {
		return StepResult{}, err
	}
	if !req.Checkpoint && (req.CheckpointWaitDigest || req.CheckpointDedupe) {
		return StepResult{}, fmt.Errorf("checkpoint_wait_for_digest or checkpoint_dedupe is set without checkpoint: %w", ErrInvalid)
	}
	if req.RestoreCheckpointID == "" && req.RestoreFreshEntropy {
		return StepResult{}, fmt.Errorf("restore_fresh_entropy is set without restore_checkpoint_id: %w", ErrInvalid)
	}
	if _, submit := req.Action.(Submit); submit && req.Setup {
		return StepResult{}, fmt.Errorf("a submit cannot be a setup step: it ends the agent's episode: %w", ErrInvalid)
	}
	b, err := c.lookup(req.SandboxID)
	if err != nil {
		return StepResult{}, err
	}
	cctx, end, err := c.beginTurn(ctx, b, req.RestoreCheckpointID, req.RestoreFreshEntropy)
	if err != nil {
		return StepResult{}, err
	}
	defer end()
	res, err := c.step(cctx, b, &req)
	if err := c.stored(ctx, err); err != nil {
		if res.CheckpointID != "" && !res.CheckpointDeduplicated { // named by no answer
			c.dropTaken(res.CheckpointID)
		}
		return StepResult{}, err
	}
	return res, nil
}

// beginTurn waits for b's turn (Lease.Begin) and returns the call's context and the function
// that ends the turn. With a checkpoint to restore, the checkpoint is checked before anything
// changes, what runs in the sandbox is aborted, and the sandbox is restored (restoreIn).
func (c *Core) beginTurn(ctx context.Context, b *box, restore string, fresh bool) (context.Context, func(), error) {
	var from Place
	if restore != "" {
		var err error
		if from, err = c.restorable(ctx, b, restore); err != nil {
			return nil, nil, err
		}
		b.lease.Abort()
	}
	cctx, end, err := b.lease.Begin(ctx)
	if err != nil {
		return nil, nil, err
	}
	if restore != "" {
		if err := c.restoreIn(cctx, b, restore, from, fresh); err != nil {
			end()
			return nil, nil, err
		}
	}
	return cctx, end, nil
}

// step performs req's action on b, whose turn the caller holds (ctx is the turn's).
func (c *Core) step(ctx context.Context, b *box, req *StepRequest) (StepResult, error) {
	cur := b.current()
	if err := endedErr(b, cur); err != nil {
		return StepResult{}, err
	}
	if req.Checkpoint {
		// Refused before the action runs: nothing changes, no step is counted.
		if err := c.rt.CheckCheckpointAdmission(); err != nil {
			return StepResult{}, fmt.Errorf("checkpointing after the step: %w", err)
		}
	}
	env := b.lease.Env()
	start := time.Now()
	index := cur.base + cur.own
	res := StepResult{EpisodeID: cur.id, StepIndex: index, Info: map[string]string{}}
	out, cutErr, err := c.attempt(ctx, b, req, start.Sub(cur.started)-cur.setupTime, &res)
	if err != nil {
		return StepResult{}, err
	}
	took := time.Since(start)
	res.Observation, res.Reward, res.Terminated = out.obs, out.reward, out.terminated
	if out.verr != nil {
		res.Info["verifier_error"] = c.cfg.Scrub(out.verr.Error())
	}
	if out.refused != "" {
		res.Info["verifier_refused"] = out.refused
	}
	own, agent, elapsed := b.count(out.reward, req.Setup, took)
	if !req.Setup && !res.Terminated && !res.Truncated {
		truncate(env, agent, elapsed, &res)
	}
	res.StepsLeft = stepsLeft(env, agent)
	if req.Checkpoint && cutErr == nil {
		t, derr, err := c.checkpointAfter(ctx, b, req)
		switch {
		case errors.Is(err, errdefs.ErrResourceExhausted):
			// A cap filled since the check above: the step stands, recorded, without its checkpoint.
			res.Info["checkpoint_refused"] = err.Error()
		case err != nil:
			return StepResult{}, c.stepFailed(ctx, b, fmt.Errorf("checkpointing after the step: %w", err))
		case derr != nil:
			// The checkpoint is taken and kept; its digest is not known yet. The step stands.
			res.Info["checkpoint_digest_error"] = c.cfg.Scrub(derr.Error())
		}
		res.CheckpointID, res.CheckpointDigest, res.CheckpointDeduplicated = t.info.ID, t.digest, t.dup
	}
	if c.rec != nil {
		c.recordStep(cur.id, own-1, req, start, took, &res, out.verr)
	}
	switch {
	case res.Terminated && out.verr != nil:
		c.endEpisode(b, ended{status: ledger.StatusFailed, class: ledger.FailureVerifier, msg: "the verifier failed: " + c.cfg.Scrub(out.verr.Error())})
	case res.Terminated:
		c.endEpisode(b, ended{status: ledger.StatusTerminated})
	case res.Truncated:
		c.endEpisode(b, ended{status: ledger.StatusTruncated, why: budgetWords(env, res.Info["truncated_by"])})
	}
	if cutErr != nil {
		return StepResult{}, cutErr
	}
	return res, nil
}

// endedErr is the error of a step on b, whose episode is cur, once cur has ended; nil while it
// runs.
func endedErr(b *box, cur state) error {
	if !cur.ended {
		return nil
	}
	why := ""
	if cur.why != "" {
		why = " (" + cur.why + ")"
	}
	return about(fmt.Errorf("sandbox %s: episode %s is %s%s; Restore or Reset to go on: %w", b.lease.ID(), cur.id, cur.status, why, ErrEpisodeEnded),
		"sandbox_id", b.lease.ID(), "episode_id", cur.id)
}

// attempt performs req's action on b within what the time budget has left of an episode that
// has run for ran (setup steps' time left out), as perform does; with the budget spent, the
// action is skipped and res truncated. A setup step is bounded by the step timeout alone.
// cutErr is the caller's error when the caller ended the call while the action ran.
func (c *Core) attempt(ctx context.Context, b *box, req *StepRequest, ran time.Duration, res *StepResult) (out outcome, cutErr, err error) {
	left, spent := budgetLeft(b.lease.Env(), ran)
	switch {
	case req.Setup:
		left = 0
	case spent:
		res.Truncated = true
		res.Info["truncated_by"] = "max_seconds"
		res.Info["action_skipped"] = "the episode's time budget was spent before the step began"
		return outcome{}, nil, nil
	}
	return c.perform(ctx, b, req.Action, left)
}

// budgetLeft returns the time left in env's time budget for an episode that has run for ran
// (0: no budget), and whether it is spent.
func budgetLeft(env *envpool.Env, ran time.Duration) (left time.Duration, spent bool) {
	d := env.MaxDuration()
	if d <= 0 {
		return 0, false
	}
	left = d - ran
	return left, left <= 0
}

// perform runs a within the time left and says how it went: its outcome (an error the agent's
// state caused is observed, recorded and counted), the caller's error if the caller ended the
// call while it ran, or the error that fails the call.
func (c *Core) perform(ctx context.Context, b *box, a Action, left time.Duration) (out outcome, cutErr, err error) {
	if out, err = c.act(ctx, b, a, left); err == nil {
		return out, nil, nil
	}
	ae := agentError(a, err, b.lease.Sandbox().Done())
	if ae == nil && callerCut(ctx) {
		// The action ran, cut short, and what it did so far stays: it is a step, recorded and
		// counted, while the caller, gone, gets its error.
		ae = &ActionError{Errno: unix.ECANCELED,
			Message: "the call was ended by its caller (gone, or past its deadline) while the action ran: what the action did so far stays"}
		cutErr = callErr(ctx, err)
	}
	if ae == nil || envpool.Aborted(ctx) {
		return outcome{}, nil, c.stepFailed(ctx, b, err)
	}
	return outcome{obs: Observation{Error: ae}}, cutErr, nil
}

// callerCut says the call's caller ended it (it went away, or its deadline passed), rather than
// a Restore or Close aborting it.
func callerCut(ctx context.Context) bool {
	return ctx.Err() != nil && !envpool.Aborted(ctx)
}

// budgetWords says which of env's budgets truncated an episode.
func budgetWords(env *envpool.Env, by string) string {
	switch by {
	case "max_steps":
		return fmt.Sprintf("its env's step budget, max_steps %d, is spent", env.MaxSteps())
	case "max_seconds":
		return fmt.Sprintf("its env's time budget, max_seconds %v, is spent", env.MaxDuration())
	}
	return ""
}

// truncate truncates an agent's step, its episode's agent-th on its path (setup steps left
// out), after which the episode has run for elapsed (setup steps' time left out), when it
// reaches one of env's budgets.
func truncate(env *envpool.Env, agent int, elapsed time.Duration, res *StepResult) {
	if n := env.MaxSteps(); n > 0 && agent >= n {
		res.Truncated = true
		res.Info["truncated_by"] = "max_steps"
	} else if d := env.MaxDuration(); d > 0 && elapsed >= d {
		res.Truncated = true
		res.Info["truncated_by"] = "max_seconds"
	}
}

// stepsLeft is how many more agent steps env's max_steps allows an episode whose path holds
// agent of them; -1 when env has no step budget.
func stepsLeft(env *envpool.Env, agent int) int {
	n := env.MaxSteps()
	if n <= 0 {
		return -1
	}
	return max(n-agent, 0)
}

// count counts a step of b's episode, a setup step or the agent's, that took took with its
// reward, and returns the episode's own steps, the agent's steps on its path, and how long it
// has run less its setup steps' time.
func (b *box) count(reward float64, setup bool, took time.Duration) (own, agent int, elapsed time.Duration) {
	b.mu.Lock()
	defer b.mu.Unlock()
	b.ep.own++
	if setup {
		b.ep.setupTime += took
	} else {
		b.ep.agentOwn++
	}
	b.ep.total += reward
	return b.ep.own, b.ep.agentBase + b.ep.agentOwn, time.Since(b.ep.started) - b.ep.setupTime
}

// checkpointAfter checkpoints b after a step, in the env's process mode, as req asks. derr is
// the error of the digest it waited for, or of the look for an equal checkpoint: the
// checkpoint taken is then answered without them.
func (c *Core) checkpointAfter(ctx context.Context, b *box, req *StepRequest) (t taken, derr, err error) {
	mode, err := processMode(b.lease.Env(), sandbox.ProcessesDefault)
	if err != nil {
		return taken{}, nil, err
	}
	p := b.place()
	octx, done := c.cfg.Observe(ctx, "checkpoint")
	info, err := b.lease.Sandbox().CheckpointWith(octx, sandbox.CheckpointOptions{Processes: mode, Labels: p.labels()})
	done(err)
	if err != nil {
		return taken{}, nil, err
	}
	t, derr = c.settle(ctx, info, p, req.CheckpointWaitDigest, req.CheckpointDedupe)
	if derr != nil {
		if _, held := c.placeHeld(info.ID); held {
			t = taken{info: info, parent: info.Parent}
		}
	}
	return t, derr, nil
}

// stepFailed handles err, the failure of a step's action on b (ctx is the turn's): an
// infrastructure failure (InfraFailure) ends the episode failed with class infra. It returns
// the error for the client.
func (c *Core) stepFailed(ctx context.Context, b *box, err error) error {
	err = callErr(ctx, err)
	gone, infra := c.infraFailure(ctx, b.lease.Sandbox(), err)
	if !infra {
		return err
	}
	ep := b.current().id
	c.log.Warn("episode failed: infrastructure error in a step", "sandbox", b.lease.ID(), "episode", ep, "err", err)
	msg := "infrastructure error in a step: " + c.cfg.Scrub(err.Error())
	if gone {
		msg = "its sandbox went away during a step (its init died)"
	}
	c.endEpisode(b, ended{status: ledger.StatusFailed, class: ledger.FailureInfra, msg: msg})
	if gone {
		return about(fmt.Errorf("sandbox %s went away during the step (its init died); episode %s failed (infra); Reset for a new sandbox: %w",
			b.lease.ID(), ep, sandbox.ErrClosed), "sandbox_id", b.lease.ID(), "episode_id", ep)
	}
	return err
}

// processMode picks how a checkpoint captures processes: the asked mode, else the env's, else
// the runtime's default (sandbox.ProcessesDefault).
func processMode(env *envpool.Env, asked sandbox.ProcessMode) (sandbox.ProcessMode, error) {
	if asked != sandbox.ProcessesDefault {
		return asked, nil
	}
	m, ok := ProcessModeOf(env.ProcessMode())
	if !ok {
		return sandbox.ProcessesDefault, fmt.Errorf("env %s: process_mode %d is not one of PROCESS_MODE_FILESYSTEM, PROCESS_MODE_TEMPLATE or PROCESS_MODE_CRIU: %w",
			env.Name(), env.ProcessMode(), ErrInvalid)
	}
	return m, nil
}

// ProcessModeOf is the runtime's mode for the API's (UNSPECIFIED: the default); false for a
// value the API does not define.
func ProcessModeOf(m deltagymv1.ProcessMode) (sandbox.ProcessMode, bool) {
	switch m {
	case deltagymv1.ProcessMode_PROCESS_MODE_UNSPECIFIED:
		return sandbox.ProcessesDefault, true
	case deltagymv1.ProcessMode_PROCESS_MODE_FILESYSTEM:
		return sandbox.ProcessesNone, true
	case deltagymv1.ProcessMode_PROCESS_MODE_TEMPLATE:
		return sandbox.ProcessesTemplate, true
	case deltagymv1.ProcessMode_PROCESS_MODE_CRIU:
		return sandbox.ProcessesCRIU, true
	}
	return sandbox.ProcessesDefault, false
}
