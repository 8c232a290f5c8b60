package procstate

import (
	"bufio"
	"cmp"
	"encoding/binary"
	"errors"
	"fmt"
	"net/netip"
	"os"
	"slices"
	"strconv"
	"strings"
	"unsafe"

	"golang.org/x/sys/unix"

	"github.com/deltagym/deltagym/sandbox/ptfork"
)

// A template's copies share the open file descriptions of the template,
// as any fork shares its parent's. What a copy writes into one that it
// shares with the template (a pipe's buffer, an eventfd's count, an epoll
// instance's interest list, a connection's stream) the next copy would
// find, and the live process goes on with those of the checkpoint after
// it, changing them too. So a capture records, while the process is
// stopped, the state of each description that is the process's alone —
// a pipe whose two ends it holds (and what the pipe holds), an eventfd,
// an epoll instance (what it watches) — and every copy is given new ones
// in that state by calls injected into it (fixUpPrivate). A connected TCP
// socket cannot be duplicated: each copy gets a new, unconnected socket of
// its kind in its place, so the copy sees the connection reset (reads fail
// with ENOTCONN, polls report a hang-up), as after a network failure, and
// no copy reads what another sent.
//
// A listening socket is the process's alone: its template does not keep it
// (freeListeners puts an unbound socket of its kind in its place), so a
// service the agent ends frees its port and its path at once, as it would
// without checkpoints: a client is refused, and a new server binds them.
// Each copy gets a new socket listening where the process's did, with its
// options and backlog (a TCP socket: listenTCP; a unix socket bound to an
// absolute path: rebindUnix, the restored root's file there being a copy
// no socket is bound to), once the processes the restore killed have let
// go of the address. A copy made to be saved as a CRIU image runs in the
// live sandbox, where the live process holds the address: it gets an
// unbound socket, which its image then records as listening (image.go).
// A listening socket another process holds too (a pre-forked server's
// workers) stays shared, since one copy binding its address would shut
// the others out; its queue of connections not yet accepted is emptied
// before each copy runs, so no copy accepts one made before it. Connected
// unix sockets stay shared. What a fork drops is given back too: the
// interval timer (readItimer, fixItimer), and memory marked MADV_DONTFORK
// (forkWhole).

// Private is a description of a template whose copies each get their own.
type Private struct {
	// Kind: "pipe", "eventfd", "timerfd", "epoll", "socket" (reset),
	// "tcplisten" and "unixlisten" (listening anew), "listen" (shared,
	// drained).
	Kind string `json:"kind"`
	FD   int    `json:"fd"`
	// Flags are the fd's file status flags and O_CLOEXEC (fdinfo's flags).
	Flags int `json:"flags"`
	// Read are a pipe's other read ends (FD is the first) and Write its
	// write ends, with their flags; Read are also a listening socket's
	// other fds (tcplisten, unixlisten).
	Read  []PrivateFD `json:"read,omitempty"`
	Write []PrivateFD `json:"write,omitempty"`
	// Data is what a pipe held.
	Data []byte `json:"data,omitempty"`
	// Size is a pipe's capacity, if not the default.
	Size int `json:"size,omitempty"`
	// Count is an eventfd's count; Semaphore its mode.
	Count     uint64 `json:"count,omitempty"`
	Semaphore bool   `json:"semaphore,omitempty"`
	// Watches are what an epoll instance watches.
	Watches []Watch `json:"watches,omitempty"`
	// Domain, Type and Proto are a socket's; Path is the path a listening
	// unix socket is bound to, and Mode, UID and GID its file's (as the
	// sandbox sees them).
	Domain int    `json:"domain,omitempty"`
	Type   int    `json:"type,omitempty"`
	Proto  int    `json:"proto,omitempty"`
	Path   string `json:"path,omitempty"`
	Mode   uint32 `json:"mode,omitempty"`
	UID    uint32 `json:"uid,omitempty"`
	GID    uint32 `json:"gid,omitempty"`
	// Addr is the address a listening TCP socket is bound to (struct
	// sockaddr_in or sockaddr_in6, as getsockname gives it); Backlog is a
	// listening socket's backlog; Opts are a listening TCP socket's values
	// of listenOpts, in that order.
	Addr    []byte `json:"addr,omitempty"`
	Backlog int    `json:"backlog,omitempty"`
	Opts    []int  `json:"opts,omitempty"`
	// Clock and Timer are a timerfd's clock and what was left of its
	// timer: interval and value (struct itimerspec: seconds, nanoseconds).
	Clock int       `json:"clock,omitempty"`
	Timer [4]uint64 `json:"timer,omitzero"`
	// link is the description's key ("socket:[inode]") at the capture.
	link string
}

// PrivateFD is one more fd of a description, with its flags.
type PrivateFD struct {
	FD    int `json:"fd"`
	Flags int `json:"flags"`
}

// Watch is one entry of an epoll instance's interest list.
type Watch struct {
	FD     int    `json:"fd"`
	Events uint32 `json:"events"`
	Data   uint64 `json:"data"`
}

const (
	defaultPipeSize  = 65536
	eventfdSemaphore = 1 // EFD_SEMAPHORE
	// maxPipeBytes bounds what a template's pipes to itself may hold, all
	// together, and maxPrivate how many descriptions it may have its
	// copies get their own of: the record keeps them, and each copy is
	// given them by injected calls. A process past either is saved by
	// CRIU, whose images count against the checkpoint budget.
	maxPipeBytes = 256 << 10
	maxPrivate   = 1024
)

// special is an fd whose target is not a path: a pipe, a socket, an
// anonymous inode.
type special struct {
	pid   int // the process's host pid
	fd    int
	link  string
	flags int
	info  string // the fdinfo file
}

