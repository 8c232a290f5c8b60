package ledger_test

import (
	"context"
	"fmt"
	"log/slog"
	"math/rand/v2"
	"os"
	"path/filepath"
	"runtime/debug"
	"slices"
	"strconv"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"

	"github.com/deltagym/deltagym/internal/locate"
	"github.com/deltagym/deltagym/server/ledger"
	"github.com/deltagym/deltagym/server/ledger/pgserver"
)

// syntheticText is shell-output-like text: words from a small vocabulary and numbers, so it
// compresses about as well as real command output does.
func syntheticText(n int) []byte {
	words := []string{"ok", "PASS", "FAIL", "error:", "warning:", "test_", "src/", "main.go", "line", "expected",
		"got", "\n", "  ", "--- ", "build", "cache", "hit", "miss", "0x7f", "panic:", "goroutine", "running"}
	r := rand.New(rand.NewPCG(1, 2))
	out := make([]byte, 0, n+32)
	for len(out) < n {
		if r.IntN(4) == 0 {
			out = fmt.Appendf(out, "%d ", r.IntN(100000))
		} else {
			out = append(out, words[r.IntN(len(words))]...)
			out = append(out, ' ')
		}
	}
	return out[:n]
}

// quietLogger logs warnings and errors only: an info line (the cluster's start) in the middle
// of a benchmark's result line would break it.
func quietLogger() *slog.Logger {
	return slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: slog.LevelWarn}))
}

// BenchmarkWriterSteps measures the writer alone: steps with 4 KiB (and 256-byte) observations
// timed until all are committed to a private Postgres (fsync on). It reports steps/s end to end
// and the p50/p99 latency of the Step call itself.
//
// Two ways of offering the load:
//   - rate=max appends as fast as possible. The writer is then overloaded: its in-memory queue
//     fills and most rows are read back from the spool, which costs CPU that a writer keeping up
//     never spends. steps/s is what it delivers in that state.
//   - rate=50000 (DELTAGYM_LEDGER_BENCH_RATE, at least 1000) appends at the target rate, paced
//     per millisecond.
//     delivered-steps/s is what Postgres received from the end of the first second to the end
//     of the appends: the offered rate if the writer keeps up. max-backlog-rows is the most rows
//     appended but not yet in Postgres (sampled every 100 ms); it stays bounded when the writer
//     keeps up and grows with the run when it does not. steps/s also counts the last batch's
//     delivery after the appends, so it reads a little under the rate even then.
func BenchmarkWriterSteps(b *testing.B) {
	paced := 50_000
	if r, err := strconv.Atoi(os.Getenv("DELTAGYM_LEDGER_BENCH_RATE")); err == nil && r >= 1000 {
		paced = r
	}
	for _, c := range []struct{ size, rate int }{{4096, 0}, {4096, paced}, {256, 0}} {
		rate := "max"
		if c.rate > 0 {
			rate = strconv.Itoa(c.rate)
		}
		b.Run(fmt.Sprintf("obs=%d/rate=%s", c.size, rate), func(b *testing.B) { benchWriter(b, c.size, c.rate) })
	}
}

