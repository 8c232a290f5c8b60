// Package launch starts the resident init of a sandbox in its namespaces.
//
// Four costs shape it:
//   - A new mount namespace copies every mount of its parent. The server's
//     mount namespace holds a tmpfs per live layer, so inits are not cloned
//     from it but from a minimal "spawn" mount namespace (a tmpfs root
//     holding only the static init binary, /proc and a few device nodes).
//   - A Go os/exec into a new user namespace is far slower than a clone.
//     A zygote (`dg-init --zygote`, started once in the spawn namespace)
//     clones each new init with one C clone() and writes its id maps; the
//     clone needs no exec, it runs the init's main directly.
//   - A new net namespace is slow to make and is torn down asynchronously:
//     NetPool keeps ready namespaces (loopback up); the zygote enters one
//     before the clone, so the init is born in it.
//   - The user namespace maps the sandbox's uid 0..65535 onto a host range
//     of its own, so root inside is not root outside.
//
// The root swap is done from outside: the caller's thread enters the
// sandbox's mount namespace, swaps the root and comes back (Init.Swap), and
// long-lived worker threads detach the replaced roots afterwards.
package launch

import (
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"sync"
	"time"

	"golang.org/x/sys/unix"

	"github.com/deltagym/deltagym/sandbox/cpupin"
	"github.com/deltagym/deltagym/sandbox/initproc"
)

// IDRange is the size of each sandbox's uid and gid range.
const IDRange = 65536

// SpawnNS is a minimal mount namespace that inits are cloned from, by a
// zygote (`dg-init --zygote`) living in it.
type SpawnNS struct {
	fd     int // /proc/thread-self/ns/mnt of the namespace
	zygote *initproc.Conn
	zcmd   *exec.Cmd
	once   sync.Once
}

// NewSpawnNS creates the spawn namespace. initBinary is the path of the
// static dg-init program on the host; it is copied into the namespace.
func NewSpawnNS(initBinary string) (*SpawnNS, error) {
	bin, err := os.ReadFile(initBinary)
	if err != nil {
		return nil, fmt.Errorf("reading init binary: %w", err)
	}
	type result struct {
		fd  int
		err error
	}
	ch := make(chan result, 1)
	go func() {
		// This thread's namespaces are changed for good: it is never
		// unlocked, so the runtime ends it when the goroutine returns.
		runtime.LockOSThread()
		fd, err := buildSpawnNS(bin)
		ch <- result{fd, err}
	}()
	r := <-ch
	if r.err != nil {
		return nil, fmt.Errorf("building spawn namespace: %w", r.err)
	}
	s := &SpawnNS{fd: r.fd}
	if err := s.startZygote(); err != nil {
		unix.Close(s.fd)
		return nil, err
	}
	return s, nil
}

func (s *SpawnNS) startZygote() error {
	pair, err := unix.Socketpair(unix.AF_UNIX, unix.SOCK_SEQPACKET|unix.SOCK_CLOEXEC, 0)
	if err != nil {
		return fmt.Errorf("zygote socket: %w", err)
	}
	if err := unix.SetNonblock(pair[0], true); err != nil {
		unix.Close(pair[0])
		unix.Close(pair[1])
		return err
	}
	ours := os.NewFile(uintptr(pair[0]), "zygote-control")
	theirs := os.NewFile(uintptr(pair[1]), "zygote-control-child")
	defer theirs.Close()
	// os/exec would open /dev/null inside the spawn namespace, which has
	// none: give it the host's.
	devnull, err := os.OpenFile(os.DevNull, os.O_RDWR, 0)
	if err != nil {
		ours.Close()
		return err
	}
	defer devnull.Close()
	cmd := &exec.Cmd{
		Path:       "/dg-init",
		Args:       []string{"dg-init", "--zygote"},
		Env:        []string{"PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"},
		ExtraFiles: []*os.File{theirs},
		Stdin:      devnull,
		Stdout:     devnull,
		Stderr:     os.Stderr,
	}
	errc := make(chan error, 1)
	go func() {
		runtime.LockOSThread() // never unlocked: the thread's namespaces are changed for good
		errc <- s.startLocked(cmd)
	}()
	if err := <-errc; err != nil {
		ours.Close()
		return err
	}
	theirs.Close()
	s.zcmd = cmd
	if s.zygote, err = initproc.NewConn(ours); err != nil {
		ours.Close()
		_ = cmd.Process.Kill()
		_ = cmd.Wait()
		return fmt.Errorf("starting zygote: %w", err)
	}
	return nil
}

