package episode

import (
	"os"
	"time"

	"golang.org/x/sys/unix"

	"github.com/deltagym/deltagym/sandbox"
)

// Action is what a step does: Exec, WriteFile, ReadFile or Submit; a tree action (ListDir,
// Stat, Remove, MakeDir, Upload, Download: files.go); a process action (ListProcesses, Signal);
// or Refused, a request the wire could not make into one.
type Action interface {
	// Kind names the action as its proto field does: "exec", "write_file", "list_dir" ...
	Kind() string
}

// Exec runs a command: exactly one of Command (a shell string) and Argv.
type Exec struct {
	Command string
	Argv    []string
	Stdin   []byte
	Env     map[string]string
	Cwd     string
	// Timeout, when positive and shorter than the env's step timeout, bounds the command.
	Timeout time.Duration
	// Background starts the command and returns at once.
	Background bool
	// Session runs Command in the named persistent shell (started on first use).
	Session string
	// Interact runs a Session command interactively (sandbox.Interact): Command is the
	// command, or the input of the one attached, which may be empty (the Enter key alone).
	Interact *sandbox.Interact
	// Output, when set, is given the command's output as it is read (sandbox.ExecRequest's
	// Output): StreamStep's. It is not part of the action (nor of its record).
	Output func(stream int, p []byte)
}

// Refused is an action its front end could not decode (patterns that do not compile, flags
// that do not go together): validate refuses it with Err, before anything runs.
type Refused struct{ Err error }

// Kind returns "refused".
func (Refused) Kind() string { return "refused" }

// ListProcesses lists the sandbox's processes (sandbox.Sandbox.ListProcesses).
type ListProcesses struct{}

// Signal sends Signal (0: SIGTERM) to process Pid of the sandbox, or with Group to its process
// group (sandbox.Sandbox.Signal).
type Signal struct {
	Pid    int
	Signal int
	Group  bool
}

// Kind returns "list_processes".
func (ListProcesses) Kind() string { return "list_processes" }

// Kind returns "signal".
func (Signal) Kind() string { return "signal" }

// ListProcessesResult is the sandbox's processes, by pid.
type ListProcessesResult struct{ Processes []sandbox.Process }

// SignalResult is a signal sent.
type SignalResult struct{}

// WriteFile writes (or appends to) a file in the sandbox.
type WriteFile struct {
	Path    string
	Content []byte
	Mode    os.FileMode // permission bits of a created file; 0 means 0644
	Append  bool
}

// ReadFile reads a file of the sandbox from Offset, at most MaxBytes (0: the env's output cap).
type ReadFile struct {
	Path     string
	Offset   int64
	MaxBytes int64
}

// Submit runs the env's verifier and ends the episode; Answer, when set, is in the verifier's
// environment as DELTAGYM_ANSWER.
type Submit struct {
	Answer *string
}

// Kind returns "exec".
func (Exec) Kind() string { return "exec" }

// Kind returns "write_file".
func (WriteFile) Kind() string { return "write_file" }

// Kind returns "read_file".
func (ReadFile) Kind() string { return "read_file" }

// Kind returns "submit".
func (Submit) Kind() string { return "submit" }

// Observation is what an action saw; exactly one field is set, none for a skipped step. Error
// is set, alone, when the sandbox's own state refused the action (classify).
type Observation struct {
	Exec      *sandbox.ExecResult
	WriteFile *WriteFileResult
	ReadFile  *ReadFileResult
	Submit    *SubmitResult
	// The tree actions' (files.go).
	ListDir  *ListDirResult
	Stat     *StatResult
	Remove   *RemoveResult
	MakeDir  *MakeDirResult
	Upload   *sandbox.UploadStats
	Download *DownloadResult
	// The process actions' (procs.go).
	ListProcesses *ListProcessesResult
	Signal        *SignalResult
	Error         *ActionError
}

// ActionError is why the sandbox's state refused an action: the errno it gave and what failed
// where, in words.
type ActionError struct {
	Errno   unix.Errno
	Message string
	// Path is the path the errno is about, when the runtime says: a file action's, or the
	// directory a command could not start in.
	Path string
}

// WriteFileResult is the size of the file after a write.
type WriteFileResult struct{ Size int64 }

// ReadFileResult is what a read returned: Content, the file's Size, and whether the file goes
// on past what was returned.
type ReadFileResult struct {
	Content   []byte
	Size      int64
	Truncated bool
}

// SubmitResult is the verifier's verdict on a submit.
type SubmitResult struct {
	Components map[string]float64
	Output     string
}

// ResetRequest starts an episode in a sandbox of Env at the start of a task.
type ResetRequest struct {
	Env     string
	Seed    *int64
	Options map[string]string
	Run     string
	Group   string
	// IdempotencyKey, when set, makes a retry with the same key and request return the first
	// call's result.
	IdempotencyKey string
	// LeaseTTL is the sandbox's lease TTL (envpool.Lease.SetTTL): 0 means the pools' default;
	// negative or past Config.MaxLeaseTTL is ErrInvalid.
	LeaseTTL time.Duration
}

// ResetResult is a reset's sandbox and episode.
type ResetResult struct {
	SandboxID string
	EpisodeID string
	// CheckpointID is the episode's initial state (the task's or the env's pool checkpoint).
	CheckpointID string
	Env          string
	Task         string
	// Hook is the env's reset hook's result (nil without one).
	Hook *sandbox.ExecResult
	// TaskCached says the task checkpoint was reused (meaningful with a Hook).
	TaskCached bool
	// Took is the server's own time for the reset.
	Took         time.Duration
	LeaseExpires time.Time
}

