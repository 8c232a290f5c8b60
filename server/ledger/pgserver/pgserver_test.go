package pgserver

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/deltagym/deltagym/internal/locate"
	"github.com/deltagym/deltagym/internal/testenv"
)

func skipUnlessPostgres(t *testing.T) {
	t.Helper()
	binDirs(t)
}

// binDirs returns the installed PostgreSQL bin directories (locate.PostgresBinDirs), or skips t.
func binDirs(t *testing.T) []string {
	t.Helper()
	testenv.Integration(t, "a Postgres")
	dirs, err := locate.PostgresBinDirs()
	if err != nil {
		t.Skip(err)
	}
	return dirs
}

func ping(t *testing.T, url string) {
	t.Helper()
	if one := queryInt(t, url, "SELECT 1"); one != 1 {
		t.Fatalf("SELECT 1 = %d", one)
	}
}

// queryInt connects to url and returns the integer sql selects.
func queryInt(t *testing.T, url, sql string) int {
	t.Helper()
	conn, err := pgx.Connect(t.Context(), url)
	if err != nil {
		t.Fatalf("connecting to %s: %v", url, err)
	}
	defer conn.Close(context.Background())
	var n int
	if err := conn.QueryRow(t.Context(), sql).Scan(&n); err != nil {
		t.Fatalf("%s: %v", sql, err)
	}
	return n
}

func TestStartStopRestart(t *testing.T) {
	skipUnlessPostgres(t)
	dir := t.TempDir()
	begin := time.Now()
	s, err := StartConfig(t.Context(), Config{BinDirs: binDirs(t), DataDir: dir})
	if err != nil {
		t.Fatal(err)
	}
	t.Logf("fresh cluster: initdb+start+createdb in %v", time.Since(begin))
	begin = time.Now()
	fast, err := StartConfig(t.Context(), Config{BinDirs: binDirs(t), DataDir: t.TempDir(), NoSync: true})
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
	s, err := StartConfig(t.Context(), Config{BinDirs: binDirs(t), DataDir: dir})
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
	s2, err := StartConfig(t.Context(), Config{BinDirs: binDirs(t), DataDir: dir})
	if err != nil {
		t.Fatalf("start over a stale postmaster.pid: %v", err)
	}
	defer s2.Stop(context.Background())
	ping(t, s2.URL())
}

func TestOrphanedPostmaster(t *testing.T) {
	skipUnlessPostgres(t)
	dir := t.TempDir()
	s, err := StartConfig(t.Context(), Config{BinDirs: binDirs(t), DataDir: dir})
	if err != nil {
		t.Fatal(err)
	}
	oldPid := s.cmd.Process.Pid
	// The process that started it "crashes": the postmaster is left running, unowned.
	s2, err := StartConfig(t.Context(), Config{BinDirs: binDirs(t), DataDir: dir})
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
	if err := cfg.Validate(); !errors.Is(err, ErrSocketPathTooLong) {
		t.Fatalf("Validate of a data dir too deep for a unix socket: %v, want ErrSocketPathTooLong", err)
	}
}