// inspectPrivate records in pi the descriptions of process pid among
// specials that its copies get their own of, or sets pi.reason when one
// cannot be given (see epollPrivate).
func inspectPrivate(pid int, specials []special, pi *procInfo) error {
	if len(specials) == 0 {
		return nil
	}
	pidfd, err := unix.PidfdOpen(pid, 0)
	if err != nil {
		return err
	}
	defer unix.Close(pidfd)
	var pipes []*Private // in the order of their first read ends
	byLink := map[string]*Private{}
	var writeEnds []special
	var epolls []special
	for _, sp := range specials {
		switch {
		case strings.HasPrefix(sp.link, "pipe:"):
			p := byLink[sp.link]
			switch {
			case sp.flags&unix.O_ACCMODE == unix.O_WRONLY:
				writeEnds = append(writeEnds, sp)
			case p == nil:
				p = &Private{Kind: "pipe", FD: sp.fd, Flags: sp.flags}
				byLink[sp.link] = p
				pipes = append(pipes, p)
			default:
				p.Read = append(p.Read, PrivateFD{FD: sp.fd, Flags: sp.flags})
			}
		case sp.link == "anon_inode:[eventfd]":
			p := Private{Kind: "eventfd", FD: sp.fd, Flags: sp.flags}
			p.Count, _ = strconv.ParseUint(fdinfoField(sp.info, "eventfd-count"), 16, 64)
			p.Semaphore = fdinfoField(sp.info, "eventfd-semaphore") == "1"
			pi.tpl.Private = append(pi.tpl.Private, p)
		case sp.link == "anon_inode:[timerfd]":
			if p, ok := timerfdPrivate(sp); ok {
				pi.tpl.Private = append(pi.tpl.Private, p)
			}
		case sp.link == "anon_inode:[eventpoll]":
			epolls = append(epolls, sp)
		case strings.HasPrefix(sp.link, "socket:"):
			pi.sockets = append(pi.sockets, sp.link)
			addSocketPrivate(pidfd, sp, pi)
		}
	}
	for _, w := range writeEnds {
		if p := byLink[w.link]; p != nil {
			p.Write = append(p.Write, PrivateFD{FD: w.fd, Flags: w.flags})
		}
	}
	if err := pipePrivates(pidfd, pipes, pi); err != nil {
		return err
	}
	if n := len(pi.tpl.Private) + len(epolls); n > maxPrivate && pi.reason == "" {
		pi.reason = fmt.Sprintf("it holds %d pipes, eventfds, timerfds, epoll instances and sockets a copy would get its own of (template copies take at most %d)", n, maxPrivate)
	}
	for _, sp := range epolls {
		p, why := epollPrivate(pid, sp, specials)
		if why != "" {
			if pi.reason == "" {
				pi.reason = why
			}
			continue
		}
		pi.tpl.Private = append(pi.tpl.Private, p) // after what it watches
	}
	return nil
}

// pipePrivates records the pipes whose write ends the process holds too
// (pipes to itself), with what they hold.
func pipePrivates(pidfd int, pipes []*Private, pi *procInfo) error {
	held := 0
	for _, p := range pipes {
		if len(p.Write) == 0 {
			continue // the other end is another process's: shared
		}
		if err := pipeContents(pidfd, p); err != nil {
			return fmt.Errorf("reading the pipe of fd %d: %w", p.FD, err)
		}
		if held += max(len(p.Data), p.Size); held > maxPipeBytes {
			if pi.reason == "" {
				pi.reason = fmt.Sprintf("its pipes to itself hold, or can hold, more than %d bytes (template copies carry at most that)", maxPipeBytes)
			}
			return nil
		}
		pi.tpl.Private = append(pi.tpl.Private, *p)
	}
	return nil
}

// fdinfoField is the value of field k of an fdinfo file.
func fdinfoField(info, k string) string {
	for line := range strings.Lines(info) {
		if key, v, ok := strings.Cut(line, ":"); ok && key == k {
			return strings.TrimSpace(v)
		}
	}
	return ""
}

// socketPrivate classifies socket sp of the process behind pidfd: a
// listening one is made anew in each copy (or, shared, drained at each
// restore), a connected TCP one reset.
func socketPrivate(pidfd int, sp special) (Private, bool) {
	fd, err := unix.PidfdGetfd(pidfd, sp.fd, 0)
	if err != nil {
		return Private{}, false
	}
	defer unix.Close(fd)
	domain, err1 := unix.GetsockoptInt(fd, unix.SOL_SOCKET, unix.SO_DOMAIN)
	typ, err2 := unix.GetsockoptInt(fd, unix.SOL_SOCKET, unix.SO_TYPE)
	proto, err3 := unix.GetsockoptInt(fd, unix.SOL_SOCKET, unix.SO_PROTOCOL)
	if err1 != nil || err2 != nil || err3 != nil {
		return Private{}, false
	}
	if on, err := unix.GetsockoptInt(fd, unix.SOL_SOCKET, unix.SO_ACCEPTCONN); err == nil && on == 1 {
		if p, ok := listenerPrivate(fd, sp, domain, typ, proto); ok {
			return p, true
		}
		return Private{Kind: "listen", FD: sp.fd, Flags: sp.flags, link: sp.link}, true
	}
	if typ != unix.SOCK_STREAM || domain != unix.AF_INET && domain != unix.AF_INET6 {
		return Private{}, false
	}
	if _, err := unix.Getpeername(fd); err != nil {
		return Private{}, false // not connected
	}
	return Private{Kind: "socket", FD: sp.fd, Flags: sp.flags, Domain: domain, Type: typ, Proto: proto}, true
}

// listenOpts are the options of a listening TCP socket that its copies
// are given (a connection accepted inherits the last three).
var listenOpts = [...]struct{ level, name int }{
	{unix.SOL_SOCKET, unix.SO_REUSEADDR},
	{unix.SOL_SOCKET, unix.SO_REUSEPORT},
	{unix.IPPROTO_TCP, unix.TCP_DEFER_ACCEPT},
	{unix.SOL_SOCKET, unix.SO_KEEPALIVE},
	{unix.IPPROTO_TCP, unix.TCP_NODELAY},
	{unix.SOL_IP, unix.IP_FREEBIND}, // bound to an address no interface has
}

