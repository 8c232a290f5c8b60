package deltagym

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"syscall"
	"time"

	"connectrpc.com/connect"

	deltagymv1 "github.com/deltagym/deltagym/clients/go/gen/deltagym/v1"
)

// Sandbox is a handle on a sandbox leased from the server. Its methods are
// safe for concurrent use; the server performs calls on one sandbox one at a
// time. Close it when done (or let its lease expire).
type Sandbox struct {
	c  *Client
	id string

	mu sync.Mutex
	// +checklocks:mu
	episodeID string
	// +checklocks:mu
	startCheckpoint string
	// +checklocks:mu
	leaseExpiry time.Time
	// reset is set before the handle is shared and never changed.
	reset *deltagymv1.ResetResponse
	// +checklocks:mu
	closed bool

	// keepalive, when running: closing stop ends the loop, which closes done.
	// +checklocks:mu
	kaStop chan struct{}
	// +checklocks:mu
	kaDone chan struct{}
	// +checklocks:mu
	kaErr  error
	onBeat func(time.Time, error) // test hook, called after each heartbeat
}

// ID returns the sandbox's ID.
func (s *Sandbox) ID() string { return s.id }

// EpisodeID returns the ID of the sandbox's current episode as last reported
// by the server (after Reset, Fork, Restore or a step).
func (s *Sandbox) EpisodeID() string {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.episodeID
}

// StartCheckpointID returns the checkpoint the current episode started from,
// when known: the initial state after Reset, or the checkpoint of a Fork or
// Restore.
func (s *Sandbox) StartCheckpointID() string {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.startCheckpoint
}

// LeaseExpiry returns when the sandbox is reaped unless renewed, as last
// reported by the server (zero if not known yet).
func (s *Sandbox) LeaseExpiry() time.Time {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.leaseExpiry
}

// ResetResponse returns the server's response to the Reset that created this
// handle (nil for handles from Fork or Client.Sandbox): the task, the reset
// hook's output and the info map.
func (s *Sandbox) ResetResponse() *deltagymv1.ResetResponse { return s.reset }

// Task returns the task text of the Reset that created this handle.
func (s *Sandbox) Task() string {
	return s.reset.GetObservation().GetReset_().GetTask()
}

