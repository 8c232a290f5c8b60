package main

import (
	"bytes"
	"runtime/debug"
	"strings"
	"testing"
)

func TestRunRejectsBadInput(t *testing.T) {
	for _, tc := range []struct {
		name string
		args []string
		code int
		want string
	}{
		{"unknown scenario", []string{"--addr", "127.0.0.1:1", "--scenario", "nope", "--quiet"}, 2, "or density"},
		{"unknown scenario before a server starts", []string{"--serve", "/nonexistent", "--scenario", "nope", "--quiet"}, 2, "is not one of"},
		{"stray word", []string{"extra", "--addr", "127.0.0.1:1"}, 2, `unexpected argument "extra"`},
		{"address without a port", []string{"--addr", "localhost"}, 2, "is not host:port"},
		{"cluster target without a port", []string{"--addr", "dns:nodes.example", "--quiet"}, 2, "want dns:NAME:PORT"},
		{"zero concurrency", []string{"--addr", "127.0.0.1:1", "--concurrency", "0"}, 2, "at least one sandbox"},
		{"zero duration", []string{"--addr", "127.0.0.1:1", "--duration", "0s"}, 2, "must be positive"},
		{"negative density", []string{"--addr", "127.0.0.1:1", "--scenario", "density", "--density-n", "-5"}, 2, "--density-n -5"},
		{"report path a directory", []string{"--addr", "127.0.0.1:1", "--json", "/tmp"}, 2, "it is a directory"},
		{"zero conns", []string{"--addr", "127.0.0.1:1", "--conns", "0"}, 2, "--conns 0"},
		{"zero group", []string{"--addr", "127.0.0.1:1", "--scenario", "grpo", "--group", "0"}, 2, "--group 0"},
		{"scenario named before the address", []string{"--scenario", "rollbak"}, 2, `scenario "rollbak" is not one of`},
		{"no server binary", []string{"--serve", "/nonexistent/deltagym", "--init", "/bin/sh", "--envs", "/"}, 1, "server binary /nonexistent/deltagym (--serve)"},
		{"no env catalog", []string{"--serve", "/bin/true", "--init", "/bin/sh", "--envs", "/nonexistent"}, 1, "env catalog /nonexistent (--envs)"},
		{"unwritable report", []string{"--addr", "127.0.0.1:1", "--json", "/nonexistent/r.json"}, 2, "cannot write /nonexistent/r.json"},
		{"unknown flag", []string{"--frobnicate"}, 2, "flag provided but not defined"},
		{"no address", []string{"--quiet"}, 2, "no server address: pass --addr"},
		{"process size", []string{"--addr", "127.0.0.1:1", "--scenario", "rollback-process", "--process-mb", "-3", "--quiet"}, 2, "process size -3 MiB"},
		{"process method", []string{"--addr", "127.0.0.1:1", "--scenario", "rollback-process", "--process-method", "dump", "--quiet"}, 2, "process method"},
		{"unknown api", []string{"--addr", "127.0.0.1:1", "--api", "rest", "--quiet"}, 2, `api "rest" is neither`},
		{"stream api elsewhere", []string{"--addr", "127.0.0.1:1", "--scenario", "grpo", "--api", "stream", "--quiet"}, 2, "serves the rollback and rollback-exec scenarios"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Setenv("DELTAGYM_ADDR", "")
			var out, errOut bytes.Buffer
			if code := run(t.Context(), tc.args, &out, &errOut); code != tc.code || !strings.Contains(errOut.String(), tc.want) {
				t.Fatalf("run(%q) = %d, stderr %q; want %d and %q", tc.args, code, errOut.String(), tc.code, tc.want)
			}
		})
	}
}

func TestTuneGC(t *testing.T) {
	pct := debug.SetGCPercent(100)
	t.Cleanup(func() { debug.SetGCPercent(pct) })
	tuneGC(func(string) string { return "" })
	if got := debug.SetGCPercent(100); got != loadGCPercent {
		t.Errorf("GC percent %d, want %d", got, loadGCPercent)
	}
	// Set in the environment: left as the runtime read it.
	tuneGC(func(k string) string { return map[string]string{"GOGC": "50"}[k] })
	if got := debug.SetGCPercent(100); got != 100 {
		t.Errorf("GC percent %d with GOGC set, want it untouched (100)", got)
	}
}