// listenerPrivate describes listening socket fd (sp) for copies that
// listen anew: a TCP socket, with its address, options and backlog, or a
// unix socket bound to an absolute path whose file is a socket (a
// relative path was resolved against the cwd of the bind, which is not
// known; an abstract name stays shared).
func listenerPrivate(fd int, sp special, domain, typ, proto int) (Private, bool) {
	p := Private{FD: sp.fd, Flags: sp.flags, Domain: domain, Type: typ, Proto: proto, link: sp.link}
	switch domain {
	case unix.AF_UNIX:
		sa, err := unix.Getsockname(fd)
		u, ok := sa.(*unix.SockaddrUnix)
		if err != nil || !ok || !strings.HasPrefix(u.Name, "/") {
			return p, false
		}
		st, ok := socketIn(sp.pid, u.Name)
		if !ok {
			return p, false
		}
		uid, ok1 := idIn(sp.pid, "uid_map", st.Uid)
		gid, ok2 := idIn(sp.pid, "gid_map", st.Gid)
		if !ok1 || !ok2 {
			return p, false
		}
		p.Kind, p.Path, p.Backlog = "unixlisten", u.Name, unix.SOMAXCONN
		p.Mode, p.UID, p.GID = st.Mode&^unix.S_IFMT, uid, gid
		return p, true
	case unix.AF_INET, unix.AF_INET6:
		if typ != unix.SOCK_STREAM {
			return p, false
		}
		addr, err := rawSockname(fd)
		if err != nil {
			return p, false
		}
		// A listening socket's backlog is what TCP_INFO reports as
		// sacked (tcp_get_info).
		info, err := unix.GetsockoptTCPInfo(fd, unix.IPPROTO_TCP, unix.TCP_INFO)
		if err != nil {
			return p, false
		}
		p.Kind, p.Addr, p.Backlog = "tcplisten", addr, int(info.Sacked)
		for _, o := range listenOpts {
			v, err := unix.GetsockoptInt(fd, o.level, o.name)
			if err != nil {
				return p, false
			}
			p.Opts = append(p.Opts, v)
		}
		if domain == unix.AF_INET6 {
			v, err := unix.GetsockoptInt(fd, unix.IPPROTO_IPV6, unix.IPV6_V6ONLY)
			if err != nil {
				return p, false
			}
			p.Opts = append(p.Opts, v)
		}
		return p, true
	}
	return p, false
}

// idIn is host id as process pid's user namespace sees it, by its map
// ("uid_map" or "gid_map").
func idIn(pid int, m string, id uint32) (uint32, bool) {
	b, err := os.ReadFile("/proc/" + strconv.Itoa(pid) + "/" + m)
	if err != nil {
		return 0, false
	}
	for line := range strings.Lines(string(b)) {
		var in, out, n uint32
		if _, err := fmt.Sscan(line, &in, &out, &n); err == nil && id >= out && id-out < n {
			return in + (id - out), true
		}
	}
	return 0, false
}

// rawSockname is socket fd's address as the kernel gives it (struct
// sockaddr_in or sockaddr_in6).
func rawSockname(fd int) ([]byte, error) {
	var buf [unix.SizeofSockaddrInet6]byte
	n := uint32(len(buf))
	if _, _, e := unix.Syscall(unix.SYS_GETSOCKNAME, uintptr(fd), uintptr(unsafe.Pointer(&buf[0])), uintptr(unsafe.Pointer(&n))); e != 0 {
		return nil, e
	}
	if n > uint32(len(buf)) {
		return nil, unix.EINVAL
	}
	return append([]byte(nil), buf[:n]...), nil
}

// listensAnew reports whether p is a listening socket that each copy
// listens on anew (tcplisten, unixlisten), its template holding an unbound
// one in its place.
func (p Private) listensAnew() bool { return p.Kind == "tcplisten" || p.Kind == "unixlisten" }

// ListenAddr returns the address of listening TCP socket p (tcplisten)
// as an IP and a port.
func (p Private) ListenAddr() (ip []byte, port int, ok bool) {
	switch {
	case p.Domain == unix.AF_INET && len(p.Addr) >= unix.SizeofSockaddrInet4:
		return p.Addr[4:8], int(binary.BigEndian.Uint16(p.Addr[2:4])), true
	case p.Domain == unix.AF_INET6 && len(p.Addr) >= unix.SizeofSockaddrInet6:
		return p.Addr[8:24], int(binary.BigEndian.Uint16(p.Addr[2:4])), true
	}
	return nil, 0, false
}

// timerfdPrivate reads timerfd sp's clock and what is left of its timer.
// Expirations not read yet count as one coming at once.
func timerfdPrivate(sp special) (Private, bool) {
	p := Private{Kind: "timerfd", FD: sp.fd, Flags: sp.flags}
	var err error
	if p.Clock, err = strconv.Atoi(fdinfoField(sp.info, "clockid")); err != nil {
		return p, false
	}
	parse := func(k string) (uint64, uint64, bool) {
		var s, ns uint64
		_, err := fmt.Sscanf(fdinfoField(sp.info, k), "(%d, %d)", &s, &ns)
		return s, ns, err == nil
	}
	vs, vns, ok1 := parse("it_value")
	is, ins, ok2 := parse("it_interval")
	if !ok1 || !ok2 {
		return p, false
	}
	if ticks, _ := strconv.ParseUint(fdinfoField(sp.info, "ticks"), 10, 64); ticks > 0 {
		vs, vns = 0, 1
	}
	p.Timer = [4]uint64{is, ins, vs, vns}
	return p, true
}

// isSocketIn reports whether path, resolved in the root of process pid
// (never outside it), is a socket.
func isSocketIn(pid int, path string) bool {
	_, ok := socketIn(pid, path)
	return ok
}

// socketIn is isSocketIn, with the file's status.
func socketIn(pid int, path string) (unix.Stat_t, bool) {
	var st unix.Stat_t
	root, err := unix.Open("/proc/"+strconv.Itoa(pid)+"/root", unix.O_PATH|unix.O_DIRECTORY|unix.O_CLOEXEC, 0)
	if err != nil {
		return st, false
	}
	defer unix.Close(root)
	fd, err := unix.Openat2(root, strings.TrimLeft(path, "/"), &unix.OpenHow{Flags: unix.O_PATH | unix.O_NOFOLLOW | unix.O_CLOEXEC,
		Resolve: unix.RESOLVE_IN_ROOT | unix.RESOLVE_NO_MAGICLINKS})
	if err != nil {
		return st, false
	}
	defer unix.Close(fd)
	return st, unix.Fstat(fd, &st) == nil && st.Mode&unix.S_IFMT == unix.S_IFSOCK
}

