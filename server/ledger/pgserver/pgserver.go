// Package pgserver runs a private PostgreSQL cluster for deltagym: the default ledger database
// when no external Postgres URL is given, and the one the tests use.
//
// The cluster lives in DataDir/postgres (created with initdb on first start), listens only on a
// unix socket in DataDir/pgsock (never TCP), logs to DataDir/postgres.log and holds a database
// named by Config.Database ("deltagym"). When the caller is root, initdb and postgres run as the
// `postgres` system user (Postgres refuses to run as root); the cluster and socket directories
// are owned by it, and DataDir and its ancestors get the search (o+x) bit so that user can reach
// them. A postmaster left behind by a crashed run is stopped and a stale postmaster.pid removed
// before the new start. With Config.Supervise, a postmaster that exits on its own (killed, or
// unable to write a full disk) is started again, with growing pauses between tries, until Stop.
// As root, the cluster runs in a control group of its own that caps its memory, page cache
// included (Config.MemoryLimit, memgroup.go).
package pgserver

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net/url"
	"os"
	"os/exec"
	"os/user"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/deltagym/deltagym/sandbox/cgroup"
)

// defaultSettings suit the ledger's write-heavy load; Config.Settings overrides them.
//   - max_wal_size: fewer forced checkpoints.
//   - wal_init_zero=off: a new 16 MiB WAL segment is created by writing its last byte, not
//     filled with zeros first. On a VM, where writes into new page-cache pages are slow, the
//     zeros cost the COPY backends CPU per row and a batch its latency
//     (BenchmarkCopyCost/wal-init-zero-on; docs/PERFORMANCE.md, "The ledger"), and a segment
//     recycled after a checkpoint never needed them. WAL stays durable: fdatasync makes the
//     blocks a write allocated durable with it. What changes is that a full disk is met by a
//     WAL write, which Postgres answers by restarting, instead of by the segment's creation;
//     the writer's spool keeps the rows until it is back.
//   - wal_buffers=32MB, not the 4 MB that 128 MB of shared buffers gives. The ledger's four
//     COPY backends fill 4 MB within a batch, and a backend that finds the buffers full
//     writes WAL out itself (pg_stat_wal.wal_buffers_full). The larger buffers deliver more
//     steps/s, saturated and paced, for less of Postgres's CPU per step (BenchmarkWriterSteps
//     with DELTAGYM_LEDGER_BENCH_PG=wal_buffers=4MB; docs/PERFORMANCE.md, "Figures behind
//     design choices"); which part of that the backends' own WAL writes are is not known.
var defaultSettings = map[string]string{"max_wal_size": "2GB", "wal_init_zero": "off", "wal_buffers": "32MB"}

// mallocEnv stops glibc from handing a backend's freed heap back to the kernel as soon as 128 KiB
// sit free at its top. COPY resets its per-batch memory every few dozen 4 KiB rows; with the
// default trim threshold each reset would shrink the heap and the next batch fault the same
// pages in again (zeroed by the kernel), a visible share of the backend's CPU in a COPY of 4 KiB
// observations. A backend keeps up to its peak heap until it exits.
var mallocEnv = []string{"MALLOC_TRIM_THRESHOLD_=268435456", "MALLOC_TOP_PAD_=16777216"}

// maxSocketPath is the size of sun_path on Linux, including the terminating NUL.
const maxSocketPath = 108

