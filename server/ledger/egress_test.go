package ledger_test

import (
	"context"
	"errors"
	"testing"
	"time"

	"github.com/deltagym/deltagym/server/ledger"
	"github.com/deltagym/deltagym/server/ledger/pgtest"
)

func egressRows(at time.Time) []ledger.EgressRow {
	return []ledger.EgressRow{
		{Env: "pip", Sandbox: "sb-1", EpisodeID: "ep-1", Host: "pypi.org", Port: 443, Address: "151.101.0.223", Allowed: true,
			BytesUp: 517, BytesDown: 4096, StartedAt: at, Duration: 3 * time.Millisecond},
		{Env: "pip", Sandbox: "sb-1", Host: "index.test", Port: 80, Address: "10.0.0.7",
			Reason: "egress refused: 10.0.0.7 is a private address, which the allow-list does not name", StartedAt: at},
		{Env: "pip", Sandbox: "sb-2", Host: "nowhere.test", Port: 80, Reason: "resolving nowhere.test: no such host", StartedAt: at},
	}
}

// checkEgress checks that the rows of egressRows arrived whole.
func checkEgress(t *testing.T, url string) {
	t.Helper()
	for q, want := range map[string]int{
		"SELECT count(*) FROM egress": 3,
		`SELECT count(*) FROM egress WHERE env = 'pip' AND sandbox = 'sb-1' AND episode_id = 'ep-1' AND host = 'pypi.org'
			AND port = 443 AND address = '151.101.0.223'::inet AND allowed AND reason IS NULL AND bytes_up = 517
			AND bytes_down = 4096 AND duration_ns = 3000000`: 1,
		`SELECT count(*) FROM egress WHERE NOT allowed AND episode_id IS NULL AND reason LIKE '%private address%'
			AND address = '10.0.0.7'::inet`: 1,
		"SELECT count(*) FROM egress WHERE sandbox = 'sb-2' AND address IS NULL AND reason LIKE 'resolving%'": 1,
	} {
		if n := count(t, url, q); n != want {
			t.Errorf("%s: %d, want %d", q, n, want)
		}
	}
}

func TestEgressRows(t *testing.T) {
	t.Parallel()
	b := setup(t, nil)
	for _, r := range egressRows(b.at(0)) {
		must(t, b.w.Egress(r))
	}
	must(t, b.w.Flush(t.Context()))
	checkEgress(t, b.url)
	for _, bad := range []ledger.EgressRow{{Host: "h", Port: 1}, {Sandbox: "s", Port: 1}, {Sandbox: "s", Host: "h", Port: 70000}} {
		if err := b.w.Egress(bad); !errors.Is(err, ledger.ErrInvalid) {
			t.Errorf("Egress(%+v) = %v, want ErrInvalid", bad, err)
		}
	}
}

// Rows spooled while Postgres is down arrive, decoded from the spool, once it is back.
func TestEgressRowsFromSpool(t *testing.T) {
	t.Parallel()
	srv, url := pgtest.Private(t)
	spool := t.TempDir()
	must(t, srv.Stop(t.Context()))
	w, err := ledger.NewWriter(ledger.Config{URL: url, SpoolDir: spool, Logger: quiet})
	must(t, err)
	for _, r := range egressRows(time.Now()) {
		must(t, w.Egress(r))
	}
	ctx, cancel := context.WithTimeout(t.Context(), 100*time.Millisecond)
	defer cancel()
	if err := w.Close(ctx); !errors.Is(err, ledger.ErrUndelivered) {
		t.Fatalf("Close with Postgres down = %v, want ErrUndelivered", err)
	}
	must(t, srv.StartAgain(t.Context()))
	w2, err := ledger.NewWriter(ledger.Config{URL: url, SpoolDir: spool, Logger: quiet})
	must(t, err)
	must(t, w2.Close(t.Context()))
	checkEgress(t, url)
}
