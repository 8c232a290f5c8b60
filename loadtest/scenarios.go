package loadtest

import (
	"bytes"
	"context"
	"fmt"
	"math/rand/v2"
	"slices"
	"strconv"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	deltagymv1 "github.com/deltagym/deltagym/clients/go/gen/deltagym/v1"
)

// worker owns one sandbox (or, for grpo, one parent sandbox) and performs iterations of
// its scenario.
type worker interface {
	// setup creates the worker's sandbox state; it is not measured.
	setup(ctx context.Context) error
	// iterate performs one iteration, timing each call with rec.op.
	iterate(ctx context.Context, rec *recorder) error
	// close frees the worker's sandboxes (best effort).
	close(ctx context.Context)
}

// dataPath is the file the scenarios write and verify inside the sandbox.
const dataPath = "/work/loadtest.dat"

func newWorker(scenario string, id int, c deltagymv1.EnvServiceClient, cfg *Config) worker {
	b := base{c: c, env: cfg.Env, id: id, rng: rand.New(rand.NewPCG(uint64(id), 0x10ad7e57)), stream: cfg.API == APIStream}
	switch scenario {
	case "rollback":
		return &rollbackWorker{base: b, size: cfg.FileSize}
	case "rollback-exec":
		return &rollbackExecWorker{base: b}
	case "rollback-process":
		return &rollbackProcessWorker{base: b, mb: cfg.ProcessMB, method: cfg.ProcessMethod, shape: cfg.ProcessShape}
	case "steps":
		return &stepsWorker{base: b}
	case "grpo":
		return &grpoWorker{base: b, g: cfg.Group}
	case "tree":
		return &treeWorker{base: b}
	case "mixed":
		mix := []string{"rollback", "steps", "tree", "grpo"}
		return newWorker(mix[id%len(mix)], id, c, cfg)
	}
	panic("unknown scenario " + scenario) // Validate rejects it first
}

// base holds what every worker has: a client, the env, and one sandbox.
type base struct {
	c   deltagymv1.EnvServiceClient
	env string
	id  int
	rng *rand.Rand
	sid string
	// stream: steps go on st, a StepStream of the worker's own (APIStream), opened on
	// first use; the worker waits for each answer before it sends the next step.
	stream bool
	st     grpc.BidiStreamingClient[deltagymv1.StepStreamRequest, deltagymv1.StepStreamResponse]
	stop   context.CancelFunc // ends st
	reqID  uint64
	// cks are the checkpoints the worker took and has not released: close releases them,
	// so that a run against a long-lived server leaves none behind (each holds its layers,
	// and a checkpoint with processes its frozen templates, until released).
	cks []string
}

// checkpointTaken is called with each checkpoint a worker takes (tests only).
var checkpointTaken func(id string)

// own records a checkpoint the worker took, for close to release.
func (b *base) own(id string) {
	if id == "" {
		return
	}
	b.cks = append(b.cks, id)
	if checkpointTaken != nil {
		checkpointTaken(id)
	}
}

// release releases a checkpoint the worker took.
func (b *base) release(ctx context.Context, id string) error {
	_, err := b.c.ReleaseCheckpoint(ctx, &deltagymv1.ReleaseCheckpointRequest{CheckpointId: id})
	if err == nil || status.Code(err) == codes.NotFound {
		b.cks = slices.DeleteFunc(b.cks, func(c string) bool { return c == id })
	}
	return err
}

func (b *base) reset(ctx context.Context) error {
	r, err := b.c.Reset(ctx, &deltagymv1.ResetRequest{Env: b.env, Run: "loadtest"})
	if err != nil {
		return fmt.Errorf("reset: %w", err)
	}
	b.sid = r.GetSandboxId()
	return nil
}

// close ends the worker's sandbox and releases its checkpoints, on a context of its own (up to
// a minute) so that the end of the run cannot cut it short.
func (b *base) close(ctx context.Context) {
	ctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), time.Minute)
	defer cancel()
	b.endStream()
	if b.sid != "" {
		_, _ = b.c.Close(ctx, &deltagymv1.CloseRequest{SandboxId: b.sid})
		b.sid = ""
	}
	// Deepest first: a tree's checkpoints were taken root first. One whose release fails
	// stays listed, for the next close.
	for _, id := range slices.Backward(slices.Clone(b.cks)) {
		_ = b.release(ctx, id)
	}
}

func (b *base) step(ctx context.Context, a *deltagymv1.Action, checkpoint bool) (*deltagymv1.StepResponse, error) {
	return b.stepReq(ctx, &deltagymv1.StepRequest{Action: a, Checkpoint: checkpoint})
}

