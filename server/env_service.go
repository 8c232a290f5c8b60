package server

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"maps"
	"os"
	"slices"
	"sort"
	"strconv"
	"time"

	"connectrpc.com/connect"
	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/trace"
	"google.golang.org/protobuf/encoding/protojson"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/known/timestamppb"

	"github.com/deltagym/deltagym/envpool"
	deltagymv1 "github.com/deltagym/deltagym/clients/go/gen/deltagym/v1"
	"github.com/deltagym/deltagym/clients/go/gen/deltagym/v1/deltagymv1connect"
	"github.com/deltagym/deltagym/sandbox"
	"github.com/deltagym/deltagym/server/ledger"
)

// maxFork bounds one Fork's n.
const maxFork = 1024

type envService struct{ s *Server }

var _ deltagymv1connect.EnvServiceHandler = (*envService)(nil)

func (e *envService) envInfo(env *envpool.Env) *deltagymv1.EnvInfo {
	return &deltagymv1.EnvInfo{Spec: env.Spec(), WarmCount: int32(env.Warm()), ActiveCount: int32(e.s.pools.Active(env.Name()))}
}

func (e *envService) ListEnvs(ctx context.Context, req *connect.Request[deltagymv1.ListEnvsRequest]) (*connect.Response[deltagymv1.ListEnvsResponse], error) {
	resp := &deltagymv1.ListEnvsResponse{}
	for _, env := range e.s.pools.Envs() {
		resp.Envs = append(resp.Envs, e.envInfo(env))
	}
	return connect.NewResponse(resp), nil
}

func (e *envService) RegisterEnv(ctx context.Context, req *connect.Request[deltagymv1.RegisterEnvRequest]) (*connect.Response[deltagymv1.RegisterEnvResponse], error) {
	env, err := e.s.registerEnv(req.Msg.GetSpec(), req.Msg.GetReplace())
	if err != nil {
		return nil, e.s.toConnect(err)
	}
	e.s.log.Info("env registered", "env", env.Name(), "replace", req.Msg.GetReplace())
	return connect.NewResponse(&deltagymv1.RegisterEnvResponse{Env: e.envInfo(env)}), nil
}

func (e *envService) ImportImage(ctx context.Context, req *connect.Request[deltagymv1.ImportImageRequest]) (*connect.Response[deltagymv1.ImportImageResponse], error) {
	m := req.Msg
	if m.GetName() == "" || m.GetPath() == "" {
		return nil, e.s.toConnect(fmt.Errorf("import needs a name and a path: %w", ErrInvalid))
	}
	if m.GetReference() != "" {
		return nil, e.s.toConnect(fmt.Errorf("picking an image by reference is not supported yet; import a layout or archive holding one image: %w", ErrInvalid))
	}
	src, err := e.s.imports.open(m.GetPath())
	if err != nil {
		return nil, e.s.toConnect(err)
	}
	defer src.Close()
	st, err := src.Stat()
	if err != nil {
		return nil, e.s.toConnect(fmt.Errorf("reading image path %q: %w", m.GetPath(), err))
	}
	switch m.GetFormat() {
	case deltagymv1.ImageFormat_IMAGE_FORMAT_DOCKER_ARCHIVE:
		if !st.Mode().IsRegular() {
			return nil, e.s.toConnect(fmt.Errorf("%q is not a docker save tarball (a regular file): %w", m.GetPath(), ErrInvalid))
		}
	case deltagymv1.ImageFormat_IMAGE_FORMAT_OCI_LAYOUT, deltagymv1.ImageFormat_IMAGE_FORMAT_ROOTFS_DIR:
		if !st.IsDir() {
			return nil, e.s.toConnect(fmt.Errorf("%q is not a directory: %w", m.GetPath(), ErrInvalid))
		}
	}
	if !st.IsDir() && !st.Mode().IsRegular() {
		return nil, e.s.toConnect(fmt.Errorf("%q is neither a directory nor a regular file: %w", m.GetPath(), ErrInvalid))
	}
	ctx, done := e.s.obs.op(ctx, "import_image")
	info, err := e.s.rt.ImportImage(ctx, m.GetName(), fdPath(src), e.s.imports.options()...)
	done(err)
	if err != nil {
		return nil, e.s.toConnect(renamedError{err: err, old: fdPath(src), new: m.GetPath()})
	}
	e.s.pools.ImageImported(info.Name)
	return connect.NewResponse(&deltagymv1.ImportImageResponse{Name: info.Name, Digest: info.Digest, LayerCount: int32(info.Layers)}), nil
}

func (e *envService) Reset(ctx context.Context, req *connect.Request[deltagymv1.ResetRequest]) (*connect.Response[deltagymv1.ResetResponse], error) {
	resp, err := e.s.idem.do(ctx, "reset", req.Msg.GetIdempotencyKey(), req.Msg, func() (proto.Message, error) {
		return e.reset(ctx, req.Msg)
	})
	if err != nil {
		return nil, e.s.toConnect(err)
	}
	return connect.NewResponse(resp.(*deltagymv1.ResetResponse)), nil
}