func buildSpawnNS(bin []byte) (int, error) {
	// The locked thread may be the process's main thread, which the
	// runtime keeps instead of ending it, and which /proc/self shows: go
	// back to the host's namespace once done.
	home, err := unix.Open("/proc/thread-self/ns/mnt", unix.O_RDONLY|unix.O_CLOEXEC, 0)
	if err != nil {
		return -1, err
	}
	defer unix.Close(home)
	// The spawn root is mounted on a temporary directory of the host's,
	// which is removed from the host's namespace: once the new one has
	// pivoted away from it, the host's path is no longer its own.
	dir, err := os.MkdirTemp("", "dg-spawn-")
	if err != nil {
		return -1, err
	}
	fd, err := buildSpawnNSIn(bin, dir)
	if err := unix.Setns(home, unix.CLONE_NEWNS); err != nil {
		panic(fmt.Sprintf("leaving the spawn namespace: %v", err))
	}
	if rerr := os.Remove(dir); rerr != nil && err == nil {
		unix.Close(fd)
		return -1, rerr
	}
	return fd, err
}

func buildSpawnNSIn(bin []byte, dir string) (int, error) {
	if err := unix.Unshare(unix.CLONE_FS | unix.CLONE_NEWNS); err != nil {
		return -1, fmt.Errorf("unshare: %w", err)
	}
	if err := unix.Mount("", "/", "", unix.MS_REC|unix.MS_PRIVATE, ""); err != nil {
		return -1, fmt.Errorf("making mounts private: %w", err)
	}
	if err := unix.Mount("tmpfs", dir, "tmpfs", unix.MS_NOSUID, "mode=755,size=4m"); err != nil {
		return -1, fmt.Errorf("mounting spawn root: %w", err)
	}
	if err := os.WriteFile(filepath.Join(dir, "dg-init"), bin, 0o755); err != nil {
		return -1, err
	}
	for _, d := range []string{"proc", "dev", ".devsrc", "old"} {
		if err := os.Mkdir(filepath.Join(dir, d), 0o755); err != nil {
			return -1, err
		}
	}
	// A tmpfs of its own, so that each sandbox's /dev binds the root of a
	// superblock: CRIU takes a bind of a directory below one for a mount
	// it cannot restore.
	if err := unix.Mount("dg-dev", filepath.Join(dir, ".devsrc"), "tmpfs", unix.MS_NOSUID, "mode=755,size=64k"); err != nil {
		return -1, fmt.Errorf("mounting the /dev tree: %w", err)
	}
	if err := buildDevTree(filepath.Join(dir, ".devsrc")); err != nil {
		return -1, err
	}
	// A proc of the host's pid namespace: the kernel lets a user namespace
	// mount its own proc only where a fully visible one exists already.
	if err := unix.Mount("proc", filepath.Join(dir, "proc"), "proc", unix.MS_NOSUID|unix.MS_NODEV|unix.MS_NOEXEC, ""); err != nil {
		return -1, fmt.Errorf("mounting proc: %w", err)
	}
	if err := unix.PivotRoot(dir, filepath.Join(dir, "old")); err != nil {
		return -1, fmt.Errorf("pivot_root: %w", err)
	}
	if err := unix.Chdir("/"); err != nil {
		return -1, err
	}
	if err := unix.Unmount("/old", unix.MNT_DETACH); err != nil {
		return -1, fmt.Errorf("detaching host root: %w", err)
	}
	if err := os.Remove("/old"); err != nil {
		return -1, err
	}
	return unix.Open("/proc/thread-self/ns/mnt", unix.O_RDONLY|unix.O_CLOEXEC, 0)
}

