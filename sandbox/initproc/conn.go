// Package initproc speaks to dg-init, the resident init (pid 1) of a sandbox.
//
// The init is a small static C program (csrc/init.c, built by the
// Makefile). The server holds one end of a SOCK_SEQPACKET socket pair; the
// init has the other as fd 3. A Conn waits for the init's hello, sends
// requests (ping, spawn and guard to an init; clone and next pid to the
// zygote, `dg-init --zygote`) and receives their replies and the exit events of the
// processes the init reaps, one reader goroutine per Conn. Requests are
// answered in order, so replies are matched by id. The init takes no part
// in a root swap: the server does it from outside (sandbox/launch).
package initproc

import (
	"bytes"
	"encoding/binary"
	"errors"
	"fmt"
	"os"
	"strings"
	"sync"
	"syscall"

	"golang.org/x/sys/unix"

	"github.com/deltagym/deltagym/internal/errdefs"
)

// Message types; they match the enum in csrc/init.c.
const (
	msgPing  = 1
	msgSpawn = 3
	msgGuard = 4
	// msgSetNextPid sets the sandbox's next pid (SetNextPid).
	msgSetNextPid = 5
	msgReply      = 100
	msgExit       = 101
)

// Spawn flags; they match csrc/init.c.
const (
	// FlagSetsid starts the command in a new session.
	FlagSetsid = 1 << 0
)

const hdrLen = 12

// ErrClosed is returned for requests on a Conn whose init has gone.
var ErrClosed = errors.New("sandbox init is gone")

// ExitEvent reports a process reaped by the init: its pid inside the sandbox
// and its wait status.
type ExitEvent struct {
	Pid    int
	Status unix.WaitStatus
}

// Conn is the server's end of the control socket of one init.
type Conn struct {
	sock *os.File
	wmu  sync.Mutex // serialises sends and the order of pending replies

	mu sync.Mutex
	// nextID is taken with wmu held too, so that replies come in its
	// order.
	// +checklocks:mu
	// +checklocks:wmu
	nextID uint32
	// +checklocks:mu
	pending map[uint32]pendingCall
	// waiters holds a buffered channel per spawned pid, registered by the
	// reader when the spawn reply arrives, before it can see that pid's exit.
	// +checklocks:mu
	waiters map[int]chan ExitEvent
	// +checklocks:mu
	closed bool
	done   chan struct{}
}

type pendingCall struct {
	ch    chan reply
	spawn bool
	exit  chan ExitEvent // for a spawn: where its pid's exit goes
}

type reply struct {
	err int32
	val int32
}

// NewConn wraps the server's end of the socket pair and waits for the
// init's hello.
func NewConn(sock *os.File) (*Conn, error) {
	c := &Conn{
		sock:    sock,
		pending: map[uint32]pendingCall{},
		waiters: map[int]chan ExitEvent{},
		done:    make(chan struct{}),
	}
	hello := make(chan reply, 1)
	c.pending[0] = pendingCall{ch: hello}
	c.nextID = 1
	go c.readLoop()
	select {
	case r := <-hello:
		if r.err != 0 {
			return nil, fmt.Errorf("init hello: %w", syscall.Errno(r.err))
		}
	case <-c.done:
		return nil, fmt.Errorf("waiting for init hello: %w", ErrClosed)
	}
	return c, nil
}

// Done is closed when the init has gone (its socket closed).
func (c *Conn) Done() <-chan struct{} { return c.done }

func (c *Conn) readLoop() {
	defer c.shutdown()
	buf := make([]byte, 64)
	for {
		n, err := c.sock.Read(buf)
		if err != nil || n == 0 {
			return
		}
		if n < hdrLen {
			continue
		}
		typ := binary.NativeEndian.Uint32(buf[0:])
		id := binary.NativeEndian.Uint32(buf[4:])
		p := buf[hdrLen:n]
		if len(p) < 8 {
			continue
		}
		a := int32(binary.NativeEndian.Uint32(p[0:]))
		b := int32(binary.NativeEndian.Uint32(p[4:]))
		switch typ {
		case msgReply:
			c.mu.Lock()
			pc, ok := c.pending[id]
			delete(c.pending, id)
			if ok && pc.spawn && b > 0 {
				c.waiters[int(b)] = pc.exit
			}
			c.mu.Unlock()
			if ok {
				pc.ch <- reply{a, b}
			}
		case msgExit:
			ev := ExitEvent{Pid: int(a), Status: unix.WaitStatus(b)}
			c.mu.Lock()
			if ch, ok := c.waiters[ev.Pid]; ok {
				delete(c.waiters, ev.Pid)
				ch <- ev
			}
			c.mu.Unlock()
		}
	}
}

