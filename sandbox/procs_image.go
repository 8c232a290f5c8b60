package sandbox

import (
	"context"
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
	"github.com/deltagym/deltagym/sandbox/ptfork"
)

// CRIU images made from templates (see docs/ARCHITECTURE.md).
//
// A template can only be copied in its own sandbox's pid namespace. For
// everything else — a fork into new sandboxes, a restore in another
// sandbox, a restore after the template was lost, a checkpoint that must
// outlive its sandbox or the server — the runtime turns each template into
// a CRIU image, once per checkpoint, and keeps it with the checkpoint
// (store/criu/<checkpoint>/t<n>):
//
//  1. a copy is forked from the template, as for a restore, and fixed up
//     in the sandbox's live root (cwd, reopened files, a session's fresh
//     pipes); it is detached with SIGSTOP pending, so it stops before it
//     runs any code of its own, in a group of its own beside the command
//     group (a checkpoint taken meanwhile does not see it);
//  2. criu dumps the stopped copy — the files it maps from the root the
//     process was first started in are external (extFile) — and kills it.
//
// The image records a stopped task: criu restores it stopped and the
// restore sends SIGCONT. The copy has a pid of its own, which the image
// keeps. Files the copy reopened are checked by criu against the restored
// root's (size and mode): one changed in the live state since the
// checkpoint, still open, fails the making of the image.
//
// When: on demand, the first time a checkpoint's processes are needed away
// from their templates (Create from it, Restore in another sandbox); in the
// background right after a checkpoint taken with CheckpointOptions.Durable;
// and when the sandbox holding the templates is destroyed (closed, reaped,
// or at a clean shutdown of the runtime), so that its checkpoints keep
// their processes; and by the next server after a crash (readopt.go). A
// template lost before any of these (an agent's kill -9 -1, the sandbox's
// init killed) takes its process with it, unless the checkpoint was taken
// durable.

// tplImages returns the images made from c's templates, if any.
func (r *Runtime) tplImages(c *checkpoint) []criuUnit {
	r.mu.Lock()
	defer r.mu.Unlock()
	return c.TplImages
}

// imagesForTemplates returns CRIU images of c's templates, making them if
// need be; the sandbox holding the templates must be alive then.
func (r *Runtime) imagesForTemplates(ctx context.Context, c *checkpoint) ([]criuUnit, error) {
	if len(c.Procs) == 0 {
		return nil, nil
	}
	if imgs := r.tplImages(c); len(imgs) > 0 {
		return imgs, nil
	}
	r.pimg.tplMu.Lock()
	defer r.pimg.tplMu.Unlock()
	if imgs := r.tplImages(c); len(imgs) > 0 {
		return imgs, nil
	}
	r.mu.Lock()
	owner := r.sandboxes[c.SandboxID]
	r.mu.Unlock()
	if owner == nil {
		return nil, fmt.Errorf("%w: checkpoint %s holds live processes (%s) as frozen copies in sandbox %s, which ended without saving them (its init was killed, a template was found thawed after a crash, or CRIU was missing then); its files can still be restored or forked, without those processes; take checkpoints durable to keep processes whatever happens to the sandbox",
			ErrProcesses, c.ID, procNames(c.Procs), c.SandboxID)
	}
	return owner.imageTemplates(ctx, c)
}

// imageTemplates saves each template of c as a CRIU image and records the
// images with c. Called with r.pimg.tplMu held.
func (s *Sandbox) imageTemplates(ctx context.Context, c *checkpoint) ([]criuUnit, error) {
	s.procs.run.Lock()
	defer s.procs.run.Unlock()
	return s.imageTemplatesLocked(ctx, c)
}

