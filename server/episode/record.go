package episode

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"maps"
	"slices"
	"strings"
	"time"

	"golang.org/x/sys/unix"
	"google.golang.org/protobuf/encoding/protojson"
	"google.golang.org/protobuf/proto"

	deltagymv1 "github.com/deltagym/deltagym/clients/go/gen/deltagym/v1"
	"github.com/deltagym/deltagym/internal/wiretext"
	"github.com/deltagym/deltagym/sandbox"
	"github.com/deltagym/deltagym/server/ledger"
)

// Recorder is what the core records in the ledger; *ledger.Writer is one. Its methods must not
// block on the database.
type Recorder interface {
	EpisodeStarted(ledger.EpisodeStart) error
	EpisodeEnded(ledger.EpisodeEnd) error
	Step(ledger.StepRow) error
	Reward(ledger.RewardRow) error
	Checkpoint(ledger.CheckpointRow) error
	CheckpointReleased(id string, at time.Time) error
	// CheckpointDigest records a checkpoint's state digest once computed; CheckpointEdge a
	// parent link of the checkpoint graph that a deduplicating checkpoint made.
	CheckpointDigest(id string, d ledger.Digest) error
	CheckpointEdge(ledger.CheckpointEdge) error
	// Stored waits until every row recorded before the call is stored where a crash of the
	// server does not lose it (ledger.Writer.Stored: the spool), without waiting for the
	// database.
	Stored(ctx context.Context) error
}

var _ Recorder = (*ledger.Writer)(nil)

func (c *Core) ledgerErr(err error) {
	if err != nil {
		c.log.Warn("recording to ledger", "err", err)
	}
}

// stored waits until the rows a call recorded are stored (Recorder.Stored), before the call
// answers: a client is never told of a step, checkpoint or episode whose row a crash of the
// server could still lose. err is the call's own error: a failed call waits too (the rows its
// failure implies, such as a failed episode's end, are stored before it answers) and returns
// err. A call that succeeded fails if its rows could not be stored (ledger.ErrSpoolWrite:
// unavailable); what it did stands, in the sandbox and in the episode, and its rows stay
// queued for the spool, so the episode and its ledger rows still agree.
func (c *Core) stored(ctx context.Context, err error) error {
	if c.rec == nil {
		return err
	}
	serr := c.rec.Stored(ctx)
	if err != nil {
		if ctx.Err() == nil || !errors.Is(serr, ctx.Err()) {
			c.ledgerErr(serr)
		}
		// Else the caller left (or its deadline passed) before the spool took the rows: they
		// stay queued and are stored as any others, so there is nothing to warn of.
		return err
	}
	return serr
}

// The ledger keeps an action as the API's JSON (protojson of deltagym.v1.Action) and an
// observation as the API's binary encoding (deltagym.v1.Observation), so that every front end's
// trajectories read back the same way (LedgerService.GetTrajectory).

// actionProto is a's API form.
func actionProto(a Action) *deltagymv1.Action {
	if p := treeActionProto(a); p != nil {
		return p
	}
	switch x := a.(type) {
	case Exec:
		e := &deltagymv1.ExecAction{Command: x.Command, Argv: x.Argv, Stdin: x.Stdin, Env: x.Env, Cwd: x.Cwd,
			TimeoutSeconds: x.Timeout.Seconds(), Background: x.Background, Session: x.Session}
		if it := x.Interact; it != nil {
			e.Interactive, e.Interrupt = true, it.Interrupt
			for _, re := range it.Expect {
				e.Expect = append(e.Expect, re.String())
			}
		}
		return &deltagymv1.Action{Kind: &deltagymv1.Action_Exec{Exec: e}}
	case WriteFile:
		return &deltagymv1.Action{Kind: &deltagymv1.Action_WriteFile{WriteFile: &deltagymv1.WriteFileAction{Path: x.Path,
			Content: x.Content, Mode: uint32(x.Mode), Append: x.Append}}}
	case ReadFile:
		return &deltagymv1.Action{Kind: &deltagymv1.Action_ReadFile{ReadFile: &deltagymv1.ReadFileAction{Path: x.Path,
			Offset: x.Offset, MaxBytes: x.MaxBytes}}}
	case Submit:
		return &deltagymv1.Action{Kind: &deltagymv1.Action_Submit{Submit: &deltagymv1.SubmitAction{Answer: x.Answer}}}
	case ListProcesses, Signal:
		return processActionProto(x)
	}
	return nil
}