func (c *Conn) shutdown() {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.closed {
		return
	}
	c.closed = true
	close(c.done)
	for id, pc := range c.pending {
		close(pc.ch)
		delete(c.pending, id)
	}
	for pid, ch := range c.waiters {
		close(ch)
		delete(c.waiters, pid)
	}
}

// Close closes the socket; the init then exits and the kernel ends every
// process of the sandbox's pid namespace. Close is idempotent.
func (c *Conn) Close() error {
	c.wmu.Lock()
	defer c.wmu.Unlock()
	err := c.sock.Close()
	if errors.Is(err, os.ErrClosed) {
		err = nil
	}
	<-c.done
	return err
}

func (c *Conn) call(typ uint32, payload []byte, files []int) (reply, error) {
	return c.callSpawn(typ, payload, files, nil)
}

func (c *Conn) callSpawn(typ uint32, payload []byte, files []int, exit chan ExitEvent) (reply, error) {
	ch := make(chan reply, 1)
	c.wmu.Lock()
	c.mu.Lock()
	if c.closed {
		c.mu.Unlock()
		c.wmu.Unlock()
		return reply{}, ErrClosed
	}
	id := c.nextID
	c.nextID++
	c.pending[id] = pendingCall{ch: ch, spawn: exit != nil, exit: exit}
	c.mu.Unlock()
	msg := make([]byte, hdrLen+len(payload))
	binary.NativeEndian.PutUint32(msg[0:], typ)
	binary.NativeEndian.PutUint32(msg[4:], id)
	binary.NativeEndian.PutUint32(msg[8:], uint32(len(payload)))
	copy(msg[hdrLen:], payload)
	var oob []byte
	if len(files) > 0 {
		oob = unix.UnixRights(files...)
	}
	err := sendmsg(c.sock, msg, oob)
	c.wmu.Unlock()
	if err != nil {
		c.mu.Lock()
		delete(c.pending, id)
		c.mu.Unlock()
		return reply{}, fmt.Errorf("sending to init: %w", err)
	}
	r, ok := <-ch
	if !ok {
		return reply{}, ErrClosed
	}
	return r, nil
}

func sendmsg(f *os.File, msg, oob []byte) error {
	rc, err := f.SyscallConn()
	if err != nil {
		return err
	}
	var serr error
	werr := rc.Write(func(fd uintptr) bool {
		serr = unix.Sendmsg(int(fd), msg, oob, nil, unix.MSG_NOSIGNAL)
		return serr != unix.EAGAIN
	})
	if werr != nil {
		return werr
	}
	return serr
}

// PeerOpen reports whether the init's end of the socket is still open. Only
// the init holds it (close-on-exec, so its children hold it only between
// fork and exec), and an init cannot be reaped before every task of its pid
// namespace has exited: while its end is open, the init's pid is still its
// own, which makes a pidfd opened by that pid before the check the init's.
func (c *Conn) PeerOpen() bool {
	rc, err := c.sock.SyscallConn()
	if err != nil {
		return false
	}
	open := false
	cerr := rc.Control(func(fd uintptr) {
		p := []unix.PollFd{{Fd: int32(fd), Events: unix.POLLRDHUP}}
		n, err := unix.Poll(p, 0)
		for err == unix.EINTR { // the Go runtime's preemption signals
			n, err = unix.Poll(p, 0)
		}
		open = err == nil && (n == 0 || p[0].Revents&(unix.POLLHUP|unix.POLLRDHUP|unix.POLLERR|unix.POLLNVAL) == 0)
	})
	return cerr == nil && open
}

