// Command deltagym-loadtest drives a deltagym server with a load test scenario and prints
// throughput, latency per operation (p50/p90/p99/max) and errors by code; it can write a
// JSON report (--json) and a latency CDF plot (--plot), measure the full-copy baseline in
// the same run (--full-copy), and start a private server for the run (--serve).
//
//	deltagym-loadtest --addr 127.0.0.1:8080 --scenario rollback --concurrency 64 --duration 30s
//	deltagym-loadtest --serve bin/deltagym --init bin/dg-init --data .data/loadtest --envs envs --image-dir .data/images/default
//	deltagym-loadtest --scenario rollback-process --process-mb 8 --concurrency 64   # plus the CRIU variant, or "not available"
package main

import (
	"context"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"net"
	"os"
	"os/signal"
	"path/filepath"
	"runtime/debug"
	"strings"
	"syscall"
	"time"

	"golang.org/x/sys/unix"

	deltagym "github.com/deltagym/deltagym/clients/go/deltagym"
	"github.com/deltagym/deltagym/loadtest"
)

// isTerminal says whether w is a terminal: the live progress line rewrites itself with
// carriage returns, which a file or a pipe would keep as one endless line.
func isTerminal(w io.Writer) bool {
	f, ok := w.(*os.File)
	if !ok {
		return false
	}
	_, err := unix.IoctlGetTermios(int(f.Fd()), unix.TCGETS)
	return err == nil
}

// loadGCPercent is the collector's GOGC for the load generator. Its live heap is small (the
// workers' requests and the histograms), so at the default 100 the collector runs several times
// a second, on CPU the server under test would otherwise get: at 400 the generator spends less
// CPU per rollback (docs/PERFORMANCE.md, "Figures behind design choices").
const loadGCPercent = 400

// tuneGC sets the collector, unless the environment does (GOGC).
func tuneGC(getenv func(string) string) {
	if getenv("GOGC") == "" {
		debug.SetGCPercent(loadGCPercent)
	}
}

func main() {
	tuneGC(os.Getenv)
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	code := run(ctx, os.Args[1:], os.Stdout, os.Stderr)
	stop()
	os.Exit(code)
}

// options are the parsed command line.
type options struct {
	cfg                           loadtest.Config
	srv                           loadtest.ServerConfig
	densityN                      int
	jsonPath, plotPath, serverLog string
	fullCopy, quiet, noCRIU       bool
	set                           map[string]bool // the flags given
}

func run(ctx context.Context, args []string, stdout, stderr io.Writer) int {
	o, code := parseArgs(args, stderr)
	if o == nil {
		return code
	}
	if !o.quiet && isTerminal(stderr) {
		o.cfg.Progress = stderr
	}
	var server *loadtest.Server
	if o.srv.Binary != "" {
		s, stop, err := startServer(ctx, o, stderr)
		if err != nil {
			fmt.Fprintln(stderr, "deltagym-loadtest:", err)
			return 1
		}
		defer stop()
		server = s
	}
	if o.cfg.Scenario == "density" {
		return runDensity(ctx, o, server, stdout, stderr)
	}
	return runLoad(ctx, o, server, stdout, stderr)
}

