package loadtest

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"math"
	"os"
	"path/filepath"
	"runtime"
	"slices"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"golang.org/x/sys/unix"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
)

func TestParseMetrics(t *testing.T) {
	for _, tc := range []struct {
		name string
		text string
		want map[string]float64
		ok   bool
	}{
		{"labels and plain", `# HELP deltagym_checkpoints checkpoints
# TYPE deltagym_checkpoints gauge
deltagym_checkpoints{otel_scope_name="x",otel_scope_version=""} 12
process_resident_memory_bytes 2.807808e+07
`, map[string]float64{"deltagym_checkpoints": 12, "process_resident_memory_bytes": 28078080}, true},
		{"summed over label sets", "a{code=\"ok\"} 1\na{code=\"x\"} 2\n", map[string]float64{"a": 3}, true},
		{"label value with braces and spaces", "a{msg=\"} {\"} 5 1700000000\n", map[string]float64{"a": 5}, true},
		{"bad value", "a 1x\n", nil, false},
		{"no value", "a{b=\"c\"}\n", nil, false},
		{"unterminated labels", "a{b=\"c\" 1\n", nil, false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			got, err := parseMetrics(strings.NewReader(tc.text))
			if (err == nil) != tc.ok {
				t.Fatalf("parseMetrics = %v, %v; want ok=%v", got, err, tc.ok)
			}
			if err != nil {
				if !errors.Is(err, ErrUnexpected) {
					t.Fatalf("error %v is not ErrUnexpected", err)
				}
				return
			}
			if len(got) != len(tc.want) {
				t.Fatalf("parseMetrics = %v, want %v", got, tc.want)
			}
			for k, v := range tc.want {
				if got[k] != v {
					t.Fatalf("%s = %v, want %v (all: %v)", k, got[k], v, got)
				}
			}
		})
	}
}

// series builds a timeline of n one-second samples after a 2 s warm-up (two samples), with
// per-second values from f(i) for i in [0, n).
func series(n int, f func(i int) (perSec float64, rss, backlog int64)) []Sample {
	var tl []Sample
	for i := -2; i < n; i++ {
		p, rss, b := f(max(i, 0))
		tl = append(tl, Sample{AtSec: float64(i + 3), IntervalSec: 1, Iterations: int64(p), PerSec: p, ServerRSS: rss,
			DiscardBacklog: b, ServerCPU: 0.5, SandboxCPU: 0.25, LoadgenCPU: 0.1, MachineBusy: 0.5})
	}
	return tl
}

