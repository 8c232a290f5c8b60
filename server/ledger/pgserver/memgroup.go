package pgserver

import (
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"os"
	"strings"

	"github.com/deltagym/deltagym/sandbox/cgroup"
)

// DefaultMemoryLimit caps a private cluster's memory (Config.MemoryLimit 0): its shared
// buffers (128 MB by default), its backends and the page cache of its files.
const DefaultMemoryLimit = 512 << 20

// memoryGroupRoot is the path segment, below each cgroup hierarchy's root, that holds the
// groups of private clusters, one per cluster directory.
const memoryGroupRoot = "deltagym-postgres"

// Why a private cluster runs in a memory-capped control group of its own.
//
// The ledger's rows grow Postgres's files for as long as the server runs: a table's heap and,
// until checkpoints recycle its segments, the WAL. Without a cap, every new block of those
// files takes a page the machine has never handed out, for the page cache keeps what it has
// while free memory lasts. On this VM a page never handed out, or handed back to the host
// (virtio_balloon's free page reporting), costs about 5 µs to touch first
// (docs/ARCHITECTURE.md, known limits). Capped, the group's page cache stays within its limit: the
// kernel reclaims the group's own clean pages, written out already by the checkpointer, and
// hands them to the new blocks, warm. BenchmarkWriterSteps at 30,000 steps/s, with and
// without the cap (a 384 MiB group, three interleaved pairs): Postgres 19.9–21.4 against
// 26.0–31.8 µs of CPU per step, and the writer, whose spool's freed pages no longer go to
// Postgres's growth, 9.5–11.0 against 13.1–15.3.
//
// The cap also keeps a long-running ledger's page cache from crowding the sandboxes' memory.
// The kernel's OOM killer acts within the group only: a backend killed there makes the
// postmaster restart the others (the ledger writer retries), a postmaster killed there is
// started again by supervision.

// groupName names the cluster's group after its directory, so that a server started again
// on the same data directory finds the group a crashed run left.
func groupName(pgdata string) string {
	sum := sha256.Sum256([]byte(pgdata))
	return "pg-" + hex.EncodeToString(sum[:6])
}

// openGroup makes the cluster's memory group with Config.MemoryLimit, or takes over the one a
// crashed run left, unless it has one already. Called with mu held.
func (s *Server) openGroup() error {
	if s.group != nil || s.cfg.MemoryLimit < 0 || os.Geteuid() != 0 {
		return nil
	}
	m, err := cgroup.New(cgroup.Config{Root: memoryGroupRoot})
	if err != nil {
		return err
	}
	name, lim := groupName(s.pgdata), cgroup.Limits{MemoryBytes: s.cfg.MemoryLimit}
	g, err := m.Create(name, lim)
	if errors.Is(err, cgroup.ErrExist) {
		if g, err = m.Open(name); err == nil {
			err = g.SetLimits(lim)
		}
	}
	if err != nil {
		return err
	}
	s.groups, s.group = m, g
	path := g.Path()
	s.groupPath.Store(&path)
	return nil
}

// removeGroup removes the cluster's group once its processes are gone. Called with mu held.
func (s *Server) removeGroup() error {
	if s.group == nil {
		return nil
	}
	err := s.groups.Remove(s.group.Name())
	if err == nil {
		err = s.groups.RemoveBase() // the last cluster's group takes the base along
	}
	s.groups, s.group = nil, nil
	s.groupPath.Store(nil)
	if err != nil {
		return fmt.Errorf("removing postgres memory group: %w", err)
	}
	return nil
}

// removeLeftGroup removes the memory group a crashed run left for the cluster in pgdata, if any.
func removeLeftGroup(pgdata string) error {
	if os.Geteuid() != 0 {
		return nil
	}
	s := &Server{pgdata: pgdata}
	m, err := cgroup.New(cgroup.Config{Root: memoryGroupRoot})
	if err != nil {
		return fmt.Errorf("removing postgres memory group: %w", err)
	}
	g, err := m.Open(groupName(pgdata))
	if err != nil {
		return m.RemoveBase()
	}
	s.groups, s.group = m, g
	return s.removeGroup()
}

// inGroup turns the postmaster's command line into one that moves it into the cluster's group
// before it starts, so that every process it forks is born there. The kernel checks moves into a
// group against the credentials of whoever opened the group's cgroup.procs: this process, root,
// opens them, and the shell, already the postgres user, writes "0" (itself) to each, closes
// them and becomes the postmaster. It returns the command's name, arguments and files.
func (s *Server) inGroup(postgres string, args []string) (string, []string, []*os.File, error) {
	if s.group == nil {
		return postgres, args, nil, nil
	}
	files, err := s.group.OpenProcs()
	if err != nil {
		return "", nil, nil, err
	}
	var b strings.Builder
	b.WriteString("{ ")
	for i := range files {
		fmt.Fprintf(&b, "echo 0 >&%d && ", 3+i)
	}
	b.WriteString(`:; } || { echo "deltagym: could not move postgres into its memory cgroup ` + s.group.Path() +
		`" >&2; exit 1; }; exec`)
	for i := range files {
		fmt.Fprintf(&b, " %d>&-", 3+i)
	}
	b.WriteString(`; exec "$0" "$@"`)
	return "/bin/sh", append([]string{"-c", b.String(), postgres}, args...), files, nil
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
