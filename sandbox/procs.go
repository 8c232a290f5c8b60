package sandbox

import (
	"bufio"
	"context"
	"crypto/rand"
	"encoding/binary"
	"errors"
	"fmt"
	"os"
	"runtime"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"
	"unsafe"

	"golang.org/x/sys/unix"

	"github.com/deltagym/deltagym/sandbox/cgroup"
	"github.com/deltagym/deltagym/sandbox/initproc"
	"github.com/deltagym/deltagym/sandbox/ptfork"
)

// Process checkpoints, fast path (template fork; see docs/ARCHITECTURE.md).
//
// At a checkpoint with live processes, the sandbox's command group is
// frozen, the upper is copied and sealed (the live processes keep the upper
// they have), and every process is seized with ptrace and made to clone
// itself (sandbox/ptfork): the copy — the template — is moved into a frozen
// cgroup of its own checkpoint ("t-<checkpoint>", under the sandbox's group,
// so it counts against the sandbox's memory limit) before it is detached,
// so it never runs; the live process is detached and goes on. A template's
// root is the sandbox's root, and every root swap (pivot_root) re-points
// the roots of all tasks whose root is the old root, so a template's root
// follows the sandbox's live root.
//
// At an in-place restore, after the root swap, each template is seized, its
// group thawed (it is in ptrace-stop, so it cannot run), and made to clone
// itself again; the group is frozen again before the template is detached.
// The new copy is fixed up by system calls injected into it, so they run
// with its own credentials and meet its seccomp filter: chdir to its cwd's
// path in the restored root; every regular file it had open in the
// sandbox's root is reopened by path with the same flags and offset (so it
// reaches the restored state, not the discarded upper); a session's shell
// gets fresh pipes for stdin, stdout and stderr (the server takes its ends
// with pidfd_getfd). Other descriptions (the host's /dev/null, sockets,
// pipes between processes) stay shared with the template, which is frozen:
// a listening socket keeps listening on the same port.
//
// Templates are copies of one thread: multithreaded processes, process trees
// (a command with children), processes with a writable shared file mapping
// or with a root of their own take the general path (procs_criu.go); an
// open deleted file is refused with ErrProcesses naming the process.
// Templates live in the sandbox's pid namespace, so only the sandbox that
// made them copies them; other sandboxes and forks get CRIU images made from
// them (procs_image.go).

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

// CheckpointOptions tunes one checkpoint.
type CheckpointOptions struct {
	Processes ProcessMode
	// Durable also saves the processes kept as templates as CRIU images,
	// in the background, so that the checkpoint brings them back after its
	// sandbox is gone, after a restart, or once a template is lost.
	Durable bool
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
	Reason  string // why the general path (criu) took it
	// ImagePid is the pid a template's process has in forks, and in
	// restores in other sandboxes, which bring it back from a CRIU image
	// of a copy of the template: that copy's pid (0 until the image is
	// made).
	ImagePid int
}

// templateGroups returns the sandbox's template groups.
func (s *Sandbox) templateGroups() []*cgroup.Cgroup {
	s.procs.mu.Lock()
	defer s.procs.mu.Unlock()
	out := make([]*cgroup.Cgroup, 0, len(s.procs.tpls))
	for _, tg := range s.procs.tpls {
		out = append(out, tg)
	}
	return out
}

// procTemplate is the persisted record of one template.
type procTemplate struct {
	HostPid int       `json:"host_pid"`
	Start   uint64    `json:"start"` // start time, guards against pid reuse
	NSPid   int       `json:"ns_pid"`
	Comm    string    `json:"comm"`
	Cwd     string    `json:"cwd"`
	Files   []tplFile `json:"files,omitempty"`
	Session string    `json:"session,omitempty"`
	// Leader is set when the process led its own session (as every
	// command does): its copies call setsid, so that they lead one too.
	Leader bool `json:"leader,omitempty"`
	// Dumpable is the process's dumpable flag (PR_GET_DUMPABLE) when it was
	// captured; its template is kept non-dumpable (guardTemplate) and its
	// copies get the flag back. 0 in records that predate the guard, whose
	// templates kept the process's flag.
	Dumpable int `json:"dumpable,omitempty"`
}

// tplFile is a file a template has open in the sandbox's root.
type tplFile struct {
	FD    int    `json:"fd"`
	Path  string `json:"path"`
	Flags int    `json:"flags"`
	Pos   int64  `json:"pos"`
}

// procInfo is what inspecting a live process found.
type procInfo struct {
	tpl    procTemplate
	ppid   int
	reason string // why it cannot be a template, if it cannot
	// deleted names an open deleted file: neither path takes it (criu's
	// ghost files fail to restore across the sandbox's mount namespace).
	deleted string
}

func (t procTemplate) name() string { return fmt.Sprintf("pid %d (%s)", t.NSPid, t.Comm) }

// inspect reads what a template of pid needs. rootMnt is the mount id of
// the sandbox's root.
func inspect(pid int, rootMnt uint64) (procInfo, error) {
	dir := "/proc/" + strconv.Itoa(pid)
	var pi procInfo
	stat, err := os.ReadFile(dir + "/stat")
	if err != nil {
		return pi, err
	}
	// comm is in parentheses and may hold spaces; fields follow the last ')'.
	open, end := strings.IndexByte(string(stat), '('), strings.LastIndexByte(string(stat), ')')
	if open < 0 || end < open {
		return pi, fmt.Errorf("parsing %s/stat", dir)
	}
	pi.tpl.Comm = string(stat[open+1 : end])
	f := strings.Fields(string(stat[end+1:]))
	if len(f) < 20 {
		return pi, fmt.Errorf("parsing %s/stat", dir)
	}
	pi.ppid, _ = strconv.Atoi(f[1])
	pi.tpl.Leader = f[3] == strconv.Itoa(pid)
	pi.tpl.Start, _ = strconv.ParseUint(f[19], 10, 64)
	pi.tpl.HostPid = pid
	status, err := os.ReadFile(dir + "/status")
	if err != nil {
		return pi, err
	}
	for _, line := range strings.Split(string(status), "\n") {
		k, v, _ := strings.Cut(line, ":")
		v = strings.TrimSpace(v)
		switch k {
		case "NSpid":
			ns := strings.Fields(v)
			pi.tpl.NSPid, _ = strconv.Atoi(ns[len(ns)-1])
		case "Threads":
			if v != "1" {
				pi.reason = "it has " + v + " threads (template copies are single-threaded)"
			}
		}
	}
	if mnt, err := mntID(dir + "/root"); err != nil {
		return pi, err
	} else if mnt != rootMnt && pi.reason == "" {
		pi.reason = "it has a root of its own"
	}
	if pi.tpl.Cwd, err = os.Readlink(dir + "/cwd"); err != nil {
		return pi, err
	}
	if mnt, err := mntID(dir + "/cwd"); err != nil {
		return pi, err
	} else if mnt != rootMnt && pi.reason == "" {
		pi.reason = "its working directory " + pi.tpl.Cwd + " is outside the sandbox's root filesystem"
	}
	if err := inspectFiles(dir, rootMnt, &pi); err != nil {
		return pi, err
	}
	if pi.reason == "" {
		pi.reason, err = sharedWritableMap(dir)
	}
	return pi, err
}

