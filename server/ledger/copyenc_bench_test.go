package ledger_test

import (
	"context"
	"crypto/sha256"
	"fmt"
	"slices"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/deltagym/deltagym/server/ledger"
	"github.com/deltagym/deltagym/server/ledger/pgserver"
)

// stepColumns are the steps table's columns in the order of ledger.CopyStepsStatement.
var stepColumns = []string{"episode_id", "idx", "action", "observation", "observation_size",
	"observation_sha256", "reward", "terminated", "truncated", "started_at", "duration_ns", "checkpoint_id"}

// stepValues is a step row as the values pgx encodes through its type map.
func stepValues(s *ledger.StepRow) []any {
	var ck any
	if s.CheckpointID != "" {
		ck = s.CheckpointID
	}
	return []any{s.EpisodeID, int32(s.Index), s.Action, s.Observation, s.ObservationSize, s.ObservationSHA256,
		s.Reward, s.Terminated, s.Truncated, s.StartedAt, int64(s.Duration), ck}
}

// copyPaths are the ways of sending a batch of step rows in one COPY: the writer's own encoder
// (copyenc.go, through pgconn), and pgx's CopyFrom with the rows as values, built for the batch
// (CopyFromRows) or row by row as pgx asks for them (CopyFromSlice).
var copyPaths = map[string]func(ctx context.Context, tx pgx.Tx, rows []*ledger.StepRow) error{
	"copyenc": func(ctx context.Context, tx pgx.Tx, rows []*ledger.StepRow) error {
		_, err := tx.Conn().PgConn().CopyFrom(ctx, ledger.StepCopyStream(rows), ledger.CopyStepsStatement)
		return err
	},
	"pgx-rows": func(ctx context.Context, tx pgx.Tx, rows []*ledger.StepRow) error {
		vals := make([][]any, len(rows))
		for i, s := range rows {
			vals[i] = stepValues(s)
		}
		_, err := tx.CopyFrom(ctx, pgx.Identifier{"steps"}, stepColumns, pgx.CopyFromRows(vals))
		return err
	},
	"pgx-slice": func(ctx context.Context, tx pgx.Tx, rows []*ledger.StepRow) error {
		_, err := tx.CopyFrom(ctx, pgx.Identifier{"steps"}, stepColumns, pgx.CopyFromSlice(len(rows),
			func(i int) ([]any, error) { return stepValues(rows[i]), nil }))
		return err
	},
}

// BenchmarkStepCopy sends b.N step rows into the steps table of a private Postgres (fsync on,
// pgserver's settings, as `make run`'s) in transactions of 8192 rows (the writer's BatchRows),
// with 4 KiB and 256-byte observations. The batches take copyPaths in turn (copyenc, pgx-rows,
// pgx-slice, copyenc, ...), so that the paths meet the machine and the table at the same
// moments; the table is emptied and checkpointed before each run. For each path it reports
// rows/s (over its batches' time), the CPU a row cost this process (encoding and sending:
// go-cpu-us/row) and the COPY's backend (pg-cpu-us/row), and the p50/p99 time of a batch.
func BenchmarkStepCopy(b *testing.B) {
	ctx := context.Background()
	srv, _ := benchPostgres(b, pgserver.Config{})
	text := syntheticText(1 << 20)
	// A new cluster's first gigabyte of WAL goes into new segment files, later ones into
	// recycled ones (BenchmarkCopyCost's "cold"): measure after that, as on a server that has
	// run a while.
	if err := warmUp(ctx, srv.URL(), stepRows(150_000, 4096, text, 0)); err != nil {
		b.Fatal(err)
	}
	run := 0
	for _, obs := range []int{4096, 256} {
		b.Run(fmt.Sprintf("obs=%d", obs), func(b *testing.B) {
			run++
			benchStepCopy(b, srv.URL(), stepRows(b.N, obs, text, run))
		})
	}
}

// copyPathNames are copyPaths' names, in the order the batches take them.
var copyPathNames = []string{"copyenc", "pgx-rows", "pgx-slice"}

// copyStats is what one path's batches took.
type copyStats struct {
	rows                int
	wall, self, backend time.Duration
	lat                 []time.Duration
}

