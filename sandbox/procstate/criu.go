package procstate

import (
	"bytes"
	"cmp"
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"time"

	"golang.org/x/sys/unix"

	"github.com/deltagym/deltagym/sandbox/criu"
	"github.com/deltagym/deltagym/sandbox/initproc"
)

// Process checkpoints, general path (CRIU; see docs/ARCHITECTURE.md).
//
// A process tree the fast path cannot copy — a command with children, a
// program of more than ptfork.MaxThreads threads, or a process with an
// open deleted file, a shared
// writable file mapping or a root of its own — is saved as a CRIU image
// instead (criu.DumpTree: pid namespace external, user and mount namespaces
// joined, the tree left stopped). ProcessesCRIU takes every tree this way.
// The images live with the checkpoint (store/criu/<checkpoint>/<n>), so
// such a checkpoint brings its processes back in any sandbox of its image —
// the one that made it, a fork, and a sandbox after a restart — and keeps
// them until it is released.
//
// Capture, with the fast path's processes held in ptrace-stop: each CRIU
// tree is released from ptrace, dumped by criu, which leaves it stopped
// (SIGSTOP); the upper is copied while everything is stopped, so files and
// processes are of one instant; then the trees get SIGCONT. A tree sees
// that stop and continue as a job-control stop.
//
// Restore: after the root swap, each tree is restored by criu into the
// sandbox's namespaces and a command group of its own, with the pids it
// had (so they must be free: the restore waits for the killed processes to
// be reaped). Its root is a child of the server, which reaps it. Trees are
// restored before template copies are forked, whose new pids could take
// theirs.
//
// A session's shell is the root of its tree: its pipes to the server are
// recorded by inode, by their part (stdin, stdout, stderr, wherever the tree
// holds them), and replaced at restore by fresh ones (inherit_fd).
//
// A process brought back from a template maps files of an earlier root, a
// mount the swaps have detached, which criu cannot find: such files are
// external to the dump and handed in at restore (ExtFile).
//
// Limits: a tree's stdio must be files of the sandbox or the session's pipes
// (background commands get the sandbox's own /dev/null); a dump and a
// restore cost many times a template's (BenchmarkRollbackVsCRIU,
// docs/PERFORMANCE.md).

func (u Unit) name() string {
	if len(u.Procs) == 0 {
		return "a process tree"
	}
	return fmt.Sprintf("pid %d (%s)", u.Procs[0].NSPid, u.Procs[0].Comm)
}

