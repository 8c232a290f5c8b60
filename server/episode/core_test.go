package episode_test

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"path/filepath"
	"slices"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	deltagymv1 "github.com/deltagym/deltagym/clients/go/gen/deltagym/v1"
	"github.com/deltagym/deltagym/envpool"
	"github.com/deltagym/deltagym/internal/errdefs"
	"github.com/deltagym/deltagym/internal/locate"
	"github.com/deltagym/deltagym/sandbox"
	"github.com/deltagym/deltagym/sandbox/image/imagetest"
	"github.com/deltagym/deltagym/server/episode"
	"github.com/deltagym/deltagym/server/ledger"
)

// recorder keeps what the core records, in order.
type recorder struct {
	mu sync.Mutex
	// +checklocks:mu
	starts []ledger.EpisodeStart
	// +checklocks:mu
	ends []ledger.EpisodeEnd
	// +checklocks:mu
	steps []ledger.StepRow
	// +checklocks:mu
	rewards []ledger.RewardRow
	// +checklocks:mu
	ckpts []ledger.CheckpointRow
	// +checklocks:mu
	released []string
	// +checklocks:mu
	digests map[string]ledger.Digest
	// +checklocks:mu
	edges []ledger.CheckpointEdge
	// +checklocks:mu
	unstored []string // the kinds of the rows tied to an answer recorded since the last Stored
	// +checklocks:mu
	stored []string // the kinds of those rows Stored stored
	// +checklocks:mu
	storeErr error // what Stored returns (nil: the rows are stored)
}

// recorded notes a row of kind that Stored must store before the call answers.
//
// +checklocks:r.mu
func (r *recorder) recorded(kind string) { r.unstored = append(r.unstored, kind) }

func (r *recorder) Stored(context.Context) error {
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.storeErr != nil {
		return r.storeErr
	}
	r.stored = append(r.stored, r.unstored...)
	r.unstored = nil
	return nil
}

// failStores makes Stored return err (nil: succeed again).
func (r *recorder) failStores(err error) {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.storeErr = err
}

// notStored returns the kinds of the rows recorded since the last Stored.
func (r *recorder) notStored() []string {
	r.mu.Lock()
	defer r.mu.Unlock()
	return slices.Clone(r.unstored)
}

func (r *recorder) EpisodeStarted(e ledger.EpisodeStart) error {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.starts = append(r.starts, e)
	r.recorded("start")
	return nil
}

func (r *recorder) EpisodeEnded(e ledger.EpisodeEnd) error {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.ends = append(r.ends, e)
	r.recorded("end")
	return nil
}

func (r *recorder) Step(s ledger.StepRow) error {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.steps = append(r.steps, s)
	r.recorded("step")
	return nil
}

func (r *recorder) Reward(w ledger.RewardRow) error {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.rewards = append(r.rewards, w)
	r.recorded("reward")
	return nil
}

func (r *recorder) CheckpointDigest(id string, d ledger.Digest) error {
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.digests == nil {
		r.digests = map[string]ledger.Digest{}
	}
	r.digests[id] = d
	return nil
}

func (r *recorder) CheckpointEdge(e ledger.CheckpointEdge) error {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.edges = append(r.edges, e)
	r.recorded("edge")
	return nil
}

func (r *recorder) Checkpoint(c ledger.CheckpointRow) error {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.ckpts = append(r.ckpts, c)
	if c.Kind == ledger.KindUser || c.Kind == ledger.KindEvaluate { // not the pools' own, taken in the background
		r.recorded("checkpoint")
	}
	return nil
}

func (r *recorder) CheckpointReleased(id string, _ time.Time) error {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.released = append(r.released, id)
	return nil
}

// wasReleased says whether the release of checkpoint id was recorded.
func (r *recorder) wasReleased(id string) bool {
	r.mu.Lock()
	defer r.mu.Unlock()
	return slices.Contains(r.released, id)
}

// end returns how episode id ended, false if it did not.
func (r *recorder) end(id string) (ledger.EpisodeEnd, bool) {
	r.mu.Lock()
	defer r.mu.Unlock()
	for _, e := range r.ends {
		if e.ID == id {
			return e, true
		}
	}
	return ledger.EpisodeEnd{}, false
}