// Config describes a private cluster.
type Config struct {
	// DataDir holds the cluster (DataDir/postgres), its socket directory and its log. Required.
	DataDir string
	// BinDirs are directories holding initdb and postgres, in order of preference: a new
	// cluster is made by the first, an existing one is run by the first of the cluster's own
	// major version (a cluster made by another cannot be opened). Required;
	// internal/locate.PostgresBinDirs lists the installed ones.
	BinDirs []string
	// Database is created if absent. Default "deltagym".
	Database string
	// Settings are extra server settings passed as -c name=value (e.g. shared_buffers).
	Settings map[string]string
	// NoSync skips fsync in initdb and at run time, and commits without waiting for the WAL
	// (synchronous_commit off): fast, for tests only. A machine crash can corrupt the cluster;
	// a Postgres crash cannot, but it loses the last transactions of sessions that do not turn
	// synchronous_commit on (the ledger's do).
	NoSync bool
	// SmartTimeout is how long Stop waits for clients to disconnect (smart shutdown) before it
	// asks for a fast shutdown. Default 3s.
	SmartTimeout time.Duration
	// FastTimeout is how long Stop waits for a fast shutdown (its checkpoint written) before it
	// asks for an immediate one, and ImmediateTimeout how long it waits for that before it kills
	// the postmaster: a postmaster that hangs (stopped, or stuck in a recovery) cannot hold
	// the server's exit. Defaults 30s and 10s.
	FastTimeout, ImmediateTimeout time.Duration
	// Supervise starts the postmaster again when it exits without Stop: after RestartDelay,
	// then after pauses doubling up to a minute while it fails to start. Its clients see an
	// outage in between (the ledger writer keeps rows in its spool). Off, the cluster stays
	// down until Restart or StartAgain.
	Supervise bool
	// RestartDelay is the first pause before a supervised restart. Default 500ms.
	RestartDelay time.Duration
	// Logger receives supervised exits and restarts. Default slog.Default().
	Logger *slog.Logger
	// MemoryLimit caps the memory of the cluster's processes, its shared buffers and the page
	// cache of its files, in bytes: when the caller is root, the postmaster runs in a control
	// group of its own with that limit (memgroup.go says why). Default DefaultMemoryLimit;
	// negative: no group.
	MemoryLimit int64
}

// Validate checks the config and fills in defaults.
func (c *Config) Validate() error {
	if c.DataDir == "" {
		return errors.New("pgserver: DataDir is required")
	}
	abs, err := filepath.Abs(c.DataDir)
	if err != nil {
		return fmt.Errorf("resolving data dir: %w", err)
	}
	c.DataDir = abs
	if n := len(filepath.Join(c.DataDir, "pgsock", ".s.PGSQL.5432.lock")); n >= maxSocketPath {
		return fmt.Errorf("data dir %s gives a %d-byte socket path: %w", c.DataDir, n, ErrSocketPathTooLong)
	}
	if c.BinDirs, err = checkBinDirs(c.BinDirs); err != nil {
		return err
	}
	if c.Database == "" {
		c.Database = "deltagym"
	}
	if c.SmartTimeout <= 0 {
		c.SmartTimeout = 3 * time.Second
	}
	if c.FastTimeout <= 0 {
		c.FastTimeout = 30 * time.Second
	}
	if c.ImmediateTimeout <= 0 {
		c.ImmediateTimeout = 10 * time.Second
	}
	if c.RestartDelay <= 0 {
		c.RestartDelay = 500 * time.Millisecond
	}
	if c.Logger == nil {
		c.Logger = slog.Default()
	}
	if c.MemoryLimit == 0 {
		c.MemoryLimit = DefaultMemoryLimit
	}
	return nil
}

// Server is a running private cluster. Its methods are safe for concurrent use.
type Server struct {
	cfg     Config
	bin     string // the one of cfg.BinDirs that runs the cluster
	pgdata  string
	sockDir string
	cred    *syscall.Credential // nil when not root

	mu      sync.Mutex // guards cmd, exited, waitErr, logFile and the group; held through a start or stop
	cmd     *exec.Cmd
	exited  chan struct{} // closed when cmd has exited
	waitErr error
	logFile *os.File
	groups  *cgroup.Manager // of group
	group   *cgroup.Cgroup  // caps the cluster's memory (Config.MemoryLimit); nil without
	noGroup bool            // a move into the group failed: no cap from then on
	// logStart is the size postgres.log had when the postmaster last started: logTail shows
	// what that run wrote, not what earlier ones did.
	logStart atomic.Int64
	// groupPath is group's path, for MemoryGroup without mu.
	groupPath atomic.Pointer[string]

	// sup is supervision's state, apart from mu so that Stop can end a supervised start that
	// holds mu (waiting for old backends, or for a long crash recovery).
	sup struct {
		mu sync.Mutex
		// +checklocks:mu
		armed bool // from a start by the caller until Stop
		// +checklocks:mu
		stop chan struct{} // closed by Stop
		// +checklocks:mu
		cancel context.CancelFunc // ends the supervised start in progress
	}
	pid      atomic.Int64 // the running postmaster's, 0 if none
	restarts atomic.Int64 // supervised starts that succeeded
}

