package criu

// Dumping and restoring one process tree that lives inside a sandbox beside
// the sandbox's init, without dumping or recreating the sandbox's
// namespaces. See docs/CRIU.md, "Trees inside a sandbox: Swrk.DumpTree and
// Swrk.RestoreTree".
//
// CRIU 4.2.1 either dumps a namespace (and recreates it on restore) or, when
// the tree shares the namespace with criu itself, leaves it alone and lets
// the restored tree inherit criu's. So each namespace is handled so that
// the restored tree ends up in the target sandbox's:
//
//   - net, cgroup, uts, ipc: criu runs in the sandbox's (setns on a locked
//     thread before the fork and exec of `criu swrk`), so they are neither
//     dumped nor recreated. Net must be: the sandbox's net namespace comes
//     from a pool and is owned by the host user namespace, and criu refuses
//     to dump a user namespace with namespaces it does not own ("One or more
//     namespaces doesn't belong to the target user namespace"). Cgroup must
//     be: the sandbox's init sits outside its cgroup namespace's root in the
//     v1 hierarchies ("invalid cgroup configuration, /../../… is not a
//     suffix of …").
//   - pid: marked external at dump (pid[inode]:key) and handed back as an
//     inherited fd at restore; criu then forks the tree into that namespace
//     with the dumped pids (clone3 set_tid).
//   - user, mnt: criu cannot run in them (it needs host privileges and its
//     own binary). They are dumped, and afterwards the inventory image's
//     root ids are rewritten so that criu believes the tree shared its user
//     and mount namespaces; restore then joins the target's with join-ns.
//     Without the rewrite, join-ns fails (mnt: EINVAL, user: EPERM) because
//     criu also recreates the dumped namespaces, and restoring into the
//     external pid namespace from a fresh user namespace fails ("Unable to
//     create the proc file system: Operation not permitted").
//   - time: the clock image is dropped, so the tree stays in the host's time
//     namespace like its siblings instead of a fresh one owned by the host
//     user namespace (which a second dump refuses: "Can't setns …/time").
//   - Bind mounts of host device nodes (/dev/null …) are external mounts
//     (mnt[] auto-detection); cgroups are left alone (manage-cgroups ignore)
//     and the tree is placed by starting criu in the target cgroups.
//   - Unix sockets bound to a path lose the mount id criu recorded
//     (unixSocketsInRoot): the id is of the sandbox's mounts at the dump,
//     which criu would look up among the namespaces it restored.
//   - Restore runs in criu's unprivileged mode: inside the sandbox's user
//     namespace the tasks lack host CAP_NET_ADMIN, and socket restore fails
//     on SO_SNDBUFFORCE ("Unable to set socket SO_SNDBUFFORCE/SO_RCVBUFFORCE:
//     Operation not permitted") otherwise.
//
// What a dump and a restore cost (BenchmarkTreeDump, BenchmarkTreeRestore):
// docs/PERFORMANCE.md, "CRIU alone".

import (
	"bytes"
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"strconv"
	"strings"
	"time"

	"github.com/checkpoint-restore/go-criu/v7/crit"
	criucore "github.com/checkpoint-restore/go-criu/v7/crit/images/criu-core"
	"github.com/checkpoint-restore/go-criu/v7/crit/images/fdinfo"
	"github.com/checkpoint-restore/go-criu/v7/crit/images/inventory"
	"github.com/checkpoint-restore/go-criu/v7/crit/images/pstree"
	"github.com/checkpoint-restore/go-criu/v7/crit/images/seccomp"
	"github.com/checkpoint-restore/go-criu/v7/rpc"
	"golang.org/x/sys/unix"
	"google.golang.org/protobuf/proto"
)

// pidNSKey names the external pid namespace in tree images.
const pidNSKey = "sbxpid"

// TreeDumpOpts describes a dump of one process tree inside a sandbox.
type TreeDumpOpts struct {
	// Pid is the host pid of the tree's root. It must not be the init of its
	// pid namespace, and must share the pid, user and mount namespaces of
	// NSPid.
	Pid int
	// NSPid is the host pid of the sandbox's init: the namespaces the tree
	// lives in are taken from /proc/NSPid/ns.
	NSPid int
	// ImagesDir is an existing directory that receives the images and dump.log.
	ImagesDir string
	// LeaveRunning keeps the tree running after the dump instead of killing it.
	LeaveRunning bool
	// LeaveStopped leaves every task of the tree stopped (SIGSTOP) after
	// the dump, for the caller to resume with SIGCONT once it has saved
	// what must match the images (the files the tree has open).
	LeaveStopped bool
	// ExternalFiles names files the tree reaches on a mount criu cannot
	// find in the mount namespace (a detached one), as criu keys them:
	// "file[<mount id>:<inode>]", both hex. criu records only the key; the
	// restore must hand each one in (TreeRestoreOpts.Inherit).
	ExternalFiles []string
}

