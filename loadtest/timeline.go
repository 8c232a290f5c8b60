package loadtest

import (
	"bufio"
	"context"
	"fmt"
	"io"
	"math"
	"net/http"
	"slices"
	"strconv"
	"strings"
	"time"
)

// Sample is one interval of the run (Config.SampleInterval, warm-up included): the
// iterations and errors completed in it, the server's resident memory and runtime gauges at
// its end, and the CPU seconds each party used during it. Gauges the run could not read are
// -1 (ServerRSS 0).
type Sample struct {
	// AtSec is the end of the interval, in seconds since the scenario started.
	AtSec       float64 `json:"at_seconds"`
	IntervalSec float64 `json:"interval_seconds"`
	Iterations  int64   `json:"iterations"`
	PerSec      float64 `json:"per_second"`
	Errors      int64   `json:"errors"`
	// ServerRSS is from /proc/<pid>/status when the server's PID is known, else from the
	// server's /metrics (process_resident_memory_bytes).
	ServerRSS int64 `json:"server_rss_bytes,omitempty"`
	// DiscardBacklog, LiveSandboxes and Checkpoints are the server's gauges on /metrics.
	DiscardBacklog int64 `json:"discard_backlog"`
	LiveSandboxes  int64 `json:"live_sandboxes"`
	Checkpoints    int64 `json:"checkpoints"`
	// ServerCPU is the server process's CPU seconds in the interval (/proc, else /metrics).
	ServerCPU float64 `json:"server_cpu_seconds"`
	// SandboxCPU is the CPU seconds of every sandbox (the cgroup2 cpu.stat of their parent).
	SandboxCPU float64 `json:"sandbox_cpu_seconds"`
	// LoadgenCPU is this process's CPU seconds (getrusage).
	LoadgenCPU float64 `json:"loadgen_cpu_seconds"`
	// MachineBusy is the fraction of all CPUs' time not idle (/proc/stat), whoever used it.
	MachineBusy float64 `json:"machine_busy_fraction"`
	// ProbeCPU is the CPU seconds a fixed user-space task took at the interval's end
	// (speedProbe): it grows when the machine slows down (-1: unknown).
	ProbeCPU float64 `json:"probe_cpu_seconds"`
}

// counters are the cumulative readings a Sample is the difference of.
type counters struct {
	at         time.Time
	iters      int64
	errs       int64
	serverCPU  float64 // -1: unknown
	sandboxCPU float64 // -1: unknown
	loadgenCPU float64
	machine    cpuTimes
	probe      float64 // -1: unknown
}

// sampler reads the counters and gauges of a run.
type sampler struct {
	cfg     *Config
	rec     *recorder
	metrics string // the server's /metrics URL
	http    *http.Client
	probe   *speedProbe
}

func newSampler(cfg *Config, rec *recorder) *sampler {
	return &sampler{cfg: cfg, rec: rec, metrics: "http://" + cfg.Addr + "/metrics",
		http: &http.Client{Timeout: min(cfg.SampleInterval, 2*time.Second)}, probe: newSpeedProbe()}
}

// read takes the cumulative counters now; m is the latest scrape of /metrics (nil when it
// failed).
func (s *sampler) read(m map[string]float64) counters {
	c := counters{at: time.Now(), iters: s.rec.liveIters.Load(), errs: s.rec.liveErrors.Load(),
		serverCPU: -1, sandboxCPU: -1, loadgenCPU: selfCPU(), machine: readCPU()}
	switch {
	case s.cfg.ServerPID > 0:
		c.serverCPU = procCPU(s.cfg.ServerPID)
	case m != nil:
		if v, ok := m["process_cpu_seconds_total"]; ok {
			c.serverCPU = v
		}
	}
	if s.cfg.SandboxCPUStat != "" {
		if v, ok := cgroupUsageOK(s.cfg.SandboxCPUStat); ok {
			c.sandboxCPU = v
		}
	}
	// After the CPU readings: the probe's own CPU goes to the next interval's load generator.
	c.probe = s.probe.run()
	return c
}