func TestMeasureFlatness(t *testing.T) {
	const mb = 1 << 20
	for _, tc := range []struct {
		name                     string
		tl                       []Sample
		thr, rss, backlog        bool
		verdict                  string
		ratio                    float64
		firstBacklog, lastBacklg int64
	}{
		{"flat", series(300, func(i int) (float64, int64, int64) { return 2000 + float64(i%7), 100 * mb, int64(i % 5) }),
			true, true, true, "flat", 1, 4, 4},
		{"throughput falls", series(300, func(i int) (float64, int64, int64) { return 2000 - 4*float64(i), 100 * mb, 2 }),
			false, true, true, "NOT flat: throughput", 0.49, 2, 2},
		{"rss grows", series(300, func(i int) (float64, int64, int64) { return 2000, int64(100+i) * mb, 2 }),
			true, false, true, "NOT flat: server RSS", 1, 2, 2},
		{"backlog grows", series(300, func(i int) (float64, int64, int64) { return 2000, 100 * mb, int64(i) }),
			true, true, false, "NOT flat: discard backlog", 1, 59, 299},
		{"short run uses thirds", series(9, func(i int) (float64, int64, int64) { return 100, 50 * mb, 0 }),
			true, true, true, "flat", 1, 0, 0},
	} {
		t.Run(tc.name, func(t *testing.T) {
			f := measureFlatness(tc.tl, 2, float64(len(tc.tl)-2), 2)
			if f == nil {
				t.Fatal("no flatness for a long enough timeline")
			}
			if f.ThroughputFlat != tc.thr || f.RSSFlat != tc.rss || f.BacklogFlat != tc.backlog || !strings.HasPrefix(f.Verdict, tc.verdict) {
				t.Fatalf("flatness %+v, want throughput %v rss %v backlog %v verdict %q", f, tc.thr, tc.rss, tc.backlog, tc.verdict)
			}
			if math.Abs(f.ThroughputRatio-tc.ratio) > 0.02 || f.FirstBacklogMax != tc.firstBacklog || f.LastBacklogMax != tc.lastBacklg {
				t.Fatalf("ratio %.3f backlog %d -> %d; want %.2f, %d -> %d", f.ThroughputRatio, f.FirstBacklogMax, f.LastBacklogMax,
					tc.ratio, tc.firstBacklog, tc.lastBacklg)
			}
			if f.ServerCores != 0.5 || f.SandboxCores != 0.25 || f.MachineCores != 1 {
				t.Fatalf("cores %+v", f)
			}
			// CPU per iteration over the measured part, and what 2 CPUs allow at that cost.
			var n int64
			for _, x := range tc.tl[2:] {
				n += x.Iterations
			}
			per := float64(len(tc.tl)-2) / float64(n)
			if math.Abs(f.ServerCPUPerIter-0.5*per) > 1e-9 || math.Abs(f.SandboxCPUPerIter-0.25*per) > 1e-9 ||
				math.Abs(f.LoadgenCPUPerIter-0.1*per) > 1e-9 || math.Abs(f.MachineCPUPerIter-per) > 1e-9 || math.Abs(f.CPUBoundPerSec-2/per) > 1e-6 {
				t.Fatalf("CPU per iteration %+v, want server %g, sandboxes %g, loadgen %g, machine %g s, bound %g/s", f, 0.5*per, 0.25*per, 0.1*per, per, 2/per)
			}
			if len(tc.tl) > 100 && f.WindowSec != 60 {
				t.Fatalf("window %v s, want 60", f.WindowSec)
			}
		})
	}
	if f := measureFlatness(series(1, func(int) (float64, int64, int64) { return 1, 1, 0 }), 2, 1, 2); f != nil {
		t.Fatalf("flatness of one measured sample: %+v", f)
	}
}

