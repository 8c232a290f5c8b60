package ledger_test

import (
	"context"
	"crypto/sha256"
	"encoding/base64"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/deltagym/deltagym/internal/locate"
	"github.com/deltagym/deltagym/server/ledger"
	"github.com/deltagym/deltagym/server/ledger/pgserver"
)

// procCPU returns the user+system CPU time process pid has used; with children, that of its
// children it has waited for too.
func procCPU(pid int, children bool) (time.Duration, error) {
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid))
	if err != nil {
		return 0, err
	}
	s := string(b)
	f := strings.Fields(s[strings.LastIndexByte(s, ')')+2:])
	if len(f) < 13 {
		return 0, fmt.Errorf("parsing /proc/%d/stat", pid)
	}
	u, _ := strconv.ParseInt(f[11], 10, 64)
	k, _ := strconv.ParseInt(f[12], 10, 64)
	if children {
		cu, _ := strconv.ParseInt(f[13], 10, 64)
		ck, _ := strconv.ParseInt(f[14], 10, 64)
		u, k = u+cu, k+ck
	}
	return time.Duration(u+k) * 10 * time.Millisecond, nil // USER_HZ is 100 on Linux
}

// clusterCPU sums the CPU time of the private cluster in dataDir: its postmaster, the
// postmaster's children (backends, WAL writer, checkpointer…) alive now, and those it reaped.
func clusterCPU(dataDir string) (time.Duration, error) {
	b, err := os.ReadFile(filepath.Join(dataDir, "postgres", "postmaster.pid"))
	if err != nil {
		return 0, err
	}
	pm, err := strconv.Atoi(strings.SplitN(string(b), "\n", 2)[0])
	if err != nil {
		return 0, fmt.Errorf("parsing postmaster.pid: %w", err)
	}
	ents, err := os.ReadDir("/proc")
	if err != nil {
		return 0, err
	}
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
		if ppid, _ := strconv.Atoi(f[1]); ppid != pm && pid != pm {
			continue
		}
		// The postmaster's own count takes in the children it has reaped (autovacuum workers,
		// say), which are gone from /proc.
		if c, err := procCPU(pid, pid == pm); err == nil {
			total += c
		}
	}
	return total, nil
}

// selfCPU returns the CPU time (user+system) this process has used.
func selfCPU() time.Duration {
	var ru syscall.Rusage
	_ = syscall.Getrusage(syscall.RUSAGE_SELF, &ru)
	return time.Duration(ru.Utime.Nano() + ru.Stime.Nano())
}

