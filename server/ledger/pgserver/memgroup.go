package pgserver

import (
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"strings"

	"github.com/deltagym/deltagym/sandbox/cgroup"
)

// DefaultMemoryLimit caps a private cluster's memory (Config.MemoryLimit 0): its shared
// buffers (128 MB by default), its backends and the page cache of its files.
const DefaultMemoryLimit = 512 << 20

// memoryGroupPrefix starts the path segment, below each cgroup hierarchy's root, of a private
// cluster's group: deltagym-pg-<hash of the cluster's directory>/postgres. Each cluster has a
// base of its own, so that removing it at Stop never races another cluster making its group.
const memoryGroupPrefix = "deltagym-pg-"

// memoryGroupName is the group's name below its base.
const memoryGroupName = "postgres"

// memoryHeadroom is what a cap must leave above the shared buffers: backends and page cache.
const memoryHeadroom = 256 << 20

// failMoveForTest makes the postmaster's shell fail its move (tests of the fallback).
var failMoveForTest bool

// moveFailed is the exit status of the postmaster's shell when it could not move itself into
// the group.
const moveFailed = 111

// Why a private cluster runs in a memory-capped control group of its own.
//
// The ledger's rows grow Postgres's files for as long as the server runs: a table's heap and,
// until checkpoints recycle its segments, the WAL. Without a cap, every new block of those
// files takes a page the machine has never handed out, for the page cache keeps what it has
// while free memory lasts. On a VM a page never handed out, or handed back to the host
// (virtio_balloon's free page reporting), costs microseconds to touch first
// (docs/ARCHITECTURE.md, "Known limits"). Capped, the group's page cache stays within its
// limit: the kernel reclaims the group's own clean pages, written out already by the
// checkpointer, and hands them to the new blocks, warm. That spares Postgres CPU per step, and
// the writer too, whose spool's freed pages do not go to Postgres's growth
// (BenchmarkWriterSteps with DELTAGYM_LEDGER_BENCH_PG_MB; docs/PERFORMANCE.md, "The ledger").
//
// The cap also keeps a long-running ledger's page cache from crowding the sandboxes' memory.
// The kernel's OOM killer acts within the group only: a backend killed there makes the
// postmaster restart the others (the ledger writer retries), a postmaster killed there is
// started again by supervision. The group is also one in the cpu and pids hierarchies (the
// cgroup package makes its groups so), so under CPU contention Postgres weighs as one group
// against the server's threads, as each sandbox does; and it is outside the server's own
// group, as the sandboxes are, so a service manager's limits on the server do not cover it.
//
// The postmaster cannot be moved after it starts (it may have forked already), and os/exec
// runs nothing between fork and exec, so a shell does it: root (this process) opens the
// group's cgroup.procs files, the kernel checks a move against the opener's credentials, and
// the shell, already the postgres user, writes "0" (itself) to each, closes them and becomes
// the postmaster. If that fails (a kernel that checks the writer's credentials instead, a
// group removed from outside), the cluster starts without the cap, with a warning.

// groupRoot names the cluster's base after its directory, so that a server started again on
// the same data directory finds the group a crashed run left.
func groupRoot(pgdata string) string {
	sum := sha256.Sum256([]byte(pgdata))
	return memoryGroupPrefix + hex.EncodeToString(sum[:6])
}

// memoryLimit is the cap: Config.MemoryLimit, raised to leave memoryHeadroom above
// shared_buffers when the settings make those larger than the default's 128 MB.
func (s *Server) memoryLimit() int64 {
	buffers := int64(128 << 20)
	if v, ok := s.cfg.Settings["shared_buffers"]; ok {
		if b, err := pgBytes(v); err == nil {
			buffers = b
		}
	}
	return max(s.cfg.MemoryLimit, buffers+memoryHeadroom)
}

// pgBytes parses a PostgreSQL memory setting in bytes: a number with a unit (kB, MB, GB, TB)
// or a bare number of 8 kB blocks.
func pgBytes(v string) (int64, error) {
	v = strings.TrimSpace(v)
	unit := int64(8 << 10)
	for suffix, u := range map[string]int64{"kB": 1 << 10, "MB": 1 << 20, "GB": 1 << 30, "TB": 1 << 40} {
		if n, ok := strings.CutSuffix(v, suffix); ok {
			v, unit = strings.TrimSpace(n), u
			break
		}
	}
	n, err := strconv.ParseInt(v, 10, 64)
	if err != nil || n < 0 {
		return 0, fmt.Errorf("memory setting %q: not a size", v)
	}
	return n * unit, nil
}