func benchWriter(b *testing.B, obsSize, rate int) {
	ctx := context.Background()
	// The cluster runs with pgserver's defaults, as `make run`'s does. DELTAGYM_LEDGER_BENCH_PG=
	// name=value,… adds or overrides settings, to compare (shared_buffers=512MB, for one, made
	// no difference).
	settings := map[string]string{}
	for _, kv := range strings.Split(os.Getenv("DELTAGYM_LEDGER_BENCH_PG"), ",") {
		if k, v, ok := strings.Cut(kv, "="); ok {
			settings[k] = v
		}
	}
	// DELTAGYM_LEDGER_BENCH_PG_MB overrides the cluster's memory cap (pgserver.DefaultMemoryLimit).
	capMB, _ := strconv.Atoi(os.Getenv("DELTAGYM_LEDGER_BENCH_PG_MB"))
	srv, dir := benchPostgres(b, pgserver.Config{Settings: settings, MemoryLimit: int64(capMB) << 20})
	// DELTAGYM_LEDGER_BENCH_CONNS and _DELAY override Config.Conns and DeliveryDelay, to compare.
	conns, _ := strconv.Atoi(os.Getenv("DELTAGYM_LEDGER_BENCH_CONNS"))
	delay, _ := time.ParseDuration(os.Getenv("DELTAGYM_LEDGER_BENCH_DELAY"))
	queue, _ := strconv.Atoi(os.Getenv("DELTAGYM_LEDGER_BENCH_QUEUE_MB"))
	vacuumSteps, _ := strconv.Atoi(os.Getenv("DELTAGYM_LEDGER_BENCH_VACUUM_STEPS"))
	// DELTAGYM_LEDGER_BENCH_BUFFERED=1 writes the spool through the page cache, to compare with
	// O_DIRECT.
	ledger.SetDirectSpool(os.Getenv("DELTAGYM_LEDGER_BENCH_BUFFERED") != "1")
	defer ledger.SetDirectSpool(true)
	// The writer runs in `deltagym serve`, whose collector runs at GOGC 400 (cmd/deltagym/gc.go)
	// unless GOGC is set: so does the benchmark (GOGC=100 for Go's default).
	if os.Getenv("GOGC") == "" {
		defer debug.SetGCPercent(debug.SetGCPercent(400))
	}
	// DELTAGYM_LEDGER_BENCH_NEW_SLABS=1 reads rows back into new slabs, to compare with slab
	// reuse.
	ledger.SetSlabReuse(os.Getenv("DELTAGYM_LEDGER_BENCH_NEW_SLABS") != "1")
	defer ledger.SetSlabReuse(true)
	w, err := ledger.NewWriter(ledger.Config{URL: srv.URL(), SpoolDir: filepath.Join(dir, "spool"), Conns: conns, DeliveryDelay: delay, QueueBytes: queue << 20, VacuumSteps: vacuumSteps})
	if err != nil {
		b.Fatal(err)
	}
	defer w.Close(ctx)
	text := syntheticText(1 << 20)
	// appendSteps appends n steps of episodes named prefix-K, paced at rate steps/s (0: as fast
	// as it can), calling each with the index and the Step call's latency.
	appendSteps := func(prefix string, n, rate int, each func(i int, took time.Duration)) {
		const perEpisode = 100
		start := time.Now()
		ep := ""
		for i := range n {
			if rate > 0 && i%(rate/1000) == 0 {
				if d := time.Until(start.Add(time.Duration(i) * time.Second / time.Duration(rate))); d > 0 {
					time.Sleep(d)
				}
			}
			if i%perEpisode == 0 {
				ep = fmt.Sprintf("%s-%d", prefix, i/perEpisode)
				if err := w.EpisodeStarted(ledger.EpisodeStart{ID: ep, Env: "env", Run: "bench"}); err != nil {
					b.Fatal(err)
				}
			}
			off := (i * 997) % (len(text) - obsSize)
			t0 := time.Now()
			err := w.Step(ledger.StepRow{EpisodeID: ep, Index: i % perEpisode, Action: []byte(`{"exec":"make test"}`),
				Observation: text[off : off+obsSize], Reward: 0.5, Duration: time.Millisecond})
			if each != nil {
				each(i, time.Since(t0))
			}
			if err != nil {
				b.Fatal(err)
			}
		}
	}
	// Warm-up: a server that has run for a while writes its WAL into segments its checkpoints
	// recycled, where a new cluster creates every one (a new file's inode and blocks), has its
	// memory group full (new blocks take the group's own reclaimed pages) and its heap faulted
	// in. The same number of steps, delivered and checkpointed, gets the cluster there before
	// the timing starts (which then starts with no checkpoint under way, where a server at this
	// rate has one about every gigabyte of WAL). Every row is vacuumed once: the writer vacuums
	// the steps it delivered every Config.VacuumSteps (vacuum.go), in the warm-up as in the
	// timed run (vacuums counts the timed run's). DELTAGYM_LEDGER_BENCH_VACUUM_STEPS sets
	// VacuumSteps; negative, the writer leaves the table to autovacuum, which vacuums an
	// insert-only table after each fifth or so of growth, and the timed run models that by
	// vacuuming the warm-up's rows, as many as it times, from its start, waiting for that
	// vacuum to end before it stops the clock (vacuum-ms); its CPU counts in pg-cpu-us/step.
	// DELTAGYM_LEDGER_BENCH_COLD=1 skips the warm-up and that vacuum.
	if os.Getenv("DELTAGYM_LEDGER_BENCH_COLD") != "1" {
		appendSteps("warm", b.N, 0, nil)
		if err := w.Flush(ctx); err != nil {
			b.Fatal(err)
		}
		conn, err := pgx.Connect(ctx, srv.URL())
		if err != nil {
			b.Fatal(err)
		}
		_, err = conn.Exec(ctx, "CHECKPOINT")
		conn.Close(ctx)
		if err != nil {
			b.Fatal(err)
		}
	}
	b.SetBytes(int64(obsSize))
	lat := make([]time.Duration, 0, b.N)
	st0 := w.Stats()
	pg0, _ := clusterCPU(dir)
	self0 := selfCPU()
	var maxBacklog atomic.Uint64
	stop := make(chan struct{})
	sampled := make(chan struct{})
	go func() {
		defer close(sampled)
		t := time.NewTicker(100 * time.Millisecond)
		defer t.Stop()
		for {
			select {
			case <-stop:
				return
			case <-t.C:
				st := w.Stats()
				if n := st.Appended - st.Delivered; n > maxBacklog.Load() {
					maxBacklog.Store(n)
				}
			}
		}
	}()
	b.ResetTimer()
	start := time.Now()
	vacuum := make(chan time.Duration, 1) // how long the vacuum of the warm-up's rows took
	// DELTAGYM_LEDGER_BENCH_NO_VACUUM=1 leaves it to autovacuum (to compare its settings).
	// With the writer vacuuming, the warm-up's rows are vacuumed already.
	if os.Getenv("DELTAGYM_LEDGER_BENCH_COLD") == "1" || os.Getenv("DELTAGYM_LEDGER_BENCH_NO_VACUUM") == "1" || vacuumSteps >= 0 {
		vacuum <- 0
	} else {
		go func() {
			// What the vacuum did (pages read, hit, dirtied; WAL) is logged with -test.v.
			cfg, err := pgx.ParseConfig(srv.URL())
			if err != nil {
				b.Error(err)
				vacuum <- 0
				return
			}
			cfg.OnNotice = func(_ *pgconn.PgConn, n *pgconn.Notice) { b.Logf("vacuum: %s", n.Message) }
			conn, err := pgx.ConnectConfig(ctx, cfg)
			if err == nil {
				_, err = conn.Exec(ctx, "VACUUM (VERBOSE) steps")
				conn.Close(ctx)
			}
			if err != nil {
				b.Error(err)
			}
			vacuum <- time.Since(start)
		}()
	}
	// For a paced run: what Postgres received from the end of the first second (warm-up) to
	// the end of the appends, the steady state the offered rate is compared with.
	var warmAt time.Time
	var warmDelivered uint64
	appendSteps("bench", b.N, rate, func(i int, took time.Duration) {
		lat = append(lat, took)
		if rate > 0 && i == rate {
			warmAt, warmDelivered = time.Now(), w.Stats().Delivered
		}
	})
	appended := time.Since(start)
	endDelivered := w.Stats().Delivered
	if err := w.Flush(ctx); err != nil {
		b.Fatal(err)
	}
	vacuumed := <-vacuum
	elapsed := time.Since(start)
	b.StopTimer()
	close(stop)
	<-sampled
	pg1, _ := clusterCPU(dir)
	self1 := selfCPU()
	slices.Sort(lat)
	b.ReportMetric(float64(b.N)/elapsed.Seconds(), "steps/s")
	b.ReportMetric(float64(b.N)/appended.Seconds(), "appends/s")
	b.ReportMetric(float64(vacuumed.Milliseconds()), "vacuum-ms")

	b.ReportMetric(float64(lat[len(lat)/2].Nanoseconds()), "step-p50-ns")
	b.ReportMetric(float64(lat[len(lat)*99/100].Nanoseconds()), "step-p99-ns")
	b.ReportMetric(float64(pg1-pg0)/1e3/float64(b.N), "pg-cpu-us/step")
	b.ReportMetric(float64(self1-self0)/1e3/float64(b.N), "go-cpu-us/step")
	st := w.Stats()
	b.ReportMetric(float64(st.Spooled-st0.Spooled), "spooled-rows")
	b.ReportMetric(float64(st.Vacuums-st0.Vacuums), "vacuums")
	b.ReportMetric(float64(maxBacklog.Load()), "max-backlog-rows")
	if !warmAt.IsZero() {
		b.ReportMetric(float64(endDelivered-warmDelivered)/start.Add(appended).Sub(warmAt).Seconds(), "delivered-steps/s")
	}
}

// benchPostgres starts a private Postgres cluster of cfg (BinDirs, DataDir and Logger filled in)
// with the ledger's schema, for a benchmark, and returns it with its data directory; it is
// stopped and removed when b ends. The benchmark skips where no PostgreSQL is installed.
func benchPostgres(b *testing.B, cfg pgserver.Config) (*pgserver.Server, string) {
	b.Helper()
	binDirs, err := locate.PostgresBinDirs()
	if err != nil {
		b.Skip(err)
	}
	dir, err := os.MkdirTemp("", "pgbench")
	if err != nil {
		b.Fatal(err)
	}
	b.Cleanup(func() { os.RemoveAll(dir) })
	cfg.BinDirs, cfg.DataDir, cfg.Logger = binDirs, dir, quietLogger()
	ctx := context.Background()
	srv, err := pgserver.StartConfig(ctx, cfg)
	if err != nil {
		b.Fatal(err)
	}
	b.Cleanup(func() { srv.Stop(ctx) })
	if _, err := ledger.MigrateURL(ctx, srv.URL()); err != nil {
		b.Fatal(err)
	}
	return srv, dir
}
