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
// and when the sandbox holding the templates is destroyed (not when the
// runtime shuts down), so that its checkpoints keep their processes.

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
	r.tplImageMu.Lock()
	defer r.tplImageMu.Unlock()
	if imgs := r.tplImages(c); len(imgs) > 0 {
		return imgs, nil
	}
	r.mu.Lock()
	owner := r.sandboxes[c.SandboxID]
	r.mu.Unlock()
	if owner == nil {
		return nil, fmt.Errorf("%w: checkpoint %s holds live processes (%s) as frozen copies in sandbox %s, which is gone; only a checkpoint taken durable keeps them past its sandbox",
			ErrProcesses, c.ID, procNames(c.Procs), c.SandboxID)
	}
	return owner.imageTemplates(ctx, c)
}

// imageTemplates saves each template of c as a CRIU image and records the
// images with c. Called with r.tplImageMu held.
func (s *Sandbox) imageTemplates(ctx context.Context, c *checkpoint) (units []criuUnit, err error) {
	s.tplRun.Lock()
	defer s.tplRun.Unlock()
	if err := s.checkTemplates(c); err != nil {
		return nil, err
	}
	sw, err := s.rt.criuSwrk()
	if err != nil {
		return nil, err
	}
	defer func() {
		if err != nil {
			for _, u := range units {
				_ = os.RemoveAll(u.Dir)
			}
		}
	}()
	start := time.Now()
	ctx = context.WithoutCancel(ctx) // never leave a copy half-dumped
	for i, t := range c.Procs {
		u, err := s.imageTemplate(ctx, sw, c, i, t)
		if err != nil {
			return units, fmt.Errorf("%w: saving the frozen copy of %s kept by checkpoint %s as a CRIU image: %w", ErrProcesses, t.name(), c.ID, err)
		}
		units = append(units, u)
	}
	s.rt.mu.Lock()
	defer s.rt.mu.Unlock()
	if s.rt.ckpts[c.ID] != c {
		return units, fmt.Errorf("%w: checkpoint %s was released", ErrNotFound, c.ID)
	}
	c.TplImages = units
	if err := s.rt.writeCheckpoint(c); err != nil {
		c.TplImages = nil
		return units, err
	}
	s.rt.log.Debug("templates saved as CRIU images", "sandbox", s.id, "checkpoint", c.ID, "n", len(units), "took", time.Since(start))
	return units, nil
}

