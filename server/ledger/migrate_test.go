package ledger_test

import (
	"context"
	"encoding/base64"
	"fmt"
	"math/rand/v2"
	"path/filepath"
	"strings"
	"sync"
	"testing"

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
	for i := range errs {
		wg.Go(func() { errs[i] = ledger.MigrateURL(context.Background(), url) })
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
	if n := count(t, url, "SELECT count(*) FROM schema_migrations"); n != len(files) {
		t.Fatalf("schema_migrations has %d rows, want %d", n, len(files))
	}
	if n := count(t, url, "SELECT count(*) FROM information_schema.tables WHERE table_name IN ('runs','episodes','steps','rewards','checkpoints')"); n != 5 {
		t.Fatalf("%d ledger tables, want 5", n)
	}
	must(t, ledger.MigrateURL(t.Context(), url)) // and again: a no-op
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
