package loadtest

import (
	"bytes"
	"encoding/json"
	"errors"
	"image/png"
	"os"
	"path/filepath"
	"slices"
	"sync"
	"testing"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	deltagymv1 "github.com/deltagym/deltagym/clients/go/gen/deltagym/v1"
)

func TestConfigValidate(t *testing.T) {
	for _, tc := range []struct {
		name string
		cfg  Config
		ok   bool
	}{
		{"defaults", Config{Addr: "127.0.0.1:1"}, true},
		{"no address", Config{}, false},
		{"unknown scenario", Config{Addr: "x:1", Scenario: "nope"}, false},
		{"negative rate", Config{Addr: "x:1", Rate: -1}, false},
		{"tiny file", Config{Addr: "x:1", FileSize: 3}, false},
		{"negative concurrency", Config{Addr: "x:1", Concurrency: -2}, false},
		{"tiny sample interval", Config{Addr: "x:1", SampleInterval: time.Millisecond}, false},
		{"rollback-process", Config{Addr: "x:1", Scenario: "rollback-process"}, true},
		{"negative process size", Config{Addr: "x:1", ProcessMB: -1}, false},
		{"unknown process method", Config{Addr: "x:1", ProcessMethod: "dump"}, false},
		{"unknown process shape", Config{Addr: "x:1", ProcessShape: "ring"}, false},
		{"threads", Config{Addr: "x:1", Scenario: "rollback-process", ProcessShape: ShapeThreads}, true},
		{"cluster by DNS", Config{Addr: "dns:nodes.example:8080", Scenario: "grpo"}, true},
		{"cluster by list", Config{Addr: "10.0.0.1:8080,10.0.0.2:8080"}, true},
		{"cluster by DNS without a port", Config{Addr: "dns:nodes.example"}, false},
		{"cluster list of nothing", Config{Addr: ", ,"}, false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			err := tc.cfg.Validate()
			if (err == nil) != tc.ok {
				t.Fatalf("Validate() = %v, want ok=%v", err, tc.ok)
			}
			if err != nil && !errors.Is(err, ErrInvalid) {
				t.Fatalf("Validate() = %v, want ErrInvalid", err)
			}
			if tc.ok && (tc.cfg.Concurrency != 64 || tc.cfg.FileSize != 4096 || tc.cfg.ProcessMB != 8 || tc.cfg.ProcessMethod != ProcessTemplate) {
				t.Fatalf("defaults not filled in: %+v", tc.cfg)
			}
		})
	}
}

// TestRollbackScenario runs the rollback scenario against the real server for a few seconds:
// no errors, rollbacks counted, every operation measured, and the report's outputs written.
func TestRollbackScenario(t *testing.T) {
	s := needServer(t)
	// Over a StepStream the restore rides on the read.
	stream, err := Run(t.Context(), Config{Addr: s.Addr, Token: s.Token, Scenario: "rollback", API: APIStream, Concurrency: 8, Duration: 2 * time.Second, Warmup: time.Second})
	if err != nil {
		t.Fatal(err)
	}
	checkRollbacks(t, stream, "restore+read_file", "write_file", "iteration")
	rep, err := Run(t.Context(), Config{Addr: s.Addr, Token: s.Token, Scenario: "rollback", Concurrency: 8, Duration: 4 * time.Second, Warmup: time.Second})
	if err != nil {
		t.Fatal(err)
	}
	sum := checkRollbacks(t, rep, "restore", "read_file", "write_file", "iteration")
	if !bytes.Contains(sum.Bytes(), []byte(" rollbacks/s")) {
		t.Fatalf("summary has no rollbacks/s line:\n%s", sum.String())
	}
	dir := t.TempDir()
	if err := rep.WriteJSON(filepath.Join(dir, "r.json")); err != nil {
		t.Fatal(err)
	}
	var back Report
	b, _ := os.ReadFile(filepath.Join(dir, "r.json"))
	if err := json.Unmarshal(b, &back); err != nil || back.Iterations != rep.Iterations || back.Ops["restore"].HistB64 == "" {
		t.Fatalf("JSON report does not round-trip: %v", err)
	}
	if err := rep.WritePlot(filepath.Join(dir, "cdf.png")); err != nil {
		t.Fatal(err)
	}
	f, _ := os.Open(filepath.Join(dir, "cdf.png"))
	defer f.Close()
	img, err := png.Decode(f)
	if err != nil || img.Bounds().Dx() != 1000 {
		t.Fatalf("plot is not a 1000-pixel-wide PNG: %v", err)
	}
}