// A config names its binaries: none given, or a directory without them, is refused.
func TestBinDirsChecked(t *testing.T) {
	empty := t.TempDir()
	for _, dirs := range [][]string{nil, {empty}} {
		cfg := Config{DataDir: t.TempDir(), BinDirs: dirs}
		if err := cfg.Validate(); !errors.Is(err, ErrNoBinaries) {
			t.Fatalf("Validate with bin dirs %q: %v, want ErrNoBinaries", dirs, err)
		}
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
	s, err := StartConfig(t.Context(), Config{BinDirs: binDirs(t), DataDir: dir})
	if err != nil {
		t.Fatal(err)
	}
	group := s.MemoryGroup()
	// The process that started it "crashes": the postmaster is left running.
	if err := StopOrphan(t.Context(), dir); err != nil {
		t.Fatal(err)
	}
	<-s.exited
	if _, err := os.Stat(filepath.Join(dir, "postgres", "postmaster.pid")); !os.IsNotExist(err) {
		t.Fatalf("postmaster.pid after StopOrphan: %v", err)
	}
	if group != "" {
		groupGone(t, group)
	}
}

// A supervised cluster whose postmaster is killed outright starts again once the backend it
// left running has gone; Stop while a supervised start waits for such a backend returns at once
// and nothing starts after it.
func TestSupervisedRestart(t *testing.T) {
	s, supLog, _ := startSupervised(t)

	// A backend busy in a query does not notice its postmaster's death until the query ends.
	old := s.Pid()
	backend, busy := busyBackend(t, s.URL(), 30_000_000)
	if err := syscall.Kill(old, syscall.SIGKILL); err != nil {
		t.Fatal(err)
	}
	deadline := time.Now().Add(3 * time.Minute) // a loaded machine (CI) is slow to end the old backends
	for s.Restarts() == 0 {
		if time.Now().After(deadline) {
			t.Fatalf("not started again within 3 minutes\nsupervision: %s\ncluster processes: %s\npostgres log: %s",
				supLog.String(), describe(s.clusterProcesses()), s.logTail())
		}
		if running(backend) {
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
	if now := s.Pid(); now == old || now == 0 {
		t.Fatalf("postmaster pid %d after the restart, killed %d", now, old)
	}
	// It waited for the backend instead of trying to start beside it.
	if log := wholeLog(t, s); strings.Contains(log, "pre-existing shared memory block") {
		t.Fatalf("a start was tried beside the old backend; log: %s", log)
	}

	// Killed again with a backend busy for longer; Stop while the supervised start waits for it.
	old = s.Pid()
	backend, busy = busyBackend(t, s.URL(), 40_000_000)
	if err := syscall.Kill(old, syscall.SIGKILL); err != nil {
		t.Fatal(err)
	}
	for s.Pid() != 0 {
		time.Sleep(time.Millisecond)
	}
	time.Sleep(200 * time.Millisecond) // past the pause: the start waits for the backend
	ctx, cancel := context.WithTimeout(t.Context(), 10*time.Second)
	defer cancel()
	begin := time.Now()
	group := s.MemoryGroup()
	if err := s.Stop(ctx); err != nil {
		t.Fatal(err)
	}
	took := time.Since(begin)
	switch {
	case group == "" && !running(backend):
		t.Fatalf("Stop took %v, until the backend the supervised start waited for had gone", took)
	case group != "":
		// With a memory group, Stop ends what is left of the cluster in it, at once (the
		// group empties a moment before the killed process is reaped).
		for end := time.Now().Add(5 * time.Second); running(backend); time.Sleep(10 * time.Millisecond) {
			if time.Now().After(end) {
				t.Fatalf("Stop (%v) left the old backend running in the cluster's group %s", took, group)
			}
		}
	}
	<-busy
	for running(backend) {
		time.Sleep(10 * time.Millisecond)
	}
	time.Sleep(time.Second)
	if n := s.Restarts(); n != 1 {
		t.Fatalf("Restarts = %d after Stop, want 1\nsupervision: %s\nlog: %s", n, supLog.String(), s.logTail())
	}
	if pids := s.clusterProcesses(); len(pids) != 0 {
		t.Fatalf("postgres processes %v run after Stop", pids)
	}
}

// busyBackend starts a query counting n rows on a connection of its own and returns its
// backend's pid and a channel that gets the query's end.
func busyBackend(t *testing.T, url string, n int) (int, <-chan error) {
	t.Helper()
	conn, err := pgx.Connect(t.Context(), url)
	if err != nil {
		t.Fatal(err)
	}
	var backend int
	if err := conn.QueryRow(t.Context(), "SELECT pg_backend_pid()").Scan(&backend); err != nil {
		t.Fatal(err)
	}
	busy := make(chan error, 1)
	go func() {
		_, err := conn.Exec(context.Background(), "SELECT count(*) FROM generate_series(1, $1::bigint)", n)
		conn.Close(context.Background())
		busy <- err
	}()
	time.Sleep(200 * time.Millisecond) // the query is running
	return backend, busy
}

// startSupervised starts a supervised cluster (stopped at cleanup) whose supervision logs to
// the returned buffer.
func startSupervised(t *testing.T) (*Server, *lockedBuffer, string) {
	t.Helper()
	skipUnlessPostgres(t)
	dir := t.TempDir()
	supLog := new(lockedBuffer)
	s, err := StartConfig(t.Context(), Config{BinDirs: binDirs(t), DataDir: dir, NoSync: true, Supervise: true,
		RestartDelay: 50 * time.Millisecond, Logger: slog.New(slog.NewTextHandler(supLog, nil))})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = s.Stop(context.Background()) })
	return s, supLog, dir
}

// lockedBuffer is a bytes.Buffer safe for a logger's goroutines.
type lockedBuffer struct {
	mu sync.Mutex
	// +checklocks:mu
	b bytes.Buffer
}

func (l *lockedBuffer) Write(p []byte) (int, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.b.Write(p)
}

func (l *lockedBuffer) String() string {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.b.String()
}

// describe gives each process's /proc stat line (name, state, parent…) and kernel wait channel.
func describe(pids []int) string {
	var b strings.Builder
	for _, pid := range pids {
		st, _ := os.ReadFile("/proc/" + strconv.Itoa(pid) + "/stat")
		wchan, _ := os.ReadFile("/proc/" + strconv.Itoa(pid) + "/wchan")
		fmt.Fprintf(&b, "\n  %s wchan=%s", strings.TrimSpace(string(st)), wchan)
	}
	return b.String()
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

// The processes of a cluster reached through a symbolic link are found: the kernel shows their
// working directory resolved.
func TestClusterProcessesThroughSymlink(t *testing.T) {
	skipUnlessPostgres(t)
	real := t.TempDir()
	link := filepath.Join(t.TempDir(), "link")
	if err := os.Symlink(real, link); err != nil {
		t.Fatal(err)
	}
	s, err := StartConfig(t.Context(), Config{BinDirs: binDirs(t), DataDir: link, NoSync: true})
	if err != nil {
		t.Fatal(err)
	}
	defer s.Stop(context.Background())
	pids := s.clusterProcesses()
	if !slices.Contains(pids, s.Pid()) {
		t.Fatalf("cluster processes %v lack the postmaster %d", pids, s.Pid())
	}
}

// A supervised start that fails is tried again until one succeeds.
func TestSupervisedRetry(t *testing.T) {
	s, supLog, dir := startSupervised(t)
	// A setting Postgres refuses makes every start fail until it is taken back.
	auto := filepath.Join(dir, "postgres", "postgresql.auto.conf")
	good, err := os.ReadFile(auto)
	if err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(auto, append(slices.Clone(good), "shared_buffers = 'plenty'\n"...), 0o600); err != nil {
		t.Fatal(err)
	}
	if err := syscall.Kill(s.Pid(), syscall.SIGKILL); err != nil {
		t.Fatal(err)
	}
	deadline := time.Now().Add(time.Minute)
	for strings.Count(supLog.String(), "starting private postgres again failed") < 2 {
		if time.Now().After(deadline) {
			t.Fatalf("no second failed start within a minute; supervision: %s", supLog.String())
		}
		time.Sleep(10 * time.Millisecond)
	}
	if err := os.WriteFile(auto, good, 0o600); err != nil {
		t.Fatal(err)
	}
	for s.Restarts() == 0 {
		if time.Now().After(deadline) {
			t.Fatalf("not started again once the setting was taken back; supervision: %s\npostgres log: %s", supLog.String(), s.logTail())
		}
		time.Sleep(10 * time.Millisecond)
	}
	ping(t, s.URL())
}

// inCgroup reports whether process pid is in the group at path (relative to a hierarchy's
// root): /proc/<pid>/cgroup names one path per hierarchy. A process gone counts as in.
func inCgroup(t *testing.T, pid int, path string) bool {
	t.Helper()
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/cgroup", pid))
	if errors.Is(err, os.ErrNotExist) {
		return true
	}
	if err != nil {
		t.Fatal(err)
	}
	for _, line := range strings.Split(strings.TrimSpace(string(b)), "\n") {
		f := strings.SplitN(line, ":", 3)
		if len(f) == 3 && f[2] == path {
			return true
		}
	}
	return false
}

// groupLimit reads the memory limit of the group at path, under cgroup v2 or v1.
func groupLimit(t *testing.T, path string) string {
	t.Helper()
	for _, f := range []string{"/sys/fs/cgroup" + path + "/memory.max", "/sys/fs/cgroup/memory" + path + "/memory.limit_in_bytes"} {
		if b, err := os.ReadFile(f); err == nil {
			return strings.TrimSpace(string(b))
		}
	}
	t.Fatalf("no memory limit file for group %s", path)
	return ""
}

// TestMemoryGroup: as root, the cluster's every process runs in a memory-capped group of its
// own, from the postmaster's start on, also after a supervised restart; Stop removes the group.
func TestMemoryGroup(t *testing.T) {
	skipUnlessPostgres(t)
	if os.Geteuid() != 0 {
		t.Skip("the memory group needs root (CI runs as root)")
	}
	dir := t.TempDir()
	s, err := StartConfig(t.Context(), Config{BinDirs: binDirs(t), DataDir: dir, NoSync: true, Supervise: true,
		RestartDelay: 50 * time.Millisecond, MemoryLimit: 400 << 20})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = s.Stop(context.Background()) })
	group := s.MemoryGroup()
	if group == "" {
		t.Fatal("no memory group")
	}
	if got := groupLimit(t, group); got != strconv.Itoa(400<<20) {
		t.Fatalf("memory limit of %s = %s, want %d", group, got, 400<<20)
	}
	check := func() {
		t.Helper()
		procs := s.clusterProcesses()
		if len(procs) < 3 {
			t.Fatalf("%d cluster processes, want the postmaster and its helpers", len(procs))
		}
		conn, err := pgx.Connect(t.Context(), s.URL())
		if err != nil {
			t.Fatal(err)
		}
		defer conn.Close(context.Background())
		var backend int
		if err := conn.QueryRow(t.Context(), "SELECT pg_backend_pid()").Scan(&backend); err != nil {
			t.Fatal(err)
		}
		for _, pid := range append(procs, backend) {
			if !inCgroup(t, pid, group) {
				b, _ := os.ReadFile(fmt.Sprintf("/proc/%d/cgroup", pid))
				t.Fatalf("cluster process %d is not in %s:\n%s", pid, group, b)
			}
		}
	}
	check()
	old := s.Pid()
	if err := syscall.Kill(old, syscall.SIGKILL); err != nil {
		t.Fatal(err)
	}
	deadline := time.Now().Add(3 * time.Minute)
	for s.Pid() == old || s.Pid() == 0 {
		if time.Now().After(deadline) {
			t.Fatal("the killed postmaster was not started again")
		}
		time.Sleep(50 * time.Millisecond)
	}
	check()
	if s.MemoryGroup() != group {
		t.Fatalf("group %s after the restart, want %s", s.MemoryGroup(), group)
	}
	if err := s.Stop(t.Context()); err != nil {
		t.Fatal(err)
	}
	groupGone(t, group)
}