func (r *recorder) start(id string) (ledger.EpisodeStart, bool) {
	r.mu.Lock()
	defer r.mu.Unlock()
	for _, e := range r.starts {
		if e.ID == id {
			return e, true
		}
	}
	return ledger.EpisodeStart{}, false
}

func (r *recorder) stepsOf(id string) []ledger.StepRow {
	r.mu.Lock()
	defer r.mu.Unlock()
	var out []ledger.StepRow
	for _, s := range r.steps {
		if s.EpisodeID == id {
			out = append(out, s)
		}
	}
	return out
}

var runtimes atomic.Int64

// setup starts a runtime on the busybox image, pools of env "e" (a verifier that rewards
// /tmp/answer's number, four steps at most) and a core that records into a recorder: the
// core as a front end other than the RPC handlers drives it.
func setup(t *testing.T) (*episode.Core, *sandbox.Runtime, *recorder) {
	t.Helper()
	core, rt, rec, _ := setupWith(t, nil)
	return core, rt, rec
}

// setupWith is setup with the core's configuration changed by mod.
func setupWith(t *testing.T, mod func(*episode.Config)) (*episode.Core, *sandbox.Runtime, *recorder, *envpool.Manager) {
	t.Helper()
	return setupEnvs(t, mod, baseSpec())
}

// baseSpec is env "e" of setup.
func baseSpec() *deltagymv1.EnvSpec {
	return &deltagymv1.EnvSpec{Name: "e", Image: "default", Setup: []string{"echo base > /tmp/base"},
		Verifier: "cat /tmp/answer 2>/dev/null || echo 0", Budgets: &deltagymv1.Budgets{MaxSteps: 4}, PoolSize: 2}
}

// setupEnvs is setupWith with pools of specs.
func setupEnvs(t *testing.T, mod func(*episode.Config), specs ...*deltagymv1.EnvSpec) (*episode.Core, *sandbox.Runtime, *recorder, *envpool.Manager) {
	t.Helper()
	if os.Geteuid() != 0 {
		t.Skip("needs root: sandboxes use namespaces, mounts and cgroups")
	}
	init, err := locate.Init()
	if err != nil {
		t.Skip(err)
	}
	criu, _ := locate.CRIU() // where it is expected if not installed: forks that need it fail

	ctx := t.Context()
	cfg := sandbox.Config{DataDir: filepath.Join(t.TempDir(), "data"), InitBinary: init, CRIU: criu,
		CgroupRoot: fmt.Sprintf("dgeptest-%d-%d", os.Getpid(), runtimes.Add(1))}
	// The core is made after the runtime: the hook reaches it once it is.
	var hooked atomic.Pointer[episode.Core]
	cfg.OnStateDigest = func(id string, d sandbox.StateDigest) {
		if c := hooked.Load(); c != nil {
			c.StateDigest(id, d)
		}
	}
	rt, err := sandbox.New(ctx, cfg)
	must(t, err)
	t.Cleanup(func() {
		if err := rt.Close(context.Background()); err != nil {
			t.Errorf("closing runtime: %v", err)
		}
		if err := sandbox.Purge(cfg.DataDir); err != nil {
			t.Errorf("purging: %v", err)
		}
		for _, d := range []string{"unified/", "memory/", "pids/", "cpu/", "freezer/", ""} {
			_ = os.Remove("/sys/fs/cgroup/" + d + cfg.CgroupRoot)
		}
	})
	_, err = rt.ImportImage(ctx, "default", imagetest.Busybox(t))
	must(t, err)
	rec := &recorder{}
	log := slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: slog.LevelWarn}))
	ecfg := episode.Config{Runtime: rt, Ledger: rec, Logger: log}
	if mod != nil {
		mod(&ecfg)
	}
	core, err := episode.New(ecfg)
	must(t, err)
	hooked.Store(core)
	pools, err := envpool.New(envpool.Config{Runtime: rt, LeaseTTL: time.Minute, AcquireTimeout: time.Minute, Logger: log,
		OnCheckpoint: core.PoolCheckpoint, OnEnd: core.LeaseEnded}, specs)
	must(t, err)
	core.UsePools(pools)
	t.Cleanup(func() {
		if err := pools.Close(context.Background()); err != nil {
			t.Errorf("closing pools: %v", err)
		}
	})
	return core, rt, rec, pools
}