// dumpTree saves the tree rooted at host pid root as unit n of checkpoint c
// and leaves it stopped. procs are its processes (host pids), root first;
// mounts are the sandbox's mounts.
func (ps *State) dumpTree(ctx context.Context, c *Checkpoint, n int, root int, procs []procInfo, why string, mounts sandboxMounts) (Unit, error) {
	u := Unit{Dir: filepath.Join(ps.cfg.CRIUDir(c.ID), strconv.Itoa(n)), Why: why, Session: procs[0].tpl.Session,
		Attached: procs[0].tpl.Attached}
	seen := map[string]bool{}
	for _, p := range procs {
		u.Procs = append(u.Procs, UnitProc{NSPid: p.tpl.NSPid, Comm: p.tpl.Comm})
		r, err := detachedFiles(p.tpl.HostPid, mounts, seen)
		if err != nil {
			return u, fmt.Errorf("pid %d (%s): %w", p.tpl.NSPid, p.tpl.Comm, err)
		}
		u.Ext = append(u.Ext, r.ext...)
		u.Local = cmp.Or(u.Local, r.local(p.tpl.NSPid, p.tpl.Comm))
	}
	ext := make([]string, len(u.Ext))
	for i, e := range u.Ext {
		ext[i] = e.Key
	}
	if u.Session != "" {
		keys := procs[0].tpl.sessionPipes
		for fd := range u.Pipes {
			link, err := os.Readlink(fmt.Sprintf("/proc/%d/fd/%d", root, fd))
			if err != nil || !strings.HasPrefix(link, "pipe:[") || keys[0] != "" && !slices.Contains(keys[:], link) {
				return u, fmt.Errorf("%w: session %q: its shell's fd %d is %q, not the server's pipe", ErrProcesses, u.Session, fd, link)
			}
			u.Pipes[fd] = link
		}
		if keys[0] != "" {
			// By the pipe's part, not by the fd that holds it now: a shell
			// running an interactive command holds its stderr pipe on
			// another fd (saved from the command's 2>&1), and its fd 2 is
			// the stdout pipe; the restore replaces each pipe wherever it
			// is held.
			u.Pipes = keys
		}
	}
	sw, err := ps.h.CRIU()
	if err != nil {
		return u, err
	}
	if err := os.MkdirAll(u.Dir, 0o700); err != nil {
		return u, err
	}
	start := time.Now()
	err = sw.DumpTree(ctx, criu.TreeDumpOpts{Pid: root, NSPid: ps.h.InitPid(), ImagesDir: u.Dir, LeaveStopped: true, ExternalFiles: ext})
	if err != nil {
		return u, fmt.Errorf("%w: saving %s (%s) with CRIU: %w; checkpoint files only (process mode filesystem) or end it first",
			ErrProcesses, u.name(), why, err)
	}
	u.Bytes = dirBytes(u.Dir)
	ps.h.Log().Debug("process tree dumped", "sandbox", ps.h.ID(), "checkpoint", c.ID, "tree", u.name(), "why", why, "took", time.Since(start))
	return u, nil
}

// restoreTimeout bounds one tree's restore by criu.
const restoreTimeout = 2 * time.Minute

// RestoreTrees brings back the CRIU trees units of c in the sandbox, after
// its root swap. Called with the sandbox's state changes serialised.
func (ps *State) RestoreTrees(ctx context.Context, c *Checkpoint, units []Unit) error {
	if len(units) == 0 {
		return nil
	}
	run := ps.cfg.RunDir
	var sw *criu.Swrk
	swrk := func() (*criu.Swrk, error) {
		if sw != nil {
			return sw, nil
		}
		// criu joins the namespace: until the last swap's old root is
		// detached, it sits on top of the new one, where criu would look
		// for files.
		ps.h.Settled()
		s, err := ps.h.CRIU()
		if err != nil {
			return nil, err
		}
		if err := os.MkdirAll(run, 0o700); err != nil {
			return nil, err
		}
		sw = s
		return sw, nil
	}
	for _, u := range units {
		for attempt := 0; ; attempt++ {
			tt := ps.treeOf(c, u)
			if err := ps.waitPidsFree(u, tt != nil); err != nil {
				return err
			}
			if tt != nil && attempt == 0 {
				err := ps.copyTree(tt)
				if err == nil {
					break
				}
				ps.h.Log().Warn("a process tree could not be copied from its templates; its images serve", "sandbox", ps.h.ID(), "checkpoint", c.ID, "tree", u.name(), "err", err)
				if err := ps.waitPidsFree(u, true); err != nil {
					return err
				}
			}
			sw, err := swrk()
			if err != nil {
				return err
			}
			err = ps.restoreTree(ctx, sw, run, c, u)
			if err == nil {
				break
			}
			// A failed restore leaves nothing of the tree (criu's, or the guard's, kill). One
			// that lost a race for a pid, or whose guard found a copy stopped by another cause,
			// is tried again once the pids are free, after a pause that doubles each time: a
			// pid whose process the kernel is still releasing reads as free in /proc before a
			// fork may take it again.
			if attempt >= restoreAttempts-1 || !transientRestore(err) {
				return err
			}
			ps.h.Log().Warn("restoring a process tree again", "sandbox", ps.h.ID(), "checkpoint", c.ID, "tree", u.name(), "err", err)
			select {
			case <-ctx.Done():
				return err
			case <-time.After(restorePause << attempt):
			}
		}
	}
	return nil
}