// pipeContents reads what pipe p holds without taking it out (tee into a
// pipe of the server's), and its capacity.
func pipeContents(pidfd int, p *Private) error {
	src, err := unix.PidfdGetfd(pidfd, p.FD, 0)
	if err != nil {
		return err
	}
	defer unix.Close(src)
	if size, err := unix.FcntlInt(uintptr(src), unix.F_GETPIPE_SZ, 0); err == nil && size != defaultPipeSize {
		p.Size = size
	}
	if p.Size > maxPipeBytes {
		return nil // not read: too large to carry (pipePrivates)
	}
	var fds [2]int
	if err := unix.Pipe2(fds[:], unix.O_CLOEXEC|unix.O_NONBLOCK); err != nil {
		return err
	}
	defer unix.Close(fds[0])
	defer unix.Close(fds[1])
	if p.Size > 0 {
		if _, err := unix.FcntlInt(uintptr(fds[1]), unix.F_SETPIPE_SZ, p.Size); err != nil {
			return err
		}
	}
	n, err := unix.Tee(src, fds[1], 1<<30, unix.SPLICE_F_NONBLOCK)
	if err == unix.EAGAIN || n == 0 {
		return nil // empty
	}
	if err != nil {
		return err
	}
	p.Data = make([]byte, n)
	_, err = unix.Read(fds[0], p.Data)
	return err
}

// epollPrivate reads the interest list of epoll instance sp of process
// pid. It says why not (a reason for CRIU) if the instance watches another
// epoll instance, or a description the process no longer has on the fd it
// was added with (the list names fd numbers).
func epollPrivate(pid int, sp special, specials []special) (Private, string) {
	p := Private{Kind: "epoll", FD: sp.fd, Flags: sp.flags}
	sc := bufio.NewScanner(strings.NewReader(sp.info))
	for sc.Scan() {
		f := strings.Fields(sc.Text())
		if len(f) < 6 || f[0] != "tfd:" || f[2] != "events:" || f[4] != "data:" {
			continue
		}
		tfd, err1 := strconv.Atoi(f[1])
		ev, err2 := strconv.ParseUint(f[3], 16, 32)
		data, err3 := strconv.ParseUint(f[5], 16, 64)
		if err1 != nil || err2 != nil || err3 != nil {
			return p, fmt.Sprintf("its epoll instance (fd %d) lists an entry it cannot parse", sp.fd)
		}
		for _, o := range specials {
			if o.fd == tfd && o.link == "anon_inode:[eventpoll]" {
				return p, fmt.Sprintf("its epoll instance (fd %d) watches another (fd %d)", sp.fd, tfd)
			}
		}
		var st unix.Stat_t
		ino, _ := strconv.ParseUint(strings.TrimPrefix(fieldAfter(f, "ino:"), "ino:"), 16, 64)
		if unix.Stat("/proc/"+strconv.Itoa(pid)+"/fd/"+strconv.Itoa(tfd), &st) != nil || st.Ino != ino {
			return p, fmt.Sprintf("its epoll instance (fd %d) watches fd %d, which it has closed or reused since", sp.fd, tfd)
		}
		p.Watches = append(p.Watches, Watch{FD: tfd, Events: uint32(ev), Data: data})
	}
	return p, ""
}

// readItimer records the interval timer of stopped process p in t, if its
// SIGALRM disposition says it may have one running.
func readItimer(p *ptfork.Proc, t *Template) (err error) {
	if !t.alarm {
		return nil
	}
	mem := p.Scratch()
	defer func() { err = errors.Join(err, mem.Release()) }()
	a, err := mem.Put("")
	if err != nil {
		return err
	}
	if _, err := p.Syscall(unix.SYS_GETITIMER, unix.ITIMER_REAL, a); err != nil {
		return fmt.Errorf("reading the interval timer: %w", err)
	}
	var b [32]byte
	if err := p.Read(a, b[:]); err != nil {
		return err
	}
	for i := range t.Itimer {
		t.Itimer[i] = int64(binary.NativeEndian.Uint64(b[8*i:]))
	}
	return nil
}

// forkWhole forks stopped process p with all its memory. A fork leaves out
// what the process marked MADV_DONTFORK (V8, and so Node, marks its heap
// so): a template without it would fault on its first touch. When the
// copy's address space is smaller than p's, the copy is ended and p is
// forked again by withDoFork.
func forkWhole(p *ptfork.Proc) (*ptfork.Proc, error) {
	cp, _, err := p.Fork()
	if err != nil {
		return nil, err
	}
	a, b := ptfork.VMSize(p.Pid), ptfork.VMSize(cp.Pid)
	if a == b || a == 0 || b == 0 {
		return cp, nil
	}
	cp.Kill()
	return withDoFork(p, func() (*ptfork.Proc, error) {
		cp, _, err := p.Fork()
		return cp, err
	})
}

// withDoFork calls fork, which forks stopped process p, with p's regions
// marked MADV_DONTFORK marked to be copied, and puts the marks back on p
// after; the copy keeps its memory marked to be copied, and so do its
// copies (a fork of theirs copies it). On error nothing of the copy is
// left.
func withDoFork(p *ptfork.Proc, fork func() (*ptfork.Proc, error)) (*ptfork.Proc, error) {
	regions, err := dontForkRegions(p.Pid)
	if err != nil {
		return nil, err
	}
	mark := func(advice uintptr) error {
		for _, r := range regions {
			if _, err := p.Syscall(unix.SYS_MADVISE, r[0], r[1]-r[0], advice); err != nil {
				return fmt.Errorf("madvise of %#x-%#x: %w", r[0], r[1], err)
			}
		}
		return nil
	}
	if err := mark(unix.MADV_DOFORK); err != nil {
		return nil, errors.Join(err, mark(unix.MADV_DONTFORK))
	}
	cp, err := fork()
	if err = errors.Join(err, mark(unix.MADV_DONTFORK)); err != nil && cp != nil {
		cp.Kill()
		cp = nil
	}
	return cp, err
}

