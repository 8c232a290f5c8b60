package ledger_test

import (
	"context"
	"fmt"
	"math/rand/v2"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"testing"
	"time"

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

// BenchmarkWriterSteps measures the writer alone: steps with 4 KiB observations appended as
// fast as possible, timed until all are committed to a private Postgres (fsync on). It reports
// steps/s end to end and the p50/p99 latency of the Step call itself.
func BenchmarkWriterSteps(b *testing.B) {
	for _, size := range []int{4096, 256} {
		b.Run(fmt.Sprintf("obs=%d", size), func(b *testing.B) { benchWriter(b, size) })
	}
}

func benchWriter(b *testing.B, obsSize int) {
	if _, err := os.Stat(filepath.Join(pgserver.DefaultBinDir, "postgres")); err != nil {
		b.Skip("postgres 15 not installed (run scripts/deps.sh postgres)")
	}
	dir, err := os.MkdirTemp("", "pgbench")
	if err != nil {
		b.Fatal(err)
	}
	defer os.RemoveAll(dir)
	ctx := context.Background()
	srv, err := pgserver.StartConfig(ctx, pgserver.Config{DataDir: dir,
		Settings: map[string]string{"shared_buffers": "512MB", "max_wal_size": "4GB"}})
	if err != nil {
		b.Fatal(err)
	}
	defer srv.Stop(ctx)
	if err := ledger.MigrateURL(ctx, srv.URL()); err != nil {
		b.Fatal(err)
	}
	// DELTAGYM_LEDGER_BENCH_CONNS and _DELAY override Config.Conns and DeliveryDelay, to compare.
	conns, _ := strconv.Atoi(os.Getenv("DELTAGYM_LEDGER_BENCH_CONNS"))
	delay, _ := time.ParseDuration(os.Getenv("DELTAGYM_LEDGER_BENCH_DELAY"))
	w, err := ledger.NewWriter(ledger.Config{URL: srv.URL(), SpoolDir: filepath.Join(dir, "spool"), Conns: conns, DeliveryDelay: delay})
	if err != nil {
		b.Fatal(err)
	}
	defer w.Close(ctx)
	text := syntheticText(1 << 20)
	const perEpisode = 100
	lat := make([]time.Duration, 0, b.N)
	b.SetBytes(int64(obsSize))
	pg0, _ := clusterCPU(dir)
	self0 := selfCPU()
	b.ResetTimer()
	start := time.Now()
	ep := ""
	for i := range b.N {
		if i%perEpisode == 0 {
			ep = fmt.Sprintf("bench-%d", i/perEpisode)
			if err := w.EpisodeStarted(ledger.EpisodeStart{ID: ep, Env: "env", Run: "bench"}); err != nil {
				b.Fatal(err)
			}
		}
		off := (i * 997) % (len(text) - obsSize)
		t0 := time.Now()
		err := w.Step(ledger.StepRow{EpisodeID: ep, Index: i % perEpisode, Action: []byte(`{"exec":"make test"}`),
			Observation: text[off : off+obsSize], Reward: 0.5, Duration: time.Millisecond})
		lat = append(lat, time.Since(t0))
		if err != nil {
			b.Fatal(err)
		}
	}
	appended := time.Since(start)
	if err := w.Flush(ctx); err != nil {
		b.Fatal(err)
	}
	elapsed := time.Since(start)
	b.StopTimer()
	pg1, _ := clusterCPU(dir)
	self1 := selfCPU()
	slices.Sort(lat)
	b.ReportMetric(float64(b.N)/elapsed.Seconds(), "steps/s")
	b.ReportMetric(float64(b.N)/appended.Seconds(), "appends/s")
	b.ReportMetric(float64(lat[len(lat)/2].Nanoseconds()), "step-p50-ns")
	b.ReportMetric(float64(lat[len(lat)*99/100].Nanoseconds()), "step-p99-ns")
	b.ReportMetric(float64(pg1-pg0)/1e3/float64(b.N), "pg-cpu-us/step")
	b.ReportMetric(float64(self1-self0)/1e3/float64(b.N), "go-cpu-us/step")
	st := w.Stats()
	b.ReportMetric(float64(st.Spooled), "spooled-rows")
}
