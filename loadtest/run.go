package loadtest

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"sync"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	deltagym "github.com/deltagym/deltagym/clients/go/deltagym"
	deltagymv1 "github.com/deltagym/deltagym/clients/go/gen/deltagym/v1"
)

// Run performs one load test: it sets up cfg.Concurrency sandboxes (not measured), runs the
// scenario for Warmup+Duration, discards the warm-up and reports the rest. Errors of single
// iterations are counted in the report, not returned; Run fails only when it cannot start.
func Run(ctx context.Context, cfg Config) (*Report, error) {
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	clients, cluster, closeClients, err := dial(ctx, &cfg)
	if err != nil {
		return nil, err
	}
	defer closeClients()

	// Set up every sandbox, a few at a time (Reset waits on the warm pool).
	workers := make([]worker, cfg.Concurrency)
	setupStart := time.Now()
	setupErrs := make([]error, len(workers))
	var wg sync.WaitGroup
	sem := make(chan struct{}, 8)
	for i := range workers {
		workers[i] = newWorker(cfg.Scenario, i, clients[i%len(clients)], &cfg)
		wg.Add(1)
		go func() {
			defer wg.Done()
			sem <- struct{}{}
			defer func() { <-sem }()
			setupErrs[i] = workers[i].setup(ctx)
		}()
	}
	wg.Wait()
	defer func() {
		// Also after an interrupt: the sandboxes are the server's until closed.
		cctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), time.Minute)
		defer cancel()
		var cw sync.WaitGroup
		for _, w := range workers {
			cw.Go(func() { w.close(cctx) })
		}
		cw.Wait()
	}()
	if err := setupError(cfg.Addr, setupErrs); err != nil {
		return nil, err
	}
	setupTime := time.Since(setupStart)

	rec := newRecorder()
	start := time.Now()
	rec.measureFrom = start.Add(cfg.Warmup)
	rec.measureTo = rec.measureFrom.Add(cfg.Duration)
	rctx, cancel := context.WithDeadline(ctx, rec.measureTo)
	defer cancel()

	stopProgress := progress(ctx, cfg, rec, start)
	var backlog int64
	if cfg.Rate > 0 {
		backlog = openLoop(rctx, cfg, rec, workers)
	} else {
		closedLoop(rctx, cfg, rec, workers)
	}
	stopProgress()
	interrupted := ctx.Err() != nil
	if interrupted {
		// Report what was measured until then, if the warm-up was over.
		at := time.Now()
		if !at.After(rec.measureFrom) {
			return nil, ctx.Err()
		}
		if at.Before(rec.measureTo) {
			rec.measureTo = at
			cfg.Duration = at.Sub(rec.measureFrom)
		}
	}
	r := newReport(cfg, rec, setupTime)
	r.Backlog, r.Interrupted = backlog, interrupted
	if cluster != nil {
		r.Nodes = cluster.placedOn()
	}
	return r, nil
}

// dial returns the clients the workers share: cfg.Conns connections to one server, or the
// cluster cfg.Addr names (its Cluster keeps one connection to each node), with the function that
// closes them.
func dial(ctx context.Context, cfg *Config) (clients []deltagymv1.EnvServiceClient, cluster *clusterEnv, closeAll func(), err error) {
	if deltagym.IsClusterTarget(cfg.Addr) {
		if cluster, err = dialCluster(ctx, cfg); err != nil {
			return nil, nil, nil, err
		}
		return []deltagymv1.EnvServiceClient{cluster}, cluster, func() { _ = cluster.closeCluster() }, nil
	}
	var conns []*grpc.ClientConn
	closeAll = func() {
		for _, c := range conns {
			_ = c.Close()
		}
	}
	opts := DialOptions(cfg.Token)
	for range cfg.Conns {
		conn, err := grpc.NewClient(cfg.Addr, opts...)
		if err != nil {
			closeAll()
			return nil, nil, nil, fmt.Errorf("dialing %s: %w", cfg.Addr, err)
		}
		conns = append(conns, conn)
		clients = append(clients, deltagymv1.NewEnvServiceClient(conn))
	}
	return clients, nil, closeAll, nil
}

