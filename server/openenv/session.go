package openenv

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"sort"
	"sync"

	"github.com/deltagym/deltagym/envpool"
	"github.com/deltagym/deltagym/sandbox"
	"github.com/deltagym/deltagym/server/episode"
)

// A session is one environment instance of the protocol: a WebSocket's, an MCP session's, or
// a stateless request's. It holds at most one sandbox, leased at its first reset (or its first
// step or state, which reset it with no options) and closed with the session. Calls on a
// session run one at a time (mu).
type session struct {
	h   *Handler // never changes
	env string   // never changes
	// life ends when the session is closed: it aborts the call in progress, and the calls
	// waiting for their turn find the session closed.
	life context.Context
	end  context.CancelFunc

	mu sync.Mutex
	// +checklocks:mu
	sandbox string // "" until the first reset, and after the sandbox was lost
	// +checklocks:mu
	resetStart string // the checkpoint the last plain reset started from: a reset like it restores it
	// +checklocks:mu
	resetKey string // what the last plain reset asked (seed and options), "" for none
	// +checklocks:mu
	resetObs Observation // what that reset showed (the task and the reset hook's output)
	// +checklocks:mu
	closed bool
}

func (h *Handler) newSession(env string) *session {
	life, end := context.WithCancel(context.Background())
	return &session{h: h, env: env, life: life, end: end}
}

// bind returns ctx, ended with the session too, and the function that releases it.
func (s *session) bind(ctx context.Context) (context.Context, func()) {
	ctx, cancel := context.WithCancel(ctx)
	stop := context.AfterFunc(s.life, cancel)
	return ctx, func() { stop(); cancel() }
}

// lostLocked is err of a call whose sandbox is gone (its lease expired, the server reaped it):
// the session lets go of it, so that its next call starts a new episode, and says so.
// +checklocks:s.mu
func (s *session) lostLocked(err error) error {
	if errors.Is(err, envpool.ErrLeaseEnded) || errors.Is(err, envpool.ErrUnknownSandbox) {
		s.sandbox, s.resetKey = "", ""
		return fmt.Errorf("%w; the session's next reset or step starts a new episode in a new sandbox", err)
	}
	return err
}

// resetArgs is a reset's data: the seed, the extension's checkpoint_id, group_id and run, and
// every other key as an option of the env's task (a string, number or boolean).
type resetArgs struct {
	seed         *int64
	checkpoint   string
	group, run   string
	freshEntropy bool
	options      map[string]string
}

// resetArgsOf reads a reset's data. episode_id, which OpenEnv's clients may send, names the
// episode on the client's side only: the server's episode IDs are its own.
func resetArgsOf(data map[string]json.RawMessage) (resetArgs, error) {
	var r resetArgs
	str := func(k string, dst *string) error {
		if v, ok := data[k]; ok && string(v) != "null" {
			if err := json.Unmarshal(v, dst); err != nil {
				return invalid("reset's %s is a string, not %.64s", k, v)
			}
		}
		return nil
	}
	for _, k := range [][2]any{{"checkpoint_id", &r.checkpoint}, {"group_id", &r.group}, {"run", &r.run}} {
		if err := str(k[0].(string), k[1].(*string)); err != nil {
			return r, err
		}
	}
	if v, ok := data["seed"]; ok && string(v) != "null" {
		var n int64
		if err := json.Unmarshal(v, &n); err != nil {
			return r, invalid("reset's seed is an integer, not %.64s", v)
		}
		r.seed = &n
	}
	if v, ok := data["fresh_entropy"]; ok && string(v) != "null" {
		if err := json.Unmarshal(v, &r.freshEntropy); err != nil {
			return r, invalid("reset's fresh_entropy is a boolean, not %.64s", v)
		}
	}
	for k, v := range data {
		switch k {
		case "seed", "checkpoint_id", "group_id", "run", "fresh_entropy", "episode_id":
			continue
		}
		s, err := optionValue(v)
		if err != nil {
			return r, invalid("reset option %.64q: %v", k, err)
		}
		if r.options == nil {
			r.options = map[string]string{}
		}
		r.options[k] = s
	}
	if r.freshEntropy && r.checkpoint == "" {
		return r, invalid("reset's fresh_entropy goes with checkpoint_id (a plain reset without a seed gets new entropy)")
	}
	if r.checkpoint != "" && len(r.options) > 0 {
		return r, invalid("a reset from checkpoint_id starts where the checkpoint is, so it takes no task options (got %d)", len(r.options))
	}
	return r, nil
}