// parseArgs parses and checks the command line. A nil options means exit with the code.
func parseArgs(args []string, stderr io.Writer) (*options, int) {
	o := &options{}
	fs := flag.NewFlagSet("deltagym-loadtest", flag.ContinueOnError)
	fs.SetOutput(stderr)
	cfg, srv := &o.cfg, &o.srv
	fs.StringVar(&cfg.Addr, "addr", os.Getenv("DELTAGYM_ADDR"), "server address host:port, or a cluster's target: dns:NAME:PORT or a comma-separated list of addresses (ignored with --serve)")
	fs.StringVar(&cfg.Token, "token", "", "bearer token (default $DELTAGYM_TOKEN, else the file $DELTAGYM_TOKEN_FILE, else the server's token file, .data/token or $DELTAGYM_DATA/token; ignored with --serve)")
	fs.StringVar(&cfg.Scenario, "scenario", "rollback", "scenario: "+strings.Join(loadtest.Scenarios, ", ")+", or density")
	fs.IntVar(&o.densityN, "density-n", 1000, "density: idle sandboxes to start")
	fs.StringVar(&cfg.Env, "env", "shell", "env to reset sandboxes from")
	fs.IntVar(&cfg.Concurrency, "concurrency", 64, "sandboxes (closed-loop workers)")
	fs.Float64Var(&cfg.Rate, "rate", 0, "open-loop target rate in iterations/s (0: closed loop)")
	fs.DurationVar(&cfg.Duration, "duration", 30*time.Second, "measured duration")
	fs.DurationVar(&cfg.Warmup, "warmup", 3*time.Second, "warm-up before the measured duration (discarded)")
	fs.IntVar(&cfg.FileSize, "file-size", 4096, "bytes the rollback scenario writes per iteration")
	fs.IntVar(&cfg.ProcessMB, "process-mb", 8, "rollback-process: MiB the process of each sandbox holds (every page written)")
	fs.StringVar(&cfg.ProcessMethod, "process-method", loadtest.ProcessTemplate, "rollback-process: how checkpoints capture the process: template, or criu")
	fs.StringVar(&cfg.ProcessShape, "process-shape", loadtest.ShapeSingle, "rollback-process: the process's shape: single, threads (four), or tree (a shell running it as its child)")
	fs.BoolVar(&o.noCRIU, "no-criu", false, "rollback-process: do not measure (or probe) the CRIU variant beside the template run")
	fs.IntVar(&cfg.Group, "group", 8, "children per fork in the grpo scenario")
	fs.StringVar(&cfg.API, "api", "", "rollback scenarios: "+loadtest.APIStream+" (one StepStream per sandbox; the restore rides on a step, restore_checkpoint_id) or "+loadtest.APIUnary+" (Restore and each step a unary call); default "+loadtest.APIStream+" for rollback and rollback-exec, "+loadtest.APIUnary+" for the others")
	fs.IntVar(&cfg.Conns, "conns", 1, "HTTP/2 connections shared by the workers")
	fs.DurationVar(&cfg.SampleInterval, "sample", time.Second, "interval of the timeline's samples (throughput, server RSS, discard backlog, CPU per process)")
	fs.StringVar(&o.jsonPath, "json", "", "write the JSON report to this file")
	fs.StringVar(&o.plotPath, "plot", "", "write a latency CDF plot (PNG) to this file")
	fs.BoolVar(&o.fullCopy, "full-copy", false, "also measure the full-copy rollback baseline (10k files, 1,000 / 50 MB changed)")
	fs.BoolVar(&o.quiet, "quiet", false, "no live progress line (there is none when stderr is not a terminal)")
	fs.StringVar(&srv.Binary, "serve", "", "start this server binary (bin/deltagym) for the run and stop it after")
	fs.StringVar(&srv.Init, "init", "", "with --serve: the sandbox init (default: the server's, $DELTAGYM_INIT, else the dg-init beside it, else the checkout's bin/dg-init)")
	fs.StringVar(&srv.DataDir, "data", ".data/loadtest", "with --serve: the server's data dir; --full-copy scratch goes here too")
	fs.StringVar(&srv.EnvsDir, "envs", "envs", "with --serve: the env catalog")
	fs.StringVar(&srv.ImageDir, "image-dir", "", "with --serve: the built default image (.data/images/default), linked into the data dir")
	fs.BoolVar(&srv.Ledger, "ledger", false, "with --serve: run the server with its ledger (default --no-ledger)")
	fs.IntVar(&srv.PoolSize, "pool-size", 0, "with --serve: the server's --pool-size")
	fs.BoolVar(&srv.IsolateCgroups, "isolate-cgroups", true, "with --serve: give the server private cgroup roots (another server's sandboxes stay untouched)")
	fs.StringVar(&o.serverLog, "server-log", "", "with --serve: append the server's output to this file")
	fs.Usage = func() {
		fmt.Fprintf(fs.Output(), "Usage: deltagym-loadtest [flags]\n\n%s\nFlags:\n", scenarioHelp)
		fs.PrintDefaults()
	}
	if err := fs.Parse(args); err != nil {
		if errors.Is(err, flag.ErrHelp) {
			return nil, 0
		}
		return nil, 2
	}
	if fs.NArg() > 0 {
		fmt.Fprintf(stderr, "deltagym-loadtest: unexpected argument %q: every option is a flag (--name value); -h lists them\n", fs.Arg(0))
		return nil, 2
	}
	o.set = map[string]bool{}
	fs.Visit(func(f *flag.Flag) { o.set[f.Name] = true })
	if cfg.Token == "" {
		tok, err := deltagym.ResolveToken()
		if err != nil {
			fmt.Fprintln(stderr, "deltagym-loadtest:", err)
			return nil, 2
		}
		cfg.Token = tok
	}
	if cfg.API == "" && (cfg.Scenario == "rollback" || cfg.Scenario == "rollback-exec") {
		cfg.API = loadtest.APIStream
	}
	if err := checkArgs(o); err != nil {
		fmt.Fprintln(stderr, "deltagym-loadtest:", err)
		return nil, 2
	}
	return o, 0
}