// TestFlatnessMachineSpeed: a run whose throughput falls while the server's CPU per second
// holds and the fixed task slows as much is reported with the machine's speed beside the
// verdict, window medians of the probe and the server's CPU per iteration in each window.
func TestFlatnessMachineSpeed(t *testing.T) {
	for _, tc := range []struct {
		name       string
		probeEnd   float64 // the probe's time at the end, in ms (1 at the start)
		thrEnd     float64 // the throughput at the end (2000 at the start)
		wantSpeed  string
		wantVerdic string
	}{
		{"machine slows", 1.4, 1400, "the machine ran user-space code slower at the end", "NOT flat: throughput"},
		{"server slows", 1, 1400, "the machine's user-space speed held", "NOT flat: throughput"},
		{"machine speeds up", 0.7, 2000, "the machine ran user-space code faster at the end", "flat"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			const n = 300
			at := func(i int, from, to float64) float64 { return from + (to-from)*float64(i)/(n-1) }
			var tl []Sample
			for i := -2; i < n; i++ {
				j := max(i, 0)
				p := at(j, 2000, tc.thrEnd)
				tl = append(tl, Sample{AtSec: float64(i + 3), IntervalSec: 1, Iterations: int64(p), PerSec: p, ServerRSS: 64 << 20,
					ServerCPU: 1.3, SandboxCPU: 0, LoadgenCPU: 0.2, MachineBusy: 0.8, ProbeCPU: at(j, 1, tc.probeEnd) / 1000})
			}
			f := measureFlatness(tl, 2, n, 2)
			if f == nil || !strings.HasPrefix(f.Verdict, tc.wantVerdic) {
				t.Fatalf("flatness %+v, want verdict %q", f, tc.wantVerdic)
			}
			// Window medians (the upper one of the 60 samples of each minute): samples 30
			// and n-30 when the probe rises, 29 and n-31 when it falls.
			i0, i1 := 30, n-30
			if tc.probeEnd < 1 {
				i0, i1 = 29, n-31
			}
			wantFirst, wantLast := at(i0, 1, tc.probeEnd)/1000, at(i1, 1, tc.probeEnd)/1000
			if math.Abs(f.FirstProbeCPU-wantFirst) > 1e-12 || math.Abs(f.LastProbeCPU-wantLast) > 1e-12 {
				t.Fatalf("probe %g -> %g s, want %g -> %g", f.FirstProbeCPU, f.LastProbeCPU, wantFirst, wantLast)
			}
			var it0, it1 int64
			for i, x := range tl[2:] {
				if i < 60 {
					it0 += x.Iterations
				}
				if i >= n-60 {
					it1 += x.Iterations
				}
			}
			if math.Abs(f.FirstServerCPUPerIter-1.3*60/float64(it0)) > 1e-9 || math.Abs(f.LastServerCPUPerIter-1.3*60/float64(it1)) > 1e-9 {
				t.Fatalf("server CPU per iteration %g -> %g s, want %g -> %g", f.FirstServerCPUPerIter, f.LastServerCPUPerIter,
					1.3*60/float64(it0), 1.3*60/float64(it1))
			}
			var sum bytes.Buffer
			(&Report{Unit: "rollbacks", SampleSec: 1, WarmupSec: 2, Timeline: tl, Flatness: f, Machine: Machine{CPUs: 2}}).writeTimeline(&sum)
			for _, want := range []string{"probe ms", "machine speed (first vs last 60s): a fixed user-space task took", "the server's CPU per iteration", tc.wantSpeed} {
				if !strings.Contains(sum.String(), want) {
					t.Fatalf("summary lacks %q:\n%s", want, sum.String())
				}
			}
		})
	}
	// Without probe readings, no speed line.
	f := measureFlatness(series(300, func(int) (float64, int64, int64) { return 2000, 64 << 20, 0 }), 2, 300, 2)
	if f.FirstProbeCPU != -1 || f.LastProbeCPU != -1 {
		t.Fatalf("probe %g -> %g with no readings, want -1", f.FirstProbeCPU, f.LastProbeCPU)
	}
}

// TestSpeedProbe: the fixed task takes some CPU time, the same within a factor on an idle
// thread, and counts only the thread's own: with a spinning thread on the same CPU it takes
// about twice as long by the clock, not in CPU time.
func TestSpeedProbe(t *testing.T) {
	p := newSpeedProbe()
	var v []float64
	for range 5 {
		x := p.run()
		if x <= 0 || x > 1 {
			t.Fatalf("probe took %g s of CPU", x)
		}
		v = append(v, x)
	}
	lo, hi := slices.Min(v), slices.Max(v)
	if hi > 3*lo {
		t.Fatalf("probe times %v vary more than threefold", v)
	}

	// Both threads on CPU 0 (this goroutine's thread stays locked: it ends with the test).
	var cpu0 unix.CPUSet
	cpu0.Set(0)
	runtime.LockOSThread()
	if err := unix.SchedSetaffinity(0, &cpu0); err != nil {
		t.Skipf("cannot pin threads: %v", err)
	}
	var stop atomic.Bool
	spinning := make(chan error, 1)
	go func() {
		runtime.LockOSThread() // ends with the goroutine
		spinning <- unix.SchedSetaffinity(0, &cpu0)
		for !stop.Load() { // spins: the probes share the CPU with it
		}
	}()
	defer stop.Store(true)
	if err := <-spinning; err != nil {
		t.Skipf("cannot pin threads: %v", err)
	}
	var cpu float64
	start := time.Now()
	for range 20 {
		cpu += p.run()
	}
	wall := time.Since(start).Seconds()
	if cpu > 20*3*slices.Max(v) || wall < 1.3*cpu {
		t.Fatalf("20 probes sharing a CPU with a spinner: %.1f ms of CPU in %.1f ms (alone: %v s each)", 1000*cpu, 1000*wall, v)
	}
	t.Logf("20 probes sharing a CPU with a spinner: %.1f ms of CPU in %.1f ms", 1000*cpu, 1000*wall)
}

