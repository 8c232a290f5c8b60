package ledger_test

import (
	"context"
	"encoding/base64"
	"errors"
	"fmt"
	"math/rand/v2"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/deltagym/deltagym/server/ledger"
	"github.com/deltagym/deltagym/server/ledger/pgtest"
)

// Servers starting together migrate once: the advisory lock serialises them.
func TestMigrateConcurrently(t *testing.T) {
	t.Parallel()
	url := pgtest.Empty(t)
	var wg sync.WaitGroup
	errs := make([]error, 4)
	applied := make([][]string, 4)
	for i := range errs {
		wg.Go(func() { applied[i], errs[i] = ledger.MigrateURL(context.Background(), url) })
	}
	wg.Wait()
	for i, err := range errs {
		if err != nil {
			t.Fatalf("migration %d: %v", i, err)
		}
	}
	files, err := filepath.Glob("migrations/*.sql")
	if err != nil || len(files) == 0 {
		t.Fatalf("listing migrations: %v (%d files)", err, len(files))
	}
	// One of them applied every migration, and said so; the others found nothing to do.
	var sizes []int
	for _, a := range applied {
		sizes = append(sizes, len(a))
	}
	slices.Sort(sizes)
	if !slices.Equal(sizes, []int{0, 0, 0, len(files)}) {
		t.Fatalf("the four migrations applied %v, want one all %d and the others none", applied, len(files))
	}
	if n := count(t, url, "SELECT count(*) FROM schema_migrations"); n != len(files) {
		t.Fatalf("schema_migrations has %d rows, want %d", n, len(files))
	}
	if n := count(t, url, "SELECT count(*) FROM information_schema.tables WHERE table_name IN ('runs','episodes','steps','rewards','checkpoints')"); n != 5 {
		t.Fatalf("%d ledger tables, want 5", n)
	}
	again, err := ledger.MigrateURL(t.Context(), url) // and again: a no-op
	must(t, err)
	if len(again) != 0 {
		t.Fatalf("migrating an up-to-date schema applied %v", again)
	}
}

// A step's small columns never go to the TOAST table: only an observation too big for a page
// does (compressed first). Under 0001 alone, a 4 KiB observation pushed the SHA-256 and the
// action out to TOAST, two TOAST rows per step.
func TestStepsStayInline(t *testing.T) {
	t.Parallel()
	text := syntheticText(1 << 20)
	random := make([]byte, 64<<10)
	rng := rand.New(rand.NewPCG(3, 4))
	for i := range random {
		random[i] = byte(rng.Uint32())
	}
	for _, tc := range []struct {
		name       string
		obs        []byte
		wantChunks bool // the observation itself is too big for the page, even compressed
	}{
		{"empty", nil, false},
		{"text-4KiB", text[:4096], false},
		{"text-7KiB", text[:7000], false},
		{"incompressible-6KiB", random[:6000], false},
		{"incompressible-64KiB", random, true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			b := setup(t, func(c *ledger.Config) { c.Logger = quiet })
			must(t, b.w.EpisodeStarted(ledger.EpisodeStart{ID: "ep", Env: "env"}))
			const steps = 20
			for i := range steps {
				r := stepRow("ep", i)
				r.Observation = tc.obs
				must(t, b.w.Step(r))
			}
			must(t, b.w.Flush(t.Context()))
			var toast string
			conn, err := pgx.Connect(t.Context(), b.url)
			must(t, err)
			defer conn.Close(context.Background())
			must(t, conn.QueryRow(t.Context(), "SELECT reltoastrelid::regclass::text FROM pg_class WHERE oid = 'steps'::regclass").Scan(&toast))
			chunks := count(t, b.url, "SELECT count(DISTINCT chunk_id) FROM "+toast)
			switch {
			case tc.wantChunks && chunks != steps:
				t.Fatalf("%d values in TOAST, want %d (one observation per step)", chunks, steps)
			case !tc.wantChunks && chunks != 0:
				t.Fatalf("%d values in TOAST, want none", chunks)
			}
			if n := count(t, b.url, "SELECT count(*) FROM steps WHERE observation_size = $1 AND length(observation) = $1", len(tc.obs)); n != steps {
				t.Fatalf("%d steps read back whole, want %d", n, steps)
			}
		})
	}
}

