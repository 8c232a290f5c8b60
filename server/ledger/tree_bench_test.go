package ledger_test

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"testing"
	"time"

	"github.com/deltagym/deltagym/server/ledger"
	"github.com/deltagym/deltagym/server/ledger/pgserver"
)

// BenchmarkCheckpointTree reads the checkpoint graph of a run of 10,000 checkpoints: 100
// episodes, each starting at a checkpoint of the one before and taking a chain of 100. It
// reports the p50/p99 of Store.CheckpointTree over the run (run=) and over one episode of the
// middle (episode=). DELTAGYM_LEDGER_BENCH_GRAPH=1 also records a digest of every checkpoint
// and an extra parent link (as a deduplicating checkpoint does) into 1% of them.
func BenchmarkCheckpointTree(b *testing.B) {
	ctx := context.Background()
	srv, dir := benchPostgres(b, pgserver.Config{})
	w, err := ledger.NewWriter(ledger.Config{URL: srv.URL(), SpoolDir: filepath.Join(dir, "spool"), Logger: quiet})
	if err != nil {
		b.Fatal(err)
	}
	defer w.Close(ctx)
	graph := os.Getenv("DELTAGYM_LEDGER_BENCH_GRAPH") == "1"
	t0 := time.Now().Add(-time.Hour)
	n := 0
	id := func(ep, i int) string { return fmt.Sprintf("ck-%03d-%03d", ep, i) }
	parent := "pool"
	must := func(err error) {
		if err != nil {
			b.Fatal(err)
		}
	}
	must(w.Checkpoint(ledger.CheckpointRow{ID: parent, Kind: ledger.KindPool, Env: "env", CreatedAt: t0}))
	for ep := range 100 {
		e := fmt.Sprintf("ep-%03d", ep)
		must(w.EpisodeStarted(ledger.EpisodeStart{ID: e, Env: "env", Run: "bench", StartCheckpoint: parent, StartedAt: t0.Add(time.Duration(n) * time.Millisecond)}))
		for i := range 100 {
			n++
			must(w.Checkpoint(ledger.CheckpointRow{ID: id(ep, i), ParentID: parent, Kind: ledger.KindUser, Env: "env", EpisodeID: e,
				StepIndex: i + 1, CreatedAt: t0.Add(time.Duration(n) * time.Millisecond)}))
			parent = id(ep, i)
		}
		parent = id(ep, 49)
	}
	if graph {
		for ep := range 100 {
			for i := range 100 {
				must(w.CheckpointDigest(id(ep, i), ledger.Digest{Files: fmt.Sprintf("sha256:%064d", ep*100+i)}))
			}
			// A later episode's sandbox came back to a state of this one.
			must(w.CheckpointEdge(ledger.CheckpointEdge{ChildID: id(ep, 10), ParentID: id((ep+1)%100, 99)}))
		}
	}
	must(w.Flush(ctx))
	st, err := ledger.Open(ctx, srv.URL(), w)
	if err != nil {
		b.Fatal(err)
	}
	defer st.Close()
	for _, c := range []struct{ name, run, episode string }{{"run", "bench", ""}, {"episode", "", "ep-050"}} {
		b.Run(c.name, func(b *testing.B) {
			var lat []time.Duration
			for b.Loop() {
				t := time.Now()
				roots, err := st.CheckpointTree(ctx, c.run, c.episode)
				lat = append(lat, time.Since(t))
				if err != nil || len(roots) != 1 {
					b.Fatalf("tree: %d roots, %v", len(roots), err)
				}
			}
			slices.Sort(lat)
			b.ReportMetric(float64(lat[len(lat)/2].Microseconds())/1e3, "p50-ms")
			b.ReportMetric(float64(lat[len(lat)*99/100].Microseconds())/1e3, "p99-ms")
		})
	}
}
