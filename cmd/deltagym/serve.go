package main

import (
	"context"
	"flag"
	"os"
	"os/signal"
	"syscall"

	"github.com/deltagym/deltagym/server"
)

// runServe runs the server in the foreground until SIGINT or SIGTERM, then
// shuts it down gracefully.
func runServe(ctx context.Context, a *app, fs *flag.FlagSet, args []string) error {
	var cfg server.Config
	cfg.RegisterFlags(fs)
	pos, _, err := parseArgs(fs, args)
	if err != nil {
		return err
	}
	if err := wantArgs(pos, 0, 0, ""); err != nil {
		return err
	}
	ctx, stop := signal.NotifyContext(ctx, os.Interrupt, syscall.SIGTERM)
	defer stop()
	return server.Run(ctx, cfg)
}