// ObservationProto is o's API form (nil for a skipped step's).
func ObservationProto(o Observation) *deltagymv1.Observation {
	if p := treeObservationProto(o); p != nil && o.Error == nil {
		return p
	}
	switch {
	case o.Error != nil:
		e := o.Error
		return &deltagymv1.Observation{Error: &deltagymv1.ActionError{Errno: int32(e.Errno), ErrnoName: unix.ErrnoName(e.Errno), Message: e.Message}}
	case o.Exec != nil:
		return &deltagymv1.Observation{Kind: &deltagymv1.Observation_Exec{Exec: ExecResultProto(*o.Exec)}}
	case o.WriteFile != nil:
		return &deltagymv1.Observation{Kind: &deltagymv1.Observation_WriteFile{WriteFile: &deltagymv1.WriteFileResult{Size: o.WriteFile.Size}}}
	case o.ReadFile != nil:
		r := o.ReadFile
		return &deltagymv1.Observation{Kind: &deltagymv1.Observation_ReadFile{ReadFile: &deltagymv1.ReadFileResult{
			Content: r.Content, Size: r.Size, Truncated: r.Truncated}}}
	case o.Submit != nil:
		return &deltagymv1.Observation{Kind: &deltagymv1.Observation_Submit{Submit: &deltagymv1.SubmitResult{
			Components: o.Submit.Components, Output: o.Submit.Output}}}
	case o.ListProcesses != nil, o.Signal != nil:
		return processObservationProto(o)
	}
	return nil
}

// ExecResultProto is r's API form.
func ExecResultProto(r sandbox.ExecResult) *deltagymv1.ExecResult {
	return &deltagymv1.ExecResult{Stdout: r.Stdout, Stderr: r.Stderr, ExitCode: int32(r.ExitCode), Signal: signalNumber(r.Signal),
		TimedOut: r.TimedOut, StdoutTruncated: r.StdoutTruncated, StderrTruncated: r.StderrTruncated,
		DurationSeconds: r.Duration.Seconds(), Pid: int32(r.Pid), Matched: r.Matched, Running: r.Running}
}

// signalNumber converts a signal name ("SIGKILL") to its number (0 if none or unknown).
func signalNumber(name string) int32 {
	if name == "" {
		return 0
	}
	return int32(unix.SignalNum(name))
}

// ActionBytesCap is how much of an action's bulk — a write_file's content, an exec's stdin — the
// ledger keeps. A step's row is one value of a COPY to Postgres: a row holding the largest write
// (64 MiB, 90 MB as JSON) takes Postgres's COPY past its memory cap, and the ledger stalls behind it.
const ActionBytesCap = 64 << 10

// ActionCut is what a recorded action says of bulk it cut at ActionBytesCap: the JSON key "cut"
// beside the action's own (which protojson readers discard), with the whole bulk's size and
// SHA-256 (hex).
type ActionCut struct {
	SizeBytes int64  `json:"sizeBytes,string"`
	SHA256    string `json:"sha256"`
}

// recordedAction is a's JSON as the ledger keeps it: protojson of its API form, its bulk cut at
// ActionBytesCap and described under "cut".
func recordedAction(a Action) ([]byte, error) {
	p := actionProto(a)
	var bulk *[]byte
	switch k := p.GetKind().(type) {
	case *deltagymv1.Action_WriteFile:
		bulk = &k.WriteFile.Content
	case *deltagymv1.Action_Exec:
		bulk = &k.Exec.Stdin
	case *deltagymv1.Action_Upload:
		bulk = &k.Upload.Tar
	}
	if bulk == nil || len(*bulk) <= ActionBytesCap {
		return protojson.Marshal(p)
	}
	sum := sha256.Sum256(*bulk)
	cut := ActionCut{SizeBytes: int64(len(*bulk)), SHA256: hex.EncodeToString(sum[:])}
	*bulk = (*bulk)[:ActionBytesCap:ActionBytesCap] // p is this call's own: the step's bytes are not changed
	b, err := protojson.Marshal(p)
	if err != nil {
		return nil, err
	}
	fields := map[string]json.RawMessage{}
	if err := json.Unmarshal(b, &fields); err != nil {
		return nil, err
	}
	if fields["cut"], err = json.Marshal(cut); err != nil {
		return nil, err
	}
	return json.Marshal(fields)
}