// optionValue is an option's value as a string: strings as they are, numbers and booleans as
// JSON writes them.
func optionValue(v json.RawMessage) (string, error) {
	var x any
	if err := json.Unmarshal(v, &x); err != nil {
		return "", err
	}
	switch t := x.(type) {
	case string:
		return t, nil
	case float64, bool:
		return string(v), nil
	}
	return "", fmt.Errorf("a task option is a string, number or boolean, not %.64s", v)
}

// key fingerprints a plain reset's seed and options: a reset that asks the same again is a
// restore of the start.
func (r resetArgs) key() string {
	keys := make([]string, 0, len(r.options))
	for k := range r.options {
		keys = append(keys, k)
	}
	sort.Strings(keys)
	b, _ := json.Marshal(struct {
		Seed *int64
		Run  string
		G    string
		K    []string
		O    map[string]string
	}{r.seed, r.run, r.group, keys, r.options})
	return string(b)
}

// reset starts a new episode: a fork of the checkpoint (checkpoint_id), a restore of the
// start when the seed and options are those of the last reset, else a Reset. A sandbox the
// session held before is closed once the new one is there.
func (s *session) reset(ctx context.Context, data map[string]json.RawMessage) (Result, error) {
	args, err := resetArgsOf(data)
	if err != nil {
		return Result{}, err
	}
	ctx, done := s.bind(ctx)
	defer done()
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.resetLocked(ctx, args)
}

// +checklocks:s.mu
func (s *session) resetLocked(ctx context.Context, args resetArgs) (Result, error) {
	if s.closed {
		return Result{}, errSessionClosed
	}
	if args.checkpoint != "" {
		return s.forkLocked(ctx, args)
	}
	if key := args.key(); s.sandbox != "" && key == s.resetKey && s.resetStart != "" {
		// The seed decides the state: an unseeded reset gets new entropy, as a Reset would.
		r, err := s.h.core.Restore(ctx, episode.RestoreRequest{SandboxID: s.sandbox, CheckpointID: s.resetStart, FreshEntropy: args.seed == nil})
		if err == nil {
			obs := s.resetObs
			return s.resultLocked(obs, r.EpisodeID, s.resetStart, nil), nil
		}
		s.h.log.Debug("restoring the start at a reset; resetting instead", "sandbox", s.sandbox, "err", err)
	}
	r, err := s.h.core.Reset(ctx, episode.ResetRequest{Env: s.env, Seed: args.seed, Options: args.options, Run: args.run, Group: args.group})
	if err != nil {
		return Result{}, err
	}
	s.replaceLocked(r.SandboxID, r.CheckpointID)
	s.resetKey = args.key()
	s.resetObs = Observation{Task: r.Task}
	if r.Hook != nil {
		s.resetObs.setExec(*r.Hook)
	}
	return s.resultLocked(s.resetObs, r.EpisodeID, r.CheckpointID, nil), nil
}

// forkLocked starts the session's episode at a checkpoint of its env: a Fork of one.
// +checklocks:s.mu
func (s *session) forkLocked(ctx context.Context, args resetArgs) (Result, error) {
	p, err := s.h.core.CheckpointPlace(ctx, args.checkpoint)
	if err != nil {
		return Result{}, err
	}
	if p.Env != s.env {
		return Result{}, invalid("checkpoint %s is of env %q, not %q: connect to /openenv/%s to start from it", args.checkpoint, p.Env, s.env, p.Env)
	}
	if args.seed != nil {
		return Result{}, invalid("a reset from checkpoint_id starts where the checkpoint is: it takes no seed (fresh_entropy gives it new entropy)")
	}
	r, err := s.h.core.Fork(ctx, episode.ForkRequest{CheckpointID: args.checkpoint, N: 1, Run: args.run, Group: args.group, FreshEntropy: args.freshEntropy})
	if err != nil {
		return Result{}, err
	}
	c := r.Children[0]
	s.replaceLocked(c.SandboxID, args.checkpoint)
	s.resetKey = "" // a plain reset after it resets the env
	return s.resultLocked(Observation{Task: s.h.task(s.env)}, c.EpisodeID, args.checkpoint, nil), nil
}

