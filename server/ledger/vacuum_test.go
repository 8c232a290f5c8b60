package ledger_test

import (
	"bytes"
	"context"
	"encoding/binary"
	"fmt"
	"log/slog"
	"math/rand/v2"
	"net/url"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/deltagym/deltagym/server/ledger"
	"github.com/deltagym/deltagym/server/ledger/pgtest"
)

// logBuffer is an io.Writer for a slog handler that tests read while the writer logs.
type logBuffer struct {
	mu sync.Mutex
	// +checklocks:mu
	buf bytes.Buffer
}

func (b *logBuffer) Write(p []byte) (int, error) {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.buf.Write(p)
}

func (b *logBuffer) String() string {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.buf.String()
}

// frozenSteps counts the step rows on pages the visibility map has all-frozen (watchVacuum
// made the database ready for it).
func frozenSteps(t *testing.T, dbURL string) int {
	t.Helper()
	return count(t, dbURL, `SELECT count(*) FROM steps s
		JOIN pg_visibility_map('steps') v ON v.blkno = (s.ctid::text::point)[0]::bigint
		WHERE v.all_frozen`)
}

// appendEpisodes appends episodes of perEpisode steps with 2 KiB random observations (lz4
// cannot shrink them: three rows to a page) and flushes.
func appendEpisodes(t *testing.T, w *ledger.Writer, prefix string, episodes, perEpisode int) {
	t.Helper()
	rng := rand.New(rand.NewPCG(uint64(len(prefix)), uint64(episodes)))
	for e := range episodes {
		ep := fmt.Sprintf("%s-%d", prefix, e)
		must(t, w.EpisodeStarted(ledger.EpisodeStart{ID: ep, Env: "env", Run: "vacuum"}))
		for i := range perEpisode {
			row := stepRow(ep, i)
			row.Observation = make([]byte, 2048)
			for j := 0; j < len(row.Observation); j += 8 {
				binary.LittleEndian.PutUint64(row.Observation[j:], rng.Uint64())
			}
			must(t, w.Step(row))
		}
	}
	must(t, w.Flush(t.Context()))
}

// watchVacuum turns autovacuum off for the steps table of the database at dbURL, so that only
// the writer's vacuums mark and freeze it (and none locks it meanwhile), and adds
// pg_visibility there for frozenSteps.
func watchVacuum(t *testing.T, dbURL string) {
	t.Helper()
	conn, err := pgx.Connect(t.Context(), dbURL)
	must(t, err)
	defer conn.Close(context.Background())
	for _, q := range []string{"ALTER TABLE steps SET (autovacuum_enabled = off)", "CREATE EXTENSION IF NOT EXISTS pg_visibility"} {
		_, err = conn.Exec(t.Context(), q)
		must(t, err)
	}
}

// waitFrozen waits up to 30 s for at least want steps to be frozen and returns how many are.
// Its scans may make a vacuum skip a page (see TestWriterVacuumSkippedRetries): want leaves
// room for that.
func waitFrozen(t *testing.T, dbURL string, want int) int {
	t.Helper()
	deadline := time.Now().Add(30 * time.Second)
	n := frozenSteps(t, dbURL)
	for ; n < want && time.Now().Before(deadline); n = frozenSteps(t, dbURL) {
		time.Sleep(50 * time.Millisecond)
	}
	return n
}

// privateURL is the URL of a migrated database on a cluster of the test's own. A vacuum marks
// only the rows every snapshot sees, and a snapshot's horizon is the oldest transaction running
// in the whole cluster: on the shared one, another test's long transaction (a migration
// waiting for a lock) would hold the vacuums of these tests back.
func privateURL(t *testing.T) string {
	t.Helper()
	_, u := pgtest.Private(t)
	return u
}

func warnLogger(logs *logBuffer) *slog.Logger {
	return slog.New(slog.NewTextHandler(logs, &slog.HandlerOptions{Level: slog.LevelWarn}))
}

