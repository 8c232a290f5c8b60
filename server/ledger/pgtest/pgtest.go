// Package pgtest gives tests a real, private Postgres with the ledger schema: one cluster per
// test binary, started by the first test that asks for a database and stopped by Run (from
// TestMain) once the tests are over, and a fresh database per test, copied from a migrated
// template; or a cluster of a test's own (Private) for tests that stop and restart it. A binary
// whose selected tests need no database starts no cluster. Under -short (the unit tier) tests
// that need one skip.
package pgtest

import (
	"context"
	"fmt"
	"log/slog"
	"os"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/deltagym/deltagym/internal/locate"
	"github.com/deltagym/deltagym/internal/testenv"
	"github.com/deltagym/deltagym/server/ledger"
	"github.com/deltagym/deltagym/server/ledger/pgserver"
)

const templateDB = "ledger_template"

var (
	// sharedMu guards the shared cluster: started once, by the first test that needs it.
	sharedMu sync.Mutex
	// +checklocks:sharedMu
	shared *pgserver.Server
	// +checklocks:sharedMu
	sharedErr error
	// +checklocks:sharedMu
	sharedDir string
	// +checklocks:sharedMu
	sharedRun bool       // Run is in charge: it stops the cluster after the tests
	mu        sync.Mutex // serialises CREATE DATABASE … TEMPLATE
	counter   atomic.Int64
)

// Run runs the tests and then stops the binary's shared cluster, if a test started it. Use it
// from TestMain:
//
//	func TestMain(m *testing.M) { os.Exit(pgtest.Run(m)) }
//
// If Postgres is not installed the tests still run, and Start skips them.
func Run(m *testing.M) int {
	sharedMu.Lock()
	sharedRun = true
	sharedMu.Unlock()
	code := m.Run()
	sharedMu.Lock()
	defer sharedMu.Unlock()
	if shared != nil {
		if err := shared.Stop(context.Background()); err != nil {
			fmt.Fprintln(os.Stderr, "pgtest: stopping the shared postgres:", err)
		}
		shared = nil
	}
	if sharedDir != "" {
		os.RemoveAll(sharedDir)
	}
	return code
}

// sharedServer returns the binary's shared cluster, starting it on first use, or nil when Run
// is not in charge of stopping it.
func sharedServer() (*pgserver.Server, error) {
	sharedMu.Lock()
	defer sharedMu.Unlock()
	if !sharedRun || shared != nil || sharedErr != nil {
		return shared, sharedErr
	}
	sharedDir, sharedErr = os.MkdirTemp("", "pgtest") // short: a socket path must fit 107 bytes
	if sharedErr != nil {
		return nil, sharedErr
	}
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	shared, sharedErr = startWithTemplate(ctx, sharedDir, false)
	return shared, sharedErr
}

func skipReason() string {
	if r := testenv.IntegrationReason("a Postgres"); r != "" {
		return r
	}
	if _, err := locate.PostgresBinDirs(); err != nil {
		return err.Error()
	}
	return ""
}

func startWithTemplate(ctx context.Context, dir string, supervise bool) (*pgserver.Server, error) {
	settings := map[string]string{"max_connections": "200"}
	if supervise {
		// Commits made without synchronous_commit reach the WAL only with the WAL writer's
		// next round: ten seconds, so that a kill loses them for sure if the ledger's commits
		// were such (TestPostgresKilled).
		settings["wal_writer_delay"] = "10s"
	}
	// No memory cap (pgserver's tests cover it): up to 200 backends of parallel tests could
	// outgrow the default one, and an OOM kill restarts the whole shared cluster.
	binDirs, err := locate.PostgresBinDirs()
	if err != nil {
		return nil, err
	}
	s, err := pgserver.StartConfig(ctx, pgserver.Config{BinDirs: binDirs, DataDir: dir, Database: templateDB, NoSync: true,
		MemoryLimit: -1, SmartTimeout: 100 * time.Millisecond, Settings: settings,
		Supervise: supervise, RestartDelay: 100 * time.Millisecond, Logger: slog.New(slog.DiscardHandler)})
	if err != nil {
		return nil, err
	}
	if _, err := ledger.MigrateURL(ctx, s.URL()); err != nil {
		_ = s.Stop(context.Background())
		return nil, err
	}
	return s, nil
}

// Start returns the URL of a fresh database with the ledger schema, dropped when the test ends.
// It uses the shared cluster if TestMain calls Run, else starts a cluster for the test.
func Start(t testing.TB) string {
	t.Helper()
	return freshDB(t, server(t), templateDB)
}

// Empty is like Start but the database has no schema (for migration tests).
func Empty(t testing.TB) string {
	t.Helper()
	return freshDB(t, server(t), "template0")
}

func server(t testing.TB) *pgserver.Server {
	t.Helper()
	if r := skipReason(); r != "" {
		t.Skip(r)
	}
	s, err := sharedServer()
	if err != nil {
		t.Fatalf("shared postgres: %v", err)
	}
	if s != nil {
		return s
	}
	s, _ = Private(t)
	return s
}

// Private starts a cluster of the test's own (stopped at cleanup) and returns it with the URL
// of a migrated database on it, for tests that stop or restart Postgres.
func Private(t testing.TB) (*pgserver.Server, string) {
	t.Helper()
	return private(t, false)
}

// Supervised is Private with the cluster supervised (pgserver.Config.Supervise), as the
// server runs its own: a postmaster that dies is started again.
func Supervised(t testing.TB) (*pgserver.Server, string) {
	t.Helper()
	return private(t, true)
}

func private(t testing.TB, supervise bool) (*pgserver.Server, string) {
	t.Helper()
	if r := skipReason(); r != "" {
		t.Skip(r)
	}
	dir, err := os.MkdirTemp("", "pgtest") // short: t.TempDir can be too deep for a socket path
	if err != nil {
		t.Fatal(err)
	}
	s, err := startWithTemplate(context.Background(), dir, supervise)
	if err != nil {
		os.RemoveAll(dir)
		t.Fatalf("starting private postgres: %v", err)
	}
	t.Cleanup(func() {
		if err := s.Stop(context.Background()); err != nil {
			t.Errorf("stopping private postgres: %v", err)
		}
		os.RemoveAll(dir)
	})
	return s, freshDB(t, s, templateDB)
}

func freshDB(t testing.TB, s *pgserver.Server, template string) string {
	t.Helper()
	ctx := context.Background()
	name := fmt.Sprintf("test_%d_%d", os.Getpid(), counter.Add(1))
	conn, err := pgx.Connect(ctx, s.URLFor("postgres"))
	if err != nil {
		t.Fatalf("connecting to test postgres: %v", err)
	}
	defer conn.Close(ctx)
	mu.Lock()
	_, err = conn.Exec(ctx, "CREATE DATABASE "+name+" TEMPLATE "+template)
	mu.Unlock()
	if err != nil {
		t.Fatalf("creating test database: %v", err)
	}
	t.Cleanup(func() {
		conn, err := pgx.Connect(ctx, s.URLFor("postgres"))
		if err != nil {
			return // the test stopped the server for good
		}
		defer conn.Close(ctx)
		_, _ = conn.Exec(ctx, "DROP DATABASE IF EXISTS "+name+" WITH (FORCE)")
	})
	return s.URLFor(name)
}