func must(t *testing.T, err error) {
	t.Helper()
	if err != nil {
		t.Fatal(err)
	}
}

func stepOK(t *testing.T, core *episode.Core, sb string, a episode.Action) episode.StepResult {
	t.Helper()
	r, err := core.Step(t.Context(), episode.StepRequest{SandboxID: sb, Action: a})
	must(t, err)
	return r
}

// An episode driven through the core alone: every action, the budgets, the ledger's rows, a
// restore's branch and its step numbering, a fork, an evaluation, a close.
func TestEpisodeLifecycle(t *testing.T) {
	core, rt, rec := setup(t)
	ctx := t.Context()
	rr, err := core.Reset(ctx, episode.ResetRequest{Env: "e", Run: "run", Group: "g"})
	must(t, err)
	sb, ep := rr.SandboxID, rr.EpisodeID
	if s, ok := rec.start(ep); !ok || s.Env != "e" || s.Run != "run" || s.Sandbox != sb || s.StartCheckpoint != rr.CheckpointID {
		t.Fatalf("episode start recorded as %+v (%v)", s, ok)
	}
	if r := stepOK(t, core, sb, episode.Exec{Command: "cat /tmp/base"}); string(r.Observation.Exec.Stdout) != "base\n" || r.StepIndex != 0 {
		t.Fatalf("exec: %+v", r)
	}
	if r := stepOK(t, core, sb, episode.WriteFile{Path: "/tmp/answer", Content: []byte("1\n")}); r.Observation.WriteFile.Size != 2 || r.StepIndex != 1 {
		t.Fatalf("write_file: %+v", r)
	}
	if r := stepOK(t, core, sb, episode.ReadFile{Path: "/tmp/answer", MaxBytes: 1}); string(r.Observation.ReadFile.Content) != "1" || !r.Observation.ReadFile.Truncated {
		t.Fatalf("read_file: %+v", r)
	}
	ck, err := core.Checkpoint(ctx, episode.CheckpointRequest{SandboxID: sb})
	must(t, err)
	if p, err := core.CheckpointPlace(t.Context(), ck.Info.ID); err != nil || p != (episode.Place{Env: "e", Episode: ep, Run: "run", Group: "g", Own: 3, Steps: 3, Agent: 3}) {
		t.Fatalf("the checkpoint's place: %+v, %v", p, err)
	}
	sub := stepOK(t, core, sb, episode.Submit{})
	if !sub.Terminated || sub.Reward != 1 || sub.StepIndex != 3 {
		t.Fatalf("submit: %+v", sub)
	}
	if e, ok := rec.end(ep); !ok || e.Status != ledger.StatusTerminated || e.TotalReward != 1 {
		t.Fatalf("episode end recorded as %+v (%v)", e, ok)
	}
	if steps := rec.stepsOf(ep); len(steps) != 4 || steps[3].Index != 3 || !steps[3].Terminated {
		t.Fatalf("recorded steps: %+v", steps)
	}
	if _, err := core.Step(ctx, episode.StepRequest{SandboxID: sb, Action: episode.Exec{Command: "true"}}); !errors.Is(err, episode.ErrEpisodeEnded) {
		t.Fatalf("a step after the end: %v", err)
	}

	// A restore starts an episode where the checkpoint was: its steps number on from 3, and
	// the budget of four steps truncates its first.
	rs, err := core.Restore(ctx, episode.RestoreRequest{SandboxID: sb, CheckpointID: ck.Info.ID})
	must(t, err)
	if rs.NextStepIndex != 3 || rs.EpisodeID == ep {
		t.Fatalf("restore: %+v", rs)
	}
	if s, _ := rec.start(rs.EpisodeID); s.ParentEpisode != ep || s.StartCheckpoint != ck.Info.ID || s.Run != "run" {
		t.Fatalf("branch recorded as %+v", s)
	}
	r := stepOK(t, core, sb, episode.Exec{Argv: []string{"cat", "/tmp/answer"}})
	if r.StepIndex != 3 || !r.Truncated || r.Info["truncated_by"] != "max_steps" || string(r.Observation.Exec.Stdout) != "1\n" {
		t.Fatalf("the step after the restore: %+v", r)
	}
	if e, _ := rec.end(rs.EpisodeID); e.Status != ledger.StatusTruncated {
		t.Fatalf("the branch ended %+v", e)
	}

	// A fork of the checkpoint continues its path in each child, and evaluating a child leaves
	// it as it was.
	f, err := core.Fork(ctx, episode.ForkRequest{CheckpointID: ck.Info.ID, N: 2})
	must(t, err)
	if len(f.Children) != 2 {
		t.Fatalf("fork: %+v", f)
	}
	kid := f.Children[0].SandboxID
	d, err := core.Sandbox(kid)
	must(t, err)
	if d.NextStepIndex != 3 || d.Run != "run" || d.Group != "g" || d.Done {
		t.Fatalf("a child: %+v", d)
	}
	v, err := core.Evaluate(ctx, kid)
	must(t, err)
	if v.Reward != 1 {
		t.Fatalf("evaluate: %+v", v)
	}
	// Its checkpoint is recorded, then released: nothing else would ever release it.
	var evals []string
	for _, c := range rec.ckptsOf("") {
		if c.Kind == ledger.KindEvaluate {
			evals = append(evals, c.ID)
		}
	}
	if len(evals) != 1 {
		t.Fatalf("evaluate checkpoints recorded: %v, want one", evals)
	}
	if _, err := rt.Checkpoint(evals[0]); !errors.Is(err, sandbox.ErrNotFound) {
		t.Fatalf("the evaluate checkpoint is still held: %v", err)
	}
	if !rec.wasReleased(evals[0]) {
		t.Fatalf("the release of evaluate checkpoint %s is not recorded", evals[0])
	}
	must(t, core.Close(ctx, kid))
	must(t, core.Close(ctx, kid)) // closing a closed sandbox succeeds
	if _, err := core.Touch(kid); !errors.Is(err, envpool.ErrLeaseEnded) {
		t.Fatalf("a closed sandbox: %v, want it closed", err)
	}
	if e, _ := rec.end(f.Children[0].EpisodeID); e.Status != ledger.StatusTruncated {
		t.Fatalf("a closed child's episode ended %+v", e)
	}
	if len(core.Sandboxes(episode.Filter{Run: "run"})) != 2 { // the reset sandbox and the other child
		t.Fatalf("sandboxes of run: %+v", core.Sandboxes(episode.Filter{Run: "run"}))
	}

	must(t, core.ReleaseCheckpoint(ck.Info.ID))
	if _, err := core.CheckpointPlace(t.Context(), ck.Info.ID); !errors.Is(err, sandbox.ErrNotFound) {
		t.Fatalf("a released checkpoint's place: %v", err)
	}
	if _, err := rt.Checkpoint(ck.Info.ID); !errors.Is(err, sandbox.ErrNotFound) {
		t.Fatalf("a released checkpoint: %v", err)
	}
}