// openGroup makes the cluster's memory group, or takes over the one a crashed run left, unless
// it has one already. Without a cap (Config.MemoryLimit negative, or after a failed move) it
// removes the one a crashed run may have left. Called with mu held.
func (s *Server) openGroup() error {
	if s.group != nil || os.Geteuid() != 0 {
		return nil
	}
	if s.cfg.MemoryLimit < 0 || s.noGroup {
		return removeLeftGroup(s.pgdata)
	}
	m, err := cgroup.New(cgroup.Config{Root: groupRoot(s.pgdata)})
	if err != nil {
		return err
	}
	lim := cgroup.Limits{MemoryBytes: s.memoryLimit()}
	g, err := m.Create(memoryGroupName, lim)
	if errors.Is(err, cgroup.ErrExist) {
		if g, err = m.Open(memoryGroupName); err == nil {
			err = g.SetLimits(lim)
		}
	}
	if err != nil {
		_ = m.RemoveBase()
		return err
	}
	s.groups, s.group = m, g
	path := g.Path()
	s.groupPath.Store(&path)
	return nil
}

// removeGroup removes the cluster's group and its base, ending whatever of the cluster still
// runs there. Called with mu held.
func (s *Server) removeGroup() error {
	if s.group == nil {
		return nil
	}
	err := s.groups.Remove(s.group.Name())
	if err == nil {
		err = s.groups.RemoveBase()
	}
	s.groups, s.group = nil, nil
	s.groupPath.Store(nil)
	if err != nil {
		return fmt.Errorf("removing postgres memory group: %w", err)
	}
	return nil
}

// dropGroup gives up the cap after a failed move: the group goes, and the next starts run
// without one. Called with mu held.
func (s *Server) dropGroup(why error) {
	s.cfg.Logger.Warn("private postgres runs without its memory cap", "dir", s.cfg.DataDir, "err", why)
	if err := s.removeGroup(); err != nil {
		s.cfg.Logger.Warn("removing postgres memory group", "err", err)
	}
	s.noGroup = true
}

// removeLeftGroup removes the memory group a crashed run left for the cluster in pgdata, if
// any, ending what still runs in it.
func removeLeftGroup(pgdata string) error {
	if os.Geteuid() != 0 {
		return nil
	}
	root := groupRoot(pgdata)
	if !groupExists(root) {
		return nil
	}
	m, err := cgroup.New(cgroup.Config{Root: root})
	if err != nil {
		return fmt.Errorf("removing postgres memory group: %w", err)
	}
	g, err := m.Open(memoryGroupName)
	if err != nil {
		return m.RemoveBase()
	}
	s := &Server{groups: m, group: g}
	return s.removeGroup()
}

// groupExists reports whether a base named root is in any cgroup hierarchy, without making
// one (cgroup.New would).
func groupExists(root string) bool {
	dirs, _ := filepath.Glob(filepath.Join("/sys/fs/cgroup", "*", root))
	if len(dirs) > 0 {
		return true
	}
	_, err := os.Stat(filepath.Join("/sys/fs/cgroup", root))
	return err == nil
}

// inGroup turns the postmaster's command line into one that moves it into the cluster's group
// before it starts, so that every process it forks is born there (see above). It returns the
// command's name, arguments and files.
func (s *Server) inGroup(postgres string, args []string) (string, []string, []*os.File) {
	if s.group == nil {
		return postgres, args, nil
	}
	files, err := s.group.OpenProcs()
	if err != nil {
		s.dropGroup(err)
		return postgres, args, nil
	}
	var b strings.Builder
	b.WriteString("{ ")
	for i := range files {
		fmt.Fprintf(&b, "echo 0 >&%d && ", 3+i)
	}
	if failMoveForTest {
		b.WriteString("false && ")
	}
	fmt.Fprintf(&b, `:; } || { echo "deltagym: could not move postgres into its memory cgroup %s" >&2; exit %d; }; exec`,
		s.group.Path(), moveFailed)
	for i := range files {
		fmt.Fprintf(&b, " %d>&-", 3+i)
	}
	b.WriteString(`; exec "$0" "$@"`)
	return "/bin/sh", append([]string{"-c", b.String(), postgres}, args...), files
}

// MemoryGroup returns the path, below each cgroup hierarchy's root, of the control group that
// caps the cluster's memory, or "" when it runs in none (Config.MemoryLimit negative, not
// root, or no group could be made: the start logged why). It does not wait for a start.
func (s *Server) MemoryGroup() string {
	if p := s.groupPath.Load(); p != nil {
		return *p
	}
	return ""
}
