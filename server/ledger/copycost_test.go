package ledger_test

import (
	"context"
	"crypto/sha256"
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/deltagym/deltagym/server/ledger"
	"github.com/deltagym/deltagym/server/ledger/pgserver"
)

// procCPU returns the user+system CPU time pid has used.
func procCPU(pid int) (time.Duration, error) {
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid))
	if err != nil {
		return 0, err
	}
	s := string(b)
	f := strings.Fields(s[strings.LastIndexByte(s, ')')+2:])
	u, _ := strconv.ParseInt(f[11], 10, 64)
	k, _ := strconv.ParseInt(f[12], 10, 64)
	return time.Duration(u+k) * 10 * time.Millisecond, nil
}

// clusterCPU sums the CPU time of the postmaster's children (backends, walwriter, checkpointer…).
func clusterCPU(dataDir string) (time.Duration, error) {
	b, err := os.ReadFile(filepath.Join(dataDir, "postgres", "postmaster.pid"))
	if err != nil {
		return 0, err
	}
	pm, _ := strconv.Atoi(strings.SplitN(string(b), "\n", 2)[0])
	ents, _ := os.ReadDir("/proc")
	var total time.Duration
	for _, e := range ents {
		pid, err := strconv.Atoi(e.Name())
		if err != nil {
			continue
		}
		st, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid))
		if err != nil {
			continue
		}
		s := string(st)
		f := strings.Fields(s[strings.LastIndexByte(s, ')')+2:])
		if pp, _ := strconv.Atoi(f[1]); pp != pm && pid != pm {
			continue
		}
		c, _ := procCPU(pid)
		total += c
	}
	return total, nil
}

