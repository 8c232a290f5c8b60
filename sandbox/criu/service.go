package criu

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"syscall"
	"time"

	"github.com/checkpoint-restore/go-criu/v7/rpc"
)

// maxMsg is CRIU's CR_MAX_MSG_SIZE: no RPC message is larger.
const maxMsg = 8192

// Config configures a Service.
type Config struct {
	// Binary is the CRIU 4.2.1+ wrapper (scripts/criu.sh writes it; internal/locate.CRIU finds
	// it). Required.
	Binary string
	// WorkDir is an existing absolute directory for the service socket and service.log.
	WorkDir string
}

// Validate reports whether the Config can start a Service.
func (c Config) Validate() error {
	if !filepath.IsAbs(c.WorkDir) {
		return fmt.Errorf("%w: work dir %q is not absolute", ErrInvalidConfig, c.WorkDir)
	}
	// sun_path holds 108 bytes including the NUL.
	if len(filepath.Join(c.WorkDir, "criu.sock")) > 107 {
		return fmt.Errorf("%w: work dir %q is too long for a unix socket path", ErrInvalidConfig, c.WorkDir)
	}
	return nil
}

// Service is a long-lived `criu service` child process. Each Dump or Restore opens a connection
// to it; the service forks a worker for each. Methods are safe for concurrent use.
type Service struct {
	cmd     *exec.Cmd
	sock    string
	logPath string
	exited  chan struct{}
	waitErr error

	mu sync.Mutex
	// +checklocks:mu
	closed bool
}

// Start runs `criu service` and returns once it accepts connections.
func Start(ctx context.Context, cfg Config) (*Service, error) {
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	bin := cfg.Binary
	if err := executable(bin); err != nil {
		return nil, fmt.Errorf("checking criu %q: %w", bin, err)
	}
	s := &Service{
		sock:    filepath.Join(cfg.WorkDir, "criu.sock"),
		logPath: filepath.Join(cfg.WorkDir, "service.log"),
		exited:  make(chan struct{}),
	}
	status, statusW, err := os.Pipe()
	if err != nil {
		return nil, fmt.Errorf("starting criu service: %w", err)
	}
	defer status.Close()
	// --status-fd makes the service write one byte once it listens.
	s.cmd = exec.Command(bin, "service", "--address", s.sock, "--status-fd", "3", "-o", s.logPath)
	s.cmd.ExtraFiles = []*os.File{statusW}
	s.cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true}
	err = s.cmd.Start()
	statusW.Close()
	if err != nil {
		return nil, fmt.Errorf("starting criu service %s: %w", bin, err)
	}
	go func() {
		s.waitErr = s.cmd.Wait()
		close(s.exited)
	}()
	if d, ok := ctx.Deadline(); ok {
		_ = status.SetReadDeadline(d)
	}
	var b [1]byte
	if _, err := io.ReadFull(status, b[:]); err != nil {
		_ = s.cmd.Process.Kill()
		<-s.exited
		return nil, fmt.Errorf("waiting for criu service to listen (%s): %w", s.logTail(), err)
	}
	return s, nil
}

// Dump checkpoints the tree rooted at o.Pid into o.ImagesDir.
func (s *Service) Dump(ctx context.Context, o DumpOpts) error {
	if err := o.Validate(); err != nil {
		return err
	}
	_, err := s.call(ctx, rpc.CriuReqType_DUMP, o.rpc(), filepath.Join(o.ImagesDir, "dump.log"))
	return err
}

// Restore recreates the tree saved in o.ImagesDir and returns the host pid of its root.
func (s *Service) Restore(ctx context.Context, o RestoreOpts) (int, error) {
	if err := o.Validate(); err != nil {
		return 0, err
	}
	resp, err := s.call(ctx, rpc.CriuReqType_RESTORE, o.rpc(), filepath.Join(o.ImagesDir, "restore.log"))
	if err != nil {
		return 0, err
	}
	return int(resp.GetRestore().GetPid()), nil
}

// Version asks the service for CRIU's version as major*10000+minor*100+sublevel.
func (s *Service) Version(ctx context.Context) (int, error) {
	resp, err := s.call(ctx, rpc.CriuReqType_VERSION, nil, s.logPath)
	if err != nil {
		return 0, err
	}
	v := resp.GetVersion()
	return int(v.GetMajorNumber()*10000 + v.GetMinorNumber()*100 + v.GetSublevel()), nil
}

func (s *Service) call(ctx context.Context, typ rpc.CriuReqType, opts *rpc.CriuOpts, log string) (*rpc.CriuResp, error) {
	s.mu.Lock()
	closed := s.closed
	s.mu.Unlock()
	if closed {
		return nil, ErrClosed
	}
	var d net.Dialer
	c, err := d.DialContext(ctx, "unixpacket", s.sock)
	if err != nil {
		return nil, fmt.Errorf("connecting to criu service: %w", err)
	}
	defer c.Close()
	if dl, ok := ctx.Deadline(); ok {
		_ = c.SetDeadline(dl)
	}
	stop := context.AfterFunc(ctx, func() { _ = c.SetDeadline(time.Now()) })
	defer stop()

	resp, err := exchange(c, typ, opts, log, nil)
	if err != nil && ctx.Err() != nil {
		return nil, fmt.Errorf("%w: %w", ctx.Err(), err)
	}
	return resp, err
}

// Close stops the service. It is idempotent.
func (s *Service) Close() error {
	s.mu.Lock()
	if s.closed {
		s.mu.Unlock()
		return nil
	}
	s.closed = true
	s.mu.Unlock()
	var errs []error
	if err := s.cmd.Process.Signal(syscall.SIGTERM); err != nil && !errors.Is(err, os.ErrProcessDone) {
		errs = append(errs, fmt.Errorf("stopping criu service: %w", err))
	}
	<-s.exited
	if err := os.Remove(s.sock); err != nil && !errors.Is(err, os.ErrNotExist) {
		errs = append(errs, fmt.Errorf("removing criu service socket: %w", err))
	}
	return errors.Join(errs...)
}

// logTail returns the last lines of service.log for error messages.
func (s *Service) logTail() string {
	b, err := os.ReadFile(s.logPath)
	if err != nil {
		return "no service.log"
	}
	lines := strings.Split(strings.TrimSpace(string(b)), "\n")
	if len(lines) > 3 {
		lines = lines[len(lines)-3:]
	}
	return strings.Join(lines, "; ")
}