// buildDevTree fills dir with the /dev every sandbox sees: the host's
// harmless device nodes (bound onto empty files), the standard symlinks,
// and the mount points of /dev/shm and /dev/pts. Each init binds the tree
// on its /dev instead of mounting a tmpfs of its own there: a superblock
// costs every memory cgroup on the machine a slot in the kernel's shrinker
// tables (mm/shrinker.c: a KiB for each 64 superblocks, in each group), so
// superblocks a sandbox adds make each sandbox dearer as they multiply.
// The tree belongs to the host's root, which sandboxes see as nobody, and
// each init seals its bind read-only.
func buildDevTree(dir string) error {
	for _, d := range []string{"null", "zero", "full", "random", "urandom", "tty"} {
		p := filepath.Join(dir, d)
		if err := os.WriteFile(p, nil, 0o666); err != nil {
			return err
		}
		if err := unix.Mount("/dev/"+d, p, "", unix.MS_BIND, ""); err != nil {
			return fmt.Errorf("binding /dev/%s: %w", d, err)
		}
	}
	for name, target := range map[string]string{"fd": "/proc/self/fd", "stdin": "/proc/self/fd/0", "stdout": "/proc/self/fd/1", "stderr": "/proc/self/fd/2"} {
		if err := os.Symlink(target, filepath.Join(dir, name)); err != nil {
			return err
		}
	}
	for name, mode := range map[string]os.FileMode{"shm": 0o777 | os.ModeSticky, "pts": 0o755} {
		p := filepath.Join(dir, name)
		if err := os.Mkdir(p, mode); err != nil {
			return err
		}
		if err := os.Chmod(p, mode); err != nil { // past the umask
			return err
		}
	}
	return nil
}

// Close stops the zygote and releases the namespace. Inits cloned from it
// live on until their own control sockets close. Close is idempotent.
func (s *SpawnNS) Close() error {
	var err error
	s.once.Do(func() {
		err = s.zygote.Close()
		err = errors.Join(err, ignoreExit(s.zcmd.Wait()))
		err = errors.Join(err, unix.Close(s.fd))
	})
	return err
}

func ignoreExit(err error) error {
	var ee *exec.ExitError
	if errors.As(err, &ee) {
		return nil
	}
	return err
}

// Config describes one init to start.
type Config struct {
	// HostID is the first host uid and gid of the sandbox's range.
	HostID int
	// NetNS is an fd of the net namespace to start in (from a NetPool).
	NetNS int
	// Hostname is the sandbox's host name (its uts namespace).
	Hostname string
}

// Init is a started resident init.
type Init struct {
	Conn *initproc.Conn
	// Pid is the init's pid in the host's pid namespace.
	Pid    int
	done   chan struct{}
	status unix.WaitStatus
	once   sync.Once
	// detached receives the outcome of the previous swap's detach of the
	// old root, which finishes after Swap returns; the next Swap waits.
	detached chan error
	// gone is closed once the previous swap's old root is detached.
	goneMu sync.Mutex
	// +checklocks:goneMu
	gone chan struct{}
}

// MovedMounts are the mounts of a sandbox's namespace that Swap moves onto
// each new root (relative to the root).
var MovedMounts = []string{"proc", "dev"}