func (e *envService) reset(ctx context.Context, m *deltagymv1.ResetRequest) (*deltagymv1.ResetResponse, error) {
	if m.GetEnv() == "" {
		return nil, fmt.Errorf("reset needs an env: %w", ErrInvalid)
	}
	env, err := e.s.pools.Env(m.GetEnv())
	if err != nil {
		return nil, err
	}
	start := time.Now()
	span := trace.SpanFromContext(ctx) // the RPC's
	ctx, done := e.s.obs.op(ctx, "reset")
	l, res, err := e.s.pools.Reset(ctx, env, envpool.ResetParams{Seed: seedOf(m), Options: m.GetOptions()})
	done(err)
	if err != nil {
		return nil, err
	}
	from, _ := e.s.ckpts.Load(res.Checkpoint)
	meta, _ := from.(ckptMeta)
	sess := e.s.startEpisode(l, m.GetRun(), m.GetGroupId(), seedOf(m), res.Checkpoint, ckptMeta{global: meta.global})
	obs := &deltagymv1.ResetResult{Task: env.Task()}
	info := map[string]string{"env": env.Name()}
	if res.Hook != nil {
		obs.Hook = execResult(*res.Hook)
		info["task_cached"] = strconv.FormatBool(res.Cached)
	}
	info["server_seconds"] = strconv.FormatFloat(time.Since(start).Seconds(), 'g', 6, 64)
	span.SetAttributes(attribute.String("deltagym.env", env.Name()), attribute.String("deltagym.sandbox_id", l.ID()),
		attribute.String("deltagym.episode_id", sess.episode), attribute.String("deltagym.checkpoint_id", res.Checkpoint),
		attribute.Bool("deltagym.task_cached", res.Cached))
	return &deltagymv1.ResetResponse{SandboxId: l.ID(), EpisodeId: sess.episode, CheckpointId: res.Checkpoint,
		Observation: &deltagymv1.Observation{Kind: &deltagymv1.Observation_Reset_{Reset_: obs}}, Info: info,
		LeaseExpireTime: timestamppb.New(l.Expires())}, nil
}

func seedOf(m *deltagymv1.ResetRequest) *int64 {
	if m.Seed == nil {
		return nil
	}
	v := m.GetSeed()
	return &v
}

// lease finds a live, handed-over sandbox.
func (s *Server) lease(id string) (*envpool.Lease, *session, error) {
	if id == "" {
		return nil, nil, fmt.Errorf("sandbox_id is required: %w", ErrInvalid)
	}
	l, err := s.pools.Lease(id)
	if err != nil {
		if _, ok := s.closed.Load(id); ok {
			return nil, nil, fmt.Errorf("sandbox %s: %w", id, envpool.ErrLeaseEnded)
		}
		if s.ended[id] {
			return nil, nil, fmt.Errorf("sandbox %s ended with the server's previous run (its episode failed, class infra); Reset for a new one: %w",
				id, envpool.ErrUnknownSandbox)
		}
		return nil, nil, err
	}
	sess := sessionOf(l)
	if sess == nil {
		return nil, nil, fmt.Errorf("sandbox %q: %w", id, envpool.ErrUnknownSandbox)
	}
	return l, sess, nil
}

// callErr turns an error of a call begun on l into ErrAborted when Restore or Close aborted it.
func callErr(ctx context.Context, err error) error {
	if err != nil && envpool.Aborted(ctx) {
		return fmt.Errorf("%w: %w", envpool.ErrAborted, err)
	}
	return err
}

func (e *envService) Step(ctx context.Context, req *connect.Request[deltagymv1.StepRequest]) (*connect.Response[deltagymv1.StepResponse], error) {
	span := trace.SpanFromContext(ctx)
	span.SetAttributes(attribute.String("deltagym.sandbox_id", req.Msg.GetSandboxId()), attribute.String("deltagym.action", actionKind(req.Msg.GetAction())))
	resp, err := e.s.step(ctx, req.Msg)
	if err != nil {
		return nil, e.s.toConnect(err)
	}
	span.SetAttributes(attribute.String("deltagym.episode_id", resp.GetEpisodeId()), attribute.Int("deltagym.step_index", int(resp.GetStepIndex())),
		attribute.Bool("deltagym.terminated", resp.GetTerminated()), attribute.Bool("deltagym.truncated", resp.GetTruncated()))
	return connect.NewResponse(resp), nil
}

func validateAction(a *deltagymv1.Action) error {
	switch k := a.GetKind().(type) {
	case *deltagymv1.Action_Exec:
		x := k.Exec
		if (x.GetCommand() == "") == (len(x.GetArgv()) == 0) {
			return fmt.Errorf("exec needs exactly one of command and argv: %w", ErrInvalid)
		}
		if x.GetSession() != "" && len(x.GetArgv()) > 0 {
			return fmt.Errorf("exec with a session takes a command, not argv: %w", ErrInvalid)
		}
		if x.GetTimeoutSeconds() < 0 {
			return fmt.Errorf("exec timeout_seconds %v is negative: %w", x.GetTimeoutSeconds(), ErrInvalid)
		}
	case *deltagymv1.Action_WriteFile:
		if k.WriteFile.GetPath() == "" {
			return fmt.Errorf("write_file needs a path: %w", ErrInvalid)
		}
		if k.WriteFile.GetMode() > 0o7777 {
			return fmt.Errorf("write_file mode %o has bits beyond 07777: %w", k.WriteFile.GetMode(), ErrInvalid)
		}
	case *deltagymv1.Action_ReadFile:
		if k.ReadFile.GetPath() == "" {
			return fmt.Errorf("read_file needs a path: %w", ErrInvalid)
		}
		if k.ReadFile.GetOffset() < 0 || k.ReadFile.GetMaxBytes() < 0 {
			return fmt.Errorf("read_file offset and max_bytes must not be negative: %w", ErrInvalid)
		}
	case *deltagymv1.Action_Submit:
	default:
		return fmt.Errorf("action has no kind set (exec, write_file, read_file or submit; in JSON exec, writeFile, readFile or submit, other names are ignored): %w", ErrInvalid)
	}
	return nil
}

