package main

import (
	"bytes"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/deltagym/deltagym/internal/locate"
	"github.com/deltagym/deltagym/server"
	"github.com/deltagym/deltagym/server/ledger/pgserver"
)

// script writes an executable file at dir/name and returns its path.
func script(t *testing.T, dir, name string) string {
	t.Helper()
	p := filepath.Join(dir, name)
	if err := os.WriteFile(p, []byte("#!/bin/sh\nexit 1\n"), 0o755); err != nil {
		t.Fatal(err)
	}
	return p
}

// serve's flags default to what internal/locate finds, which the variables name here.
func TestServeFlagDefaults(t *testing.T) {
	dir := t.TempDir()
	init, criu := script(t, dir, "dg-init"), script(t, dir, "criu")
	script(t, dir, "initdb")
	script(t, dir, "postgres")
	t.Setenv(locate.EnvInit, init)
	t.Setenv(locate.EnvCRIU, criu)
	t.Setenv(locate.EnvPostgres, dir)
	stdout, stderr, code := runCLI(t, "", "serve", "-h")
	for _, want := range []string{"-init string", fmt.Sprintf("(default %q)", init), "-criu path", fmt.Sprintf("(default %q)", criu),
		"-postgres-bin directories", fmt.Sprintf("(default %s)", dir)} {
		if code != exitOK || !strings.Contains(stdout, want) {
			t.Fatalf("serve -h: exit %d, stdout without %q:\n%s%s", code, want, stdout, stderr)
		}
	}
}

// check refuses to start without the sandbox init or, for the private Postgres, its
// binaries, saying what to install; it logs which programs the server runs.
func TestProgramsCheck(t *testing.T) {
	dir := t.TempDir()
	init := script(t, dir, "dg-init")
	plain := filepath.Join(dir, "plain")
	if err := os.WriteFile(plain, nil, 0o644); err != nil {
		t.Fatal(err)
	}
	notFound := func(what string) error {
		return fmt.Errorf("finding %s: %w (run `make %s`)", what, locate.ErrNotInstalled, what)
	}
	missing := programs{initErr: notFound("init"), criuErr: notFound("criu"), pgErr: notFound("postgres"), pgSearched: true}
	found := programs{init: init, criu: init, pg: []string{dir}, pgSearched: true}
	for _, tc := range []struct {
		name    string
		p       programs
		cfg     server.Config
		wantErr string   // in the error; "" for none
		wantLog []string // in the log
	}{
		{name: "no init", p: missing, wantErr: "make init"},
		{name: "init not executable", p: found, cfg: server.Config{InitBinary: plain}, wantErr: "make init"},
		{name: "no postgres", p: missing, cfg: server.Config{InitBinary: init}, wantErr: "make postgres"},
		{name: "postgres flag empty", p: found, cfg: server.Config{InitBinary: init}, wantErr: "make postgres"},
		{name: "no ledger", p: missing, cfg: server.Config{InitBinary: init, NoLedger: true},
			wantLog: []string{"sandbox init", init, "CRIU: none", "make criu"}},
		{name: "criu expected", p: missing, cfg: server.Config{InitBinary: init, CRIU: plain, DatabaseURL: "postgres:///x"},
			wantLog: []string{"CRIU: not installed", plain, "make criu"}},
		{name: "all found", p: found, cfg: server.Config{InitBinary: init, CRIU: init, PostgresBinDirs: []string{dir}},
			wantLog: []string{"msg=CRIU path=" + init, "postgres binaries", dir, "PostgreSQL 17 is not installed in the checkout"}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			var log bytes.Buffer
			err := tc.p.check(&tc.cfg, slog.New(slog.NewTextHandler(&log, nil)))
			switch {
			case tc.wantErr != "" && (err == nil || !strings.Contains(err.Error(), tc.wantErr)):
				t.Fatalf("check: %v, want an error saying %q", err, tc.wantErr)
			case tc.wantErr == "" && err != nil:
				t.Fatalf("check: %v", err)
			}
			for _, w := range tc.wantLog {
				if !strings.Contains(log.String(), w) {
					t.Errorf("log without %q:\n%s", w, log.String())
				}
			}
		})
	}
}

// Errors of the private Postgres's binaries say what to do; others pass unchanged.
func TestPostgresHint(t *testing.T) {
	version := fmt.Errorf("starting: %w: the cluster was made by PostgreSQL 15", pgserver.ErrVersion)
	err := postgresHint(t.Context(), version)
	for _, want := range []string{"made by PostgreSQL 15", "Installed here: ", "make postgres", "--postgres-bin", locate.EnvPostgres, "make clean-ledger"} {
		if !errors.Is(err, pgserver.ErrVersion) || !strings.Contains(err.Error(), want) {
			t.Fatalf("postgresHint(%v) = %v, want ErrVersion saying %q", version, err, want)
		}
	}
	none := fmt.Errorf("starting: %w", pgserver.ErrNoBinaries)
	if err := postgresHint(t.Context(), none); !errors.Is(err, pgserver.ErrNoBinaries) || !strings.Contains(err.Error(), "make postgres") ||
		!strings.Contains(err.Error(), "--postgres-bin") {
		t.Fatalf("postgresHint(%v) = %v", none, err)
	}
	other := errors.New("something else")
	if err := postgresHint(t.Context(), other); err != other {
		t.Fatalf("postgresHint(%v) = %v, want it unchanged", other, err)
	}
	if err := postgresHint(t.Context(), nil); err != nil {
		t.Fatalf("postgresHint(nil) = %v", err)
	}
}