// Swap makes the detached mount mountFD the sandbox's root. The calling
// goroutine's thread enters the sandbox's mount namespace, stacks the mount
// on the current root, moves /proc and /dev into it, pivot_roots onto it
// and comes back. pivot_root re-points every task whose root or cwd is the
// old root; others (cwd below /, open fds) keep reaching the old mount,
// which is the caller's to handle. The caller keeps ownership of mountFD.
//
// The detach of the old root is the slow part (the kernel waits for an RCU
// grace period) and changes nothing the sandbox can see (the old root sits
// on top of the new one, above every task's root), so a worker detaches it
// after Swap returns. Swaps of one init are serialised by the caller; each
// waits for the previous detach.
//
// The swap runs on the caller's thread, not on a worker's: handing it to a
// locked worker thread and back costs more in the Go scheduler's hand-overs
// than the swap itself.
func (in *Init) Swap(mountFD int) error {
	if in.detached != nil {
		err := <-in.detached
		in.detached = nil
		if err != nil {
			return fmt.Errorf("detaching the previous root: %w", err)
		}
	}
	// The namespace is opened for the swap and its detach (which closes
	// it): an idle sandbox holds no descriptor of it.
	mntns, err := in.NS(unix.PIDFD_GET_MNT_NAMESPACE)
	if err != nil {
		return err
	}
	under, err, homeErr := swapHere(mntns, mountFD)
	if under < 0 {
		unix.Close(mntns)
		return errors.Join(err, homeErr)
	}
	// Pivoted: the swap is done. A thread that could not come back (it
	// ended) fails the next Swap, through the detach's outcome.
	detached, gone := make(chan error, 1), make(chan struct{})
	in.detached = detached
	in.goneMu.Lock()
	in.gone = gone
	in.goneMu.Unlock()
	detachers.do(detachJob{mntns, under, homeErr, detached, gone})
	return nil
}

// OldRootGone returns a channel closed once the last Swap's old root is
// detached (the detach finishes after Swap returns), or nil before the
// first Swap.
func (in *Init) OldRootGone() <-chan struct{} {
	in.goneMu.Lock()
	defer in.goneMu.Unlock()
	return in.gone
}

// Settled waits until the last Swap's old root is detached. Until then it
// sits on top of the new root, where a process that joins the namespace
// (criu, to dump or restore processes) would find it: criu refuses files
// on overmounted mounts, and looks for files in the old root.
func (in *Init) Settled() {
	if g := in.OldRootGone(); g != nil {
		<-g
	}
}

// hostFS is the server's own root and working directory, which a thread
// back from a sandbox's mount namespace takes again.
var hostFS = sync.OnceValues(func() ([3]int, error) {
	var fds [3]int
	var err error
	if fds[0], err = unix.Open("/proc/thread-self/ns/mnt", unix.O_RDONLY|unix.O_CLOEXEC, 0); err != nil {
		return fds, fmt.Errorf("opening the server's mount namespace: %w", err)
	}
	if fds[1], err = unix.Open("/", unix.O_PATH|unix.O_DIRECTORY|unix.O_CLOEXEC, 0); err != nil {
		unix.Close(fds[0])
		return fds, fmt.Errorf("opening the server's root: %w", err)
	}
	if fds[2], err = unix.Open(".", unix.O_PATH|unix.O_DIRECTORY|unix.O_CLOEXEC, 0); err != nil {
		unix.Close(fds[0])
		unix.Close(fds[1])
		return fds, fmt.Errorf("opening the server's working directory: %w", err)
	}
	return fds, nil
})

// goHome takes a thread back from a sandbox's mount namespace: the server's
// namespace, root and working directory.
func goHome(fs [3]int) error {
	if err := unix.Setns(fs[0], unix.CLONE_NEWNS); err != nil {
		return err
	}
	if err := unix.Fchdir(fs[1]); err != nil {
		return err
	}
	if err := unix.Chroot("."); err != nil {
		return err
	}
	return unix.Fchdir(fs[2])
}