func inspectFiles(dir string, rootMnt uint64, pi *procInfo) error {
	ents, err := os.ReadDir(dir + "/fd")
	if err != nil {
		return err
	}
	for _, e := range ents {
		fd, err := strconv.Atoi(e.Name())
		if err != nil {
			continue
		}
		link, err := os.Readlink(dir + "/fd/" + e.Name())
		if err != nil {
			continue // closed meanwhile
		}
		if !strings.HasPrefix(link, "/") {
			continue // pipes, sockets, anonymous inodes: shared with the template
		}
		info, err := os.ReadFile(dir + "/fdinfo/" + e.Name())
		if err != nil {
			continue
		}
		var tf tplFile
		var mnt uint64
		tf.FD, tf.Path = fd, link
		for _, line := range strings.Split(string(info), "\n") {
			k, v, _ := strings.Cut(line, ":")
			v = strings.TrimSpace(v)
			switch k {
			case "pos":
				tf.Pos, _ = strconv.ParseInt(v, 10, 64)
			case "flags":
				fl, _ := strconv.ParseInt(v, 8, 64)
				tf.Flags = int(fl)
			case "mnt_id":
				mnt, _ = strconv.ParseUint(v, 10, 64)
			}
		}
		if mnt != rootMnt {
			continue // /dev, /proc, the host's /dev/null: shared
		}
		if strings.HasSuffix(link, " (deleted)") {
			if pi.deleted == "" {
				pi.deleted = fmt.Sprintf("it holds the deleted file %s open (fd %d)", strings.TrimSuffix(link, " (deleted)"), fd)
			}
			if pi.reason == "" {
				pi.reason = pi.deleted
			}
			continue
		}
		pi.tpl.Files = append(pi.tpl.Files, tf)
	}
	return nil
}

// sharedWritableMap names a file the process maps shared and writable: a
// copy would write through to the live state's file, not its own. It asks
// the kernel for such mappings only (PROCMAP_QUERY, Linux 6.11: a few µs),
// or else reads the whole maps file (140 µs for a python3 process here).
func sharedWritableMap(dir string) (string, error) {
	f, err := os.Open(dir + "/maps")
	if err != nil {
		return "", err
	}
	defer f.Close()
	name, err := sharedWritableQuery(f)
	if errors.Is(err, unix.ENOTTY) || errors.Is(err, unix.EINVAL) {
		return sharedWritableScan(f)
	}
	return name, err
}

// procmapQuery is struct procmap_query of linux/fs.h.
type procmapQuery struct {
	Size, QueryFlags, QueryAddr                        uint64
	VMAStart, VMAEnd, VMAFlags, VMAPageSize, VMAOffset uint64
	Inode                                              uint64
	DevMajor, DevMinor, VMANameSize, BuildIDSize       uint32
	VMANameAddr, BuildIDAddr                           uint64
}

const (
	procmapQueryIoctl     = 0xC0686611 // _IOWR(0x66, 17, struct procmap_query)
	procmapWritable       = 0x02
	procmapShared         = 0x08
	procmapCoveringOrNext = 0x10
	procmapFileBacked     = 0x20
)

// sharedWritableQuery walks the shared, writable, file-backed mappings of
// an open maps file with PROCMAP_QUERY.
func sharedWritableQuery(maps *os.File) (string, error) {
	name := make([]byte, unix.PathMax)
	for addr := uint64(0); ; {
		q := procmapQuery{
			Size:        uint64(unsafe.Sizeof(procmapQuery{})),
			QueryFlags:  procmapCoveringOrNext | procmapWritable | procmapShared | procmapFileBacked,
			QueryAddr:   addr,
			VMANameSize: uint32(len(name)),
			VMANameAddr: uint64(uintptr(unsafe.Pointer(&name[0]))),
		}
		_, _, errno := unix.Syscall(unix.SYS_IOCTL, maps.Fd(), procmapQueryIoctl, uintptr(unsafe.Pointer(&q)))
		runtime.KeepAlive(name)
		if errno == unix.ENOENT {
			return "", nil // no more
		}
		if errno != 0 {
			return "", errno
		}
		p := string(name[:max(int(q.VMANameSize)-1, 0)]) // the size counts the NUL
		if strings.HasPrefix(p, "/") && !strings.HasPrefix(p, "/dev/") {
			return "it maps " + p + " shared and writable", nil
		}
		addr = q.VMAEnd
	}
}

// sharedWritableScan is sharedWritableQuery by reading the maps file.
func sharedWritableScan(maps *os.File) (string, error) {
	sc := bufio.NewScanner(maps)
	for sc.Scan() {
		fl := strings.Fields(sc.Text())
		if len(fl) < 6 || len(fl[1]) < 4 || fl[1][1] != 'w' || fl[1][3] != 's' {
			continue
		}
		p := fl[5]
		if strings.HasPrefix(p, "/") && !strings.HasPrefix(p, "/dev/") {
			return "it maps " + p + " shared and writable", nil
		}
	}
	return "", sc.Err()
}

func mntID(path string) (uint64, error) {
	var st unix.Statx_t
	if err := unix.Statx(unix.AT_FDCWD, path, 0, unix.STATX_MNT_ID, &st); err != nil {
		return 0, fmt.Errorf("statx %s: %w", path, err)
	}
	return st.Mnt_id, nil
}

// captureProcesses captures the sandbox's live processes — templates for
// what the fast path can copy, CRIU images for the other trees (or for all
// of them in ProcessesCRIU) — and calls copyFS while every one of them is
// stopped, so that the files and the processes are captured at the same
// instant. Called with op held.
//
// Single-threaded processes are stopped by ptrace, not by the freezer: each
// is seized and interrupted, and the command group is listed again until
// no new process appears (a stopped process cannot fork). Trees for CRIU
// are released from ptrace and dumped by criu, which leaves them stopped.
func (s *Sandbox) captureProcesses(ctx context.Context, c *checkpoint, mode ProcessMode, copyFS func() error) (err error) {
	if err := s.materialize(); err != nil { // processes run: it is, but be sure
		return err
	}
	rootMnt, err := mntID("/proc/" + strconv.Itoa(s.init.Pid) + "/root")
	if err != nil {
		return err
	}
	tr := ptfork.NewSession()
	defer func() {
		// The originals go on (if templates were made, they are detached
		// by now, into their frozen group).
		if cerr := tr.Close(); cerr != nil {
			err = errors.Join(err, cerr)
		}
	}()
	st, err := s.stopAll(tr)
	if err != nil {
		return err
	}
	procs, err := s.inspectAll(st, rootMnt)
	if err != nil {
		return err
	}
	tplProcs, trees, err := s.planCapture(splitTrees(procs), mode)
	if err != nil {
		return err
	}
	if len(trees) > 0 {
		resume, err := s.dumpTrees(ctx, c, trees, st)
		defer func() { err = resume(err) }()
		if err != nil {
			return err
		}
	}
	if err := copyFS(); err != nil {
		return err
	}
	if len(tplProcs) == 0 {
		return nil
	}
	return s.makeTemplates(c, tplProcs, st.seized)
}