// step performs one Step (also for StepStream).
//
// Time budget (the env's budgets.max_seconds, counted from the episode's start): a step begun
// with the budget already spent does not perform its action; it is answered (and recorded) as a
// truncated step with no observation and info action_skipped. An exec's timeout is the least of
// the env's step timeout, the action's timeout_seconds and the time left in the budget, so a
// command overruns the budget by no more than the time it takes to kill it and collect its
// output; such an exec comes back timed_out and its step truncated. (A submit's verifier is not
// bounded by the budget: judging the episode is not the agent's time.)
//
// Failures: a verifier that fails or prints no reward ends the episode failed with class
// verifier (the step still answers, with info verifier_error); an action that fails because the
// sandbox is gone or the server failed (infraFailure) ends it failed with class infra, and the
// step returns the error.
func (s *Server) step(ctx context.Context, m *deltagymv1.StepRequest) (*deltagymv1.StepResponse, error) {
	if err := validateAction(m.GetAction()); err != nil {
		return nil, err
	}
	restore := m.GetRestoreCheckpointId()
	if restore == "" && m.GetRestoreFreshEntropy() {
		return nil, fmt.Errorf("restore_fresh_entropy is set without restore_checkpoint_id: %w", ErrInvalid)
	}
	l, sess, err := s.lease(m.GetSandboxId())
	if err != nil {
		return nil, err
	}
	var meta ckptMeta
	if restore != "" {
		// As Restore: checked before anything changes, and what runs in the
		// sandbox is aborted.
		if meta, err = s.restorable(ctx, l, restore); err != nil {
			return nil, err
		}
		l.Abort()
	}
	cctx, end, err := l.Begin(ctx)
	if err != nil {
		return nil, err
	}
	defer end()
	if restore != "" {
		if err := s.restoreIn(cctx, l, sess, restore, meta, m.GetRestoreFreshEntropy()); err != nil {
			return nil, err
		}
	}
	sess.mu.Lock()
	ended, episode, index, started := sess.ended, sess.episode, sess.base+sess.own, sess.started
	sess.mu.Unlock()
	if ended {
		return nil, fmt.Errorf("sandbox %s: episode %s is %s; Restore or Reset to go on: %w", l.ID(), episode, sess.status, ErrEpisodeEnded)
	}
	env := l.Env()
	start := time.Now()
	resp := &deltagymv1.StepResponse{EpisodeId: episode, StepIndex: int32(index), Info: map[string]string{}}
	var (
		obs        *deltagymv1.Observation
		reward     float64
		terminated bool
		verr       error
		left       time.Duration // time left in the episode's time budget; 0: no budget
		spent      bool
	)
	if d := env.MaxDuration(); d > 0 {
		left = d - start.Sub(started)
		spent = left <= 0
	}
	if spent {
		resp.Truncated = true
		resp.Info["truncated_by"] = "max_seconds"
		resp.Info["action_skipped"] = "the episode's time budget was spent before the step began"
	} else {
		obs, reward, terminated, verr, err = s.act(cctx, l, m.GetAction(), left)
		if err != nil {
			return nil, s.stepFailed(cctx, l, sess, err)
		}
	}
	dur := time.Since(start)
	resp.Observation, resp.Reward, resp.Terminated = obs, reward, terminated
	if verr != nil {
		resp.Info["verifier_error"] = s.scrub(verr.Error())
	}
	sess.mu.Lock()
	sess.own++
	sess.total += reward
	own := sess.own
	elapsed := time.Since(sess.started)
	sess.mu.Unlock()
	if !terminated && !resp.Truncated {
		if n := env.MaxSteps(); n > 0 && index+1 >= n {
			resp.Truncated = true
			resp.Info["truncated_by"] = "max_steps"
		} else if d := env.MaxDuration(); d > 0 && elapsed >= d {
			resp.Truncated = true
			resp.Info["truncated_by"] = "max_seconds"
		}
	}
	if m.GetCheckpoint() {
		cctx2, done := s.obs.op(cctx, "checkpoint")
		mode, err := processMode(env, deltagymv1.ProcessMode_PROCESS_MODE_UNSPECIFIED)
		var info sandbox.CheckpointInfo
		if err == nil {
			info, err = l.Sandbox().CheckpointWith(cctx2, sandbox.CheckpointOptions{Processes: mode})
		}
		done(err)
		if err != nil {
			return nil, s.stepFailed(cctx, l, sess, fmt.Errorf("checkpointing after the step: %w", err))
		}
		s.recordCheckpoint(env.Name(), ledger.KindUser, info, sess)
		resp.CheckpointId = info.ID
	}
	if s.writer != nil {
		action, aerr := protojson.Marshal(m.GetAction())
		if aerr != nil { // recorded as JSON null, and said
			s.ledgerErr(fmt.Errorf("episode %s step %d: encoding the action: %w", episode, own-1, aerr))
		}
		obsBytes, _ := proto.MarshalOptions{Deterministic: true}.Marshal(obs)
		s.ledgerErr(s.writer.Step(ledger.StepRow{EpisodeID: episode, Index: own - 1, Action: action, ActionValid: true, Observation: obsBytes,
			Reward: reward, Terminated: terminated, Truncated: resp.Truncated, StartedAt: start, Duration: dur, CheckpointID: resp.CheckpointId}))
		if _, ok := m.GetAction().GetKind().(*deltagymv1.Action_Submit); ok && verr == nil {
			i := own - 1
			sub := obs.GetSubmit()
			s.ledgerErr(s.writer.Reward(ledger.RewardRow{EpisodeID: episode, StepIndex: &i, Source: ledger.SourceVerifier,
				Components: sub.GetComponents(), Value: reward}))
		}
	}
	switch {
	case terminated && verr != nil:
		s.endEpisode(sess, ledger.StatusFailed, ledger.FailureVerifier, "the verifier failed: "+s.scrub(verr.Error()))
	case terminated:
		s.endEpisode(sess, ledger.StatusTerminated, ledger.FailureNone, "")
	case resp.Truncated:
		s.endEpisode(sess, ledger.StatusTruncated, ledger.FailureNone, "")
	}
	return resp, nil
}