// groupGone fails unless the group at path, and its base (path's parent), are gone from every
// hierarchy.
func groupGone(t *testing.T, path string) {
	t.Helper()
	for _, p := range []string{path, filepath.Dir(path)} {
		dirs, err := filepath.Glob("/sys/fs/cgroup/*" + p)
		if err != nil {
			t.Fatal(err)
		}
		if _, err := os.Stat("/sys/fs/cgroup" + p); err == nil {
			dirs = append(dirs, "/sys/fs/cgroup"+p)
		}
		if len(dirs) > 0 {
			t.Fatalf("group %s left behind: %v", p, dirs)
		}
	}
}

// TestNoMemoryGroup: a negative MemoryLimit runs the cluster in the caller's groups.
func TestNoMemoryGroup(t *testing.T) {
	skipUnlessPostgres(t)
	s, err := StartConfig(t.Context(), Config{BinDirs: binDirs(t), DataDir: t.TempDir(), NoSync: true, MemoryLimit: -1})
	if err != nil {
		t.Fatal(err)
	}
	defer s.Stop(context.Background())
	if g := s.MemoryGroup(); g != "" {
		t.Fatalf("memory group %s with MemoryLimit -1", g)
	}
	ping(t, s.URL())
}

// TestMemoryGroupFallbacks: a failed move into the group starts the cluster without a cap; a
// failed start leaves no group; a cluster started without a cap removes the group a crashed
// capped run left.
func TestMemoryGroupFallbacks(t *testing.T) {
	skipUnlessPostgres(t)
	if os.Geteuid() != 0 {
		t.Skip("the memory group needs root (CI runs as root)")
	}
	t.Run("move fails", func(t *testing.T) {
		failMoveForTest = true
		defer func() { failMoveForTest = false }()
		log := new(lockedBuffer)
		s, err := StartConfig(t.Context(), Config{BinDirs: binDirs(t), DataDir: t.TempDir(), NoSync: true, Logger: slog.New(slog.NewTextHandler(log, nil))})
		if err != nil {
			t.Fatal(err)
		}
		defer s.Stop(context.Background())
		ping(t, s.URL())
		if g := s.MemoryGroup(); g != "" {
			t.Fatalf("memory group %s after a failed move", g)
		}
		if !strings.Contains(log.String(), "without its memory cap") || !strings.Contains(wholeLog(t, s), "could not move postgres") {
			t.Fatalf("no word of the failed move; server log: %s\npostgres log: %s", log, wholeLog(t, s))
		}
		if dirs, _ := filepath.Glob("/sys/fs/cgroup/*/" + groupRoot(s.pgdata)); len(dirs) > 0 {
			t.Fatalf("group left after the failed move: %v", dirs)
		}
	})
	t.Run("start fails", func(t *testing.T) {
		dir := t.TempDir()
		_, err := StartConfig(t.Context(), Config{BinDirs: binDirs(t), DataDir: dir, NoSync: true, Settings: map[string]string{"max_connections": "-5"}})
		if err == nil {
			t.Fatal("a cluster with max_connections=-5 started")
		}
		if groupExists(groupRoot(filepath.Join(dir, "postgres"))) {
			t.Fatal("a failed start left its memory group")
		}
	})
	t.Run("uncapped after capped crash", func(t *testing.T) {
		dir := t.TempDir()
		s, err := StartConfig(t.Context(), Config{BinDirs: binDirs(t), DataDir: dir, NoSync: true})
		if err != nil {
			t.Fatal(err)
		}
		group := s.MemoryGroup()
		if group == "" {
			t.Fatal("no memory group")
		}
		// The process that started it "crashes"; the next start runs without a cap.
		s2, err := StartConfig(t.Context(), Config{BinDirs: binDirs(t), DataDir: dir, NoSync: true, MemoryLimit: -1})
		if err != nil {
			t.Fatal(err)
		}
		defer s2.Stop(context.Background())
		<-s.exited
		ping(t, s2.URL())
		groupGone(t, group)
	})
}