// Every call answers only once the rows it recorded are stored (Recorder.Stored): the
// episode's start, its steps, rewards and checkpoints, a restore's branch, a fork's children
// and the end.
func TestAnswersAfterRowsStored(t *testing.T) {
	core, _, rec := setup(t)
	ctx := t.Context()
	check := func(call string) {
		t.Helper()
		if rows := rec.notStored(); len(rows) > 0 {
			t.Fatalf("%s answered before its rows %v were stored", call, rows)
		}
	}
	rr, err := core.Reset(ctx, episode.ResetRequest{Env: "e"})
	must(t, err)
	check("reset")
	sb := rr.SandboxID
	stepOK(t, core, sb, episode.Exec{Command: "echo 1 > /tmp/answer"})
	check("step")
	_, err = core.Step(ctx, episode.StepRequest{SandboxID: sb, Action: episode.Exec{Command: "true"}, Checkpoint: true})
	must(t, err)
	check("a step with a checkpoint")
	ck, err := core.Checkpoint(ctx, episode.CheckpointRequest{SandboxID: sb})
	must(t, err)
	check("checkpoint")
	_, err = core.Restore(ctx, episode.RestoreRequest{SandboxID: sb, CheckpointID: ck.Info.ID})
	must(t, err)
	check("restore")
	stepOK(t, core, sb, episode.Submit{})
	check("submit")
	f, err := core.Fork(ctx, episode.ForkRequest{CheckpointID: ck.Info.ID, N: 1})
	must(t, err)
	check("fork")
	kid := f.Children[0].SandboxID
	_, err = core.Evaluate(ctx, kid)
	must(t, err)
	check("evaluate")
	must(t, core.Close(ctx, kid))
	check("close")
	rec.mu.Lock()
	stored := slices.Sorted(slices.Values(rec.stored))
	rec.mu.Unlock()
	for _, kind := range []string{"checkpoint", "end", "reward", "start", "step"} {
		if !slices.Contains(stored, kind) {
			t.Fatalf("rows stored %v: no %s", stored, kind)
		}
	}
}

