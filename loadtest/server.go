package loadtest

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"time"

	"google.golang.org/grpc"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"
)

// cgroupControllers are the hierarchies the server's sandboxes use; StartServer gives the
// server a private view of each (see ServerConfig.IsolateCgroups).
var cgroupControllers = []string{"cpu", "memory", "pids", "unified"}

// ServerConfig configures StartServer.
type ServerConfig struct {
	// Binary is the server executable (bin/deltagym).
	Binary string
	// Init is the sandbox init (bin/dg-init), passed as --init. Empty: the server's own
	// default, which it finds itself ($DELTAGYM_INIT, else the dg-init beside it, else the
	// checkout's bin/dg-init), as it finds CRIU and PostgreSQL.
	Init string
	// DataDir is the server's data directory (created).
	DataDir string
	// EnvsDir is the env catalog directory.
	EnvsDir string
	// ImageDir, when set, is the directory holding the default image's rootfs
	// (.data/images/default); DataDir/images/default is made a symlink to it so the server
	// imports it without a rebuild.
	ImageDir string
	// Ledger runs the server with its ledger (a private Postgres); default --no-ledger.
	Ledger bool
	// PoolSize is --pool-size (0: the server's default).
	PoolSize int
	// IsolateCgroups runs the server in a private mount namespace in which each cgroup
	// hierarchy it uses is a bind mount of a fresh sub-group of the host's, so its cgroup
	// root "deltagym" does not collide with (and its start-up reconcile does not remove the
	// sandboxes of) another server on the machine. Needs root.
	IsolateCgroups bool
	// Log receives the server's output; nil discards it.
	Log io.Writer
	// StartTimeout bounds start-up until healthy. Default 3m (a first start imports the image).
	StartTimeout time.Duration
}

// Validate checks the config and fills in defaults.
func (c *ServerConfig) Validate() error {
	for _, f := range []struct{ v, what string }{{c.Binary, "server binary (--serve bin/deltagym)"},
		{c.DataDir, "data dir (--data)"}, {c.EnvsDir, "env catalog (--envs envs)"}} {
		if f.v == "" {
			return fmt.Errorf("starting a server needs its %s: %w", f.what, ErrInvalid)
		}
	}
	if _, err := exec.LookPath(c.Binary); err != nil {
		return fmt.Errorf("server binary %s (--serve): %w: %w", c.Binary, err, ErrInvalid)
	}
	if _, err := os.Stat(c.Init); c.Init != "" && err != nil {
		return fmt.Errorf("sandbox init %s (--init; make build makes bin/dg-init): %w", c.Init, ErrInvalid)
	}
	if st, err := os.Stat(c.EnvsDir); err != nil || !st.IsDir() {
		return fmt.Errorf("env catalog %s (--envs) is not a directory; the repository's envs/ is the default catalog: %w", c.EnvsDir, ErrInvalid)
	}
	if c.ImageDir == "" {
		if _, err := os.Stat(filepath.Join(c.DataDir, "images", "default")); err != nil {
			return fmt.Errorf("%s has no default image: pass --image-dir .data/images/default (built by make image): %w", c.DataDir, ErrInvalid)
		}
	}
	if c.StartTimeout <= 0 {
		c.StartTimeout = 3 * time.Minute
	}
	if c.Log == nil {
		c.Log = io.Discard
	}
	return nil
}

// Server is a server process started by StartServer.
type Server struct {
	// Addr is its loopback listen address.
	Addr string
	// Token is the bearer token it requires, made for it by StartServer.
	Token string
	// PID is the process id of the server (with IsolateCgroups, of the shell that execs it:
	// the same process).
	PID int

	cmd       *exec.Cmd
	cgName    string
	done      chan struct{}
	waitErr   error
	closeOnce sync.Once
	closeErr  error
}

// StartServer starts a server on a free loopback port and waits until its gRPC health
// check serves.
func StartServer(ctx context.Context, cfg ServerConfig) (*Server, error) {
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	if err := os.MkdirAll(cfg.DataDir, 0o755); err != nil {
		return nil, fmt.Errorf("creating data dir: %w", err)
	}
	if cfg.ImageDir != "" {
		if err := linkImage(cfg.DataDir, cfg.ImageDir); err != nil {
			return nil, err
		}
	}
	addr, err := freePort()
	if err != nil {
		return nil, err
	}
	args := []string{"serve", "--addr", addr, "--data", cfg.DataDir, "--envs", cfg.EnvsDir}
	if cfg.Init != "" {
		args = append(args, "--init", cfg.Init)
	}
	if !cfg.Ledger {
		args = append(args, "--no-ledger")
	}
	if cfg.PoolSize > 0 {
		args = append(args, "--pool-size", strconv.Itoa(cfg.PoolSize))
	}
	s := &Server{Addr: addr, Token: newToken(), done: make(chan struct{})}
	var cmd *exec.Cmd
	if cfg.IsolateCgroups {
		s.cgName = fmt.Sprintf("deltagym-loadtest-%d", os.Getpid())
		script := "set -e\n"
		for _, c := range cgroupControllers {
			host := filepath.Join("/sys/fs/cgroup", c)
			if err := os.MkdirAll(filepath.Join(host, s.cgName), 0o755); err != nil {
				return nil, fmt.Errorf("creating cgroup %s/%s: %w", c, s.cgName, err)
			}
			script += fmt.Sprintf("mount --bind %s %s\n", filepath.Join(host, s.cgName), host)
		}
		script += `exec "$@"` + "\n"
		cmd = exec.Command("/bin/sh", append([]string{"-c", script, "deltagym-serve", cfg.Binary}, args...)...)
		cmd.SysProcAttr = &syscall.SysProcAttr{Unshareflags: syscall.CLONE_NEWNS, Setpgid: true}
	} else {
		cmd = exec.Command(cfg.Binary, args...)
		cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true}
	}
	// The token goes by the environment, which other users cannot read, not by argv.
	cmd.Env = append(os.Environ(), "DELTAGYM_TOKEN="+s.Token)
	cmd.Stdout, cmd.Stderr = cfg.Log, cfg.Log
	if err := cmd.Start(); err != nil {
		s.removeCgroups()
		return nil, fmt.Errorf("starting %s: %w: %w", cfg.Binary, ErrServerStart, err)
	}
	s.cmd, s.PID = cmd, cmd.Process.Pid
	go func() { s.waitErr = cmd.Wait(); close(s.done) }()
	wctx, cancel := context.WithTimeout(ctx, cfg.StartTimeout)
	defer cancel()
	if err := s.waitHealthy(wctx); err != nil {
		_ = s.Close()
		return nil, err
	}
	return s, nil
}