func TestMemoryLimitLeavesRoomAboveSharedBuffers(t *testing.T) {
	for _, c := range []struct {
		limit   int64
		buffers string
		want    int64
	}{
		{512 << 20, "", 512 << 20},
		{512 << 20, "128MB", 512 << 20},
		{512 << 20, "512MB", 768 << 20},
		{512 << 20, "1GB", 1280 << 20},
		{512 << 20, "65536", 768 << 20}, // 8 kB blocks
		{512 << 20, "262144kB", 512 << 20},
		{512 << 20, "lots", 512 << 20},
	} {
		s := &Server{cfg: Config{MemoryLimit: c.limit, Settings: map[string]string{}}}
		if c.buffers != "" {
			s.cfg.Settings["shared_buffers"] = c.buffers
		}
		if got := s.memoryLimit(); got != c.want {
			t.Errorf("limit %d, shared_buffers %q: cap %d, want %d", c.limit, c.buffers, got, c.want)
		}
	}
}

// wholeLog is postgres.log as every run of the cluster wrote it.
func wholeLog(t *testing.T, s *Server) string {
	t.Helper()
	b, err := os.ReadFile(filepath.Join(s.cfg.DataDir, "postgres.log"))
	if err != nil {
		t.Fatal(err)
	}
	return string(b)
}

