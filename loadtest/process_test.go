package loadtest

import (
	"bytes"
	"errors"
	"strings"
	"testing"
	"time"

	"google.golang.org/grpc"

	deltagymv1 "github.com/deltagym/deltagym/clients/go/gen/deltagym/v1"
)

// skipUnavailable skips t when err says the env cannot run the process scenario (no
// python3 in its image).
func skipUnavailable(t *testing.T, err error) {
	t.Helper()
	if errors.Is(err, ErrUnavailable) {
		t.Skipf("rollback-process cannot run in this env: %v", err)
	}
}

// TestRollbackProcessScenario runs rollback-process against the real server for a few
// seconds in each shape: every iteration restores an 8 MiB python3 process (from its
// template; a shell's child, with the shell, from CRIU) and finds it at its checkpointed
// counter, with no errors.
func TestRollbackProcessScenario(t *testing.T) {
	s := needServer(t)
	for _, shape := range []string{ShapeSingle, ShapeThreads, ShapeTree} {
		t.Run(shape, func(t *testing.T) { rollbackProcessShape(t, s.Addr, s.Token, shape) })
	}
}

func rollbackProcessShape(t *testing.T, addr, token, shape string) {
	rep, err := Run(t.Context(), Config{Addr: addr, Token: token, Scenario: "rollback-process", Concurrency: 4,
		ProcessShape: shape, Duration: 3 * time.Second, Warmup: time.Second})
	skipUnavailable(t, err)
	if err != nil {
		t.Fatal(err)
	}
	var sum bytes.Buffer
	rep.WriteSummary(&sum)
	t.Log("\n" + sum.String())
	if rep.ErrorCount != 0 {
		t.Fatalf("errors: %v (first wrong restore: %s)", rep.Errors, rep.FirstWrong)
	}
	if rep.Iterations == 0 || rep.Unit != "rollbacks" || !strings.Contains(sum.String(), " rollbacks/s") {
		t.Fatalf("no rollbacks measured: %d %s", rep.Iterations, rep.Unit)
	}
	for _, op := range []string{"restore", "check", "change", "iteration"} {
		st := rep.Ops[op]
		if st.Count < rep.Iterations-int64(rep.Concurrency) || st.P50Ms <= 0 || st.P99Ms < st.P50Ms {
			t.Fatalf("op %s: %+v (iterations %d)", op, st, rep.Iterations)
		}
	}
}

// TestProcessVerificationDetectsWrongRestore proves the process check can fail: without
// its restore, an iteration finds the process at the changed counter (ErrWrongRestore);
// with it, the checkpointed counter is back, also after a wrong iteration.
func TestProcessVerificationDetectsWrongRestore(t *testing.T) {
	s := needServer(t)
	conn, err := grpc.NewClient(s.Addr, DialOptions(s.Token)...)
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	cfg := Config{Addr: s.Addr, Token: s.Token, Scenario: "rollback-process", ProcessMB: 2}
	if err := cfg.Validate(); err != nil {
		t.Fatal(err)
	}
	w := newWorker(cfg.Scenario, 3, deltagymv1.NewEnvServiceClient(conn), &cfg).(*rollbackProcessWorker)
	defer w.close(t.Context())
	err = w.setup(t.Context())
	skipUnavailable(t, err)
	if err != nil {
		t.Fatal(err)
	}
	rec := newRecorder()
	for i, tc := range []struct {
		name        string
		skipRestore bool
		wrong       bool
	}{
		{"restored", false, false},
		{"restored again", false, false},
		{"restore skipped", true, true},
		{"restored after a wrong one", false, false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			w.skipRestore = tc.skipRestore
			err := w.iterate(t.Context(), rec)
			switch {
			case tc.wrong && !errors.Is(err, ErrWrongRestore):
				t.Fatalf("iteration %d = %v, want ErrWrongRestore", i, err)
			case tc.wrong && errCode(err) != "wrong_restore":
				t.Fatalf("errCode = %q", errCode(err))
			case !tc.wrong && err != nil:
				t.Fatalf("iteration %d: %v", i, err)
			}
			if tc.wrong {
				// The failed check left the counter as it was; change it as the next
				// iteration expects.
				if err := w.change(t.Context(), nil); err == nil {
					t.Fatal("change after a skipped restore should find the counter two past the checkpoint")
				}
			}
		})
	}
}

// TestProcessCRIUSlot: the CRIU variant is measured when the server offers it and
// reported as not available, with the server's reason, when it answers Unimplemented.
func TestProcessCRIUSlot(t *testing.T) {
	s := needServer(t)
	v, err := MeasureProcessCRIU(t.Context(), Config{Addr: s.Addr, Token: s.Token, Concurrency: 2, Duration: 2 * time.Second, Warmup: 500 * time.Millisecond})
	skipUnavailable(t, err)
	if err != nil {
		t.Fatal(err)
	}
	var sum bytes.Buffer
	(&Report{ProcessCRIU: v, Ops: map[string]OpStats{}}).WriteSummary(&sum)
	t.Log(sum.String())
	if v.Method != ProcessCRIU {
		t.Fatalf("method %q", v.Method)
	}
	if !v.Available {
		if !strings.Contains(v.Reason, "Unimplemented") || !strings.Contains(sum.String(), "process rollback by criu: not available (") {
			t.Fatalf("CRIU not available without the server's reason: %+v\n%s", v, sum.String())
		}
		return
	}
	if v.Throughput <= 0 || v.RestoreP50Ms <= 0 || v.Errors != 0 {
		t.Fatalf("CRIU variant figures: %+v", v)
	}
}