// sample is the interval from prev to cur, with the gauges of the scrape m.
func (s *sampler) sample(start time.Time, prev, cur counters, m map[string]float64) Sample {
	d := cur.at.Sub(prev.at).Seconds()
	x := Sample{AtSec: cur.at.Sub(start).Seconds(), IntervalSec: d, Iterations: cur.iters - prev.iters,
		Errors: cur.errs - prev.errs, DiscardBacklog: -1, LiveSandboxes: -1, Checkpoints: -1,
		ServerCPU: -1, SandboxCPU: -1, LoadgenCPU: cur.loadgenCPU - prev.loadgenCPU, ProbeCPU: cur.probe}
	if d > 0 {
		x.PerSec = float64(x.Iterations) / d
	}
	if cur.serverCPU >= 0 && prev.serverCPU >= 0 {
		x.ServerCPU = cur.serverCPU - prev.serverCPU
	}
	if cur.sandboxCPU >= 0 && prev.sandboxCPU >= 0 {
		x.SandboxCPU = cur.sandboxCPU - prev.sandboxCPU
	}
	if tot := cur.machine.total - prev.machine.total; tot > 0 {
		x.MachineBusy = 1 - float64(cur.machine.idle-prev.machine.idle)/float64(tot)
	}
	if s.cfg.ServerPID > 0 {
		x.ServerRSS = procRSS(s.cfg.ServerPID)
	} else if v, ok := m["process_resident_memory_bytes"]; ok {
		x.ServerRSS = int64(v)
	}
	for name, dst := range map[string]*int64{"deltagym_layers_discard_backlog": &x.DiscardBacklog,
		"deltagym_sandboxes_live": &x.LiveSandboxes, "deltagym_checkpoints": &x.Checkpoints} {
		if v, ok := m[name]; ok {
			*dst = int64(v)
		}
	}
	return x
}

// scrape reads the server's /metrics; nil when it cannot.
func (s *sampler) scrape(ctx context.Context) map[string]float64 {
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, s.metrics, nil)
	if err != nil {
		return nil
	}
	if s.cfg.Token != "" {
		req.Header.Set("Authorization", "Bearer "+s.cfg.Token)
	}
	resp, err := s.http.Do(req)
	if err != nil {
		return nil
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		return nil
	}
	m, err := parseMetrics(resp.Body)
	if err != nil {
		return nil
	}
	return m
}

// parseMetrics reads the Prometheus text format into one value per metric name, summed over
// its label sets (the gauges read here have one).
func parseMetrics(r io.Reader) (map[string]float64, error) {
	m := map[string]float64{}
	sc := bufio.NewScanner(r)
	sc.Buffer(make([]byte, 64<<10), 1<<20)
	for sc.Scan() {
		line := strings.TrimSpace(sc.Text())
		if line == "" || line[0] == '#' {
			continue
		}
		name, rest := line, ""
		if i := strings.IndexAny(line, "{ "); i >= 0 {
			name, rest = line[:i], line[i:]
		}
		if strings.HasPrefix(rest, "{") {
			j := strings.LastIndexByte(rest, '}')
			if j < 0 {
				return nil, fmt.Errorf("metric %s: unterminated labels: %w", name, ErrUnexpected)
			}
			rest = rest[j+1:]
		}
		f := strings.Fields(rest)
		if len(f) == 0 {
			return nil, fmt.Errorf("metric %s: no value: %w", name, ErrUnexpected)
		}
		v, err := strconv.ParseFloat(f[0], 64)
		if err != nil {
			return nil, fmt.Errorf("metric %s: value %q: %w", name, f[0], ErrUnexpected)
		}
		m[name] += v
	}
	if err := sc.Err(); err != nil {
		return nil, fmt.Errorf("reading metrics: %w", err)
	}
	return m, nil
}

