package server

import (
	"fmt"
	"math"
	"os"
	"regexp"
	"strconv"
	"time"

	"google.golang.org/protobuf/types/known/timestamppb"

	deltagymv1 "github.com/deltagym/deltagym/clients/go/gen/deltagym/v1"
	"github.com/deltagym/deltagym/sandbox"
	"github.com/deltagym/deltagym/server/episode"
)

// The mapping between EnvService's messages and the episode core's domain types.

func resetRequest(m *deltagymv1.ResetRequest) episode.ResetRequest {
	r := episode.ResetRequest{Env: m.GetEnv(), Options: m.GetOptions(), Run: m.GetRun(), Group: m.GetGroupId(),
		IdempotencyKey: m.GetIdempotencyKey(), LeaseTTL: leaseTTL(m.GetLeaseTtlSeconds())}
	if m.Seed != nil {
		seed := m.GetSeed()
		r.Seed = &seed
	}
	return r
}

func resetResponse(r episode.ResetResult) *deltagymv1.ResetResponse {
	obs := &deltagymv1.ResetResult{Task: r.Task}
	info := map[string]string{"env": r.Env}
	if r.Hook != nil {
		obs.Hook = episode.ExecResultProto(*r.Hook)
		info["task_cached"] = strconv.FormatBool(r.TaskCached)
	}
	info["server_seconds"] = strconv.FormatFloat(r.Took.Seconds(), 'g', 6, 64)
	return &deltagymv1.ResetResponse{SandboxId: r.SandboxID, EpisodeId: r.EpisodeID, CheckpointId: r.CheckpointID,
		Observation: &deltagymv1.Observation{Kind: &deltagymv1.Observation_Reset_{Reset_: obs}}, Info: info,
		LeaseExpireTime: timestamppb.New(r.LeaseExpires)}
}

func stepRequest(m *deltagymv1.StepRequest) episode.StepRequest {
	return episode.StepRequest{SandboxID: m.GetSandboxId(), Action: action(m.GetAction()), Checkpoint: m.GetCheckpoint(),
		RestoreCheckpointID: m.GetRestoreCheckpointId(), RestoreFreshEntropy: m.GetRestoreFreshEntropy(), Setup: m.GetSetup(),
		CheckpointWaitDigest: m.GetCheckpointWaitForDigest(), CheckpointDedupe: m.GetCheckpointDedupe()}
}

// action is a's domain form; nil (which the core refuses) for an action of no kind.
func action(a *deltagymv1.Action) episode.Action {
	switch k := a.GetKind().(type) {
	case *deltagymv1.Action_Exec:
		return execAction(k.Exec)
	case *deltagymv1.Action_WriteFile:
		w := k.WriteFile
		return episode.WriteFile{Path: w.GetPath(), Content: w.GetContent(), Mode: os.FileMode(w.GetMode()), Append: w.GetAppend()}
	case *deltagymv1.Action_ReadFile:
		r := k.ReadFile
		return episode.ReadFile{Path: r.GetPath(), Offset: r.GetOffset(), MaxBytes: r.GetMaxBytes()}
	case *deltagymv1.Action_Submit:
		return episode.Submit{Answer: k.Submit.Answer}
	case *deltagymv1.Action_ListProcesses:
		return episode.ListProcesses{}
	case *deltagymv1.Action_Signal:
		x := k.Signal
		return episode.Signal{Pid: int(x.GetPid()), Signal: int(x.GetSignal()), Group: x.GetProcessGroup()}
	}
	return treeAction(a)
}

// treeAction is a's domain form for a tree action; nil for another kind.
func treeAction(a *deltagymv1.Action) episode.Action {
	switch k := a.GetKind().(type) {
	case *deltagymv1.Action_ListDir:
		return episode.ListDir{Path: k.ListDir.GetPath(), Depth: int(k.ListDir.GetDepth()), MaxEntries: int(k.ListDir.GetMaxEntries())}
	case *deltagymv1.Action_Stat:
		return episode.Stat{Path: k.Stat.GetPath()}
	case *deltagymv1.Action_Remove:
		return episode.Remove{Path: k.Remove.GetPath(), Recursive: k.Remove.GetRecursive()}
	case *deltagymv1.Action_MakeDir:
		return episode.MakeDir{Path: k.MakeDir.GetPath(), Mode: episode.FileMode(k.MakeDir.GetMode()), Parents: k.MakeDir.GetParents()}
	case *deltagymv1.Action_Upload:
		return episode.Upload{Path: k.Upload.GetPath(), Tar: k.Upload.GetTar()}
	case *deltagymv1.Action_Download:
		return episode.Download{Path: k.Download.GetPath(), MaxBytes: k.Download.GetMaxBytes()}
	}
	return nil
}