// StartConfig starts the private cluster described by cfg and creates its database.
func StartConfig(ctx context.Context, cfg Config) (*Server, error) {
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	bin, major, err := cfg.chooseBinDir(ctx, filepath.Join(cfg.DataDir, "postgres"))
	if err != nil {
		return nil, err
	}
	cfg.Logger.Info("private postgres", "dir", cfg.DataDir, "version", major, "bin", bin)
	s := &Server{
		cfg:     cfg,
		bin:     bin,
		pgdata:  filepath.Join(cfg.DataDir, "postgres"),
		sockDir: filepath.Join(cfg.DataDir, "pgsock"),
	}
	if os.Geteuid() == 0 {
		cred, err := postgresUser()
		if err != nil {
			return nil, err
		}
		s.cred = cred
	}
	if err := os.MkdirAll(cfg.DataDir, 0o755); err != nil {
		return nil, fmt.Errorf("creating data dir: %w", err)
	}
	if s.cred != nil {
		// The postgres user reaches the cluster and runs the binaries (a checkout's
		// .cache/postgres under a home directory, say).
		resolved, err := filepath.EvalSymlinks(bin)
		if err != nil {
			return nil, fmt.Errorf("resolving %s: %w", bin, err)
		}
		for _, d := range []string{cfg.DataDir, resolved} {
			if err := ensureTraversable(d); err != nil {
				return nil, err
			}
		}
	}
	if err := s.initdb(ctx); err != nil {
		return nil, err
	}
	if err := s.start(ctx); err != nil {
		s.mu.Lock()
		if gerr := s.removeGroup(); gerr != nil {
			err = errors.Join(err, gerr)
		}
		s.mu.Unlock()
		return nil, err
	}
	s.arm()
	if err := s.createDatabase(ctx, cfg.Database); err != nil {
		_ = s.Stop(context.WithoutCancel(ctx))
		return nil, err
	}
	return s, nil
}

// StopOrphan shuts down the postmaster of the private cluster in dataDir that a crashed run left
// running, if there is one, and removes the cluster's memory group. The cluster must not be in
// use by a live server.
func StopOrphan(ctx context.Context, dataDir string) error {
	abs, err := filepath.Abs(dataDir)
	if err != nil {
		return fmt.Errorf("resolving data dir: %w", err)
	}
	s := &Server{pgdata: filepath.Join(abs, "postgres")}
	// The group goes even if the postmaster would not: its removal ends what runs in it.
	return errors.Join(s.clearStale(ctx), removeLeftGroup(s.pgdata))
}

// URL returns a pgx-compatible URL of the server's database over its unix socket.
func (s *Server) URL() string { return s.URLFor(s.cfg.Database) }

// URLFor returns the URL of another database of the same cluster.
func (s *Server) URLFor(database string) string {
	return fmt.Sprintf("postgres:///%s?host=%s&user=postgres&sslmode=disable",
		url.PathEscape(database), url.QueryEscape(s.sockDir))
}

// SocketDir returns the directory holding the server's unix socket.
func (s *Server) SocketDir() string { return s.sockDir }