// A step whose rows cannot be stored fails as unavailable; it happened all the same, so the
// episode counts it, its row stays recorded, and the next step comes after it. A checkpoint
// taken by a call that fails so is released.
func TestStepFailsWhenItsRowsCannotBeStored(t *testing.T) {
	core, rt, rec := setup(t)
	ctx := t.Context()
	rr, err := core.Reset(ctx, episode.ResetRequest{Env: "e"})
	must(t, err)
	rec.failStores(fmt.Errorf("storing ledger rows: %w", ledger.ErrSpoolWrite))
	_, err = core.Step(ctx, episode.StepRequest{SandboxID: rr.SandboxID, Action: episode.Exec{Command: "echo 1 > /tmp/answer"}})
	if !errors.Is(err, ledger.ErrSpoolWrite) || !errors.Is(err, errdefs.ErrUnavailable) {
		t.Fatalf("a step whose rows cannot be stored: %v, want unavailable (the spool write)", err)
	}
	if _, err := core.Checkpoint(ctx, episode.CheckpointRequest{SandboxID: rr.SandboxID}); !errors.Is(err, errdefs.ErrUnavailable) {
		t.Fatalf("a checkpoint whose row cannot be stored: %v, want unavailable", err)
	}
	_, err = core.Step(ctx, episode.StepRequest{SandboxID: rr.SandboxID, Checkpoint: true, Action: episode.Exec{Command: "true"}})
	if !errors.Is(err, errdefs.ErrUnavailable) {
		t.Fatalf("a checkpointing step whose rows cannot be stored: %v, want unavailable", err)
	}
	if _, err := core.Fork(ctx, episode.ForkRequest{SandboxID: rr.SandboxID, N: 1}); !errors.Is(err, errdefs.ErrUnavailable) {
		t.Fatalf("a fork whose rows cannot be stored: %v, want unavailable", err)
	}
	// The checkpoints those calls took, which their errors name to no one, are released.
	var taken []string
	for _, c := range rec.ckptsOf(rr.EpisodeID) {
		taken = append(taken, c.ID)
		if _, err := rt.Checkpoint(c.ID); !errors.Is(err, sandbox.ErrNotFound) || !rec.wasReleased(c.ID) {
			t.Errorf("checkpoint %s of a call that failed is held (%v) or its release not recorded", c.ID, err)
		}
	}
	if len(taken) != 3 {
		t.Fatalf("checkpoints recorded %v, want the three calls'", taken)
	}
	rec.failStores(nil)
	r := stepOK(t, core, rr.SandboxID, episode.ReadFile{Path: "/tmp/answer"})
	if r.StepIndex != 2 || string(r.Observation.ReadFile.Content) != "1\n" {
		t.Fatalf("the step after: index %d, /tmp/answer %q; want index 2 and the first step's write", r.StepIndex, r.Observation.ReadFile.Content)
	}
	if steps := rec.stepsOf(rr.EpisodeID); len(steps) != 3 || steps[0].Index != 0 || steps[1].Index != 1 || steps[2].Index != 2 {
		t.Fatalf("recorded steps %+v, want 0, 1 and 2", steps)
	}
}

