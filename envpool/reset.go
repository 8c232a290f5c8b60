package envpool

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"maps"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/deltagym/deltagym/sandbox"
)

// ResetParams are the task parameters of a Reset.
type ResetParams struct {
	Seed    *int64
	Options map[string]string
}

// ResetResult describes the start state of a Reset's sandbox.
type ResetResult struct {
	// Checkpoint is the episode's initial state: the task checkpoint when the env has a reset
	// hook, else the env's pool checkpoint.
	Checkpoint string
	// Hook is the reset hook's result (nil without a hook). On a cached task it is the result of
	// the run that made the task checkpoint.
	Hook *sandbox.ExecResult
	// Cached is set when the task checkpoint was reused (the sandbox is a fork of it).
	Cached bool
}

var optionNameRE = regexp.MustCompile(`^[A-Za-z_][A-Za-z0-9_]*$`)

type task struct {
	checkpoint string
	hook       sandbox.ExecResult
	used       uint64 // tick of the last use, for eviction
}

// maxTasks bounds an env's task cache; the least recently used task's
// checkpoint is released beyond it (a later reset of that task reruns its hook).
const maxTasks = 1024

// taskCache maps a task key (seed and options) to the checkpoint after its reset hook.
type taskCache struct {
	mu sync.Mutex
	// +checklocks:mu
	tasks map[string]task
	// +checklocks:mu
	tick uint64
}

func newTaskCache() *taskCache { return &taskCache{tasks: map[string]task{}} }

// get returns the task of key, marking it used.
func (c *taskCache) get(key string) (task, bool) {
	c.mu.Lock()
	defer c.mu.Unlock()
	t, ok := c.tasks[key]
	if ok {
		c.tick++
		t.used = c.tick
		c.tasks[key] = t
	}
	return t, ok
}

// len returns the number of tasks cached.
func (c *taskCache) len() int {
	c.mu.Lock()
	defer c.mu.Unlock()
	return len(c.tasks)
}

// put adds a task and returns the checkpoint of the one it evicted, if any.
func (c *taskCache) put(key string, t task) (evicted string) {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.tick++
	t.used = c.tick
	c.tasks[key] = t
	if len(c.tasks) <= maxTasks {
		return ""
	}
	oldKey, old := "", uint64(1<<64-1)
	for k, v := range c.tasks {
		if v.used < old {
			oldKey, old = k, v.used
		}
	}
	evicted = c.tasks[oldKey].checkpoint
	delete(c.tasks, oldKey)
	return evicted
}

// vars returns the task's variables: each option by its key, and the seed as DELTAGYM_SEED
// (nil for none).
func (p ResetParams) vars() map[string]string {
	if len(p.Options) == 0 && p.Seed == nil {
		return nil
	}
	vars := make(map[string]string, len(p.Options)+1)
	maps.Copy(vars, p.Options)
	if p.Seed != nil {
		vars["DELTAGYM_SEED"] = strconv.FormatInt(*p.Seed, 10)
	}
	return vars
}

func taskKey(p ResetParams) string {
	var b strings.Builder
	if p.Seed != nil {
		b.WriteString(strconv.FormatInt(*p.Seed, 10))
	}
	for _, k := range slices.Sorted(maps.Keys(p.Options)) {
		b.WriteString("\x00" + k + "=" + p.Options[k])
	}
	return b.String()
}

// OptionKeyOK reports whether k may name a Reset option: options become environment variables
// of the reset hook and the verifier, so a key is a variable name, and not one of DELTAGYM_'s.
func OptionKeyOK(k string) bool {
	return optionNameRE.MatchString(k) && !strings.HasPrefix(k, "DELTAGYM_")
}

// checkOption checks a Reset option: a key OptionKeyOK takes, a value without NUL.
func checkOption(k, v string) error {
	if !OptionKeyOK(k) {
		return fmt.Errorf("option %.64q is not a variable name (or uses the DELTAGYM_ prefix): %w", k, ErrBadOption)
	}
	if strings.ContainsRune(v, 0) {
		return fmt.Errorf("option %s's value holds NUL: %w", k, ErrBadOption)
	}
	return nil
}