// stepReq performs one step in the worker's sandbox: on its StepStream with APIStream, else
// as a unary Step. A step that fails on the stream returns its error as a gRPC status, as
// the unary call would.
func (b *base) stepReq(ctx context.Context, req *deltagymv1.StepRequest) (*deltagymv1.StepResponse, error) {
	req.SandboxId = b.sid
	if !b.stream {
		return b.c.Step(ctx, req)
	}
	if b.st == nil {
		// The stream outlives this call's context: it lives until close (or a failure).
		sctx, stop := context.WithCancel(context.WithoutCancel(ctx))
		st, err := b.c.StepStream(sctx)
		if err != nil {
			stop()
			return nil, err
		}
		b.st, b.stop = st, stop
	}
	b.reqID++
	if err := b.st.Send(&deltagymv1.StepStreamRequest{RequestId: b.reqID, Step: req}); err != nil {
		b.endStream()
		return nil, err
	}
	// The call's context ending cancels the stream (its answer may never come).
	unwatch := context.AfterFunc(ctx, b.stop)
	m, err := b.st.Recv()
	if !unwatch() {
		b.endStream()
		return nil, status.FromContextError(ctx.Err()).Err()
	}
	if err != nil {
		b.endStream()
		return nil, err
	}
	if m.GetRequestId() != b.reqID {
		b.endStream()
		return nil, fmt.Errorf("stream answered request %d, waiting for %d: %w", m.GetRequestId(), b.reqID, ErrUnexpected)
	}
	if e := m.GetError(); e != nil {
		return nil, status.Error(codes.Code(e.GetCode()), e.GetMessage())
	}
	return m.GetStep(), nil
}

// restoreFor restores the sandbox to checkpoint ck for step req (timed as op) unless skip:
// with APIStream the step itself restores first (restore_checkpoint_id: one message each way),
// else a timed Restore call does. It returns the name to time the step under.
func (b *base) restoreFor(ctx context.Context, rec *recorder, req *deltagymv1.StepRequest, op, ck string, skip bool) (string, error) {
	switch {
	case skip:
		return op, nil
	case b.stream:
		req.RestoreCheckpointId = ck
		return "restore+" + op, nil
	}
	return op, rec.op("restore", func() error { return b.restore(ctx, ck) })
}

// endStream closes the worker's StepStream, if open.
func (b *base) endStream() {
	if b.st == nil {
		return
	}
	_ = b.st.CloseSend()
	b.stop()
	b.st, b.stop = nil, nil
}

func (b *base) checkpoint(ctx context.Context) (string, error) {
	r, err := b.c.Checkpoint(ctx, &deltagymv1.CheckpointRequest{SandboxId: b.sid})
	if err != nil {
		return "", fmt.Errorf("checkpoint: %w", err)
	}
	b.own(r.GetCheckpointId())
	return r.GetCheckpointId(), nil
}

func (b *base) restore(ctx context.Context, ck string) error {
	_, err := b.c.Restore(ctx, &deltagymv1.RestoreRequest{SandboxId: b.sid, CheckpointId: ck})
	return err
}

func writeAction(path string, content []byte) *deltagymv1.Action {
	return &deltagymv1.Action{Kind: &deltagymv1.Action_WriteFile{WriteFile: &deltagymv1.WriteFileAction{Path: path, Content: content}}}
}

func readAction(path string) *deltagymv1.Action {
	return &deltagymv1.Action{Kind: &deltagymv1.Action_ReadFile{ReadFile: &deltagymv1.ReadFileAction{Path: path}}}
}

func execAction(command string) *deltagymv1.Action {
	return &deltagymv1.Action{Kind: &deltagymv1.Action_Exec{Exec: &deltagymv1.ExecAction{Command: command}}}
}

func argvAction(argv ...string) *deltagymv1.Action {
	return &deltagymv1.Action{Kind: &deltagymv1.Action_Exec{Exec: &deltagymv1.ExecAction{Argv: argv}}}
}

// fill returns size bytes that start with tag and repeat it.
func fill(tag string, size int) []byte {
	return bytes.Repeat([]byte(tag), size/len(tag)+1)[:size]
}

// rollbackWorker: checkpoint once, then Restore, read_file (the file changed before the
// restore must be back at its checkpointed content), write_file (change it again).
type rollbackWorker struct {
	base
	size        int
	ck          string
	want        []byte
	n           int
	skipRestore bool // tests only: proves that verification catches a missing restore
}

