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
		{"unknown scenario", []string{"--addr", "127.0.0.1:1", "--scenario", "nope", "--quiet"}, 1, "is not one of"},
		{"unknown flag", []string{"--frobnicate"}, 2, "flag provided but not defined"},
		{"no address", []string{"--quiet"}, 1, "no server address"},
		{"process size", []string{"--addr", "127.0.0.1:1", "--scenario", "rollback-process", "--process-mb", "-3", "--quiet"}, 1, "process size -3 MiB"},
		{"process method", []string{"--addr", "127.0.0.1:1", "--scenario", "rollback-process", "--process-method", "dump", "--quiet"}, 1, "process method"},
		{"unknown api", []string{"--addr", "127.0.0.1:1", "--api", "rest", "--quiet"}, 1, `api "rest" is neither`},
		{"stream api elsewhere", []string{"--addr", "127.0.0.1:1", "--scenario", "grpo", "--api", "stream", "--quiet"}, 1, "serves the rollback and rollback-exec scenarios"},
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
