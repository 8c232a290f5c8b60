package main

import (
	"runtime/debug"

	"golang.org/x/sys/unix"
)

// The server's live heap is small (tens of MiB: requests, not sandboxes,
// make its garbage), so with Go's default GOGC of 100 the collector runs
// several times a second under load, and its mark workers and assists take
// a measurable share of the server's CPU under the rollback load test, a
// fraction of that at 400 (docs/PERFORMANCE.md, "The server process"). A
// heap allowed to reach five times the live one stays small next to what
// the sandboxes hold (the density load test reports the server's RSS per
// sandbox; docs/PERFORMANCE.md, "Figures behind design choices"). A soft
// limit of a quarter of the machine's memory
// keeps a large live heap (big file reads in flight) from being allowed
// five times its size: the collector works harder as the heap nears it.
const serveGCPercent = 400

// tuneGC sets the collector for serving, unless the environment sets it
// (GOGC, GOMEMLIMIT).
func tuneGC(getenv func(string) string) {
	if getenv("GOGC") == "" {
		debug.SetGCPercent(serveGCPercent)
	}
	if getenv("GOMEMLIMIT") == "" {
		if lim := serveMemoryLimit(); lim > 0 {
			debug.SetMemoryLimit(lim)
		}
	}
}

// serveMemoryLimit is a quarter of the machine's memory, or 0 if unknown.
func serveMemoryLimit() int64 {
	var si unix.Sysinfo_t
	if unix.Sysinfo(&si) != nil {
		return 0
	}
	return int64(si.Totalram) * int64(si.Unit) / 4
}