// StepRequest is one step: the action, with an optional restore before it and an optional
// checkpoint after it.
type StepRequest struct {
	SandboxID string
	Action    Action
	// Checkpoint takes a checkpoint of the state after the step (StepResult.CheckpointID).
	Checkpoint bool
	// RestoreCheckpointID restores the sandbox to that checkpoint before the action, as
	// Restore does (the step is the first of the new episode).
	RestoreCheckpointID string
	// RestoreFreshEntropy gives the restored state a new seed (sandbox.RestoreOptions).
	RestoreFreshEntropy bool
	// Setup marks a step that sets the task up: performed, numbered and recorded as any, it
	// counts against neither of the env's budgets (not max_steps, and its time not in
	// max_seconds). A submit cannot be one.
	Setup bool
	// CheckpointWaitDigest and CheckpointDedupe are CheckpointRequest's WaitDigest and Dedupe
	// for the checkpoint after the step; either without Checkpoint is ErrInvalid.
	CheckpointWaitDigest bool
	CheckpointDedupe     bool
}

// StepResult is a step's outcome. Info carries "truncated_by" (max_steps or max_seconds),
// "action_skipped" (the time budget was spent before the step) and "verifier_error".
type StepResult struct {
	EpisodeID    string
	StepIndex    int
	Observation  Observation
	Reward       float64
	Terminated   bool
	Truncated    bool
	CheckpointID string
	// CheckpointDigest and CheckpointDeduplicated are CheckpointResult's Digest and
	// Deduplicated for CheckpointID.
	CheckpointDigest       sandbox.StateDigest
	CheckpointDeduplicated bool
	Info                   map[string]string
	// StepsLeft is how many more agent steps the env's max_steps allows after this one; -1
	// when it has none.
	StepsLeft int
}

// CheckpointRequest checkpoints a sandbox. Processes is how its processes are captured:
// sandbox.ProcessesDefault means the env's mode, else the runtime's.
type CheckpointRequest struct {
	SandboxID string
	Processes sandbox.ProcessMode
	// Durable also saves the processes kept as templates as CRIU images.
	Durable bool
	// WaitDigest waits for the checkpoint's state digest (CheckpointResult.Digest).
	WaitDigest bool
	// Dedupe, which implies WaitDigest, answers with an existing checkpoint of the sandbox's
	// env and task holding the same state, if there is one, instead of keeping the new one.
	Dedupe bool
}

// CheckpointResult is the checkpoint taken; Durable says whether it brings its processes back
// after its sandbox is gone or the server restarts: every one has an image (Info.Processes'
// Saved), which a durable request waits for.
type CheckpointResult struct {
	Info sandbox.CheckpointInfo
	// Parent is the sandbox's previous checkpoint: Info.Parent, unless Deduplicated.
	Parent  string
	Durable bool
	// Digest is the checkpoint's state digest, with WaitDigest or Dedupe.
	Digest sandbox.StateDigest
	// Deduplicated: Info is an existing checkpoint found holding the sandbox's state.
	Deduplicated bool
}

// RestoreRequest puts a sandbox at a checkpoint of its env and starts the episode there.
type RestoreRequest struct {
	SandboxID    string
	CheckpointID string
	FreshEntropy bool
}

// RestoreResult is the episode that starts at the checkpoint and the index of its next step.
type RestoreResult struct {
	EpisodeID     string
	NextStepIndex int
}

// ForkRequest makes N sandboxes, each with an episode, at a checkpoint (CheckpointID) or at the
// current state of a sandbox (SandboxID, which is checkpointed first); exactly one of them.
// Run and Group default to the source's.
type ForkRequest struct {
	CheckpointID   string
	SandboxID      string
	N              int
	Run            string
	Group          string
	FreshEntropy   bool
	IdempotencyKey string
	// LeaseTTL is ResetRequest.LeaseTTL for each child.
	LeaseTTL time.Duration
}

// ForkResult lists the children and what became of the source's processes in them.
type ForkResult struct {
	CheckpointID string
	Children     []Child
	Processes    []ProcessNote
}

// Child is one forked sandbox and its episode.
type Child struct {
	SandboxID string
	EpisodeID string
}

// Capture says how a process of a checkpoint was captured, or brought into a fork.
type Capture int

// Captures.
const (
	CaptureTemplate Capture = iota // a frozen copy (template) of the process
	CaptureCRIU                    // a CRIU image
	CaptureNone                    // not at all: the fork runs without it
)

// ProcessNote says how a process was captured or brought back, and why.
type ProcessNote struct {
	Pid     int
	Command string
	Method  Capture
	Reason  string
}

// Verdict is an evaluation's reward.
type Verdict struct {
	Reward     float64
	Components map[string]float64
	Output     string
	Took       time.Duration
}

// SandboxInfo describes a leased sandbox and its episode.
type SandboxInfo struct {
	SandboxID       string
	Env             string
	EpisodeID       string
	Run             string
	Group           string
	Done            bool // the episode ended; Restore or Reset to go on
	NextStepIndex   int
	StartCheckpoint string
	LeaseExpires    time.Time
	Created         time.Time
}

// Filter selects sandboxes; empty fields match all.
type Filter struct {
	Env, Run, Group string
}
