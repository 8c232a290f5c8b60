package main

import (
	"math"
	"runtime/debug"
	"testing"
)

func TestTuneGC(t *testing.T) {
	pct := debug.SetGCPercent(100)
	lim := debug.SetMemoryLimit(math.MaxInt64)
	t.Cleanup(func() {
		debug.SetGCPercent(pct)
		debug.SetMemoryLimit(lim)
	})
	tuneGC(func(string) string { return "" })
	if got := debug.SetGCPercent(100); got != serveGCPercent {
		t.Errorf("GC percent %d, want %d", got, serveGCPercent)
	}
	if got := debug.SetMemoryLimit(math.MaxInt64); got != serveMemoryLimit() || got < 64<<20 {
		t.Errorf("memory limit %d, want a quarter of the machine's memory (%d)", got, serveMemoryLimit())
	}
	// Set in the environment: left as the runtime read it.
	tuneGC(func(k string) string { return map[string]string{"GOGC": "50", "GOMEMLIMIT": "2GiB"}[k] })
	if got := debug.SetGCPercent(100); got != 100 {
		t.Errorf("GC percent %d with GOGC set, want it untouched (100)", got)
	}
	if got := debug.SetMemoryLimit(math.MaxInt64); got != math.MaxInt64 {
		t.Errorf("memory limit %d with GOMEMLIMIT set, want it untouched", got)
	}
}