// Validate reports whether the options can be used.
func (o TreeDumpOpts) Validate() error {
	if o.Pid <= 0 || o.NSPid <= 0 || o.Pid == o.NSPid {
		return fmt.Errorf("%w: tree pid %d in the namespaces of %d", ErrInvalidConfig, o.Pid, o.NSPid)
	}
	if o.LeaveRunning && o.LeaveStopped {
		return fmt.Errorf("%w: leave running and leave stopped both set", ErrInvalidConfig)
	}
	if !filepath.IsAbs(o.ImagesDir) {
		return fmt.Errorf("%w: images dir %q is not absolute", ErrInvalidConfig, o.ImagesDir)
	}
	for _, k := range o.ExternalFiles {
		if !strings.HasPrefix(k, "file[") || !strings.HasSuffix(k, "]") {
			return fmt.Errorf("%w: external file key %q is not file[<mount>:<inode>]", ErrInvalidConfig, k)
		}
	}
	return nil
}

// TreeRestoreOpts describes restoring a tree dumped by DumpTree into a sandbox.
type TreeRestoreOpts struct {
	// ImagesDir holds the images of a DumpTree; restore.log is written there.
	ImagesDir string
	// NSPid is the host pid of the target sandbox's init: the tree joins the
	// pid, user, mount, net, ipc, uts and cgroup namespaces of /proc/NSPid/ns
	// and finds its files under that mount namespace's root. It may be the
	// sandbox the tree was dumped from or another one of the same image.
	NSPid int
	// Cgroups are cgroup directories (one per hierarchy, e.g.
	// /sys/fs/cgroup/memory/… and /sys/fs/cgroup/unified/…) the tree is
	// restored into: criu joins them before it forks the tree. Empty leaves
	// the tree in the caller's cgroups.
	Cgroups []string
	// Inherit hands files to the tree in place of what it had: each
	// replaces every descriptor of the dumped tree whose key it names,
	// such as "pipe:[1234]" (the link of /proc/<pid>/fd/<n> at the dump),
	// or a key of TreeDumpOpts.ExternalFiles: criu reopens that file
	// through /proc with the flags the tree had, and checks its size and
	// mode against the dump's.
	Inherit []InheritFile
	// LeaveStopped leaves every task of the tree stopped (SIGSTOP) once it
	// is restored, before it runs a single instruction of its own, for the
	// caller to finish it (a filter stacked on it) and resume it with
	// SIGCONT; StoppedTasks says which were stopped at the dump.
	LeaveStopped bool
}

// InheritFile is one file handed to a restored tree (TreeRestoreOpts.Inherit).
type InheritFile struct {
	Key  string
	File *os.File
}

// Validate reports whether the options can be used.
func (o TreeRestoreOpts) Validate() error {
	if o.NSPid <= 0 {
		return fmt.Errorf("%w: namespace pid %d", ErrInvalidConfig, o.NSPid)
	}
	if !filepath.IsAbs(o.ImagesDir) {
		return fmt.Errorf("%w: images dir %q is not absolute", ErrInvalidConfig, o.ImagesDir)
	}
	for _, c := range o.Cgroups {
		if !filepath.IsAbs(c) {
			return fmt.Errorf("%w: cgroup %q is not absolute", ErrInvalidConfig, c)
		}
	}
	return nil
}

// nsFiles holds open /proc/<pid>/ns files of one process.
type nsFiles map[string]*os.File

func openNS(pid int, names ...string) (nsFiles, error) {
	fs := nsFiles{}
	for _, n := range names {
		f, err := os.Open(fmt.Sprintf("/proc/%d/ns/%s", pid, n))
		if err != nil {
			fs.close()
			return nil, fmt.Errorf("opening %s namespace of %d: %w", n, pid, err)
		}
		fs[n] = f
	}
	return fs, nil
}

func (fs nsFiles) close() {
	for _, f := range fs {
		f.Close()
	}
}

// ino returns the inode of namespace n, its identity.
func (fs nsFiles) ino(n string) (uint64, error) {
	var st unix.Stat_t
	if err := unix.Fstat(int(fs[n].Fd()), &st); err != nil {
		return 0, fmt.Errorf("inspecting %s namespace: %w", n, err)
	}
	return st.Ino, nil
}

// inheritedNS are the namespaces criu runs in, so that it neither dumps
// them nor recreates them.
var inheritedNS = []struct {
	name string
	flag int
}{{"net", unix.CLONE_NEWNET}, {"cgroup", unix.CLONE_NEWCGROUP}, {"uts", unix.CLONE_NEWUTS}, {"ipc", unix.CLONE_NEWIPC}}