// dontForkRegions lists pid's mappings marked MADV_DONTFORK ("dc" in
// smaps' VmFlags), merged where they touch.
func dontForkRegions(pid int) ([][2]uintptr, error) {
	f, err := os.Open("/proc/" + strconv.Itoa(pid) + "/smaps")
	if err != nil {
		return nil, err
	}
	defer f.Close()
	var out [][2]uintptr
	var cur [2]uintptr
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		line := sc.Text()
		if lo, hi, ok := strings.Cut(strings.Fields(line + " ")[0], "-"); ok && !strings.HasSuffix(lo, ":") {
			l, err1 := strconv.ParseUint(lo, 16, 64)
			h, err2 := strconv.ParseUint(hi, 16, 64)
			if err1 == nil && err2 == nil {
				cur = [2]uintptr{uintptr(l), uintptr(h)}
			}
			continue
		}
		if !strings.HasPrefix(line, "VmFlags:") || !slices.Contains(strings.Fields(line), "dc") {
			continue
		}
		if n := len(out); n > 0 && out[n-1][1] == cur[0] {
			out[n-1][1] = cur[1]
		} else {
			out = append(out, cur)
		}
	}
	return out, sc.Err()
}

// fixItimer gives copy cp t's interval timer.
func fixItimer(cp *ptfork.Proc, t Template, mem *ptfork.Scratch) error {
	if t.Itimer == [4]int64{} {
		return nil
	}
	var b [32]byte
	for i, v := range t.Itimer {
		binary.NativeEndian.PutUint64(b[8*i:], uint64(v))
	}
	a, err := mem.Put(string(b[:]))
	if err == nil {
		_, err = cp.Syscall(unix.SYS_SETITIMER, unix.ITIMER_REAL, a, 0)
	}
	if err != nil {
		return fmt.Errorf("setting the interval timer: %w", err)
	}
	return nil
}

// fieldAfter is the field of f that starts with prefix, or "".
func fieldAfter(f []string, prefix string) string {
	for _, x := range f {
		if strings.HasPrefix(x, prefix) {
			return x
		}
	}
	return ""
}

// fixUpPrivate gives copy cp its own descriptions in place of those t
// records (see above), but for its listening sockets: a copy to be saved
// as an image (forImage) gets them unbound, and a copy of a restore gets
// them from listenAnew, once the processes the restore killed are out of
// the way.
func fixUpPrivate(cp *ptfork.Proc, t Template, mem *ptfork.Scratch, forImage bool) error {
	if err := fixItimer(cp, t, mem); err != nil {
		return err
	}
	if len(t.Private) == 0 {
		return nil
	}
	for _, p := range t.Private {
		var err error
		switch p.Kind {
		case "pipe":
			err = privatePipe(cp, p, mem)
		case "eventfd":
			flags := p.Flags & (unix.O_NONBLOCK | unix.O_CLOEXEC)
			if p.Semaphore {
				flags |= eventfdSemaphore
			}
			err = replaceFD(cp, p.FD, p.Flags, func() (uintptr, error) {
				return cp.Syscall(unix.SYS_EVENTFD2, uintptr(p.Count), uintptr(flags))
			})
		case "socket":
			typ := p.Type | p.Flags&unix.O_NONBLOCK // SOCK_NONBLOCK is O_NONBLOCK
			err = replaceFD(cp, p.FD, p.Flags, func() (uintptr, error) {
				return cp.Syscall(unix.SYS_SOCKET, uintptr(p.Domain), uintptr(typ), uintptr(p.Proto))
			})
		case "timerfd":
			err = replaceFD(cp, p.FD, p.Flags, func() (uintptr, error) {
				return privateTimerfd(cp, p, mem)
			})
		case "unixlisten", "tcplisten":
			if forImage {
				err = placeListener(cp, p, func() (uintptr, error) { return unboundSocket(cp, p) })
			}
		case "epoll":
			if !forImage {
				// A socket listening anew is put on its fd later: the
				// epoll instance watches it then (listenAnew).
				lfds := listenerFDs(t)
				p.Watches = slices.DeleteFunc(slices.Clone(p.Watches), func(w Watch) bool { return lfds[w.FD] })
			}
			err = privateEpoll(cp, p, mem)
		case "listen":
			err = drainListener(cp.Pid, p.FD)
		}
		if err != nil {
			return fmt.Errorf("giving the copy its own %s (fd %d): %w", p.Kind, p.FD, err)
		}
	}
	return nil
}

// replaceFD puts the description make returns (an fd of the copy's) on fd,
// with its close-on-exec flag from flags, and closes the one make gave.
func replaceFD(cp *ptfork.Proc, fd, flags int, make func() (uintptr, error)) error {
	nfd, err := make()
	if err != nil {
		return err
	}
	if _, err := cp.Syscall(unix.SYS_DUP3, nfd, uintptr(fd), uintptr(flags&unix.O_CLOEXEC)); err != nil {
		return fmt.Errorf("dup3 onto fd %d: %w", fd, err)
	}
	_, err = cp.Syscall(unix.SYS_CLOSE, nfd)
	return err
}

// privatePipe gives the copy a new pipe holding what the template's held,
// on the fds of its read ends and of its write ends (p).
func privatePipe(cp *ptfork.Proc, p Private, mem *ptfork.Scratch) error {
	a, err := mem.Put("")
	if err != nil {
		return err
	}
	if _, err := cp.Syscall(unix.SYS_PIPE2, a, unix.O_CLOEXEC); err != nil {
		return fmt.Errorf("pipe2: %w", err)
	}
	var b [8]byte
	if err := cp.Read(a, b[:]); err != nil {
		return err
	}
	r, w := uintptr(binary.NativeEndian.Uint32(b[:4])), uintptr(binary.NativeEndian.Uint32(b[4:]))
	if p.Size > 0 {
		if _, err := cp.Syscall(unix.SYS_FCNTL, r, unix.F_SETPIPE_SZ, uintptr(p.Size)); err != nil {
			return fmt.Errorf("setting the pipe's size: %w", err)
		}
	}
	if len(p.Data) > 0 {
		if err := fillPipe(cp.Pid, int(w), p.Data); err != nil {
			return err
		}
	}
	reads := append([]PrivateFD{{FD: p.FD, Flags: p.Flags}}, p.Read...)
	ends := append(reads, p.Write...)
	for i, e := range ends {
		src := r
		if i >= len(reads) {
			src = w
		}
		if _, err := cp.Syscall(unix.SYS_DUP3, src, uintptr(e.FD), uintptr(e.Flags&unix.O_CLOEXEC)); err != nil {
			return fmt.Errorf("dup3 onto fd %d: %w", e.FD, err)
		}
		if _, err := cp.Syscall(unix.SYS_FCNTL, uintptr(e.FD), unix.F_SETFL, uintptr(e.Flags&unix.O_NONBLOCK)); err != nil {
			return fmt.Errorf("fcntl of fd %d: %w", e.FD, err)
		}
	}
	// The new pipe's fds were free, so none of the ends: both go.
	for _, fd := range []uintptr{r, w} {
		if _, err := cp.Syscall(unix.SYS_CLOSE, fd); err != nil {
			return err
		}
	}
	return nil
}