// TestTimeline runs the rollback scenarios against the real server for a few seconds with
// 1 s samples: with the server's PID (RSS and CPU from /proc, sandbox CPU from its cgroup)
// and without it (RSS and CPU from the server's /metrics). Every sample has the server's
// runtime gauges, and the summary and JSON carry the table and the flatness verdict.
func TestTimeline(t *testing.T) {
	s := needServer(t)
	for _, tc := range []struct {
		name     string
		scenario string
		pid      int
		cpuStat  string
	}{
		// rollback-exec runs a process in each sandbox per iteration: sandbox CPU shows.
		{"proc", "rollback-exec", s.PID, s.SandboxCPUStat()},
		{"metrics", "rollback", 0, ""},
	} {
		t.Run(tc.name, func(t *testing.T) {
			const conc = 8
			rep, err := Run(t.Context(), Config{Addr: s.Addr, Token: s.Token, Scenario: tc.scenario, Concurrency: conc, Duration: 4 * time.Second,
				Warmup: time.Second, SampleInterval: time.Second, ServerPID: tc.pid, SandboxCPUStat: tc.cpuStat})
			if err != nil {
				t.Fatal(err)
			}
			var sum bytes.Buffer
			rep.WriteSummary(&sum)
			t.Log("\n" + sum.String())
			if rep.ErrorCount != 0 {
				t.Fatalf("errors: %v", rep.Errors)
			}
			if n := len(rep.Timeline); n < 4 || n > 5 {
				t.Fatalf("%d samples in a 5 s run at 1 s", n)
			}
			var iters int64
			var srvCPU, boxCPU, genCPU float64
			for i, x := range rep.Timeline {
				if x.IntervalSec < 0.5 || x.IntervalSec > 2 || math.Abs(x.PerSec-float64(x.Iterations)/x.IntervalSec) > 1e-6 {
					t.Fatalf("sample %d: %+v", i, x)
				}
				if x.ServerRSS < 8<<20 || x.DiscardBacklog < 0 || x.LiveSandboxes < conc || x.Checkpoints < conc || x.ServerCPU < 0 {
					t.Fatalf("sample %d lacks the server's gauges: %+v", i, x)
				}
				if x.ProbeCPU <= 0 {
					t.Fatalf("sample %d has no probe time: %+v", i, x)
				}
				if (x.SandboxCPU >= 0) != (tc.cpuStat != "") {
					t.Fatalf("sample %d: sandbox CPU %v with cpu.stat %q", i, x.SandboxCPU, tc.cpuStat)
				}
				iters += x.Iterations
				srvCPU += x.ServerCPU
				boxCPU += x.SandboxCPU
				genCPU += x.LoadgenCPU
			}
			if iters < rep.Iterations/2 || srvCPU <= 0 || genCPU <= 0 || (tc.cpuStat != "" && boxCPU <= 0) {
				t.Fatalf("timeline totals: %d iterations (report %d), CPU server %.2f sandboxes %.2f load generator %.2f",
					iters, rep.Iterations, srvCPU, boxCPU, genCPU)
			}
			f := rep.Flatness
			if f == nil || f.FirstPerSec <= 0 || f.LastPerSec <= 0 || f.FirstRSS <= 0 || f.Verdict == "" || f.ServerCores <= 0 {
				t.Fatalf("flatness: %+v", f)
			}
			for _, want := range []string{"timeline (1s samples", "rollbacks/s", "flatness (first vs last", "CPU over the measured run", "CPU per iteration: server ", "probe ms", "machine speed (first vs last"} {
				if !strings.Contains(sum.String(), want) {
					t.Fatalf("summary lacks %q:\n%s", want, sum.String())
				}
			}
			path := filepath.Join(t.TempDir(), "r.json")
			if err := rep.WriteJSON(path); err != nil {
				t.Fatal(err)
			}
			var back Report
			b, _ := os.ReadFile(path)
			if err := json.Unmarshal(b, &back); err != nil || len(back.Timeline) != len(rep.Timeline) || back.Flatness == nil ||
				back.Timeline[0].Checkpoints != rep.Timeline[0].Checkpoints || back.SampleSec != 1 {
				t.Fatalf("JSON timeline does not round-trip: %v", err)
			}
		})
	}
}

