package ledger_test

import (
	"bytes"
	"context"
	"fmt"
	"log/slog"
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
	mu  sync.Mutex
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

// frozenSteps counts the step rows on pages the visibility map has all-frozen.
func frozenSteps(t *testing.T, dbURL string) int {
	t.Helper()
	conn, err := pgx.Connect(t.Context(), dbURL)
	must(t, err)
	defer conn.Close(context.Background())
	_, err = conn.Exec(t.Context(), "CREATE EXTENSION IF NOT EXISTS pg_visibility")
	must(t, err)
	var n int
	must(t, conn.QueryRow(t.Context(), `SELECT count(*) FROM steps s
		JOIN pg_visibility_map('steps') v ON v.blkno = (s.ctid::text::point)[0]::bigint
		WHERE v.all_frozen`).Scan(&n))
	return n
}

// appendEpisodes appends episodes of perEpisode steps with 2 KiB observations (three or four
// rows to a page) and flushes.
func appendEpisodes(t *testing.T, w *ledger.Writer, prefix string, episodes, perEpisode int) {
	t.Helper()
	obs := bytes.Repeat([]byte("0123456789abcdef"), 128)
	for e := range episodes {
		ep := fmt.Sprintf("%s-%d", prefix, e)
		must(t, w.EpisodeStarted(ledger.EpisodeStart{ID: ep, Env: "env", Run: "vacuum"}))
		for i := range perEpisode {
			row := stepRow(ep, i)
			row.Observation = append([]byte(nil), obs...)
			must(t, w.Step(row))
		}
	}
	must(t, w.Flush(t.Context()))
}

// The writer vacuums and freezes the steps it delivered, every VacuumSteps of them, so that
// autovacuum never has to read their pages back; with VacuumSteps negative it leaves them be.
func TestWriterVacuumsSteps(t *testing.T) {
	t.Parallel()
	const every, total = 1000, 6000
	logs := &logBuffer{}
	b := setup(t, func(c *ledger.Config) {
		c.VacuumSteps = every
		c.Conns, c.BatchRows = 1, 200
		c.Logger = slog.New(slog.NewTextHandler(logs, &slog.HandlerOptions{Level: slog.LevelWarn}))
	})
	appendEpisodes(t, b.w, "vac", total/100, 100)
	// Each vacuum freezes what was committed when it started, and the next starts once every
	// more steps are delivered (and four times as long as it took has passed): in the end, all
	// but the steps delivered since the last one (fewer than every) and a batch being copied
	// then are frozen. The last may still be running.
	want := total - every - 200
	deadline := time.Now().Add(30 * time.Second)
	n := frozenSteps(t, b.url)
	for ; n < want && time.Now().Before(deadline); n = frozenSteps(t, b.url) {
		time.Sleep(50 * time.Millisecond)
	}
	if n < want {
		t.Fatalf("%d of %d steps frozen after %d vacuums, want at least %d; log:\n%s", n, total, b.w.Stats().Vacuums, want, logs)
	}
	if s := logs.String(); s != "" {
		t.Fatalf("the writer logged warnings:\n%s", s)
	}

	off := setup(t, func(c *ledger.Config) { c.VacuumSteps = -1 })
	appendEpisodes(t, off.w, "novac", 20, 100)
	if v := off.w.Stats().Vacuums; v != 0 {
		t.Fatalf("with VacuumSteps -1 the writer ran %d vacuums", v)
	}
	// Autovacuum may vacuum the table meanwhile, but it freezes no row as young as these.
	if n := frozenSteps(t, off.url); n != 0 {
		t.Fatalf("with VacuumSteps -1, %d steps frozen", n)
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
		c.Logger = slog.New(slog.NewTextHandler(logs, &slog.HandlerOptions{Level: slog.LevelWarn}))
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
	if strings.Count(s, "does not vacuum") != 1 || !strings.Contains(s, "permission denied") {
		t.Fatalf("want one warning that the writer does not vacuum (permission denied), got:\n%s", s)
	}
	if v := b.w.Stats().Vacuums; v != 0 {
		t.Fatalf("%d vacuums counted, want 0", v)
	}
}

// An older snapshot held open elsewhere keeps the writer's vacuums from marking anything; the
// writer then backs off instead of scanning the same pages every VacuumSteps, and catches up
// once the snapshot is gone.
func TestWriterVacuumHeldBack(t *testing.T) {
	t.Parallel()
	logs := &logBuffer{}
	b := setup(t, func(c *ledger.Config) {
		c.VacuumSteps = 500
		c.Conns, c.BatchRows = 1, 100 // patience: 2,000 steps without a gain
		c.Logger = slog.New(slog.NewTextHandler(logs, &slog.HandlerOptions{Level: slog.LevelWarn}))
	})
	appendEpisodes(t, b.w, "before", 10, 100)
	conn, err := pgx.Connect(t.Context(), b.url)
	must(t, err)
	defer conn.Close(context.Background())
	tx, err := conn.BeginTx(t.Context(), pgx.TxOptions{IsoLevel: pgx.RepeatableRead})
	must(t, err)
	must(t, tx.QueryRow(t.Context(), "SELECT count(*) FROM steps").Scan(new(int)))
	v0 := b.w.Stats().Vacuums
	// 30 rounds of 1,000 steps, 100 ms apart: 60 vacuums' worth.
	for r := range 30 {
		appendEpisodes(t, b.w, fmt.Sprintf("held%d", r), 10, 100)
		time.Sleep(100 * time.Millisecond)
	}
	if v := b.w.Stats().Vacuums - v0; v > 12 {
		t.Fatalf("%d vacuums while a snapshot held them back, want a few (backing off)", v)
	}
	must(t, tx.Rollback(t.Context()))
	appendEpisodes(t, b.w, "after", 10, 100)
	const total, want = 32_000, 32_000 - 500 - 1000
	deadline := time.Now().Add(30 * time.Second)
	n := frozenSteps(t, b.url)
	for ; n < want && time.Now().Before(deadline); n = frozenSteps(t, b.url) {
		time.Sleep(100 * time.Millisecond)
	}
	if n < want {
		t.Fatalf("%d of %d steps frozen after the snapshot ended, want at least %d", n, total, want)
	}
	if s := logs.String(); s != "" {
		t.Fatalf("the writer logged warnings:\n%s", s)
	}
}
