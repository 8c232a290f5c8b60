package sandbox

import (
	"context"
	"crypto/rand"
	"encoding/binary"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"time"

	"golang.org/x/sys/unix"

	"github.com/deltagym/deltagym/sandbox/cgroup"
	"github.com/deltagym/deltagym/sandbox/criu"
)

// ProcessMode says how a checkpoint captures the sandbox's live processes.
type ProcessMode int

// Process modes.
const (
	// ProcessesDefault is the runtime's Config.ProcessMode.
	ProcessesDefault ProcessMode = iota
	// ProcessesNone captures files only; a restore ends every process.
	ProcessesNone
	// ProcessesTemplate keeps a frozen template copy of each process.
	ProcessesTemplate
)

// ProcessesCRIU saves every process tree as a CRIU image.
const ProcessesCRIU ProcessMode = ProcessesTemplate + 1

// CheckpointOptions tunes one checkpoint.
type CheckpointOptions struct {
	Processes ProcessMode
	// Durable also saves the processes kept as templates as CRIU images,
	// before the checkpoint returns, so that the checkpoint brings them
	// back after its sandbox is gone, after a restart, or once a template
	// is lost. A process that could not be saved leaves the checkpoint
	// standing (files and templates) and says why
	// (ProcessCapture.Unsaved).
	Durable bool
	// Labels are kept in the checkpoint's record (CheckpointInfo.Labels).
	Labels map[string]string
	// Pinned keeps the checkpoint until it is released, whatever
	// Config.CheckpointTTL: for checkpoints whose owner releases them
	// (a pool's, a reset cache's). A pin lasts as long as the runtime: a
	// checkpoint kept across a restart expires by the TTL.
	Pinned bool
}

// CaptureMethod is how a checkpoint captured one process.
type CaptureMethod int

// Capture methods. Their names (String) are those of the API and the
// ledger.
const (
	// CaptureTemplate: a frozen template copy, in the checkpoint's sandbox.
	CaptureTemplate CaptureMethod = iota + 1
	// CaptureCRIU: a CRIU image of the process's tree (the general path).
	CaptureCRIU
)

// String returns the method's name: "template" or "criu".
func (m CaptureMethod) String() string {
	switch m {
	case CaptureTemplate:
		return "template"
	case CaptureCRIU:
		return "criu"
	}
	return "unknown"
}

// MarshalText encodes the method as its name.
func (m CaptureMethod) MarshalText() ([]byte, error) { return []byte(m.String()), nil }

// ProcessCapture tells how one process was captured by a checkpoint.
type ProcessCapture struct {
	Pid     int    // inside the sandbox, at the checkpoint
	Command string // its name
	Method  CaptureMethod
	Session string // the session whose shell it is, if any
	// Reason says why the general path (criu) took the process, or, for
	// a template, what its copies share with it.
	Reason string
	// ImagePid is the pid a template's process has in forks, and in
	// restores in other sandboxes, which bring it back from a CRIU image
	// of a copy of the template: that copy's pid (0 until the image is
	// made).
	ImagePid int
	// Saved: the process has a CRIU image that restores anywhere, so the
	// checkpoint brings it back whatever happens to its sandbox or the
	// server.
	Saved bool
	// Unsaved says why the process is not saved: a durable checkpoint
	// could not save it.
	Unsaved string
}

// moveCopy moves a copy into its group g: through the command group's
// cgroup.procs opened ahead, if g is that group. Called with op held.
func (s *Sandbox) moveCopy(g *cgroup.Cgroup, pid int) error {
	s.cmds.mu.Lock()
	defer s.cmds.mu.Unlock()
	if w := s.workFilesNow(); g == s.cmds.work && w.procs != nil {
		return w.procs.Write(strconv.Itoa(pid))
	}
	return g.Move(pid)
}

