package sandbox

import (
	"fmt"
	"log/slog"
	"maps"
	"os"
	"path/filepath"
	"strconv"
	"time"

	"golang.org/x/sys/unix"

	"github.com/deltagym/deltagym/sandbox/cgroup"
	"github.com/deltagym/deltagym/sandbox/criu"
	"github.com/deltagym/deltagym/sandbox/initproc"
	"github.com/deltagym/deltagym/sandbox/procstate"
)

// procHost is a Sandbox as its process state sees it (procstate.Host).
type procHost Sandbox

var _ procstate.Host = (*procHost)(nil)

func (h *procHost) sb() *Sandbox { return (*Sandbox)(h) }

func (h *procHost) ID() string             { return h.id }
func (h *procHost) InitPid() int           { return h.init.Pid }
func (h *procHost) Settled()               { h.init.Settled() }
func (h *procHost) PidsLimit() int64       { return h.spec.Limits.Pids }
func (h *procHost) Cgroup() *cgroup.Cgroup { return h.cg }
func (h *procHost) Log() *slog.Logger      { return h.rt.log }

func (h *procHost) Watch(nsPid int) <-chan initproc.ExitEvent { return h.init.Conn.Watch(nsPid) }

func (h *procHost) Guard(listener *os.File) error { return h.init.Conn.Guard(listener) }

func (h *procHost) OpenRoot() (int, error) {
	root, err := unix.Open("/proc/"+strconv.Itoa(h.init.Pid)+"/root", unix.O_PATH|unix.O_DIRECTORY|unix.O_CLOEXEC, 0)
	if err != nil {
		return -1, fmt.Errorf("%w: the sandbox's init went away", ErrClosed)
	}
	return root, nil
}

func (h *procHost) Owner() (uid, gid int) {
	return h.hostID + int(h.spec.UID), h.hostID + int(h.spec.GID)
}

func (h *procHost) GroupName(prefix string) string { return h.sb().groupName(prefix) }
func (h *procHost) WorkGroup() *cgroup.Cgroup      { return h.sb().workGroup() }
func (h *procHost) WorkPids() ([]int, error)       { return h.sb().workPidsNow() }

func (h *procHost) Subgroup(prefix string) (*cgroup.Cgroup, error) { return h.sb().subgroup(prefix) }

func (h *procHost) MoveCopy(g *cgroup.Cgroup, pid int) error { return h.sb().moveCopy(g, pid) }

// SettleKilled settles the killed processes, then writes back the /dev/shm
// of the checkpoint the copies are of (deferShm).
func (h *procHost) SettleKilled(tpls []procstate.Template) {
	h.sb().settleKilled(tpls)
	h.sb().settleShm()
}

func (h *procHost) SessionShells() map[int]procstate.SessionShell {
	h.mu.Lock()
	sessions := make(map[string]*session, len(h.sessions))
	maps.Copy(sessions, h.sessions)
	h.mu.Unlock()
	out := make(map[int]procstate.SessionShell, len(sessions))
	for name, se := range sessions {
		out[se.hostPid] = procstate.SessionShell{Name: name, Attached: se.attachedState(), Pipes: se.pipeKeys()}
	}
	return out
}

func (h *procHost) AdoptSession(name string, att *procstate.Attached, cg *cgroup.Cgroup, pid int, stdio [3]*os.File, exit <-chan initproc.ExitEvent) {
	h.sb().adoptSession(name, att, cg, pid, stdio, exit)
}

func (h *procHost) CRIU() (*criu.Swrk, error) { return h.rt.criuSwrk() }

func (h *procHost) QueueFold(pid int, what string) {
	h.rt.folds.Queue(pid, h.sb().memoryRoom, what, h.id)
}

func (h *procHost) MemoryRoom() int64 {
	if h.rt.hooks.noRoom {
		return 0
	}
	return h.sb().memoryRoom()
}

// procConfig is the process state's configuration for a sandbox of r.
func (r *Runtime) procConfig() procstate.Config {
	return procstate.Config{
		CRIUDir:       r.criuDir,
		RunDir:        filepath.Join(r.store, "criu", "run"),
		ForkAtRestore: r.cfg.ForkAtRestore,
		SmallPages:    r.cfg.SmallPageTemplates,
		AheadAlways:   func() bool { return r.hooks.aheadAlways },
		StopWait:      func() time.Duration { return r.hooks.stopWait },
	}
}

func (h *procHost) NextPid(nsPid int) error { return h.init.Conn.SetNextPid(nsPid) }