// DumpTree checkpoints the tree rooted at o.Pid, which lives inside a
// sandbox beside its init o.NSPid, into o.ImagesDir, so that RestoreTree can
// bring it back into that sandbox or another of the same image. It runs one
// `criu swrk` in the sandbox's net, cgroup, uts and ipc namespaces.
//
// The tree must hold no file outside the sandbox's mount namespace (e.g. a
// host /dev/null as stdio) and must be a session of its own.
func (w *Swrk) DumpTree(ctx context.Context, o TreeDumpOpts) error {
	if err := o.Validate(); err != nil {
		return err
	}
	ns, err := openNS(o.NSPid, "pid", "user", "mnt", "net", "cgroup", "uts", "ipc")
	if err != nil {
		return err
	}
	defer ns.close()
	if err := sameNS(o.Pid, ns, "pid", "user", "mnt"); err != nil {
		return err
	}
	pidIno, err := ns.ino("pid")
	if err != nil {
		return err
	}
	opts := &rpc.CriuOpts{
		ImagesDirFd:       proto.Int32(-1),
		ImagesDir:         proto.String(o.ImagesDir),
		Pid:               proto.Int32(int32(o.Pid)),
		LeaveRunning:      proto.Bool(o.LeaveRunning),
		LeaveStopped:      proto.Bool(o.LeaveStopped),
		NetworkLock:       rpc.CriuNetworkLockMethod_SKIP.Enum(),
		ManageCgroups:     proto.Bool(true),
		ManageCgroupsMode: rpc.CriuCgMode_IGNORE.Enum(),
		External:          append([]string{fmt.Sprintf("pid[%d]:%s", pidIno, pidNSKey), "mnt[]"}, o.ExternalFiles...),
		LogFile:           proto.String("dump.log"),
		LogLevel:          proto.Int32(2),
		// A connection still in a listening socket's queue, not accepted
		// yet, is left out of the image rather than failing the dump
		// (its client sees a reset after a restore): a frozen template's
		// socket keeps every connection made to the port since its
		// checkpoint (none of them is the checkpoint's), and one left
		// there made its image fail at shutdown; a live process's, one
		// that arrived as it was dumped.
		TcpSkipInFlight: proto.Bool(true),
		// A tree whose session or process group leader is not in it
		// (`cmd &` whose shell has exited, a job of a session's shell)
		// is saved all the same (leadOwnSession).
		ShellJob: proto.Bool(true),
	}
	log := filepath.Join(o.ImagesDir, "dump.log")
	if _, err := w.swrkIn(ctx, ns, nil, nil, rpc.CriuReqType_DUMP, opts, log); err != nil {
		return err
	}
	if err := adoptNamespaces(o.ImagesDir); err != nil {
		return fmt.Errorf("rewriting the images in %s: %w", o.ImagesDir, err)
	}
	if err := leadOwnSession(o.ImagesDir); err != nil {
		return fmt.Errorf("rewriting the images in %s: %w", o.ImagesDir, err)
	}
	if err := dropNotify(o.ImagesDir); err != nil {
		return fmt.Errorf("rewriting the seccomp filters in %s: %w", o.ImagesDir, err)
	}
	if err := unixSocketsInRoot(o.ImagesDir); err != nil {
		return fmt.Errorf("rewriting the unix sockets in %s: %w", o.ImagesDir, err)
	}
	return nil
}

// unixSocketsInRoot rewrites the unix sockets of a dump that are bound to
// a path so that a restore binds them in the mount namespace it joins, and
// drops the sizes of its regular files (below). criu
// records the id of the mount a socket's path is on and looks the mount up
// at restore among the namespaces it restored ("Unable to find the N
// mount"): the tree's mount namespace is joined, not restored, and a mount
// id is of the sandbox's mounts at the dump, not the restore's. Without
// one, criu binds the path (absolute) in the namespace it runs in, the
// sandbox's.
func unixSocketsInRoot(dir string) error {
	path := filepath.Join(dir, "files.img")
	img, err := decodeImage(path, &fdinfo.FileEntry{})
	if errors.Is(err, os.ErrNotExist) {
		return nil
	}
	if err != nil {
		return err
	}
	changed := false
	for _, e := range img.Entries {
		if u := e.Message.(*fdinfo.FileEntry).GetUsk(); u != nil && u.MntId != nil {
			u.MntId, changed = nil, true
		}
		// A file's size at the dump is not checked at restore: an image
		// made from a template is dumped in the live root (procstate,
		// image.go), where a file the process writes may have grown since
		// the checkpoint, whose files a restore brings back.
		if r := e.Message.(*fdinfo.FileEntry).GetReg(); r != nil && r.Size != nil {
			r.Size, changed = nil, true
		}
	}
	if !changed {
		return nil
	}
	return encodeImage(path, img)
}