// The writer vacuums and freezes the steps it delivered, every VacuumSteps of them, so that
// autovacuum never has to read their pages back; with VacuumSteps negative it leaves them be.
func TestWriterVacuumsSteps(t *testing.T) {
	t.Parallel()
	const every, total = 1000, 6000
	logs := &logBuffer{}
	b := setupURL(t, privateURL(t), func(c *ledger.Config) {
		c.VacuumSteps = every
		c.Conns, c.BatchRows = 1, 200
		c.Logger = warnLogger(logs)
	})
	watchVacuum(t, b.url)
	appendEpisodes(t, b.w, "vac", total/100, 100)
	// Each vacuum freezes what was committed when it started, and the next starts once every
	// more steps are delivered: in the end, all but the steps delivered since the last one
	// (fewer than every) and a batch being copied then are frozen. The last may still be
	// running.
	want := total - every - 200
	if n := waitFrozen(t, b.url, want); n < want {
		t.Fatalf("%d of %d steps frozen after %d vacuums, want at least %d; log:\n%s", n, total, b.w.Stats().Vacuums, want, logs)
	}
	if v := b.w.Stats().Vacuums; v < 1 || v > total/every {
		t.Fatalf("%d vacuums counted for %d steps, one every %d", v, total, every)
	}
	if s := logs.String(); s != "" {
		t.Fatalf("the writer logged warnings:\n%s", s)
	}

	// More steps than the default VacuumSteps, so that -1 meaning the default would show.
	off := setup(t, func(c *ledger.Config) { c.VacuumSteps = -1 })
	watchVacuum(t, off.url)
	appendEpisodes(t, off.w, "novac", 120, 100)
	time.Sleep(500 * time.Millisecond)
	if v := off.w.Stats().Vacuums; v != 0 {
		t.Fatalf("with VacuumSteps -1 the writer ran %d vacuums", v)
	}
	if n := frozenSteps(t, off.url); n != 0 {
		t.Fatalf("with VacuumSteps -1, %d steps frozen", n)
	}
}

// A vacuum that finds the table locked (autovacuum's, here a LOCK in the same mode) is
// skipped, not counted, and tried again once the lock is gone, with no more steps coming.
func TestWriterVacuumSkippedRetries(t *testing.T) {
	t.Parallel()
	b := setupURL(t, privateURL(t), func(c *ledger.Config) { c.VacuumSteps = 1000 })
	watchVacuum(t, b.url)
	conn, err := pgx.Connect(t.Context(), b.url)
	must(t, err)
	defer conn.Close(context.Background())
	tx, err := conn.Begin(t.Context())
	must(t, err)
	_, err = tx.Exec(t.Context(), "LOCK TABLE steps IN SHARE UPDATE EXCLUSIVE MODE")
	must(t, err)
	appendEpisodes(t, b.w, "locked", 30, 100)
	time.Sleep(1500 * time.Millisecond)
	if v := b.w.Stats().Vacuums; v != 0 {
		t.Fatalf("%d vacuums counted while the table was locked, want 0", v)
	}
	must(t, tx.Commit(t.Context()))
	// Wait on the writer's count, not by reading the table: a scan that holds a page while
	// the vacuum comes to it makes the vacuum skip that page, till the next one, and a few of
	// the pages would be found unfrozen.
	deadline := time.Now().Add(30 * time.Second)
	for b.w.Stats().Vacuums == 0 && time.Now().Before(deadline) {
		time.Sleep(20 * time.Millisecond)
	}
	if n := frozenSteps(t, b.url); n != 3000 {
		t.Fatalf("%d of 3000 steps frozen after the lock was gone (%d vacuums)", n, b.w.Stats().Vacuums)
	}
	if v := b.w.Stats().Vacuums; v != 1 {
		t.Fatalf("%d vacuums counted, want the 1 retried", v)
	}
}

// A writer whose role may write the ledger's tables but not vacuum them (another role owns
// them) says so once, goes on delivering, and leaves the table to autovacuum.
func TestWriterCannotVacuum(t *testing.T) {
	t.Parallel()
	owner := pgtest.Start(t)
	conn, err := pgx.Connect(t.Context(), owner)
	must(t, err)
	defer conn.Close(context.Background())
	role := fmt.Sprintf("ledger_writer_%d", time.Now().UnixNano())
	for _, q := range []string{
		"CREATE ROLE " + role + " LOGIN",
		"GRANT SELECT, INSERT, UPDATE, DELETE ON ALL TABLES IN SCHEMA public TO " + role,
		"GRANT USAGE ON ALL SEQUENCES IN SCHEMA public TO " + role,
		"GRANT CREATE ON SCHEMA public TO " + role, // Migrate creates schema_migrations if need be
	} {
		_, err := conn.Exec(t.Context(), q)
		must(t, err)
	}
	t.Cleanup(func() {
		c, err := pgx.Connect(context.Background(), owner)
		if err == nil {
			_, _ = c.Exec(context.Background(), "DROP OWNED BY "+role)
			_, _ = c.Exec(context.Background(), "DROP ROLE "+role)
			c.Close(context.Background())
		}
	})
	u, err := url.Parse(owner)
	must(t, err)
	q := u.Query() // the user is a parameter of the URL
	q.Set("user", role)
	u.RawQuery = q.Encode()
	logs := &logBuffer{}
	b := setupURL(t, u.String(), func(c *ledger.Config) {
		c.VacuumSteps = 100
		c.Logger = warnLogger(logs)
	})
	appendEpisodes(t, b.w, "novac", 10, 100)
	deadline := time.Now().Add(30 * time.Second)
	for !strings.Contains(logs.String(), "does not vacuum") && time.Now().Before(deadline) {
		time.Sleep(10 * time.Millisecond)
	}
	appendEpisodes(t, b.w, "more", 10, 100)
	if n := count(t, owner, "SELECT count(*) FROM steps"); n != 2000 {
		t.Fatalf("%d steps stored, want 2000", n)
	}
	s := logs.String()
	if strings.Count(s, "does not vacuum") != 1 || !strings.Contains(s, "may not vacuum the steps table") {
		t.Fatalf("want one warning that the writer does not vacuum (its role may not), got:\n%s", s)
	}
	if v := b.w.Stats().Vacuums; v != 0 {
		t.Fatalf("%d vacuums counted, want 0", v)
	}
}