// BenchmarkCopyCost measures what Postgres spends per step row, without the writer: 4 KiB
// observations COPYed in 8192-row transactions (as the writer batches them) straight into the
// steps table, under the current schema and under variants of it. It reports the CPU the COPY
// backend and the whole cluster use per row (from /proc, so it holds up on a loaded machine
// better than rows/s does), WAL and disk bytes per row, values moved to the TOAST table per
// row, and the p50/p99 time of one batch. Variants run in the order listed, in one cluster;
// compare those after cold (-bench 'CopyCost/(cold|schema|ids-main)$').
func BenchmarkCopyCost(b *testing.B) {
	binDirs, err := locate.PostgresBinDirs()
	if err != nil {
		b.Skip(err)
	}
	variants := []struct {
		name, sql string
		write     bool // rows of a 4 KiB write_file: the content in the action, a small observation
	}{
		// The schema on a new cluster: it creates the WAL segments that the variants after it
		// recycle, as a server that has run a while does, so it reads dearer per row.
		{"cold", "", false},
		{"schema", "", false}, // as migrated
		// Postgres's default, which pgserver turns off: every new 16 MiB WAL segment written with
		// zeros first. Run it alone (-bench CopyCost/wal-init-zero-on): a variant after another one in
		// the same cluster may recycle that one's segments instead of creating new ones.
		{"wal-init-zero-on", "SET wal_init_zero = on", false},
		// The small columns EXTENDED, as 0001 left them and 0002 changes: 4 KiB rows push them
		// to TOAST.
		{"small-cols-extended", `ALTER TABLE steps ALTER COLUMN action SET STORAGE EXTENDED,
			ALTER COLUMN observation_sha256 SET STORAGE EXTENDED, ALTER COLUMN episode_id SET STORAGE EXTENDED,
			ALTER COLUMN checkpoint_id SET STORAGE EXTENDED`, false},
		// No lz4 for rows up to a page: less CPU, three times the disk (one 4 KiB row per page).
		{"uncompressed", "ALTER TABLE steps SET (toast_tuple_target = 8160)", false},
		// The ids and the hash MAIN, as 0002 left them and 0006 changes: PostgreSQL tries to
		// compress each of them in turn once the compressed observation leaves the row over the
		// TOAST target.
		{"ids-main", `ALTER TABLE steps ALTER COLUMN episode_id SET STORAGE MAIN,
			ALTER COLUMN observation_sha256 SET STORAGE MAIN, ALTER COLUMN checkpoint_id SET STORAGE MAIN`, false},
		// 4 KiB writes: the action compressed with lz4 (0003), and with pglz, Postgres's default.
		{"write-action", "", true},
		{"write-action-pglz", "ALTER TABLE steps ALTER COLUMN action SET COMPRESSION pglz", true},
	}
	dir, err := os.MkdirTemp("", "pgcost")
	if err != nil {
		b.Fatal(err)
	}
	defer os.RemoveAll(dir)
	ctx := context.Background()
	srv, err := pgserver.StartConfig(ctx, pgserver.Config{BinDirs: binDirs, DataDir: dir, Logger: quietLogger(),
		Settings: map[string]string{"shared_buffers": "512MB", "max_wal_size": "4GB"}})
	if err != nil {
		b.Fatal(err)
	}
	defer srv.Stop(ctx)
	text := syntheticText(1 << 20)
	const batch = 8192
	for vi, v := range variants {
		b.Run(v.name, func(b *testing.B) {
			conn, err := pgx.Connect(ctx, srv.URL())
			if err != nil {
				b.Fatal(err)
			}
			defer conn.Close(ctx)
			if _, err := conn.Exec(ctx, "DROP TABLE IF EXISTS steps, episodes, runs, rewards, checkpoints, ledger_spool_marks, schema_migrations"); err != nil {
				b.Fatal(err)
			}
			if _, err := ledger.Migrate(ctx, conn); err != nil {
				b.Fatal(err)
			}
			if v.sql != "" {
				if _, err := conn.Exec(ctx, v.sql); err != nil {
					b.Fatal(err)
				}
			}
			var pid int
			var toast string
			if err := conn.QueryRow(ctx, "SELECT pg_backend_pid(), reltoastrelid::regclass::text FROM pg_class WHERE oid = 'steps'::regclass").Scan(&pid, &toast); err != nil {
				b.Fatal(err)
			}
			cols := []string{"episode_id", "idx", "action", "observation", "observation_size",
				"observation_sha256", "reward", "terminated", "truncated", "started_at", "duration_ns", "checkpoint_id"}
			rows := make([][]any, 0, b.N)
			now := time.Now()
			for i := range b.N {
				off := (i * 997) % (len(text) - 4096)
				obs, action := text[off:off+4096], []byte(`{"exec":"make test"}`)
				if v.write {
					action = fmt.Appendf(nil, `{"writeFile":{"path":"/work/notes.txt","content":%q}}`,
						base64.StdEncoding.EncodeToString(obs))
					obs = []byte(`{"writeFile":{"bytesWritten":4096}}`)
				}
				sum := sha256.Sum256(obs)
				rows = append(rows, []any{fmt.Sprintf("bench-%d-%d", vi, i/100), int32(i % 100), action,
					obs, int64(len(obs)), sum[:], 0.5, false, false, now, int64(time.Millisecond), nil})
			}
			var wal0, wal1, size, toasted int64
			backend0, _ := procCPU(pid, false)
			cluster0, _ := clusterCPU(dir)
			if err := conn.QueryRow(ctx, "SELECT pg_current_wal_lsn() - '0/0'").Scan(&wal0); err != nil {
				b.Fatal(err)
			}
			var lat []time.Duration
			b.ResetTimer()
			start := time.Now()
			for i := 0; i < len(rows); i += batch {
				t0 := time.Now()
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
				lat = append(lat, time.Since(t0))
			}
			elapsed := time.Since(start)
			b.StopTimer()
			backend1, _ := procCPU(pid, false)
			cluster1, _ := clusterCPU(dir)
			_ = conn.QueryRow(ctx, "SELECT pg_current_wal_lsn() - '0/0'").Scan(&wal1)
			_ = conn.QueryRow(ctx, "SELECT pg_total_relation_size('steps')").Scan(&size)
			_ = conn.QueryRow(ctx, "SELECT count(DISTINCT chunk_id) FROM "+toast).Scan(&toasted)
			slices.Sort(lat)
			n := float64(b.N)
			b.ReportMetric(n/elapsed.Seconds(), "rows/s")
			b.ReportMetric(float64(backend1-backend0)/1e3/n, "backend-us/row")
			b.ReportMetric(float64(cluster1-cluster0)/1e3/n, "cluster-us/row")
			b.ReportMetric(float64(wal1-wal0)/n, "wal-B/row")
			b.ReportMetric(float64(size)/n, "disk-B/row")
			b.ReportMetric(float64(toasted)/n, "toasted/row")
			b.ReportMetric(float64(lat[len(lat)/2].Microseconds())/1e3, "batch-p50-ms")
			b.ReportMetric(float64(lat[len(lat)*99/100].Microseconds())/1e3, "batch-p99-ms")
		})
	}
}