// fillPipe writes data into the write end fd of stopped process pid's new
// pipe, from the server (it fits: it came out of a pipe of that size).
func fillPipe(pid, fd int, data []byte) error {
	pidfd, err := unix.PidfdOpen(pid, 0)
	if err != nil {
		return err
	}
	defer unix.Close(pidfd)
	w, err := unix.PidfdGetfd(pidfd, fd, 0)
	if err != nil {
		return err
	}
	defer unix.Close(w)
	// Non-blocking (the write end's own flags are set after): a pipe the
	// kernel made smaller than asked (its user past its pipe pages) would
	// hold the server's write forever.
	if _, err := unix.FcntlInt(uintptr(w), unix.F_SETFL, unix.O_NONBLOCK); err != nil {
		return err
	}
	if size, err := unix.FcntlInt(uintptr(w), unix.F_GETPIPE_SZ, 0); err == nil && size < len(data) {
		return fmt.Errorf("the new pipe holds %d bytes, less than the %d the process's held (its user is past its pipe pages)", size, len(data))
	}
	for len(data) > 0 {
		n, err := unix.Write(w, data)
		if err != nil {
			return fmt.Errorf("filling the pipe: %w", err)
		}
		data = data[n:]
	}
	return nil
}

// privateEpoll gives the copy a new epoll instance watching what p's did,
// on the fds it has now (its own descriptions where it was given them).
func privateEpoll(cp *ptfork.Proc, p Private, mem *ptfork.Scratch) error {
	ep, err := cp.Syscall(unix.SYS_EPOLL_CREATE1, uintptr(p.Flags&unix.O_CLOEXEC))
	if err != nil {
		return fmt.Errorf("epoll_create1: %w", err)
	}
	for _, w := range p.Watches {
		if err := epollWatch(cp, ep, w, mem); err != nil {
			return err
		}
	}
	if _, err := cp.Syscall(unix.SYS_DUP3, ep, uintptr(p.FD), uintptr(p.Flags&unix.O_CLOEXEC)); err != nil {
		return fmt.Errorf("dup3 onto fd %d: %w", p.FD, err)
	}
	_, err = cp.Syscall(unix.SYS_CLOSE, ep)
	return err
}

// epollWatch has epoll instance ep of copy cp watch w.
func epollWatch(cp *ptfork.Proc, ep uintptr, w Watch, mem *ptfork.Scratch) error {
	var ev [12]byte // struct epoll_event, packed
	binary.NativeEndian.PutUint32(ev[:4], w.Events)
	binary.NativeEndian.PutUint64(ev[4:], w.Data)
	a, err := mem.Put(string(ev[:]))
	if err != nil {
		return err
	}
	if _, err := cp.Syscall(unix.SYS_EPOLL_CTL, ep, unix.EPOLL_CTL_ADD, uintptr(w.FD), a); err != nil {
		return fmt.Errorf("watching fd %d: %w", w.FD, err)
	}
	return nil
}

// privateTimerfd makes a timerfd in the copy on p's clock, armed with what
// was left of p's timer, relative to now.
func privateTimerfd(cp *ptfork.Proc, p Private, mem *ptfork.Scratch) (uintptr, error) {
	fd, err := cp.Syscall(unix.SYS_TIMERFD_CREATE, uintptr(p.Clock), uintptr(p.Flags&(unix.O_NONBLOCK|unix.O_CLOEXEC)))
	if err != nil || p.Timer == [4]uint64{} {
		return fd, err
	}
	var b [32]byte
	for i, v := range p.Timer {
		binary.NativeEndian.PutUint64(b[8*i:], v)
	}
	a, err := mem.Put(string(b[:]))
	if err == nil {
		_, err = cp.Syscall(unix.SYS_TIMERFD_SETTIME, fd, 0, a, 0)
	}
	return fd, err
}

// listenAnew gives copy cp, fixed up (fixUpPrivate), a new socket in
// place of each listening socket t records, listening where the process's
// did. It releases mem, cp's scratch page.
func listenAnew(cp *ptfork.Proc, t Template, mem *ptfork.Scratch) (err error) {
	defer func() {
		if uerr := mem.Release(); uerr != nil && err == nil {
			err = uerr
		}
	}()
	for _, p := range t.Private {
		if !p.listensAnew() {
			continue
		}
		err := placeListener(cp, p, func() (uintptr, error) {
			if p.Kind == "tcplisten" {
				return listenTCP(cp, p, mem)
			}
			return rebindUnix(cp, p, mem)
		})
		if err != nil {
			return fmt.Errorf("listening anew (fd %d): %w", p.FD, err)
		}
	}
	return watchListeners(cp, t, mem)
}

// listenerFDs are the fds of t's sockets that listen anew in its copies.
func listenerFDs(t Template) map[int]bool {
	fds := map[int]bool{}
	for _, p := range t.Private {
		if p.listensAnew() {
			fds[p.FD] = true
			for _, o := range p.Read {
				fds[o.FD] = true
			}
		}
	}
	return fds
}