// Returns of a seccomp filter's instructions (struct sock_filter: u16 code,
// u8 jt, u8 jf, u32 k; little-endian).
const (
	bpfRetK          = 0x06 // BPF_RET|BPF_K
	seccompRetNotify = 0x7fc00000
	seccompRetAllow  = 0x7fff0000
	bpfInsnLen       = 8
)

// dropNotify rewrites the seccomp filters of a dump so that the calls they
// hand to a listener (the sandbox's init, which answers a command's calls
// that reach other processes: see dg-init's SECCOMP.md) are allowed. criu
// restores a filter without its listener, and the kernel fails every call
// a filter hands to no listener with ENOSYS: kill(2) among them. A restore
// stacks a filter with a listener of its own on every process it brings
// back (sandbox/procstate, guard.go). Such a filter, whose every answer is
// to allow or to hand over, allows everything once rewritten: it is
// replaced by a single "allow", so that restoring and dumping a process
// again and again adds an instruction to its filters, not a filter's worth.
func dropNotify(dir string) error {
	path := filepath.Join(dir, "seccomp.img")
	img, err := decodeImage(path, &seccomp.SeccompEntry{})
	if errors.Is(err, os.ErrNotExist) {
		return nil // no filter
	}
	if err != nil {
		return err
	}
	changed := false
	for _, e := range img.Entries {
		for _, f := range e.Message.(*seccomp.SeccompEntry).GetSeccompFilters() {
			prog, handsOnly, ok := allowNotify(f.GetFilter())
			if !ok {
				continue
			}
			changed = true
			if handsOnly {
				prog = binary.LittleEndian.AppendUint32([]byte{bpfRetK, 0, 0, 0}, seccompRetAllow)
			}
			f.Filter = prog
		}
	}
	if !changed {
		return nil
	}
	return encodeImage(path, img)
}

// allowNotify returns prog with every "return SECCOMP_RET_USER_NOTIF"
// made "return SECCOMP_RET_ALLOW", whether every return of prog was one of
// the two (then the program allows everything), and whether it changed
// anything.
func allowNotify(prog []byte) (out []byte, handsOnly, changed bool) {
	if len(prog)%bpfInsnLen != 0 {
		return nil, false, false
	}
	out = bytes.Clone(prog)
	handsOnly = true
	for i := 0; i < len(out); i += bpfInsnLen {
		code := binary.LittleEndian.Uint16(out[i:])
		if code&0x07 != 0x06 { // BPF_CLASS: not a return
			continue
		}
		k := binary.LittleEndian.Uint32(out[i+4:])
		switch {
		case code == bpfRetK && k == seccompRetNotify:
			binary.LittleEndian.PutUint32(out[i+4:], seccompRetAllow)
			changed = true
		case code == bpfRetK && k == seccompRetAllow:
		default:
			handsOnly = false
		}
	}
	return out, handsOnly, changed
}

// RestoreTree recreates a tree saved by DumpTree inside the sandbox whose
// init is o.NSPid and returns the host pid of its root. The tree keeps its
// dumped pids inside the sandbox's pid namespace, so they must be free
// there (kill the original first when restoring into the same sandbox).
// The root is restored as a child of the caller (rst_sibling), who must reap
// it; inside the sandbox its parent pid is 0.
func (w *Swrk) RestoreTree(ctx context.Context, o TreeRestoreOpts) (int, error) {
	if err := o.Validate(); err != nil {
		return 0, err
	}
	ns, err := openNS(o.NSPid, "pid", "user", "mnt", "net", "cgroup", "uts", "ipc")
	if err != nil {
		return 0, err
	}
	defer ns.close()
	if err := clearSocketFiles(o.ImagesDir, o.NSPid); err != nil {
		return 0, err
	}
	// criu's fds: 3 is the RPC socket, then the pid, user and mnt namespaces.
	extra := []*os.File{ns["pid"], ns["user"], ns["mnt"]}
	inherit := []*rpc.InheritFd{{Key: proto.String(pidNSKey), Fd: proto.Int32(4)}}
	for i, f := range o.Inherit {
		extra = append(extra, f.File)
		inherit = append(inherit, &rpc.InheritFd{Key: proto.String(f.Key), Fd: proto.Int32(int32(7 + i))})
	}
	opts := &rpc.CriuOpts{
		ImagesDirFd:       proto.Int32(-1),
		ImagesDir:         proto.String(o.ImagesDir),
		ManageCgroups:     proto.Bool(true),
		ManageCgroupsMode: rpc.CriuCgMode_IGNORE.Enum(),
		RstSibling:        proto.Bool(true),
		// The tree's tasks run in the sandbox's user namespace, where
		// SO_SNDBUFFORCE/SO_RCVBUFFORCE (host CAP_NET_ADMIN) fail and any
		// socket's restore with them; unprivileged mode sets the plain
		// SO_SNDBUF/SO_RCVBUF instead.
		Unprivileged: proto.Bool(true),
		InheritFd:    inherit,
		LeaveStopped: proto.Bool(o.LeaveStopped),
		LogFile:      proto.String("restore.log"),
		LogLevel:     proto.Int32(2),
	}
	join := func(pid int) {
		// The restored root opens these itself, before it drops anything;
		// criu's own fds are reachable through its /proc entry.
		opts.JoinNs = []*rpc.JoinNamespace{
			{Ns: proto.String("mnt"), NsFile: proto.String(fmt.Sprintf("/proc/%d/fd/6", pid))},
			{Ns: proto.String("user"), NsFile: proto.String(fmt.Sprintf("/proc/%d/fd/5", pid))},
		}
	}
	log := filepath.Join(o.ImagesDir, "restore.log")
	resp, err := w.swrkIn(ctx, ns, extra, func(pid int) error {
		join(pid)
		for _, c := range o.Cgroups {
			if err := os.WriteFile(filepath.Join(c, "cgroup.procs"), []byte(strconv.Itoa(pid)), 0); err != nil {
				return fmt.Errorf("moving criu into cgroup %s: %w", c, err)
			}
		}
		return nil
	}, rpc.CriuReqType_RESTORE, opts, log)
	if err != nil {
		return 0, err
	}
	return int(resp.GetRestore().GetPid()), nil
}

