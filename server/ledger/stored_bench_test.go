package ledger_test

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"sync"
	"testing"
	"time"

	"github.com/deltagym/deltagym/server/ledger"
	"github.com/deltagym/deltagym/server/ledger/pgserver"
)

// BenchmarkWriterStored measures what acknowledging a step costs its caller: a 4 KiB step
// appended, then, as the server does before it answers, Stored. ack=none appends only (the
// rows reach the spool within the group-commit window, unwaited for); ack=write waits for the
// spool write that holds the row, through the page cache (Config.PageCache, as the server runs
// without --ledger-sync); ack=write-direct the same with O_DIRECT, to compare; ack=sync
// (Config.Sync, as --ledger-sync runs it) for the O_DIRECT write and its fsync.
// callers=1 is one client stepping; callers=16 are concurrent callers, whose rows share
// writes (group commit). It reports the p50/p99 latency of one caller's append+Stored, and
// rows/s over all callers; a private Postgres takes the deliveries meanwhile.
func BenchmarkWriterStored(b *testing.B) {
	ctx := context.Background()
	srv, dir := benchPostgres(b, pgserver.Config{})
	// DELTAGYM_LEDGER_BENCH_BUFFERED=1 writes the spool through the page cache, to compare with
	// O_DIRECT.
	ledger.SetDirectSpool(os.Getenv("DELTAGYM_LEDGER_BENCH_BUFFERED") != "1")
	defer ledger.SetDirectSpool(true)
	text := syntheticText(1 << 20)
	for _, ack := range []string{"none", "write", "write-direct", "sync"} {
		for _, callers := range []int{1, 16} {
			b.Run(fmt.Sprintf("ack=%s/callers=%d", ack, callers), func(b *testing.B) {
				w, err := ledger.NewWriter(ledger.Config{URL: srv.URL(), SpoolDir: filepath.Join(dir, "spool-"+ack+fmt.Sprint(callers)), Sync: ack == "sync",
					PageCache: ack == "write"})
				if err != nil {
					b.Fatal(err)
				}
				defer w.Close(ctx)
				lat := make([][]time.Duration, callers)
				var wg sync.WaitGroup
				start := time.Now()
				for c := range callers {
					wg.Go(func() {
						ep := fmt.Sprintf("ep-%s-%d-%d", ack, callers, c)
						if err := w.EpisodeStarted(ledger.EpisodeStart{ID: ep, Env: "env", Run: "bench"}); err != nil {
							b.Error(err)
							return
						}
						for i := c; i < b.N; i += callers {
							off := (i * 997) % (len(text) - 4096)
							t0 := time.Now()
							err := w.Step(ledger.StepRow{EpisodeID: ep, Index: i, Action: []byte(`{"exec":"make test"}`),
								Observation: text[off : off+4096], Reward: 0.5, Duration: time.Millisecond})
							if err == nil && ack != "none" {
								err = w.Stored(ctx)
							}
							lat[c] = append(lat[c], time.Since(t0))
							if err != nil {
								b.Error(err)
								return
							}
						}
					})
				}
				wg.Wait()
				elapsed := time.Since(start)
				b.StopTimer()
				if err := w.Flush(ctx); err != nil {
					b.Fatal(err)
				}
				all := slices.Sorted(slices.Values(slices.Concat(lat...)))
				if len(all) == 0 {
					return
				}
				b.ReportMetric(float64(b.N)/elapsed.Seconds(), "rows/s")
				b.ReportMetric(float64(all[len(all)/2].Nanoseconds())/1e3, "call-p50-us")
				b.ReportMetric(float64(all[len(all)*99/100].Nanoseconds())/1e3, "call-p99-us")
			})
		}
	}
}