// Stop shuts the server down: a smart shutdown (waiting for clients) for up to
// Config.SmartTimeout, then a fast one (disconnecting them) until ctx ends or for up to
// Config.FastTimeout, then an immediate one for up to Config.ImmediateTimeout, then SIGKILL.
// Stop is idempotent.
func (s *Server) Stop(ctx context.Context) error {
	s.disarm() // first: a supervised start in progress holds mu
	s.mu.Lock()
	defer s.mu.Unlock()
	// The group goes even if the postmaster would not stop: its removal ends what runs in it.
	return errors.Join(s.stopLocked(ctx), s.removeGroup())
}

// Restart stops the server and starts it again on the same cluster. If the start fails while
// supervision is on, supervision keeps trying.
func (s *Server) Restart(ctx context.Context) error {
	s.mu.Lock()
	err := s.stopLocked(ctx)
	if err == nil {
		err = s.startLocked(ctx)
	}
	s.mu.Unlock()
	return s.afterStart(err)
}

// StartAgain starts a server that was stopped. It is a no-op when the server runs.
func (s *Server) StartAgain(ctx context.Context) error {
	s.mu.Lock()
	var err error
	if s.cmd == nil {
		err = s.startLocked(ctx)
	}
	s.mu.Unlock()
	return s.afterStart(err)
}

// afterStart arms supervision after a successful start by the caller; after a failed one, a
// supervised server that was not stopped goes on trying.
func (s *Server) afterStart(err error) error {
	if err == nil {
		s.arm()
	} else if stop, ok := s.armedStop(); ok && s.cfg.Supervise {
		go s.retry(stop)
	}
	return err
}

// arm turns supervision on until Stop.
func (s *Server) arm() {
	s.sup.mu.Lock()
	defer s.sup.mu.Unlock()
	if !s.sup.armed {
		s.sup.armed, s.sup.stop = true, make(chan struct{})
	}
}

// disarm turns supervision off and ends a supervised start in progress.
func (s *Server) disarm() {
	s.sup.mu.Lock()
	defer s.sup.mu.Unlock()
	if s.sup.armed {
		s.sup.armed = false
		close(s.sup.stop)
	}
	if s.sup.cancel != nil {
		s.sup.cancel()
	}
}

// armedStop returns the channel Stop closes, if supervision is on.
func (s *Server) armedStop() (chan struct{}, bool) {
	s.sup.mu.Lock()
	defer s.sup.mu.Unlock()
	return s.sup.stop, s.sup.armed
}

func (s *Server) stopLocked(ctx context.Context) error {
	if s.cmd == nil {
		return nil
	}
	cmd, exited := s.cmd, s.exited
	defer func() {
		s.cmd = nil
		s.pid.Store(0)
		if s.logFile != nil {
			_ = s.logFile.Close()
			s.logFile = nil
		}
	}()
	steps := []struct {
		sig  syscall.Signal
		wait time.Duration
	}{
		{syscall.SIGTERM, s.cfg.SmartTimeout},     // smart
		{syscall.SIGINT, s.cfg.FastTimeout},       // fast, or until ctx ends
		{syscall.SIGQUIT, s.cfg.ImmediateTimeout}, // immediate
		{syscall.SIGKILL, s.cfg.ImmediateTimeout}, // its children see it gone and exit
	}
	for i, st := range steps {
		if err := cmd.Process.Signal(st.sig); err != nil && !errors.Is(err, os.ErrProcessDone) {
			return fmt.Errorf("signalling postgres: %w", err)
		}
		t := time.NewTimer(st.wait)
		var done <-chan struct{}
		if i == 1 {
			done = ctx.Done()
		}
		select {
		case <-exited:
			t.Stop()
			if i == len(steps)-1 {
				return fmt.Errorf("stopping postgres pid %d: it answered no shutdown request and was killed", cmd.Process.Pid)
			}
			return nil
		case <-t.C:
		case <-done:
			t.Stop()
		}
	}
	return fmt.Errorf("stopping postgres pid %d: still running after SIGKILL", cmd.Process.Pid)
}

func (s *Server) start(ctx context.Context) error {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.startLocked(ctx)
}