func BenchmarkCopyCost(b *testing.B) {
	variants := []struct{ name, sql string }{
		{"base", ""},
		{"pglz", "ALTER TABLE steps ALTER COLUMN observation SET COMPRESSION pglz"},
		{"external", "ALTER TABLE steps ALTER COLUMN observation SET STORAGE EXTERNAL"},
		{"plain", "ALTER TABLE steps ALTER COLUMN observation SET STORAGE PLAIN"},
		{"main-ttt", "ALTER TABLE steps SET (toast_tuple_target = 8160)"},
		{"ext-ttt", "ALTER TABLE steps ALTER COLUMN observation SET STORAGE EXTERNAL; ALTER TABLE steps SET (toast_tuple_target = 8160)"},
		{"main-t4000", "ALTER TABLE steps SET (toast_tuple_target = 4000)"},
		{"t4000-nopk", "ALTER TABLE steps SET (toast_tuple_target = 4000); ALTER TABLE steps DROP CONSTRAINT steps_pkey"},
		{"t4000-json", "ALTER TABLE steps SET (toast_tuple_target = 4000); ALTER TABLE steps ALTER COLUMN action TYPE json"},
		{"small", "ALTER TABLE steps ALTER COLUMN action SET STORAGE MAIN, ALTER COLUMN observation_sha256 SET STORAGE MAIN, ALTER COLUMN episode_id SET STORAGE MAIN, ALTER COLUMN checkpoint_id SET STORAGE MAIN"},
		{"small-nopk", "ALTER TABLE steps ALTER COLUMN action SET STORAGE MAIN, ALTER COLUMN observation_sha256 SET STORAGE MAIN, ALTER COLUMN episode_id SET STORAGE MAIN, ALTER COLUMN checkpoint_id SET STORAGE MAIN; ALTER TABLE steps DROP CONSTRAINT steps_pkey"},
		{"small-json", "ALTER TABLE steps ALTER COLUMN action SET STORAGE MAIN, ALTER COLUMN observation_sha256 SET STORAGE MAIN, ALTER COLUMN episode_id SET STORAGE MAIN, ALTER COLUMN checkpoint_id SET STORAGE MAIN; ALTER TABLE steps ALTER COLUMN action TYPE json"},
		{"small-ttt", "ALTER TABLE steps ALTER COLUMN action SET STORAGE MAIN, ALTER COLUMN observation_sha256 SET STORAGE MAIN, ALTER COLUMN episode_id SET STORAGE MAIN, ALTER COLUMN checkpoint_id SET STORAGE MAIN; ALTER TABLE steps SET (toast_tuple_target = 8160)"},
		{"nopk", "ALTER TABLE steps DROP CONSTRAINT steps_pkey"},
		{"json", "ALTER TABLE steps ALTER COLUMN action TYPE json"},
	}
	if v := os.Getenv("COPYCOST_VARIANTS"); v != "" {
		keep := strings.Split(v, ",")
		var out []struct{ name, sql string }
		for _, x := range variants {
			for _, k := range keep {
				if x.name == k {
					out = append(out, x)
				}
			}
		}
		variants = out
	}
	settings := map[string]string{"shared_buffers": "512MB", "max_wal_size": "4GB"}
	for _, kv := range strings.Split(os.Getenv("COPYCOST_SETTINGS"), ",") {
		if k, v, ok := strings.Cut(kv, "="); ok {
			settings[k] = v
		}
	}
	dir, err := os.MkdirTemp("", "pgcost")
	if err != nil {
		b.Fatal(err)
	}
	defer os.RemoveAll(dir)
	ctx := context.Background()
	srv, err := pgserver.StartConfig(ctx, pgserver.Config{DataDir: dir, Settings: settings})
	if err != nil {
		b.Fatal(err)
	}
	defer srv.Stop(ctx)
	text := syntheticText(1 << 20)
	batch, _ := strconv.Atoi(os.Getenv("COPYCOST_BATCH"))
	if batch == 0 {
		batch = 8192
	}
	for vi, v := range variants {
		b.Run(v.name, func(b *testing.B) {
			conn, err := pgx.Connect(ctx, srv.URL())
			if err != nil {
				b.Fatal(err)
			}
			defer conn.Close(ctx)
			_, _ = conn.Exec(ctx, "DROP TABLE IF EXISTS steps, episodes, runs, rewards, checkpoints, ledger_spool_marks, schema_migrations")
			if err := ledger.Migrate(ctx, conn); err != nil {
				b.Fatal(err)
			}
			if v.sql != "" {
				if _, err := conn.Exec(ctx, v.sql); err != nil {
					b.Fatal(err)
				}
			}
			var pid int
			_ = conn.QueryRow(ctx, "SELECT pg_backend_pid()").Scan(&pid)
			cols := []string{"episode_id", "idx", "action", "observation", "observation_size",
				"observation_sha256", "reward", "terminated", "truncated", "started_at", "duration_ns", "checkpoint_id"}
			rows := make([][]any, 0, b.N)
			now := time.Now()
			for i := range b.N {
				off := (i * 997) % (len(text) - 4096)
				obs := text[off : off+4096]
				sum := sha256.Sum256(obs)
				rows = append(rows, []any{fmt.Sprintf("bench-%d-%d", vi, i/100), int32(i % 100), []byte(`{"exec":"make test"}`),
					obs, int64(4096), sum[:], 0.5, false, false, now, int64(1000000), nil})
			}
			c0, _ := procCPU(pid)
			t0, _ := clusterCPU(dir)
			var w0 int64
			_ = conn.QueryRow(ctx, "SELECT pg_current_wal_lsn() - '0/0'").Scan(&w0)
			b.ResetTimer()
			start := time.Now()
			for i := 0; i < len(rows); i += batch {
				tx, err := conn.Begin(ctx)
				if err != nil {
					b.Fatal(err)
				}
				if _, err := tx.CopyFrom(ctx, pgx.Identifier{"steps"}, cols, pgx.CopyFromRows(rows[i:min(i+batch, len(rows))])); err != nil {
					b.Fatal(err)
				}
				if err := tx.Commit(ctx); err != nil {
					b.Fatal(err)
				}
			}
			el := time.Since(start)
			b.StopTimer()
			c1, _ := procCPU(pid)
			t1, _ := clusterCPU(dir)
			var w1, size int64
			_ = conn.QueryRow(ctx, "SELECT pg_current_wal_lsn() - '0/0'").Scan(&w1)
			_ = conn.QueryRow(ctx, "SELECT pg_total_relation_size('steps')").Scan(&size)
			var toast int64
			var storage, comp string
			_ = conn.QueryRow(ctx, "SELECT coalesce(pg_total_relation_size(nullif(reltoastrelid,0)),0) FROM pg_class WHERE relname='steps'").Scan(&toast)
			_ = conn.QueryRow(ctx, "SELECT attstorage::text, attcompression::text FROM pg_attribute WHERE attrelid='steps'::regclass AND attname='observation'").Scan(&storage, &comp)
			var tn, avgsz int64
			var cm *string
			_ = conn.QueryRow(ctx, "SELECT count(*) FROM (SELECT 1 FROM pg_class c WHERE false) x").Scan(&tn)
			var toastName string
			_ = conn.QueryRow(ctx, "SELECT reltoastrelid::regclass::text FROM pg_class WHERE relname='steps'").Scan(&toastName)
			if toastName != "-" && toastName != "" {
				_ = conn.QueryRow(ctx, "SELECT count(*) FROM "+toastName).Scan(&tn)
			}
			_ = conn.QueryRow(ctx, "SELECT avg(pg_column_size(observation))::bigint, min(pg_column_compression(observation)) FROM steps").Scan(&avgsz, &cm)
			if tn > 0 {
				var cid, cseq, clen int64
				_ = conn.QueryRow(ctx, "SELECT chunk_id::int8, chunk_seq::int8, length(chunk_data)::int8 FROM "+toastName+" LIMIT 1").Scan(&cid, &cseq, &clen)
				var a, e, h, o int64
				_ = conn.QueryRow(ctx, "SELECT avg(pg_column_size(action))::int8, avg(pg_column_size(episode_id))::int8, avg(pg_column_size(observation_sha256))::int8, avg(octet_length(observation))::int8 FROM steps").Scan(&a, &e, &h, &o)
				b.Logf("chunk %d/%d len %d; col sizes action %d ep %d sha %d obs %d", cid, cseq, clen, a, e, h, o)
			}
			b.Logf("storage=%q compression=%q toast=%s chunks=%d avg-col=%d colcomp=%v", storage, comp, toastName, tn, avgsz, cm)
			n := float64(b.N)
			b.ReportMetric(float64(toast)/n, "toast-B/row")
			b.ReportMetric(n/el.Seconds(), "rows/s")
			b.ReportMetric(float64(c1-c0)/1e3/n, "backend-us/row")
			b.ReportMetric(float64(t1-t0)/1e3/n, "cluster-us/row")
			b.ReportMetric(float64(w1-w0)/n, "wal-B/row")
			b.ReportMetric(float64(size)/n, "disk-B/row")
		})
	}
}

// selfCPU returns the CPU time (user+system) this process has used.
func selfCPU() time.Duration {
	var ru syscall.Rusage
	_ = syscall.Getrusage(syscall.RUSAGE_SELF, &ru)
	return time.Duration(ru.Utime.Nano() + ru.Stime.Nano())
}