// progress samples the run every cfg.SampleInterval (into rec.timeline) and prints a live
// line to cfg.Progress each second, until the returned stop is called. The last interval is
// sampled if it is at least half an interval long.
func progress(ctx context.Context, cfg Config, rec *recorder, start time.Time) (stop func()) {
	done := make(chan struct{})
	finished := make(chan struct{})
	s := newSampler(&cfg, rec)
	sctx, cancel := context.WithCancel(context.WithoutCancel(ctx))
	prevM := s.scrape(sctx)
	prev := s.read(prevM)
	prev.at = start
	take := func() {
		m := s.scrape(sctx)
		cur := s.read(m)
		x := s.sample(start, prev, cur, m)
		rec.mu.Lock()
		rec.timeline = append(rec.timeline, x)
		rec.mu.Unlock()
		prev = cur
	}
	go func() {
		defer close(finished)
		line := time.NewTicker(time.Second)
		defer line.Stop()
		tick := time.NewTicker(cfg.SampleInterval)
		defer tick.Stop()
		var last int64
		for {
			select {
			case <-done:
				if cfg.Progress != nil {
					fmt.Fprintln(cfg.Progress)
				}
				// The interval the run ended in, if most of one: the run ends on the tick
				// that would have sampled it.
				if time.Since(prev.at) >= cfg.SampleInterval/2 {
					take()
				}
				return
			case <-tick.C:
				take()
			case now := <-line.C:
				n := rec.liveIters.Load()
				if cfg.Progress != nil {
					phase := "measuring"
					if now.Before(rec.measureFrom) {
						phase = "warm-up"
					}
					fmt.Fprintf(cfg.Progress, "\r[%5.1fs %-9s] %6d %s/s  total %d  errors %d   ", now.Sub(start).Seconds(), phase,
						n-last, unit(cfg.Scenario), n, rec.liveErrors.Load())
				}
				last = n
			}
		}
	}()
	return func() { close(done); <-finished; cancel() }
}

// Flatness compares the first and the last window of the measured part of the timeline:
// a sustained run keeps its throughput, its server RSS and its discard backlog flat.
type Flatness struct {
	// WindowSec is the length of the windows compared: a minute, or a third of shorter runs.
	WindowSec       float64 `json:"window_seconds"`
	FirstPerSec     float64 `json:"first_window_per_second"`
	LastPerSec      float64 `json:"last_window_per_second"`
	ThroughputRatio float64 `json:"throughput_ratio"` // last / first
	FirstRSS        int64   `json:"first_window_rss_bytes,omitempty"`
	LastRSS         int64   `json:"last_rss_bytes,omitempty"`
	RSSGrowth       float64 `json:"rss_growth"` // (last - first) / first
	FirstBacklogMax int64   `json:"first_window_backlog_max"`
	LastBacklogMax  int64   `json:"last_window_backlog_max"`
	// CPU cores used on average over the measured part: CPU seconds per second (-1:
	// unknown).
	ServerCores  float64 `json:"server_cores"`
	SandboxCores float64 `json:"sandbox_cores"`
	LoadgenCores float64 `json:"loadgen_cores"`
	MachineCores float64 `json:"machine_busy_cores"`
	// CPU seconds per iteration over the measured part (-1: unknown), the whole machine's
	// busy CPU seconds per iteration (kernel threads and other processes included), and the
	// throughput the machine's CPUs would allow at that whole-machine cost (0: unknown): a
	// projection, since the cost per iteration changes with the load, but what bounds a
	// closed-loop run on a small machine.
	ServerCPUPerIter  float64 `json:"server_cpu_seconds_per_iteration"`
	SandboxCPUPerIter float64 `json:"sandbox_cpu_seconds_per_iteration"`
	LoadgenCPUPerIter float64 `json:"loadgen_cpu_seconds_per_iteration"`
	MachineCPUPerIter float64 `json:"machine_cpu_seconds_per_iteration"`
	CPUBoundPerSec    float64 `json:"cpu_bound_per_second"`
	// The machine's speed in the two windows: the median CPU seconds of the fixed task
	// (Sample.ProbeCPU; -1: unknown), and the server's CPU seconds per iteration (-1:
	// unknown). Both rising together point at the machine rather than the server.
	FirstProbeCPU         float64 `json:"first_window_probe_cpu_seconds"`
	LastProbeCPU          float64 `json:"last_window_probe_cpu_seconds"`
	FirstServerCPUPerIter float64 `json:"first_window_server_cpu_seconds_per_iteration"`
	LastServerCPUPerIter  float64 `json:"last_window_server_cpu_seconds_per_iteration"`

	ThroughputFlat bool   `json:"throughput_flat"`
	RSSFlat        bool   `json:"rss_flat"`
	BacklogFlat    bool   `json:"backlog_flat"`
	Verdict        string `json:"verdict"`
}