// stepFailed handles err, the failure of a step's action on l (ctx is the call's, from Begin):
// an infrastructure failure (infraFailure) ends the episode failed with class infra. It returns
// the error for the client.
func (s *Server) stepFailed(ctx context.Context, l *envpool.Lease, sess *session, err error) error {
	err = callErr(ctx, err)
	gone, infra := infraFailure(ctx, l.Sandbox(), err)
	if !infra {
		return err
	}
	sess.mu.Lock()
	episode := sess.episode
	sess.mu.Unlock()
	s.log.Warn("episode failed: infrastructure error in a step", "sandbox", l.ID(), "episode", episode, "err", err)
	msg := "infrastructure error in a step: " + s.scrub(err.Error())
	if gone {
		msg = "its sandbox went away during a step (its init died)"
	}
	s.endEpisode(sess, ledger.StatusFailed, ledger.FailureInfra, msg)
	if gone {
		return fmt.Errorf("sandbox %s went away during the step (its init died); episode %s failed (infra); Reset for a new sandbox: %w",
			l.ID(), episode, sandbox.ErrClosed)
	}
	return err
}

// infraFailure reports whether err, from a call begun on a lease of box with context ctx (from
// Begin), is the infrastructure's fault rather than the client's, and whether the sandbox is
// gone. Infrastructure failures: the sandbox was destroyed under the call by the runtime because
// its init died (the call ends aborted though neither the client nor the pools aborted it, or
// closed with the init dead), or the server failed internally (an Internal error, such as a
// spawn failing for a reason of the host). Not: bad input, exhausted limits, a shell session the
// agent ended, aborts by Restore, Close or the reaper (which end the episode themselves), and the
// caller's own cancellation or deadline.
func infraFailure(ctx context.Context, box *sandbox.Sandbox, err error) (gone, infra bool) {
	switch {
	case err == nil, envpool.Aborted(ctx), ctx.Err() != nil:
		return false, false
	case errors.Is(err, sandbox.ErrAborted): // only Restore and Destroy abort an exec
		return true, true
	case errors.Is(err, sandbox.ErrClosed):
		gone = initDead(box)
		return gone, gone
	}
	return false, codeOf(err) == connect.CodeInternal
}

// initDeathGrace is how long initDead gives a dying init to finish exiting: a call can see the
// init's connection close while the kernel is still tearing the process down.
const initDeathGrace = 250 * time.Millisecond

// initDead reports whether box's init has exited (the runtime then destroys the sandbox). It
// waits up to initDeathGrace for the runtime to notice, then asks the kernel.
func initDead(box *sandbox.Sandbox) bool {
	t := time.NewTimer(initDeathGrace)
	defer t.Stop()
	select {
	case <-box.Done():
		return true
	case <-t.C:
	}
	st, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", box.InitPid()))
	if err != nil {
		return true
	}
	i := bytes.LastIndexByte(st, ')') // the state follows the command name in parentheses
	return i < 0 || i+2 >= len(st) || st[i+2] == 'Z' || st[i+2] == 'X'
}

// actionKind names an action's kind for traces.
func actionKind(a *deltagymv1.Action) string {
	switch a.GetKind().(type) {
	case *deltagymv1.Action_Exec:
		return "exec"
	case *deltagymv1.Action_WriteFile:
		return "write_file"
	case *deltagymv1.Action_ReadFile:
		return "read_file"
	case *deltagymv1.Action_Submit:
		return "submit"
	}
	return ""
}