func (w *rollbackWorker) setup(ctx context.Context) error {
	if err := w.reset(ctx); err != nil {
		return err
	}
	w.want = fill(fmt.Sprintf("checkpointed-%d|", w.id), w.size)
	if _, err := w.step(ctx, writeAction(dataPath, w.want), false); err != nil {
		return fmt.Errorf("writing the checkpointed file: %w", err)
	}
	ck, err := w.checkpoint(ctx)
	if err != nil {
		return err
	}
	w.ck = ck
	return w.change(ctx, nil)
}

// change overwrites the file with content of the same size that differs from w.want.
func (w *rollbackWorker) change(ctx context.Context, rec *recorder) error {
	w.n++
	content := fill(fmt.Sprintf("changed-%d-%d|", w.id, w.n), w.size)
	call := func() error {
		r, err := w.step(ctx, writeAction(dataPath, content), false)
		if err == nil && r.GetObservation().GetWriteFile().GetSize() != int64(w.size) {
			return fmt.Errorf("write_file reported %d bytes, wrote %d: %w", r.GetObservation().GetWriteFile().GetSize(), w.size, ErrUnexpected)
		}
		return err
	}
	if rec == nil {
		return call()
	}
	return rec.op("write_file", call)
}

func (w *rollbackWorker) iterate(ctx context.Context, rec *recorder) error {
	req := &deltagymv1.StepRequest{Action: readAction(dataPath)}
	op, err := w.restoreFor(ctx, rec, req, "read_file", w.ck, w.skipRestore)
	if err != nil {
		return err
	}
	err = rec.op(op, func() error {
		r, err := w.stepReq(ctx, req)
		if err != nil {
			return err
		}
		return w.check(r)
	})
	if err != nil {
		return err
	}
	return w.change(ctx, rec)
}

// check says whether a read of the data file found the checkpointed content.
func (w *rollbackWorker) check(r *deltagymv1.StepResponse) error {
	if got := r.GetObservation().GetReadFile().GetContent(); !bytes.Equal(got, w.want) {
		return fmt.Errorf("%s holds %q…, want %q…: %w", dataPath, head(got), head(w.want), ErrWrongRestore)
	}
	return nil
}

func head(b []byte) []byte { return b[:min(len(b), 24)] }

// rollbackExecWorker: like rollback, but one exec both checks the restored file and
// changes it.
type rollbackExecWorker struct {
	base
	ck          string
	want        string
	skipRestore bool // tests only
}

func (w *rollbackExecWorker) setup(ctx context.Context) error {
	if err := w.reset(ctx); err != nil {
		return err
	}
	w.want = fmt.Sprintf("checkpointed-%d", w.id)
	if _, err := w.step(ctx, writeAction(dataPath, []byte(w.want)), false); err != nil {
		return fmt.Errorf("writing the checkpointed file: %w", err)
	}
	ck, err := w.checkpoint(ctx)
	if err != nil {
		return err
	}
	w.ck = ck
	_, err = w.step(ctx, writeAction(dataPath, []byte("changed")), false)
	return err
}

func (w *rollbackExecWorker) iterate(ctx context.Context, rec *recorder) error {
	req := &deltagymv1.StepRequest{Action: execAction("cat " + dataPath + " && echo changed > " + dataPath)}
	op, err := w.restoreFor(ctx, rec, req, "exec", w.ck, w.skipRestore)
	if err != nil {
		return err
	}
	return rec.op(op, func() error {
		r, err := w.stepReq(ctx, req)
		if err != nil {
			return err
		}
		x := r.GetObservation().GetExec()
		if x.GetExitCode() != 0 {
			return fmt.Errorf("exec exited %d: %s: %w", x.GetExitCode(), head(x.GetStderr()), ErrUnexpected)
		}
		if string(x.GetStdout()) != w.want {
			return fmt.Errorf("%s holds %q, want %q: %w", dataPath, head(x.GetStdout()), w.want, ErrWrongRestore)
		}
		return nil
	})
}

// stepsWorker: exec `true`, restoring the start checkpoint when the step budget ends the
// episode.
type stepsWorker struct {
	base
	ck string
}

func (w *stepsWorker) setup(ctx context.Context) error {
	if err := w.reset(ctx); err != nil {
		return err
	}
	ck, err := w.checkpoint(ctx)
	w.ck = ck
	return err
}

func (w *stepsWorker) iterate(ctx context.Context, rec *recorder) error {
	var truncated bool
	err := rec.op("exec", func() error {
		r, err := w.step(ctx, argvAction("true"), false)
		if err != nil {
			return err
		}
		if c := r.GetObservation().GetExec().GetExitCode(); c != 0 {
			return fmt.Errorf("true exited %d: %w", c, ErrUnexpected)
		}
		truncated = r.GetTruncated() || r.GetTerminated()
		return nil
	})
	if err != nil || !truncated {
		return err
	}
	return rec.op("restore", func() error { return w.restore(ctx, w.ck) })
}

