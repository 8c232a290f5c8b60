package sandbox

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"os"
	"slices"
	"strconv"
	"strings"
	"time"

	"golang.org/x/sys/unix"

	"github.com/deltagym/deltagym/internal/wiretext"
	"github.com/deltagym/deltagym/sandbox/cgroup"
)

// The processes of a sandbox, as its agent sees them: every process of its command group
// (commands, what they left running, sessions and their jobs; not the init, nor the frozen
// copies checkpoints keep, nor what a restore killed and is still exiting), named by their pids
// in the sandbox's pid namespace. They are read from the host's /proc, which the agent cannot
// change: the sandbox's own /proc is the agent's to unmount or replace. A host pid maps to the
// sandbox's by NSpid (and NSpgid, NSsid) in /proc/<pid>/status, at the level of the
// sandbox's namespace among the init's.

// Process describes a process of the sandbox (ListProcesses).
type Process struct {
	// Pid, PPid, Pgid and Sid are in the sandbox's pid namespace; PPid is 0 for a process
	// whose parent is not the sandbox's (or is gone).
	Pid, PPid, Pgid, Sid int
	// Argv is its command line, cut at MaxArgvBytes.
	Argv []string
	// State is its state letter, as in /proc (R, S, D, Z, T ...).
	State string
	// Session names the persistent session (ExecRequest.Session) it runs in, if any.
	Session string
	// Age is how long ago it started.
	Age time.Duration
}

// MaxArgvBytes bounds the command line a Process gives of each process.
const MaxArgvBytes = 4 << 10

// ProcError is why a signal found no process: Errno (ESRCH) and Msg say it. It is the
// sandbox's state (the agent's), not the request's, that has no such process.
type ProcError struct {
	Pid   int
	Errno unix.Errno
	Msg   string
}

// Error implements error.
func (e *ProcError) Error() string { return ErrNotFound.Error() + ": " + e.Msg }

// Unwrap returns ErrNotFound and the errno.
func (e *ProcError) Unwrap() []error { return []error{ErrNotFound, e.Errno} }

// MaxSignal is the largest signal number (SIGRTMAX).
const MaxSignal = 64

// procEntry is what status and stat say of a process of the sandbox: host is its host pid,
// hostPPid its parent's, and the rest in the sandbox's namespace.
type procEntry struct {
	host, hostPPid  int
	pid, pgid, sid  int
	state           string
	startTicks      uint64
	startTicksValid bool
}

// is reports whether the process is pid, or with group in process group pid.
func (e procEntry) is(pid int, group bool) bool {
	if group {
		return e.pgid == pid
	}
	return e.pid == pid
}

// ListProcesses lists the sandbox's processes, by pid.
func (s *Sandbox) ListProcesses(ctx context.Context) ([]Process, error) {
	_, err := s.beginExec()
	defer s.op.RUnlock()
	if err != nil {
		return nil, err
	}
	level, err := s.nsLevel()
	if err != nil {
		return nil, err
	}
	entries, err := s.procEntries(level)
	if err != nil {
		return nil, err
	}
	ns := map[int]int{s.init.Pid: 1}
	for _, e := range entries {
		ns[e.host] = e.pid
	}
	sessions := s.sessionPids()
	now := bootTicks()
	out := make([]Process, 0, len(entries))
	for _, e := range entries {
		p := Process{Pid: e.pid, PPid: ns[e.hostPPid], Pgid: e.pgid, Sid: e.sid, State: e.state, Session: sessions[e.host],
			Argv: readArgv(e.host)}
		if e.startTicksValid && now >= e.startTicks {
			p.Age = time.Duration(now-e.startTicks) * (time.Second / clockTicks)
		}
		out = append(out, p)
	}
	slices.SortFunc(out, byPid)
	return out, nil
}