// stopSet is what stopAll stopped: the processes of the command group in
// the order they were found.
type stopSet struct {
	seized   map[int]*ptfork.Proc // in ptrace-stop
	threaded map[int]bool         // cannot be seized: they go on until criu stops them
	order    []int
}

// stopAll seizes and stops every single-threaded process of the command
// group, listing the group again until no new process appears: once it
// returns, nothing in the group can fork but the threaded processes it
// names (which criu stops). A process that exits meanwhile is left out.
func (s *Sandbox) stopAll(tr *ptfork.Session) (stopSet, error) {
	st := stopSet{seized: map[int]*ptfork.Proc{}, threaded: map[int]bool{}}
	for round := 0; ; round++ {
		pids, err := s.workPidsNow()
		if err != nil {
			return st, err
		}
		fresh, more, err := st.seizeNew(tr, pids)
		if err != nil {
			return st, err
		}
		if len(fresh) == 0 && !more {
			return st, nil
		}
		if round == 10 {
			return st, fmt.Errorf("%w: processes keep starting (a fork loop?); checkpoint files only (process mode filesystem; CLI: --processes files)", ErrProcesses)
		}
		for _, p := range fresh {
			if err := p.Wait(); err != nil {
				delete(st.seized, p.Pid)
				continue // it exited
			}
			st.order = append(st.order, p.Pid)
		}
	}
}

// seizeNew seizes the processes of pids not seen before. It returns those
// seized (not yet stopped) and whether it found a new threaded process.
func (st *stopSet) seizeNew(tr *ptfork.Session, pids []int) (fresh []*ptfork.Proc, more bool, err error) {
	for _, pid := range pids {
		if st.seized[pid] != nil || st.threaded[pid] {
			continue
		}
		p, err := tr.Seize(pid)
		if errors.Is(err, ptfork.ErrGone) {
			continue
		}
		if errors.Is(err, ptfork.ErrThreads) {
			st.threaded[pid], more = true, true
			st.order = append(st.order, pid)
			continue
		}
		if err != nil {
			return nil, false, fmt.Errorf("%w: pid %d: %w", ErrProcesses, pid, err)
		}
		st.seized[pid] = p
		fresh = append(fresh, p)
	}
	return fresh, more, nil
}

// inspectAll inspects the stopped processes, in order, naming the session
// whose shell each is. A threaded process that ended meanwhile is left
// out; any other failure fails the capture.
func (s *Sandbox) inspectAll(st stopSet, rootMnt uint64) ([]procInfo, error) {
	s.mu.Lock()
	sessionOf := map[int]string{}
	for name, se := range s.sessions {
		sessionOf[se.hostPid] = name
	}
	s.mu.Unlock()
	procs := make([]procInfo, 0, len(st.order))
	for _, pid := range st.order {
		pi, err := inspect(pid, rootMnt)
		if err != nil {
			if st.threaded[pid] {
				continue // it ended meanwhile
			}
			return nil, fmt.Errorf("inspecting pid %d: %w", pid, err)
		}
		pi.tpl.Session = sessionOf[pid]
		procs = append(procs, pi)
	}
	return procs, nil
}

// planCapture sorts the process trees into those copied as templates (one
// process each, returned as tplProcs) and those CRIU dumps (trees, each
// with its reason). It refuses what neither path brings back: an open
// deleted file, a session's shell below the root of its tree.
func (s *Sandbox) planCapture(units []procTree, mode ProcessMode) (tplProcs []procInfo, trees []procTree, err error) {
	full, err := s.templatesFull(units, mode)
	if err != nil {
		return nil, nil, err
	}
	for _, u := range units {
		why := u.criuReason(mode)
		if why == "" && full != "" {
			why = full
		}
		if why == "" {
			tplProcs = append(tplProcs, u.procs[0])
			continue
		}
		if err := u.criuCapturable(); err != nil {
			return nil, nil, err
		}
		u.why = why
		trees = append(trees, u)
	}
	return tplProcs, trees, nil
}

// criuCapturable fails if CRIU cannot capture tree t in a way a restore
// brings back.
func (t procTree) criuCapturable() error {
	for _, p := range t.procs {
		if p.deleted != "" {
			return fmt.Errorf("%w: %s cannot be captured: %s, which neither template copies nor CRIU can bring back in a sandbox; close it, end the process, or checkpoint files only (process mode filesystem; CLI: --processes files)",
				ErrProcesses, p.tpl.name(), p.deleted)
		}
		if p.tpl.Session != "" && p.tpl.HostPid != t.procs[0].tpl.HostPid {
			return fmt.Errorf("%w: session %q cannot be captured: its shell %s is not the root of its process tree; end it, or checkpoint files only (process mode filesystem; CLI: --processes files)",
				ErrProcesses, p.tpl.Session, p.tpl.name())
		}
	}
	return nil
}

// dumpTrees releases trees from ptrace and has criu dump each into c's
// images, which leaves them stopped. It returns resume, which the caller
// calls with its result once the files are copied and the templates made:
// it lets everything criu stopped go on, and on failure removes c's CRIU
// directory. resume is never nil: the caller calls it even if dumpTrees
// fails.
func (s *Sandbox) dumpTrees(ctx context.Context, c *checkpoint, trees []procTree, st stopSet) (resume func(error) error, err error) {
	resume = func(err error) error {
		// Everything criu stopped goes on (trees may have grown while
		// not stopped: list the group, not the trees).
		pids, lerr := s.workPidsNow()
		err = errors.Join(err, lerr)
		var cont []int
		for _, p := range pids {
			if st.seized[p] == nil {
				cont = append(cont, p)
			}
		}
		resumeTrees(cont)
		if err != nil {
			_ = os.RemoveAll(s.rt.criuDir(c.ID))
		}
		return err
	}
	// Until criu is at work, nothing is left stopped but what ptrace
	// holds (which tr.Close releases).
	none := func(err error) error { return err }
	s.init.Settled() // criu joins the namespace
	mounts, err := mountIDs(s.init.Pid)
	if err != nil {
		return none, err
	}
	// Released from ptrace, dumped, left stopped by criu.
	for _, u := range trees {
		for _, p := range u.procs {
			if sp := st.seized[p.tpl.HostPid]; sp != nil {
				delete(st.seized, p.tpl.HostPid)
				if err := sp.Detach(); err != nil {
					return none, fmt.Errorf("%w: releasing %s for CRIU: %w", ErrProcesses, p.tpl.name(), err)
				}
			}
		}
	}
	dctx := context.WithoutCancel(ctx) // never leave a tree half-dumped
	for i, u := range trees {
		cu, err := s.dumpTree(dctx, c, i, u.procs[0].tpl.HostPid, u.procs, u.why, mounts)
		if err != nil {
			return resume, err
		}
		c.Images = append(c.Images, cu)
	}
	return resume, nil
}