// startServer starts the server of --serve for the run, and returns it with the function that
// stops it.
func startServer(ctx context.Context, o *options, stderr io.Writer) (*loadtest.Server, func(), error) {
	closeLog := func() {}
	if o.serverLog != "" {
		f, err := os.OpenFile(o.serverLog, os.O_CREATE|os.O_WRONLY|os.O_APPEND, 0o644)
		if err != nil {
			return nil, nil, err
		}
		o.srv.Log, closeLog = f, func() { _ = f.Close() }
	}
	fmt.Fprintf(stderr, "starting %s (data %s) ...\n", o.srv.Binary, o.srv.DataDir)
	s, err := loadtest.StartServer(ctx, o.srv)
	if err != nil {
		closeLog()
		return nil, nil, err
	}
	fmt.Fprintf(stderr, "server pid %d healthy on %s\n", s.PID, s.Addr)
	o.cfg.Addr, o.cfg.Token = s.Addr, s.Token
	stop := func() {
		if err := s.Close(); err != nil {
			fmt.Fprintln(stderr, "deltagym-loadtest: stopping the server:", err)
		}
		fmt.Fprintf(stderr, "stopped server pid %d\n", s.PID)
		closeLog()
	}
	return s, stop, nil
}

// runDensity runs the density scenario and writes its summary and report.
func runDensity(ctx context.Context, o *options, server *loadtest.Server, stdout, stderr io.Writer) int {
	dc := loadtest.DensityConfig{Addr: o.cfg.Addr, Token: o.cfg.Token, Env: o.cfg.Env, N: o.densityN}
	if server != nil {
		dc.ServerPID, dc.MemoryCgroup = server.PID, server.SandboxMemoryUsage()
	}
	d, err := loadtest.MeasureDensity(ctx, dc)
	if err != nil {
		fmt.Fprintln(stderr, "deltagym-loadtest:", err)
		return 1
	}
	d.WriteSummary(stdout)
	if o.jsonPath != "" {
		b, _ := json.MarshalIndent(d, "", "  ")
		if err := os.WriteFile(o.jsonPath, append(b, '\n'), 0o644); err != nil {
			fmt.Fprintln(stderr, "deltagym-loadtest:", err)
			return 1
		}
		fmt.Fprintln(stderr, "report:", o.jsonPath)
	}
	if o.plotPath != "" {
		// No latency to plot; a plot left there by an earlier run would not be this run's.
		if err := os.Remove(o.plotPath); err == nil {
			fmt.Fprintf(stderr, "density measures no latency: no plot (removed the earlier run's %s)\n", o.plotPath)
		} else {
			fmt.Fprintln(stderr, "density measures no latency: no plot written")
		}
	}
	return 0
}

