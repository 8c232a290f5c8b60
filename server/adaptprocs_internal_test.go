package server

import (
	"context"
	"io"
	"log/slog"
	"runtime"
	"sync/atomic"
	"testing"
	"time"
)

// TestAdaptProcs: the Ps double while more RPCs are in flight than there are
// Ps, not while there are as many, and come back once the queue is gone.
func TestAdaptProcs(t *testing.T) {
	base := runtime.GOMAXPROCS(0)
	defer runtime.GOMAXPROCS(base)
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	var inflight atomic.Int64
	go func() {
		defer close(done)
		adaptProcs(ctx, &inflight, slog.New(slog.NewTextHandler(io.Discard, nil)))
	}()
	waitProcs := func(want int, within time.Duration) {
		t.Helper()
		deadline := time.Now().Add(within)
		for runtime.GOMAXPROCS(0) != want {
			if time.Now().After(deadline) {
				t.Fatalf("GOMAXPROCS %d after %v with %d RPCs in flight, want %d", runtime.GOMAXPROCS(0), within, inflight.Load(), want)
			}
			time.Sleep(5 * time.Millisecond)
		}
	}
	inflight.Store(int64(base)) // as many as Ps: no queue
	time.Sleep(300 * time.Millisecond)
	if got := runtime.GOMAXPROCS(0); got != base {
		t.Fatalf("GOMAXPROCS %d with %d RPCs in flight, want %d", got, base, base)
	}
	inflight.Store(int64(base + 5))
	waitProcs(2*base, 2*time.Second)
	inflight.Store(0)
	waitProcs(base, 5*time.Second)
	// Raised again, then the server stops: its own number back.
	inflight.Store(int64(base + 5))
	waitProcs(2*base, 2*time.Second)
	cancel()
	<-done
	if got := runtime.GOMAXPROCS(0); got != base {
		t.Fatalf("GOMAXPROCS %d after the server stopped, want %d", got, base)
	}
}