// A tree's restore that fails for a cause that passes (transientRestore) is tried
// restoreAttempts times in all, restorePause, then twice that, and so on, apart.
const (
	restoreAttempts = 4
	restorePause    = 20 * time.Millisecond
)

// transientRestore says a tree's restore failed for a cause that passes: criu found a pid it
// needed taken at its fork (criu's own words), or the guard met an unexpected ptrace stop.
func transientRestore(err error) bool {
	msg := err.Error()
	return strings.Contains(msg, "Can't fork for") && strings.Contains(msg, "File exists") ||
		strings.Contains(msg, "unexpected ptrace stop")
}

// restoreTree has criu restore the process tree of unit u of checkpoint c
// into the sandbox, in a cgroup of its own; a session's shell becomes its
// session's again, with fresh pipes to the server.
func (ps *State) restoreTree(ctx context.Context, sw *criu.Swrk, run string, c *Checkpoint, u Unit) (err error) {
	tmp, err := linkImages(run, c, u)
	if err != nil {
		return err
	}
	defer os.RemoveAll(tmp)
	// A session's shell gets a group of its own, as a started one does (a
	// timeout kills what it runs), and fresh pipes to the server.
	prefix := "c"
	if u.Session != "" {
		prefix = "s"
	}
	cg, err := ps.h.Subgroup(prefix)
	if err != nil {
		return fmt.Errorf("creating cgroup: %w", err)
	}
	inherit, err := ps.openExternal(u)
	if err != nil {
		_ = cg.Delete()
		return err
	}
	var ours, theirs [3]*os.File // the server's ends; the shell's
	defer func() {
		for _, f := range inherit {
			f.File.Close()
		}
		closeFiles(theirs[:])
		if err != nil {
			closeFiles(ours[:])
			_ = cg.Delete()
		}
	}()
	if u.Session != "" {
		if ours, theirs, err = ps.shellPipes(); err != nil {
			return err
		}
		for i := range theirs {
			inherit = append(inherit, criu.InheritFile{Key: u.Pipes[i], File: theirs[i]})
		}
	}
	start := time.Now()
	// A restore that hangs (criu waiting on a task that will never report)
	// must not hold the sandbox forever.
	ctx, cancel := context.WithTimeout(ctx, restoreTimeout)
	defer cancel()
	pid, err := sw.RestoreTree(ctx, criu.TreeRestoreOpts{ImagesDir: tmp, NSPid: ps.h.InitPid(), Cgroups: cg.Dirs(), Inherit: inherit,
		LeaveStopped: true})
	if err != nil {
		// A root criu made and killed is our child: a zombie of the
		// sandbox's pid namespace would keep its init from exiting.
		reapRestoredRoots()
		return fmt.Errorf("%w: restoring %s from checkpoint %s's CRIU image: %w", ErrProcesses, u.name(), c.ID, err)
	}
	// The root is the server's child (criu restores it as its sibling: as
	// criu's child it would go to the host's init when criu exits, which
	// reaps it late, keeping its pid taken in the sandbox).
	exit := reapOnExit(pid)
	if err := ps.guardTree(cg, tmp, pid, u.Stopped); err != nil {
		// Not one of its processes may run unguarded.
		_ = cg.Kill()
		<-exit
		return fmt.Errorf("%w: restoring %s from checkpoint %s's CRIU image: %w", ErrProcesses, u.name(), c.ID, err)
	}
	if u.Session != "" {
		ps.h.AdoptSession(u.Session, u.Attached, cg, pid, ours, exit)
	}
	ps.h.Log().Debug("process tree restored", "sandbox", ps.h.ID(), "checkpoint", c.ID, "tree", u.name(), "took", time.Since(start))
	return nil
}