// recordStep records step index (the episode's own count) of episode ep, req's, and a submit's reward
// (none for a submit the time budget skipped, whose verifier never ran).
func (c *Core) recordStep(ep string, index int, req *StepRequest, start time.Time, took time.Duration, res *StepResult, verr error) {
	action, err := recordedAction(req.Action)
	if err != nil { // recorded as JSON null, and said
		c.ledgerErr(fmt.Errorf("episode %s step %d: encoding the action: %w", ep, index, err))
	}
	obs := ObservationProto(res.Observation)
	obsBytes, err := proto.MarshalOptions{Deterministic: true}.Marshal(obs)
	if err != nil && wiretext.Message(obs) {
		// A name or command a sandbox chose that is not UTF-8: recorded as the API sends it.
		obsBytes, err = proto.MarshalOptions{Deterministic: true}.Marshal(obs)
	}
	if err != nil {
		c.ledgerErr(fmt.Errorf("episode %s step %d: encoding the observation: %w", ep, index, err))
	}
	sum := sha256.Sum256(obsBytes)
	size := int64(len(obsBytes))
	if len(obsBytes) > ObservationBulkCap {
		// The ledger keeps a prefix of a large observation: its bulk is cut here instead, so that
		// what is kept still decodes (an exit code, a duration), with the whole one's size and sum.
		cutBulk(obs)
		obsBytes, _ = proto.MarshalOptions{Deterministic: true}.Marshal(obs)
	}
	c.ledgerErr(c.rec.Step(ledger.StepRow{EpisodeID: ep, Index: index, Action: action, ActionValid: true, Observation: obsBytes,
		ObservationSize: size, ObservationSHA256: sum[:],
		Reward: res.Reward, Terminated: res.Terminated, Truncated: res.Truncated, StartedAt: start, Duration: took,
		CheckpointID: res.CheckpointID, Setup: req.Setup}))
	if sub := res.Observation.Submit; sub != nil && verr == nil { // a submit the verifier judged
		c.ledgerErr(c.rec.Reward(ledger.RewardRow{EpisodeID: ep, StepIndex: &index, Source: ledger.SourceVerifier,
			Components: sub.Components, Value: res.Reward}))
	}
}

// ObservationBulkCap is the size past which a recorded observation's bulk (a command's output, a
// file read) is cut, each part to a quarter of it: under the ledger's own cap on what it stores
// (64 KiB by default), with room for the rest of the message.
const ObservationBulkCap = 48 << 10

// cutBulk cuts the bulk of o, a recorded observation, to ObservationBulkCap/4 each.
func cutBulk(o *deltagymv1.Observation) {
	const part = ObservationBulkCap / 4
	cut := func(b []byte) []byte { return b[:min(len(b), part):min(len(b), part)] }
	switch k := o.GetKind().(type) {
	case *deltagymv1.Observation_Exec:
		k.Exec.Stdout, k.Exec.Stderr = cut(k.Exec.Stdout), cut(k.Exec.Stderr)
	case *deltagymv1.Observation_ReadFile:
		k.ReadFile.Content = cut(k.ReadFile.Content)
	case *deltagymv1.Observation_Download:
		k.Download.Tar = cut(k.Download.Tar)
	case *deltagymv1.Observation_ListDir:
		// The first entries, as many as fit in the bulk's share.
		size, n := 0, 0
		for _, e := range k.ListDir.Entries {
			if size += proto.Size(e) + 4; size > 3*part {
				break
			}
			n++
		}
		k.ListDir.Entries = k.ListDir.Entries[:n]
	case *deltagymv1.Observation_Submit:
		if len(k.Submit.Output) > part {
			k.Submit.Output = strings.ToValidUTF8(k.Submit.Output[:part], "")
		}
	}
	if e := o.GetError(); e != nil && len(e.Message) > part {
		e.Message = strings.ToValidUTF8(e.Message[:part], "")
	}
}

// sortedEnv is an exec's environment as KEY=value, sorted by key.
func sortedEnv(env map[string]string) []string {
	vars := make([]string, 0, len(env))
	for _, key := range slices.Sorted(maps.Keys(env)) {
		vars = append(vars, key+"="+env[key])
	}
	return vars
}