// makeTemplates has each stopped process of tplProcs clone itself into a
// template, in a frozen group of c's own, and records them in c. On
// success every template is detached into its frozen group (it never
// runs) before the originals go on; on failure none is left.
func (s *Sandbox) makeTemplates(c *checkpoint, tplProcs []procInfo, seized map[int]*ptfork.Proc) error {
	tg, err := s.takeTemplateGroup()
	if err != nil {
		return err
	}
	live := make([]procTemplate, len(tplProcs))
	for i := range tplProcs {
		live[i] = tplProcs[i].tpl
	}
	var made []*ptfork.Proc
	fail := func(err error) error {
		for _, t := range made {
			t.Kill()
		}
		_ = tg.Delete()
		return err
	}
	for i, pi := range tplProcs {
		t, err := forkTemplate(seized[pi.tpl.HostPid], &tplProcs[i].tpl, tg)
		if t != nil {
			made = append(made, t)
		}
		if err != nil {
			return fail(s.copyError(pi.tpl.name(), err))
		}
	}
	// Into their frozen group before the originals go on.
	for _, t := range made {
		if err := t.Detach(); err != nil {
			return fail(err)
		}
	}
	c.Procs = make([]procTemplate, len(tplProcs))
	for i := range tplProcs {
		c.Procs[i] = tplProcs[i].tpl
	}
	c.TplGroup = tg.Name()
	s.procs.mu.Lock()
	s.procs.tpls[c.ID] = tg
	s.procs.mu.Unlock()
	s.foldLive(live)
	return nil
}

// forkTemplate has stopped process p clone itself into a template in group
// tg: a session leader of its own, non-dumpable (guardTemplate), still in
// ptrace-stop. It updates t to describe the template (its pid and start
// time). The template, if one was forked, is returned even on error.
func forkTemplate(p *ptfork.Proc, t *procTemplate, tg *cgroup.Cgroup) (*ptfork.Proc, error) {
	cp, _, err := p.Fork()
	if err != nil {
		return nil, err
	}
	reapIfOurs(cp.Pid)
	if t.Leader {
		// Born in the process's session and group, the template would
		// keep their id, the process's pid, taken after the process ends:
		// a CRIU tree that had that pid could not be restored. (Before it
		// joins its frozen group: a frozen task runs no injected call.)
		if _, serr := cp.Syscall(unix.SYS_SETSID); serr != nil {
			return cp, fmt.Errorf("setsid: %w", serr)
		}
	}
	if err := guardTemplate(cp, t); err != nil {
		return cp, err
	}
	if err := tg.Add(cp.Pid); err != nil {
		return cp, err
	}
	t.HostPid = cp.Pid
	if st, err := startTime(cp.Pid); err == nil {
		t.Start = st
	}
	return cp, nil
}

// guardTemplate makes a new template non-dumpable, recording the process's
// own flag in t. The template lives in the sandbox's pid namespace with the
// process's credentials: dumpable, it would be open to the sandbox's own
// commands through ptrace, /proc/PID/mem and process_vm_writev, and a write
// into its memory would change every later restore and fork of the
// checkpoint. Non-dumpable, only a holder of CAP_SYS_PTRACE over the
// sandbox's user namespace reaches it: the server, never a command. (Before
// the template joins its frozen group: a frozen task runs no injected call.)
func guardTemplate(p *ptfork.Proc, t *procTemplate) error {
	d, err := p.Syscall(unix.SYS_PRCTL, unix.PR_GET_DUMPABLE)
	if err != nil {
		return fmt.Errorf("reading the dumpable flag: %w", err)
	}
	t.Dumpable = int(d)
	if d == 0 {
		return nil
	}
	if _, err := p.Syscall(unix.SYS_PRCTL, unix.PR_SET_DUMPABLE, 0); err != nil {
		return fmt.Errorf("making the template non-dumpable: %w", err)
	}
	return nil
}

// procTree is one process tree of the command group: a process whose
// parent is outside the group (the init, or the server for a tree criu
// restored), and its descendants.
type procTree struct {
	procs []procInfo // the root first
	why   string
}

// splitTrees groups procs into trees, in the order of their roots.
func splitTrees(procs []procInfo) []procTree {
	byPid := map[int]int{}
	for i, p := range procs {
		byPid[p.tpl.HostPid] = i
	}
	rootOf := func(i int) int {
		for n := 0; n < len(procs); n++ {
			j, ok := byPid[procs[i].ppid]
			if !ok {
				break
			}
			i = j
		}
		return i
	}
	var roots []int
	members := map[int][]procInfo{}
	for i := range procs {
		r := rootOf(i)
		if _, ok := members[r]; !ok {
			roots = append(roots, r)
			members[r] = []procInfo{procs[r]}
		}
		if r != i {
			members[r] = append(members[r], procs[i])
		}
	}
	out := make([]procTree, len(roots))
	for k, r := range roots {
		out[k] = procTree{procs: members[r]}
	}
	return out
}

// criuReason says why t takes the general path, or "" for a template.
func (t procTree) criuReason(mode ProcessMode) string {
	switch {
	case mode == ProcessesCRIU:
		return "process mode criu"
	case len(t.procs) > 1:
		return fmt.Sprintf("in the process tree of %s, with %s a child of it: process trees are not template-copied",
			t.procs[0].tpl.name(), t.procs[1].tpl.name())
	default:
		return t.procs[0].reason
	}
}

// copyError is the error of a failed copy of process name (a template's,
// or a template's copy): ErrBudget if the pids limit refused it
// (pidsError), else ErrProcesses.
func (s *Sandbox) copyError(name string, err error) error {
	if perr := s.pidsError(err); perr != err {
		return fmt.Errorf("copying %s: %w", name, perr)
	}
	return fmt.Errorf("%w: copying %s: %w", ErrProcesses, name, err)
}