// linkImages makes a directory under run of hard links to the images of u
// (its logs left out), readable by criu once it has joined the sandbox's
// user namespace, and returns it; the caller removes it. Concurrent
// restores of one image (a fork fan-out) each get one, for criu's log and
// its scratch files.
func linkImages(run string, c *Checkpoint, u Unit) (dir string, err error) {
	tmp, err := os.MkdirTemp(run, "r")
	if err != nil {
		return "", err
	}
	defer func() {
		if err != nil {
			os.RemoveAll(tmp)
		}
	}()
	// criu reads the images after it has joined the sandbox's user
	// namespace, through its descriptor of this directory: they must be
	// readable by others (store/criu itself is the host root's alone).
	if err := os.Chmod(tmp, 0o711); err != nil {
		return "", err
	}
	ents, err := os.ReadDir(u.Dir)
	if err != nil {
		if errors.Is(err, os.ErrNotExist) {
			return "", fmt.Errorf("%w: the CRIU image of %s kept by checkpoint %s is gone", ErrProcesses, u.name(), c.ID)
		}
		return "", err
	}
	for _, e := range ents {
		if strings.HasSuffix(e.Name(), ".log") {
			continue
		}
		if err := os.Link(filepath.Join(u.Dir, e.Name()), filepath.Join(tmp, e.Name())); err != nil {
			return "", err
		}
		if err := os.Chmod(filepath.Join(tmp, e.Name()), 0o644); err != nil {
			return "", err
		}
	}
	return tmp, nil
}

// shellPipes makes the stdin, stdout and stderr pipes of the shell of a session
// restored by criu: ours are the server's ends, theirs the shell's, owned by
// the sandbox's user. On error, the pipes made so far are returned, for the
// caller to close.
func (ps *State) shellPipes() (ours, theirs [3]*os.File, err error) {
	uid, gid := ps.h.Owner()
	for i := range 3 {
		r, w, err := os.Pipe()
		if err != nil {
			return ours, theirs, err
		}
		if i == 0 {
			ours[i], theirs[i] = w, r
		} else {
			ours[i], theirs[i] = r, w
		}
		// criu reopens the shell's end through /proc/self/fd as the
		// shell's user: the pipe must be that user's.
		if err := unix.Fchown(int(theirs[i].Fd()), uid, gid); err != nil {
			return ours, theirs, fmt.Errorf("handing a pipe to the session's shell: %w", err)
		}
	}
	return ours, theirs, nil
}

// waitPidsFree waits until no process of the sandbox holds a pid of u (the
// killed processes of the state being left may still be dying). A pid stays
// taken while a process has it as its process group or session too, after
// the process that had it is gone: a killed member of a session whose
// leader was reaped first keeps the leader's pid from criu (EEXIST). The
// ids of u's threads other than its processes' are read from its images,
// unless u is known to have none (single, a tree with templates).
func (ps *State) waitPidsFree(u Unit, single bool) error {
	procDir := fmt.Sprintf("/proc/%d/root/proc", ps.h.InitPid())
	want := make(map[int]bool, len(u.Procs))
	for _, p := range u.Procs {
		want[p.NSPid] = true
	}
	// A thread's id is not listed in /proc, but it is taken while the
	// thread lives (an ended process's threads exit one by one).
	var tids []int
	if !single {
		tids, _ = criu.TreeThreads(u.Dir)
	}
	deadline := time.Now().Add(5 * time.Second)
	for {
		holder, err := pidHolder(procDir, want)
		if err != nil {
			return err
		}
		for _, tid := range tids {
			if _, serr := os.Stat(procDir + "/" + strconv.Itoa(tid)); holder == "" && serr == nil && !want[tid] {
				holder = fmt.Sprintf("thread id %d is still taken", tid)
			}
		}
		// A pid the listing does not show may still be taken: by a thread of another process
		// (thread ids are not listed, but /proc answers them) that is still exiting.
		for pid := range want {
			if _, serr := os.Stat(procDir + "/" + strconv.Itoa(pid)); holder == "" && serr == nil {
				holder = fmt.Sprintf("pid %d is still taken (by a thread, or a process still ending)", pid)
			}
		}
		if holder == "" {
			return nil
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("%w: %s, which %s needs back, 5 s after the sandbox's processes were ended", ErrProcesses, holder, u.name())
		}
		time.Sleep(time.Millisecond)
	}
}