// checkRollbacks checks a rollback run's report: no error, and each of ops timed once per
// iteration at least. It returns the printed summary.
func checkRollbacks(t *testing.T, rep *Report, ops ...string) *bytes.Buffer {
	t.Helper()
	var sum bytes.Buffer
	rep.WriteSummary(&sum)
	t.Log("\n" + sum.String())
	if rep.ErrorCount != 0 || len(rep.Errors) != 0 {
		t.Fatalf("api %s: errors: %v (first wrong restore: %s)", rep.API, rep.Errors, rep.FirstWrong)
	}
	if rep.Iterations == 0 || rep.Throughput <= 0 {
		t.Fatalf("api %s: no rollbacks measured: %+v", rep.API, rep)
	}
	for _, op := range ops {
		st, ok := rep.Ops[op]
		// Iterations count those that end in the window, ops those that begin in it: the
		// iterations in flight when the window opened make the difference.
		if !ok || st.Count < rep.Iterations-int64(rep.Concurrency) || st.P50Ms <= 0 || st.P99Ms < st.P50Ms || st.MaxMs < st.P99Ms {
			t.Fatalf("api %s: op %s: %+v (iterations %d)", rep.API, op, st, rep.Iterations)
		}
	}
	return &sum
}

// TestVerificationDetectsWrongRestore proves the scenarios' checks can fail: an iteration
// whose restore is skipped finds the file changed since the checkpoint and reports
// ErrWrongRestore, while the same worker with its restore passes.
func TestVerificationDetectsWrongRestore(t *testing.T) {
	s := needServer(t)
	conn, err := grpc.NewClient(s.Addr, DialOptions(s.Token)...)
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	c := deltagymv1.NewEnvServiceClient(conn)
	rec := newRecorder()
	for _, tc := range []struct{ name, api string }{{"rollback", APIUnary}, {"rollback-exec", APIUnary}, {"rollback", APIStream}, {"rollback-exec", APIStream}} {
		name := tc.name
		t.Run(name+"/"+tc.api, func(t *testing.T) {
			cfg := Config{Addr: s.Addr, Token: s.Token, Scenario: name, API: tc.api}
			if err := cfg.Validate(); err != nil {
				t.Fatal(err)
			}
			w := newWorker(name, 1, c, &cfg)
			skip := func(v bool) {
				switch w := w.(type) {
				case *rollbackWorker:
					w.skipRestore = v
				case *rollbackExecWorker:
					w.skipRestore = v
				}
			}
			if err := w.setup(t.Context()); err != nil {
				t.Fatal(err)
			}
			defer w.close(t.Context())
			if err := w.iterate(t.Context(), rec); err != nil {
				t.Fatalf("iteration with restore: %v", err)
			}
			skip(true)
			err := w.iterate(t.Context(), rec)
			if !errors.Is(err, ErrWrongRestore) {
				t.Fatalf("iteration without restore = %v, want ErrWrongRestore", err)
			}
			if errCode(err) != "wrong_restore" {
				t.Fatalf("errCode = %q", errCode(err))
			}
			skip(false)
			if err := w.iterate(t.Context(), rec); err != nil {
				t.Fatalf("iteration with restore after a wrong one: %v", err)
			}
		})
	}
}

