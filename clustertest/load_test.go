package clustertest

import (
	"context"
	"fmt"
	"strconv"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	deltagym "github.com/deltagym/deltagym/clients/go/deltagym"
	"github.com/deltagym/deltagym/loadtest"
)

// loadConfig is one load-test run of the cluster.
type loadConfig struct {
	scenario, api      string
	concurrency, group int
}

// runLoad runs the load test's scenario for 5 s (after 1 s of warm-up) through the cluster's
// target: the load test dials it with deltagym.DialCluster, from the bridge's namespace.
func runLoad(t testing.TB, c *cluster, lc loadConfig) *loadtest.Report {
	t.Helper()
	cfg := loadtest.Config{Addr: target, Token: c.token, ClusterOptions: c.clientOptions(), Scenario: lc.scenario, API: lc.api,
		Concurrency: lc.concurrency, Group: lc.group, Duration: 5 * time.Second, Warmup: time.Second}
	r, err := loadtest.Run(t.Context(), cfg)
	if err != nil {
		t.Fatalf("load test %s through the cluster: %v", lc.scenario, err)
	}
	return r
}

// looper steps in one sandbox in a loop, checking each answer, until its first failure.
type looper struct {
	sb   *deltagym.Sandbox
	node string

	n  atomic.Int64
	mu sync.Mutex
	// +checklocks:mu
	err error
}

func (w *looper) count() int64 { return w.n.Load() }

func (w *looper) failure() error {
	w.mu.Lock()
	defer w.mu.Unlock()
	return w.err
}

// loop writes and reads back a counter until ctx ends or a call fails; it signals progress
// after each iteration and at its failure.
func (w *looper) loop(ctx context.Context, progress chan<- struct{}) {
	signal := func() {
		select {
		case progress <- struct{}{}:
		default:
		}
	}
	for i := 0; ctx.Err() == nil; i++ {
		v := strconv.Itoa(i)
		res, err := w.sb.Exec(ctx, "echo "+v+" > /work/n && cat /work/n")
		if ctx.Err() != nil {
			return
		}
		if err == nil && string(res.Stdout) != v+"\n" {
			err = fmt.Errorf("read back %q, want %q", res.Stdout, v+"\n")
		}
		if err != nil {
			w.mu.Lock()
			w.err = err
			w.mu.Unlock()
			signal()
			return
		}
		w.n.Add(1)
		signal()
	}
}

// runLoopers runs every worker until ctx ends or it fails.
func runLoopers(ctx context.Context, ws []*looper, progress chan<- struct{}) {
	var wg sync.WaitGroup
	for _, w := range ws {
		wg.Go(func() { w.loop(ctx, progress) })
	}
	wg.Wait()
}