// pidHolder looks through procDir (the sandbox's /proc) for a process that
// has one of the pids of want as its pid, process group or session, and
// says which; "" if none.
func pidHolder(procDir string, want map[int]bool) (string, error) {
	ents, err := os.ReadDir(procDir)
	if err != nil {
		return "", fmt.Errorf("listing the sandbox's processes: %w", err)
	}
	for _, e := range ents {
		pid, err := strconv.Atoi(e.Name())
		if err != nil {
			continue
		}
		b, err := os.ReadFile(procDir + "/" + e.Name() + "/stat")
		if err != nil {
			continue // gone since the listing
		}
		// pid (comm) state ppid pgrp session …; comm may hold spaces.
		st := string(b)
		i := strings.LastIndexByte(st, ')')
		f := strings.Fields(st[i+1:])
		if i < 0 || len(f) < 4 {
			continue
		}
		comm := st[strings.IndexByte(st, '(')+1 : i]
		pgrp, _ := strconv.Atoi(f[2])
		sid, _ := strconv.Atoi(f[3])
		switch {
		case want[pid]:
			return fmt.Sprintf("pid %d is still taken (%s)", pid, comm), nil
		case want[pgrp]:
			return fmt.Sprintf("pid %d is still taken as the process group of pid %d (%s)", pgrp, pid, comm), nil
		case want[sid]:
			return fmt.Sprintf("pid %d is still taken as the session of pid %d (%s)", sid, pid, comm), nil
		}
	}
	return "", nil
}

// resumeTrees lets stopped CRIU trees go on.
func resumeTrees(pids []int) {
	for _, p := range pids {
		_ = unix.Kill(p, unix.SIGCONT)
	}
}

// reapRestoredRoots makes sure every child of the server that lives in a
// sandbox's pid namespace — a root of a tree whose restore failed, killed by
// criu, perhaps not dead yet — is reaped once it has exited. Roots already
// watched get a second watcher, which finds nothing to reap.
func reapRestoredRoots() {
	tasks, _ := os.ReadDir("/proc/self/task")
	for _, t := range tasks {
		b, err := os.ReadFile("/proc/self/task/" + t.Name() + "/children")
		if err != nil {
			continue
		}
		for _, f := range strings.Fields(string(b)) {
			pid, err := strconv.Atoi(f)
			if err != nil {
				continue
			}
			st, err := os.ReadFile("/proc/" + f + "/status")
			if err != nil {
				continue
			}
			for _, line := range strings.Split(string(st), "\n") {
				if v, ok := strings.CutPrefix(line, "NSpid:"); ok && len(strings.Fields(v)) > 1 {
					reapOnExit(pid)
				}
			}
		}
	}
}

// reapIfOurs arranges for pid to be reaped by the server if the server is
// its parent: a copy made with CLONE_PARENT of a process criu restored (the
// server's child) is the server's child too, and no init would reap it.
// It returns the exit channel, or nil if pid is not the server's child.
func reapIfOurs(pid int) <-chan initproc.ExitEvent {
	fd, err := unix.PidfdOpen(pid, unix.PIDFD_NONBLOCK)
	if err != nil {
		return nil
	}
	// The parent from the pidfd (Linux 6.13): a tenth of the cost of
	// reading /proc/<pid>/stat, on every template restore.
	info := unix.PidfdInfo{Mask: unix.PIDFD_INFO_PID}
	ppid := -1
	if err := unix.IoctlPidfdInfo(fd, &info); err == nil {
		ppid = int(info.Ppid)
	} else if st, err := os.ReadFile("/proc/" + strconv.Itoa(pid) + "/stat"); err == nil {
		if i := bytes.LastIndexByte(st, ')'); i >= 0 {
			if f := strings.Fields(string(st[i+1:])); len(f) >= 2 {
				ppid, _ = strconv.Atoi(f[1])
			}
		}
	}
	if ppid != os.Getpid() {
		unix.Close(fd)
		return nil
	}
	return reapPidfd(pid, fd)
}

