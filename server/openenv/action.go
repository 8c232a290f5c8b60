package openenv

import (
	"bytes"
	"encoding/json"
	"fmt"
	"math"
	"strings"
	"time"

	"github.com/deltagym/deltagym/internal/errdefs"
	"github.com/deltagym/deltagym/server/episode"
)

// DefaultStepCap bounds a command's run so that its step answers inside the clients' 60 s wait
// for a message, with room for the output to travel.
const DefaultStepCap = 55 * time.Second

// Action is the one flat action object of the protocol. Command is required; it may be empty
// only when exactly one of WriteFile, ReadFile, Submit, Checkpoint, Restore and Evaluate is
// set. Checkpoint (after) and Restore (before) also go with a command, a write, a read or a
// submit; Evaluate goes alone.
type Action struct {
	Command   *string    `json:"command"`
	WriteFile *WriteFile `json:"write_file,omitempty"`
	ReadFile  *ReadFile  `json:"read_file,omitempty"`
	// Submit is true, or the answer as a string (in the verifier's environment as
	// DELTAGYM_ANSWER).
	Submit     json.RawMessage `json:"submit,omitempty"`
	Checkpoint bool            `json:"checkpoint,omitempty"`
	Restore    string          `json:"restore,omitempty"`
	// FreshEntropy gives the restored state a new seed.
	FreshEntropy bool `json:"fresh_entropy,omitempty"`
	Evaluate     bool `json:"evaluate,omitempty"`
	// Timeout bounds the command, in seconds, up to the handler's step cap (55 s by default: the
	// step answers inside the clients' 60 s).
	Timeout float64           `json:"timeout,omitempty"`
	Cwd     string            `json:"cwd,omitempty"`
	Env     map[string]string `json:"env,omitempty"`
	// Session runs the command in a persistent shell of that name (cd and exports persist).
	Session string `json:"session,omitempty"`
	// Metadata is OpenEnv's Action field; typed clients send it, and it is not used.
	Metadata map[string]any `json:"metadata,omitempty"`
}

// WriteFile writes text to a file of the sandbox.
type WriteFile struct {
	Path    string `json:"path"`
	Content string `json:"content"`
	Append  bool   `json:"append,omitempty"`
	// Mode is the permission bits of a created file, 0644 when 0.
	Mode uint32 `json:"mode,omitempty"`
}

// ReadFile reads a file of the sandbox: a path alone, or an object with an offset and a limit.
type ReadFile struct {
	Path     string `json:"path"`
	Offset   int64  `json:"offset,omitempty"`
	MaxBytes int64  `json:"max_bytes,omitempty"`
}

// UnmarshalJSON takes a path string or the object.
func (r *ReadFile) UnmarshalJSON(b []byte) error {
	if len(b) > 0 && b[0] == '"' {
		return json.Unmarshal(b, &r.Path)
	}
	type plain ReadFile
	dec := json.NewDecoder(bytes.NewReader(b))
	dec.DisallowUnknownFields()
	return dec.Decode((*plain)(r))
}

// invalid is an action or reset that the protocol refuses before anything runs.
func invalid(format string, args ...any) error {
	return fmt.Errorf("%s: %w", fmt.Sprintf(format, args...), errdefs.ErrInvalidArgument)
}

// decodeAction reads an action object, refusing unknown fields: a misspelt field would
// otherwise do nothing, silently.
func decodeAction(raw json.RawMessage) (Action, error) {
	var a Action
	if len(bytes.TrimSpace(raw)) == 0 || bytes.Equal(bytes.TrimSpace(raw), []byte("null")) {
		return a, invalid("the step has no action: send an object with a command (a shell string)")
	}
	dec := json.NewDecoder(bytes.NewReader(raw))
	dec.DisallowUnknownFields()
	if err := dec.Decode(&a); err != nil {
		return a, invalid("the action is not an action object (command, write_file, read_file, submit, checkpoint, restore, fresh_entropy, evaluate, timeout, cwd, env, session, metadata): %v", err)
	}
	return a, nil
}