// execAction is x's domain form; an interactive one's patterns that cannot be compiled, or
// flags that do not go together, make it episode.Refused.
func execAction(x *deltagymv1.ExecAction) episode.Action {
	e := episode.Exec{Command: x.GetCommand(), Argv: x.GetArgv(), Stdin: x.GetStdin(), Env: x.GetEnv(), Cwd: x.GetCwd(),
		Timeout: seconds(x.GetTimeoutSeconds()), Background: x.GetBackground(), Session: x.GetSession()}
	switch {
	case !x.GetInteractive() && (len(x.GetExpect()) > 0 || x.GetInterrupt()):
		return episode.Refused{Err: fmt.Errorf("exec: expect and interrupt are for an interactive exec (set interactive): %w", ErrInvalid)}
	case !x.GetInteractive():
		return e
	case x.GetInterrupt() && (x.GetCommand() != "" || len(x.GetArgv()) > 0):
		return episode.Refused{Err: fmt.Errorf("exec: an interrupt sends Ctrl-C, not a command: leave command empty: %w", ErrInvalid)}
	}
	expect, err := expectPatterns(x.GetExpect())
	if err != nil {
		return episode.Refused{Err: err}
	}
	e.Interact = &sandbox.Interact{Expect: expect, Interrupt: x.GetInterrupt()}
	return e
}

// expectPatterns compiles an interactive exec's expect patterns, their count and lengths
// checked against sandbox.Interact's bounds before any is compiled (validate checks the rest).
func expectPatterns(expect []string) ([]*regexp.Regexp, error) {
	if len(expect) > sandbox.MaxExpect {
		return nil, fmt.Errorf("exec: %d expect patterns, more than %d: %w", len(expect), sandbox.MaxExpect, ErrInvalid)
	}
	for i, e := range expect {
		if len(e) > sandbox.MaxExpectBytes {
			return nil, fmt.Errorf("exec: expect pattern %d is %d bytes long, more than %d: %w", i, len(e), sandbox.MaxExpectBytes, ErrInvalid)
		}
	}
	out := make([]*regexp.Regexp, len(expect))
	for i, e := range expect {
		re, err := regexp.Compile(e)
		if err != nil {
			return nil, fmt.Errorf("exec: expect pattern %d is not a regular expression (RE2 syntax): %v: %w", i, err, ErrInvalid)
		}
		out[i] = re
	}
	return out, nil
}

// seconds converts a number of seconds from the wire, saturating where a Duration ends. NaN
// and the infinities, which no timeout means, become negative, which the core refuses.
func seconds(s float64) time.Duration {
	if math.IsNaN(s) || math.IsInf(s, 0) {
		return -1
	}
	switch d := s * float64(time.Second); {
	case d >= math.MaxInt64:
		return math.MaxInt64
	case d <= math.MinInt64:
		return math.MinInt64
	default:
		return time.Duration(d)
	}
}

// leaseTTL converts a lease_ttl_seconds from the wire: negative, NaN and the infinities
// become negative, which the core refuses, and a positive TTL under a nanosecond stays
// positive (zero means the default).
func leaseTTL(s float64) time.Duration {
	switch {
	case s < 0 || math.IsNaN(s) || math.IsInf(s, 0):
		return -1
	case s > 0:
		return max(seconds(s), 1)
	}
	return 0
}

func stepResponse(r episode.StepResult) *deltagymv1.StepResponse {
	return &deltagymv1.StepResponse{EpisodeId: r.EpisodeID, StepIndex: int32(r.StepIndex), Observation: episode.ObservationProto(r.Observation),
		Reward: r.Reward, Terminated: r.Terminated, Truncated: r.Truncated, CheckpointId: r.CheckpointID, Info: r.Info,
		StepsLeft: int32(r.StepsLeft), CheckpointDigest: digestProto(r.CheckpointDigest), CheckpointDeduplicated: r.CheckpointDeduplicated}
}