// Flatness thresholds: the last window's throughput within 10% of the first's, RSS grown by
// at most 10%, and the backlog's maximum at most twice the first window's (or 16).
const (
	flatThroughput = 0.10
	flatRSS        = 0.10
	flatBacklogMin = 16
)

// measureFlatness judges the timeline's measured part (from warmup to warmup+duration
// seconds); nil when it has too few samples for two windows.
func measureFlatness(tl []Sample, warmup, duration float64, cpus int) *Flatness {
	const eps = 0.05
	var in []Sample
	for _, x := range tl {
		if x.AtSec-x.IntervalSec >= warmup-eps && x.AtSec <= warmup+duration+eps {
			in = append(in, x)
		}
	}
	if len(in) < 2 {
		return nil
	}
	// The windows are whole samples: a minute's worth, or a third of a shorter run.
	from, to := in[0].AtSec-in[0].IntervalSec, in[len(in)-1].AtSec
	k := max(1, int(math.Min(60, (to-from)/3)/in[0].IntervalSec+eps))
	k = min(k, len(in)/2)
	first, last := in[:k], in[len(in)-k:]
	w := 0.0
	for _, x := range first {
		w += x.IntervalSec
	}
	f := &Flatness{WindowSec: w, FirstPerSec: rate(first), LastPerSec: rate(last),
		FirstBacklogMax: maxBacklog(first), LastBacklogMax: maxBacklog(last),
		FirstRSS: first[len(first)-1].ServerRSS, LastRSS: last[len(last)-1].ServerRSS}
	if f.FirstPerSec > 0 {
		f.ThroughputRatio = f.LastPerSec / f.FirstPerSec
	}
	if f.FirstRSS > 0 {
		f.RSSGrowth = float64(f.LastRSS-f.FirstRSS) / float64(f.FirstRSS)
	}
	f.FirstProbeCPU, f.LastProbeCPU = medianProbe(first), medianProbe(last)
	f.FirstServerCPUPerIter, f.LastServerCPUPerIter = serverPerIter(first), serverPerIter(last)
	f.addCPU(in, cpus)
	f.judge()
	return f
}

// addCPU fills in the CPU the measured samples in took, in cores and per iteration; -1 where a
// sample could not measure it.
func (f *Flatness) addCPU(in []Sample, cpus int) {
	var secs, srv, box, gen, busy float64
	var iters int64
	srvOK, boxOK := true, true
	for _, x := range in {
		secs += x.IntervalSec
		iters += x.Iterations
		srv += x.ServerCPU
		box += x.SandboxCPU
		gen += x.LoadgenCPU
		busy += x.MachineBusy * x.IntervalSec * float64(cpus)
		srvOK = srvOK && x.ServerCPU >= 0
		boxOK = boxOK && x.SandboxCPU >= 0
	}
	f.ServerCores, f.SandboxCores, f.LoadgenCores, f.MachineCores = srv/secs, box/secs, gen/secs, busy/secs
	if !srvOK {
		f.ServerCores = -1
	}
	if !boxOK {
		f.SandboxCores = -1
	}
	f.ServerCPUPerIter, f.SandboxCPUPerIter, f.LoadgenCPUPerIter, f.MachineCPUPerIter = -1, -1, -1, -1
	if iters == 0 {
		return
	}
	n := float64(iters)
	f.LoadgenCPUPerIter = gen / n
	if srvOK {
		f.ServerCPUPerIter = srv / n
	}
	if boxOK {
		f.SandboxCPUPerIter = box / n
	}
	if busy > 0 {
		f.MachineCPUPerIter = busy / n
		f.CPUBoundPerSec = float64(cpus) / f.MachineCPUPerIter
	}
}