// TestScenarios runs each other scenario briefly against the real server, with no errors,
// and leaves no checkpoint behind: each one a worker took is released by the end of the run
// (a second release is NotFound).
func TestScenarios(t *testing.T) {
	s := needServer(t)
	conn, err := grpc.NewClient(s.Addr, DialOptions(s.Token)...)
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	client := deltagymv1.NewEnvServiceClient(conn)
	var mu sync.Mutex
	var taken []string
	checkpointTaken = func(id string) {
		mu.Lock()
		taken = append(taken, id)
		mu.Unlock()
	}
	t.Cleanup(func() { checkpointTaken = nil })
	for _, tc := range []struct {
		scenario string
		ops      []string
	}{
		{"rollback-exec", []string{"restore", "exec"}},
		{"steps", []string{"exec"}},
		{"grpo", []string{"fork", "step", "evaluate", "close"}},
		{"tree", []string{"step_checkpoint", "restore", "read_file"}},
		{"mixed", []string{"restore", "exec", "fork", "step_checkpoint"}},
	} {
		t.Run(tc.scenario, func(t *testing.T) {
			rep, err := Run(t.Context(), Config{Addr: s.Addr, Token: s.Token, Scenario: tc.scenario, Concurrency: 4, Group: 4,
				Duration: 3 * time.Second, Warmup: 500 * time.Millisecond})
			if err != nil {
				t.Fatal(err)
			}
			if rep.ErrorCount != 0 {
				t.Fatalf("errors: %v (%s)", rep.Errors, rep.FirstWrong)
			}
			if rep.Iterations == 0 {
				t.Fatal("no iterations")
			}
			for _, op := range tc.ops {
				if rep.Ops[op].Count == 0 {
					t.Fatalf("op %s never measured: %v", op, rep.Ops)
				}
			}
			mu.Lock()
			ids := taken
			taken = nil
			mu.Unlock()
			if len(ids) == 0 {
				t.Fatal("no checkpoint recorded as taken")
			}
			for _, id := range ids {
				_, err := client.ReleaseCheckpoint(t.Context(), &deltagymv1.ReleaseCheckpointRequest{CheckpointId: id})
				if status.Code(err) != codes.NotFound {
					t.Fatalf("checkpoint %s (#%d of %d taken) left behind: a second release gave %v, want NotFound", id, slices.Index(ids, id), len(ids), err)
				}
			}
		})
	}
}

// TestOpenLoop: at a rate the server easily sustains, the iterations measured match the
// target rate, and the latency counts from the due time.
func TestOpenLoop(t *testing.T) {
	s := needServer(t)
	const rate, secs = 20.0, 3
	rep, err := Run(t.Context(), Config{Addr: s.Addr, Token: s.Token, Scenario: "rollback", Concurrency: 8, Rate: rate,
		Duration: secs * time.Second, Warmup: 500 * time.Millisecond})
	if err != nil {
		t.Fatal(err)
	}
	if rep.ErrorCount != 0 {
		t.Fatalf("errors: %v", rep.Errors)
	}
	if got := rep.Throughput; got < rate*0.7 || got > rate*1.1 {
		t.Fatalf("open-loop throughput %.1f/s, want about %.0f/s", got, rate)
	}
}

func TestFullCopy(t *testing.T) {
	if os.Geteuid() != 0 {
		// Not privileged: it only copies files; run it anyway.
		t.Log("not root: full-copy baseline uses only ordinary files")
	}
	res, err := MeasureFullCopy(t.Context(), FullCopyConfig{Dir: t.TempDir(), Files: 200, Changed: 20, ChangedBytes: 20 * 10_000, Rounds: 3})
	if err != nil {
		t.Fatal(err)
	}
	if want := int64(180*4096 + 20*10_000); res.RootBytes != want {
		t.Fatalf("root is %d bytes, want %d", res.RootBytes, want)
	}
	if res.WholeRootMs <= 0 || res.UpperOnlyMs <= 0 || len(res.WholeRootRuns) != 3 {
		t.Fatalf("timings: %+v", res)
	}
	// As root the copies are made on tmpfs, as the server's layers are, and nothing stays
	// mounted.
	if os.Geteuid() == 0 && res.Medium != "tmpfs" {
		t.Fatalf("copied on %q, want tmpfs", res.Medium)
	}
	if b, _ := os.ReadFile("/proc/self/mountinfo"); bytes.Contains(b, []byte("dg-fullcopy")) {
		t.Fatal("the full-copy tmpfs is still mounted in the test's namespace")
	}
}