// runLoad runs a load scenario, the baselines asked for beside it, and writes the summary and
// the outputs.
func runLoad(ctx context.Context, o *options, server *loadtest.Server, stdout, stderr io.Writer) int {
	cfg := o.cfg
	if server != nil {
		cfg.ServerPID, cfg.SandboxCPUStat = server.PID, server.SandboxCPUStat()
	}
	probe := loadtest.StartProbe(cfg.ServerPID, cfg.SandboxCPUStat)
	rep, err := loadtest.Run(ctx, cfg)
	if err != nil {
		fmt.Fprintln(stderr, "deltagym-loadtest:", err)
		return 1
	}
	rep.Machine = probe.End()
	if err := measureBaselines(ctx, o, cfg, rep, stderr); err != nil {
		fmt.Fprintln(stderr, "deltagym-loadtest:", err)
		return 1
	}
	rep.WriteSummary(stdout)
	switch {
	case !writeOutputs(o, rep, stderr):
		return 1
	case rep.Interrupted:
		return 130
	case rep.ErrorCount > 0:
		return 3
	}
	return 0
}

// measureBaselines measures what --full-copy and rollback-process ask for beside the run, into
// rep: the full-copy baseline with a solo restore to compare, and the CRIU variant.
func measureBaselines(ctx context.Context, o *options, cfg loadtest.Config, rep *loadtest.Report, stderr io.Writer) error {
	fullCopy := o.fullCopy
	criu := cfg.Scenario == "rollback-process" && cfg.ProcessMethod == loadtest.ProcessTemplate && !o.noCRIU
	if rep.Interrupted && (fullCopy || criu) {
		// What was measured, without the baselines the interrupt also asked to skip.
		fmt.Fprintln(stderr, "interrupted: the baselines (full copy, CRIU) are not measured")
		return nil
	}
	if fullCopy {
		fmt.Fprintln(stderr, "measuring the full-copy baseline ...")
		fc, err := loadtest.MeasureFullCopy(ctx, loadtest.FullCopyConfig{Dir: filepath.Join(o.srv.DataDir, "fullcopy")})
		if err != nil {
			return fmt.Errorf("full-copy baseline: %w", err)
		}
		solo, err := loadtest.Run(ctx, loadtest.Config{Addr: cfg.Addr, Token: cfg.Token, Env: cfg.Env, Scenario: "rollback",
			Concurrency: 1, Duration: 3 * time.Second, Warmup: 500 * time.Millisecond})
		if err != nil {
			return fmt.Errorf("solo restore: %w", err)
		}
		fc.SetSoloRestore(solo.Ops["restore"].P50Ms, solo.Ops["restore"].P99Ms)
		rep.FullCopy = fc
	}
	if criu {
		fmt.Fprintln(stderr, "measuring the CRIU variant of rollback-process ...")
		cc := cfg
		cc.Duration, cc.Progress = min(cfg.Duration, 10*time.Second), nil
		v, err := loadtest.MeasureProcessCRIU(ctx, cc)
		if err != nil {
			return fmt.Errorf("CRIU variant: %w", err)
		}
		rep.ProcessCRIU = v
	}
	return nil
}

// writeOutputs writes the JSON report and the plot asked for; false if one could not be.
func writeOutputs(o *options, rep *loadtest.Report, stderr io.Writer) bool {
	ok := true
	for _, out := range []struct {
		path, what string
		write      func(string) error
	}{{o.jsonPath, "report", rep.WriteJSON}, {o.plotPath, "plot", rep.WritePlot}} {
		if out.path == "" {
			continue
		}
		if err := out.write(out.path); err != nil {
			fmt.Fprintln(stderr, "deltagym-loadtest:", err)
			ok = false
			continue
		}
		fmt.Fprintf(stderr, "%s: %s\n", out.what, out.path)
	}
	return ok
}

