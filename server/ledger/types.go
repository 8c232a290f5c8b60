package ledger

import (
	"bytes"
	"encoding/json"
	"fmt"
	"strings"
	"time"
	"unicode/utf8"

	"github.com/deltagym/deltagym/internal/wiretext"
)

// Status is an episode's state in the ledger.
type Status string

// Episode statuses.
const (
	StatusRunning    Status = "running"
	StatusTerminated Status = "terminated" // ended by the task (submit, verifier)
	StatusTruncated  Status = "truncated"  // ended by a budget
	StatusBranched   Status = "branched"   // ended by a restore into its sandbox
	StatusFailed     Status = "failed"     // ended by an error; see FailureClass
)

func (s Status) valid() bool {
	switch s {
	case StatusRunning, StatusTerminated, StatusTruncated, StatusBranched, StatusFailed:
		return true
	}
	return false
}

// FailureClass says whose fault a failed episode was.
type FailureClass string

// Failure classes; the empty class means no failure.
const (
	FailureNone     FailureClass = ""
	FailureInfra    FailureClass = "infra"
	FailureAgent    FailureClass = "agent"
	FailureVerifier FailureClass = "verifier"
)

func (f FailureClass) valid() bool {
	switch f {
	case FailureNone, FailureInfra, FailureAgent, FailureVerifier:
		return true
	}
	return false
}

// CheckpointKind says why a checkpoint was taken.
type CheckpointKind string

// Checkpoint kinds.
const (
	KindUser     CheckpointKind = "user"     // asked for by the client
	KindPool     CheckpointKind = "pool"     // an env's warm initial state
	KindTask     CheckpointKind = "task"     // a task's initial state after reset
	KindEvaluate CheckpointKind = "evaluate" // taken before running the verifier
)

func (k CheckpointKind) valid() bool {
	switch k {
	case KindUser, KindPool, KindTask, KindEvaluate:
		return true
	}
	return false
}

// Reward sources with a fixed meaning; any other non-empty string names a trainer's source.
const (
	SourceVerifier = "verifier"
	SourceTrainer  = "trainer"
)

// EpisodeStart records the start of an episode (a Reset, or a restore or fork from a checkpoint).
type EpisodeStart struct {
	ID              string    `json:"id"`
	Env             string    `json:"env"`
	Run             string    `json:"run,omitempty"`
	Group           string    `json:"group,omitempty"`
	Seed            int64     `json:"seed"`
	StartCheckpoint string    `json:"start_checkpoint,omitempty"` // the state it started from
	ParentEpisode   string    `json:"parent_episode,omitempty"`   // the episode it branched from
	Sandbox         string    `json:"sandbox,omitempty"`          // the sandbox it runs in
	StartedAt       time.Time `json:"started_at"`
}

// EpisodeEnd records how an episode ended.
type EpisodeEnd struct {
	ID           string       `json:"id"`
	Status       Status       `json:"status"`
	FailureClass FailureClass `json:"failure_class,omitempty"`
	// FailureMessage says why a failed episode failed.
	FailureMessage string    `json:"failure_message,omitempty"`
	TotalReward    float64   `json:"total_reward"`
	EndedAt        time.Time `json:"ended_at"`
}

// StepRow is one step of an episode. Index counts the episode's own steps from 0.
// Observation is stored capped (Config.ObservationCap); ObservationSize and ObservationSHA256
// describe the full observation and are filled in by Writer.Step.
type StepRow struct {
	EpisodeID         string          `json:"episode_id"`
	Index             int             `json:"index"`
	Action            json.RawMessage `json:"action"`
	Observation       []byte          `json:"observation"`
	ObservationSize   int64           `json:"observation_size"`
	ObservationSHA256 []byte          `json:"observation_sha256"`
	Reward            float64         `json:"reward"`
	Terminated        bool            `json:"terminated"`
	Truncated         bool            `json:"truncated"`
	StartedAt         time.Time       `json:"started_at"`
	Duration          time.Duration   `json:"duration_ns"`
	CheckpointID      string          `json:"checkpoint_id,omitempty"` // a checkpoint taken after the step
	// Setup marks a step that set the task up (the API's StepRequest.setup): numbered among the
	// episode's steps, counted against none of its env's budgets.
	Setup bool `json:"setup,omitempty"`
	// ActionValid says that Action is valid JSON already (protojson's output, as the server
	// records it), so Writer.Step does not check it again: the check costs about what making
	// it did (for a write_file of 4 KiB, its content base64 in the JSON).
	ActionValid bool `json:"-"`
}