// swapHere does a swap up to pivot_root on a thread of its own making: a
// fresh goroutine, run at once on the caller's thread (the caller waits),
// locked to it and given an fs context of its own (unshare(CLONE_FS), which
// setns needs). The thread keeps that context when it goes back to the
// pool: the same root, working directory and umask as the server's, which
// never changes them after it starts. A thread that cannot come back from
// the sandbox's namespace ends with the goroutine.
//
// Once pivoted, it returns an O_PATH descriptor of the new root, on which
// the old root now sits, waiting to be detached; else -1 and what failed.
// homeErr says the thread could not leave the sandbox's namespace.
func swapHere(mntns, mountFD int) (under int, err, homeErr error) {
	fs, err := hostFS()
	if err != nil {
		return -1, err, nil
	}
	type result struct {
		under        int
		err, homeErr error
	}
	done := make(chan result, 1)
	go func() {
		runtime.LockOSThread()
		if err := unix.Unshare(unix.CLONE_FS); err != nil {
			runtime.UnlockOSThread()
			done <- result{-1, fmt.Errorf("unsharing the thread's fs context: %w", err), nil}
			return
		}
		under, err := pivotOnto(mntns, mountFD)
		if herr := goHome(fs); herr != nil {
			// Locked, the thread ends with this goroutine.
			done <- result{under, err, fmt.Errorf("leaving the sandbox's mount namespace: %w", herr)}
			return
		}
		runtime.UnlockOSThread()
		done <- result{under, err, nil}
	}()
	r := <-done
	return r.under, r.err, r.homeErr
}

// pivotOnto enters mntns and makes mountFD its root (pivot_root), from the
// calling thread. Once pivoted, it returns an O_PATH descriptor of the new
// root, on which the old root now sits; else -1.
func pivotOnto(mntns, mountFD int) (int, error) {
	if err := unix.Setns(mntns, unix.CLONE_NEWNS); err != nil {
		return -1, fmt.Errorf("entering sandbox mount namespace: %w", err)
	}
	if err := unix.MoveMount(mountFD, "", unix.AT_FDCWD, "/", unix.MOVE_MOUNT_F_EMPTY_PATH); err != nil {
		return -1, fmt.Errorf("attaching new root: %w", err)
	}
	// The descriptor the detach starts from, taken while nothing is
	// changed yet that it would leave half-done.
	under, err := unix.FcntlInt(uintptr(mountFD), unix.F_DUPFD_CLOEXEC, 0)
	if err != nil {
		return -1, err
	}
	if err := unix.Fchdir(mountFD); err != nil {
		unix.Close(under)
		return -1, fmt.Errorf("entering new root: %w", err)
	}
	for _, m := range MovedMounts {
		if err := unix.MoveMount(unix.AT_FDCWD, "/"+m, unix.AT_FDCWD, m, 0); err != nil {
			unix.Close(under)
			return -1, fmt.Errorf("moving /%s: %w", m, err)
		}
	}
	if err := unix.PivotRoot(".", "."); err != nil {
		unix.Close(under)
		return -1, fmt.Errorf("pivot_root: %w", err)
	}
	return under, nil
}

// detachPool detaches replaced roots on long-lived locked threads, each
// with an fs context of its own, in the background: a job enters the
// sandbox's mount namespace, detaches the old root (lazily: open fds keep
// what they hold) and comes back.
type detachPool struct {
	once sync.Once
	jobs chan detachJob
	mu   sync.Mutex
	tids map[int]bool
	// cpus are the CPUs the process may run on, as the first caller's
	// thread found them.
	cpus unix.CPUSet
}

type detachJob struct {
	// mntns is the sandbox's mount namespace, closed after the detach.
	// under is a descriptor of the new root, closed after the detach of
	// the old root that sits on it (umount of "." there reaches the mount
	// on top: the old root).
	mntns, under int
	pre          error // reported with the detach's outcome
	detached     chan error
	gone         chan struct{}
}

var detachers detachPool

