package main

import (
	"runtime/debug"

	"golang.org/x/sys/unix"
)

// The server's live heap is small (tens of MiB: requests, not sandboxes,
// make its garbage), so with Go's default GOGC of 100 the collector ran
// several times a second under load: its mark workers and assists took 7%
// of the server's CPU under the rollback load test, 1% at 400. A heap
// allowed to reach five times the live one stays small next to what the
// sandboxes hold (1,000 idle sandboxes grew the server's RSS by 9 KiB each
// at 400, 17 KiB at 100). A soft limit of a quarter of the machine's memory
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