// taskStopped is criu's TASK_STOPPED, a core image's task state.
const taskStopped = 3

// StoppedTasks returns the pids (in the tree's pid namespace) of the tasks
// a dump in dir saved stopped.
func StoppedTasks(dir string) (map[int]bool, error) {
	tree, err := decodeImage(filepath.Join(dir, "pstree.img"), &pstree.PstreeEntry{})
	if err != nil {
		return nil, err
	}
	out := map[int]bool{}
	for _, e := range tree.Entries {
		pid := e.Message.(*pstree.PstreeEntry).GetPid()
		core, err := decodeImage(filepath.Join(dir, fmt.Sprintf("core-%d.img", pid)), &criucore.CoreEntry{})
		if err != nil {
			return nil, err
		}
		if len(core.Entries) == 0 {
			return nil, fmt.Errorf("empty core image of task %d", pid)
		}
		if core.Entries[0].Message.(*criucore.CoreEntry).GetTc().GetTaskState() == taskStopped {
			out[int(pid)] = true
		}
	}
	return out, nil
}

// sameNS checks that pid shares the named namespaces of ns.
func sameNS(pid int, ns nsFiles, names ...string) error {
	for _, n := range names {
		want, err := ns.ino(n)
		if err != nil {
			return err
		}
		var st unix.Stat_t
		if err := unix.Stat(fmt.Sprintf("/proc/%d/ns/%s", pid, n), &st); err != nil {
			return fmt.Errorf("inspecting %s namespace of %d: %w", n, pid, err)
		}
		if st.Ino != want {
			return fmt.Errorf("%w: %d is not in the %s namespace of the sandbox", ErrInvalidConfig, pid, n)
		}
	}
	return nil
}

// swrkIn runs one `criu swrk` request with criu in the net, cgroup, uts and
// ipc namespaces of ns. extra are passed to criu as fds 4, 5, …; started,
// if set, runs with criu's pid before the request is sent.
func (w *Swrk) swrkIn(ctx context.Context, ns nsFiles, extra []*os.File, started func(pid int) error,
	typ rpc.CriuReqType, opts *rpc.CriuOpts, log string) (*rpc.CriuResp, error) {
	if err := ctx.Err(); err != nil {
		return nil, err
	}
	pair, err := unix.Socketpair(unix.AF_UNIX, unix.SOCK_SEQPACKET|unix.SOCK_CLOEXEC, 0)
	if err != nil {
		return nil, fmt.Errorf("criu %s: socket pair: %w", typ, err)
	}
	ours := os.NewFile(uintptr(pair[0]), "criu-swrk")
	theirs := os.NewFile(uintptr(pair[1]), "criu-swrk-child")
	defer ours.Close()
	cmd := exec.Command(w.bin, "swrk", "3")
	if w.features != "" {
		cmd.Env = append(os.Environ(), "XDG_RUNTIME_DIR="+w.features)
	}
	cmd.ExtraFiles = append([]*os.File{theirs}, extra...)
	cmd.Stdout, cmd.Stderr = nil, nil
	run := ""
	if typ == rpc.CriuReqType_DUMP && w.features != "" && w.mayCoverRun(opts.GetImagesDir()) {
		run = filepath.Join(w.features, "run")
	}
	err = startInNS(cmd, ns, run)
	theirs.Close()
	if err != nil {
		return nil, fmt.Errorf("criu %s: starting criu swrk in the sandbox's namespaces: %w", typ, err)
	}
	done := make(chan struct{})
	defer func() {
		// swrk exits once the socket closes; never leave it behind.
		ours.Close()
		select {
		case <-done:
		case <-time.After(10 * time.Second):
			_ = cmd.Process.Kill()
			<-done
		}
	}()
	go func() { _ = cmd.Wait(); close(done) }()
	if started != nil {
		if err := started(cmd.Process.Pid); err != nil {
			return nil, fmt.Errorf("criu %s: %w", typ, err)
		}
	}
	stop := context.AfterFunc(ctx, func() { _ = ours.SetDeadline(time.Now()) })
	defer stop()
	return exchange(ours, typ, opts, log, w.keep)
}

