package ledger_test

import (
	"context"
	"errors"
	"log/slog"
	"os"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/deltagym/deltagym/server/ledger"
	"github.com/deltagym/deltagym/server/ledger/pgtest"
)

// quiet drops the writers' retry logs (the tests check Stats instead).
var quiet = slog.New(slog.DiscardHandler)

func TestMain(m *testing.M) {
	if os.Getenv(childEnv) != "" {
		if os.Getenv(childStoredEnv) != "" {
			os.Exit(storedChild())
		}
		os.Exit(killChild())
	}
	os.Exit(pgtest.Run(m))
}

type bundle struct {
	url   string
	w     *ledger.Writer
	store *ledger.Store
	spool string
	t0    time.Time
}

// setup returns a writer and a store over a fresh database.
func setup(t *testing.T, mod func(*ledger.Config)) *bundle {
	t.Helper()
	return setupURL(t, pgtest.Start(t), mod)
}

func setupURL(t *testing.T, url string, mod func(*ledger.Config)) *bundle {
	t.Helper()
	cfg := ledger.Config{URL: url, SpoolDir: t.TempDir(), Logger: quiet}
	if mod != nil {
		mod(&cfg)
	}
	w, err := ledger.NewWriter(cfg)
	if err != nil {
		t.Fatal(err)
	}
	st, err := ledger.Open(t.Context(), url, w)
	if err != nil {
		t.Fatal(err)
	}
	b := &bundle{url: url, w: w, store: st, spool: cfg.SpoolDir, t0: time.Now().UTC().Truncate(time.Millisecond)}
	t.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
		defer cancel()
		if err := w.Close(ctx); err != nil && !errors.Is(err, ledger.ErrUndelivered) {
			t.Errorf("closing writer: %v", err)
		}
		st.Close()
	})
	return b
}

// at returns a distinct, ordered timestamp.
func (b *bundle) at(i int) time.Time { return b.t0.Add(time.Duration(i) * time.Millisecond) }

func must(t *testing.T, err error) {
	t.Helper()
	if err != nil {
		t.Fatal(err)
	}
}

func count(t *testing.T, url, q string, args ...any) int {
	t.Helper()
	conn, err := pgx.Connect(t.Context(), url)
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close(context.Background())
	var n int
	if err := conn.QueryRow(t.Context(), q, args...).Scan(&n); err != nil {
		t.Fatalf("%s: %v", q, err)
	}
	return n
}