// Reset hands over a sandbox of env at the start of a task. Without a reset hook it is a warm
// sandbox from the pool. With one, a cached task checkpoint is forked, or else a warm sandbox
// runs the hook (seed as DELTAGYM_SEED, each option as a variable of its key) and the state after
// it is checkpointed and cached.
func (m *Manager) Reset(ctx context.Context, env *Env, p ResetParams) (*Lease, ResetResult, error) {
	for k, v := range p.Options {
		if err := checkOption(k, v); err != nil {
			return nil, ResetResult{}, err
		}
	}
	hook := env.spec.GetResetHook()
	if hook == "" {
		l, err := m.Acquire(ctx, env)
		if err != nil {
			return nil, ResetResult{}, err
		}
		l.SetTask(p.vars())
		return l, ResetResult{Checkpoint: env.pool.ckpt}, nil
	}
	key := taskKey(p)
	if t, ok := env.tasks.get(key); ok {
		ls, err := m.Fork(ctx, env, t.checkpoint, 1)
		if err == nil {
			h := t.hook
			ls[0].SetTask(p.vars())
			return ls[0], ResetResult{Checkpoint: t.checkpoint, Hook: &h, Cached: true}, nil
		}
		m.log.Warn("forking cached task; rerunning its hook", "env", env.Name(), "checkpoint", t.checkpoint, "err", err)
	}
	l, err := m.Acquire(ctx, env)
	if err != nil {
		return nil, ResetResult{}, err
	}
	fail := func(err error) (*Lease, ResetResult, error) {
		_ = m.CloseLease(context.WithoutCancel(ctx), l)
		return nil, ResetResult{}, err
	}
	// Secret options reach the verifier only (Pristine), never the hook.
	secret := env.spec.GetEvaluation().GetSecretOptions()
	vars := make([]string, 0, len(p.Options)+1)
	for k, v := range p.vars() {
		if !slices.Contains(secret, k) {
			vars = append(vars, k+"="+v)
		}
	}
	res, err := l.box.Exec(ctx, sandbox.ExecRequest{Command: hook, Env: vars, Timeout: env.stepTimeout, MaxOutput: env.outputCap})
	if err != nil {
		return fail(fmt.Errorf("env %s: running reset hook: %w", env.Name(), err))
	}
	if res.ExitCode != 0 || res.TimedOut {
		return fail(fmt.Errorf("env %s: reset hook exited %d (timed out %v): %s: %w",
			env.Name(), res.ExitCode, res.TimedOut, tail(res.Stderr, 512), ErrBadOption))
	}
	// Forked for later resets of the task: files only. Its labels keep the task, for the
	// episodes that start from it. Pinned: the task cache releases it when it evicts the task,
	// never the checkpoint TTL.
	l.SetTask(p.vars())
	info, err := l.box.CheckpointWith(ctx, sandbox.CheckpointOptions{Processes: sandbox.ProcessesNone, Pinned: true, Labels: TaskLabels(l.Task())})
	if err != nil {
		return fail(fmt.Errorf("env %s: checkpointing task: %w", env.Name(), err))
	}
	m.reportCheckpoint(env.Name(), KindTask, info)
	if old := env.tasks.put(key, task{checkpoint: info.ID, hook: res}); old != "" {
		if err := m.rt.ReleaseCheckpoint(old); err != nil && !errors.Is(err, sandbox.ErrNotFound) {
			m.log.Warn("releasing an evicted task checkpoint", "env", env.Name(), "checkpoint", old, "err", err)
		}
		m.kick()
	}
	return l, ResetResult{Checkpoint: info.ID, Hook: &res}, nil
}

// Verdict is a verifier's result.
type Verdict struct {
	Reward     float64
	Components map[string]float64
	Output     string // stdout then stderr, cut at the env's output cap
	Duration   time.Duration
	// Checkpoint is the state Evaluate ran the verifier on (none for Verify and Pristine).
	Checkpoint sandbox.CheckpointInfo
	// Refused says why the agent's state was refused without running the verifier
	// (Pristine: a copy path held a symlink, FIFO, socket or device, or more than the
	// env's copy caps); the reward is then 0. Empty when the verifier ran.
	Refused string
}

// Verify runs env's verifier in sb as it is (VERIFIER_MODE_SANDBOX). answer, when set, is in
// the verifier's environment as DELTAGYM_ANSWER.
func (m *Manager) Verify(ctx context.Context, env *Env, sb Box, answer *string) (Verdict, error) {
	if !env.HasVerifier() {
		return Verdict{}, fmt.Errorf("env %s: %w", env.Name(), ErrNoVerifier)
	}
	var vars []string
	if answer != nil {
		vars = append(vars, "DELTAGYM_ANSWER="+*answer)
	}
	return m.runVerifier(ctx, env, sb, vars)
}