func (s *Server) startLocked(ctx context.Context) error {
	if err := s.clearStale(ctx); err != nil {
		return err
	}
	if err := os.RemoveAll(s.sockDir); err != nil {
		return fmt.Errorf("clearing socket dir: %w", err)
	}
	if err := s.mkdirOwned(s.sockDir); err != nil {
		return err
	}
	logFile, err := os.OpenFile(filepath.Join(s.cfg.DataDir, "postgres.log"), os.O_CREATE|os.O_WRONLY|os.O_APPEND, 0o644)
	if err != nil {
		return fmt.Errorf("opening postgres log: %w", err)
	}
	if fi, err := logFile.Stat(); err == nil {
		s.logStart.Store(fi.Size())
	}
	args := []string{"-D", s.pgdata,
		"-c", "listen_addresses=",
		"-c", "unix_socket_directories=" + s.sockDir,
		"-c", "unix_socket_permissions=0700",
	}
	if s.cfg.NoSync {
		args = append(args, "-c", "fsync=off", "-c", "full_page_writes=off", "-c", "synchronous_commit=off")
	}
	for k, v := range defaultSettings {
		if _, ok := s.cfg.Settings[k]; !ok {
			args = append(args, "-c", k+"="+v)
		}
	}
	for k, v := range s.cfg.Settings {
		args = append(args, "-c", k+"="+v)
	}
	if err := s.openGroup(); err != nil {
		s.cfg.Logger.Warn("private postgres runs without its memory cap", "dir", s.cfg.DataDir, "err", err)
	}
	name, args, files := s.inGroup(filepath.Join(s.bin, "postgres"), args)
	defer func() {
		for _, f := range files {
			_ = f.Close()
		}
	}()
	cmd := exec.Command(name, args...)
	cmd.ExtraFiles = files
	cmd.Env = append([]string{"LC_ALL=C", "PATH=/usr/bin:/bin"}, mallocEnv...)
	cmd.Dir = "/"
	cmd.Stdout, cmd.Stderr = logFile, logFile
	// Own process group: a terminal's ^C reaches the deltagym server, which stops Postgres last.
	cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true, Credential: s.cred}
	if err := cmd.Start(); err != nil {
		_ = logFile.Close()
		return fmt.Errorf("starting postgres: %w", err)
	}
	exited := make(chan struct{})
	s.cmd, s.exited, s.logFile = cmd, exited, logFile
	go func() {
		err := cmd.Wait()
		s.waitErr = err
		close(exited)
		if s.cfg.Supervise {
			s.supervise(cmd)
		}
	}()
	if err := s.waitReady(ctx, exited); err != nil {
		_ = s.stopLocked(context.WithoutCancel(ctx))
		var exit *exec.ExitError
		if s.group != nil && errors.As(s.waitErr, &exit) && exit.ExitCode() == moveFailed {
			s.dropGroup(fmt.Errorf("moving the postmaster into its group: %w", err))
			return s.startLocked(ctx)
		}
		return err
	}
	s.pid.Store(int64(cmd.Process.Pid))
	return nil
}

// supervise runs once cmd, a postmaster of this server, has exited. Unless it was stopped (or
// replaced) or supervision is off, it starts a new one (retry).
func (s *Server) supervise(cmd *exec.Cmd) {
	stop, ok := s.armedStop()
	if !ok {
		return // Stop, which stops what it finds
	}
	s.mu.Lock()
	if s.cmd != cmd {
		s.mu.Unlock()
		return
	}
	s.cmd = nil
	s.pid.Store(0)
	if s.logFile != nil {
		_ = s.logFile.Close()
		s.logFile = nil
	}
	s.cfg.Logger.Warn("private postgres exited; starting it again", "dir", s.cfg.DataDir, "exit", s.waitErr, "log", s.logTail())
	s.mu.Unlock()
	s.retry(stop)
}