// scenarioHelp is what -h says about the scenarios.
const scenarioHelp = `Scenarios (--scenario), each per sandbox, --concurrency sandboxes at once:
  rollback          checkpoint once, then loop: restore, write a 4 KiB file, read back a file
                    changed before the restore and check it is back (a wrong restore is an error)
  rollback-exec     the same, one exec'd shell command checking the restored file and changing it
  rollback-process  one python3 process of --process-mb MiB per sandbox, checkpointed with it;
                    loop: restore, ask the process for its state and check it, change it; the
                    CRIU path is measured beside it (--no-criu to skip)
  steps             exec true, step after step (a restore when the episode's step budget ends)
  grpo              fork --group children from a checkpoint, one step in each, evaluate each
                    (the verifier must give reward 1), close them; its unit is a group
  tree              random expansion (a step with a checkpoint) and backtracking (restore a
                    checkpoint on the current path and check it)
  mixed             rollback, steps, tree and grpo workers side by side (one each in turn)
  density           start --density-n idle sandboxes; report memory per sandbox and start time
The throughput line reads "<N> <unit>/s": rollbacks, steps, groups, tree-ops or iterations.
With --serve the load test starts its own server (--init, --data, --envs, --image-dir);
without it, --addr (or DELTAGYM_ADDR) names a running one, e.g. 127.0.0.1:8080 from make run,
or a cluster of them: dns:NAME:PORT (every A record of NAME a node) or host:port,host:port,...
Against a cluster each sandbox goes to the least loaded node, a grpo fork spreads its children
over the nodes, and the report counts the sandboxes each node made.
`

// checkArgs rejects what the flags cannot mean before anything starts.
func checkArgs(o *options) error {
	cfg := &o.cfg
	for _, c := range []struct {
		flag string
		bad  bool
		msg  string
	}{
		{"concurrency", cfg.Concurrency < 1, fmt.Sprintf("--concurrency %d: at least one sandbox", cfg.Concurrency)},
		{"duration", cfg.Duration <= 0, fmt.Sprintf("--duration %v: it must be positive", cfg.Duration)},
		{"conns", cfg.Conns < 1, fmt.Sprintf("--conns %d: at least one connection", cfg.Conns)},
		{"group", cfg.Group < 1, fmt.Sprintf("--group %d: at least one child per fork", cfg.Group)},
		{"sample", cfg.SampleInterval <= 0, fmt.Sprintf("--sample %v: it must be positive (100ms or more)", cfg.SampleInterval)},
		{"", o.densityN < 1, fmt.Sprintf("--density-n %d: at least one sandbox", o.densityN)},
	} {
		if c.bad && (c.flag == "" || o.set[c.flag]) {
			return errors.New(c.msg)
		}
	}
	if o.srv.Binary == "" && cfg.Addr != "" && !deltagym.IsClusterTarget(cfg.Addr) {
		if _, port, err := net.SplitHostPort(cfg.Addr); err != nil || port == "" {
			return fmt.Errorf("--addr %q is not host:port (for example 127.0.0.1:8080)", cfg.Addr)
		}
	}
	if cfg.Scenario != "density" {
		c := *cfg
		if o.srv.Binary != "" {
			c.Addr = "127.0.0.1:1" // the server's address is known once it runs
		}
		if err := c.Validate(); err != nil {
			return err
		}
	}
	return checkOutputs(o.jsonPath, o.plotPath)
}

// checkOutputs checks that the output files can be written.
func checkOutputs(paths ...string) error {
	for _, p := range paths {
		if p == "" {
			continue
		}
		if st, err := os.Stat(p); err == nil && st.IsDir() {
			return fmt.Errorf("cannot write %s: it is a directory; name a file in it", p)
		}
		if err := unix.Access(filepath.Dir(p), unix.W_OK); err != nil {
			return fmt.Errorf("cannot write %s: its directory: %w", p, err)
		}
	}
	return nil
}