// init keeps the main goroutine on the main thread (an init's LockOSThread does), so that
// startInNS never runs there: the main thread never ends, and one left in a sandbox's
// namespaces, or in a private copy of the mount namespace, would stay so.
func init() { runtime.LockOSThread() }

// startInNS starts cmd from a thread that has entered the namespaces of ns
// that criu must share with the tree. The thread is never unlocked, so the
// Go runtime ends it instead of reusing it elsewhere.
//
// With run set, criu runs in a private copy of the host's mount namespace
// with run (a directory on the runtime's tmpfs) over /run: a privileged criu
// keeps its kernel feature cache only in /run/criu.kdat and only on a tmpfs,
// and probing again costs a dump most of its time (the probes of a root
// criu make network namespaces). The host's /run is never written. Should
// the copy fail, criu runs where it would have and probes.
func startInNS(cmd *exec.Cmd, ns nsFiles, run string) error {
	errc := make(chan error, 1)
	go func() {
		runtime.LockOSThread()
		for _, n := range inheritedNS {
			if err := unix.Setns(int(ns[n.name].Fd()), n.flag); err != nil {
				errc <- fmt.Errorf("entering %s namespace: %w", n.name, err)
				return
			}
		}
		if run != "" {
			overRun(run)
		}
		errc <- cmd.Start()
	}()
	return <-errc
}

// maxCopiedMounts bounds the mounts a dump's private mount namespace copies. The copy costs
// about a microsecond a mount, all of it under the kernel's lock on every mount namespace, which
// stalls every sandbox's mounts meanwhile: past the bound, a dump probes the kernel instead.
const maxCopiedMounts = 2000

// mayCoverRun says whether a dump with its images in images may run with the feature cache
// over /run: not when that would hide what criu needs (its images, the wrapper) or copy too
// many mounts.
func (w *Swrk) mayCoverRun(images string) bool {
	if w.hostMounts != nil && w.hostMounts() > maxCopiedMounts {
		return false
	}
	for _, p := range []string{images, w.bin} {
		real, err := filepath.EvalSymlinks(p)
		if err != nil || real == "/run" || strings.HasPrefix(real, "/run/") {
			return false
		}
	}
	return true
}

// overRun puts the calling thread, which must be locked and never unlocked,
// in a private copy of its mount namespace with dir over /run.
func overRun(dir string) {
	if fi, err := os.Lstat(dir); err != nil || !fi.IsDir() {
		return
	}
	// CLONE_FS: a Go thread shares its filesystem information with the
	// process's other threads, which no mount namespace can be changed under.
	if unix.Unshare(unix.CLONE_FS|unix.CLONE_NEWNS) != nil {
		return
	}
	if unix.Mount("", "/", "", unix.MS_REC|unix.MS_PRIVATE, "") != nil {
		return
	}
	_ = unix.Mount(dir, "/run", "", unix.MS_BIND, "")
}

// rpcFile is the caller's end of a swrk socket pair.
type rpcFile interface {
	Read([]byte) (int, error)
	Write([]byte) (int, error)
}

// exchange sends one request and answers notifications until the final response.
// A failed request's error names keep's copy of the log, if keep is set.
func exchange(c rpcFile, typ rpc.CriuReqType, opts *rpc.CriuOpts, log string, keep *logKeeper) (*rpc.CriuResp, error) {
	req := &rpc.CriuReq{Type: typ.Enum(), Opts: opts}
	buf := make([]byte, maxMsg)
	for {
		b, err := proto.Marshal(req)
		if err != nil {
			return nil, fmt.Errorf("encoding criu %s request: %w", typ, err)
		}
		if _, err := c.Write(b); err != nil {
			return nil, fmt.Errorf("sending criu %s request: %w", typ, err)
		}
		n, err := c.Read(buf)
		if err != nil {
			return nil, fmt.Errorf("reading criu %s response (see %s): %w", typ, log, err)
		}
		if n == 0 {
			return nil, fmt.Errorf("reading criu %s response (see %s): %w: criu exited", typ, log, ErrRequest)
		}
		resp := &rpc.CriuResp{}
		if err := proto.Unmarshal(buf[:n], resp); err != nil {
			return nil, fmt.Errorf("decoding criu %s response: %w", typ, err)
		}
		if !resp.GetSuccess() {
			return nil, requestError(typ, resp, log, keep)
		}
		if resp.GetType() != rpc.CriuReqType_NOTIFY {
			return resp, nil
		}
		req = &rpc.CriuReq{Type: rpc.CriuReqType_NOTIFY.Enum(), NotifySuccess: proto.Bool(true)}
	}
}