// The log's tail in errors and warnings is what the postmaster's last run wrote, not what runs
// before it did.
func TestLogTailOfLastRun(t *testing.T) {
	skipUnlessPostgres(t)
	dir := t.TempDir()
	s, err := StartConfig(t.Context(), Config{BinDirs: binDirs(t), DataDir: dir, NoSync: true, MemoryLimit: -1})
	if err != nil {
		t.Fatal(err)
	}
	defer s.Stop(context.Background())
	if err := s.Stop(t.Context()); err != nil {
		t.Fatal(err)
	}
	f, err := os.OpenFile(filepath.Join(dir, "postgres.log"), os.O_WRONLY|os.O_APPEND, 0)
	if err != nil {
		t.Fatal(err)
	}
	_, _ = f.WriteString("an old line from an earlier run\n")
	f.Close()
	if err := s.StartAgain(t.Context()); err != nil {
		t.Fatal(err)
	}
	tail := s.logTail()
	if strings.Contains(tail, "an old line") || !strings.Contains(tail, "ready to accept connections") {
		t.Fatalf("log tail after a new start:\n%s", tail)
	}
	if !strings.Contains(wholeLog(t, s), "an old line") {
		t.Fatal("the old line is gone from the log")
	}
}

// serverMajor is the major version the running cluster reports.
func serverMajor(t *testing.T, url string) int {
	t.Helper()
	return queryInt(t, url, "SELECT current_setting('server_version_num')::int") / 10000
}