// SeedPath is where a sandbox restored or forked with fresh entropy finds
// its own random seed (decimal, one line), for programs to reseed from:
// copies of one template share the random state they had in memory.
const SeedPath = "/run/deltagym/fork-seed"

// RestoreOptions tunes one restore.
type RestoreOptions struct {
	// FreshEntropy writes a new seed to SeedPath before the restored
	// processes run, and reseeds every restored session's $RANDOM.
	FreshEntropy bool
}

// newSeed returns a random seed.
func newSeed() uint64 {
	var b [8]byte
	_, _ = rand.Read(b[:])
	return binary.LittleEndian.Uint64(b[:])
}

// writeSeed writes seed to SeedPath as the sandbox's root, whatever user
// commands run as. The caller holds op.
func (s *Sandbox) writeSeed(seed uint64) error {
	rel := strings.TrimPrefix(SeedPath, "/")
	err := s.fileOpOnce(s.hostID, s.hostID, rel, func(root int, rel string) error {
		if err := mkdirAll(root, rel); err != nil {
			return err
		}
		fd, err := unix.Openat2(root, rel, &unix.OpenHow{Flags: unix.O_WRONLY | unix.O_CREAT | unix.O_TRUNC | unix.O_CLOEXEC | unix.O_NOFOLLOW, Mode: 0o644, Resolve: resolve})
		if err != nil {
			return err
		}
		f := os.NewFile(uintptr(fd), SeedPath)
		_, err = f.WriteString(strconv.FormatUint(seed, 10) + "\n")
		return errors.Join(err, f.Close())
	})
	if err != nil {
		return fmt.Errorf("writing %s: %w", SeedPath, err)
	}
	return nil
}

// reseedSessions sets $RANDOM in every session to a fresh value.
func (s *Sandbox) reseedSessions(ctx context.Context) error {
	s.mu.Lock()
	names := make([]string, 0, len(s.sessions))
	for n := range s.sessions {
		names = append(names, n)
	}
	s.mu.Unlock()
	for _, n := range names {
		res, err := s.Exec(ctx, ExecRequest{Session: n, Command: "RANDOM=" + strconv.FormatUint(newSeed()%32768, 10), Timeout: 10 * time.Second})
		if err == nil && res.ExitCode != 0 {
			err = fmt.Errorf("exit %d: %s", res.ExitCode, res.Stderr)
		}
		if err != nil {
			return fmt.Errorf("reseeding session %s: %w", n, err)
		}
	}
	return nil
}

// criuSwrk returns the runtime's criu runner, made on first use from
// Config.CRIU (and again after a failure: a wrapper installed at that path
// while the server runs is used without a restart).
func (r *Runtime) criuSwrk() (*criu.Swrk, error) {
	r.pimg.mu.Lock()
	defer r.pimg.mu.Unlock()
	if r.pimg.swrk == nil {
		w, err := criu.NewSwrk(r.cfg.CRIU)
		if err != nil {
			return nil, fmt.Errorf("%w: the general path needs CRIU 4.2.1+ (run `make criu`): %w", ErrProcesses, err)
		}
		w.KeepLogs(filepath.Join(r.store, "criu-logs"), keptCRIULogs)
		// meta is the runtime's own tmpfs, mode 0700 (mountMeta).
		cache := filepath.Join(r.store, "meta", "criu")
		err = os.Mkdir(cache, 0o700)
		if err == nil || errors.Is(err, os.ErrExist) {
			err = w.CacheFeatures(cache, r.layers.Mounts)
		}
		if err != nil {
			r.log.Warn("criu will probe the kernel at every call", "err", err)
		}
		r.pimg.swrk = w
	}
	return r.pimg.swrk, nil
}

// keptCRIULogs is how many logs of failed CRIU requests the runtime keeps
// (in store/criu-logs), for the errors that name them.
const keptCRIULogs = 64

// criuDir is where checkpoint id keeps its CRIU images.
func (r *Runtime) criuDir(id string) string { return filepath.Join(r.store, "criu", id) }