// reapOnExit reaps child pid once it has exited. A blocking wait4 alone
// would not do: the root may be seized by a later checkpoint, and a wait by
// the tracer's process reports (and consumes) its ptrace stops. A pidfd
// becomes readable only on exit.
func reapOnExit(pid int) <-chan initproc.ExitEvent {
	fd, err := unix.PidfdOpen(pid, unix.PIDFD_NONBLOCK)
	if err != nil {
		exit := make(chan initproc.ExitEvent, 1)
		close(exit)
		return exit
	}
	return reapPidfd(pid, fd)
}

// reapPidfd is reapOnExit with a non-blocking pidfd of pid, which it closes.
func reapPidfd(pid, fd int) <-chan initproc.ExitEvent {
	exit := make(chan initproc.ExitEvent, 1)
	f := os.NewFile(uintptr(fd), "pidfd")
	go func() {
		defer close(exit)
		defer f.Close()
		if rc, err := f.SyscallConn(); err == nil {
			_ = rc.Read(func(fd uintptr) bool {
				p := []unix.PollFd{{Fd: int32(fd), Events: unix.POLLIN}}
				n, _ := unix.Poll(p, 0)
				return n > 0
			})
		}
		// It has exited, so it stops no more: a blocking wait consumes
		// no ptrace stop. It blocks while another tracer (criu, which
		// dumped and killed it) has yet to release it.
		var ws unix.WaitStatus
		for {
			got, err := unix.Wait4(pid, &ws, 0, nil)
			if err == unix.EINTR {
				continue
			}
			if err == nil && got == pid {
				exit <- initproc.ExitEvent{Pid: pid, Status: ws}
			}
			return
		}
	}()
	return exit
}

// sandboxMounts are the mounts of a sandbox's namespace: their ids, and
// the id of its /dev/shm.
type sandboxMounts struct {
	ids map[uint64]bool
	shm uint64
}

// mountIDs returns the mounts of pid's mount namespace.
func mountIDs(pid int) (sandboxMounts, error) {
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/mountinfo", pid))
	if err != nil {
		return sandboxMounts{}, err
	}
	m := sandboxMounts{ids: map[uint64]bool{}}
	for _, line := range strings.Split(string(b), "\n") {
		f := strings.Fields(line)
		if len(f) < 5 {
			continue
		}
		if id, err := strconv.ParseUint(f[0], 10, 64); err == nil {
			m.ids[id] = true
			if f[4] == "/dev/shm" {
				m.shm = id
			}
		}
	}
	return m, nil
}

// reach is what detachedFiles finds a process reaches beyond the files of
// the sandbox's mounts.
type reach struct {
	ext []ExtFile
	// shm is a file of the sandbox's /dev/shm the process has open or
	// mapped (POSIX shared memory and semaphores), if any: a tmpfs of the
	// sandbox's own that checkpoints do not carry, which criu records by
	// path, so the process's image restores only in its own sandbox.
	shm string
}

// local names the file of the sandbox's /dev/shm process nsPid (comm) has
// open or mapped, or "": the sandbox looks at the images of such a process
// for a file removed while held, which criu cannot restore in a sandbox.
func (r reach) local(nsPid int, comm string) string {
	if r.shm == "" {
		return ""
	}
	return fmt.Sprintf("pid %d (%s) has %s open or mapped", nsPid, comm, strings.TrimSuffix(r.shm, " (deleted)"))
}