// imageTemplate makes the image of template n of c.
func (s *Sandbox) imageTemplate(ctx context.Context, sw *criu.Swrk, c *checkpoint, n int, t procTemplate) (criuUnit, error) {
	u := criuUnit{Dir: filepath.Join(s.rt.criuDir(c.ID), "t"+strconv.Itoa(n)), Why: "saved from its template", Session: t.Session, Stopped: true}
	s.tplMu.Lock()
	tg := s.tpls[c.ID]
	s.tplMu.Unlock()
	if tg == nil {
		return u, fmt.Errorf("the templates were released")
	}
	// Beside the command group, not in it: a checkpoint taken meanwhile
	// must not see the copy.
	s.mu.Lock()
	s.seq++
	name := "i" + strconv.Itoa(s.seq)
	s.mu.Unlock()
	cg, err := s.cg.Sub(name)
	if err != nil {
		return u, fmt.Errorf("creating cgroup: %w", err)
	}
	defer func() { _ = cg.Delete() }() // kills the copy if it is still there
	copyPid, nsPid, err := s.stoppedCopy(tg, cg, t)
	if err != nil {
		return u, err
	}
	u.Procs = []criuProc{{NSPid: nsPid, Comm: t.Comm}}
	if t.Session != "" {
		for fd := range u.Pipes {
			link, err := os.Readlink(fmt.Sprintf("/proc/%d/fd/%d", copyPid, fd))
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
	if u.Ext, err = detachedFiles(copyPid, mounts, map[string]bool{}); err != nil {
		return u, err
	}
	ext := make([]string, len(u.Ext))
	for i, e := range u.Ext {
		ext[i] = e.Key
	}
	if err := os.MkdirAll(u.Dir, 0o700); err != nil {
		return u, err
	}
	if err := sw.DumpTree(ctx, criu.TreeDumpOpts{Pid: copyPid, NSPid: s.init.Pid, ImagesDir: u.Dir, ExternalFiles: ext}); err != nil {
		return u, err
	}
	return u, nil
}

// stoppedCopy forks a copy of template t (of group tg), fixes it up in the
// live root, moves it into cg and leaves it stopped (SIGSTOP) before it
// runs. It returns the copy's host pid and its pid in the sandbox.
func (s *Sandbox) stoppedCopy(tg, cg *cgroup.Cgroup, t procTemplate) (hostPid, nsPid int, err error) {
	tr := ptfork.NewSession()
	defer func() {
		if cerr := tr.Close(); cerr != nil {
			err = errors.Join(err, cerr)
		}
	}()
	tpl, err := tr.Seize(t.HostPid)
	if err != nil {
		return 0, 0, err
	}
	if err := tg.SetFrozen(false); err != nil {
		return 0, 0, err
	}
	defer func() {
		// Frozen again before the template is detached (tr.Close).
		if ferr := tg.SetFrozen(true); ferr != nil {
			err = errors.Join(err, ferr)
		}
	}()
	if err := tpl.Wait(); err != nil {
		return 0, 0, fmt.Errorf("stopping the template: %w", err)
	}
	cp, nsPid, err := tpl.Fork()
	if err != nil {
		return 0, 0, fmt.Errorf("copying: %w", err)
	}
	reapIfOurs(cp.Pid)
	stdio, err := fixUp(cp, t)
	// The session's pipes only have to exist for the dump; criu records
	// them by inode, and a restore hands in fresh ones.
	closeFiles(stdio[:])
	if err == nil {
		err = cg.Move(cp.Pid)
	}
	if err != nil {
		cp.Kill()
		return 0, 0, fmt.Errorf("fixing up a copy: %w", err)
	}
	cp.Signal = unix.SIGSTOP
	if err := cp.Detach(); err != nil {
		cp.Kill()
		return 0, 0, err
	}
	// The stop is delivered once the copy is scheduled.
	deadline := time.Now().Add(5 * time.Second)
	for {
		st, err := os.ReadFile("/proc/" + strconv.Itoa(cp.Pid) + "/stat")
		if err != nil {
			return 0, 0, fmt.Errorf("the copy ended: %w", err)
		}
		if i := strings.LastIndexByte(string(st), ')'); i > 0 && len(st) > i+2 && st[i+2] == 'T' {
			return cp.Pid, nsPid, nil
		}
		if time.Now().After(deadline) {
			return 0, 0, fmt.Errorf("the copy did not stop")
		}
		time.Sleep(100 * time.Microsecond)
	}
}

// ckptLive reports whether c is still a checkpoint of the runtime.
func (r *Runtime) ckptLive(c *checkpoint) bool {
	r.mu.Lock()
	defer r.mu.Unlock()
	return r.ckpts[c.ID] == c
}

// imageAllTemplates saves the templates of every checkpoint the sandbox
// holds as CRIU images, before it is destroyed, so that those checkpoints
// keep their processes (not when the runtime shuts down: templates of
// checkpoints not taken durable do not outlive the server). Called with op
// held.
func (s *Sandbox) imageAllTemplates(ctx context.Context) {
	s.rt.mu.Lock()
	closing := s.rt.closed
	s.rt.mu.Unlock()
	if closing {
		return
	}
	s.tplMu.Lock()
	ids := make([]string, 0, len(s.tpls))
	for id := range s.tpls {
		ids = append(ids, id)
	}
	s.tplMu.Unlock()
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
