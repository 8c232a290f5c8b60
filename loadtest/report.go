package loadtest

import (
	"encoding/json"
	"fmt"
	"io"
	"maps"
	"math"
	"os"
	"slices"
	"strconv"
	"strings"
	"syscall"
	"time"

	"github.com/HdrHistogram/hdrhistogram-go"
)

// Report is the result of one Run, as written by WriteJSON.
type Report struct {
	Scenario    string  `json:"scenario"`
	API         string  `json:"api"`
	Conns       int     `json:"conns"` // HTTP/2 connections the workers shared
	Unit        string  `json:"unit"`
	Concurrency int     `json:"concurrency"`
	Rate        float64 `json:"target_rate,omitempty"`
	DurationSec float64 `json:"duration_seconds"`
	WarmupSec   float64 `json:"warmup_seconds"`
	SetupSec    float64 `json:"setup_seconds"`
	Iterations  int64   `json:"iterations"`
	Throughput  float64 `json:"throughput_per_second"`
	ErrorCount  int64   `json:"error_count"`
	Backlog     int64   `json:"open_loop_backlog,omitempty"`
	// Interrupted: the run was stopped (SIGINT, SIGTERM) before its end; the report covers
	// the measured time until then (DurationSec).
	Interrupted bool   `json:"interrupted,omitempty"`
	FirstWrong  string `json:"first_wrong_restore,omitempty"`
	// Ops holds latency per operation; "iteration" is a whole iteration.
	Ops map[string]OpStats `json:"ops"`
	// SampleSec is the interval of the timeline's samples.
	SampleSec float64 `json:"sample_seconds"`
	// Timeline has one sample per SampleSec of the run (warm-up included).
	Timeline []Sample `json:"timeline"`
	// Flatness compares the first and last window of the measured timeline.
	Flatness *Flatness `json:"flatness,omitempty"`
	// Nodes counts the sandboxes the run made on each node of a cluster (Resets and fork
	// children), by node name; empty against one server.
	Nodes map[string]int `json:"nodes,omitempty"`
	// Errors counts failures by "operation: code".
	Errors map[string]int64 `json:"errors"`
	// Machine describes the load on the machine during the run.
	Machine Machine `json:"machine"`
	// FullCopy is the full-copy baseline, when measured in the same run.
	FullCopy *FullCopyResult `json:"full_copy,omitempty"`
	// ProcessCRIU is the CRIU variant of the rollback-process scenario, measured (or found
	// not available) in the same run.
	ProcessCRIU *ProcessVariant `json:"process_criu,omitempty"`

	hists map[string]*hdrhistogram.Histogram
}

// OpStats is the latency distribution of one operation, in milliseconds.
type OpStats struct {
	Count   int64   `json:"count"`
	PerSec  float64 `json:"per_second"`
	MeanMs  float64 `json:"mean_ms"`
	P50Ms   float64 `json:"p50_ms"`
	P90Ms   float64 `json:"p90_ms"`
	P99Ms   float64 `json:"p99_ms"`
	P999Ms  float64 `json:"p999_ms"`
	MaxMs   float64 `json:"max_ms"`
	HistB64 string  `json:"hdr_histogram,omitempty"` // the HDR histogram (µs), base64 V2 encoding
}

// Machine is what else ran on the machine: load averages before and after, CPU counts,
// and CPU seconds used by the load generator and (when known) the server process tree.
type Machine struct {
	CPUs            int        `json:"cpus"`
	LoadBefore      [3]float64 `json:"loadavg_before"`
	LoadAfter       [3]float64 `json:"loadavg_after"`
	LoadgenCPUSec   float64    `json:"loadgen_cpu_seconds"`
	ServerCPUSec    float64    `json:"server_cpu_seconds,omitempty"`
	SandboxCPUSec   float64    `json:"sandbox_cpu_seconds,omitempty"`
	MachineBusyFrac float64    `json:"machine_busy_fraction"`
	ServerRSSBytes  int64      `json:"server_rss_bytes,omitempty"`
}

func ms(us int64) float64 { return float64(us) / 1000 }