// TestBinDirsMatchCluster: a new cluster is made by the first bin directory given; a cluster
// that Debian's PostgreSQL 15 made runs with 15's binaries when they are
// among those given, and is refused, naming the versions given, when they are not.
func TestBinDirsMatchCluster(t *testing.T) {
	dirs := binDirs(t)
	preferred := dirs[0]
	newMajor, err := BinaryMajor(t.Context(), preferred)
	if err != nil {
		t.Fatal(err)
	}
	old := "/usr/lib/postgresql/15/bin"
	if hasBinaries(old) != nil || newMajor == 15 {
		t.Skipf("needs Debian's PostgreSQL 15 and a newer one (make postgres); found %s (%d)", preferred, newMajor)
	}
	dir := t.TempDir()
	s, err := StartConfig(t.Context(), Config{DataDir: dir, NoSync: true, BinDirs: []string{old, preferred}})
	if err != nil {
		t.Fatal(err)
	}
	if got := serverMajor(t, s.URL()); got != 15 {
		t.Fatalf("cluster runs %d, want 15, the first given", got)
	}
	if err := s.Stop(t.Context()); err != nil {
		t.Fatal(err)
	}

	var log bytes.Buffer
	s, err = StartConfig(t.Context(), Config{DataDir: dir, NoSync: true, BinDirs: []string{preferred, old},
		Logger: slog.New(slog.NewTextHandler(&log, nil))})
	if err != nil {
		t.Fatal(err)
	}
	if got := serverMajor(t, s.URL()); got != 15 {
		t.Fatalf("%d preferred: cluster runs %d, want its own 15", newMajor, got)
	}
	if !strings.Contains(log.String(), "another major version") {
		t.Errorf("no warning logged about the older cluster: %s", log.String())
	}
	if err := s.Stop(t.Context()); err != nil {
		t.Fatal(err)
	}

	_, err = StartConfig(t.Context(), Config{DataDir: dir, NoSync: true, BinDirs: []string{preferred}})
	if want := fmt.Sprintf("%s (%d)", preferred, newMajor); !errors.Is(err, ErrVersion) ||
		!strings.Contains(err.Error(), "made by PostgreSQL 15") || !strings.Contains(err.Error(), want) {
		t.Fatalf("only %d's binaries for a 15 cluster: %v, want ErrVersion naming %s", newMajor, err, want)
	}
	t.Log(err)
}

// A postmaster that answers no shutdown request (here: stopped) cannot hold Stop: after the
// smart, fast and immediate requests time out it is killed, and Stop says so.
func TestStopHungPostmaster(t *testing.T) {
	skipUnlessPostgres(t)
	s, err := StartConfig(t.Context(), Config{BinDirs: binDirs(t), DataDir: t.TempDir(), NoSync: true,
		SmartTimeout: 50 * time.Millisecond, FastTimeout: 50 * time.Millisecond, ImmediateTimeout: 200 * time.Millisecond})
	if err != nil {
		t.Fatal(err)
	}
	pid := s.Pid()
	if err := syscall.Kill(pid, syscall.SIGSTOP); err != nil {
		t.Fatal(err)
	}
	err = s.Stop(context.Background())
	if err == nil || !strings.Contains(err.Error(), "killed") {
		t.Fatalf("Stop of a stopped postmaster: %v, want an error saying it was killed", err)
	}
	if err := syscall.Kill(pid, 0); !errors.Is(err, syscall.ESRCH) {
		t.Fatalf("postmaster %d after Stop: %v, want it gone", pid, err)
	}
}