// Signal sends sig (0: SIGTERM) to process pid of the sandbox, or with group to every process
// of the sandbox in process group pid. The init (pid 1) and pids that are not positive are
// ErrInvalid, as is a signal number past MaxSignal; a pid (or group) that no process of the
// sandbox has is a *ProcError (ESRCH). Each process is signalled through a pidfd opened
// before its membership is checked, so a pid reused by another process between the two gets
// nothing: the pidfd's own process is gone (ESRCH, which counts as gone).
func (s *Sandbox) Signal(ctx context.Context, pid int, sig unix.Signal, group bool) error {
	if err := checkSignal(pid, sig); err != nil {
		return err
	}
	if sig == 0 {
		sig = unix.SIGTERM
	}
	_, err := s.beginExec()
	defer s.op.RUnlock()
	if err != nil {
		return err
	}
	level, err := s.nsLevel()
	if err != nil {
		return err
	}
	entries, err := s.procEntries(level)
	if err != nil {
		return err
	}
	fds := map[int]int{} // host pid -> pidfd, of the targets
	defer closeFds(fds)
	for _, e := range entries {
		if e.is(pid, group) {
			if fd, err := unix.PidfdOpen(e.host, 0); err == nil { // else gone
				fds[e.host] = fd
			}
		}
	}
	// Each target as its pidfd holds it: it is still the sandbox's process of that pid (or
	// group) if it still is the process its host pid names now.
	again, err := s.procEntries(level)
	if err != nil {
		return err
	}
	sent := 0
	for _, e := range again {
		fd, ok := fds[e.host]
		if !ok || !e.is(pid, group) {
			continue
		}
		switch err := unix.PidfdSendSignal(fd, sig, nil, 0); {
		case err == nil:
			sent++
		case !errors.Is(err, unix.ESRCH):
			return fmt.Errorf("signalling process %d: %w", e.pid, err)
		}
	}
	if sent == 0 {
		what := "process"
		if group {
			what = "process group"
		}
		return &ProcError{Pid: pid, Errno: unix.ESRCH, Msg: fmt.Sprintf("no %s %d in the sandbox", what, pid)}
	}
	return nil
}

// byPid orders processes by pid.
func byPid(a, b Process) int { return a.Pid - b.Pid }

// closeFds closes the pidfds of fds.
func closeFds(fds map[int]int) {
	for _, fd := range fds {
		unix.Close(fd)
	}
}

// checkSignal checks a signal's request: a pid other than the init's, and a signal number.
func checkSignal(pid int, sig unix.Signal) error {
	switch {
	case pid == 1:
		return fmt.Errorf("%w: pid 1 is the sandbox's init, which cannot be signalled", ErrInvalid)
	case pid <= 0:
		return fmt.Errorf("%w: pid %d: a process (or process group) is a positive pid", ErrInvalid, pid)
	case sig < 0 || sig > MaxSignal:
		return fmt.Errorf("%w: signal %d is not a signal number (1 to %d; 0 means SIGTERM)", ErrInvalid, int(sig), MaxSignal)
	}
	return nil
}

// nsLevel is the depth of the sandbox's pid namespace: the number of pids in the init's NSpid.
func (s *Sandbox) nsLevel() (int, error) {
	st, err := os.ReadFile("/proc/" + strconv.Itoa(s.init.Pid) + "/status")
	if err != nil {
		return 0, fmt.Errorf("reading the init's status: %w", err)
	}
	ids := statusIDs(st, "NSpid:")
	if len(ids) == 0 || ids[len(ids)-1] != 1 {
		return 0, fmt.Errorf("the init's NSpid %v does not end with pid 1", ids)
	}
	return len(ids), nil
}

// procEntries reads the processes of the command group, those it can (one that exits while it
// reads is left out).
func (s *Sandbox) procEntries(level int) ([]procEntry, error) {
	hosts, err := s.workGroup().Pids()
	if err != nil {
		if errors.Is(err, os.ErrNotExist) {
			return nil, nil
		}
		return nil, err
	}
	out := make([]procEntry, 0, len(hosts))
	for _, h := range hosts {
		if h == s.init.Pid {
			continue
		}
		if e, ok := readProcEntry(h, level); ok && e.pid > 1 {
			out = append(out, e)
		}
	}
	return out, nil
}