// judge sets the verdict: flat, or what moved between the first and the last window.
func (f *Flatness) judge() {
	f.ThroughputFlat = f.FirstPerSec > 0 && math.Abs(f.ThroughputRatio-1) <= flatThroughput
	f.RSSFlat = f.FirstRSS == 0 || f.RSSGrowth <= flatRSS
	f.BacklogFlat = f.LastBacklogMax <= max(2*f.FirstBacklogMax, flatBacklogMin)
	var why []string
	if !f.ThroughputFlat {
		why = append(why, fmt.Sprintf("throughput %+.0f%%", 100*(f.ThroughputRatio-1)))
	}
	if !f.RSSFlat {
		why = append(why, fmt.Sprintf("server RSS %+.0f%%", 100*f.RSSGrowth))
	}
	if !f.BacklogFlat {
		why = append(why, fmt.Sprintf("discard backlog up to %d from %d", f.LastBacklogMax, f.FirstBacklogMax))
	}
	f.Verdict = "flat"
	if len(why) > 0 {
		f.Verdict = "NOT flat: " + strings.Join(why, ", ")
	}
}

func rate(xs []Sample) float64 {
	var n int64
	var d float64
	for _, x := range xs {
		n += x.Iterations
		d += x.IntervalSec
	}
	if d == 0 {
		return 0
	}
	return float64(n) / d
}

// speedVerdict reads the ratio of the probe's last to first time.
func speedVerdict(ratio float64) string {
	switch {
	case ratio >= 1+flatThroughput:
		return "the machine ran user-space code slower at the end"
	case ratio <= 1-flatThroughput:
		return "the machine ran user-space code faster at the end"
	}
	return "the machine's user-space speed held"
}

// medianProbe is the median of the samples' ProbeCPU; -1 if none has one.
func medianProbe(xs []Sample) float64 {
	var v []float64
	for _, x := range xs {
		if x.ProbeCPU > 0 {
			v = append(v, x.ProbeCPU)
		}
	}
	if len(v) == 0 {
		return -1
	}
	slices.Sort(v)
	return v[len(v)/2]
}

// serverPerIter is the server's CPU seconds per iteration over the samples; -1 if unknown.
func serverPerIter(xs []Sample) float64 {
	var cpu float64
	var n int64
	for _, x := range xs {
		if x.ServerCPU < 0 {
			return -1
		}
		cpu += x.ServerCPU
		n += x.Iterations
	}
	if n == 0 {
		return -1
	}
	return cpu / float64(n)
}

func maxBacklog(xs []Sample) int64 {
	m := int64(-1)
	for _, x := range xs {
		m = max(m, x.DiscardBacklog)
	}
	return m
}

// timelineRows is the most rows the summary's timeline table prints; longer timelines are
// merged into rows of several samples.
const timelineRows = 15