// CheckpointRow records a checkpoint. StepIndex is the number of the episode's own steps taken
// when it was made (0: at the episode's start), so a branch from it inherits steps 0..StepIndex-1.
type CheckpointRow struct {
	ID         string         `json:"id"`
	ParentID   string         `json:"parent_id,omitempty"`
	Kind       CheckpointKind `json:"kind"`
	Env        string         `json:"env"`
	Sandbox    string         `json:"sandbox,omitempty"`
	EpisodeID  string         `json:"episode_id,omitempty"`
	StepIndex  int            `json:"step_index"`
	CreatedAt  time.Time      `json:"created_at"`
	ReleasedAt *time.Time     `json:"released_at,omitempty"` // read side only
}

// Digest is a checkpoint's state digest (sandbox.StateDigest): Files of its filesystem,
// Processes of its live processes ("" when it holds none).
type Digest struct {
	Files     string `json:"files"`
	Processes string `json:"processes,omitempty"`
}

// CheckpointEdge is a parent link of the checkpoint graph besides a checkpoint's own parent_id:
// a deduplicating checkpoint of a sandbox whose previous checkpoint was ParentID found the
// sandbox's state in ChildID, taken elsewhere. A zero CreatedAt means now.
type CheckpointEdge struct {
	ChildID   string    `json:"child_id"`
	ParentID  string    `json:"parent_id"`
	CreatedAt time.Time `json:"created_at"`
}

// RewardRow is one reward of an episode, from the verifier or a trainer.
type RewardRow struct {
	EpisodeID  string             `json:"episode_id"`
	StepIndex  *int               `json:"step_index,omitempty"` // nil: the episode as a whole
	Source     string             `json:"source"`
	Components map[string]float64 `json:"components,omitempty"`
	Value      float64            `json:"value"`
	CreatedAt  time.Time          `json:"created_at"`
}

func (r *EpisodeStart) validate() error {
	if r.ID == "" || r.Env == "" {
		return fmt.Errorf("episode start needs an id and an env: %w", ErrInvalid)
	}
	if len(r.ID) > MaxIDLen || len(r.StartCheckpoint) > MaxIDLen {
		return fmt.Errorf("episode start: id of %d bytes, start checkpoint of %d: over %d: %w", len(r.ID), len(r.StartCheckpoint), MaxIDLen, ErrInvalid)
	}
	return nil
}

func (r *EpisodeEnd) validate() error {
	if r.ID == "" {
		return fmt.Errorf("episode end needs an id: %w", ErrInvalid)
	}
	if !r.Status.valid() || r.Status == StatusRunning {
		return fmt.Errorf("episode %s: end status %q: %w", r.ID, r.Status, ErrInvalid)
	}
	if !r.FailureClass.valid() {
		return fmt.Errorf("episode %s: failure class %q: %w", r.ID, r.FailureClass, ErrInvalid)
	}
	return nil
}

func (r *CheckpointRow) validate() error {
	if r.ID == "" || r.Env == "" {
		return fmt.Errorf("checkpoint needs an id and an env: %w", ErrInvalid)
	}
	if len(r.ID) > MaxIDLen {
		return fmt.Errorf("checkpoint id of %d bytes: over %d: %w", len(r.ID), MaxIDLen, ErrInvalid)
	}
	if !r.Kind.valid() {
		return fmt.Errorf("checkpoint %s: kind %q: %w", r.ID, r.Kind, ErrInvalid)
	}
	return nil
}