func newReport(cfg Config, rec *recorder, setup time.Duration) *Report {
	r := &Report{Scenario: cfg.Scenario, API: cfg.API, Conns: cfg.Conns, Unit: unit(cfg.Scenario), Concurrency: cfg.Concurrency, Rate: cfg.Rate,
		DurationSec: cfg.Duration.Seconds(), WarmupSec: cfg.Warmup.Seconds(), SetupSec: setup.Seconds(),
		Iterations: rec.iterations.Load(), Ops: map[string]OpStats{}, Errors: map[string]int64{}, hists: map[string]*hdrhistogram.Histogram{}}
	r.Throughput = float64(r.Iterations) / cfg.Duration.Seconds()
	rec.mu.Lock()
	defer rec.mu.Unlock()
	for op, h := range rec.hists {
		r.hists[op] = h
		enc, _ := h.Encode(hdrhistogram.V2CompressedEncodingCookieBase)
		r.Ops[op] = OpStats{Count: h.TotalCount(), PerSec: float64(h.TotalCount()) / cfg.Duration.Seconds(), MeanMs: h.Mean() / 1000,
			P50Ms: ms(h.ValueAtQuantile(50)), P90Ms: ms(h.ValueAtQuantile(90)), P99Ms: ms(h.ValueAtQuantile(99)),
			P999Ms: ms(h.ValueAtQuantile(99.9)), MaxMs: ms(h.Max()), HistB64: string(enc)}
	}
	for k, v := range rec.errors {
		r.Errors[k] = v
		r.ErrorCount += v
	}
	r.FirstWrong = rec.firstWrong
	r.Timeline = rec.timeline
	r.SampleSec = cfg.SampleInterval.Seconds()
	r.Flatness = measureFlatness(r.Timeline, r.WarmupSec, r.DurationSec, numCPU())
	return r
}

// WriteSummary prints the human summary; its throughput line reads "<N> <unit>/s".
func (r *Report) WriteSummary(w io.Writer) {
	mode := "closed loop"
	if r.Rate > 0 {
		mode = fmt.Sprintf("open loop at %.0f/s", r.Rate)
	}
	if r.Interrupted {
		fmt.Fprintf(w, "interrupted: the report covers the first %.1fs of the measured run\n", r.DurationSec)
	}
	api := "unary calls"
	if r.API == APIStream {
		api = "one StepStream per sandbox, the restore carried by a step"
	}
	conns := "one HTTP/2 connection"
	if r.Conns > 1 {
		conns = fmt.Sprintf("%d HTTP/2 connections", r.Conns)
	}
	fmt.Fprintf(w, "scenario %s: %d sandboxes, %s, %s, %s, %.0fs measured after %.0fs warm-up (setup %.1fs)\n",
		r.Scenario, r.Concurrency, mode, api, conns, r.DurationSec, r.WarmupSec, r.SetupSec)
	fmt.Fprintf(w, "throughput: %.0f %s/s (%d in %.0fs), %d errors\n", r.Throughput, r.Unit, r.Iterations, r.DurationSec, r.ErrorCount)
	if r.Rate > 0 && r.Throughput < 0.98*r.Rate {
		fmt.Fprintf(w, "open loop: %.0f/s offered, %.0f/s completed: the server did not keep up (%d iterations still queued at the end; latencies count from when each was due)\n",
			r.Rate, r.Throughput, r.Backlog)
	}
	if len(r.Nodes) > 0 {
		names := slices.Sorted(maps.Keys(r.Nodes))
		parts := make([]string, len(names))
		for i, n := range names {
			parts[i] = fmt.Sprintf("%s %d", n, r.Nodes[n])
		}
		fmt.Fprintf(w, "sandboxes made per node: %s\n", strings.Join(parts, ", "))
	}
	fmt.Fprintf(w, "%-16s %10s %9s %9s %9s %9s %9s\n", "op", "count", "/s", "p50 ms", "p90 ms", "p99 ms", "max ms")
	ops := make([]string, 0, len(r.Ops))
	for op := range r.Ops {
		ops = append(ops, op)
	}
	slices.Sort(ops)
	for _, op := range ops {
		s := r.Ops[op]
		fmt.Fprintf(w, "%-16s %10d %9.0f %9.3f %9.3f %9.3f %9.3f\n", op, s.Count, s.PerSec, s.P50Ms, s.P90Ms, s.P99Ms, s.MaxMs)
	}
	if it, ok := r.Ops["iteration"]; ok && math.Abs(float64(it.Count-r.Iterations)) > 0.05*float64(r.Iterations) {
		fmt.Fprintf(w, "(the table times the calls and iterations that began in the window, %d iterations; the throughput counts those that ended in it, %d)\n",
			it.Count, r.Iterations)
	}
	if len(r.Errors) > 0 {
		keys := make([]string, 0, len(r.Errors))
		for k := range r.Errors {
			keys = append(keys, k)
		}
		slices.Sort(keys)
		fmt.Fprintln(w, "errors by code:")
		for _, k := range keys {
			fmt.Fprintf(w, "  %-40s %d\n", k, r.Errors[k])
		}
		if r.FirstWrong != "" {
			fmt.Fprintf(w, "  first wrong restore: %s\n", r.FirstWrong)
		}
	}
	r.writeTimeline(w)
	if m := r.Machine; m.CPUs > 0 {
		r.writeMachine(w)
	}
	if fc := r.FullCopy; fc != nil {
		fc.writeSummary(w, r)
	}
	if v := r.ProcessCRIU; v != nil {
		v.writeSummary(w, r)
	}
}