// writeTimeline prints the timeline as a table of at most timelineRows rows, then the
// flatness verdict.
func (r *Report) writeTimeline(w io.Writer) {
	tl := r.Timeline
	if len(tl) == 0 {
		return
	}
	k := (len(tl) + timelineRows - 1) / timelineRows
	cpus := float64(max(r.Machine.CPUs, numCPU()))
	fmt.Fprintf(w, "timeline (%gs samples, %d per row; warm-up until %.0fs; CPU in cores, i.e. CPU seconds per second):\n",
		r.SampleSec, k, r.WarmupSec)
	fmt.Fprintf(w, "%7s %11s %6s %8s %7s %5s %6s %7s %9s %8s %8s %8s\n",
		"t s", r.Unit+"/s", "errors", "RSS MiB", "backlog", "live", "ckpts", "server", "sandboxes", "loadgen", "machine", "probe ms")
	for i := 0; i < len(tl); i += k {
		row := tl[i:min(i+k, len(tl))]
		var n, errs int64
		var d, srv, box, gen, busy float64
		srvOK, boxOK := true, true
		backlog := int64(-1)
		for _, x := range row {
			n += x.Iterations
			errs += x.Errors
			d += x.IntervalSec
			srv += x.ServerCPU
			box += x.SandboxCPU
			gen += x.LoadgenCPU
			busy += x.MachineBusy * x.IntervalSec * cpus
			srvOK = srvOK && x.ServerCPU >= 0
			boxOK = boxOK && x.SandboxCPU >= 0
			backlog = max(backlog, x.DiscardBacklog)
		}
		end := row[len(row)-1]
		probe := "-"
		if p := medianProbe(row); p > 0 {
			probe = strconv.FormatFloat(1000*p, 'f', 2, 64)
		}
		fmt.Fprintf(w, "%7.0f %11.0f %6d %8s %7s %5s %6s %7s %9s %8.2f %8.2f %8s\n", end.AtSec, float64(n)/d, errs,
			mib(end.ServerRSS), gauge(backlog), gauge(end.LiveSandboxes), gauge(end.Checkpoints),
			cores(srv/d, srvOK), cores(box/d, boxOK), gen/d, busy/d, probe)
	}
	if f := r.Flatness; f != nil {
		fmt.Fprintf(w, "flatness (first vs last %.0fs of the measured run): %s; %s %.0f -> %.0f /s (x%.2f), server RSS %s -> %s MiB (%+.1f%%), discard backlog max %s -> %s\n",
			f.WindowSec, f.Verdict, r.Unit, f.FirstPerSec, f.LastPerSec, f.ThroughputRatio, mib(f.FirstRSS), mib(f.LastRSS),
			100*f.RSSGrowth, gauge(f.FirstBacklogMax), gauge(f.LastBacklogMax))
		fmt.Fprintf(w, "CPU over the measured run (cores of %.0f): server %s, sandboxes %s, load generator %.2f, whole machine %.2f (the rest is other processes)\n",
			cpus, cores(f.ServerCores, f.ServerCores >= 0), cores(f.SandboxCores, f.SandboxCores >= 0), f.LoadgenCores, f.MachineCores)
		if f.CPUBoundPerSec > 0 {
			fmt.Fprintf(w, "CPU per iteration: server %s ms, sandboxes %s ms, load generator %.3f ms, whole machine %.3f ms; at the whole machine's cost %.0f CPUs fully busy would allow about %.0f %s/s\n",
				millis(f.ServerCPUPerIter), millis(f.SandboxCPUPerIter), 1000*f.LoadgenCPUPerIter, 1000*f.MachineCPUPerIter, cpus, f.CPUBoundPerSec, r.Unit)
		}
		if f.FirstProbeCPU > 0 && f.LastProbeCPU > 0 {
			fmt.Fprintf(w, "machine speed (first vs last %.0fs): a fixed user-space task took %.2f -> %.2f ms of CPU (x%.2f)", f.WindowSec,
				1000*f.FirstProbeCPU, 1000*f.LastProbeCPU, f.LastProbeCPU/f.FirstProbeCPU)
			if f.FirstServerCPUPerIter > 0 && f.LastServerCPUPerIter > 0 {
				fmt.Fprintf(w, ", the server's CPU per iteration %.3f -> %.3f ms (x%.2f)", 1000*f.FirstServerCPUPerIter,
					1000*f.LastServerCPUPerIter, f.LastServerCPUPerIter/f.FirstServerCPUPerIter)
			}
			fmt.Fprintln(w, "; "+speedVerdict(f.LastProbeCPU/f.FirstProbeCPU))
		}
	}
}

// millis formats CPU seconds as milliseconds ("-" when unknown).
func millis(v float64) string {
	if v < 0 {
		return "-"
	}
	return strconv.FormatFloat(1000*v, 'f', 3, 64)
}

func mib(b int64) string {
	if b <= 0 {
		return "-"
	}
	return strconv.FormatFloat(float64(b)/(1<<20), 'f', 0, 64)
}

func gauge(v int64) string {
	if v < 0 {
		return "-"
	}
	return strconv.FormatInt(v, 10)
}

func cores(v float64, ok bool) string {
	if !ok {
		return "-"
	}
	return strconv.FormatFloat(v, 'f', 2, 64)
}