func (p *detachPool) do(j detachJob) {
	p.once.Do(func() {
		p.jobs = make(chan detachJob, 64)
		p.tids = map[int]bool{}
		if unix.SchedGetaffinity(0, &p.cpus) != nil {
			p.cpus.Zero()
		}
		for range 2 {
			go p.worker()
		}
	})
	// Off the caller's CPU, where a restore goes on with the copies: their
	// tracer is pinned there with the templates (ptfork), and the detach
	// (its expedited RCU grace period, the old overlay's teardown) would
	// take turns with them, and a restore of a process with a new root
	// would wait for the detach. Left to the scheduler, the detach often
	// lands on the other CPU too, but nothing promises it.
	if cpu, err := cpupin.Current(); err == nil {
		set := p.cpus
		set.Clear(cpu)
		if set.Count() > 0 {
			p.mu.Lock()
			for tid := range p.tids {
				_ = unix.SchedSetaffinity(tid, &set)
			}
			p.mu.Unlock()
		}
	}
	p.jobs <- j
}

func (p *detachPool) worker() {
	runtime.LockOSThread() // never unlocked: the thread's fs context is its own
	if err := unix.Unshare(unix.CLONE_FS); err != nil {
		panic(fmt.Sprintf("detach worker: unsharing fs: %v", err))
	}
	tid := unix.Gettid()
	p.mu.Lock()
	p.tids[tid] = true
	p.mu.Unlock()
	defer func() {
		p.mu.Lock()
		delete(p.tids, tid)
		p.mu.Unlock()
	}()
	fs, err := hostFS()
	if err != nil {
		panic(fmt.Sprintf("detach worker: %v", err))
	}
	for j := range p.jobs {
		err := unix.Setns(j.mntns, unix.CLONE_NEWNS)
		if err == nil {
			if err = unix.Fchdir(j.under); err == nil {
				err = unix.Unmount(".", unix.MNT_DETACH)
			}
			if err != nil {
				err = fmt.Errorf("detaching old root: %w", err)
			}
		} else {
			err = fmt.Errorf("entering sandbox mount namespace: %w", err)
		}
		unix.Close(j.under)
		unix.Close(j.mntns)
		err = errors.Join(j.pre, err)
		if herr := goHome(fs); herr != nil {
			// The thread cannot go home: let it die with the goroutine
			// and start a fresh worker in its place.
			j.detached <- errors.Join(err, fmt.Errorf("leaving sandbox mount namespace: %w", herr))
			close(j.gone)
			go p.worker()
			return
		}
		j.detached <- err
		close(j.gone)
	}
}

// Start clones a new init (through the zygote) into new user, mount, pid,
// ipc, uts and cgroup namespaces and the given net namespace, and waits for
// its hello.
func (s *SpawnNS) Start(cfg Config) (*Init, error) {
	if cfg.NetNS < 0 {
		return nil, errors.New("starting init: a net namespace is required")
	}
	pair, err := unix.Socketpair(unix.AF_UNIX, unix.SOCK_SEQPACKET|unix.SOCK_CLOEXEC, 0)
	if err != nil {
		return nil, fmt.Errorf("control socket: %w", err)
	}
	// Non-blocking, so that the runtime poller serves it and Close
	// interrupts a pending read.
	if err := unix.SetNonblock(pair[0], true); err != nil {
		unix.Close(pair[0])
		unix.Close(pair[1])
		return nil, err
	}
	ours := os.NewFile(uintptr(pair[0]), "init-control")
	theirs := os.NewFile(uintptr(pair[1]), "init-control-child")
	pid, exit, err := s.zygote.Clone(uint32(cfg.HostID), cfg.Hostname, cfg.NetNS, theirs)
	theirs.Close() // only the init may hold its end, so that its exit is seen
	if err != nil {
		ours.Close()
		return nil, fmt.Errorf("starting init: %w", err)
	}
	in := &Init{Pid: pid, done: make(chan struct{})}
	go func() {
		if ev, ok := <-exit; ok {
			in.status = ev.Status
		}
		close(in.done)
	}()
	conn, err := initproc.NewConn(ours)
	if err != nil {
		ours.Close()
		_ = unix.Kill(pid, unix.SIGKILL)
		<-in.done
		return nil, fmt.Errorf("starting init: %w", err)
	}
	in.Conn = conn
	return in, nil
}