// templatesFull says why the processes of units that a checkpoint in mode
// would copy as templates go to CRIU instead, if they do: frozen copies
// count against the sandbox's pids limit, and once the pids in use (live
// processes, the init, frozen copies) and the new copies would pass three
// quarters of it, the rest is left to the live processes (a sandbox whose
// checkpoints hold all its pids could not even start a command). CRIU
// images hold no pid. Without CRIU, such a checkpoint fails with ErrBudget.
func (s *Sandbox) templatesFull(units []procTree, mode ProcessMode) (string, error) {
	lim := s.spec.Limits.Pids
	n := 0
	for _, u := range units {
		if u.criuReason(mode) == "" {
			n++
		}
	}
	if lim <= 0 || n == 0 {
		return "", nil
	}
	cur, err := s.cg.PidsCurrent()
	if err != nil || (cur+int64(n))*4 <= lim*3 {
		return "", nil
	}
	why := fmt.Sprintf("frozen copies would take the sandbox past three quarters of its pids limit (%d in use, %d new, limit %d; live processes and the frozen copies checkpoints keep count): a quarter is kept for the live processes; release checkpoints no longer needed, or end processes, to have processes template-copied again", cur, n, lim)
	if _, err := s.rt.criuSwrk(); err != nil {
		return "", fmt.Errorf("%w: %s, and CRIU, which would save them holding no pid, is not available (%w)", ErrBudget, why, err)
	}
	return why, nil
}

// takeTemplateGroup returns an empty, frozen cgroup for the templates of
// one checkpoint, made ahead in the background.
func (s *Sandbox) takeTemplateGroup() (*cgroup.Cgroup, error) {
	s.procs.mu.Lock()
	ch := s.procs.spareTG
	s.procs.spareTG = nil
	s.procs.mu.Unlock()
	var tg *cgroup.Cgroup
	var err error
	if ch != nil {
		r := <-ch
		tg, err = r.cg, r.err
	} else {
		tg, err = s.newTemplateGroup()
	}
	if err != nil {
		return nil, fmt.Errorf("creating template cgroup: %w", err)
	}
	next := make(chan spareGroup, 1)
	s.procs.mu.Lock()
	s.procs.spareTG = next
	s.procs.mu.Unlock()
	s.bg.Add(1) // Destroy waits for it before it removes the sandbox's group
	go func() {
		defer s.bg.Done()
		g, err := s.newTemplateGroup()
		next <- spareGroup{cg: g, err: err}
	}()
	return tg, nil
}

// spareGroup is a template group made ahead.
type spareGroup struct {
	cg  *cgroup.Cgroup
	err error
}