// Ping checks the init answers and returns its pid as the init sees it (1).
func (c *Conn) Ping() (int, error) {
	r, err := c.call(msgPing, nil, nil)
	if err != nil {
		return 0, err
	}
	return int(r.val), errnoOrNil(r.err)
}

// Guard hands the init listener, the seccomp listener of a filter
// GuardFilter made, for the init to answer its calls as it answers its own
// filter's (csrc/SECCOMP.md). The init keeps a copy; the caller closes
// listener.
func (c *Conn) Guard(listener *os.File) error {
	r, err := c.call(msgGuard, nil, []int{int(listener.Fd())})
	if err != nil {
		return err
	}
	if err := errnoOrNil(r.err); err != nil {
		return fmt.Errorf("handing a seccomp listener to the init: %w", err)
	}
	return nil
}

// SpawnRequest describes one command for the init to start.
type SpawnRequest struct {
	Argv  []string
	Env   []string
	Cwd   string
	UID   uint32
	GID   uint32
	Flags uint32
	// Stdin, Stdout, Stderr are passed to the command as fds 0, 1, 2.
	Stdin, Stdout, Stderr *os.File
	// CgroupProcs are open cgroup.procs files the command moves itself into
	// before it execs, so that nothing it starts can escape them.
	CgroupProcs []*os.File
}

// ErrSpawn wraps the errno with which a command could not be started.
var ErrSpawn = errors.New("starting command")

// ErrTooLarge is a command past the init's limits (CheckArgs). It is the
// request's fault, whatever the sandbox holds. Its message is its class's,
// which the server drops from messages whose status code says it.
var ErrTooLarge = fmt.Errorf("%w", errdefs.ErrInvalidArgument)

// ErrBadArg is a command the init's wire format cannot carry: an empty
// argument, or a NUL byte in a string. It is the request's fault.
var ErrBadArg = fmt.Errorf("%w", errdefs.ErrInvalidArgument)

// The init's limits on a command (csrc/init.c). A request past one is
// refused before it is sent: the init would cut it (drop the arguments past
// its table, and the environment with them) or drop the message.
const (
	// MaxEntries is how many argv and environment entries a command takes
	// in all: the init's table of MAXARGS (4096) pointers less the two NULL
	// ends.
	MaxEntries = 4094
	// MaxPayload is the most bytes of a spawn request's payload (header,
	// cwd, argv and environment, each string NUL-terminated): under both the
	// init's receive buffer (MAXMSG, 256 KiB) and the socket's send buffer
	// (net.core.wmem_default, 208 KiB by default), which bounds one
	// SOCK_SEQPACKET message.
	MaxPayload = 200 << 10
	// MaxString is the longest one argument or KEY=VALUE may be, in bytes:
	// the kernel's MAX_ARG_STRLEN (32 pages) less the NUL; execve fails with
	// E2BIG past it.
	MaxString = 32*4096 - 1
)

// spawnHdrLen is the size of the spawn header (struct spawn_hdr of init.c).
const spawnHdrLen = 16

// CheckArgs checks a command against the init's limits (MaxEntries,
// MaxPayload, MaxString) and its wire format (no empty argument, no NUL
// byte). env is the command's environment, KEY=VALUE, as far as the caller
// has it (a request's own variables; Spawn checks the whole, the sandbox's
// own included), and the refusals count what it holds. An error wraps
// ErrTooLarge or ErrBadArg and says which limit and by how much.
func CheckArgs(argv, env []string, cwd string) error {
	return checkArgs(argv, env, cwd, "")
}