// retry starts the postmaster again: after Config.RestartDelay, then after pauses doubling up
// to a minute for as long as starting fails (a full disk, say, on which the crash recovery
// cannot write), until it runs or stop is closed. A start waits as long as the postmaster
// lives and is not ready (a long crash recovery), unless Stop ends it.
func (s *Server) retry(stop chan struct{}) {
	delay := s.cfg.RestartDelay
	for {
		t := time.NewTimer(delay)
		select {
		case <-stop:
			t.Stop()
			return
		case <-t.C:
		}
		s.sup.mu.Lock()
		if !s.sup.armed || s.sup.stop != stop {
			s.sup.mu.Unlock()
			return
		}
		ctx, cancel := context.WithCancel(context.Background())
		s.sup.cancel = cancel
		s.sup.mu.Unlock()

		s.mu.Lock()
		started, err := false, error(nil)
		if s.cmd == nil { // else the caller started it meanwhile
			err = s.startLocked(ctx)
			started = err == nil
		}
		s.mu.Unlock()
		stopped := ctx.Err() != nil // Stop cancelled it
		s.sup.mu.Lock()
		s.sup.cancel = nil
		s.sup.mu.Unlock()
		cancel()
		if err == nil {
			if started {
				s.restarts.Add(1)
				s.cfg.Logger.Info("private postgres started again", "dir", s.cfg.DataDir)
			}
			return
		}
		if stopped {
			return
		}
		delay = min(2*delay, time.Minute)
		s.cfg.Logger.Warn("starting private postgres again failed; trying again later", "dir", s.cfg.DataDir, "err", err, "in", delay)
	}
}

// Pid returns the running postmaster's pid, or 0 while none runs.
func (s *Server) Pid() int { return int(s.pid.Load()) }

// Restarts returns how many times supervision has started the postmaster again.
func (s *Server) Restarts() int { return int(s.restarts.Load()) }

// waitReady polls the socket until the server accepts a connection to its maintenance database.
func (s *Server) waitReady(ctx context.Context, exited <-chan struct{}) error {
	delay := 2 * time.Millisecond
	for {
		cctx, cancel := context.WithTimeout(ctx, time.Second)
		conn, err := pgx.Connect(cctx, s.URLFor("postgres"))
		cancel()
		if err == nil {
			return conn.Close(ctx)
		}
		t := time.NewTimer(delay)
		select {
		case <-exited:
			t.Stop()
			return fmt.Errorf("waiting for postgres to accept connections: %w: %v; log: %s", ErrExited, s.waitErr, s.logTail())
		case <-ctx.Done():
			t.Stop()
			return fmt.Errorf("waiting for postgres to accept connections: %w (last: %v)", ctx.Err(), err)
		case <-t.C:
		}
		delay = min(delay*2, 50*time.Millisecond)
	}
}

func (s *Server) createDatabase(ctx context.Context, name string) error {
	conn, err := pgx.Connect(ctx, s.URLFor("postgres"))
	if err != nil {
		return fmt.Errorf("connecting to postgres: %w", err)
	}
	defer conn.Close(context.WithoutCancel(ctx))
	var exists bool
	if err := conn.QueryRow(ctx, "SELECT EXISTS (SELECT 1 FROM pg_database WHERE datname = $1)", name).Scan(&exists); err != nil {
		return fmt.Errorf("looking up database %s: %w", name, err)
	}
	if exists {
		return nil
	}
	if _, err := conn.Exec(ctx, "CREATE DATABASE "+pgx.Identifier{name}.Sanitize()); err != nil {
		return fmt.Errorf("creating database %s: %w", name, err)
	}
	return nil
}