func (s *Sandbox) checkOpen() error {
	if err := s.c.checkOpen(); err != nil {
		return err
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.closed {
		return fmt.Errorf("sandbox %s: %w", s.id, ErrSandboxClosed)
	}
	return nil
}

// StepResult holds what every step returns.
type StepResult struct {
	// EpisodeID is the episode the step belongs to.
	EpisodeID string
	// StepIndex is the index of the step in its episode, inherited steps
	// counted.
	StepIndex int
	// Reward is the step's reward (the verifier's, for Submit).
	Reward float64
	// Terminated is set when the episode reached a terminal state.
	Terminated bool
	// Truncated is set when the episode ran out of a budget.
	Truncated bool
	// CheckpointID is the checkpoint of the state after the step, when
	// WithCheckpoint asked for one.
	CheckpointID string
	// CheckpointDigest is CheckpointID's state digest when the step asked to
	// wait for it (WithCheckpointDigest, WithCheckpointDedupe).
	CheckpointDigest *deltagymv1.StateDigest
	// CheckpointDeduplicated is set when WithCheckpointDedupe found the state
	// in an existing checkpoint, whose ID CheckpointID is.
	CheckpointDeduplicated bool
	// Info holds extra env- or server-defined facts.
	Info map[string]string
	// Observation is the raw observation.
	Observation *deltagymv1.Observation
}

// Done reports whether the episode ended with this step.
func (r *StepResult) Done() bool { return r.Terminated || r.Truncated }

// ExecResult is the outcome of Exec or Run.
type ExecResult struct {
	StepResult
	// Stdout and Stderr are the process's output, cut at the env's cap.
	Stdout, Stderr []byte
	// ExitCode is the exit status, or -1 when the process was killed by a
	// signal or runs in the background.
	ExitCode int
	// Signal is the number of the signal that killed the process, or 0.
	Signal int
	// TimedOut is set when the step timeout killed the process.
	TimedOut bool
	// StdoutTruncated and StderrTruncated are set when the output was cut.
	StdoutTruncated, StderrTruncated bool
	// Duration is the process's wall time, measured by the server.
	Duration time.Duration
	// PID is the process id inside the sandbox of a background process.
	PID int
}

// OK reports whether the process exited with status 0 in time.
func (r *ExecResult) OK() bool { return r.ExitCode == 0 && r.Signal == 0 && !r.TimedOut }

// WriteResult is the outcome of WriteFile.
type WriteResult struct {
	StepResult
	// Size is the size of the file after the write.
	Size int64
}

// ReadResult is the outcome of ReadFile.
type ReadResult struct {
	StepResult
	// Content is the bytes read.
	Content []byte
	// Size is the full size of the file.
	Size int64
	// Truncated is set when the file continues past Content.
	Truncated bool
}

// SubmitResult is the outcome of Submit: the verifier's verdict. Its reward
// is StepResult.Reward.
type SubmitResult struct {
	StepResult
	// Components are the named parts of the reward.
	Components map[string]float64
	// Output is the verifier's combined output.
	Output string
}

// StepOption sets a field of a step. Options that do not apply to the
// action (a session on WriteFile) are ignored.
type StepOption func(*stepConfig)

type stepConfig struct {
	checkpoint bool
	ckDigest   bool
	ckDedupe   bool
	stdin      []byte
	env        map[string]string
	cwd        string
	timeout    time.Duration
	background bool
	session    string
	mode       uint32
	append     bool
	offset     int64
	maxBytes   int64
}

// WithCheckpoint asks for a checkpoint of the state after the step; its ID is
// in StepResult.CheckpointID.
func WithCheckpoint() StepOption { return func(c *stepConfig) { c.checkpoint = true } }

// WithCheckpointDigest, which implies WithCheckpoint, waits for the
// checkpoint's state digest (StepResult.CheckpointDigest), as WaitDigest does
// for Checkpoint.
func WithCheckpointDigest() StepOption {
	return func(c *stepConfig) { c.checkpoint, c.ckDigest = true, true }
}

// WithCheckpointDedupe, which implies WithCheckpoint, answers an existing
// checkpoint of the env holding the state after the step, if there is one
// (StepResult.CheckpointDeduplicated), as Dedupe does for Checkpoint.
func WithCheckpointDedupe() StepOption {
	return func(c *stepConfig) { c.checkpoint, c.ckDedupe = true, true }
}

// request is the step request of action with c's checkpoint options.
func (c *stepConfig) request(action *deltagymv1.Action) *deltagymv1.StepRequest {
	return &deltagymv1.StepRequest{Action: action, Checkpoint: c.checkpoint,
		CheckpointWaitForDigest: c.ckDigest, CheckpointDedupe: c.ckDedupe}
}

// WithStdin gives an exec its standard input.
func WithStdin(stdin []byte) StepOption { return func(c *stepConfig) { c.stdin = stdin } }

// WithEnv adds an environment variable to an exec.
func WithEnv(key, value string) StepOption {
	return func(c *stepConfig) {
		if c.env == nil {
			c.env = make(map[string]string)
		}
		c.env[key] = value
	}
}

// WithCwd sets the working directory of an exec.
func WithCwd(dir string) StepOption { return func(c *stepConfig) { c.cwd = dir } }

// WithTimeout bounds the wall time of an exec (capped by the env's step
// timeout).
func WithTimeout(d time.Duration) StepOption { return func(c *stepConfig) { c.timeout = d } }

// InBackground starts an exec's process and returns at once with its PID.
func InBackground() StepOption { return func(c *stepConfig) { c.background = true } }

// WithSession runs an Exec command in the named persistent bash session.
func WithSession(name string) StepOption { return func(c *stepConfig) { c.session = name } }

// WithMode sets the permission bits of a file WriteFile creates.
func WithMode(mode uint32) StepOption { return func(c *stepConfig) { c.mode = mode } }

// Appending makes WriteFile append instead of replacing.
func Appending() StepOption { return func(c *stepConfig) { c.append = true } }

// WithRange makes ReadFile read at most maxBytes from offset (zero maxBytes
// means the env's cap).
func WithRange(offset, maxBytes int64) StepOption {
	return func(c *stepConfig) { c.offset, c.maxBytes = offset, maxBytes }
}

func stepOptions(opts []StepOption) stepConfig {
	var c stepConfig
	for _, o := range opts {
		o(&c)
	}
	return c
}

func (c stepConfig) exec() *deltagymv1.ExecAction {
	return &deltagymv1.ExecAction{
		Stdin:          c.stdin,
		Env:            c.env,
		Cwd:            c.cwd,
		TimeoutSeconds: c.timeout.Seconds(),
		Background:     c.background,
		Session:        c.session,
	}
}

// Step performs a raw action; checkpoint asks for a checkpoint after it. The
// typed methods (Exec, Run, WriteFile, ReadFile, Submit) are built on it.
func (s *Sandbox) Step(ctx context.Context, action *deltagymv1.Action, checkpoint bool) (*deltagymv1.StepResponse, error) {
	return s.step(ctx, &deltagymv1.StepRequest{Action: action, Checkpoint: checkpoint})
}

// StepFrom restores the sandbox to checkpoint checkpointID and then performs
// a raw action, in one call: "go back to this node and try this action" in
// a tree search. The restore is Restore's (the current episode ends as
// branched, a new one starts at the checkpoint; the handle's EpisodeID
// follows); if it fails, the action is not performed. Not retried.
func (s *Sandbox) StepFrom(ctx context.Context, checkpointID string, action *deltagymv1.Action, checkpoint bool, opts ...RestoreOption) (*deltagymv1.StepResponse, error) {
	if checkpointID == "" {
		return nil, fmt.Errorf("step in sandbox %s from a checkpoint: no checkpoint ID", s.id)
	}
	rc := restoreOptions(opts)
	return s.step(ctx, &deltagymv1.StepRequest{Action: action, Checkpoint: checkpoint, RestoreCheckpointId: checkpointID, RestoreFreshEntropy: rc.freshEntropy})
}

// RestoreOption changes a Restore or StepFrom.
type RestoreOption func(*restoreConfig)

type restoreConfig struct{ freshEntropy bool }

func restoreOptions(opts []RestoreOption) restoreConfig {
	var rc restoreConfig
	for _, o := range opts {
		o(&rc)
	}
	return rc
}

// RestoreFreshEntropy gives the restored state randomness of its own
// (RestoreRequest.fresh_entropy): a new seed in /run/deltagym/fork-seed
// before the restored processes run, and a reseeded $RANDOM in each
// restored session.
func RestoreFreshEntropy() RestoreOption { return func(c *restoreConfig) { c.freshEntropy = true } }

// step sends req for this sandbox and follows the episode it reports.
func (s *Sandbox) step(ctx context.Context, req *deltagymv1.StepRequest) (*deltagymv1.StepResponse, error) {
	if err := s.checkOpen(); err != nil {
		return nil, err
	}
	req.SandboxId = s.id
	res, err := s.c.env.Step(ctx, connect.NewRequest(req))
	from := req.GetRestoreCheckpointId()
	if err != nil {
		if from != "" {
			return nil, fmt.Errorf("step in sandbox %s from %s: %w", s.id, from, err)
		}
		return nil, fmt.Errorf("step in sandbox %s: %w", s.id, err)
	}
	s.mu.Lock()
	if ep := res.Msg.GetEpisodeId(); ep != "" {
		s.episodeID = ep
	}
	if from != "" {
		s.startCheckpoint = from
	}
	s.mu.Unlock()
	return res.Msg, nil
}

func stepResult(m *deltagymv1.StepResponse) StepResult {
	return StepResult{
		EpisodeID:              m.GetEpisodeId(),
		StepIndex:              int(m.GetStepIndex()),
		Reward:                 m.GetReward(),
		Terminated:             m.GetTerminated(),
		Truncated:              m.GetTruncated(),
		CheckpointID:           m.GetCheckpointId(),
		CheckpointDigest:       m.GetCheckpointDigest(),
		CheckpointDeduplicated: m.GetCheckpointDeduplicated(),
		Info:                   m.GetInfo(),
		Observation:            m.GetObservation(),
	}
}

// ExecResultOf converts the observation of an exec step.
func ExecResultOf(m *deltagymv1.StepResponse) *ExecResult {
	e := m.GetObservation().GetExec()
	return &ExecResult{
		StepResult:      stepResult(m),
		Stdout:          e.GetStdout(),
		Stderr:          e.GetStderr(),
		ExitCode:        int(e.GetExitCode()),
		Signal:          int(e.GetSignal()),
		TimedOut:        e.GetTimedOut(),
		StdoutTruncated: e.GetStdoutTruncated(),
		StderrTruncated: e.GetStderrTruncated(),
		Duration:        time.Duration(e.GetDurationSeconds() * float64(time.Second)),
		PID:             int(e.GetPid()),
	}
}

// Exec runs command with /bin/sh -c (or in a session, WithSession).
func (s *Sandbox) Exec(ctx context.Context, command string, opts ...StepOption) (*ExecResult, error) {
	c := stepOptions(opts)
	a := c.exec()
	a.Command = command
	res, err := s.step(ctx, c.request(&deltagymv1.Action{Kind: &deltagymv1.Action_Exec{Exec: a}}))
	if err != nil {
		return nil, err
	}
	return ExecResultOf(res), actionError(res)
}

// Run executes argv directly, without a shell.
func (s *Sandbox) Run(ctx context.Context, argv []string, opts ...StepOption) (*ExecResult, error) {
	c := stepOptions(opts)
	a := c.exec()
	a.Argv = argv
	a.Session = ""
	res, err := s.step(ctx, c.request(&deltagymv1.Action{Kind: &deltagymv1.Action_Exec{Exec: a}}))
	if err != nil {
		return nil, err
	}
	return ExecResultOf(res), actionError(res)
}

// WriteFile writes content to path inside the sandbox.
func (s *Sandbox) WriteFile(ctx context.Context, path string, content []byte, opts ...StepOption) (*WriteResult, error) {
	c := stepOptions(opts)
	res, err := s.step(ctx, c.request(&deltagymv1.Action{Kind: &deltagymv1.Action_WriteFile{WriteFile: &deltagymv1.WriteFileAction{
		Path: path, Content: content, Mode: c.mode, Append: c.append,
	}}}))
	if err != nil {
		return nil, err
	}
	return &WriteResult{StepResult: stepResult(res), Size: res.GetObservation().GetWriteFile().GetSize()}, actionError(res)
}

// ReadFile reads path inside the sandbox (at most the env's output cap;
// ReadResult.Truncated tells whether there is more).
func (s *Sandbox) ReadFile(ctx context.Context, path string, opts ...StepOption) (*ReadResult, error) {
	c := stepOptions(opts)
	res, err := s.step(ctx, c.request(&deltagymv1.Action{Kind: &deltagymv1.Action_ReadFile{ReadFile: &deltagymv1.ReadFileAction{
		Path: path, Offset: c.offset, MaxBytes: c.maxBytes,
	}}}))
	if err != nil {
		return nil, err
	}
	r := res.GetObservation().GetReadFile()
	return &ReadResult{StepResult: stepResult(res), Content: r.GetContent(), Size: r.GetSize(), Truncated: r.GetTruncated()}, actionError(res)
}

// ActionError is an action the sandbox's own state refused (a missing file, a FIFO where a file
// was to be read, a program that is not there): the step is recorded and counted and the
// episode goes on. Exec, Run, ReadFile and WriteFile return it beside their result. It unwraps
// to the syscall.Errno, so errors.Is(err, fs.ErrNotExist) and the like work.
type ActionError struct {
	Errno   int    // the Linux error number, such as 2
	Name    string // its name, such as "ENOENT"
	Message string // what failed and where
}

func (e *ActionError) Error() string { return e.Name + ": " + e.Message }

// Unwrap returns the error number as a syscall.Errno.
func (e *ActionError) Unwrap() error { return syscall.Errno(e.Errno) }

// actionError returns the ActionError of a step's observation, or nil.
func actionError(m *deltagymv1.StepResponse) error {
	e := m.GetObservation().GetError()
	if e == nil {
		return nil
	}
	return &ActionError{Errno: int(e.GetErrno()), Name: e.GetErrnoName(), Message: e.GetMessage()}
}

// Submit ends the episode: the env's verifier runs and its reward is
// returned with Terminated set. answer, when given (at most one), is handed
// to the verifier.
func (s *Sandbox) Submit(ctx context.Context, answer ...string) (*SubmitResult, error) {
	if len(answer) > 1 {
		return nil, fmt.Errorf("submit in sandbox %s: %w", s.id,
			connect.NewError(connect.CodeInvalidArgument, errors.New("at most one answer")))
	}
	a := &deltagymv1.SubmitAction{}
	if len(answer) == 1 {
		a.Answer = &answer[0]
	}
	res, err := s.Step(ctx, &deltagymv1.Action{Kind: &deltagymv1.Action_Submit{Submit: a}}, false)
	if err != nil {
		return nil, err
	}
	sub := res.GetObservation().GetSubmit()
	return &SubmitResult{StepResult: stepResult(res), Components: sub.GetComponents(), Output: sub.GetOutput()}, nil
}

// CheckpointOption sets a field of a Checkpoint call.
type CheckpointOption func(*deltagymv1.CheckpointRequest)

// Durable makes the checkpoint keep its processes whatever happens to its
// sandbox (an agent's kill -9 -1 included): those kept as templates are
// saved as CRIU images at once, in the background.
func Durable() CheckpointOption { return func(r *deltagymv1.CheckpointRequest) { r.Durable = true } }

// WithProcessMode sets how the checkpoint captures live processes.
func WithProcessMode(m deltagymv1.ProcessMode) CheckpointOption {
	return func(r *deltagymv1.CheckpointRequest) { r.ProcessMode = m }
}

// WaitDigest makes Checkpoint wait for the checkpoint's state digest
// (Checkpoint.Digest); without it the digest is computed in the background.
func WaitDigest() CheckpointOption {
	return func(r *deltagymv1.CheckpointRequest) { r.WaitForDigest = true }
}

// Dedupe, which implies WaitDigest, answers with an existing checkpoint of the
// sandbox's env holding the same state, if there is one, instead of keeping a
// second copy of it (Checkpoint.Deduplicated); the sandbox's state then
// descends from that checkpoint.
func Dedupe() CheckpointOption { return func(r *deltagymv1.CheckpointRequest) { r.Dedupe = true } }

// Checkpoint is a saved state of a sandbox.
type Checkpoint struct {
	// ID identifies the checkpoint, server-wide.
	ID string
	// ParentID is the checkpoint its state descends from.
	ParentID string
	// Depth is the number of its ancestors.
	Depth int
	// Durable is set when nothing that happens to the sandbox can take its
	// processes (none is kept only as a frozen template).
	Durable bool
	// Processes tells how each live process was captured.
	Processes []*deltagymv1.ProcessCapture
	// Digest is the checkpoint's state digest, with WaitDigest or Dedupe.
	Digest *deltagymv1.StateDigest
	// Deduplicated is set when Dedupe found the state in an existing
	// checkpoint: ID is that checkpoint's, and ParentID the sandbox's
	// previous checkpoint.
	Deduplicated bool
}

// Checkpoint saves the sandbox's whole state as an immutable checkpoint.
func (s *Sandbox) Checkpoint(ctx context.Context, opts ...CheckpointOption) (*Checkpoint, error) {
	if err := s.checkOpen(); err != nil {
		return nil, err
	}
	req := &deltagymv1.CheckpointRequest{SandboxId: s.id}
	for _, o := range opts {
		o(req)
	}
	res, err := s.c.env.Checkpoint(ctx, connect.NewRequest(req))
	if err != nil {
		return nil, fmt.Errorf("checkpoint of sandbox %s: %w", s.id, err)
	}
	m := res.Msg
	return &Checkpoint{ID: m.GetCheckpointId(), ParentID: m.GetParentId(), Depth: int(m.GetDepth()), Durable: m.GetDurable(), Processes: m.GetProcesses(),
		Digest: m.GetDigest(), Deduplicated: m.GetDeduplicated()}, nil
}

// RestoreResult is the outcome of Restore.
type RestoreResult struct {
	// EpisodeID is the new episode that starts at the checkpoint.
	EpisodeID string
	// NextStepIndex is the index the next step will get.
	NextStepIndex int
}

// Restore puts the sandbox exactly at checkpoint checkpointID. The current
// episode ends as branched and a new one starts; the handle's EpisodeID
// follows. Restore is not retried: a second attempt would start another
// episode.
func (s *Sandbox) Restore(ctx context.Context, checkpointID string, opts ...RestoreOption) (*RestoreResult, error) {
	if err := s.checkOpen(); err != nil {
		return nil, err
	}
	rc := restoreOptions(opts)
	res, err := s.c.env.Restore(ctx, connect.NewRequest(&deltagymv1.RestoreRequest{SandboxId: s.id, CheckpointId: checkpointID, FreshEntropy: rc.freshEntropy}))
	if err != nil {
		return nil, fmt.Errorf("restore of sandbox %s to %s: %w", s.id, checkpointID, err)
	}
	s.mu.Lock()
	s.episodeID = res.Msg.GetEpisodeId()
	s.startCheckpoint = checkpointID
	s.mu.Unlock()
	return &RestoreResult{EpisodeID: res.Msg.GetEpisodeId(), NextStepIndex: int(res.Msg.GetNextStepIndex())}, nil
}

// Fork creates n sandboxes at the current state of this one, which the
// server checkpoints first (ForkResult.CheckpointID).
func (s *Sandbox) Fork(ctx context.Context, n int, opts ...EpisodeOption) (*ForkResult, error) {
	if err := s.checkOpen(); err != nil {
		return nil, err
	}
	req := &deltagymv1.ForkRequest{Source: &deltagymv1.ForkRequest_SandboxId{SandboxId: s.id}}
	res, err := s.c.fork(ctx, req, n, opts)
	if err != nil {
		return nil, fmt.Errorf("fork of sandbox %s: %w", s.id, err)
	}
	return res, nil
}

// Evaluation is the verifier's verdict on a sandbox's current state.
type Evaluation struct {
	// Reward is the verifier's reward.
	Reward float64
	// Components are its named parts.
	Components map[string]float64
	// Output is the verifier's combined output.
	Output string
	// Duration is the verifier's wall time.
	Duration time.Duration
}

// Evaluate runs the env's verifier on the sandbox's current state without
// changing it or ending the episode.
func (s *Sandbox) Evaluate(ctx context.Context) (*Evaluation, error) {
	if err := s.checkOpen(); err != nil {
		return nil, err
	}
	res, err := s.c.env.Evaluate(ctx, connect.NewRequest(&deltagymv1.EvaluateRequest{SandboxId: s.id}))
	if err != nil {
		return nil, fmt.Errorf("evaluate of sandbox %s: %w", s.id, err)
	}
	m := res.Msg
	return &Evaluation{Reward: m.GetReward(), Components: m.GetComponents(), Output: m.GetOutput(),
		Duration: time.Duration(m.GetDurationSeconds() * float64(time.Second))}, nil
}

// Info describes the sandbox as the server knows it (GetSandbox).
func (s *Sandbox) Info(ctx context.Context) (*deltagymv1.Sandbox, error) {
	if err := s.checkOpen(); err != nil {
		return nil, err
	}
	res, err := s.c.env.GetSandbox(ctx, connect.NewRequest(&deltagymv1.GetSandboxRequest{SandboxId: s.id}))
	if err != nil {
		return nil, fmt.Errorf("describing sandbox %s: %w", s.id, err)
	}
	sb := res.Msg.GetSandbox()
	s.mu.Lock()
	s.episodeID = sb.GetEpisodeId()
	s.startCheckpoint = sb.GetStartCheckpointId()
	if t := sb.GetLeaseExpireTime(); t != nil {
		s.leaseExpiry = t.AsTime()
	}
	s.mu.Unlock()
	return sb, nil
}

// Heartbeat renews the sandbox's lease and returns its new expiry. A sandbox
// the server no longer knows yields an error wrapping ErrLeaseLost (code
// NotFound).
func (s *Sandbox) Heartbeat(ctx context.Context) (time.Time, error) {
	if err := s.checkOpen(); err != nil {
		return time.Time{}, err
	}
	return s.heartbeat(ctx)
}

func (s *Sandbox) heartbeat(ctx context.Context) (time.Time, error) {
	res, err := s.c.Heartbeat(ctx, s.id)
	if err != nil {
		return time.Time{}, err
	}
	t, ok := res.Leases[s.id]
	if !ok {
		return time.Time{}, fmt.Errorf("heartbeat of sandbox %s: %w", s.id,
			connect.NewError(connect.CodeNotFound, ErrLeaseLost))
	}
	s.mu.Lock()
	s.leaseExpiry = t
	s.mu.Unlock()
	return t, nil
}

// Close ends the sandbox's episode and frees it on the server, after
// stopping the handle's heartbeat. Close is idempotent: later calls return
// nil without contacting the server.
func (s *Sandbox) Close(ctx context.Context) error {
	s.mu.Lock()
	if s.closed {
		s.mu.Unlock()
		return nil
	}
	s.closed = true
	s.mu.Unlock()
	s.stopKeepAlive()
	if err := s.c.checkOpen(); err != nil {
		return err
	}
	if _, err := s.c.env.Close(ctx, connect.NewRequest(&deltagymv1.CloseRequest{SandboxId: s.id})); err != nil {
		return fmt.Errorf("closing sandbox %s: %w", s.id, err)
	}
	return nil
}