// imageTemplatesLocked is imageTemplates with procs.run held. On error,
// what it saved is removed.
// +checklocks:s.procs.run
func (s *Sandbox) imageTemplatesLocked(ctx context.Context, c *checkpoint) ([]criuUnit, error) {
	if err := s.checkTemplates(c); err != nil {
		return nil, err
	}
	s.init.Settled() // criu joins the namespace
	sw, err := s.rt.criuSwrk()
	if err != nil {
		return nil, err
	}
	start := time.Now()
	s.procs.mu.Lock()
	tg := s.procs.tpls[c.ID]
	s.procs.mu.Unlock()
	if tg == nil {
		return nil, fmt.Errorf("%w: the templates of checkpoint %s were released", ErrProcesses, c.ID)
	}
	copies, err := s.stoppedCopies(tg, c.Procs)
	var units []criuUnit
	if err != nil {
		err = fmt.Errorf("%w: copying the frozen copies kept by checkpoint %s to save them as CRIU images: %w", ErrProcesses, c.ID, err)
	} else {
		// Never leave a copy half-dumped.
		units, err = s.imageCopies(context.WithoutCancel(ctx), sw, c, copies)
	}
	if err == nil {
		err = s.rt.recordTplImages(c, units)
	}
	for _, cp := range copies {
		_ = cp.cg.Delete() // kills the copy if it is still there
	}
	if err != nil {
		for _, u := range units {
			_ = os.RemoveAll(u.Dir)
		}
		return units, err
	}
	s.rt.log.Debug("templates saved as CRIU images", "sandbox", s.id, "checkpoint", c.ID, "n", len(units), "took", time.Since(start))
	return units, nil
}

// imageCopies saves each of copies (of the templates of c) as a CRIU
// image. On error it returns the images saved before, the failed one's
// directory removed.
func (s *Sandbox) imageCopies(ctx context.Context, sw *criu.Swrk, c *checkpoint, copies []stopped) ([]criuUnit, error) {
	var units []criuUnit
	for i, t := range c.Procs {
		u, err := s.imageCopy(ctx, sw, c, i, t, copies[i])
		if err != nil {
			_ = os.RemoveAll(u.Dir) // what criu wrote of it
			return units, fmt.Errorf("%w: saving the frozen copy of %s kept by checkpoint %s as a CRIU image: %w", ErrProcesses, t.name(), c.ID, err)
		}
		units = append(units, u)
	}
	return units, nil
}

// recordTplImages records units as the images of c's templates, unless c
// was released meanwhile.
func (r *Runtime) recordTplImages(c *checkpoint, units []criuUnit) error {
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.ckpts[c.ID] != c {
		return fmt.Errorf("%w: checkpoint %s was released", ErrNotFound, c.ID)
	}
	c.TplImages = units
	if err := r.writeCheckpoint(c); err != nil {
		c.TplImages = nil
		return err
	}
	for _, u := range units {
		r.pimg.bytes.Add(u.Bytes)
	}
	return nil
}

// stopped is a copy of a template, stopped before it ran, in a group of
// its own.
type stopped struct {
	hostPid, nsPid int
	cg             *cgroup.Cgroup
}

// imageCopy dumps copy cp of template n of c (criu kills it).
func (s *Sandbox) imageCopy(ctx context.Context, sw *criu.Swrk, c *checkpoint, n int, t procTemplate, cp stopped) (criuUnit, error) {
	u := criuUnit{Dir: filepath.Join(s.rt.criuDir(c.ID), "t"+strconv.Itoa(n)), Why: "saved from its template", Session: t.Session, Stopped: true,
		Procs: []criuProc{{NSPid: cp.nsPid, Comm: t.Comm}}}
	if t.Session != "" {
		for fd := range u.Pipes {
			link, err := os.Readlink(fmt.Sprintf("/proc/%d/fd/%d", cp.hostPid, fd))
			if err != nil || !strings.HasPrefix(link, "pipe:[") {
				return u, fmt.Errorf("the copy's fd %d is %q, not a pipe", fd, link)
			}
			u.Pipes[fd] = link
		}
	}
	mounts, err := mountIDs(s.init.Pid)
	if err != nil {
		return u, err
	}
	if u.Ext, err = detachedFiles(cp.hostPid, mounts, map[string]bool{}); err != nil {
		return u, err
	}
	ext := make([]string, len(u.Ext))
	for i, e := range u.Ext {
		ext[i] = e.Key
	}
	if err := os.MkdirAll(u.Dir, 0o700); err != nil {
		return u, err
	}
	if err := sw.DumpTree(ctx, criu.TreeDumpOpts{Pid: cp.hostPid, NSPid: s.init.Pid, ImagesDir: u.Dir, ExternalFiles: ext}); err != nil {
		return u, err
	}
	u.Bytes = dirBytes(u.Dir)
	return u, nil
}