// sleeper is a worker whose iterations take d.
type sleeper struct{ d time.Duration }

func (sleeper) setup(context.Context) error { return nil }
func (s sleeper) iterate(ctx context.Context, _ *recorder) error {
	select {
	case <-time.After(s.d):
		return nil
	case <-ctx.Done():
		return ctx.Err()
	}
}
func (sleeper) close(context.Context) {}

// Throughput counts the iterations that end inside the measured window, wherever they began:
// iterations longer than the warm-up (a GRPO group) are not lost to the window's edges. Four
// workers of 300 ms iterations, 100 ms of warm-up and 1 s measured: each ends iterations at
// 0.3, 0.6 and 0.9 s, twelve in all (counting only those that began in the window gave 8).
func TestThroughputCountsIterationsEndingInWindow(t *testing.T) {
	rec := newRecorder()
	start := time.Now()
	rec.measureFrom = start.Add(100 * time.Millisecond)
	rec.measureTo = rec.measureFrom.Add(time.Second)
	ctx, cancel := context.WithDeadline(t.Context(), rec.measureTo)
	defer cancel()
	workers := []worker{sleeper{300 * time.Millisecond}, sleeper{300 * time.Millisecond}, sleeper{300 * time.Millisecond}, sleeper{300 * time.Millisecond}}
	closedLoop(ctx, Config{}, rec, workers)
	if n := rec.iterations.Load(); n != 12 {
		t.Fatalf("%d iterations counted in the window, want 12", n)
	}
	rec.mu.Lock()
	n := rec.hists["iteration"].TotalCount()
	rec.mu.Unlock()
	if n != 8 {
		t.Fatalf("%d iteration latencies, want the 8 that began in the window", n)
	}
}

// A set-up that fails the same way for every sandbox says so once, with the count, and an
// unreachable server gets advice.
func TestSetupError(t *testing.T) {
	errs := make([]error, 64)
	for i := range errs {
		errs[i] = fmt.Errorf("reset: %w", status.Error(codes.Unavailable, "connection refused"))
	}
	err := setupError("127.0.0.1:1", errs)
	if err == nil || strings.Count(err.Error(), "connection refused") != 1 || !strings.Contains(err.Error(), "64 x reset") ||
		!strings.Contains(err.Error(), "no deltagym server answers at 127.0.0.1:1") {
		t.Fatalf("setupError = %v", err)
	}
	errs = make([]error, 4)
	errs[2] = status.Error(codes.FailedPrecondition, "env not ready")
	if err := setupError("x:1", errs); err == nil || strings.Contains(err.Error(), "no deltagym server") || !strings.Contains(err.Error(), "1 of 4") {
		t.Fatalf("setupError = %v", err)
	}
	if err := setupError("x:1", make([]error, 3)); err != nil {
		t.Fatalf("setupError of no failures = %v", err)
	}
}