// initdb creates the cluster in a temporary directory and renames it into place, so a crash
// during initdb never leaves a half-made cluster behind.
func (s *Server) initdb(ctx context.Context) error {
	if _, err := os.Stat(filepath.Join(s.pgdata, "PG_VERSION")); err == nil {
		return nil
	}
	tmp := s.pgdata + ".initdb"
	if err := os.RemoveAll(tmp); err != nil {
		return fmt.Errorf("clearing %s: %w", tmp, err)
	}
	if err := s.mkdirOwned(tmp); err != nil {
		return err
	}
	args := []string{"-D", tmp, "-U", "postgres", "-A", "trust", "-E", "UTF8", "--locale=C"}
	if s.cfg.NoSync {
		args = append(args, "--no-sync")
	}
	cmd := exec.CommandContext(ctx, filepath.Join(s.bin, "initdb"), args...)
	cmd.Env = []string{"LC_ALL=C", "PATH=/usr/bin:/bin"}
	cmd.Dir = "/"
	cmd.SysProcAttr = &syscall.SysProcAttr{Credential: s.cred}
	if out, err := cmd.CombinedOutput(); err != nil {
		return fmt.Errorf("running initdb: %w: %s", err, strings.TrimSpace(string(out)))
	}
	if err := os.RemoveAll(s.pgdata); err != nil {
		return fmt.Errorf("clearing %s: %w", s.pgdata, err)
	}
	if err := os.Rename(tmp, s.pgdata); err != nil {
		return fmt.Errorf("moving new cluster into place: %w", err)
	}
	return nil
}

// clearStale handles a postmaster.pid left by a crashed run: a postmaster of this cluster that is
// still alive (its parent died) is shut down; a file naming a dead or unrelated process is removed.
func (s *Server) clearStale(ctx context.Context) error {
	pidPath := filepath.Join(s.pgdata, "postmaster.pid")
	f, err := os.Open(pidPath)
	if errors.Is(err, os.ErrNotExist) {
		return nil
	}
	if err != nil {
		return fmt.Errorf("reading postmaster.pid: %w", err)
	}
	line, _ := bufio.NewReader(f).ReadString('\n')
	_ = f.Close()
	pid, err := strconv.Atoi(strings.TrimSpace(line))
	if err == nil && pid > 0 && s.isOurPostmaster(pid) {
		if err := syscall.Kill(pid, syscall.SIGINT); err != nil && !errors.Is(err, syscall.ESRCH) {
			return fmt.Errorf("stopping orphaned postmaster %d: %w", pid, err)
		}
		delay := time.Millisecond
		deadline := time.Now().Add(30 * time.Second)
		for syscall.Kill(pid, 0) == nil {
			if time.Now().After(deadline) {
				_ = syscall.Kill(pid, syscall.SIGKILL)
			}
			if err := pause(ctx, delay); err != nil {
				return fmt.Errorf("waiting for orphaned postmaster %d: %w", pid, err)
			}
			delay = min(delay*2, 50*time.Millisecond)
		}
	}
	// A postmaster killed outright (SIGKILL, the OOM killer) leaves its backends running until
	// they notice, at their next wait: one in the middle of a long query takes a while. A new
	// postmaster would refuse to start beside them ("pre-existing shared memory block is still
	// in use"); waiting for them first spares those failed starts and, should they outlive the
	// wait, says why.
	if err := s.waitOldProcesses(ctx, 30*time.Second); err != nil {
		return err
	}
	if err := os.Remove(pidPath); err != nil && !errors.Is(err, os.ErrNotExist) {
		return fmt.Errorf("removing stale postmaster.pid: %w", err)
	}
	return nil
}

// waitOldProcesses waits until no postgres process works in this cluster (its working
// directory), for up to timeout.
func (s *Server) waitOldProcesses(ctx context.Context, timeout time.Duration) error {
	deadline := time.Now().Add(timeout)
	delay := time.Millisecond
	for {
		pids := s.clusterProcesses()
		if len(pids) == 0 {
			return nil
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("postgres processes %v of the old server still run in %s: %w", pids, s.pgdata, ErrStale)
		}
		if err := pause(ctx, delay); err != nil {
			return fmt.Errorf("waiting for the old server's postgres processes %v to exit: %w", pids, err)
		}
		delay = min(delay*2, 50*time.Millisecond)
	}
}

// pause waits for d, or returns ctx's error if it ends first.
func pause(ctx context.Context, d time.Duration) error {
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-ctx.Done():
		return ctx.Err()
	case <-t.C:
		return nil
	}
}