// detachedFiles lists the files pid maps, runs, has open or has as its cwd
// or root that are on a mount not in mounts (the sandbox's namespace), and
// one it has on the sandbox's /dev/shm. A process gone has none: a tree
// runs between its release from ptrace and criu's seizing it, and criu
// takes the tree as it finds it then.
func detachedFiles(pid int, mounts sandboxMounts, seen map[string]bool) (reach, error) {
	dir := "/proc/" + strconv.Itoa(pid) + "/"
	links := []string{dir + "exe", dir + "cwd", dir + "root"}
	for _, sub := range []string{"map_files/", "fd/"} {
		ents, err := os.ReadDir(dir + sub)
		if errors.Is(err, os.ErrNotExist) {
			return reach{}, nil
		}
		if err != nil {
			return reach{}, err
		}
		for _, e := range ents {
			links = append(links, dir+sub+e.Name())
		}
	}
	var out reach
	for _, l := range links {
		var st unix.Statx_t
		if unix.Statx(unix.AT_FDCWD, l, 0, unix.STATX_MNT_ID|unix.STATX_INO|unix.STATX_TYPE, &st) != nil {
			continue // closed or unmapped meanwhile
		}
		switch st.Mode & unix.S_IFMT {
		case unix.S_IFREG, unix.S_IFDIR, unix.S_IFCHR, unix.S_IFBLK:
		default:
			continue // pipes, sockets: not files of a mount
		}
		if st.Mnt_id == mounts.shm && out.shm == "" {
			out.shm, _ = os.Readlink(l)
		}
		if mounts.ids[st.Mnt_id] {
			continue
		}
		key := fmt.Sprintf("file[%x:%x]", st.Mnt_id, st.Ino)
		if seen[key] {
			continue
		}
		path, err := os.Readlink(l)
		if err != nil {
			continue
		}
		if path == "/dev/zero (deleted)" {
			continue // anonymous shared memory: criu saves its contents
		}
		if strings.HasPrefix(path, "/SYSV") && strings.HasSuffix(path, " (deleted)") {
			return reach{}, fmt.Errorf("%w: it attaches System V shared memory, which CRIU saves only with the IPC namespace, and a sandbox's is not saved; checkpoint files only (process mode filesystem)", ErrProcesses)
		}
		if !strings.HasPrefix(path, "/") || strings.HasSuffix(path, " (deleted)") {
			return reach{}, fmt.Errorf("%w: it reaches %s on a detached mount, which cannot be found again by path", ErrProcesses, path)
		}
		seen[key] = true
		out.ext = append(out.ext, ExtFile{Key: key, Path: path, Dir: st.Mode&unix.S_IFMT == unix.S_IFDIR})
	}
	return out, nil
}

// openExternal opens the files of u's dump that were on a detached mount,
// by path in the sandbox's (restored) root, to hand them to criu.
func (ps *State) openExternal(u Unit) ([]criu.InheritFile, error) {
	if len(u.Ext) == 0 {
		return nil, nil
	}
	root, err := ps.h.OpenRoot()
	if err != nil {
		return nil, err
	}
	defer unix.Close(root)
	var out []criu.InheritFile
	for _, e := range u.Ext {
		flags := uint64(unix.O_RDONLY | unix.O_CLOEXEC | unix.O_NOFOLLOW)
		if e.Dir {
			flags |= unix.O_DIRECTORY
		}
		rel := strings.TrimLeft(e.Path, "/")
		if rel == "" {
			rel = "."
		}
		fd, err := unix.Openat2(root, rel, &unix.OpenHow{Flags: flags, Resolve: unix.RESOLVE_IN_ROOT | unix.RESOLVE_NO_MAGICLINKS})
		if err != nil {
			for _, f := range out {
				f.File.Close()
			}
			return nil, fmt.Errorf("%w: %s, which %s had open or mapped at the checkpoint, cannot be opened in the restored root: %w", ErrProcesses, e.Path, u.name(), err)
		}
		out = append(out, criu.InheritFile{Key: e.Key, File: os.NewFile(uintptr(fd), e.Path)})
	}
	return out, nil
}