func (r *Report) writeMachine(w io.Writer) {
	m := r.Machine
	fmt.Fprintf(w, "machine: %d CPUs, load average %.2f before / %.2f after, busy %.0f%% during the run; CPU seconds: load generator %.1f",
		m.CPUs, m.LoadBefore[0], m.LoadAfter[0], 100*m.MachineBusyFrac, m.LoadgenCPUSec)
	if m.ServerCPUSec > 0 {
		fmt.Fprintf(w, ", server %.1f, sandboxes %.1f, server RSS %.0f MiB", m.ServerCPUSec, m.SandboxCPUSec, float64(m.ServerRSSBytes)/(1<<20))
	}
	fmt.Fprintln(w)
}

// WriteJSON writes the report as indented JSON to path.
func (r *Report) WriteJSON(path string) error {
	b, err := json.MarshalIndent(r, "", "  ")
	if err != nil {
		return err
	}
	if err := os.WriteFile(path, append(b, '\n'), 0o644); err != nil {
		return fmt.Errorf("writing report: %w", err)
	}
	return nil
}

// Probe samples machine counters before a run; End fills in Machine after it.
type Probe struct {
	load     [3]float64
	busy     cpuTimes
	self     float64
	server   int
	srvCPU   float64
	boxCPU   float64
	cgroupCP string
}

// StartProbe samples the machine; serverPID (0: unknown) is the server whose process CPU is
// reported, cgroupCPU (optional) the cgroup2 cpu.stat file of its sandboxes' cgroup parent.
func StartProbe(serverPID int, cgroupCPU string) *Probe {
	p := &Probe{load: loadavg(), busy: readCPU(), self: selfCPU(), server: serverPID, cgroupCP: cgroupCPU}
	p.srvCPU = procCPU(serverPID)
	p.boxCPU = cgroupUsage(cgroupCPU)
	return p
}

// End returns the machine facts since StartProbe.
func (p *Probe) End() Machine {
	now := readCPU()
	m := Machine{CPUs: numCPU(), LoadBefore: p.load, LoadAfter: loadavg(), LoadgenCPUSec: selfCPU() - p.self}
	if tot := now.total - p.busy.total; tot > 0 {
		m.MachineBusyFrac = 1 - float64(now.idle-p.busy.idle)/float64(tot)
	}
	if p.server > 0 {
		m.ServerCPUSec = procCPU(p.server) - p.srvCPU
		m.ServerRSSBytes = procRSS(p.server)
		m.SandboxCPUSec = cgroupUsage(p.cgroupCP) - p.boxCPU
	}
	return m
}

func loadavg() (l [3]float64) {
	b, err := os.ReadFile("/proc/loadavg")
	if err == nil {
		fmt.Sscanf(string(b), "%f %f %f", &l[0], &l[1], &l[2])
	}
	return l
}

type cpuTimes struct{ total, idle uint64 }

func readCPU() (c cpuTimes) {
	b, err := os.ReadFile("/proc/stat")
	if err != nil {
		return c
	}
	line, _, _ := strings.Cut(string(b), "\n")
	f := strings.Fields(line)
	for i, x := range f[1:] {
		var v uint64
		fmt.Sscan(x, &v)
		c.total += v
		if i == 3 || i == 4 { // idle, iowait
			c.idle += v
		}
	}
	return c
}

func numCPU() int {
	b, _ := os.ReadFile("/proc/stat")
	n := 0
	for _, l := range strings.Split(string(b), "\n") {
		if strings.HasPrefix(l, "cpu") && len(l) > 3 && l[3] >= '0' && l[3] <= '9' {
			n++
		}
	}
	return n
}

func selfCPU() float64 {
	var ru syscall.Rusage
	_ = syscall.Getrusage(syscall.RUSAGE_SELF, &ru)
	return tv(ru.Utime) + tv(ru.Stime)
}

func tv(t syscall.Timeval) float64 { return float64(t.Sec) + float64(t.Usec)/1e6 }

// procCPU is the user+system CPU seconds of pid itself (its threads; not its children).
func procCPU(pid int) float64 {
	if pid <= 0 {
		return 0
	}
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid))
	if err != nil {
		return 0
	}
	_, rest, ok := strings.Cut(string(b), ") ")
	if !ok {
		return 0
	}
	f := strings.Fields(rest)
	if len(f) < 13 {
		return 0
	}
	var ut, st float64
	fmt.Sscan(f[11], &ut)
	fmt.Sscan(f[12], &st)
	return (ut + st) / 100 // USER_HZ
}

func cgroupUsage(path string) float64 {
	v, _ := cgroupUsageOK(path)
	return v
}

// cgroupUsageOK reads usage_usec of a cgroup2 cpu.stat file, in seconds.
func cgroupUsageOK(path string) (float64, bool) {
	if path == "" {
		return 0, false
	}
	b, err := os.ReadFile(path)
	if err != nil {
		return 0, false
	}
	for _, l := range strings.Split(string(b), "\n") {
		if v, ok := strings.CutPrefix(l, "usage_usec "); ok {
			us, err := strconv.ParseFloat(strings.TrimSpace(v), 64)
			return us / 1e6, err == nil
		}
	}
	return 0, false
}
