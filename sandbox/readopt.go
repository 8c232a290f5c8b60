package sandbox

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"time"

	"golang.org/x/sys/unix"

	"github.com/deltagym/deltagym/sandbox/cgroup"
	"github.com/deltagym/deltagym/sandbox/launch"
	"github.com/deltagym/deltagym/sandbox/procstate"
)

// Re-adopting templates after a crash.
//
// A sandbox ends with the server that runs it: a clean stop destroys it
// (saving its checkpoints' templates as CRIU images first), and a crash
// closes its init's control socket. The init then ends every process but the
// frozen templates (dg-init's orphaned) and stays, holding the sandbox's
// namespaces, until they are gone. The next server on the data directory
// finds it through the sandbox's record (store/meta/sandboxes/<id>), saves
// each checkpoint's templates as CRIU images — the same path as a clean
// stop (procs_image.go) — and then ends the sandbox. A template whose group
// is found thawed, or that is gone or is another process now (its start
// time), counts as lost: its checkpoint brings back its files, and its
// processes only from a durable image.

// sandboxRecord is what the data directory keeps of a live sandbox, for the
// next server.
type sandboxRecord struct {
	InitPid   int    `json:"init_pid"`
	InitStart uint64 `json:"init_start"` // guards against pid reuse
	Cgroup    string `json:"cgroup"`     // the sandbox's top-level group
}

// endGroups removes every cgroup of the runtime whose store is store, with
// whatever still runs in them: a crashed runtime's sandboxes waiting with
// their templates, and the groups of its warm inits. The runtime records
// its cgroup root in the store (cgroupRootFile).
func endGroups(store string) error {
	b, err := os.ReadFile(filepath.Join(store, cgroupRootFile))
	if err != nil {
		return nil // no runtime ran here, or one from before the record
	}
	m, err := cgroup.New(cgroup.Config{Root: strings.TrimSpace(string(b))})
	if err != nil {
		return err
	}
	names, err := m.List()
	if err != nil {
		return err
	}
	var errs []error
	for _, n := range names {
		errs = append(errs, m.Remove(n))
	}
	return errors.Join(append(errs, m.RemoveBase())...)
}

// cgroupRootFile names, in the store, the file holding the runtime's
// cgroup root (Config.CgroupRoot).
const cgroupRootFile = "cgroup_root"

func (r *Runtime) sandboxRecordPath(id string) string {
	return filepath.Join(r.store, "meta", "sandboxes", id)
}

func (r *Runtime) writeSandboxRecord(s *Sandbox) error {
	st, err := procstate.StartTime(s.init.Pid)
	if err != nil {
		return fmt.Errorf("reading the init's start time: %w", err)
	}
	b, err := json.Marshal(sandboxRecord{InitPid: s.init.Pid, InitStart: st, Cgroup: s.cg.Name()})
	if err != nil {
		return err
	}
	return os.WriteFile(r.sandboxRecordPath(s.id), b, 0o600)
}

// readopt saves the templates that sandbox id of a crashed server left, then
// ends what is left of the sandbox. Called by New, before the layers (the
// sandbox's live root among them) are reconciled.
func (r *Runtime) readopt(ctx context.Context, id string) {
	rec, pidfd, ok := r.crashedInit(id)
	if !ok {
		return
	}
	defer unix.Close(pidfd)
	cg, err := r.cg.Open(rec.Cgroup)
	if err != nil {
		r.log.Warn("a crashed server's sandbox lost its cgroup; its templates are lost", "sandbox", id, "err", err)
		_ = unix.PidfdSendSignal(pidfd, unix.SIGKILL, nil, 0)
		return
	}
	s := &Sandbox{rt: r, id: id, cg: cg, init: &launch.Init{Pid: rec.InitPid},
		fs:   rootFS{upperFD: -1},
		cmds: cmdGroups{reuseW: make(chan workGroup, 1)},
		// Clear of the group names the crashed server used.
		seq: 1 << 30}
	s.procs = procstate.New((*procHost)(s), r.procConfig())
	cks := s.findTemplates()
	s.endUnadopted()
	if len(cks) > 0 {
		if err := s.endAllButTemplates(); err != nil {
			r.log.Warn("ending the processes of a crashed server's sandbox", "sandbox", id, "err", err)
		}
		s.saveTemplates(ctx, cks)
	}
	// End the sandbox. Template groups first: a frozen template with a
	// SIGKILL pending would hold the pid namespace's end.
	for _, tg := range s.procs.Groups() {
		if err := tg.Delete(); err != nil {
			r.log.Warn("removing a crashed server's template group", "sandbox", id, "err", err)
		}
	}
	_ = unix.PidfdSendSignal(pidfd, unix.SIGKILL, nil, 0)
	// The init is not our child: wait for its exit on the pidfd.
	fds := []unix.PollFd{{Fd: int32(pidfd), Events: unix.POLLIN}}
	if n, err := unix.Poll(fds, 5000); err != nil || n == 0 {
		r.log.Warn("the init of a crashed server's sandbox did not exit", "sandbox", id, "pid", rec.InitPid, "err", err)
	}
}