// A step's action big enough to be compressed (a write_file's content, base64 in its JSON,
// with a small observation) is compressed with lz4 (0003), not pglz, and reads back whole.
func TestActionCompressedWithLZ4(t *testing.T) {
	t.Parallel()
	b := setup(t, func(c *ledger.Config) { c.Logger = quiet })
	must(t, b.w.EpisodeStarted(ledger.EpisodeStart{ID: "ep", Env: "env"}))
	content := strings.Repeat("print('hello')\n", 400) // 6,000 bytes
	action := fmt.Appendf(nil, `{"writeFile":{"path":"/work/a.py","content":%q}}`, base64.StdEncoding.EncodeToString([]byte(content)))
	const steps = 5
	for i := range steps {
		r := stepRow("ep", i)
		r.Action = action
		must(t, b.w.Step(r))
	}
	must(t, b.w.Flush(t.Context()))
	if n := count(t, b.url, "SELECT count(*) FROM steps WHERE pg_column_compression(action) = 'lz4'"); n != steps {
		t.Fatalf("%d actions compressed with lz4, want %d (methods: %d pglz, %d none)", n, steps,
			count(t, b.url, "SELECT count(*) FROM steps WHERE pg_column_compression(action) = 'pglz'"),
			count(t, b.url, "SELECT count(*) FROM steps WHERE pg_column_compression(action) IS NULL"))
	}
	if n := count(t, b.url, "SELECT count(*) FROM steps WHERE convert_from(decode(action->'writeFile'->>'content', 'base64'), 'UTF8') = $1", content); n != steps {
		t.Fatalf("%d actions read back whole, want %d", n, steps)
	}
}

// A step's ids and hash are stored as they are (0006: never compressed nor moved out of
// line): ids of MaxIDLen bytes fit next to an observation too big for the page, which goes to
// TOAST; a longer id or a hash of another size is refused, and nothing of it is stored.
func TestStepIDsPlain(t *testing.T) {
	t.Parallel()
	b := setup(t, func(c *ledger.Config) { c.Logger = quiet })
	random := make([]byte, 64<<10)
	rng := rand.New(rand.NewPCG(5, 6))
	for i := range random {
		random[i] = byte(rng.Uint32())
	}
	ep := "ep-" + strings.Repeat("e", ledger.MaxIDLen-3)
	ckpt := strings.Repeat("c", ledger.MaxIDLen)
	must(t, b.w.EpisodeStarted(ledger.EpisodeStart{ID: ep, Env: "env"}))
	if err := b.w.EpisodeStarted(ledger.EpisodeStart{ID: ep + "x", Env: "env"}); !errors.Is(err, ledger.ErrInvalid) {
		t.Fatalf("an episode id over MaxIDLen: %v, want ErrInvalid", err)
	}
	if err := b.w.Checkpoint(ledger.CheckpointRow{ID: ckpt + "x", Env: "env", Kind: ledger.KindUser}); !errors.Is(err, ledger.ErrInvalid) {
		t.Fatalf("a checkpoint id over MaxIDLen: %v, want ErrInvalid", err)
	}
	r := stepRow(ep, 0)
	r.Observation, r.CheckpointID = random, ckpt
	must(t, b.w.Step(r))
	for _, bad := range []func(*ledger.StepRow){
		func(r *ledger.StepRow) { r.EpisodeID += "x" },
		func(r *ledger.StepRow) { r.CheckpointID = ckpt + "x" },
		func(r *ledger.StepRow) { r.ObservationSHA256 = make([]byte, 31) },
	} {
		r := stepRow(ep, 1)
		bad(&r)
		if err := b.w.Step(r); !errors.Is(err, ledger.ErrInvalid) {
			t.Fatalf("step refused with %v, want ErrInvalid", err)
		}
	}
	must(t, b.w.Flush(t.Context()))
	if n := count(t, b.url, "SELECT count(*) FROM steps"); n != 1 {
		t.Fatalf("%d steps stored, want 1", n)
	}
	if n := count(t, b.url, "SELECT count(*) FROM steps WHERE episode_id = $1 AND checkpoint_id = $2 AND observation = $3",
		ep, ckpt, random); n != 1 {
		t.Fatal("the step did not read back whole")
	}
	for _, col := range []string{"episode_id", "checkpoint_id"} { // 1 KiB of one letter: pglz would take it
		if n := count(t, b.url, "SELECT count(*) FROM steps WHERE pg_column_compression("+col+") IS NOT NULL"); n != 0 {
			t.Fatalf("%s compressed", col)
		}
	}
	if n := count(t, b.url, `SELECT count(*) FROM pg_attribute WHERE attrelid = 'steps'::regclass
		AND attname IN ('episode_id', 'observation_sha256', 'checkpoint_id') AND attstorage = 'p'`); n != 3 {
		t.Fatalf("%d of the ids and hash are PLAIN, want 3", n)
	}
	// The observation, too big for the page and incompressible, went to TOAST.
	var toast string
	conn, err := pgx.Connect(t.Context(), b.url)
	must(t, err)
	defer conn.Close(context.Background())
	must(t, conn.QueryRow(t.Context(), "SELECT reltoastrelid::regclass::text FROM pg_class WHERE oid = 'steps'::regclass").Scan(&toast))
	if n := count(t, b.url, "SELECT count(DISTINCT chunk_id) FROM "+toast); n != 1 {
		t.Fatalf("%d values in TOAST, want the observation", n)
	}
}