// clusterProcesses lists the live postgres processes whose working directory is this cluster.
func (s *Server) clusterProcesses() []int {
	ents, err := os.ReadDir("/proc")
	if err != nil {
		return nil
	}
	pgdata := s.resolvedPGData()
	var pids []int
	for _, e := range ents {
		pid, err := strconv.Atoi(e.Name())
		if err != nil {
			continue
		}
		if s.isOurs(pid, pgdata) {
			pids = append(pids, pid)
		}
	}
	return pids
}

// isOurPostmaster reports whether pid is a live postgres whose working directory is our cluster
// (any process of the cluster: the postmaster and its backends all work there).
func (s *Server) isOurPostmaster(pid int) bool {
	return s.isOurs(pid, s.resolvedPGData())
}

func (s *Server) isOurs(pid int, pgdata string) bool {
	cwd, err := os.Readlink(fmt.Sprintf("/proc/%d/cwd", pid))
	if err != nil || filepath.Clean(cwd) != pgdata {
		return false
	}
	exe, err := os.Readlink(fmt.Sprintf("/proc/%d/exe", pid))
	// A binary replaced by a package upgrade reads "…/postgres (deleted)".
	return err == nil && filepath.Base(strings.TrimSuffix(exe, " (deleted)")) == "postgres"
}

// resolvedPGData is the cluster directory with symbolic links resolved, as the kernel shows a
// process's working directory.
func (s *Server) resolvedPGData() string {
	if p, err := filepath.EvalSymlinks(s.pgdata); err == nil {
		return p
	}
	return s.pgdata
}

func (s *Server) mkdirOwned(dir string) error {
	if err := os.MkdirAll(dir, 0o700); err != nil {
		return fmt.Errorf("creating %s: %w", dir, err)
	}
	if err := os.Chmod(dir, 0o700); err != nil {
		return fmt.Errorf("setting mode of %s: %w", dir, err)
	}
	if s.cred != nil {
		if err := os.Chown(dir, int(s.cred.Uid), int(s.cred.Gid)); err != nil {
			return fmt.Errorf("giving %s to the postgres user: %w", dir, err)
		}
	}
	return nil
}

// logTail returns the end of what the postmaster's last run wrote to postgres.log, up to 2,000
// bytes.
func (s *Server) logTail() string {
	b, err := os.ReadFile(filepath.Join(s.cfg.DataDir, "postgres.log"))
	if err != nil {
		return err.Error()
	}
	if start := s.logStart.Load(); start <= int64(len(b)) {
		b = b[start:]
	}
	if len(b) > 2000 {
		b = b[len(b)-2000:]
	}
	return strings.TrimSpace(string(b))
}

func postgresUser() (*syscall.Credential, error) {
	u, err := user.Lookup("postgres")
	if err != nil {
		return nil, fmt.Errorf("looking up the postgres system user (Postgres refuses to run as root): %w", err)
	}
	uid, err1 := strconv.ParseUint(u.Uid, 10, 32)
	gid, err2 := strconv.ParseUint(u.Gid, 10, 32)
	if err1 != nil || err2 != nil {
		return nil, fmt.Errorf("parsing ids of the postgres user %q/%q", u.Uid, u.Gid)
	}
	return &syscall.Credential{Uid: uint32(uid), Gid: uint32(gid), Groups: []uint32{}}, nil
}

// ensureTraversable gives dir and each of its ancestors the search bit for others, so that the
// postgres user can reach the cluster below it. Read permission is not granted.
func ensureTraversable(dir string) error {
	for p := dir; ; p = filepath.Dir(p) {
		fi, err := os.Stat(p)
		if err != nil {
			return fmt.Errorf("checking %s: %w", p, err)
		}
		if fi.Mode().Perm()&0o001 == 0 {
			if err := os.Chmod(p, fi.Mode().Perm()|0o001); err != nil {
				return fmt.Errorf("letting the postgres user traverse %s: %w", p, err)
			}
		}
		if p == "/" || p == filepath.Dir(p) {
			return nil
		}
	}
}