// stoppedCopies forks a copy of each template tpls (of group tg), fixes it
// up in the live root, moves it into a group of its own beside the command
// group (a checkpoint taken meanwhile must not see it) and leaves it
// stopped (SIGSTOP) before it runs. Every template is seized before the
// group is thawed, as for a restore. Copies made are returned even on
// error, for the caller to end.
func (s *Sandbox) stoppedCopies(tg *cgroup.Cgroup, tpls []procTemplate) (out []stopped, err error) {
	tr := ptfork.NewSession()
	defer func() {
		if cerr := tr.Close(); cerr != nil {
			err = errors.Join(err, cerr)
		}
	}()
	seized := make([]*ptfork.Proc, len(tpls))
	for i, t := range tpls {
		if seized[i], err = tr.Seize(t.HostPid); err != nil {
			return nil, fmt.Errorf("%s: %w", t.name(), err)
		}
	}
	if err := tg.SetFrozen(false); err != nil {
		return nil, err
	}
	defer func() {
		// Frozen again before the templates are detached (tr.Close).
		if ferr := tg.SetFrozen(true); ferr != nil {
			err = errors.Join(err, ferr)
		}
	}()
	for i, t := range tpls {
		if err := seized[i].Wait(); err != nil {
			return out, fmt.Errorf("stopping the template of %s: %w", t.name(), err)
		}
		s.procs.forkMu.Lock() // no root swap while it is cloned (ahead.go)
		cp, nsPid, err := seized[i].Fork()
		s.procs.forkMu.Unlock()
		if err != nil {
			return out, fmt.Errorf("copying %s: %w", t.name(), err)
		}
		reapIfOurs(cp.Pid)
		cg, err := s.cg.Sub(s.groupName("i"))
		if err != nil {
			cp.Kill()
			return out, fmt.Errorf("creating cgroup: %w", err)
		}
		out = append(out, stopped{hostPid: cp.Pid, nsPid: nsPid, cg: cg})
		stdio, err := fixUp(cp, t)
		// The session's pipes only have to exist for the dump; criu
		// records them by inode, and a restore hands in fresh ones.
		closeFiles(stdio[:])
		if err == nil {
			err = cg.Move(cp.Pid)
		}
		if err != nil {
			cp.Kill()
			return out, fmt.Errorf("fixing up the copy of %s: %w", t.name(), err)
		}
		cp.Signal = unix.SIGSTOP
		if err := cp.Detach(); err != nil {
			cp.Kill()
			return out, err
		}
	}
	// The stops are delivered once the copies are scheduled.
	deadline := time.Now().Add(5 * time.Second)
	for _, c := range out {
		for {
			st, err := os.ReadFile("/proc/" + strconv.Itoa(c.hostPid) + "/stat")
			if err != nil {
				return out, fmt.Errorf("a copy ended: %w", err)
			}
			if i := strings.LastIndexByte(string(st), ')'); i > 0 && len(st) > i+2 && st[i+2] == 'T' {
				break
			}
			if time.Now().After(deadline) {
				return out, fmt.Errorf("a copy did not stop")
			}
			time.Sleep(100 * time.Microsecond)
		}
	}
	return out, nil
}

// startImaging counts a background save of images (Runtime.imaging) unless
// the runtime is closing (its sandboxes save their templates as they end).
// Under mu, so that no Add races Close's Wait.
func (r *Runtime) startImaging() bool {
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.closed {
		return false
	}
	r.pimg.making.Add(1)
	return true
}

// ckptLive reports whether c is still a checkpoint of the runtime.
func (r *Runtime) ckptLive(c *checkpoint) bool {
	r.mu.Lock()
	defer r.mu.Unlock()
	return r.ckpts[c.ID] == c
}

// imageAllTemplates saves the templates of every checkpoint the sandbox
// holds as CRIU images, before it is destroyed (closed, reaped, or ended by
// a clean shutdown), so that those checkpoints keep their processes. Called
// with op held.
func (s *Sandbox) imageAllTemplates(ctx context.Context) {
	s.procs.mu.Lock()
	ids := make([]string, 0, len(s.procs.tpls))
	for id := range s.procs.tpls {
		ids = append(ids, id)
	}
	s.procs.mu.Unlock()
	for _, id := range ids {
		c, err := s.rt.lookup(id)
		if err != nil {
			continue
		}
		if _, err := s.rt.imagesForTemplates(ctx, c); err != nil {
			s.rt.log.Warn("saving a checkpoint's processes before its sandbox ends", "sandbox", s.id, "checkpoint", id, "err", err)
		}
	}
}