// readProcEntry reads host pid h's status and stat, with its ids at namespace level level.
func readProcEntry(h, level int) (procEntry, bool) {
	dir := "/proc/" + strconv.Itoa(h)
	st, err := os.ReadFile(dir + "/status")
	if err != nil {
		return procEntry{}, false
	}
	e := procEntry{host: h}
	pids, pgids, sids := statusIDs(st, "NSpid:"), statusIDs(st, "NSpgid:"), statusIDs(st, "NSsid:")
	if len(pids) < level || len(pgids) < level || len(sids) < level {
		return procEntry{}, false // not in the sandbox's namespace
	}
	e.pid, e.pgid, e.sid = pids[level-1], pgids[level-1], sids[level-1]
	if pp := statusIDs(st, "PPid:"); len(pp) == 1 {
		e.hostPPid = pp[0]
	}
	if v, ok := statusField(st, "State:"); ok && v != "" {
		e.state = v[:1]
	}
	if stat, err := os.ReadFile(dir + "/stat"); err == nil {
		e.startTicks, e.startTicksValid = statStart(stat)
	}
	return e, true
}

// statusField returns the value of the line of /proc/<pid>/status that starts with key.
func statusField(st []byte, key string) (string, bool) {
	for line := range bytes.Lines(st) {
		if v, ok := bytes.CutPrefix(line, []byte(key)); ok {
			return strings.TrimSpace(string(v)), true
		}
	}
	return "", false
}

// statusIDs returns the numbers of the status line key (NSpid: 812 7).
func statusIDs(st []byte, key string) []int {
	v, ok := statusField(st, key)
	if !ok {
		return nil
	}
	var ids []int
	for _, f := range strings.Fields(v) {
		n, err := strconv.Atoi(f)
		if err != nil {
			return nil
		}
		ids = append(ids, n)
	}
	return ids
}

// statStart returns the start time (field 22, clock ticks since boot) of /proc/<pid>/stat.
func statStart(stat []byte) (uint64, bool) {
	i := bytes.LastIndexByte(stat, ')') // the command name, in parentheses, may hold anything
	if i < 0 {
		return 0, false
	}
	f := strings.Fields(string(stat[i+1:]))
	const start = 22 - 3 // fields from the state (3) on
	if len(f) <= start {
		return 0, false
	}
	n, err := strconv.ParseUint(f[start], 10, 64)
	return n, err == nil
}

// clockTicks is USER_HZ, the unit of /proc's times: 100 on every Linux architecture.
const clockTicks = 100

// bootTicks is the time since boot in clock ticks.
func bootTicks() uint64 {
	var ts unix.Timespec
	if unix.ClockGettime(unix.CLOCK_BOOTTIME, &ts) != nil {
		return 0
	}
	return uint64(ts.Sec)*clockTicks + uint64(ts.Nsec)/(1e9/clockTicks)
}

// readArgv reads host pid h's command line, cut at MaxArgvBytes.
func readArgv(h int) []string {
	f, err := os.Open("/proc/" + strconv.Itoa(h) + "/cmdline")
	if err != nil {
		return nil
	}
	defer f.Close()
	buf := make([]byte, MaxArgvBytes)
	n, _ := f.Read(buf)
	b := bytes.TrimSuffix(buf[:n], []byte{0})
	if len(b) == 0 {
		return nil
	}
	return strings.Split(wiretext.String(string(b)), "\x00") // the API's rule for text that is not UTF-8
}

// sessionPids maps the host pids of the sandbox's sessions' processes to the sessions' names.
func (s *Sandbox) sessionPids() map[int]string {
	s.mu.Lock()
	groups := make(map[string]*cgroup.Cgroup, len(s.sessions))
	for name, se := range s.sessions {
		groups[name] = se.cg
	}
	s.mu.Unlock()
	out := map[int]string{}
	for name, cg := range groups {
		pids, _ := cg.Pids()
		for _, p := range pids {
			out[p] = name
		}
	}
	return out
}
