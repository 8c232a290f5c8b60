package pgserver

import (
	"context"
	"log/slog"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
)

func skipUnlessPostgres(t *testing.T) {
	t.Helper()
	if _, err := os.Stat(filepath.Join(DefaultBinDir, "postgres")); err != nil {
		t.Skipf("postgres 15 not installed in %s (run scripts/deps.sh postgres)", DefaultBinDir)
	}
}

func ping(t *testing.T, url string) {
	t.Helper()
	conn, err := pgx.Connect(t.Context(), url)
	if err != nil {
		t.Fatalf("connecting to %s: %v", url, err)
	}
	defer conn.Close(context.Background())
	var one int
	if err := conn.QueryRow(t.Context(), "SELECT 1").Scan(&one); err != nil || one != 1 {
		t.Fatalf("SELECT 1 = %d, %v", one, err)
	}
}

func TestStartStopRestart(t *testing.T) {
	skipUnlessPostgres(t)
	dir := t.TempDir()
	begin := time.Now()
	s, err := StartConfig(t.Context(), Config{DataDir: dir})
	if err != nil {
		t.Fatal(err)
	}
	t.Logf("fresh cluster: initdb+start+createdb in %v", time.Since(begin))
	begin = time.Now()
	fast, err := StartConfig(t.Context(), Config{DataDir: t.TempDir(), NoSync: true})
	if err != nil {
		t.Fatal(err)
	}
	t.Logf("fresh cluster without fsync (tests): initdb+start+createdb in %v", time.Since(begin))
	if err := fast.Stop(t.Context()); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = s.Stop(context.Background()) })
	ping(t, s.URL())

	// No TCP listener: the settings say so.
	conn, err := pgx.Connect(t.Context(), s.URL())
	if err != nil {
		t.Fatal(err)
	}
	var listen string
	if err := conn.QueryRow(t.Context(), "SHOW listen_addresses").Scan(&listen); err != nil {
		t.Fatal(err)
	}
	// The ledger's defaults apply: WAL segments are not zero-filled, forced checkpoints are rare.
	var initZero, maxWAL string
	if err := conn.QueryRow(t.Context(), "SELECT current_setting('wal_init_zero'), current_setting('max_wal_size')").Scan(&initZero, &maxWAL); err != nil {
		t.Fatal(err)
	}
	conn.Close(t.Context())
	if listen != "" {
		t.Fatalf("listen_addresses = %q, want empty (unix socket only)", listen)
	}
	if initZero != "off" || maxWAL != "2GB" {
		t.Fatalf("wal_init_zero = %s, max_wal_size = %s; want off and 2GB (defaultSettings)", initZero, maxWAL)
	}

	begin = time.Now()
	if err := s.Restart(t.Context()); err != nil {
		t.Fatal(err)
	}
	t.Logf("restart of an existing cluster: %v", time.Since(begin))
	ping(t, s.URL())

	if err := s.Stop(t.Context()); err != nil {
		t.Fatal(err)
	}
	if err := s.Stop(t.Context()); err != nil {
		t.Fatalf("second Stop: %v", err)
	}
	if _, err := pgx.Connect(t.Context(), s.URL()); err == nil {
		t.Fatal("connected to a stopped server")
	}
	if err := s.StartAgain(t.Context()); err != nil {
		t.Fatal(err)
	}
	ping(t, s.URL())
}