// requestError is the error of a failed request: the cause criu's log
// gives first, past the lines every run here logs, then the log's path (a
// kept copy, if keep is set). criu's own message (CrErrmsg) is its first
// error line, which here is one of those.
func requestError(typ rpc.CriuReqType, resp *rpc.CriuResp, log string, keep *logKeeper) error {
	causes := logErrors(log)
	if len(causes) == 0 {
		causes = []string{strings.TrimSpace(resp.GetCrErrmsg())}
	}
	if keep != nil {
		if kept, err := keep.keep(log, typ.String()); err == nil {
			log = kept
		}
	}
	return &RequestError{Request: typ.String(), Causes: causes, Errno: int(resp.GetCrErrno()), Log: log}
}

// RequestError is a request criu answered with a failure (ErrRequest).
type RequestError struct {
	Request string   // DUMP, RESTORE
	Causes  []string // its log's first error lines, the cause first
	Errno   int
	Log     string // where its log is
}

func (e *RequestError) Error() string {
	return fmt.Sprintf("criu %s: %v: %s (errno %d; criu's log: %s)", e.Request, ErrRequest, strings.Join(e.Causes, "; "), e.Errno, e.Log)
}

// Unwrap makes the error ErrRequest.
func (e *RequestError) Unwrap() error { return ErrRequest }

// Brief is the causes and the log, for a reason shown beside a process.
func (e *RequestError) Brief() string {
	return fmt.Sprintf("%s (CRIU's log: %s)", strings.Join(e.Causes, "; "), e.Log)
}

// logErrors returns the first error lines of a criu log that are not the
// harmless ones every run logs here, without criu's prefix (Error
// (file:line):), most specific first: criu logs the cause, then what
// failed because of it.
func logErrors(log string) []string {
	b, err := os.ReadFile(log)
	if err != nil {
		return nil
	}
	var out []string
	for _, l := range strings.Split(string(b), "\n") {
		if !strings.Contains(l, "Error") || harmless(l) {
			continue
		}
		if i := strings.Index(l, "):"); i >= 0 && strings.Contains(l[:i], "Error (") {
			l = l[i+2:]
		}
		out = append(out, strings.TrimSpace(l))
		if len(out) == 3 {
			break
		}
	}
	return out
}

// harmless tells the error lines every criu run logs here, which cause
// nothing: it cannot raise its own descriptor limit in the sandbox's user
// namespace, and iptables tables it looks for are not there.
func harmless(line string) bool {
	return strings.Contains(line, "RLIMIT_NOFILE") || strings.Contains(line, "tables")
}

// adoptNamespaces rewrites the inventory of a tree dump so that the tree's
// user and mount namespaces count as criu's own: restore then neither
// recreates them nor refuses to join existing ones.
func adoptNamespaces(dir string) error {
	tree, err := decodeImage(filepath.Join(dir, "pstree.img"), &pstree.PstreeEntry{})
	if err != nil {
		return err
	}
	if len(tree.Entries) == 0 {
		return errors.New("empty pstree image")
	}
	root := tree.Entries[0].Message.(*pstree.PstreeEntry).GetPid()
	ids, err := decodeImage(filepath.Join(dir, fmt.Sprintf("ids-%d.img", root)), &criucore.TaskKobjIdsEntry{})
	if err != nil {
		return err
	}
	if len(ids.Entries) == 0 {
		return errors.New("empty ids image")
	}
	tid := ids.Entries[0].Message.(*criucore.TaskKobjIdsEntry)
	invPath := filepath.Join(dir, "inventory.img")
	inv, err := decodeImage(invPath, &inventory.InventoryEntry{})
	if err != nil {
		return err
	}
	if len(inv.Entries) == 0 {
		return errors.New("empty inventory image")
	}
	ie := inv.Entries[0].Message.(*inventory.InventoryEntry)
	if ie.RootIds == nil {
		return errors.New("inventory has no root ids")
	}
	ie.RootIds.UserNsId = proto.Uint32(tid.GetUserNsId())
	ie.RootIds.MntNsId = proto.Uint32(tid.GetMntNsId())
	if err := encodeImage(invPath, inv); err != nil {
		return err
	}
	// Without clock values criu restores the tree in the time namespace it
	// runs in (the host's, like the sandbox) instead of a fresh one that it
	// owns, which would keep the tree's monotonic clock from dump time but
	// make it unlike its siblings and refuse a second dump ("Can't setns
	// …/time").
	// A missing image is what criu reads as "not dumped".
	err = os.Remove(filepath.Join(dir, "timens-0.img"))
	if errors.Is(err, os.ErrNotExist) {
		return nil
	}
	return err
}