func (s *Server) waitHealthy(ctx context.Context) error {
	conn, err := grpc.NewClient(s.Addr, DialOptions(s.Token)...)
	if err != nil {
		return fmt.Errorf("dialing %s: %w", s.Addr, err)
	}
	defer conn.Close()
	hc := healthpb.NewHealthClient(conn)
	t := time.NewTicker(50 * time.Millisecond)
	defer t.Stop()
	for {
		cctx, cancel := context.WithTimeout(ctx, time.Second)
		r, err := hc.Check(cctx, &healthpb.HealthCheckRequest{})
		cancel()
		if err == nil && r.GetStatus() == healthpb.HealthCheckResponse_SERVING {
			return nil
		}
		select {
		case <-s.done:
			return fmt.Errorf("server exited during start-up (%v): %w", s.waitErr, ErrServerStart)
		case <-ctx.Done():
			return fmt.Errorf("waiting for health at %s (last: %v): %w", s.Addr, err, ErrServerStart)
		case <-t.C:
		}
	}
}

// Close stops the server by its PID (SIGTERM, then SIGKILL after 60 s), waits for it and
// removes its private cgroups. It is idempotent.
func (s *Server) Close() error {
	s.closeOnce.Do(func() {
		_ = syscall.Kill(s.PID, syscall.SIGTERM)
		select {
		case <-s.done:
		case <-time.After(60 * time.Second):
			_ = syscall.Kill(s.PID, syscall.SIGKILL)
			<-s.done
		}
		var ee *exec.ExitError
		if s.waitErr != nil && !errors.As(s.waitErr, &ee) {
			s.closeErr = s.waitErr
		}
		s.removeCgroups()
	})
	return s.closeErr
}

// removeCgroups removes the private cgroup sub-trees (deepest first); groups still holding
// processes stay.
func (s *Server) removeCgroups() {
	if s.cgName == "" {
		return
	}
	for _, c := range cgroupControllers {
		root := filepath.Join("/sys/fs/cgroup", c, s.cgName)
		var dirs []string
		_ = filepath.WalkDir(root, func(p string, d os.DirEntry, err error) error {
			if err == nil && d.IsDir() {
				dirs = append(dirs, p)
			}
			return nil
		})
		for i := len(dirs) - 1; i >= 0; i-- {
			_ = syscall.Rmdir(dirs[i])
		}
	}
}

// RSS returns the server's resident set size in bytes (from /proc).
func (s *Server) RSS() int64 { return procRSS(s.PID) }

func procRSS(pid int) int64 {
	f, err := os.Open(fmt.Sprintf("/proc/%d/status", pid))
	if err != nil {
		return 0
	}
	defer f.Close()
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		if rest, ok := strings.CutPrefix(sc.Text(), "VmRSS:"); ok {
			kb, _ := strconv.ParseInt(strings.TrimSuffix(strings.TrimSpace(rest), " kB"), 10, 64)
			return kb << 10
		}
	}
	return 0
}

func linkImage(dataDir, imageDir string) error {
	abs, err := filepath.Abs(imageDir)
	if err != nil {
		return err
	}
	if _, err := os.Stat(filepath.Join(abs, "rootfs")); err != nil {
		return fmt.Errorf("default image (make image): %w", err)
	}
	link := filepath.Join(dataDir, "images", "default")
	if cur, err := os.Readlink(link); err == nil && cur == abs {
		return nil
	}
	if err := os.MkdirAll(filepath.Dir(link), 0o755); err != nil {
		return err
	}
	_ = os.Remove(link)
	if err := os.Symlink(abs, link); err != nil {
		return fmt.Errorf("linking the default image: %w", err)
	}
	return nil
}

func freePort() (string, error) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return "", fmt.Errorf("finding a free port: %w", err)
	}
	defer ln.Close()
	return ln.Addr().String(), nil
}

// SandboxCPUStat returns the cgroup2 cpu.stat file that accounts the CPU of the server's
// sandboxes ("" without IsolateCgroups).
func (s *Server) SandboxCPUStat() string {
	if s.cgName == "" {
		return ""
	}
	return filepath.Join("/sys/fs/cgroup/unified", s.cgName, "cpu.stat")
}

// SandboxMemoryUsage returns the cgroup v1 memory.usage_in_bytes file of the server's
// sandboxes ("" without IsolateCgroups).
func (s *Server) SandboxMemoryUsage() string {
	if s.cgName == "" {
		return ""
	}
	return filepath.Join("/sys/fs/cgroup/memory", s.cgName, "memory.usage_in_bytes")
}