// act performs an action. verr is a verifier failure of a submit (the episode still ends).
// left, when positive, is the time left in the episode's time budget, which bounds an exec's
// timeout.
func (s *Server) act(ctx context.Context, l *envpool.Lease, a *deltagymv1.Action, left time.Duration) (obs *deltagymv1.Observation, reward float64, terminated bool, verr, err error) {
	env, box := l.Env(), l.Sandbox()
	attrs := []attribute.KeyValue{attribute.String("deltagym.sandbox_id", l.ID()), attribute.String("deltagym.env", env.Name())}
	switch k := a.GetKind().(type) {
	case *deltagymv1.Action_Exec:
		x := k.Exec
		timeout := env.StepTimeout()
		if t := time.Duration(x.GetTimeoutSeconds() * float64(time.Second)); t > 0 && t < timeout {
			timeout = t
		}
		if left > 0 && left < timeout {
			timeout = left
		}
		vars := make([]string, 0, len(x.GetEnv()))
		for _, key := range slices.Sorted(maps.Keys(x.GetEnv())) {
			vars = append(vars, key+"="+x.GetEnv()[key])
		}
		ctx, done := s.obs.op(ctx, "exec")
		span := trace.SpanFromContext(ctx)
		span.SetAttributes(append(attrs, attribute.Float64("deltagym.exec.timeout_seconds", timeout.Seconds()),
			attribute.Bool("deltagym.exec.background", x.GetBackground()))...)
		res, err := box.Exec(ctx, sandbox.ExecRequest{Argv: x.GetArgv(), Command: x.GetCommand(), Stdin: x.GetStdin(), Env: vars,
			Cwd: x.GetCwd(), Timeout: timeout, Background: x.GetBackground(), Session: x.GetSession(), MaxOutput: env.OutputCap()})
		if err == nil {
			span.SetAttributes(attribute.Int("deltagym.exec.exit_code", res.ExitCode), attribute.Bool("deltagym.exec.timed_out", res.TimedOut))
		}
		done(err)
		if err != nil {
			return nil, 0, false, nil, err
		}
		return &deltagymv1.Observation{Kind: &deltagymv1.Observation_Exec{Exec: execResult(res)}}, 0, false, nil, nil
	case *deltagymv1.Action_WriteFile:
		w := k.WriteFile
		mode := os.FileMode(w.GetMode())
		if mode == 0 {
			mode = 0o644
		}
		ctx, done := s.obs.op(ctx, "write_file")
		trace.SpanFromContext(ctx).SetAttributes(append(attrs, attribute.Int("deltagym.file.bytes", len(w.GetContent())))...)
		err := box.WriteFile(ctx, w.GetPath(), w.GetContent(), mode, w.GetAppend())
		done(err)
		if err != nil {
			return nil, 0, false, nil, err
		}
		_, size, err := box.ReadFile(ctx, w.GetPath(), 0, 0)
		if err != nil {
			return nil, 0, false, nil, err
		}
		return &deltagymv1.Observation{Kind: &deltagymv1.Observation_WriteFile{WriteFile: &deltagymv1.WriteFileResult{Size: size}}}, 0, false, nil, nil
	case *deltagymv1.Action_ReadFile:
		r := k.ReadFile
		limit := int64(env.OutputCap())
		if n := r.GetMaxBytes(); n > 0 && n < limit {
			limit = n
		}
		ctx, done := s.obs.op(ctx, "read_file")
		trace.SpanFromContext(ctx).SetAttributes(attrs...)
		data, size, err := box.ReadFile(ctx, r.GetPath(), r.GetOffset(), limit)
		done(err)
		if err != nil {
			return nil, 0, false, nil, err
		}
		return &deltagymv1.Observation{Kind: &deltagymv1.Observation_ReadFile{ReadFile: &deltagymv1.ReadFileResult{
			Content: data, Size: size, Truncated: r.GetOffset()+int64(len(data)) < size}}}, 0, false, nil, nil
	case *deltagymv1.Action_Submit:
		ctx, done := s.obs.op(ctx, "verify")
		trace.SpanFromContext(ctx).SetAttributes(attrs...)
		v, err := s.pools.Verify(ctx, env, box, k.Submit.Answer)
		done(err)
		if err != nil && !errors.Is(err, envpool.ErrVerifier) && !errors.Is(err, envpool.ErrNoVerifier) {
			return nil, 0, false, nil, err
		}
		sub := &deltagymv1.SubmitResult{Components: v.Components, Output: v.Output}
		return &deltagymv1.Observation{Kind: &deltagymv1.Observation_Submit{Submit: sub}}, v.Reward, true, err, nil
	}
	return nil, 0, false, nil, fmt.Errorf("unknown action kind: %w", ErrInvalid)
}

func execResult(r sandbox.ExecResult) *deltagymv1.ExecResult {
	return &deltagymv1.ExecResult{Stdout: r.Stdout, Stderr: r.Stderr, ExitCode: int32(r.ExitCode), Signal: signalNumber(r.Signal),
		TimedOut: r.TimedOut, StdoutTruncated: r.StdoutTruncated, StderrTruncated: r.StderrTruncated,
		DurationSeconds: r.Duration.Seconds(), Pid: int32(r.Pid)}
}

func (e *envService) StepStream(ctx context.Context, stream *connect.BidiStream[deltagymv1.StepStreamRequest, deltagymv1.StepStreamResponse]) error {
	return e.s.stepStream(ctx, stream)
}