// replaceLocked makes id the session's sandbox, closing the one it held.
// +checklocks:s.mu
func (s *session) replaceLocked(id, start string) {
	if old := s.sandbox; old != "" {
		if err := s.h.core.Close(context.WithoutCancel(context.Background()), old); err != nil {
			s.h.log.Warn("closing a session's previous sandbox", "sandbox", old, "err", err)
		}
	}
	s.sandbox, s.resetStart = id, start
}

// ensureLocked resets the session when it has no sandbox yet: a step or state before any
// reset acts on a fresh episode, as OpenEnv's own servers do.
// +checklocks:s.mu
func (s *session) ensureLocked(ctx context.Context) error {
	if s.closed {
		return errSessionClosed
	}
	if s.sandbox != "" {
		return nil
	}
	_, err := s.resetLocked(ctx, resetArgs{})
	return err
}

// step performs an action.
func (s *session) step(ctx context.Context, raw json.RawMessage) (Result, error) {
	a, err := decodeAction(raw)
	if err != nil {
		return Result{}, err
	}
	core := s.h.core
	p, err := planOf(a, s.h.cfg.StepCap)
	if err != nil {
		return Result{}, err
	}
	ctx, done := s.bind(ctx)
	defer done()
	s.mu.Lock()
	defer s.mu.Unlock()
	if err := s.ensureLocked(ctx); err != nil {
		return Result{}, err
	}
	res, err := s.stepLocked(ctx, core, p)
	return res, s.lostLocked(err)
}

// stepLocked performs the plan p.
// +checklocks:s.mu
func (s *session) stepLocked(ctx context.Context, core *episode.Core, p plan) (Result, error) {
	switch {
	case p.act != nil:
		r, err := core.Step(ctx, episode.StepRequest{SandboxID: s.sandbox, Action: p.act, Checkpoint: p.checkpoint,
			RestoreCheckpointID: p.restore, RestoreFreshEntropy: p.freshEntropy})
		if err != nil {
			return Result{}, err
		}
		res := s.stepResultLocked(r)
		res.Observation.RestoredTo = p.restore
		return res, nil
	case p.evaluate:
		v, err := core.Evaluate(ctx, s.sandbox)
		if err != nil {
			return Result{}, err
		}
		return s.evaluationLocked(v)
	case p.restore != "":
		r, err := core.Restore(ctx, episode.RestoreRequest{SandboxID: s.sandbox, CheckpointID: p.restore, FreshEntropy: p.freshEntropy})
		if err != nil {
			return Result{}, err
		}
		return s.resultLocked(Observation{RestoredTo: p.restore}, r.EpisodeID, p.restore, nil), nil
	default:
		r, err := core.Checkpoint(ctx, episode.CheckpointRequest{SandboxID: s.sandbox})
		if err != nil {
			return Result{}, err
		}
		info, err := core.Sandbox(s.sandbox)
		if err != nil {
			return Result{}, err
		}
		return s.resultLocked(Observation{CheckpointID: r.Info.ID}, info.EpisodeID, r.Info.ID, nil), nil
	}
}

// +checklocks:s.mu
func (s *session) evaluationLocked(v episode.Verdict) (Result, error) {
	info, err := s.h.core.Sandbox(s.sandbox)
	if err != nil {
		return Result{}, err
	}
	res := s.resultLocked(Observation{Evaluation: &Verdict{Reward: v.Reward, Components: v.Components, Output: v.Output}}, info.EpisodeID, "", nil)
	res.Reward = v.Reward
	return res, nil
}