// digestProto is d's API form; nil for no digest.
func digestProto(d sandbox.StateDigest) *deltagymv1.StateDigest {
	if d.IsZero() {
		return nil
	}
	return &deltagymv1.StateDigest{Files: d.Files, Processes: d.Processes}
}

// processMode is a request's process mode. A value the API does not define (a number sent
// over JSON, or by a newer client) is ErrInvalid, not the default.
func processMode(asked deltagymv1.ProcessMode) (sandbox.ProcessMode, error) {
	if m, ok := episode.ProcessModeOf(asked); ok {
		return m, nil
	}
	return sandbox.ProcessesDefault, fmt.Errorf("process_mode %d is not one of PROCESS_MODE_FILESYSTEM, PROCESS_MODE_TEMPLATE or PROCESS_MODE_CRIU: %w", asked, ErrInvalid)
}

// checkpointResponse is r's API form; scrub takes the server's host paths
// out of the reasons (criu's messages name its logs).
func checkpointResponse(r episode.CheckpointResult, scrub func(string) string) *deltagymv1.CheckpointResponse {
	info := r.Info
	resp := &deltagymv1.CheckpointResponse{CheckpointId: info.ID, ParentId: r.Parent, Depth: int32(info.Depth), Durable: r.Durable,
		Digest: digestProto(r.Digest), Deduplicated: r.Deduplicated}
	for _, p := range info.Processes {
		m := deltagymv1.CaptureMethod_CAPTURE_METHOD_TEMPLATE
		if p.Method == sandbox.CaptureCRIU {
			m = deltagymv1.CaptureMethod_CAPTURE_METHOD_CRIU
		}
		pc := &deltagymv1.ProcessCapture{Pid: int32(p.Pid), Command: p.Command, Method: m, Reason: scrub(p.Reason), Saved: p.Saved, UnsavedReason: scrub(p.Unsaved)}
		if !p.Saved && p.Unsaved == "" {
			pc.UnsavedReason = "kept only as a frozen copy in its sandbox: a checkpoint taken durable saves it as a CRIU image"
		}
		resp.Processes = append(resp.Processes, pc)
	}
	return resp
}

func forkRequest(m *deltagymv1.ForkRequest) episode.ForkRequest {
	return episode.ForkRequest{CheckpointID: m.GetCheckpointId(), SandboxID: m.GetSandboxId(), N: int(m.GetN()), Run: m.GetRun(),
		Group: m.GetGroupId(), FreshEntropy: m.GetFreshEntropy(), IdempotencyKey: m.GetIdempotencyKey(),
		LeaseTTL: leaseTTL(m.GetLeaseTtlSeconds())}
}

var captureMethods = map[episode.Capture]deltagymv1.CaptureMethod{
	episode.CaptureTemplate: deltagymv1.CaptureMethod_CAPTURE_METHOD_TEMPLATE,
	episode.CaptureCRIU:     deltagymv1.CaptureMethod_CAPTURE_METHOD_CRIU,
	episode.CaptureNone:     deltagymv1.CaptureMethod_CAPTURE_METHOD_NONE,
}

// forkResponse is r's API form; scrub takes the server's host paths out of
// the reasons.
func forkResponse(r episode.ForkResult, scrub func(string) string) *deltagymv1.ForkResponse {
	resp := &deltagymv1.ForkResponse{CheckpointId: r.CheckpointID}
	for _, p := range r.Processes {
		resp.Processes = append(resp.Processes, &deltagymv1.ProcessCapture{Pid: int32(p.Pid), Command: p.Command,
			Method: captureMethods[p.Method], Reason: scrub(p.Reason)})
	}
	for _, ch := range r.Children {
		resp.SandboxIds = append(resp.SandboxIds, ch.SandboxID)
		resp.EpisodeIds = append(resp.EpisodeIds, ch.EpisodeID)
	}
	return resp
}

