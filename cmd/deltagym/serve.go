package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"net/http/pprof"
	"os"
	"os/signal"
	"syscall"
	"time"

	"github.com/posener/complete"

	"github.com/deltagym/deltagym/server"
)

// serveCmd runs the server in the foreground until SIGINT or SIGTERM, then shuts it down
// gracefully. Its arguments are the server's own flags (server.Config.RegisterFlags, and
// --pprof), parsed by the flag package: kong passes them through. The programs the server
// runs besides its own code (the sandbox init, CRIU, PostgreSQL) are found by internal/locate:
// the defaults of --init, --criu and --postgres-bin.
type serveCmd struct {
	Args []string `arg:"" optional:"" predictor:"serve" help:"the server's flags (deltagym serve -h lists them)"`
}

// serveFlags returns the flag set of serve, bound to cfg and pprofAddr.
func serveFlags(cfg *server.Config, pprofAddr *string) *flag.FlagSet {
	fs := flag.NewFlagSet("deltagym serve", flag.ContinueOnError)
	fs.SetOutput(io.Discard) // errors and usage are printed by serveCmd.Run
	cfg.RegisterFlags(fs)
	fs.StringVar(pprofAddr, "pprof", "", "serve Go's profiler (/debug/pprof/) on this loopback `host:port`, for profiling under load; off by default")
	return fs
}

// serveFlagPredictor completes serve's flags.
func serveFlagPredictor() complete.Predictor {
	var names []string
	serveFlags(&server.Config{}, new(string)).VisitAll(func(f *flag.Flag) { names = append(names, "--"+f.Name) })
	return complete.PredictSet(names...)
}

func (s *serveCmd) Run(ctx context.Context, a *app) error {
	var cfg server.Config
	var pprofAddr string
	found := findPrograms()
	found.defaults(&cfg)
	fs := serveFlags(&cfg, &pprofAddr)
	if err := fs.Parse(s.Args); err != nil {
		return serveUsage(a, fs, err)
	}
	if fs.NArg() > 0 {
		return serveUsage(a, fs, fmt.Errorf("unexpected argument %q", fs.Arg(0)))
	}
	if err := found.check(&cfg, slog.Default()); err != nil {
		return err
	}
	ctx, stop := signal.NotifyContext(ctx, os.Interrupt, syscall.SIGTERM)
	defer stop()
	tuneGC(os.Getenv)
	actx, stopAdapt := context.WithCancel(ctx)
	adapted := make(chan struct{})
	go func() {
		defer close(adapted)
		adaptProcs(actx, slog.Default())
	}()
	defer func() {
		stopAdapt()
		<-adapted
	}()
	if pprofAddr != "" {
		stopProf, err := servePprof(pprofAddr)
		if err != nil {
			return err
		}
		defer stopProf()
	}
	return postgresHint(ctx, server.Run(ctx, cfg))
}

// serveUsage prints serve's usage: on stdout for -h, after the error on stderr otherwise.
func serveUsage(a *app, fs *flag.FlagSet, err error) error {
	w := a.stdout
	if !errors.Is(err, flag.ErrHelp) {
		w = a.stderr
		fmt.Fprintf(w, "deltagym serve: %v\n", err)
	}
	fmt.Fprintf(w, "Usage: deltagym serve [server flags]\n\nRun the server in the foreground until SIGINT or SIGTERM.\n\nFlags:\n")
	fs.SetOutput(w)
	fs.PrintDefaults()
	if errors.Is(err, flag.ErrHelp) {
		return nil
	}
	return commandExit(exitUsage)
}

// servePprof serves net/http/pprof on addr, which must be a loopback address.
func servePprof(addr string) (func(), error) {
	host, _, err := net.SplitHostPort(addr)
	if err != nil {
		return nil, usageErrorf("--pprof %q: %v", addr, err)
	}
	if ip := net.ParseIP(host); host != "localhost" && (ip == nil || !ip.IsLoopback()) {
		return nil, usageErrorf("--pprof %q: the profiler is served on loopback only (127.0.0.1:PORT)", addr)
	}
	ln, err := net.Listen("tcp", addr)
	if err != nil {
		return nil, fmt.Errorf("--pprof: %w", err)
	}
	mux := http.NewServeMux()
	mux.HandleFunc("/debug/pprof/", pprof.Index)
	mux.HandleFunc("/debug/pprof/cmdline", pprof.Cmdline)
	mux.HandleFunc("/debug/pprof/profile", pprof.Profile)
	mux.HandleFunc("/debug/pprof/symbol", pprof.Symbol)
	mux.HandleFunc("/debug/pprof/trace", pprof.Trace)
	hs := &http.Server{Handler: mux, ReadHeaderTimeout: 10 * time.Second}
	go func() {
		if err := hs.Serve(ln); err != nil && !errors.Is(err, http.ErrServerClosed) {
			fmt.Fprintln(os.Stderr, "pprof server:", err)
		}
	}()
	return func() { _ = hs.Close() }, nil
}