// stepResultLocked is a step's answer.
// +checklocks:s.mu
func (s *session) stepResultLocked(r episode.StepResult) Result {
	var obs Observation
	o := r.Observation
	switch {
	case o.Exec != nil:
		obs.setExec(*o.Exec)
	case o.ReadFile != nil:
		obs.Content, obs.Size, obs.Truncated = new(string(o.ReadFile.Content)), new(o.ReadFile.Size), o.ReadFile.Truncated
	case o.WriteFile != nil:
		obs.Size = new(o.WriteFile.Size)
	case o.Submit != nil:
		obs.Verdict = &Verdict{Reward: r.Reward, Components: o.Submit.Components, Output: o.Submit.Output}
	case o.Error != nil:
		obs.Error = o.Error.Message
		obs.Errno = o.Error.Errno.Error()
	}
	obs.CheckpointID = r.CheckpointID
	res := s.resultLocked(obs, r.EpisodeID, r.CheckpointID, &r)
	res.Reward = r.Reward
	return res
}

// resultLocked wraps obs with the session's metadata; step is the step's result, nil for a
// reset, restore, checkpoint or evaluation.
// +checklocks:s.mu
func (s *session) resultLocked(obs Observation, ep, ckpt string, step *episode.StepResult) Result {
	m := Metadata{Env: s.env, SandboxID: s.sandbox, EpisodeID: ep, CheckpointID: ckpt, StepIndex: -1}
	if step != nil {
		m.StepIndex, m.Terminated, m.Truncated = step.StepIndex, step.Terminated, step.Truncated
		m.TruncatedBy = step.Info["truncated_by"]
		m.Info = step.Info
	}
	if info, err := s.h.core.Sandbox(s.sandbox); err == nil {
		m.StepCount, m.StartCheckpointID = info.NextStepIndex, info.StartCheckpoint
		if step == nil && info.Done {
			m.Terminated = true // the episode had ended before; a reset or restore goes on
		}
	}
	obs.Metadata = &m
	return Result{Observation: obs, Done: m.Terminated || m.Truncated, Metadata: &m}
}

// state is the session's episode and how many steps its path has.
func (s *session) state(ctx context.Context) (State, error) {
	env, core := s.env, s.h.core
	ctx, done := s.bind(ctx)
	defer done()
	s.mu.Lock()
	defer s.mu.Unlock()
	if err := s.ensureLocked(ctx); err != nil {
		return State{}, err
	}
	info, err := core.Sandbox(s.sandbox)
	if err != nil {
		return State{}, s.lostLocked(err)
	}
	return State{EpisodeID: info.EpisodeID, StepCount: info.NextStepIndex, SandboxID: s.sandbox, Env: env,
		Done: info.Done, StartCheckpointID: info.StartCheckpoint}, nil
}

// keepAlive renews the lease of the session's sandbox.
func (s *session) keepAlive() {
	s.mu.Lock()
	id := s.sandbox
	s.mu.Unlock()
	if id != "" {
		_, _ = s.h.core.Touch(id)
	}
}

// close ends the session and closes its sandbox; it is idempotent. It waits for a call in
// progress, which the caller aborts by cancelling its context.
func (s *session) close(ctx context.Context) {
	h := s.h
	s.end() // the call in progress ends, and those waiting find the session closed
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.closed {
		return
	}
	s.closed = true
	if id := s.sandbox; id != "" {
		s.sandbox = ""
		if err := h.core.Close(context.WithoutCancel(ctx), id); err != nil {
			h.log.Warn("closing a session's sandbox", "sandbox", id, "err", err)
		}
	}
}

func osMode(m uint32) os.FileMode { return os.FileMode(m) }

// setExec shows a command's result.
func (o *Observation) setExec(r sandbox.ExecResult) {
	o.Stdout, o.Stderr = new(string(r.Stdout)), new(string(r.Stderr))
	code := r.ExitCode
	o.ExitCode = &code
	o.TimedOut = r.TimedOut
	o.Signal = r.Signal
	o.OutputTruncated = r.StdoutTruncated || r.StderrTruncated
	o.Duration = r.Duration.Seconds()
}