// A migration that needs a lock another session holds gives up after lockTimeout instead of
// queueing every later session behind it, and tries again until it gets the lock.
func TestMigrateWaitsOutALock(t *testing.T) {
	t.Parallel()
	url := pgtest.Empty(t)
	_, err := ledger.MigrateURL(t.Context(), url)
	must(t, err)
	conn, err := pgx.Connect(t.Context(), url)
	must(t, err)
	defer conn.Close(context.Background())
	_, err = conn.Exec(t.Context(), "DELETE FROM schema_migrations WHERE version = 6") // 0006 again
	must(t, err)
	tx, err := conn.Begin(t.Context())
	must(t, err)
	_, err = tx.Exec(t.Context(), "LOCK TABLE steps IN ACCESS SHARE MODE") // a long reader
	must(t, err)
	type result struct {
		applied []string
		err     error
		took    time.Duration
	}
	done := make(chan result, 1)
	start := time.Now()
	go func() {
		applied, err := ledger.MigrateURL(context.Background(), url)
		done <- result{applied, err, time.Since(start)}
	}()
	// Meanwhile another session reads steps: not queued behind the waiting migration for long.
	other, err := pgx.Connect(t.Context(), url)
	must(t, err)
	defer other.Close(context.Background())
	time.Sleep(500 * time.Millisecond)
	t0 := time.Now()
	var n int
	qctx, cancel := context.WithTimeout(t.Context(), 7*time.Second)
	defer cancel()
	if err := other.QueryRow(qctx, "SELECT count(*) FROM steps").Scan(&n); err != nil || time.Since(t0) > 6*time.Second {
		t.Fatalf("a reader waited %v behind the migration (%v)", time.Since(t0), err)
	}
	time.Sleep(time.Until(start.Add(9 * time.Second))) // past one attempt's lock timeout, not two
	must(t, tx.Rollback(t.Context()))
	r := <-done
	if r.err != nil || len(r.applied) != 1 || !strings.HasPrefix(r.applied[0], "0006_") || r.took < 9*time.Second {
		t.Fatalf("migration: applied %v, err %v, after %v; want 0006 once the lock was released", r.applied, r.err, r.took)
	}
}