// runVerifier runs env's verifier in sb with vars over its environment and reads its reward.
func (m *Manager) runVerifier(ctx context.Context, env *Env, sb Box, vars []string) (Verdict, error) {
	res, err := sb.Exec(ctx, sandbox.ExecRequest{Command: env.spec.GetVerifier(), Env: vars, Timeout: env.stepTimeout, MaxOutput: env.outputCap})
	if err != nil {
		return Verdict{}, fmt.Errorf("env %s: running verifier: %w", env.Name(), err)
	}
	v := Verdict{Output: string(res.Stdout) + string(res.Stderr), Duration: res.Duration}
	if len(v.Output) > env.outputCap {
		v.Output = v.Output[:env.outputCap]
	}
	if res.ExitCode != 0 || res.TimedOut {
		return v, fmt.Errorf("env %s: verifier exited %d (timed out %v): %s: %w", env.Name(), res.ExitCode, res.TimedOut, tail(res.Stderr, 512), ErrVerifier)
	}
	v.Reward, v.Components, err = ParseReward(res.Stdout)
	if err != nil {
		return v, fmt.Errorf("env %s: %w", env.Name(), err)
	}
	return v, nil
}

// Submit judges the lease's state for a submit: in the agent's sandbox as it is (Verify), or,
// for an env in VERIFIER_MODE_PRISTINE, in a fresh sandbox (Pristine). answer, when set, is
// in the verifier's environment as DELTAGYM_ANSWER. The caller holds the lease's turn.
func (m *Manager) Submit(ctx context.Context, l *Lease, answer *string) (Verdict, error) {
	if l.env.Pristine() {
		return m.Pristine(ctx, l, answer)
	}
	return m.Verify(ctx, l.env, l.box, answer)
}

// Evaluate runs the env's verifier on the lease's current state without changing it. For an
// env in VERIFIER_MODE_PRISTINE it is Pristine, as a submit would judge it; else it
// checkpoints the sandbox (an evaluate checkpoint), forks one sandbox from it, runs the
// verifier there and destroys the fork. The caller holds the lease's turn (Begin). The
// verifier sees the sandbox's files only: no process of the sandbox runs where it does.
func (m *Manager) Evaluate(ctx context.Context, l *Lease) (Verdict, error) {
	if !l.env.HasVerifier() {
		return Verdict{}, fmt.Errorf("env %s: %w", l.env.Name(), ErrNoVerifier)
	}
	if l.env.Pristine() {
		return m.Pristine(ctx, l, nil)
	}
	// The verifier runs in a fork: files only.
	info, err := l.box.CheckpointWith(ctx, sandbox.CheckpointOptions{Processes: sandbox.ProcessesNone})
	if err != nil {
		return Verdict{}, fmt.Errorf("checkpointing sandbox %s to evaluate: %w", l.ID(), err)
	}
	m.reportCheckpoint(l.env.Name(), KindEvaluate, info)
	sbs, err := m.rt.Fork(ctx, info.ID, 1, l.env.forkSpec())
	if err != nil {
		return Verdict{}, fmt.Errorf("forking sandbox %s to evaluate: %w", l.ID(), err)
	}
	defer func() {
		if err := sbs[0].Destroy(context.WithoutCancel(ctx)); err != nil {
			m.log.Warn("destroying evaluate fork", "sandbox", sbs[0].ID(), "err", err)
		}
		m.kick()
	}()
	v, err := m.Verify(ctx, l.env, sbs[0], nil)
	v.Checkpoint = info
	return v, err
}

// ParseReward reads a verifier's reward from the last non-empty line of its stdout: a number,
// or a JSON object {"reward": r, "components": {"name": x, ...}}.
func ParseReward(stdout []byte) (float64, map[string]float64, error) {
	lines := strings.Split(strings.TrimSpace(string(stdout)), "\n")
	last := strings.TrimSpace(lines[len(lines)-1])
	if last == "" {
		return 0, nil, fmt.Errorf("verifier printed no reward: %w", ErrVerifier)
	}
	if r, err := strconv.ParseFloat(last, 64); err == nil {
		return r, nil, nil
	}
	var obj struct {
		Reward     *float64           `json:"reward"`
		Components map[string]float64 `json:"components"`
	}
	if err := json.Unmarshal([]byte(last), &obj); err != nil || obj.Reward == nil {
		return 0, nil, fmt.Errorf("verifier's last line %q is neither a number nor {\"reward\": ...}: %w", tail([]byte(last), 200), ErrVerifier)
	}
	return *obj.Reward, obj.Components, nil
}
