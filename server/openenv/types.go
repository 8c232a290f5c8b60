package openenv

import (
	"fmt"

	"github.com/deltagym/deltagym/internal/errdefs"
)

// Result is the data of an observation frame, and the body of a stateless reset or step:
// OpenEnv's shape, with the metadata both in the observation (for typed clients) and beside
// it (for clients that read the generic form).
type Result struct {
	Observation Observation `json:"observation"`
	Reward      float64     `json:"reward"`
	Done        bool        `json:"done"`
	Metadata    *Metadata   `json:"metadata,omitempty"`
}

// Observation is what a reset or an action showed. Text is text (invalid UTF-8 becomes U+FFFD),
// not base64. Fields that do not apply are left out.
type Observation struct {
	// Task is the env's task, at a reset.
	Task string `json:"task,omitempty"`
	// A command's (or the reset hook's) output and status.
	Stdout          *string `json:"stdout,omitempty"`
	Stderr          *string `json:"stderr,omitempty"`
	ExitCode        *int    `json:"exit_code,omitempty"`
	Signal          string  `json:"signal,omitempty"`
	TimedOut        bool    `json:"timed_out,omitempty"`
	OutputTruncated bool    `json:"output_truncated,omitempty"`
	Duration        float64 `json:"duration_s,omitempty"`
	// A read's content, and the file's size (also after a write); Truncated says the file
	// goes on past the content.
	Content   *string `json:"content,omitempty"`
	Size      *int64  `json:"size,omitempty"`
	Truncated bool    `json:"truncated,omitempty"`
	// Verdict is a submit's, Evaluation an evaluate's.
	Verdict    *Verdict `json:"verdict,omitempty"`
	Evaluation *Verdict `json:"evaluation,omitempty"`
	// Error is why the sandbox's state refused the action (a missing file, say), and its errno's
	// name; the episode goes on.
	Error string `json:"error,omitempty"`
	Errno string `json:"errno,omitempty"`
	// CheckpointID is the checkpoint the action took; RestoredTo the one it restored.
	CheckpointID string    `json:"checkpoint_id,omitempty"`
	RestoredTo   string    `json:"restored_to,omitempty"`
	Metadata     *Metadata `json:"metadata,omitempty"`
}

// Verdict is a verifier's reward with its parts.
type Verdict struct {
	Reward     float64            `json:"reward"`
	Components map[string]float64 `json:"components,omitempty"`
	Output     string             `json:"output,omitempty"`
}

// Metadata says where an observation was made. CheckpointID is the checkpoint the message took
// or started from (a reset's start, a step's checkpoint); StepIndex is the step's index on the
// episode's path, -1 for what is not a step; StepCount is the path's steps so far.
type Metadata struct {
	Env               string            `json:"env"`
	SandboxID         string            `json:"sandbox_id"`
	EpisodeID         string            `json:"episode_id"`
	CheckpointID      string            `json:"checkpoint_id,omitempty"`
	StartCheckpointID string            `json:"start_checkpoint_id,omitempty"`
	StepIndex         int               `json:"step_index"`
	StepCount         int               `json:"step_count"`
	Terminated        bool              `json:"terminated"`
	Truncated         bool              `json:"truncated"`
	TruncatedBy       string            `json:"truncated_by,omitempty"`
	Info              map[string]string `json:"info,omitempty"`
}

// State is the data of a state frame: OpenEnv's episode_id and step_count, and the session's
// sandbox.
type State struct {
	EpisodeID         string `json:"episode_id"`
	StepCount         int    `json:"step_count"`
	SandboxID         string `json:"sandbox_id"`
	Env               string `json:"env"`
	Done              bool   `json:"done"`
	StartCheckpointID string `json:"start_checkpoint_id,omitempty"`
}

// errSessionClosed is a call on a session that was closed.
var errSessionClosed = fmt.Errorf("the session is closed: %w", errdefs.ErrFailedPrecondition)