func (r *CheckpointEdge) validate() error {
	if r.ChildID == "" || r.ParentID == "" {
		return fmt.Errorf("checkpoint edge needs a child and a parent: %w", ErrInvalid)
	}
	if len(r.ChildID) > MaxIDLen || len(r.ParentID) > MaxIDLen {
		return fmt.Errorf("checkpoint edge: ids of %d and %d bytes: over %d: %w", len(r.ChildID), len(r.ParentID), MaxIDLen, ErrInvalid)
	}
	if r.ChildID == r.ParentID {
		return fmt.Errorf("checkpoint edge from %s to itself: %w", r.ChildID, ErrInvalid)
	}
	return nil
}

func (d *Digest) validate(id string) error {
	if id == "" || d.Files == "" {
		return fmt.Errorf("checkpoint digest needs an id and a files digest: %w", ErrInvalid)
	}
	if len(id) > MaxIDLen || len(d.Files) > MaxIDLen || len(d.Processes) > MaxIDLen {
		return fmt.Errorf("checkpoint digest of %s: over %d bytes: %w", id, MaxIDLen, ErrInvalid)
	}
	return nil
}

func (r *RewardRow) validate() error {
	if r.EpisodeID == "" || r.Source == "" {
		return fmt.Errorf("reward needs an episode id and a source: %w", ErrInvalid)
	}
	return nil
}

// text is s as a text column takes it: a Postgres text value is UTF-8 without NUL, and Postgres
// refuses a row that holds one (the writer then sets the row aside: Stats.Dropped). Each byte
// that is not UTF-8 (wiretext's rule) and each NUL becomes U+FFFD, so that what a sandbox
// wrote is stored, lossily, instead of refused.
func text(s string) string {
	return strings.ReplaceAll(wiretext.String(s), "\x00", wiretext.Replacement)
}

// checkText refuses (ErrInvalid) a value a caller hands the ledger to store or to look up that
// no text column holds: one that is not UTF-8, or holds NUL. field names it as the API does.
func checkText(field, v string) error {
	if strings.IndexByte(v, 0) >= 0 || !utf8.ValidString(v) {
		return fmt.Errorf("%s %.64q is not UTF-8 text without NUL, which the ledger cannot hold: %w", field, v, ErrInvalid)
	}
	return nil
}

// jsonbText is b, JSON text, as a jsonb value takes it. jsonb holds no U+0000 and no surrogate
// outside a pair, which JSON may write as escapes (\u0000, \ud800) and Postgres refuses with
// the row that holds them; each such escape becomes \ufffd, U+FFFD, as text does with NUL. It
// returns b itself when b holds none, having looked only at b's backslashes: JSON escapes
// nothing but in strings, and a write_file's content, base64 in the action, holds none.
func jsonbText(b []byte) []byte {
	var out []byte
	last := 0
	for i := 0; i < len(b); {
		k := bytes.IndexByte(b[i:], '\\')
		if k < 0 {
			break
		}
		i += k
		if i+6 > len(b) || b[i+1] != 'u' {
			i += 2 // another escape, such as \" or \\: the character after the backslash is its own
			continue
		}
		r, n := hex4(b[i+2:i+6]), 6
		bad := r == 0 || (r >= 0xdc00 && r < 0xe000)
		if r >= 0xd800 && r < 0xdc00 { // a high surrogate, whose low one must follow
			if i+12 <= len(b) && b[i+6] == '\\' && b[i+7] == 'u' {
				if lo := hex4(b[i+8 : i+12]); lo >= 0xdc00 && lo < 0xe000 {
					n = 12
				} else {
					bad = true
				}
			} else {
				bad = true
			}
		}
		if bad {
			out = append(append(out, b[last:i]...), `\ufffd`...)
			last = i + 6
			n = 6
		}
		i += n
	}
	if out == nil {
		return b
	}
	return append(out, b[last:]...)
}

// hex4 is the value of four hex digits, or -1.
func hex4(h []byte) int {
	v := 0
	for _, c := range h {
		switch {
		case c >= '0' && c <= '9':
			v = v<<4 | int(c-'0')
		case c >= 'a' && c <= 'f':
			v = v<<4 | int(c-'a'+10)
		case c >= 'A' && c <= 'F':
			v = v<<4 | int(c-'A'+10)
		default:
			return -1
		}
	}
	return v
}