func TestStalePostmasterPid(t *testing.T) {
	skipUnlessPostgres(t)
	dir := t.TempDir()
	s, err := Start(t.Context(), dir)
	if err != nil {
		t.Fatal(err)
	}
	if err := s.Stop(t.Context()); err != nil {
		t.Fatal(err)
	}
	// A crashed run leaves a postmaster.pid naming a process that is gone.
	pidFile := filepath.Join(dir, "postgres", "postmaster.pid")
	if err := os.WriteFile(pidFile, []byte("999999\n"+filepath.Join(dir, "postgres")+"\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	s2, err := Start(t.Context(), dir)
	if err != nil {
		t.Fatalf("start over a stale postmaster.pid: %v", err)
	}
	defer s2.Stop(context.Background())
	ping(t, s2.URL())
}

func TestOrphanedPostmaster(t *testing.T) {
	skipUnlessPostgres(t)
	dir := t.TempDir()
	s, err := Start(t.Context(), dir)
	if err != nil {
		t.Fatal(err)
	}
	oldPid := s.cmd.Process.Pid
	// The process that started it "crashes": the postmaster is left running, unowned.
	s2, err := Start(t.Context(), dir)
	if err != nil {
		t.Fatalf("start over a live orphaned postmaster: %v", err)
	}
	defer s2.Stop(context.Background())
	<-s.exited // the orphan was shut down
	ping(t, s2.URL())
	b, err := os.ReadFile(filepath.Join(dir, "postgres", "postmaster.pid"))
	if err != nil {
		t.Fatal(err)
	}
	if string(b[:len(strconv.Itoa(oldPid))]) == strconv.Itoa(oldPid) {
		t.Fatalf("postmaster.pid still names the old postmaster %d", oldPid)
	}
}

func TestSocketPathTooLong(t *testing.T) {
	long := filepath.Join(t.TempDir(), string(make([]byte, 0)))
	for len(long) < 120 {
		long = filepath.Join(long, "deeper")
	}
	cfg := Config{DataDir: long}
	if err := cfg.Validate(); err == nil {
		t.Fatal("Validate accepted a data dir too deep for a unix socket")
	}
}

// StopOrphan shuts down a postmaster left by a crashed run, and is a no-op
// when there is none.
func TestStopOrphan(t *testing.T) {
	skipUnlessPostgres(t)
	dir := t.TempDir()
	if err := StopOrphan(t.Context(), dir); err != nil {
		t.Fatalf("StopOrphan without a cluster: %v", err)
	}
	s, err := Start(t.Context(), dir)
	if err != nil {
		t.Fatal(err)
	}
	// The process that started it "crashes": the postmaster is left running.
	if err := StopOrphan(t.Context(), dir); err != nil {
		t.Fatal(err)
	}
	<-s.exited
	if _, err := os.Stat(filepath.Join(dir, "postgres", "postmaster.pid")); !os.IsNotExist(err) {
		t.Fatalf("postmaster.pid after StopOrphan: %v", err)
	}
}

// A supervised cluster whose postmaster is killed outright starts again, once the backend
// it left running has gone; Stop during the pause before a restart ends supervision.
func TestSupervisedRestart(t *testing.T) {
	skipUnlessPostgres(t)
	dir := t.TempDir()
	s, err := StartConfig(t.Context(), Config{DataDir: dir, NoSync: true, Supervise: true,
		RestartDelay: 50 * time.Millisecond, Logger: slog.New(slog.DiscardHandler)})
	if err != nil {
		t.Fatal(err)
	}
	defer s.Stop(context.Background())

	// A backend busy in a query does not notice its postmaster's death until the query ends:
	// a new postmaster must not start beside it.
	conn, err := pgx.Connect(t.Context(), s.URL())
	if err != nil {
		t.Fatal(err)
	}
	var backend int
	if err := conn.QueryRow(t.Context(), "SELECT pg_backend_pid()").Scan(&backend); err != nil {
		t.Fatal(err)
	}
	busy := make(chan error, 1)
	go func() {
		_, err := conn.Exec(context.Background(), "SELECT count(*) FROM generate_series(1, 30000000)")
		busy <- err
	}()
	time.Sleep(200 * time.Millisecond) // the query is running
	s.mu.Lock()
	old := s.cmd.Process.Pid
	s.mu.Unlock()
	if err := syscall.Kill(old, syscall.SIGKILL); err != nil {
		t.Fatal(err)
	}

	deadline := time.Now().Add(time.Minute)
	for s.Restarts() == 0 {
		if time.Now().After(deadline) {
			t.Fatalf("not started again within a minute; log: %s", s.logTail())
		}
		if running(backend) && s.Restarts() == 0 {
			// Still running, so no new postmaster may be up yet.
			if c, err := pgx.Connect(t.Context(), s.URL()); err == nil {
				c.Close(context.Background())
				if running(backend) {
					t.Fatalf("a new postmaster accepts connections while backend %d of the killed one runs", backend)
				}
			}
		}
		time.Sleep(10 * time.Millisecond)
	}
	<-busy // its connection broke with the old postmaster's death, or it finished
	if running(backend) {
		t.Fatalf("backend %d of the killed postmaster runs beside the new one", backend)
	}
	ping(t, s.URL())
	s.mu.Lock()
	now := s.cmd.Process.Pid
	s.mu.Unlock()
	if now == old {
		t.Fatalf("postmaster pid %d unchanged", now)
	}

	// Killed again, then stopped before the pause is over: it stays down.
	s.cfg.RestartDelay = 300 * time.Millisecond // read by the next supervision only
	s.mu.Lock()
	pid := s.cmd.Process.Pid
	exited := s.exited
	s.mu.Unlock()
	if err := syscall.Kill(pid, syscall.SIGKILL); err != nil {
		t.Fatal(err)
	}
	<-exited
	if err := s.Stop(t.Context()); err != nil {
		t.Fatal(err)
	}
	time.Sleep(time.Second)
	if n := s.Restarts(); n != 1 {
		t.Fatalf("Restarts = %d after Stop, want 1", n)
	}
	if pids := s.clusterProcesses(); len(pids) != 0 {
		t.Fatalf("postgres processes %v run after Stop", pids)
	}
}

// running reports whether pid is a live process, not a zombie (an orphaned backend is reaped
// by whoever adopts it, perhaps later).
func running(pid int) bool {
	b, err := os.ReadFile("/proc/" + strconv.Itoa(pid) + "/stat")
	if err != nil {
		return false
	}
	st := string(b)
	i := strings.LastIndexByte(st, ')')
	return i > 0 && i+2 < len(st) && st[i+2] != 'Z' && st[i+2] != 'X'
}