// setupError sums up the sandboxes' set-up errors (nil when none failed): each distinct error
// once, with the number of sandboxes it stopped, and what to do when the server could not be
// reached at all.
func setupError(addr string, errs []error) error {
	var distinct []string
	count := map[string]int{}
	failed, unreachable := 0, 0
	for _, err := range errs {
		if err == nil {
			continue
		}
		failed++
		if status.Code(err) == codes.Unavailable {
			unreachable++
		}
		msg := err.Error()
		if count[msg] == 0 {
			distinct = append(distinct, msg)
		}
		count[msg]++
	}
	if failed == 0 {
		return nil
	}
	var b strings.Builder
	fmt.Fprintf(&b, "setting up %d of %d sandboxes failed:", failed, len(errs))
	for i, msg := range distinct {
		if i == 5 {
			fmt.Fprintf(&b, "\n  ... and %d other errors", len(distinct)-i)
			break
		}
		fmt.Fprintf(&b, "\n  %d x %s", count[msg], msg)
	}
	if unreachable == failed {
		fmt.Fprintf(&b, "\nno deltagym server answers at %s: start one (make run serves on 127.0.0.1:8080) and pass its --addr, or let the load test start its own with --serve bin/deltagym", addr)
	}
	return errors.New(b.String())
}

// iterate runs one iteration of w and records it (under "iteration", from start) or its
// error. It reports whether the worker must be set up again.
func iterate(ctx context.Context, rec *recorder, w worker, start time.Time) {
	err := w.iterate(ctx, rec)
	if err == nil {
		end := time.Now()
		rec.liveIters.Add(1)
		// Throughput counts the iterations that end in the window, wherever they began: an
		// iteration longer than the warm-up (a GRPO group) or queued in an open loop that
		// cannot keep up still counts. Latency is recorded for those that begin in it.
		if rec.inWindow(end) {
			rec.iterations.Add(1)
		}
		rec.record("iteration", start, end.Sub(start))
		return
	}
	if dl, ok := ctx.Deadline(); ctx.Err() != nil || ok && !time.Now().Before(dl) {
		// The run ended during the call: not a server error. (gRPC fails a call past the
		// deadline before the context's own timer has fired.)
		return
	}
	op := "iteration"
	var oe *opError
	if errors.As(err, &oe) {
		op = oe.op
		start = oe.start
	}
	rec.fail(op, start, err)
	if errors.Is(err, ErrWrongRestore) {
		rec.noteWrong(err)
	}
	// The sandbox may be in any state now: start it again.
	w.close(ctx)
	if err := w.setup(ctx); err != nil && ctx.Err() == nil {
		rec.fail("setup", time.Now(), err)
	}
}

func closedLoop(ctx context.Context, cfg Config, rec *recorder, workers []worker) {
	var wg sync.WaitGroup
	for _, w := range workers {
		wg.Go(func() {
			for ctx.Err() == nil {
				iterate(ctx, rec, w, time.Now())
			}
		})
	}
	wg.Wait()
}

// openLoop starts iterations at cfg.Rate per second on whichever sandbox is free; an
// iteration's latency counts from when it was due, so time spent queued shows. It returns
// the iterations still queued at the end.
func openLoop(ctx context.Context, cfg Config, rec *recorder, workers []worker) int64 {
	due := make(chan time.Time, 1<<20)
	var wg sync.WaitGroup
	for _, w := range workers {
		wg.Go(func() {
			for {
				select {
				case <-ctx.Done():
					return
				case t := <-due:
					iterate(ctx, rec, w, t)
				}
			}
		})
	}
	interval := time.Duration(float64(time.Second) / cfg.Rate)
	next := time.Now()
	tick := time.NewTicker(min(interval, time.Millisecond))
	defer tick.Stop()
loop:
	for {
		select {
		case <-ctx.Done():
			break loop
		case now := <-tick.C:
			for !next.After(now) {
				select {
				case due <- next:
				default:
					rec.fail("schedule", next, fmt.Errorf("open-loop queue full: %w", ErrUnexpected))
				}
				next = next.Add(interval)
			}
		}
	}
	wg.Wait()
	return int64(len(due))
}
