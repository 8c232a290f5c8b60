package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"log/slog"
	"net"
	"net/http"
	"net/http/pprof"
	"os"
	"os/signal"
	"syscall"
	"time"

	"github.com/deltagym/deltagym/server"
)

// runServe runs the server in the foreground until SIGINT or SIGTERM, then
// shuts it down gracefully.
func runServe(ctx context.Context, a *app, fs *flag.FlagSet, args []string) error {
	var cfg server.Config
	cfg.RegisterFlags(fs)
	pprofAddr := fs.String("pprof", "", "serve Go's profiler (/debug/pprof/) on this loopback `host:port`, for profiling under load; off by default")
	pos, _, err := parseArgs(fs, args)
	if err != nil {
		return err
	}
	if err := wantArgs(pos, 0, 0, ""); err != nil {
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
	if *pprofAddr != "" {
		stopProf, err := servePprof(*pprofAddr)
		if err != nil {
			return err
		}
		defer stopProf()
	}
	return server.Run(ctx, cfg)
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