// watchListeners has copy cp's epoll instances (made by fixUpPrivate
// without them) watch its sockets listening anew, as the process's did:
// an instance watches a description, and the one on the fd at fixUp was
// the template's unbound socket.
func watchListeners(cp *ptfork.Proc, t Template, mem *ptfork.Scratch) error {
	lfds := listenerFDs(t)
	for _, p := range t.Private {
		if p.Kind != "epoll" {
			continue
		}
		for _, w := range p.Watches {
			if !lfds[w.FD] {
				continue
			}
			if err := epollWatch(cp, uintptr(p.FD), w, mem); err != nil {
				return fmt.Errorf("epoll instance of fd %d: %w", p.FD, err)
			}
		}
	}
	return nil
}

// addSocketPrivate records socket sp in pi if its copies get their own:
// one more fd of a listening socket made anew gets the new one too
// (placeListener).
func addSocketPrivate(pidfd int, sp special, pi *procInfo) {
	if l := listenerOn(pi.tpl.Private, sp.link); l != nil {
		l.Read = append(l.Read, PrivateFD{FD: sp.fd, Flags: sp.flags})
		return
	}
	if p, ok := socketPrivate(pidfd, sp); ok {
		pi.tpl.Private = append(pi.tpl.Private, p)
	}
}

// listenerOn is the listening socket made anew (tcplisten, unixlisten)
// among ps whose key is link, or nil.
func listenerOn(ps []Private, link string) *Private {
	for i, p := range ps {
		if p.listensAnew() && p.link == link {
			return &ps[i]
		}
	}
	return nil
}

// placeListener puts the socket make returns in cp on listening socket
// p's fd, and on its other fds (p.Read), so that they stay one socket.
func placeListener(cp *ptfork.Proc, p Private, make func() (uintptr, error)) error {
	if err := replaceFD(cp, p.FD, p.Flags, make); err != nil {
		return err
	}
	for _, o := range p.Read {
		if _, err := cp.Syscall(unix.SYS_DUP3, uintptr(p.FD), uintptr(o.FD), uintptr(o.Flags&unix.O_CLOEXEC)); err != nil {
			return fmt.Errorf("dup3 onto fd %d: %w", o.FD, err)
		}
	}
	return nil
}

// unboundSocket makes a socket of listening socket p's kind in cp, not
// bound to anything.
func unboundSocket(cp *ptfork.Proc, p Private) (uintptr, error) {
	domain := p.Domain
	if p.Kind == "unixlisten" {
		domain = unix.AF_UNIX // records made before Domain was set
	}
	return cp.Syscall(unix.SYS_SOCKET, uintptr(domain), uintptr(p.Type|p.Flags&unix.O_NONBLOCK), uintptr(p.Proto))
}

// freeListeners puts an unbound socket of each listening socket's kind in
// its place in template tpl (see above), so that the template does not
// hold the address.
func freeListeners(tpl *ptfork.Proc, t Template) error {
	for _, p := range t.Private {
		if !p.listensAnew() {
			continue
		}
		if err := placeListener(tpl, p, func() (uintptr, error) { return unboundSocket(tpl, p) }); err != nil {
			return fmt.Errorf("letting go of the listening socket of fd %d: %w", p.FD, err)
		}
	}
	return nil
}

// listenTCP makes a TCP socket of p's kind in the copy, with p's options,
// bound to p's address and listening with p's backlog. SO_REUSEADDR is on
// for the bind (connections of the process the restore killed may linger
// in TIME_WAIT on the port) and set to the process's value after it.
func listenTCP(cp *ptfork.Proc, p Private, mem *ptfork.Scratch) (uintptr, error) {
	if len(p.Opts) < len(listenOpts) {
		return 0, fmt.Errorf("the record of the listening socket lacks its options")
	}
	ip, port, ok := p.ListenAddr()
	if !ok {
		return 0, fmt.Errorf("the record of the listening socket lacks its address")
	}
	addr, _ := netip.AddrFromSlice(ip)
	where := fmt.Sprintf("%s port %d", addr.Unmap(), port)
	fd, err := cp.Syscall(unix.SYS_SOCKET, uintptr(p.Domain), uintptr(p.Type|p.Flags&unix.O_NONBLOCK), uintptr(p.Proto))
	if err != nil {
		return 0, err
	}
	set := func(level, name, v int) error {
		var b [4]byte
		binary.NativeEndian.PutUint32(b[:], uint32(v))
		a, err := mem.Put(string(b[:]))
		if err == nil {
			_, err = cp.Syscall(unix.SYS_SETSOCKOPT, fd, uintptr(level), uintptr(name), a, 4)
		}
		return err
	}
	if err := set(unix.SOL_SOCKET, unix.SO_REUSEADDR, 1); err != nil {
		return fd, fmt.Errorf("setting SO_REUSEADDR: %w", err)
	}
	for i, o := range listenOpts[1:] {
		if v := p.Opts[i+1]; v != 0 {
			if err := set(o.level, o.name, v); err != nil {
				return fd, fmt.Errorf("setting option %d/%d: %w", o.level, o.name, err)
			}
		}
	}
	if p.Domain == unix.AF_INET6 && len(p.Opts) > len(listenOpts) {
		if err := set(unix.IPPROTO_IPV6, unix.IPV6_V6ONLY, p.Opts[len(listenOpts)]); err != nil {
			return fd, fmt.Errorf("setting IPV6_V6ONLY: %w", err)
		}
	}
	a, err := mem.Put(string(p.Addr))
	if err != nil {
		return fd, err
	}
	if _, err := cp.Syscall(unix.SYS_BIND, fd, a, uintptr(len(p.Addr))); err != nil {
		if errors.Is(err, unix.EADDRINUSE) {
			return fd, fmt.Errorf("listening on %s again: the address is in use by another socket of the sandbox", where)
		}
		return fd, fmt.Errorf("binding %s: %w", where, err)
	}
	if _, err := cp.Syscall(unix.SYS_LISTEN, fd, uintptr(max(p.Backlog, 0))); err != nil {
		return fd, fmt.Errorf("listening on %s: %w", where, err)
	}
	if p.Opts[0] == 0 {
		if err := set(unix.SOL_SOCKET, unix.SO_REUSEADDR, 0); err != nil {
			return fd, fmt.Errorf("setting SO_REUSEADDR back: %w", err)
		}
	}
	return fd, nil
}

