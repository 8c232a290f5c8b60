package ledger_test

import (
	"context"
	"sync"
	"testing"

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
	if n := count(t, url, "SELECT count(*) FROM schema_migrations"); n != 1 {
		t.Fatalf("schema_migrations has %d rows, want 1", n)
	}
	if n := count(t, url, "SELECT count(*) FROM information_schema.tables WHERE table_name IN ('runs','episodes','steps','rewards','checkpoints')"); n != 5 {
		t.Fatalf("%d ledger tables, want 5", n)
	}
	must(t, ledger.MigrateURL(t.Context(), url)) // and again: a no-op
}
