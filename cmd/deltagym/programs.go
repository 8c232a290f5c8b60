package main

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"slices"
	"strings"

	"github.com/deltagym/deltagym/internal/locate"
	"github.com/deltagym/deltagym/server"
	"github.com/deltagym/deltagym/server/ledger/pgserver"
)

// programs are the programs besides its own code that serve runs, as internal/locate finds
// them: the defaults of its flags --init, --criu and --postgres-bin. A search that found
// nothing keeps its error, which says what to install (make init, make criu, make postgres).
type programs struct {
	init    string
	initErr error
	// criu is where the wrapper is, or where it is expected (criuErr says it is not there yet).
	criu    string
	criuErr error
	pg      []string
	pgErr   error
	// pgSearched: the Postgres bin directories were searched for, not named by
	// $DELTAGYM_POSTGRES.
	pgSearched bool
	// pgPrivate is the checkout's install of PostgreSQL (make postgres), or "".
	pgPrivate string
}

// findPrograms looks for the programs.
func findPrograms() programs {
	var p programs
	p.init, p.initErr = locate.Init()
	p.criu, p.criuErr = locate.CRIU()
	p.pg, p.pgErr = locate.PostgresBinDirs()
	p.pgSearched = os.Getenv(locate.EnvPostgres) == ""
	p.pgPrivate = locate.PrivatePostgres()
	return p
}

// defaults puts the programs found into cfg, before its flags are registered.
func (p programs) defaults(cfg *server.Config) {
	cfg.InitBinary, cfg.CRIU, cfg.PostgresBinDirs = p.init, p.criu, p.pg
}

// check fails, saying what to install, when cfg lacks a program the server cannot start
// without, and logs which programs the server runs.
func (p programs) check(cfg *server.Config, log *slog.Logger) error {
	switch {
	case cfg.InitBinary == "" && p.initErr != nil:
		return p.initErr
	case cfg.InitBinary == "":
		return errors.New("--init is empty: the server needs the sandbox init (make init builds bin/dg-init)")
	}
	if err := locate.Executable(cfg.InitBinary); err != nil {
		return fmt.Errorf("the sandbox init %s: %w (make init builds bin/dg-init)", cfg.InitBinary, err)
	}
	log.Info("sandbox init", "path", cfg.InitBinary)
	p.logCRIU(cfg.CRIU, log)
	if cfg.NoLedger || cfg.DatabaseURL != "" {
		return nil
	}
	switch {
	case len(cfg.PostgresBinDirs) == 0 && p.pgErr != nil:
		return p.pgErr
	case len(cfg.PostgresBinDirs) == 0:
		return errors.New("--postgres-bin is empty: the private Postgres needs PostgreSQL's binaries (make postgres installs them; or --no-ledger, or --database-url)")
	}
	log.Info("postgres binaries, in order of preference", "dirs", strings.Join(cfg.PostgresBinDirs, string(os.PathListSeparator)))
	if p.pgSearched && p.pgPrivate == "" && slices.Equal(cfg.PostgresBinDirs, p.pg) {
		log.Warn(fmt.Sprintf("PostgreSQL %d is not installed in the checkout (make postgres): the private Postgres runs with the system's", locate.PostgresMajor))
	}
	return nil
}

// logCRIU says which CRIU wrapper the server runs, or that it has none.
func (p programs) logCRIU(criu string, log *slog.Logger) {
	switch {
	case criu == "" && p.criuErr != nil:
		log.Warn("CRIU: none; the checkpoints, restores and forks that need it will fail (run `make criu`, or name the wrapper with --criu)", "err", p.criuErr)
	case criu == "":
		log.Warn("CRIU: none (--criu is empty); the checkpoints, restores and forks that need it will fail")
	case locate.Executable(criu) != nil:
		log.Warn("CRIU: not installed; the checkpoints, restores and forks that need it fail until it is (run `make criu`)", "path", criu)
	default:
		log.Info("CRIU", "path", criu)
	}
}

// postgresHint adds to an error that the private Postgres's binaries caused what to do about
// it; other errors it returns as they are.
func postgresHint(ctx context.Context, err error) error {
	switch {
	case errors.Is(err, pgserver.ErrVersion):
		return fmt.Errorf("%w. Installed here: %s. make postgres installs PostgreSQL %d; --postgres-bin or $%s names other bin directories; "+
			"make clean-ledger deletes the cluster, with the trajectories it recorded", err, installedPostgres(ctx), locate.PostgresMajor, locate.EnvPostgres)
	case errors.Is(err, pgserver.ErrNoBinaries):
		return fmt.Errorf("%w (or name PostgreSQL's bin directories with --postgres-bin or $%s)", err, locate.EnvPostgres)
	}
	return err
}

// installedPostgres lists the installs of PostgreSQL's server found here, each with its major
// version.
func installedPostgres(ctx context.Context) string {
	var out []string
	for _, d := range locate.InstalledPostgres() {
		if m, err := pgserver.BinaryMajor(ctx, d); err == nil {
			out = append(out, fmt.Sprintf("%s (%d)", d, m))
		}
	}
	if len(out) == 0 {
		return "none"
	}
	return strings.Join(out, ", ")
}