// rebindUnix makes a unix socket of p's type in the copy, bound to p's
// path (the restored root's file there, a socket no one is bound to, is
// removed first) and listening.
func rebindUnix(cp *ptfork.Proc, p Private, mem *ptfork.Scratch) (uintptr, error) {
	if len(p.Path) >= 108 {
		return 0, fmt.Errorf("socket path too long: %q", p.Path)
	}
	fd, err := cp.Syscall(unix.SYS_SOCKET, unix.AF_UNIX, uintptr(p.Type|p.Flags&unix.O_NONBLOCK), 0)
	if err != nil {
		return 0, err
	}
	a, err := mem.Put(p.Path)
	if err != nil {
		return fd, err
	}
	// Only a socket is removed (the restored root's copy of the bound
	// one): anything else at the path stays, and the bind fails.
	if isSocketIn(cp.Pid, p.Path) {
		fdcwd := unix.AT_FDCWD
		if _, err := cp.Syscall(unix.SYS_UNLINKAT, uintptr(fdcwd), a, 0); err != nil && !errors.Is(err, unix.ENOENT) {
			return fd, fmt.Errorf("removing %s: %w", p.Path, err)
		}
	}
	var sa [110]byte // struct sockaddr_un: family, path, NUL
	binary.NativeEndian.PutUint16(sa[:2], unix.AF_UNIX)
	copy(sa[2:], p.Path)
	if a, err = mem.Put(string(sa[:2+len(p.Path)])); err != nil {
		return fd, err
	}
	if _, err := cp.Syscall(unix.SYS_BIND, fd, a, uintptr(2+len(p.Path)+1)); err != nil {
		return fd, fmt.Errorf("binding %s: %w", p.Path, err)
	}
	if err := socketFileAsWas(cp, p, mem); err != nil {
		return fd, err
	}
	if _, err := cp.Syscall(unix.SYS_LISTEN, fd, uintptr(cmp.Or(p.Backlog, unix.SOMAXCONN))); err != nil {
		return fd, fmt.Errorf("listening on %s: %w", p.Path, err)
	}
	return fd, nil
}

// DisarmListener shuts down socket fd of running process pid, from the
// server, if it is still socket key ("socket:[inode]": the process may
// have put another there since it was listed) and a listening TCP socket,
// set to let others bind its address (SO_REUSEADDR), and reports whether
// it did. A socket shut down stops listening but keeps its address until
// it is closed; a new socket with SO_REUSEADDR binds and listens there
// (listenTCP). The caller makes sure no template holds it
// (TemplatesListen).
func DisarmListener(pid, fd int, key string) bool {
	f, err := takeFd(pid, fd)
	if err != nil {
		return false
	}
	defer f.Close()
	sk := int(f.Fd())
	var st unix.Stat_t
	if unix.Fstat(sk, &st) != nil || "socket:["+strconv.FormatUint(st.Ino, 10)+"]" != key {
		return false
	}
	if on, err := unix.GetsockoptInt(sk, unix.SOL_SOCKET, unix.SO_ACCEPTCONN); err != nil || on != 1 {
		return false
	}
	domain, err1 := unix.GetsockoptInt(sk, unix.SOL_SOCKET, unix.SO_DOMAIN)
	typ, err2 := unix.GetsockoptInt(sk, unix.SOL_SOCKET, unix.SO_TYPE)
	if err1 != nil || err2 != nil || domain != unix.AF_INET && domain != unix.AF_INET6 || typ != unix.SOCK_STREAM {
		return false
	}
	return unix.SetsockoptInt(sk, unix.SOL_SOCKET, unix.SO_REUSEADDR, 1) == nil && unix.Shutdown(sk, unix.SHUT_RDWR) == nil
}

// socketFileAsWas gives the file of the unix socket cp just bound at p's
// path the mode and owner the process's had (the bind made it by the
// copy's umask and credentials), where they differ. Records made before
// they kept them (Mode 0) leave it as made.
func socketFileAsWas(cp *ptfork.Proc, p Private, mem *ptfork.Scratch) error {
	if p.Mode == 0 {
		return nil
	}
	st, ok := socketIn(cp.Pid, p.Path)
	if !ok {
		return fmt.Errorf("the socket bound at %s is not there", p.Path)
	}
	uid, ok1 := idIn(cp.Pid, "uid_map", st.Uid)
	gid, ok2 := idIn(cp.Pid, "gid_map", st.Gid)
	if st.Mode&^unix.S_IFMT == p.Mode && ok1 && ok2 && uid == p.UID && gid == p.GID {
		return nil
	}
	a, err := mem.Put(p.Path)
	if err != nil {
		return err
	}
	fdcwd := unix.AT_FDCWD
	if !ok1 || !ok2 || uid != p.UID || gid != p.GID {
		if _, err := cp.Syscall(unix.SYS_FCHOWNAT, uintptr(fdcwd), a, uintptr(p.UID), uintptr(p.GID), unix.AT_SYMLINK_NOFOLLOW); err != nil {
			return fmt.Errorf("giving %s its owner %d:%d back: %w", p.Path, p.UID, p.GID, err)
		}
	}
	if _, err := cp.Syscall(unix.SYS_FCHMODAT, uintptr(fdcwd), a, uintptr(p.Mode)); err != nil {
		return fmt.Errorf("giving %s its mode %#o back: %w", p.Path, p.Mode, err)
	}
	return nil
}

// drainListener ends the connections waiting to be accepted on listening
// socket fd of stopped process pid, from the server: they were made to an
// earlier copy, or to the process after the checkpoint.
func drainListener(pid, fd int) error {
	pidfd, err := unix.PidfdOpen(pid, 0)
	if err != nil {
		return err
	}
	defer unix.Close(pidfd)
	l, err := unix.PidfdGetfd(pidfd, fd, 0)
	if err != nil {
		return err
	}
	defer unix.Close(l)
	for {
		// poll first: accept on a blocking socket would wait.
		pfd := []unix.PollFd{{Fd: int32(l), Events: unix.POLLIN}}
		if n, err := unix.Poll(pfd, 0); err != nil || n == 0 {
			return nil
		}
		c, _, err := unix.Accept4(l, unix.SOCK_NONBLOCK|unix.SOCK_CLOEXEC)
		if err != nil {
			return nil
		}
		unix.Close(c)
	}
}