// checkArgs is CheckArgs; whose says whose variables env holds beyond the
// request's, for the refusals ("" for none).
func checkArgs(argv, env []string, cwd, whose string) error {
	if len(argv) == 0 {
		return fmt.Errorf("%w: exec: empty argv", ErrBadArg)
	}
	if n := len(argv) + len(env); n > MaxEntries {
		return fmt.Errorf("%w: exec: %s: a command takes at most %d argv entries and environment variables in all",
			ErrTooLarge, countArgs(argv, env, whose), MaxEntries)
	}
	size := spawnHdrLen + len(cwd) + 1 + 1 + 1 // cwd and the two empty strings that end argv and env
	if strings.IndexByte(cwd, 0) >= 0 {
		return fmt.Errorf("%w: exec: NUL byte in cwd", ErrBadArg)
	}
	for i, a := range argv {
		switch {
		case a == "":
			// An empty argument would end argv early in the wire format.
			return fmt.Errorf("%w: exec: argv[%d] is empty", ErrBadArg, i)
		case strings.IndexByte(a, 0) >= 0:
			return fmt.Errorf("%w: exec: NUL byte in argv[%d]", ErrBadArg, i)
		case len(a) > MaxString:
			return fmt.Errorf("%w: exec: argv[%d] is %d bytes: at most %d (the kernel's limit on one argument)", ErrTooLarge, i, len(a), MaxString)
		}
		size += len(a) + 1
	}
	for _, kv := range env {
		switch {
		case strings.IndexByte(kv, 0) >= 0:
			k, _, _ := strings.Cut(kv, "=")
			return fmt.Errorf("%w: exec: NUL byte in environment variable %.64q", ErrBadArg, k)
		case len(kv) > MaxString:
			k, _, _ := strings.Cut(kv, "=")
			return fmt.Errorf("%w: exec: environment variable %.64q is %d bytes: at most %d (the kernel's limit on one variable)", ErrTooLarge, k, len(kv), MaxString)
		}
		size += len(kv) + 1
	}
	if size > MaxPayload {
		return fmt.Errorf("%w: exec: argv, environment and cwd take %d bytes (%s): a command takes at most %d",
			ErrTooLarge, size, countArgs(argv, env, whose), MaxPayload)
	}
	return nil
}

// countArgs says how many argv entries and environment variables a
// command has: "6005 argv entries", "1 argv entry and 4100 environment
// variables (the sandbox's own included)".
func countArgs(argv, env []string, whose string) string {
	s := plural(len(argv), "argv entry", "argv entries")
	if len(env) > 0 {
		s += " and " + plural(len(env), "environment variable", "environment variables")
		if whose != "" {
			s += " (" + whose + " included)"
		}
	}
	return s
}

// plural is "n many", or "1 one".
func plural(n int, one, many string) string {
	if n == 1 {
		return "1 " + one
	}
	return fmt.Sprintf("%d %s", n, many)
}

// Steps at which the init can fail to start a command (SpawnError.Step);
// they match child_main in csrc/init.c.
const (
	// StepInit: the init itself (cloning the command, or reading the
	// request).
	StepInit = 0
	// StepCgroup: joining the command's cgroup.
	StepCgroup = 1
	// StepStdio: setting up fds 0, 1 and 2.
	StepStdio = 2
	// StepCreds: switching to the command's uid and gid.
	StepCreds = 4
	// StepCwd: changing to the command's directory.
	StepCwd = 6
	// StepExec: executing the program.
	StepExec = 9
)

// SpawnError is the init's failure to start a command: the step that
// failed and the errno it gave. It wraps ErrSpawn and the errno.
type SpawnError struct {
	Step  int
	Errno syscall.Errno
	what  string
}

// Error implements error.
func (e *SpawnError) Error() string { return fmt.Sprintf("%v%s: %v", ErrSpawn, e.what, e.Errno) }

// Unwrap returns ErrSpawn and the errno.
func (e *SpawnError) Unwrap() []error { return []error{ErrSpawn, e.Errno} }

// Spawn starts a command and returns its pid inside the sandbox and a
// channel that receives its exit (closed without a value if the init goes
// away first). Call Forget for a pid whose exit no one will read. A request
// past the init's limits is refused before it is sent (CheckArgs); a
// command the init could not start gives a *SpawnError.
func (c *Conn) Spawn(req SpawnRequest) (int, <-chan ExitEvent, error) {
	pid, exit, err := c.spawn(req)
	return pid, exit, err
}