func (e *envService) Checkpoint(ctx context.Context, req *connect.Request[deltagymv1.CheckpointRequest]) (*connect.Response[deltagymv1.CheckpointResponse], error) {
	// An undefined mode is refused before the request waits for the sandbox.
	if _, err := processMode(nil, req.Msg.GetProcessMode()); err != nil {
		return nil, e.s.toConnect(err)
	}
	l, sess, err := e.s.lease(req.Msg.GetSandboxId())
	if err != nil {
		return nil, e.s.toConnect(err)
	}
	cctx, end, err := l.Begin(ctx)
	if err != nil {
		return nil, e.s.toConnect(err)
	}
	defer end()
	mode, err := processMode(l.Env(), req.Msg.GetProcessMode())
	if err != nil {
		return nil, e.s.toConnect(err)
	}
	octx, done := e.s.obs.op(cctx, "checkpoint")
	info, err := l.Sandbox().CheckpointWith(octx, sandbox.CheckpointOptions{Processes: mode, Durable: req.Msg.GetDurable()})
	done(err)
	if err != nil {
		return nil, e.s.toConnect(callErr(cctx, err))
	}
	e.s.recordCheckpoint(l.Env().Name(), ledger.KindUser, info, sess)
	resp := &deltagymv1.CheckpointResponse{CheckpointId: info.ID, ParentId: info.Parent, Depth: int32(info.Depth), Durable: true}
	for _, p := range info.Processes {
		if p.Method == sandbox.CaptureTemplate && !req.Msg.GetDurable() {
			resp.Durable = false
		}
		resp.Processes = append(resp.Processes, &deltagymv1.ProcessCapture{Pid: int32(p.Pid), Command: p.Command, Method: captureMethod(p.Method), Reason: p.Reason})
	}
	return connect.NewResponse(resp), nil
}

// captureMethod names a sandbox.ProcessCapture method on the wire.
func captureMethod(m sandbox.CaptureMethod) deltagymv1.CaptureMethod {
	if m == sandbox.CaptureCRIU {
		return deltagymv1.CaptureMethod_CAPTURE_METHOD_CRIU
	}
	return deltagymv1.CaptureMethod_CAPTURE_METHOD_TEMPLATE
}

// processMode picks how a checkpoint captures processes: the request's
// mode, else the env's, else the runtime's default (templates). A value
// the API does not define (a number sent over JSON, or by a newer client)
// is ErrInvalid, not the default.
func processMode(env *envpool.Env, asked deltagymv1.ProcessMode) (sandbox.ProcessMode, error) {
	if asked == deltagymv1.ProcessMode_PROCESS_MODE_UNSPECIFIED && env != nil {
		asked = env.ProcessMode()
	}
	switch asked {
	case deltagymv1.ProcessMode_PROCESS_MODE_UNSPECIFIED:
		return sandbox.ProcessesDefault, nil
	case deltagymv1.ProcessMode_PROCESS_MODE_FILESYSTEM:
		return sandbox.ProcessesNone, nil
	case deltagymv1.ProcessMode_PROCESS_MODE_TEMPLATE:
		return sandbox.ProcessesTemplate, nil
	case deltagymv1.ProcessMode_PROCESS_MODE_CRIU:
		return sandbox.ProcessesCRIU, nil
	}
	return sandbox.ProcessesDefault, fmt.Errorf("process_mode %d is not one of PROCESS_MODE_FILESYSTEM, PROCESS_MODE_TEMPLATE or PROCESS_MODE_CRIU: %w", asked, ErrInvalid)
}

func (e *envService) Restore(ctx context.Context, req *connect.Request[deltagymv1.RestoreRequest]) (*connect.Response[deltagymv1.RestoreResponse], error) {
	if req.Msg.GetCheckpointId() == "" {
		return nil, e.s.toConnect(fmt.Errorf("checkpoint_id is required: %w", ErrInvalid))
	}
	l, sess, err := e.s.lease(req.Msg.GetSandboxId())
	if err != nil {
		return nil, e.s.toConnect(err)
	}
	meta, err := e.s.restorable(ctx, l, req.Msg.GetCheckpointId())
	if err != nil {
		return nil, e.s.toConnect(err)
	}
	l.Abort()
	cctx, end, err := l.Begin(ctx)
	if err != nil {
		return nil, e.s.toConnect(err)
	}
	defer end()
	if err := e.s.restoreIn(cctx, l, sess, req.Msg.GetCheckpointId(), meta, req.Msg.GetFreshEntropy()); err != nil {
		return nil, e.s.toConnect(err)
	}
	sess.mu.Lock()
	resp := &deltagymv1.RestoreResponse{EpisodeId: sess.episode, NextStepIndex: int32(sess.base)}
	sess.mu.Unlock()
	return connect.NewResponse(resp), nil
}

// restorable checks that checkpoint id exists and can be restored in the sandbox of l, and
// returns what the ledger knows of it.
func (s *Server) restorable(ctx context.Context, l *envpool.Lease, id string) (ckptMeta, error) {
	meta, err := s.checkpointMeta(ctx, id)
	if err != nil {
		return ckptMeta{}, err
	}
	if meta.env != l.Env().Name() {
		return ckptMeta{}, fmt.Errorf("checkpoint %s is of env %s, sandbox %s of env %s: %w",
			id, meta.env, l.ID(), l.Env().Name(), ErrOtherEnv)
	}
	return meta, nil
}

// restoreIn restores the sandbox of l to checkpoint id (checked by restorable) and starts the
// episode that begins there, ending the current one as branched. Called between l.Begin and its
// end.
func (s *Server) restoreIn(ctx context.Context, l *envpool.Lease, sess *session, id string, meta ckptMeta, fresh bool) error {
	octx, done := s.obs.op(ctx, "restore")
	err := l.Sandbox().RestoreWith(octx, id, sandbox.RestoreOptions{FreshEntropy: fresh})
	done(err)
	if err != nil {
		return err
	}
	s.endEpisode(sess, ledger.StatusBranched, ledger.FailureNone, "")
	sess.mu.Lock()
	run, group, seed := sess.run, sess.group, sess.seed
	sess.mu.Unlock()
	s.startEpisode(l, run, group, seed, id, meta)
	return nil
}

