package loadtest

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/metadata"

	deltagymv1 "github.com/deltagym/deltagym/proto/gen/go/deltagym/v1"
)

// Run performs one load test: it sets up cfg.Concurrency sandboxes (not measured), runs the
// scenario for Warmup+Duration, discards the warm-up and reports the rest. Errors of single
// iterations are counted in the report, not returned; Run fails only when it cannot start.
func Run(ctx context.Context, cfg Config) (*Report, error) {
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	opts := []grpc.DialOption{grpc.WithTransportCredentials(insecure.NewCredentials())}
	if cfg.Token != "" {
		opts = append(opts, grpc.WithUnaryInterceptor(func(ctx context.Context, method string, req, reply any, cc *grpc.ClientConn, invoker grpc.UnaryInvoker, o ...grpc.CallOption) error {
			return invoker(metadata.AppendToOutgoingContext(ctx, "authorization", "Bearer "+cfg.Token), method, req, reply, cc, o...)
		}), grpc.WithStreamInterceptor(func(ctx context.Context, desc *grpc.StreamDesc, cc *grpc.ClientConn, method string, streamer grpc.Streamer, o ...grpc.CallOption) (grpc.ClientStream, error) {
			return streamer(metadata.AppendToOutgoingContext(ctx, "authorization", "Bearer "+cfg.Token), desc, cc, method, o...)
		}))
	}
	clients := make([]deltagymv1.EnvServiceClient, cfg.Conns)
	for i := range clients {
		conn, err := grpc.NewClient(cfg.Addr, opts...)
		if err != nil {
			return nil, fmt.Errorf("dialing %s: %w", cfg.Addr, err)
		}
		defer conn.Close()
		clients[i] = deltagymv1.NewEnvServiceClient(conn)
	}

	// Set up every sandbox, a few at a time (Reset waits on the warm pool).
	workers := make([]worker, cfg.Concurrency)
	setupStart := time.Now()
	var setupErr error
	var mu sync.Mutex
	var wg sync.WaitGroup
	sem := make(chan struct{}, 8)
	for i := range workers {
		workers[i] = newWorker(cfg.Scenario, i, clients[i%len(clients)], &cfg)
		wg.Add(1)
		go func() {
			defer wg.Done()
			sem <- struct{}{}
			defer func() { <-sem }()
			if err := workers[i].setup(ctx); err != nil {
				mu.Lock()
				setupErr = errors.Join(setupErr, fmt.Errorf("setting up sandbox %d: %w", i, err))
				mu.Unlock()
			}
		}()
	}
	wg.Wait()
	defer func() {
		var cw sync.WaitGroup
		for _, w := range workers {
			cw.Go(func() { w.close(ctx) })
		}
		cw.Wait()
	}()
	if setupErr != nil {
		return nil, setupErr
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
	if err := ctx.Err(); err != nil {
		return nil, err
	}
	r := newReport(cfg, rec, setupTime)
	r.Backlog = backlog
	return r, nil
}

// iterate runs one iteration of w and records it (under "iteration", from start) or its
// error. It reports whether the worker must be set up again.
func iterate(ctx context.Context, rec *recorder, w worker, start time.Time) {
	err := w.iterate(ctx, rec)
	if err == nil {
		rec.liveIters.Add(1)
		if rec.inWindow(start) && time.Now().Before(rec.measureTo) {
			rec.iterations.Add(1)
			rec.record("iteration", start, time.Since(start))
		}
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