// An older snapshot held open elsewhere keeps the writer's vacuums from marking anything; the
// writer then backs off instead of scanning the same pages every VacuumSteps, says so, and
// catches up once the snapshot is gone.
func TestWriterVacuumHeldBack(t *testing.T) {
	t.Parallel()
	logs := &logBuffer{}
	b := setupURL(t, privateURL(t), func(c *ledger.Config) {
		c.VacuumSteps = 500
		c.Conns, c.BatchRows = 1, 100 // patience: 2,000 steps without a gain
		ledger.SetVacuumBackoff(c, 200*time.Millisecond, 800*time.Millisecond)
		c.Logger = slog.New(slog.NewTextHandler(logs, &slog.HandlerOptions{Level: slog.LevelDebug}))
	})
	watchVacuum(t, b.url)
	appendEpisodes(t, b.w, "before", 10, 100)
	conn, err := pgx.Connect(t.Context(), b.url)
	must(t, err)
	defer conn.Close(context.Background())
	tx, err := conn.BeginTx(t.Context(), pgx.TxOptions{IsoLevel: pgx.RepeatableRead})
	must(t, err)
	must(t, tx.QueryRow(t.Context(), "SELECT count(*) FROM steps").Scan(new(int)))
	v0 := b.w.Stats().Vacuums
	// 30 rounds of 1,000 steps, 100 ms apart: 60 vacuums' worth in 3 s or more, where backing
	// off after 2,000 steps (4 vacuums) and then waiting 0.2, 0.4 and 0.8 s leaves room for
	// a few a second.
	start := time.Now()
	for r := range 30 {
		appendEpisodes(t, b.w, fmt.Sprintf("held%d", r), 10, 100)
		time.Sleep(100 * time.Millisecond)
	}
	if v, most := b.w.Stats().Vacuums-v0, 8+int(time.Since(start)/(800*time.Millisecond)); v > uint64(most) {
		t.Fatalf("%d vacuums while a snapshot held them back, want at most %d (backing off)", v, most)
	}
	if !strings.Contains(logs.String(), "holds the steps' vacuum back") {
		t.Fatalf("the writer did not say its vacuum was held back; log:\n%s", logs)
	}
	must(t, tx.Rollback(t.Context()))
	appendEpisodes(t, b.w, "after", 10, 100)
	const total, want = 32_000, 32_000 - 500 - 100
	if n := waitFrozen(t, b.url, want); n < want {
		t.Fatalf("%d of %d steps frozen after the snapshot ended, want at least %d; %d vacuums; log:\n%s", n, total, want, b.w.Stats().Vacuums, logs)
	}
	if !strings.Contains(logs.String(), "no longer held back") {
		t.Fatalf("the writer did not say its vacuum went on; log:\n%s", logs)
	}
	if strings.Contains(logs.String(), "level=WARN") {
		t.Fatalf("the writer logged warnings:\n%s", logs)
	}
}

// The VACUUM's options follow the server's version.
func TestVacuumStatement(t *testing.T) {
	for _, c := range []struct {
		version int
		want    string
	}{
		{170012, "VACUUM (SKIP_LOCKED, TRUNCATE false, SKIP_DATABASE_STATS) steps"},
		{160000, "VACUUM (SKIP_LOCKED, TRUNCATE false, SKIP_DATABASE_STATS) steps"},
		{150018, "VACUUM (SKIP_LOCKED, TRUNCATE false) steps"},
		{120000, "VACUUM (SKIP_LOCKED, TRUNCATE false) steps"},
		{110022, ""},
	} {
		got, err := ledger.VacuumStatement(c.version)
		if got != c.want || (c.want == "") != (err != nil) {
			t.Fatalf("server_version_num %d: %q, %v; want %q", c.version, got, err, c.want)
		}
	}
}