func benchStepCopy(b *testing.B, url string, rows []*ledger.StepRow) {
	ctx := context.Background()
	conn, err := pgx.Connect(ctx, url)
	if err != nil {
		b.Fatal(err)
	}
	defer conn.Close(ctx)
	for _, q := range []string{"TRUNCATE steps", "CHECKPOINT"} {
		if _, err := conn.Exec(ctx, q); err != nil {
			b.Fatal(err)
		}
	}
	var pid int
	if err := conn.QueryRow(ctx, "SELECT pg_backend_pid()").Scan(&pid); err != nil {
		b.Fatal(err)
	}
	stats := make([]copyStats, len(copyPathNames))
	b.ResetTimer()
	for i, k := 0, 0; i < len(rows); i, k = i+copyBatch, k+1 {
		part := rows[i:min(i+copyBatch, len(rows))]
		st := &stats[k%len(stats)]
		backend0, _ := procCPU(pid, false)
		self0, t0 := selfCPU(), time.Now()
		if err := sendBatch(ctx, conn, part, copyPaths[copyPathNames[k%len(stats)]]); err != nil {
			b.Fatal(err)
		}
		d, self1 := time.Since(t0), selfCPU()
		backend1, _ := procCPU(pid, false)
		st.rows, st.wall, st.self, st.backend = st.rows+len(part), st.wall+d, st.self+self1-self0, st.backend+backend1-backend0
		st.lat = append(st.lat, d)
	}
	b.StopTimer()
	var stored int64
	if err := conn.QueryRow(ctx, "SELECT count(*) FROM steps").Scan(&stored); err != nil || stored != int64(len(rows)) {
		b.Fatalf("%d rows in the table, want %d: %v", stored, len(rows), err)
	}
	for p, st := range stats {
		if st.rows == 0 {
			continue
		}
		slices.Sort(st.lat)
		n, name := float64(st.rows), copyPathNames[p]
		b.ReportMetric(n/st.wall.Seconds(), name+"-rows/s")
		b.ReportMetric(float64(st.self)/1e3/n, name+"-go-cpu-us/row")
		b.ReportMetric(float64(st.backend)/1e3/n, name+"-pg-cpu-us/row")
		b.ReportMetric(float64(st.lat[len(st.lat)/2].Microseconds())/1e3, name+"-batch-p50-ms")
		b.ReportMetric(float64(st.lat[min(len(st.lat)-1, len(st.lat)*99/100)].Microseconds())/1e3, name+"-batch-p99-ms")
	}
}

// stepRows makes n step rows as the writer holds them (Writer.Step fills in the size and hash),
// in episodes of 100 steps whose IDs are unique to the run; every tenth has a checkpoint.
func stepRows(n, obs int, text []byte, run int) []*ledger.StepRow {
	rows := make([]*ledger.StepRow, n)
	now := time.Now()
	for i := range rows {
		off := (i * 997) % (len(text) - obs)
		o := text[off : off+obs]
		sum := sha256.Sum256(o)
		rows[i] = &ledger.StepRow{EpisodeID: fmt.Sprintf("ep_bench%d_%012d", run, i/100), Index: i % 100,
			Action: []byte(`{"exec":{"command":"make test"}}`), Observation: o, ObservationSize: int64(obs),
			ObservationSHA256: sum[:], Reward: 0.5, StartedAt: now.Add(time.Duration(i) * time.Microsecond), Duration: time.Millisecond}
		if i%10 == 9 {
			rows[i].CheckpointID = fmt.Sprintf("ck-%d-%d", run, i)
		}
	}
	return rows
}

// copyBatch is the writer's BatchRows: the rows of one transaction.
const copyBatch = 8192

// sendBatch sends rows by send in one transaction.
func sendBatch(ctx context.Context, conn *pgx.Conn, rows []*ledger.StepRow, send func(context.Context, pgx.Tx, []*ledger.StepRow) error) error {
	tx, err := conn.Begin(ctx)
	if err != nil {
		return err
	}
	if err := send(ctx, tx, rows); err != nil {
		_ = tx.Rollback(ctx)
		return err
	}
	return tx.Commit(ctx)
}

// warmUp copies rows into the steps table and empties it again.
func warmUp(ctx context.Context, url string, rows []*ledger.StepRow) error {
	conn, err := pgx.Connect(ctx, url)
	if err != nil {
		return err
	}
	defer conn.Close(ctx)
	for i := 0; i < len(rows); i += copyBatch {
		if err := sendBatch(ctx, conn, rows[i:min(i+copyBatch, len(rows))], copyPaths["copyenc"]); err != nil {
			return fmt.Errorf("warming the cluster up: %w", err)
		}
	}
	_, err = conn.Exec(ctx, "TRUNCATE steps")
	return err
}
