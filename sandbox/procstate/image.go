package procstate

import (
	"cmp"
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

// Image saves each template of c as a CRIU image and has record record the
// images with c; it returns them. The runtime has one checkpoint's images
// made at a time.
func (ps *State) Image(ctx context.Context, c *Checkpoint, record func([]Unit) error) ([]Unit, error) {
	ps.run.Lock()
	defer ps.run.Unlock()
	return ps.imageTemplatesLocked(ctx, c, record)
}

// imageTemplatesLocked is Image with run held. On error,
// what it saved is removed.
// +checklocks:ps.run
func (ps *State) imageTemplatesLocked(ctx context.Context, c *Checkpoint, record func([]Unit) error) ([]Unit, error) {
	if err := ps.Check(c); err != nil {
		return nil, err
	}
	ps.h.Settled() // criu joins the namespace
	sw, err := ps.h.CRIU()
	if err != nil {
		return nil, err
	}
	start := time.Now()
	ps.mu.Lock()
	tg := ps.tpls[c.ID]
	ps.mu.Unlock()
	if tg == nil {
		return nil, fmt.Errorf("%w: the templates of checkpoint %s were released", ErrProcesses, c.ID)
	}
	copies, err := ps.stoppedCopies(tg, c.Procs)
	var units []Unit
	if err != nil {
		err = fmt.Errorf("%w: copying the frozen copies kept by checkpoint %s to save them as CRIU images: %w", ErrProcesses, c.ID, err)
	} else {
		// Never leave a copy half-dumped.
		units, err = ps.imageCopies(context.WithoutCancel(ctx), sw, c, copies)
	}
	if err == nil {
		err = record(units)
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
	ps.h.Log().Debug("templates saved as CRIU images", "sandbox", ps.h.ID(), "checkpoint", c.ID, "n", len(units), "took", time.Since(start))
	return units, nil
}

// imageCopies saves each of copies (of the templates of c) as a CRIU
// image. On error it returns the images saved before, the failed one's
// directory removed.
func (ps *State) imageCopies(ctx context.Context, sw *criu.Swrk, c *Checkpoint, copies []stopped) ([]Unit, error) {
	var units []Unit
	for i, t := range c.Procs {
		u, err := ps.imageCopy(ctx, sw, c, i, t, copies[i])
		if err != nil {
			_ = os.RemoveAll(u.Dir) // what criu wrote of it
			return units, &ImageError{Index: i, Err: fmt.Errorf("%w: saving the frozen copy of %s kept by checkpoint %s as a CRIU image: %w", ErrProcesses, t.name(), c.ID, err)}
		}
		units = append(units, u)
	}
	return units, nil
}

// stopped is a copy of a template, stopped before it ran, in a group of
// its own.
type stopped struct {
	hostPid, nsPid int
	cg             *cgroup.Cgroup
}

// imageCopy dumps copy cp of template n of c (criu kills it).
func (ps *State) imageCopy(ctx context.Context, sw *criu.Swrk, c *Checkpoint, n int, t Template, cp stopped) (Unit, error) {
	u := Unit{Dir: filepath.Join(ps.cfg.CRIUDir(c.ID), "t"+strconv.Itoa(n)), Why: "saved from its template", Session: t.Session, Attached: t.Attached, Stopped: true,
		Procs: []UnitProc{{NSPid: cp.nsPid, Comm: t.Comm}}}
	if t.Session != "" {
		for fd := range u.Pipes {
			link, err := os.Readlink(fmt.Sprintf("/proc/%d/fd/%d", cp.hostPid, fd))
			if err != nil || !strings.HasPrefix(link, "pipe:[") {
				return u, fmt.Errorf("the copy's fd %d is %q, not a pipe", fd, link)
			}
			u.Pipes[fd] = link
		}
	}
	mounts, err := mountIDs(ps.h.InitPid())
	if err != nil {
		return u, err
	}
	r, err := detachedFiles(cp.hostPid, mounts, map[string]bool{})
	if err != nil {
		return u, err
	}
	u.Ext, u.Local = r.ext, r.local(t.NSPid, t.Comm)
	ext := make([]string, len(u.Ext))
	for i, e := range u.Ext {
		ext[i] = e.Key
	}
	if err := os.MkdirAll(u.Dir, 0o700); err != nil {
		return u, err
	}
	if err := sw.DumpTree(ctx, criu.TreeDumpOpts{Pid: cp.hostPid, NSPid: ps.h.InitPid(), ImagesDir: u.Dir, ExternalFiles: ext}); err != nil {
		return u, err
	}
	// The copy's listening sockets were left unbound (the live process
	// holds their addresses): its image has them listen.
	if err := criu.SetListening(u.Dir, imageListeners(t)); err != nil {
		return u, fmt.Errorf("recording the listening sockets in the image: %w", err)
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
func (ps *State) stoppedCopies(tg *cgroup.Cgroup, tpls []Template) (out []stopped, err error) {
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
		ps.forkMu.Lock() // no root swap while it is cloned (ahead.go)
		cp, nsPid, err := copyTemplate(seized[i], t)
		ps.forkMu.Unlock()
		if err != nil {
			return out, fmt.Errorf("copying %s: %w", t.name(), err)
		}
		reapIfOurs(cp.Pid)
		cg, err := ps.h.Cgroup().Sub(ps.h.GroupName("i"))
		if err != nil {
			cp.Kill()
			return out, fmt.Errorf("creating cgroup: %w", err)
		}
		out = append(out, stopped{hostPid: cp.Pid, nsPid: nsPid, cg: cg})
		stdio, _, err := fixUp(cp, t, true)
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
		cp.StopOnDetach()
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

// ImageError is a failure to save one template of a checkpoint, Index in
// its Procs; the checkpoint's templates are saved together, so none is.
type ImageError struct {
	Index int
	Err   error
}

func (e *ImageError) Error() string { return e.Err.Error() }
func (e *ImageError) Unwrap() error { return e.Err }

// imageListeners are the listening sockets a copy of t has unbound when it
// is made for an image (fixUp), as the image is to record them.
func imageListeners(t Template) []criu.Listener {
	var ls []criu.Listener
	for _, p := range t.Private {
		switch p.Kind {
		case "tcplisten":
			ip, port, ok := p.ListenAddr()
			if !ok || len(p.Opts) < len(listenOpts) {
				continue // fixUp failed on it already
			}
			l := criu.Listener{FD: p.FD, Backlog: p.Backlog, IP: ip, Port: port,
				ReuseAddr: p.Opts[0] != 0, ReusePort: p.Opts[1] != 0, KeepAlive: p.Opts[3] != 0, FreeBind: p.Opts[5] != 0}
			if len(p.Opts) > len(listenOpts) {
				l.V6Only = new(p.Opts[len(listenOpts)] != 0)
			}
			ls = append(ls, l)
		case "unixlisten":
			ls = append(ls, criu.Listener{FD: p.FD, Backlog: cmp.Or(p.Backlog, unix.SOMAXCONN), Path: p.Path, Mode: p.Mode, UID: p.UID, GID: p.GID})
		}
	}
	return ls
}