func sandboxProto(d episode.SandboxInfo) *deltagymv1.Sandbox {
	state := deltagymv1.SandboxState_SANDBOX_STATE_READY
	if d.Done {
		state = deltagymv1.SandboxState_SANDBOX_STATE_DONE
	}
	return &deltagymv1.Sandbox{SandboxId: d.SandboxID, Env: d.Env, EpisodeId: d.EpisodeID, Run: d.Run, GroupId: d.Group, State: state,
		NextStepIndex: int32(d.NextStepIndex), StartCheckpointId: d.StartCheckpoint, LeaseExpireTime: timestamppb.New(d.LeaseExpires),
		CreateTime: timestamppb.New(d.Created)}
}

// checkpointSummaryProto is d's API form.
func checkpointSummaryProto(d episode.CheckpointDesc) *deltagymv1.CheckpointSummary {
	i, p, h := d.Info, d.Place, d.Info.Hold
	out := &deltagymv1.CheckpointSummary{CheckpointId: i.ID, ParentId: i.Parent, Env: p.Env, EpisodeId: p.Episode, Run: p.Run,
		GroupId: p.Group, StepIndex: int32(p.Steps), CreateTime: timestamppb.New(i.Created), SizeBytes: i.SizeBytes,
		Depth: int32(i.Depth), Processes: int32(len(i.Processes)), Pinned: h.Pinned, LiveDescendants: int32(h.Heads), Digest: digestProto(d.Digest)}
	if !h.LastUsed.IsZero() {
		out.LastUsedTime = timestamppb.New(h.LastUsed)
	}
	if !h.Expires.IsZero() {
		out.ExpireTime = timestamppb.New(h.Expires)
	}
	return out
}

// diffDetail is a DiffCheckpoints request's detail; one the API does not define is ErrInvalid.
func diffDetail(d deltagymv1.DiffDetail) (sandbox.DiffDetail, error) {
	switch d {
	case deltagymv1.DiffDetail_DIFF_DETAIL_UNSPECIFIED, deltagymv1.DiffDetail_DIFF_DETAIL_PATHS:
		return sandbox.DiffPaths, nil
	case deltagymv1.DiffDetail_DIFF_DETAIL_LINES:
		return sandbox.DiffLines, nil
	case deltagymv1.DiffDetail_DIFF_DETAIL_UNIFIED:
		return sandbox.DiffUnified, nil
	}
	return 0, fmt.Errorf("detail %d is not one of DIFF_DETAIL_PATHS, DIFF_DETAIL_LINES or DIFF_DETAIL_UNIFIED: %w", d, ErrInvalid)
}

var changeKinds = map[sandbox.ChangeKind]deltagymv1.ChangeKind{
	sandbox.ChangeAdded:    deltagymv1.ChangeKind_CHANGE_KIND_ADDED,
	sandbox.ChangeRemoved:  deltagymv1.ChangeKind_CHANGE_KIND_REMOVED,
	sandbox.ChangeModified: deltagymv1.ChangeKind_CHANGE_KIND_MODIFIED,
}

// diffResponse is d's API form.
func diffResponse(d sandbox.Diff) *deltagymv1.DiffCheckpointsResponse {
	resp := &deltagymv1.DiffCheckpointsResponse{Truncated: d.Truncated, DetailsTruncated: d.DetailsTruncated, BaseDigest: digestProto(d.Base), Digest: digestProto(d.Target),
		Paths: make([]*deltagymv1.PathChange, 0, len(d.Paths))}
	for _, p := range d.Paths {
		resp.Paths = append(resp.Paths, &deltagymv1.PathChange{Path: p.Path, Kind: changeKinds[p.Kind], OldType: episode.FileTypeProto(p.OldType),
			NewType: episode.FileTypeProto(p.NewType), OldSize: p.OldSize, NewSize: p.NewSize, OldMode: p.OldMode, NewMode: p.NewMode,
			MetadataOnly: p.MetadataOnly, Binary: p.Binary, LinesAdded: int32(p.LinesAdded), LinesRemoved: int32(p.LinesRemoved),
			UnifiedDiff: p.Unified})
	}
	for _, p := range d.Processes {
		resp.Processes = append(resp.Processes, &deltagymv1.ProcessChange{Kind: changeKinds[p.Kind], Pid: int32(p.Pid), Command: p.Command,
			Details: p.Details})
	}
	return resp
}