func (e *envService) Fork(ctx context.Context, req *connect.Request[deltagymv1.ForkRequest]) (*connect.Response[deltagymv1.ForkResponse], error) {
	resp, err := e.s.idem.do(ctx, "fork", req.Msg.GetIdempotencyKey(), req.Msg, func() (proto.Message, error) {
		return e.fork(ctx, req.Msg)
	})
	if err != nil {
		return nil, e.s.toConnect(err)
	}
	return connect.NewResponse(resp.(*deltagymv1.ForkResponse)), nil
}

func (e *envService) fork(ctx context.Context, m *deltagymv1.ForkRequest) (*deltagymv1.ForkResponse, error) {
	n := int(m.GetN())
	if n < 1 || n > maxFork {
		return nil, fmt.Errorf("fork n %d is not between 1 and %d: %w", n, maxFork, ErrInvalid)
	}
	var ckpt string
	var meta ckptMeta
	var skipWhy string // why the children run none of the source's processes
	switch src := m.GetSource().(type) {
	case *deltagymv1.ForkRequest_CheckpointId:
		ckpt = src.CheckpointId
		var err error
		if meta, err = e.s.checkpointMeta(ctx, ckpt); err != nil {
			return nil, err
		}
	case *deltagymv1.ForkRequest_SandboxId:
		l, sess, err := e.s.lease(src.SandboxId)
		if err != nil {
			return nil, err
		}
		cctx, end, err := l.Begin(ctx)
		if err != nil {
			return nil, err
		}
		// The children get the sandbox's processes too; one that cannot be
		// captured leaves them with its files only, and the response says
		// why.
		info, err := l.Sandbox().CheckpointWith(cctx, sandbox.CheckpointOptions{})
		if errors.Is(err, sandbox.ErrProcesses) {
			skipWhy = err.Error()
			info, err = l.Sandbox().CheckpointWith(cctx, sandbox.CheckpointOptions{Processes: sandbox.ProcessesNone})
		}
		end()
		if err != nil {
			return nil, callErr(cctx, err)
		}
		ckpt = info.ID
		meta = e.s.recordCheckpoint(l.Env().Name(), ledger.KindUser, info, sess)
	default:
		return nil, fmt.Errorf("fork needs a checkpoint_id or a sandbox_id: %w", ErrInvalid)
	}
	env, err := e.s.pools.Env(meta.env)
	if err != nil {
		return nil, err
	}
	ctx, done := e.s.obs.op(ctx, "fork")
	// Processes kept as templates reach the children through CRIU images
	// made from the templates (once per checkpoint). If that cannot be
	// done (the templates' sandbox is gone, a process CRIU refuses), the
	// children start from the files and the response says why.
	leases, err := e.s.pools.Fork(ctx, env, ckpt, n, envpool.ForkOptions{FreshEntropy: m.GetFreshEntropy()})
	if errors.Is(err, sandbox.ErrProcesses) {
		skipTpl := err.Error()
		leases, err = e.s.pools.Fork(ctx, env, ckpt, n, envpool.ForkOptions{FreshEntropy: m.GetFreshEntropy(), SkipTemplates: true})
		if skipWhy == "" {
			skipWhy = skipTpl
		}
	}
	done(err)
	if err != nil {
		return nil, err
	}
	run, group := m.GetRun(), m.GetGroupId()
	if run == "" {
		run = meta.run
	}
	if group == "" {
		group = meta.group
	}
	resp := &deltagymv1.ForkResponse{CheckpointId: ckpt}
	if info, err := e.s.rt.Checkpoint(ckpt); err == nil {
		for _, p := range info.Processes {
			pc := &deltagymv1.ProcessCapture{Pid: int32(p.Pid), Command: p.Command, Method: deltagymv1.CaptureMethod_CAPTURE_METHOD_CRIU,
				Reason: "restored in every child from the checkpoint's CRIU image"}
			if p.Method != sandbox.CaptureCRIU {
				pc.Reason = "restored in every child from a CRIU image of its template"
				if p.ImagePid > 0 && skipWhy == "" {
					// The image is a copy's: the children have the process
					// at that copy's pid.
					pc.Pid = int32(p.ImagePid)
					pc.Reason += fmt.Sprintf(", as pid %d (pid %d at the checkpoint)", p.ImagePid, p.Pid)
				}
				if skipWhy != "" {
					pc.Method = deltagymv1.CaptureMethod_CAPTURE_METHOD_NONE
					pc.Reason = "the children run without it: " + skipWhy
				}
			}
			resp.Processes = append(resp.Processes, pc)
		}
		if skipWhy != "" && len(info.Processes) == 0 {
			resp.Processes = append(resp.Processes, &deltagymv1.ProcessCapture{Method: deltagymv1.CaptureMethod_CAPTURE_METHOD_NONE,
				Reason: "the children start from the sandbox's files only: " + skipWhy})
		}
	}
	for _, l := range leases {
		sess := e.s.startEpisode(l, run, group, nil, ckpt, meta)
		resp.SandboxIds = append(resp.SandboxIds, l.ID())
		resp.EpisodeIds = append(resp.EpisodeIds, sess.episode)
	}
	return resp, nil
}