func (c *Conn) spawn(req SpawnRequest) (int, chan ExitEvent, error) {
	if err := checkArgs(req.Argv, req.Env, req.Cwd, "the sandbox's own"); err != nil {
		return 0, nil, err
	}
	var b bytes.Buffer
	var h [spawnHdrLen]byte
	binary.NativeEndian.PutUint32(h[0:], req.Flags)
	binary.NativeEndian.PutUint32(h[4:], req.UID)
	binary.NativeEndian.PutUint32(h[8:], req.GID)
	binary.NativeEndian.PutUint32(h[12:], uint32(len(req.CgroupProcs)))
	b.Write(h[:])
	for _, s := range [][]string{{req.Cwd}, req.Argv, {""}, req.Env, {""}} {
		for _, x := range s {
			b.WriteString(x)
			b.WriteByte(0)
		}
	}
	fds := []int{int(req.Stdin.Fd()), int(req.Stdout.Fd()), int(req.Stderr.Fd())}
	for _, f := range req.CgroupProcs {
		fds = append(fds, int(f.Fd()))
	}
	exit := make(chan ExitEvent, 1)
	r, err := c.callSpawn(msgSpawn, b.Bytes(), fds, exit)
	if err != nil {
		return 0, nil, err
	}
	if r.err != 0 {
		if r.val > 0 {
			c.Forget(int(r.val))
		}
		se := &SpawnError{Step: int(r.err >> 16), Errno: syscall.Errno(r.err & 0xffff)}
		switch se.Step {
		case StepCgroup:
			se.what = ": joining the command's cgroup"
		case StepCreds:
			se.what = fmt.Sprintf(": switching to uid %d", req.UID)
		case StepCwd:
			se.what = fmt.Sprintf(": changing to directory %q", req.Cwd)
		default:
			se.what = fmt.Sprintf(" %q", req.Argv[0])
		}
		return 0, nil, se
	}
	return int(r.val), exit, nil
}

// msgClone is the zygote's request to clone a new init (csrc/init.c).
const msgClone = 10

// Clone asks a zygote (`dg-init --zygote`) to clone a new init into fresh
// user, mount, pid, ipc, uts and cgroup namespaces, in the net namespace
// netns, with uid and gid 0 mapped to hostID and the given host name; ctl
// becomes the new init's control socket. It returns the init's host pid and
// a channel that receives its exit.
func (c *Conn) Clone(hostID uint32, hostname string, netns int, ctl *os.File) (int, <-chan ExitEvent, error) {
	payload := binary.NativeEndian.AppendUint32(nil, hostID)
	payload = append(payload, hostname...)
	exit := make(chan ExitEvent, 1)
	r, err := c.callSpawn(msgClone, payload, []int{netns, int(ctl.Fd())}, exit)
	if err != nil {
		return 0, nil, err
	}
	if r.err != 0 {
		if r.val > 0 {
			c.Forget(int(r.val))
		}
		return 0, nil, fmt.Errorf("cloning a sandbox init: %w", syscall.Errno(r.err))
	}
	return int(r.val), exit, nil
}

// SetNextPid has the next process made in the init's sandbox get pid, if
// it is free then (the kernel hands out the next free one after it): the
// init writes the sandbox's ns_last_pid, with a capability (over the
// sandbox's user namespace) no command has. Nothing else may make a
// process there in between: the caller checks the pid it got.
func (c *Conn) SetNextPid(pid int) error {
	r, err := c.call(msgSetNextPid, binary.NativeEndian.AppendUint32(nil, uint32(int32(pid))), nil)
	if err != nil {
		return err
	}
	if err := errnoOrNil(r.err); err != nil {
		return fmt.Errorf("setting the next pid of a sandbox to %d: %w", pid, err)
	}
	return nil
}

// Watch returns a channel that receives the exit of pid, a child of the
// init that it did not spawn for this Conn (a process copy made by
// ptrace). Call it before the process can run.
func (c *Conn) Watch(pid int) <-chan ExitEvent {
	ch := make(chan ExitEvent, 1)
	c.mu.Lock()
	defer c.mu.Unlock()
	c.waiters[pid] = ch
	return ch
}

// Forget drops interest in pid's exit (a background command).
func (c *Conn) Forget(pid int) {
	c.mu.Lock()
	defer c.mu.Unlock()
	delete(c.waiters, pid)
}

func errnoOrNil(e int32) error {
	if e == 0 {
		return nil
	}
	return syscall.Errno(e)
}