// crashedInit reads the record of sandbox id of a crashed server and opens
// a pidfd of its init; ok is false if there is nothing to re-adopt (an
// older server's record, or the init is gone, its pid taken by another
// process or not).
func (r *Runtime) crashedInit(id string) (rec sandboxRecord, pidfd int, ok bool) {
	b, err := os.ReadFile(r.sandboxRecordPath(id))
	if err == nil {
		err = json.Unmarshal(b, &rec)
	}
	if err != nil || rec.InitPid <= 0 || rec.Cgroup == "" {
		return rec, -1, false // an older server's record: its inits took everything with them
	}
	pidfd, err = unix.PidfdOpen(rec.InitPid, 0)
	if err != nil {
		return rec, -1, false // the init is gone, and its templates with it
	}
	if st, err := procstate.StartTime(rec.InitPid); err != nil || st != rec.InitStart {
		unix.Close(pidfd)
		return rec, -1, false // another process has the pid now
	}
	return rec, pidfd, true
}

// findTemplates finds the template groups, still frozen, of the
// checkpoints of a crashed server's sandbox s that have no images of their
// templates yet: it adopts them (procstate.State.Adopt) and returns those
// checkpoints.
func (s *Sandbox) findTemplates() []*checkpoint {
	r := s.rt
	r.mu.Lock()
	all := make([]*checkpoint, 0, len(r.ckpts))
	for _, c := range r.ckpts {
		all = append(all, c)
	}
	r.mu.Unlock()
	var cks []*checkpoint
	for _, c := range all {
		if c.SandboxID != s.id || len(c.Procs) == 0 || len(c.TplImages) > 0 || c.TplGroup == "" {
			continue
		}
		tg, err := s.cg.OpenSub(c.TplGroup)
		if err == nil {
			var frozen bool
			if frozen, err = tg.SelfFrozen(); err == nil && !frozen {
				err = errors.New("found thawed")
			}
		}
		if err != nil {
			r.log.Warn("templates lost in a crash", "checkpoint", c.ID, "processes", procstate.Names(c.Procs), "err", err)
			continue
		}
		s.procs.Adopt(c.ID, tg)
		cks = append(cks, c)
	}
	return cks
}

// endUnadopted removes the template groups of a crashed server's sandbox
// that findTemplates did not adopt (a tree's templates, which no record
// names: its images serve), killing their templates: frozen, killed one by
// one, they would hold the pid namespace's end.
func (s *Sandbox) endUnadopted() {
	adopted := map[string]bool{}
	for _, tg := range s.procs.Groups() {
		adopted[tg.Name()] = true
	}
	ents, err := os.ReadDir(s.cg.Dirs()[0])
	if err != nil {
		return
	}
	for _, e := range ents {
		if !e.IsDir() || !procstate.IsTemplateGroup(e.Name()) {
			continue
		}
		g, err := s.cg.OpenSub(e.Name())
		if err != nil || adopted[g.Name()] {
			continue
		}
		if err := g.Delete(); err != nil {
			s.rt.log.Warn("ending a crashed server's unrecorded templates", "sandbox", s.id, "group", e.Name(), "err", err)
		}
	}
}

// saveTemplates saves the templates of cks as CRIU images, oldest
// checkpoint first; a failure loses that checkpoint's templates only.
func (s *Sandbox) saveTemplates(ctx context.Context, cks []*checkpoint) {
	slices.SortFunc(cks, func(a, b *checkpoint) int { return a.Created.Compare(b.Created) })
	for _, c := range cks {
		units, err := s.procs.Image(ctx, &c.Checkpoint, func(u []procstate.Unit) error { return s.rt.recordTplImages(c, u) })
		if err != nil {
			s.rt.log.Warn("templates lost in a crash: saving them as CRIU images failed", "checkpoint", c.ID, "processes", procstate.Names(c.Procs), "err", err)
			continue
		}
		s.rt.log.Info("templates re-adopted after a crash", "checkpoint", c.ID, "sandbox", s.id, "images", len(units))
	}
}

// endAllButTemplates kills every process of a crashed server's sandbox but
// its init and its templates. Its init does the same (dg-init's orphaned),
// unless the sandbox was frozen at the crash: it is thawed here.
func (s *Sandbox) endAllButTemplates() error {
	if frozen, err := s.cg.SelfFrozen(); err == nil && frozen {
		if err := s.cg.Thaw(); err != nil {
			return err
		}
	}
	// Copies forked ahead (ahead.go) are frozen: on a legacy (v1) host a
	// frozen process does not act on SIGKILL. Their groups go first (a
	// deletion thaws what it kills).
	if ents, err := os.ReadDir(s.cg.Dirs()[0]); err == nil {
		for _, e := range ents {
			if !e.IsDir() || !procstate.IsAheadGroup(e.Name()) {
				continue
			}
			if g, err := s.cg.OpenSub(e.Name()); err == nil {
				if err := g.Delete(); err != nil {
					s.rt.log.Warn("ending a crashed server's template copies forked ahead", "sandbox", s.id, "group", e.Name(), "err", err)
				}
			}
		}
	}
	keep := map[int]bool{s.init.Pid: true}
	for _, tg := range s.procs.Groups() {
		pids, err := tg.Pids()
		if err != nil {
			return err
		}
		for _, p := range pids {
			keep[p] = true
		}
	}
	deadline := time.Now().Add(5 * time.Second)
	for {
		pids, err := s.cg.Pids()
		if err != nil {
			return err
		}
		left := 0
		for _, p := range pids {
			if !keep[p] {
				_ = unix.Kill(p, unix.SIGKILL)
				left++
			}
		}
		if left == 0 {
			return nil
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("%d processes did not end", left)
		}
		time.Sleep(time.Millisecond)
	}
}