// TreeThreads lists the ids of the threads of the tree dumped in dir, as
// its pid namespace numbers them, the processes' own ids among them: a
// restore gives each its id back, so none may be taken.
func TreeThreads(dir string) ([]int, error) {
	tree, err := decodeImage(filepath.Join(dir, "pstree.img"), &pstree.PstreeEntry{})
	if err != nil {
		return nil, err
	}
	var out []int
	for _, e := range tree.Entries {
		p := e.Message.(*pstree.PstreeEntry)
		out = append(out, int(p.GetPid()))
		for _, t := range p.GetThreads() {
			if int(t) != int(p.GetPid()) {
				out = append(out, int(t))
			}
		}
	}
	return out, nil
}

// leadOwnSession rewrites the process tree image of a dump so that the
// tree's root leads the session and the process group of every process
// whose leader is not in the tree: the root of `cmd &`, whose shell has
// exited, is in the shell's session and group; a job of a session's shell,
// in the shell's session. criu dumps such a tree only as a shell job, and
// restores one only into its own session and group, which are outside the
// sandbox's pid namespace. Restored, the tree is as a background command
// is: a session of its own, led by its root.
func leadOwnSession(dir string) error {
	path := filepath.Join(dir, "pstree.img")
	tree, err := decodeImage(path, &pstree.PstreeEntry{})
	if err != nil {
		return err
	}
	if len(tree.Entries) == 0 {
		return errors.New("empty pstree image")
	}
	in := map[uint32]bool{}
	for _, e := range tree.Entries {
		in[e.Message.(*pstree.PstreeEntry).GetPid()] = true
	}
	root := tree.Entries[0].Message.(*pstree.PstreeEntry).GetPid()
	changed := false
	for i, e := range tree.Entries {
		p := e.Message.(*pstree.PstreeEntry)
		if !in[p.GetSid()] {
			p.Sid, changed = proto.Uint32(root), true
			if i == 0 {
				p.Pgid = proto.Uint32(root) // a session's leader leads a group
			}
		}
		if !in[p.GetPgid()] {
			p.Pgid, changed = proto.Uint32(root), true
		}
	}
	if !changed {
		return nil
	}
	return encodeImage(path, tree)
}

// encodeImage replaces the image at path with img.
func encodeImage(path string, img *crit.CriuImage) error {
	tmp := path + ".tmp"
	f, err := os.Create(tmp)
	if err != nil {
		return err
	}
	err = crit.New(nil, f, "", false, false).Encode(img)
	if cerr := f.Close(); err == nil {
		err = cerr
	}
	if err != nil {
		os.Remove(tmp)
		return fmt.Errorf("encoding %s: %w", filepath.Base(path), err)
	}
	return os.Rename(tmp, path)
}

func decodeImage(path string, entry proto.Message) (*crit.CriuImage, error) {
	f, err := os.Open(path)
	if err != nil {
		return nil, err
	}
	defer f.Close()
	img, err := crit.New(f, nil, "", false, false).Decode(entry)
	if err != nil {
		return nil, fmt.Errorf("decoding %s: %w", filepath.Base(path), err)
	}
	return img, nil
}

// CgroupDirs returns the cgroup directories of pid on this host's layout
// (v1 controllers under /sys/fs/cgroup/<controller>, cgroup2 under
// /sys/fs/cgroup/unified or /sys/fs/cgroup), as seen from the caller's
// cgroup namespace, for the hierarchies in which pid is not at the root.
// It is what TreeRestoreOpts.Cgroups wants for "beside pid".
func CgroupDirs(pid int) ([]string, error) {
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/cgroup", pid))
	if err != nil {
		return nil, fmt.Errorf("reading cgroups of %d: %w", pid, err)
	}
	var dirs []string
	for _, l := range strings.Split(strings.TrimSpace(string(b)), "\n") {
		f := strings.SplitN(l, ":", 3)
		if len(f) != 3 || f[2] == "/" || strings.HasPrefix(f[1], "name=") {
			continue
		}
		var base string
		switch f[1] {
		case "":
			base = "/sys/fs/cgroup/unified"
			if _, err := os.Stat(base); err != nil {
				base = "/sys/fs/cgroup"
			}
		default:
			base = filepath.Join("/sys/fs/cgroup", f[1])
			if _, err := os.Stat(base); err != nil {
				// Joined controllers are mounted as e.g. cpu,cpuacct.
				continue
			}
		}
		dirs = append(dirs, filepath.Join(base, f[2]))
	}
	return dirs, nil
}