func (e *envService) ReleaseCheckpoint(ctx context.Context, req *connect.Request[deltagymv1.ReleaseCheckpointRequest]) (*connect.Response[deltagymv1.ReleaseCheckpointResponse], error) {
	id := req.Msg.GetCheckpointId()
	if id == "" {
		return nil, e.s.toConnect(fmt.Errorf("checkpoint_id is required: %w", ErrInvalid))
	}
	if err := e.s.rt.ReleaseCheckpoint(id); err != nil {
		return nil, e.s.toConnect(err)
	}
	e.s.ckpts.Delete(id)
	if e.s.writer != nil {
		e.s.ledgerErr(e.s.writer.CheckpointReleased(id, time.Now()))
	}
	return connect.NewResponse(&deltagymv1.ReleaseCheckpointResponse{}), nil
}

func (e *envService) Evaluate(ctx context.Context, req *connect.Request[deltagymv1.EvaluateRequest]) (*connect.Response[deltagymv1.EvaluateResponse], error) {
	l, sess, err := e.s.lease(req.Msg.GetSandboxId())
	if err != nil {
		return nil, e.s.toConnect(err)
	}
	cctx, end, err := l.Begin(ctx)
	if err != nil {
		return nil, e.s.toConnect(err)
	}
	defer end()
	octx, done := e.s.obs.op(cctx, "evaluate")
	v, err := e.s.pools.Evaluate(octx, l)
	done(err)
	if v.Checkpoint.ID != "" {
		e.s.recordCheckpoint(l.Env().Name(), ledger.KindEvaluate, v.Checkpoint, sess)
	}
	if err != nil {
		return nil, e.s.toConnect(callErr(cctx, err))
	}
	if e.s.writer != nil {
		sess.mu.Lock()
		ep, own := sess.episode, sess.own
		sess.mu.Unlock()
		e.s.ledgerErr(e.s.writer.Reward(ledger.RewardRow{EpisodeID: ep, StepIndex: &own, Source: "evaluate", Components: v.Components, Value: v.Reward}))
	}
	return connect.NewResponse(&deltagymv1.EvaluateResponse{Reward: v.Reward, Components: v.Components, Output: v.Output,
		DurationSeconds: v.Duration.Seconds()}), nil
}

func (e *envService) Close(ctx context.Context, req *connect.Request[deltagymv1.CloseRequest]) (*connect.Response[deltagymv1.CloseResponse], error) {
	id := req.Msg.GetSandboxId()
	l, sess, err := e.s.lease(id)
	if errors.Is(err, envpool.ErrLeaseEnded) {
		return connect.NewResponse(&deltagymv1.CloseResponse{}), nil
	}
	if err != nil {
		return nil, e.s.toConnect(err)
	}
	e.s.closed.Store(id, struct{}{})
	err = e.s.pools.CloseLease(ctx, l)
	e.s.endEpisode(sess, ledger.StatusTruncated, ledger.FailureNone, "")
	if err != nil {
		return nil, e.s.toConnect(err)
	}
	return connect.NewResponse(&deltagymv1.CloseResponse{}), nil
}

func (e *envService) Heartbeat(ctx context.Context, req *connect.Request[deltagymv1.HeartbeatRequest]) (*connect.Response[deltagymv1.HeartbeatResponse], error) {
	resp := &deltagymv1.HeartbeatResponse{}
	for _, id := range req.Msg.GetSandboxIds() {
		l, _, err := e.s.lease(id)
		if err != nil {
			resp.UnknownSandboxIds = append(resp.UnknownSandboxIds, id)
			continue
		}
		resp.Leases = append(resp.Leases, &deltagymv1.Lease{SandboxId: id, ExpireTime: timestamppb.New(l.Touch())})
	}
	return connect.NewResponse(resp), nil
}

func (e *envService) GetSandbox(ctx context.Context, req *connect.Request[deltagymv1.GetSandboxRequest]) (*connect.Response[deltagymv1.GetSandboxResponse], error) {
	l, _, err := e.s.lease(req.Msg.GetSandboxId())
	if err != nil {
		return nil, e.s.toConnect(err)
	}
	return connect.NewResponse(&deltagymv1.GetSandboxResponse{Sandbox: e.s.describe(l)}), nil
}

func (e *envService) ListSandboxes(ctx context.Context, req *connect.Request[deltagymv1.ListSandboxesRequest]) (*connect.Response[deltagymv1.ListSandboxesResponse], error) {
	m := req.Msg
	resp := &deltagymv1.ListSandboxesResponse{}
	for _, l := range e.s.pools.Leases() {
		if sessionOf(l) == nil || (m.GetEnv() != "" && l.Env().Name() != m.GetEnv()) {
			continue
		}
		d := e.s.describe(l)
		if (m.GetRun() != "" && d.GetRun() != m.GetRun()) || (m.GetGroupId() != "" && d.GetGroupId() != m.GetGroupId()) {
			continue
		}
		resp.Sandboxes = append(resp.Sandboxes, d)
	}
	sort.Slice(resp.Sandboxes, func(i, j int) bool {
		return resp.Sandboxes[i].GetCreateTime().AsTime().Before(resp.Sandboxes[j].GetCreateTime().AsTime())
	})
	return connect.NewResponse(resp), nil
}