func (s *SpawnNS) startLocked(cmd *exec.Cmd) error {
	if err := unix.Unshare(unix.CLONE_FS); err != nil {
		return fmt.Errorf("unsharing fs: %w", err)
	}
	home, err := unix.Open("/proc/thread-self/ns/mnt", unix.O_RDONLY|unix.O_CLOEXEC, 0)
	if err != nil {
		return err
	}
	defer unix.Close(home)
	if err := unix.Setns(s.fd, unix.CLONE_NEWNS); err != nil {
		return fmt.Errorf("entering spawn namespace: %w", err)
	}
	err = cmd.Start()
	// Back home: this may be the main thread, which outlives the goroutine.
	if herr := unix.Setns(home, unix.CLONE_NEWNS); herr != nil {
		panic(fmt.Sprintf("leaving the spawn namespace: %v", herr))
	}
	if err != nil {
		return fmt.Errorf("starting zygote: %w", err)
	}
	return nil
}

// ErrGone is returned for a descriptor of an init that has exited.
var ErrGone = errors.New("sandbox init is gone")

// PidFD opens a pidfd of the init. It is opened by pid, and is the init's
// because the init's end of its control socket is still open after it
// (initproc.Conn.PeerOpen): an init that had exited, been reaped and had
// its pid taken by another process would have closed it. An Init holds no
// descriptor but its control socket; what it is asked for is opened on
// demand, through this.
func (in *Init) PidFD() (int, error) {
	if in.Conn == nil {
		return -1, fmt.Errorf("%w: no control socket to check its pid against", ErrGone)
	}
	fd, err := unix.PidfdOpen(in.Pid, 0)
	if err != nil {
		return -1, fmt.Errorf("%w: opening its pidfd: %w", ErrGone, err)
	}
	if !in.Conn.PeerOpen() {
		unix.Close(fd)
		return -1, fmt.Errorf("%w: its control socket is closed", ErrGone)
	}
	return fd, nil
}

// NS opens one of the init's namespaces: req is an ioctl of its pidfd,
// unix.PIDFD_GET_MNT_NAMESPACE, PIDFD_GET_USER_NAMESPACE (for idmapped
// mounts) or PIDFD_GET_NET_NAMESPACE. The caller closes the descriptor.
func (in *Init) NS(req uint) (int, error) {
	pfd, err := in.PidFD()
	if err != nil {
		return -1, err
	}
	fd, err := unix.IoctlRetInt(pfd, req)
	unix.Close(pfd)
	if err != nil {
		return -1, fmt.Errorf("%w: opening its namespace: %w", ErrGone, err)
	}
	return fd, nil
}

// ExitErr describes how the init exited, once Done is closed.
func (in *Init) ExitErr() error {
	select {
	case <-in.done:
		switch {
		case in.status.Exited() && in.status.ExitStatus() == 0:
			return nil
		case in.status.Exited():
			return fmt.Errorf("init exited with status %d", in.status.ExitStatus())
		case in.status.Signaled():
			return fmt.Errorf("init killed by %s", unix.SignalName(in.status.Signal()))
		}
		return errors.New("init is gone")
	default:
		return nil
	}
}

// Done is closed when the init process has exited.
func (in *Init) Done() <-chan struct{} { return in.done }

// Stop ends the init (and so every process of the sandbox) and waits for it.
// Stop is idempotent.
func (in *Init) Stop() error {
	in.once.Do(func() {
		_ = in.Conn.Close()
		// The init exits when its socket closes; a stuck one is killed.
		select {
		case <-in.done:
		case <-time.After(2 * time.Second):
			_ = unix.Kill(in.Pid, unix.SIGKILL)
			<-in.done
		}
	})
	return nil
}