// grpoWorker: fork G children from a checkpoint, step each (write the answer), evaluate
// each (the verifier must give reward 1), close them.
type grpoWorker struct {
	base
	g  int
	ck string
}

func (w *grpoWorker) setup(ctx context.Context) error {
	if err := w.reset(ctx); err != nil {
		return err
	}
	ck, err := w.checkpoint(ctx)
	w.ck = ck
	return err
}

func (w *grpoWorker) iterate(ctx context.Context, rec *recorder) error {
	var kids []string
	err := rec.op("fork", func() error {
		r, err := w.c.Fork(ctx, &deltagymv1.ForkRequest{Source: &deltagymv1.ForkRequest_CheckpointId{CheckpointId: w.ck}, N: int32(w.g)})
		if err != nil {
			return err
		}
		kids = r.GetSandboxIds()
		if len(kids) != w.g {
			return fmt.Errorf("fork gave %d sandboxes, want %d: %w", len(kids), w.g, ErrUnexpected)
		}
		return nil
	})
	if err != nil {
		return err
	}
	defer func() {
		for _, k := range kids {
			_ = rec.op("close", func() error {
				_, err := w.c.Close(context.WithoutCancel(ctx), &deltagymv1.CloseRequest{SandboxId: k})
				return err
			})
		}
	}()
	for i, k := range kids {
		answer := "42"
		if i%2 == 1 {
			answer = "7" // half the group answers wrongly: rewards must differ
		}
		err := rec.op("step", func() error {
			_, err := w.c.Step(ctx, &deltagymv1.StepRequest{SandboxId: k, Action: writeAction("/work/answer.txt", []byte(answer))})
			return err
		})
		if err != nil {
			return err
		}
		err = rec.op("evaluate", func() error {
			r, err := w.c.Evaluate(ctx, &deltagymv1.EvaluateRequest{SandboxId: k})
			if err != nil {
				return err
			}
			if want := map[bool]float64{true: 1, false: 0}[answer == "42"]; r.GetReward() != want {
				return fmt.Errorf("child %d (answer %s) got reward %v, want %v: %w", i, answer, r.GetReward(), want, ErrUnexpected)
			}
			return nil
		})
		if err != nil {
			return err
		}
	}
	return nil
}

// treeWorker: random expansion (a step writing the depth, with a checkpoint) and
// backtracking (restore a random checkpoint on the current path, verify its depth).
type treeWorker struct {
	base
	path []string // checkpoint IDs from the root; path[i] has depth i
}

const treeMaxDepth = 16

func (w *treeWorker) setup(ctx context.Context) error {
	if err := w.reset(ctx); err != nil {
		return err
	}
	r, err := w.step(ctx, writeAction(dataPath, []byte("0")), true)
	if err != nil {
		return fmt.Errorf("writing the root: %w", err)
	}
	w.own(r.GetCheckpointId())
	w.path = []string{r.GetCheckpointId()}
	return nil
}

func (w *treeWorker) iterate(ctx context.Context, rec *recorder) error {
	if len(w.path) < treeMaxDepth && w.rng.IntN(10) < 6 {
		return rec.op("step_checkpoint", func() error {
			r, err := w.step(ctx, writeAction(dataPath, []byte(strconv.Itoa(len(w.path)))), true)
			if err != nil {
				return err
			}
			if r.GetCheckpointId() == "" {
				return fmt.Errorf("step asked for a checkpoint and got none: %w", ErrUnexpected)
			}
			w.own(r.GetCheckpointId())
			w.path = append(w.path, r.GetCheckpointId())
			return nil
		})
	}
	j := w.rng.IntN(len(w.path))
	if err := rec.op("restore", func() error { return w.restore(ctx, w.path[j]) }); err != nil {
		return err
	}
	err := rec.op("read_file", func() error {
		r, err := w.step(ctx, readAction(dataPath), false)
		if err != nil {
			return err
		}
		if got := string(r.GetObservation().GetReadFile().GetContent()); got != strconv.Itoa(j) {
			return fmt.Errorf("restored depth %d, file says %q: %w", j, got, ErrWrongRestore)
		}
		return nil
	})
	if err != nil {
		return err
	}
	// The branches below j are abandoned: release their checkpoints, deepest first.
	for i := len(w.path) - 1; i > j; i-- {
		id := w.path[i]
		if err := rec.op("release", func() error { return w.release(ctx, id) }); err != nil {
			return err
		}
	}
	w.path = w.path[:j+1]
	return nil
}