// A reset with an idempotency key returns its first result to a retry.
func TestResetIdempotent(t *testing.T) {
	core, _, _ := setup(t)
	ctx := t.Context()
	req := episode.ResetRequest{Env: "e", IdempotencyKey: "k"}
	a, err := core.Reset(ctx, req)
	must(t, err)
	b, err := core.Reset(ctx, req)
	must(t, err)
	if a.SandboxID != b.SandboxID || a.EpisodeID != b.EpisodeID {
		t.Fatalf("a retry got %s/%s, the first call %s/%s", b.SandboxID, b.EpisodeID, a.SandboxID, a.EpisodeID)
	}
	req.Run = "other"
	if _, err := core.Reset(ctx, req); !errors.Is(err, episode.ErrInvalid) {
		t.Fatalf("the key reused for another request: %v", err)
	}
}

// A Fork whose caller went away while the pools made its children closes them: nobody will
// learn their ids. The same for a Reset.
func TestAbandonedCallsCloseTheirSandboxes(t *testing.T) {
	var cancelOn sync.Map // op -> context.CancelFunc, called once the pools are done with op
	core, _, rec, pools := setupWith(t, func(c *episode.Config) {
		c.Observe = func(ctx context.Context, op string) (context.Context, func(error)) {
			return ctx, func(error) {
				if f, ok := cancelOn.LoadAndDelete(op); ok {
					f.(context.CancelFunc)()
				}
			}
		}
	})
	r, err := core.Reset(t.Context(), episode.ResetRequest{Env: "e"})
	must(t, err)
	rec.mu.Lock()
	starts := len(rec.starts)
	rec.mu.Unlock()

	ctx, cancel := context.WithCancel(t.Context())
	cancelOn.Store("fork", cancel)
	if _, err := core.Fork(ctx, episode.ForkRequest{SandboxID: r.SandboxID, N: 3}); !errors.Is(err, context.Canceled) {
		t.Fatalf("fork abandoned by its caller: %v, want context.Canceled", err)
	}
	ctx, cancel = context.WithCancel(t.Context())
	cancelOn.Store("reset", cancel)
	if _, err := core.Reset(ctx, episode.ResetRequest{Env: "e"}); !errors.Is(err, context.Canceled) {
		t.Fatalf("reset abandoned by its caller: %v, want context.Canceled", err)
	}
	if got := core.Sandboxes(episode.Filter{}); len(got) != 1 || got[0].SandboxID != r.SandboxID {
		t.Fatalf("sandboxes handed out: %+v, want only %s", got, r.SandboxID)
	}
	rec.mu.Lock()
	n := len(rec.starts)
	rec.mu.Unlock()
	if n != starts {
		t.Fatalf("%d episodes started for abandoned sandboxes", n-starts)
	}
	if n := pools.Active("e"); n != 1 {
		t.Fatalf("%d leases of env e, want the one handed over", n)
	}
}

// ckptsOf returns the checkpoint rows of episode ep ("": all).
func (r *recorder) ckptsOf(ep string) []ledger.CheckpointRow {
	r.mu.Lock()
	defer r.mu.Unlock()
	var out []ledger.CheckpointRow
	for _, c := range r.ckpts {
		if ep == "" || c.EpisodeID == ep {
			out = append(out, c)
		}
	}
	return out
}

// edgesOf returns the parents of the graph edges recorded into checkpoint id.
func (r *recorder) edgesOf(id string) []string {
	r.mu.Lock()
	defer r.mu.Unlock()
	var out []string
	for _, e := range r.edges {
		if e.ChildID == id {
			out = append(out, e.ParentID)
		}
	}
	return out
}