// closeControls closes the controls that are open.
func closeControls(ks ...*cgroup.Control) {
	for _, k := range ks {
		if k != nil {
			k.Close()
		}
	}
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

// setTplFrozen freezes or thaws template group tg (SetFrozen) through its
// cgroup.freeze kept open: a restore writes it twice, and so does a job
// forking copies ahead. Only the file of the last group written is kept
// (one per sandbox).
// +checklocks:s.procs.run
func (s *Sandbox) setTplFrozen(tg *cgroup.Cgroup, on bool) error {
	if s.procs.tplFreeze.of != tg {
		closeControls(s.procs.tplFreeze.k)
		// nil on cgroup v1, or if it cannot be opened: SetFrozen then.
		k, _ := tg.OpenControl("cgroup.freeze")
		s.procs.tplFreeze.of, s.procs.tplFreeze.k = tg, k
	}
	if s.procs.tplFreeze.k == nil {
		return tg.SetFrozen(on)
	}
	v := "0"
	if on {
		v = "1"
	}
	return s.procs.tplFreeze.k.Write(v)
}

func (s *Sandbox) newTemplateGroup() (*cgroup.Cgroup, error) { return s.frozenGroup("t") }

// frozenGroup makes a new frozen sub-group of the sandbox's group, named
// prefix and a number.
func (s *Sandbox) frozenGroup(prefix string) (*cgroup.Cgroup, error) {
	g, err := s.cg.Sub(s.groupName(prefix))
	if err != nil {
		return nil, err
	}
	if err := g.Freeze(); err != nil {
		_ = g.Delete()
		return nil, err
	}
	return g, nil
}

// startTime returns when pid started (clock ticks since boot), or an error
// if it is gone or dying (a zombie).
func startTime(pid int) (uint64, error) {
	b, err := os.ReadFile("/proc/" + strconv.Itoa(pid) + "/stat")
	if err != nil {
		return 0, err
	}
	end := strings.LastIndexByte(string(b), ')')
	f := strings.Fields(string(b[end+1:]))
	if len(f) < 20 {
		return 0, fmt.Errorf("parsing /proc/%d/stat", pid)
	}
	if f[0] == "Z" || f[0] == "X" {
		return 0, fmt.Errorf("pid %d has exited", pid)
	}
	return strconv.ParseUint(f[19], 10, 64)
}

// checkTemplates fails unless every template of c is alive and frozen.
func (s *Sandbox) checkTemplates(c *checkpoint) error {
	if len(c.Procs) == 0 {
		return nil
	}
	if c.SandboxID != s.id {
		return fmt.Errorf("%w: checkpoint %s holds live processes (%s) that only sandbox %s can bring back: template copies are born in its pid namespace; restore it there, or take checkpoints with process mode filesystem",
			ErrProcesses, c.ID, procNames(c.Procs), c.SandboxID)
	}
	s.procs.mu.Lock()
	tg := s.procs.tpls[c.ID]
	s.procs.mu.Unlock()
	for _, t := range c.Procs {
		st, err := startTime(t.HostPid)
		if err != nil || st != t.Start || tg == nil {
			return fmt.Errorf("%w: the frozen copy of %s kept by checkpoint %s was lost (killed after the checkpoint); the checkpoint can no longer bring it back; restore another checkpoint instead (one taken with process mode \"files\" keeps no processes)", ErrProcesses, t.name(), c.ID)
		}
	}
	return nil
}

func procNames(ps []procTemplate) string {
	names := make([]string, len(ps))
	for i, p := range ps {
		names[i] = p.name()
	}
	return strings.Join(names, ", ")
}

// spawnCopies brings back the processes of c's templates into the live
// state, after the root swap: the copies forked ahead after c's previous
// restore if there are any (ahead.go), or copies forked now. Called with op
// held; the command group is empty, and the processes the restore killed
// may still be exiting (waited for before copies are forked or run). start
// is when the restore began; again says whether the restore before it
// restored c too (forkAhead).
func (s *Sandbox) spawnCopies(c *checkpoint, start time.Time, again bool) error {
	a := s.takeAhead(c) // before procs.run, which its job holds
	s.procs.run.Lock()
	defer s.procs.run.Unlock()
	return s.spawnCopiesLocked(c, a, start, again)
}

// spawnCopiesLocked is spawnCopies once the copies forked ahead for c (a,
// or nil) are taken and procs.run is held.
// +checklocks:s.procs.run
func (s *Sandbox) spawnCopiesLocked(c *checkpoint, a *aheadCopies, start time.Time, again bool) error {
	s.procs.mu.Lock()
	tg := s.procs.tpls[c.ID]
	s.procs.mu.Unlock()
	if tg == nil {
		if a != nil {
			s.endAhead(a, true)
		}
		return fmt.Errorf("%w: the templates of checkpoint %s were released", ErrProcesses, c.ID)
	}
	tr := ptfork.NewSession()
	copies, thawed, err := s.readyCopies(tr, c, tg, a)
	if err == nil {
		// The copies share their sockets with the templates, and so did
		// the processes the restore killed: one of those, not exiting
		// yet, could accept a connection meant for the restored state and
		// reset it as it dies. They exit while the copies are readied;
		// settleKilled then waits, if need be, until they are past that
		// (or gone).
		s.settleKilled(c)
		err = s.letRun(copies)
	}
	if err == nil {
		s.foldOnce(c)
		s.forkAhead(c, start, again)
	} else {
		for _, lc := range copies {
			lc.cp.Kill()
			closeFiles(lc.stdio[:])
		}
	}
	// Marked frozen again before the templates are detached (tr.Close),
	// after failed copies are ended.
	if thawed {
		if ferr := s.setTplFrozen(tg, true); ferr != nil {
			err = errors.Join(err, ferr)
		}
	}
	if cerr := tr.Close(); cerr != nil {
		err = errors.Join(err, cerr)
	}
	return err
}

// readyCopies returns a fixed-up copy of each template of c, stopped under
// ptrace in its group: the copies forked ahead (a, if not nil) if they
// serve, else copies forked now from the templates in group tg. thawed
// says whether it thawed tg (forkCopies). Copies made are returned even on
// error, for the caller to end.
// +checklocks:s.procs.run
func (s *Sandbox) readyCopies(tr *ptfork.Session, c *checkpoint, tg *cgroup.Cgroup, a *aheadCopies) (copies []liveCopy, thawed bool, err error) {
	ahead := false
	if a != nil {
		copies = s.useAhead(tr, c, a)
		ahead = copies != nil
	}
	for {
		if copies == nil {
			// Forking counts against the pids and memory limits, which
			// the killed processes count in until they are gone.
			s.settleKilled(c)
			if copies, thawed, err = s.forkCopies(tr, c, tg); err != nil {
				return copies, thawed, err
			}
		}
		if err = fixUpAll(copies); err == nil || !ahead {
			return copies, thawed, err
		}
		// Parked, a copy is within the agent's reach (prlimit, say):
		// fresh copies instead.
		s.rt.log.Debug("template copies forked ahead could not be fixed up; forking new ones", "sandbox", s.id, "checkpoint", c.ID, "err", err)
		s.endCopies(copies)
		copies, ahead = nil, false
	}
}

// letRun detaches the ready copies, which then run: a session's shell
// becomes its session's (its stdio is cleared from copies, the session's
// now). Every copy is remembered as seen live (liveSeen), for the
// huge-page folding. Called with op held.
func (s *Sandbox) letRun(copies []liveCopy) error {
	for i, lc := range copies {
		exit := lc.exit
		if lc.t.Session != "" && exit == nil {
			exit = s.init.Conn.Watch(lc.nsPid)
		}
		if err := lc.cp.Detach(); err != nil {
			return err
		}
		if lc.t.Session != "" {
			s.adoptSession(lc.t.Session, lc.cg, lc.cp.Pid, lc.stdio, exit)
			copies[i].stdio = [3]*os.File{} // the session's now
		}
	}
	s.procs.mu.Lock()
	defer s.procs.mu.Unlock()
	if s.procs.liveSeen == nil {
		s.procs.liveSeen = map[int]uint64{}
	}
	for _, lc := range copies {
		s.procs.liveSeen[lc.cp.Pid] = 0
	}
	return nil
}

// liveCopy is a copy of a template on its way into the live state: stopped
// under ptrace, in its group.
type liveCopy struct {
	cp    *ptfork.Proc
	nsPid int
	t     procTemplate
	cg    *cgroup.Cgroup
	stdio [3]*os.File               // session: the server's ends
	exit  <-chan initproc.ExitEvent // set if the server reaps it
	led   bool                      // it leads its session already (aheadProc.led)
}

// copyGroup returns the group a copy of t goes to: the command group, or a
// new group of its own under it for a session's shell (a timeout kills what
// it runs). The copy is in the template's limit groups, the sandbox's: only
// its place in the tracking hierarchy changes.
func (s *Sandbox) copyGroup(t procTemplate) (*cgroup.Cgroup, error) {
	if t.Session == "" {
		return s.workGroup(), nil
	}
	g, err := s.subgroup("s")
	if err != nil {
		return nil, fmt.Errorf("creating cgroup: %w", err)
	}
	return g, nil
}

// forkCopies forks a copy of each template of c (in group tg) and moves it
// into its group. It thaws tg (the templates stop in ptrace first: they are
// seized with an interrupt pending); thawed says whether it did, for the
// caller to freeze it again before the templates are detached. Copies made
// are returned even on error.
// +checklocks:s.procs.run
func (s *Sandbox) forkCopies(tr *ptfork.Session, c *checkpoint, tg *cgroup.Cgroup) (copies []liveCopy, thawed bool, err error) {
	tpls := make([]*ptfork.Proc, len(c.Procs))
	for i, t := range c.Procs {
		if tpls[i], err = tr.Seize(t.HostPid); err != nil {
			if errors.Is(err, ptfork.ErrGone) || dying(t.HostPid) {
				return nil, false, lostTemplate(c, t)
			}
			return nil, false, fmt.Errorf("%w: %s: %w", ErrProcesses, t.name(), err)
		}
	}
	if err := s.setTplFrozen(tg, false); err != nil {
		return nil, false, err
	}
	for i, t := range c.Procs {
		if err := tpls[i].Wait(); err != nil {
			if errors.Is(err, ptfork.ErrGone) {
				return copies, true, lostTemplate(c, t)
			}
			return copies, true, fmt.Errorf("%w: stopping template of %s: %w", ErrProcesses, t.name(), err)
		}
		cp, nsPid, err := tpls[i].Fork()
		if err != nil {
			return copies, true, s.copyError(t.name(), err)
		}
		lc := liveCopy{cp: cp, nsPid: nsPid, t: t, exit: reapIfOurs(cp.Pid)}
		if lc.cg, err = s.copyGroup(t); err == nil {
			err = s.moveCopy(lc.cg, cp.Pid)
		}
		copies = append(copies, lc)
		if err != nil {
			return copies, true, err
		}
	}
	return copies, true, nil
}

// useAhead takes the copies forked ahead for c (a): each is seized, then
// moved into its group, which thaws it into its ptrace stop. It returns nil
// if they cannot serve (one was killed: an agent's kill -9 -1, say), having
// ended them; the caller forks copies instead.
// +checklocks:s.procs.run
func (s *Sandbox) useAhead(tr *ptfork.Session, c *checkpoint, a *aheadCopies) []liveCopy {
	copies, err := s.seizeAhead(tr, c, a)
	if err == nil {
		// The group, now empty, serves the next copies forked ahead.
		s.procs.aheadFree = a.cg
		a.closeFDs()
		return copies
	}
	s.rt.log.Debug("template copies forked ahead are lost; forking new ones", "sandbox", s.id, "checkpoint", c.ID, "err", err)
	s.endCopies(copies)
	s.endAhead(a, true)
	return nil
}

// seizeAhead seizes each copy forked ahead for c (a) and moves it into its
// group, which thaws it into its ptrace stop. It fails if one ended or was
// sent a signal while parked; the copies seized are returned even then.
func (s *Sandbox) seizeAhead(tr *ptfork.Session, c *checkpoint, a *aheadCopies) ([]liveCopy, error) {
	copies := make([]liveCopy, 0, len(a.procs))
	for i, p := range a.procs {
		if !p.alive() {
			return copies, fmt.Errorf("pid %d ended", p.pid)
		}
		cp, err := tr.Seize(p.pid)
		if err != nil {
			return copies, err
		}
		lc := liveCopy{cp: cp, nsPid: p.nsPid, t: c.Procs[i], exit: p.exit, led: p.led}
		if lc.cg, err = s.copyGroup(lc.t); err == nil {
			err = s.moveCopy(lc.cg, cp.Pid)
		}
		copies = append(copies, lc)
		if err != nil {
			return copies, err
		}
	}
	for _, lc := range copies {
		if err := lc.cp.Wait(); err != nil {
			return copies, err
		}
		// Parked, a copy is a process of the sandbox an agent can signal
		// (pkill, kill -STOP); a fresh copy has no signal pending, and
		// neither may this one.
		pending, err := lc.cp.SignalsPending()
		if err == nil && (pending || lc.cp.Signal != 0) {
			err = errors.New("a signal was sent to a copy")
		}
		if err != nil {
			return copies, err
		}
	}
	return copies, nil
}

// endCopies ends copies that will not run, and the groups made for them.
func (s *Sandbox) endCopies(copies []liveCopy) {
	for _, lc := range copies {
		lc.cp.Kill()
		closeFiles(lc.stdio[:])
		if lc.cg != nil && lc.cg != s.workGroup() {
			_ = lc.cg.Delete() // a session's, made for it
		}
	}
}

// fixUpAll fixes up each of copies (fixUp).
func fixUpAll(copies []liveCopy) error {
	for i := range copies {
		lc := &copies[i]
		var err error
		t := lc.t
		t.Leader = t.Leader && !lc.led
		if lc.stdio, err = fixUp(lc.cp, t); err != nil {
			return fmt.Errorf("%w: fixing up the copy of %s: %w", ErrProcesses, lc.t.name(), err)
		}
	}
	return nil
}

// lostTemplate is the error of a restore of c whose template of t is gone.
func lostTemplate(c *checkpoint, t procTemplate) error {
	return fmt.Errorf("%w: the frozen copy of %s kept by checkpoint %s was lost (killed after the checkpoint); the checkpoint can no longer bring it back; restore another checkpoint instead (one taken with process mode \"files\" keeps no processes)", ErrProcesses, t.name(), c.ID)
}

func closeFiles(fs []*os.File) {
	for _, f := range fs {
		if f != nil {
			f.Close()
		}
	}
}

// fixUp makes a stopped copy belong to the restored state, by system calls
// it makes itself. For a session's shell it returns the server's ends of its
// new stdin, stdout and stderr pipes.
func fixUp(cp *ptfork.Proc, t procTemplate) (stdio [3]*os.File, err error) {
	mem := &scratch{cp: cp}
	defer func() {
		if uerr := mem.release(); uerr != nil && err == nil {
			err = uerr
		}
	}()
	if err := fixUpIdentity(cp, t); err != nil {
		return stdio, err
	}
	if err := fixUpFiles(cp, t, mem); err != nil {
		return stdio, err
	}
	if t.Session == "" {
		return stdio, nil
	}
	if _, err := mem.put(""); err != nil { // scratch for pipe2's result
		return stdio, err
	}
	return sessionPipes(cp, mem.addr)
}

// scratch is a page of a stopped copy's memory for the arguments of the
// system calls injected into it, mapped when first needed (not on the
// stack: the copy may run on a stack of its own making, with live data
// below its stack pointer).
type scratch struct {
	cp   *ptfork.Proc
	addr uintptr
	ok   bool // mapped
}

const scratchSize = 4096

// put writes p, NUL-terminated, at the start of the page and returns its
// address in the copy.
func (m *scratch) put(p string) (uintptr, error) {
	b := append([]byte(p), 0)
	if len(b) > scratchSize {
		return 0, fmt.Errorf("path too long: %q", p)
	}
	if !m.ok {
		a, err := m.cp.Syscall(unix.SYS_MMAP, 0, scratchSize, unix.PROT_READ|unix.PROT_WRITE, unix.MAP_PRIVATE|unix.MAP_ANONYMOUS, ^uintptr(0), 0)
		if err != nil {
			return 0, fmt.Errorf("mapping scratch memory: %w", err)
		}
		m.addr, m.ok = a, true
	}
	return m.addr, m.cp.Write(m.addr, b)
}

// release unmaps the page, if it was mapped.
func (m *scratch) release() error {
	if !m.ok {
		return nil
	}
	if _, err := m.cp.Syscall(unix.SYS_MUNMAP, m.addr, scratchSize); err != nil {
		return fmt.Errorf("unmapping scratch memory: %w", err)
	}
	return nil
}

// fixUpIdentity gives the copy back what its template was made not to
// have: the process's dumpable flag and the lead of a session of its own.
func fixUpIdentity(cp *ptfork.Proc, t procTemplate) error {
	// A copy is born non-dumpable, as its template is kept; the process it
	// copies was dumpable (1: the flag a process can set itself; 2, set by
	// the kernel for some credential changes, cannot be, and stays 0).
	if t.Dumpable == 1 {
		if _, err := cp.Syscall(unix.SYS_PRCTL, unix.PR_SET_DUMPABLE, 1); err != nil {
			return fmt.Errorf("making the copy dumpable: %w", err)
		}
	}
	// A copy is born in its template's session; the process it copies led
	// one of its own.
	if t.Leader {
		if _, err := cp.Syscall(unix.SYS_SETSID); err != nil {
			return fmt.Errorf("setsid: %w", err)
		}
	}
	return nil
}

// fixUpFiles points the copy's working directory and the files it has open
// in the sandbox's root at the restored root: each file is reopened by path
// with the same flags, on the same fd, at the same offset.
func fixUpFiles(cp *ptfork.Proc, t procTemplate, mem *scratch) error {
	// A cwd at the root needs nothing: the root swap re-pointed the
	// template's, and the copy inherits it.
	if t.Cwd != "/" {
		a, err := mem.put(t.Cwd)
		if err != nil {
			return err
		}
		if _, err := cp.Syscall(unix.SYS_CHDIR, a); err != nil {
			return fmt.Errorf("chdir %s: %w", t.Cwd, err)
		}
	}
	for _, f := range t.Files {
		if err := reopenFile(cp, f, mem); err != nil {
			return err
		}
	}
	return nil
}

// reopenFile reopens f in the copy, on its fd, at its offset.
func reopenFile(cp *ptfork.Proc, f tplFile, mem *scratch) error {
	a, err := mem.put(f.Path)
	if err != nil {
		return err
	}
	flags := f.Flags &^ (unix.O_CREAT | unix.O_EXCL | unix.O_TRUNC | unix.O_NOCTTY)
	fdcwd := unix.AT_FDCWD
	nfd, err := cp.Syscall(unix.SYS_OPENAT, uintptr(fdcwd), a, uintptr(flags), 0)
	if err != nil {
		return fmt.Errorf("reopening %s (fd %d): %w", f.Path, f.FD, err)
	}
	if _, err := cp.Syscall(unix.SYS_DUP3, nfd, uintptr(f.FD), uintptr(f.Flags&unix.O_CLOEXEC)); err != nil {
		return fmt.Errorf("dup3 onto fd %d: %w", f.FD, err)
	}
	if _, err := cp.Syscall(unix.SYS_CLOSE, nfd); err != nil {
		return fmt.Errorf("close: %w", err)
	}
	if f.Flags&unix.O_APPEND == 0 && f.Pos > 0 {
		if _, err := cp.Syscall(unix.SYS_LSEEK, uintptr(f.FD), uintptr(f.Pos), 0); err != nil && !errors.Is(err, unix.ESPIPE) {
			return fmt.Errorf("seeking fd %d: %w", f.FD, err)
		}
	}
	return nil
}

// sessionPipes gives a copied shell fresh pipes as fds 0, 1 and 2 and
// returns the server's ends: stdin's write end, stdout's and stderr's read
// ends.
func sessionPipes(cp *ptfork.Proc, mem uintptr) (stdio [3]*os.File, err error) {
	pidfd, err := unix.PidfdOpen(cp.Pid, 0)
	if err != nil {
		return stdio, fmt.Errorf("pidfd_open: %w", err)
	}
	defer unix.Close(pidfd)
	var fds [6]int32 // r0 w0 r1 w1 r2 w2, in the copy
	for i := 0; i < 3; i++ {
		if _, err := cp.Syscall(unix.SYS_PIPE2, mem, unix.O_CLOEXEC); err != nil {
			return stdio, fmt.Errorf("pipe2: %w", err)
		}
		var b [8]byte
		if err := cp.Read(mem, b[:]); err != nil {
			return stdio, err
		}
		fds[2*i] = *(*int32)(unsafe.Pointer(&b[0]))
		fds[2*i+1] = *(*int32)(unsafe.Pointer(&b[4]))
	}
	// The copy's ends become its 0, 1, 2; ours are taken out of its table.
	mine := [3]int32{fds[0], fds[3], fds[5]}
	theirs := [3]int32{fds[1], fds[2], fds[4]}
	for i, fd := range mine {
		if _, err := cp.Syscall(unix.SYS_DUP3, uintptr(fd), uintptr(i), 0); err != nil {
			return stdio, fmt.Errorf("dup3 onto fd %d: %w", i, err)
		}
	}
	names := [3]string{"session stdin", "session stdout", "session stderr"}
	for i, fd := range theirs {
		h, err := unix.PidfdGetfd(pidfd, int(fd), 0)
		if err != nil {
			closeFiles(stdio[:])
			return [3]*os.File{}, fmt.Errorf("pidfd_getfd: %w", err)
		}
		stdio[i] = os.NewFile(uintptr(h), names[i])
	}
	for _, fd := range slices.Concat(mine[:], theirs[:]) {
		if _, err := cp.Syscall(unix.SYS_CLOSE, uintptr(fd)); err != nil {
			closeFiles(stdio[:])
			return [3]*os.File{}, fmt.Errorf("close: %w", err)
		}
	}
	return stdio, nil
}

// dropTemplates ends the templates of checkpoint id, if this sandbox holds
// them.
func (s *Sandbox) dropTemplates(id string) {
	s.dropAhead(id, false)
	s.procs.mu.Lock()
	tg := s.procs.tpls[id]
	delete(s.procs.tpls, id)
	delete(s.procs.folded, id)
	s.procs.mu.Unlock()
	if tg != nil {
		if err := tg.Delete(); err != nil {
			s.rt.log.Warn("ending process templates", "sandbox", s.id, "checkpoint", id, "err", err)
		}
	}
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

// dying reports whether pid is exiting (a template killed just now cannot
// be seized: EPERM) or gone, waiting up to 200 ms for it to get there.
func dying(pid int) bool {
	for range 20 {
		if _, err := startTime(pid); err != nil {
			return true
		}
		time.Sleep(10 * time.Millisecond)
	}
	return false
}

// procState is the state of the sandbox's checkpointed processes: the
// templates of its checkpoints (procs.go), the copies forked ahead for the
// next restore (ahead.go), and what the huge-page worker was handed
// (hugepages.go).
type procState struct {
	// mu guards the templates and the copies forked ahead.
	mu sync.Mutex
	// tpls holds the process templates of this sandbox's checkpoints, one
	// frozen cgroup per checkpoint.
	// +checklocks:mu
	tpls map[string]*cgroup.Cgroup
	// folded holds the checkpoints whose templates were handed to the
	// huge-page worker, on their first restore.
	// +checklocks:mu
	folded map[string]bool
	// ahead holds the copies forked ahead for the next restore of the
	// checkpoint restored last.
	// +checklocks:mu
	ahead *aheadCopies
	// aheadEnding holds copies forked ahead being ended in the background
	// after a checkpoint's release (endAhead).
	// +checklocks:mu
	aheadEnding []*aheadCopies
	// spareTG is the next template group, made ahead.
	// +checklocks:mu
	spareTG chan spareGroup
	// liveSeen holds the live processes checkpointed since the last
	// restore, and the copies it made: host pid -> start time (0 for a
	// copy, whose start time is not read). A process not in it is folded
	// into huge pages at its first checkpoint.
	// +checklocks:mu
	liveSeen map[int]uint64
	// restoredAt is when the last restore that brought back template
	// copies returned.
	// +checklocks:mu
	restoredAt time.Time
	// aheadTook is how long the last job forking copies ahead took.
	aheadTook atomic.Int64

	// run is held while templates are copied (one ptrace tracer at a
	// time).
	run sync.Mutex
	// aheadFree is an empty, frozen group for the next copies forked ahead:
	// the group the last ones were taken from.
	// +checklocks:run
	aheadFree *cgroup.Cgroup
	// tplFreeze is the cgroup.freeze of the template group written last,
	// kept open (setTplFrozen).
	// +checklocks:run
	tplFreeze struct {
		of *cgroup.Cgroup
		k  *cgroup.Control
	}

	// forkMu is held while a copy is forked ahead, and while the root is
	// swapped: a task being cloned during a swap would keep the old root.
	forkMu sync.Mutex
}
