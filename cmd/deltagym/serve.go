package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"net"
	"net/http"
	"net/http/pprof"
	"os"
	"os/signal"
	"runtime"
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
	moreProcs()
	if *pprofAddr != "" {
		stopProf, err := servePprof(*pprofAddr)
		if err != nil {
			return err
		}
		defer stopProf()
	}
	return server.Run(ctx, cfg)
}

// moreProcs gives the Go scheduler twice as many Ps as it would use
// (GOMAXPROCS, which follows the CPUs and any cgroup CPU limit), unless the
// GOMAXPROCS variable sets them. A rollback's mount system calls block in
// the kernel (the mount namespace lock, RCU grace periods when an old root
// is detached or an overlay freed), and a thread blocked in a system call
// keeps its P until the runtime's monitor takes it back, about every 0.5 ms
// here. With one P per CPU, a CPU sits idle meanwhile while requests wait
// to run: the rollback load test (64 sandboxes on 2 CPUs) left 15% of the
// machine idle and served 940–1,000 rollbacks/s; with two Ps per CPU it
// used the machine to 94% and served 1,200–1,220.
func moreProcs() {
	if os.Getenv("GOMAXPROCS") == "" {
		runtime.GOMAXPROCS(2 * runtime.GOMAXPROCS(0))
	}
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