// plan is what a validated action does: at most one of the episode's actions, with a restore
// before it and a checkpoint after it; or a checkpoint, a restore or an evaluation alone.
type plan struct {
	act          episode.Action // nil: no step
	checkpoint   bool
	restore      string
	freshEntropy bool
	evaluate     bool
}

// planOf validates a and says what it does.
func planOf(a Action, stepCap time.Duration) (plan, error) {
	p := plan{checkpoint: a.Checkpoint, restore: a.Restore, freshEntropy: a.FreshEntropy, evaluate: a.Evaluate}
	if a.Command == nil {
		return p, invalid("action.command is required: a shell string, empty when write_file, read_file, submit, checkpoint, restore or evaluate is set alone")
	}
	if a.FreshEntropy && a.Restore == "" {
		return p, invalid("action.fresh_entropy goes with action.restore")
	}
	submit, answer, err := submitOf(a)
	if err != nil {
		return p, err
	}
	var acts []episode.Action
	var names []string
	if cmd := *a.Command; cmd != "" {
		if strings.TrimSpace(cmd) == "submit" && !submit {
			acts, names = append(acts, episode.Submit{}), append(names, "command \"submit\"")
		} else {
			x, err := execOf(a, cmd, stepCap)
			if err != nil {
				return p, err
			}
			acts, names = append(acts, x), append(names, "command")
		}
	}
	if a.WriteFile != nil {
		acts, names = append(acts, episode.WriteFile{Path: a.WriteFile.Path, Content: []byte(a.WriteFile.Content),
			Mode: osMode(a.WriteFile.Mode), Append: a.WriteFile.Append}), append(names, "write_file")
	}
	if a.ReadFile != nil {
		acts, names = append(acts, episode.ReadFile{Path: a.ReadFile.Path, Offset: a.ReadFile.Offset, MaxBytes: a.ReadFile.MaxBytes}),
			append(names, "read_file")
	}
	if submit {
		acts, names = append(acts, episode.Submit{Answer: answer}), append(names, "submit")
	}
	if len(acts) > 1 {
		return p, invalid("the action does %s at once: one step does one of command, write_file, read_file and submit", strings.Join(names, " and "))
	}
	if len(acts) == 1 {
		p.act = acts[0]
		if a.Evaluate {
			return p, invalid("action.evaluate goes alone, with an empty command")
		}
		return p, nil
	}
	// No step: exactly one of checkpoint, restore and evaluate.
	n := 0
	for _, set := range []bool{a.Checkpoint, a.Restore != "", a.Evaluate} {
		if set {
			n++
		}
	}
	if n != 1 {
		return p, invalid("the action's command is empty: set exactly one of write_file, read_file, submit, checkpoint, restore and evaluate, or give a command")
	}
	return p, nil
}

// submitOf reads action.submit: absent, false, true, or the answer.
func submitOf(a Action) (bool, *string, error) {
	if len(a.Submit) == 0 || string(a.Submit) == "null" || string(a.Submit) == "false" {
		return false, nil, nil
	}
	if string(a.Submit) == "true" {
		return true, nil, nil
	}
	var answer string
	if err := json.Unmarshal(a.Submit, &answer); err != nil {
		return false, nil, invalid("action.submit is true or the answer as a string, not %.64s", a.Submit)
	}
	return true, &answer, nil
}

func execOf(a Action, cmd string, stepCap time.Duration) (episode.Exec, error) {
	if math.IsNaN(a.Timeout) || math.IsInf(a.Timeout, 0) || a.Timeout < 0 {
		return episode.Exec{}, invalid("action.timeout is a number of seconds, 0 or more (0: %v)", stepCap)
	}
	timeout := stepCap
	if a.Timeout > 0 && a.Timeout < stepCap.Seconds() {
		// A timeout shorter than a nanosecond is the shortest there is, not none.
		timeout = max(time.Duration(a.Timeout*float64(time.Second)), time.Nanosecond)
	}
	return episode.Exec{Command: cmd, Env: a.Env, Cwd: a.Cwd, Timeout: timeout, Session: a.Session}, nil
}
