package sandbox

import (
	"bufio"
	"bytes"
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"os"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"sync"
	"time"

	"golang.org/x/sys/unix"

	"github.com/deltagym/deltagym/sandbox/cgroup"
	"github.com/deltagym/deltagym/sandbox/initproc"
	"github.com/deltagym/deltagym/sandbox/procstate"
)

type out struct {
	data      []byte
	truncated bool
	rc        int
	ok        bool
}

// A session is a persistent bash, fed commands on its stdin. Each command is
// sent as `eval $'…' </dev/null` — ANSI-C quoted, so any text is one word and
// cannot break out of the protocol; eval runs it in the shell itself, so cd,
// exports and functions persist — followed by a line that prints a sentinel
// with $? on stdout and a sentinel on stderr. The sentinels carry a random
// nonce per session, so that no output matches them by chance; the shell is
// the agent's own, and a command that reads the nonce from it can end its own
// step early, which misleads no one but its own trajectory. An interactive command
// (Interact, interact.go) reads the shell's input instead of /dev/null.
type session struct {
	// +checklocks:mu
	name    string
	cg      *cgroup.Cgroup
	hostPid int
	stdin   *os.File
	stdout  *bufio.Reader
	stderr  *bufio.Reader
	outF    *os.File
	errF    *os.File
	// +checklocks:mu
	nonce  string
	exited chan struct{}
	status unix.WaitStatus // how the shell ended, once exited is closed

	mu     sync.Mutex // one command at a time
	broken bool
	// attached: an interactive command (interact.go) still runs, its sentinel to come.
	// +checklocks:mu
	attached bool
	// pending is output read past an interactive command's match: the next call's.
	// +checklocks:mu
	pending []byte
}

var sessionNameRE = regexp.MustCompile(`^[a-zA-Z0-9_.-]{1,64}$`)

func (s *Sandbox) sessionExec(ctx context.Context, req ExecRequest) (ExecResult, error) {
	if !sessionNameRE.MatchString(req.Session) {
		return ExecResult{}, fmt.Errorf("%w: session name %q: use 1-64 letters, digits, '_', '.', '-'", ErrInvalid, req.Session)
	}
	if len(req.Stdin) > 0 {
		return ExecResult{}, fmt.Errorf("%w: session commands take no stdin", ErrInvalid)
	}
	gen, err := s.beginExec()
	defer s.op.RUnlock()
	if err != nil {
		return ExecResult{}, err
	}
	if err := s.materialize(); err != nil {
		return ExecResult{}, err
	}
	se, err := s.session(req.Session)
	if err != nil {
		return ExecResult{}, err
	}
	res, err := se.run(ctx, gen, req)
	if se.isBroken() {
		s.mu.Lock()
		if s.sessions[req.Session] == se {
			delete(s.sessions, req.Session)
		}
		s.mu.Unlock()
		se.close()
	}
	return res, err
}

// session returns the named session, starting it on first use.
func (s *Sandbox) session(name string) (*session, error) {
	s.mu.Lock()
	se := s.sessions[name]
	s.mu.Unlock()
	if se != nil {
		return se, nil
	}
	cg, err := s.subgroup("s")
	if err != nil {
		return nil, fmt.Errorf("creating session cgroup: %w", err)
	}
	se, err = s.startSession(name, cg)
	if err != nil {
		_ = cg.Delete()
		return nil, err
	}
	s.mu.Lock()
	if other := s.sessions[name]; other != nil {
		s.mu.Unlock()
		se.close()
		return other, nil
	}
	s.sessions[name] = se
	s.mu.Unlock()
	return se, nil
}

func (s *Sandbox) startSession(name string, cg *cgroup.Cgroup) (*session, error) {
	procs, err := cg.OpenProcs()
	if err != nil {
		return nil, err
	}
	defer closeAll(procs)
	inR, inW, err := os.Pipe()
	if err != nil {
		return nil, err
	}
	outR, outW, err := os.Pipe()
	if err != nil {
		inR.Close()
		inW.Close()
		return nil, err
	}
	errR, errW, err := os.Pipe()
	if err != nil {
		inR.Close()
		inW.Close()
		outR.Close()
		outW.Close()
		return nil, err
	}
	s.shmMayChange()
	nsPid, wait, err := s.init.Conn.Spawn(initproc.SpawnRequest{
		Argv: []string{"bash", "--noprofile", "--norc"}, Env: s.env([]string{"PS1=", "PS2="}),
		Cwd: s.cwd(""), UID: s.spec.UID, GID: s.spec.GID, Flags: initproc.FlagSetsid, CgroupProcs: procs,
		Stdin: inR, Stdout: outW, Stderr: errW,
	})
	inR.Close()
	outW.Close()
	errW.Close()
	if err != nil {
		inW.Close()
		outR.Close()
		errR.Close()
		return nil, fmt.Errorf("starting session %s (bash): %w", name, s.spawnError(err))
	}
	var b [8]byte
	_, _ = rand.Read(b[:])
	se := &session{
		name: name, cg: cg, stdin: inW, outF: outR, errF: errR,
		stdout: shellStream(outR), stderr: shellStream(errR),
		nonce: hex.EncodeToString(b[:]), exited: make(chan struct{}),
	}
	go se.watchExit(wait)
	// Remember the shell's host pid, so a timeout can kill what it runs and spare it. It is
	// told by its pid, not by being alone in the group: a `bash` that is a wrapper may have
	// started others before it execs the shell.
	host, err := s.hostPidIn(cg, nsPid)
	if err != nil {
		se.close()
		return nil, fmt.Errorf("starting session %s: %w", name, err)
	}
	se.hostPid = host
	return se, nil
}

// hostPidIn returns the host pid of the process of group cg whose pid in the sandbox is nsPid.
// It fails with ErrSessionEnded when there is none: the process has exited.
func (s *Sandbox) hostPidIn(cg *cgroup.Cgroup, nsPid int) (int, error) {
	level, err := s.nsLevel()
	if err != nil {
		return 0, err
	}
	hosts, err := cg.Pids()
	if err != nil {
		return 0, err
	}
	for _, h := range hosts {
		if e, ok := readProcEntry(h, level); ok && e.pid == nsPid {
			return h, nil
		}
	}
	return 0, fmt.Errorf("%w: its shell (bash, pid %d) exited as it started", ErrSessionEnded, nsPid)
}

// ansiC quotes s as a bash $'…' word.
func ansiC(s string) string {
	var b strings.Builder
	b.WriteString("$'")
	for i := 0; i < len(s); i++ {
		c := s[i]
		if c >= 'a' && c <= 'z' || c >= 'A' && c <= 'Z' || c >= '0' && c <= '9' || c == ' ' || c == '_' || c == '-' || c == '.' || c == '/' {
			b.WriteByte(c)
		} else {
			fmt.Fprintf(&b, "\\x%02x", c)
		}
	}
	b.WriteByte('\'')
	return b.String()
}

// sessionEnded is the error of a command sent to session name after its
// shell exited.
func sessionEnded(name string) error {
	return fmt.Errorf("%w: session %s: its shell has exited", ErrSessionEnded, name)
}

func (se *session) run(ctx, gen context.Context, req ExecRequest) (ExecResult, error) {
	se.mu.Lock()
	defer se.mu.Unlock()
	if se.broken {
		return ExecResult{}, sessionEnded(se.name)
	}
	tag := "__DG_" + se.nonce
	if req.Interact != nil {
		return se.interact(ctx, gen, req, tag)
	}
	if se.attached {
		if err := se.detach(ctx, gen, tag); err != nil {
			return ExecResult{}, err
		}
		if se.broken {
			return ExecResult{}, sessionEnded(se.name)
		}
	}
	start := time.Now()
	if _, err := se.stdin.Write([]byte(sessionScript(req, tag))); err != nil {
		se.broken = true
		return ExecResult{}, sessionEnded(se.name)
	}
	outc := make(chan out, 1)
	errc := make(chan out, 1)
	go func() {
		d, t, rc, ok := readUntil(se.stdout, tag+"_RC=", req.MaxOutput, streamOutput(req.Output, OutputStdout))
		outc <- out{d, t, rc, ok}
	}()
	go func() {
		d, t, _, ok := readUntil(se.stderr, tag, req.MaxOutput, streamOutput(req.Output, OutputStderr))
		errc <- out{d, t, 0, ok}
	}()
	res := ExecResult{Start: start, ExitCode: -1}
	o, e, err := se.await(ctx, gen, req.Timeout, &res, outc, errc)
	if err != nil {
		return res, err
	}
	res.Duration = time.Since(start)
	res.Stdout, res.StdoutTruncated = o.data, o.truncated
	res.Stderr, res.StderrTruncated = e.data, e.truncated
	se.conclude(&res, o, e)
	if !se.broken {
		se.atRest()
	}
	return res, nil
}

// atRestWait bounds atRest's wait for the shell to be back at rest.
const atRestWait = 50 * time.Millisecond

// atRest waits, up to atRestWait, for the shell to be back at rest: blocked reading its next
// line from stdin. Bash prints the last sentinel before it has freed what the command left and
// gone back to its read; a checkpoint taken in between would hold a shell in mid-step, whose
// memory differs from that of the same shell at rest, so the two states' digests would differ
// (statedigest.go). A shell that a background job of its own keeps busy is not waited for past
// the bound. Called with se.mu held.
func (se *session) atRest() {
	path := "/proc/" + strconv.Itoa(se.hostPid) + "/syscall"
	deadline := time.Now().Add(atRestWait)
	pause := 20 * time.Microsecond
	for {
		// "0 0x0 ": read(0, …), the first field the call's number, the second its fd.
		b, err := os.ReadFile(path)
		if err != nil || bytes.HasPrefix(b, []byte("0 0x0 ")) || time.Now().After(deadline) {
			return
		}
		time.Sleep(pause)
		pause = min(2*pause, time.Millisecond)
	}
}

// sessionScript is what the shell is fed to run req: the command with its
// environment and directory, then the sentinels tagged tag.
func sessionScript(req ExecRequest, tag string) string {
	script := ""
	for _, kv := range req.Env {
		k, v, _ := strings.Cut(kv, "=")
		script += "export " + k + "=" + ansiC(v) + "; "
	}
	if req.Cwd != "" {
		script += "cd " + ansiC(req.Cwd) + " && "
	}
	// The stderr sentinel goes first and the stdout one last: printing to
	// stderr is a redirection that bash undoes (dup2 back from a saved fd)
	// after it wrote, so a step that returned on its sentinel could leave
	// bash in the middle of that undo, and a checkpoint taken then would
	// capture the saved fd (procs.go replaces only 0, 1 and 2).
	return script + "eval " + ansiC(req.Command) + " </dev/null\n" +
		"__dg_rc=$?; printf '\\n" + tag + "\\n' >&2; printf '\\n" + tag + "_RC=%d\\n' \"$__dg_rc\"\n"
}

// await waits for both sentinels (or the streams' end). At the timeout it
// ends what the shell runs (res.TimedOut), and a second later the shell
// itself; an abort (ctx, or a restore or Destroy ending gen) breaks the
// session and returns its error. Called with se.mu held.
func (se *session) await(ctx, gen context.Context, timeout time.Duration, res *ExecResult, outc, errc chan out) (o, e out, err error) {
	timer := time.NewTimer(timeout)
	defer timer.Stop()
	gotOut, gotErr := false, false
	exited := se.exited
	for !gotOut || !gotErr {
		select {
		case o = <-outc:
			gotOut = true
		case e = <-errc:
			gotErr = true
		case <-exited:
			// The shell is gone (the command ran exit, or the timeout killed it): its streams
			// end only when every copy of their write ends is closed, and a checkpoint's
			// template of the shell holds copies. Read what is buffered, then stop.
			exited = nil
			se.stopReading(exitDrain)
		case <-timer.C:
			if !res.TimedOut {
				// End what the shell runs and spare the shell, which then
				// prints the sentinels; give it a second to do so.
				res.TimedOut = true
				se.killChildren()
				timer.Reset(time.Second)
			} else {
				// The shell itself is stuck (a builtin loop): end it.
				se.broken = true
				_ = se.cg.Kill()
			}
		case <-ctx.Done():
			// The caller's own deadline or cancellation, not an abort by Restore or Destroy.
			return o, e, se.abortRun(outc, errc, fmt.Errorf("session command cut short: %w", context.Cause(ctx)))
		case <-gen.Done():
			return o, e, se.abortRun(outc, errc, fmt.Errorf("%w: the sandbox was restored or closed", ErrAborted))
		}
	}
	return o, e, nil
}

// conclude sets how the command ended from its sentinels' replies o and e:
// its status, a timeout's SIGKILL, or, if the shell itself ended (the
// command ran `exit`, say), how the shell did, which breaks the session.
// Called with se.mu held.
func (se *session) conclude(res *ExecResult, o, e out) {
	if !o.ok || !e.ok {
		se.broken = true
		if res.TimedOut {
			res.Signal = "SIGKILL"
			return
		}
		res.ExitCode = 0
		select {
		case <-se.exited:
			if se.status.Signaled() {
				res.ExitCode, res.Signal = -1, signalName(int(se.status.Signal()))
			} else {
				res.ExitCode = se.status.ExitStatus()
			}
		case <-time.After(200 * time.Millisecond):
		}
		return
	}
	if res.TimedOut {
		res.Signal = "SIGKILL"
		return
	}
	res.ExitCode = o.rc
	if o.rc > 128 {
		// bash reports a command killed by signal N as 128+N.
		res.ExitCode = -1
		res.Signal = signalName(o.rc - 128)
	}
}

func (se *session) abortRun(outc, errc chan out, err error) error {
	se.broken = true
	_ = se.cg.Kill()
	se.outF.Close()
	se.errF.Close()
	<-outc
	<-errc
	return err
}

// killChildren kills every process of the session but its shell.
func (se *session) killChildren() { se.signalChildren(unix.SIGKILL) }

// readUntil reads lines until one starts with marker (and, for the stdout
// marker, carries the exit code), keeping at most limit bytes of what came
// before it, minus the newline the sentinel printf added. out, when not nil, is
// given what is kept as it is read, a line (or a buffer's worth) at a time.
func readUntil(r *bufio.Reader, marker string, limit int, out func([]byte)) (data []byte, truncated bool, rc int, ok bool) {
	var buf bytes.Buffer
	atLineStart := true
	sent := streamed{out: out, limit: limit}
	for {
		line, err := r.ReadSlice('\n')
		if atLineStart && bytes.HasPrefix(line, []byte(marker)) && (len(line) > 0 && line[len(line)-1] == '\n') {
			rest := strings.TrimSpace(string(line[len(marker):]))
			if rest == "" || marker[len(marker)-1] == '=' {
				if n, perr := strconv.Atoi(rest); perr == nil || rest == "" {
					b := buf.Bytes()
					if len(b) > 0 && b[len(b)-1] == '\n' {
						b = b[:len(b)-1]
					}
					if len(b) > limit { // cut, the newline kept for the sentinel's was the command's
						b = b[:limit]
					}
					return b, truncated, n, true
				}
			}
		}
		if len(line) > 0 {
			atLineStart = line[len(line)-1] == '\n'
			room := limit + 1 - buf.Len() // +1: the sentinel's newline
			if len(line) > room {
				truncated = true
				line = line[:max(room, 0)]
			}
			buf.Write(line)
			sent.add(line)
		}
		if err != nil && err != bufio.ErrBufferFull {
			b := buf.Bytes()
			if len(b) > limit {
				b = b[:limit]
			}
			sent.flush()
			return b, truncated, 0, false
		}
		if err == bufio.ErrBufferFull {
			atLineStart = false
		}
	}
}

// streamed gives a session command's output to out as readUntil reads it, up to limit
// bytes, holding a final newline back until more follows: the newline before the sentinel is
// the sentinel's, not the command's.
type streamed struct {
	out   func([]byte)
	limit int
	n     int  // bytes given
	held  bool // a newline is held back
}

// add gives line (which the reader reuses: it is copied) to out.
func (s *streamed) add(line []byte) {
	if s.out == nil || len(line) == 0 {
		return
	}
	p := make([]byte, 0, len(line)+1)
	if s.held {
		p = append(p, '\n')
	}
	p = append(p, line...)
	s.held = p[len(p)-1] == '\n'
	if s.held {
		p = p[:len(p)-1]
	}
	s.give(p)
}

// flush gives the newline held back: the stream ended without a sentinel.
func (s *streamed) flush() {
	if s.out != nil && s.held {
		s.held = false
		s.give([]byte{'\n'})
	}
}

func (s *streamed) give(p []byte) {
	p = p[:min(len(p), s.limit-s.n)]
	if len(p) > 0 {
		s.n += len(p)
		s.out(p)
	}
}

func (se *session) isBroken() bool {
	se.mu.Lock()
	defer se.mu.Unlock()
	return se.broken
}

func (se *session) close() {
	_ = se.cg.Delete()
	se.closePipes()
}

// shellStream reads one of a shell's output pipes.
func shellStream(f *os.File) *bufio.Reader {
	return bufio.NewReaderSize(drainingReader{f}, 64*1024)
}

// drainingReader reads a pipe whose read deadline ends the wait for more, not the reading of
// what is there: past the deadline, it still returns what the pipe holds until it is empty.
// A reader scheduled late after stopReading set the deadline so loses none of what the shell
// wrote before it exited.
type drainingReader struct{ f *os.File }

func (r drainingReader) Read(p []byte) (int, error) {
	n, err := r.f.Read(p)
	if n > 0 || !errors.Is(err, os.ErrDeadlineExceeded) || len(p) == 0 {
		return n, err
	}
	rc, cerr := r.f.SyscallConn()
	if cerr != nil {
		return 0, err
	}
	// Control, unlike Read, does not look at the deadline; the descriptor is non-blocking.
	var got int
	var rerr error
	if cerr := rc.Control(func(fd uintptr) {
		got, rerr = unix.Read(int(fd), p)
	}); cerr != nil || rerr != nil || got <= 0 {
		return 0, err
	}
	return got, nil
}

// exitDrain is how long a session's streams are still read after its shell exited: what the
// shell wrote is in the pipes already.
const exitDrain = 100 * time.Millisecond

// stopReading ends the reads of the shell's output after d: at once for streams that take no
// deadline.
func (se *session) stopReading(d time.Duration) {
	for _, f := range []*os.File{se.outF, se.errF} {
		if f.SetReadDeadline(time.Now().Add(d)) != nil {
			f.Close()
		}
	}
}

// closePipes closes the server's ends of the shell's stdio.
func (se *session) closePipes() {
	se.stdin.Close()
	se.outF.Close()
	se.errF.Close()
}

func signalName(n int) string {
	if name := unix.SignalName(unix.Signal(n)); name != "" {
		return name
	}
	return "SIG" + strconv.Itoa(n)
}

// adoptSession makes a process copy of a session's shell (procs.go) the
// session name, with the server's ends of its new pipes. A shell that ran an
// interactive command (att) is the session's attached to it: the command's
// sentinel has the nonce the shell read, and the output read past the last
// answer is the next call's. An idle one gets a nonce of its own.
func (s *Sandbox) adoptSession(name string, att *procstate.Attached, cg *cgroup.Cgroup, hostPid int, stdio [3]*os.File, exit <-chan initproc.ExitEvent) {
	var b [8]byte
	_, _ = rand.Read(b[:])
	se := &session{
		name: name, cg: cg, hostPid: hostPid, stdin: stdio[0], outF: stdio[1], errF: stdio[2],
		stdout: shellStream(stdio[1]), stderr: shellStream(stdio[2]),
		nonce: hex.EncodeToString(b[:]), exited: make(chan struct{}),
	}
	if att != nil {
		se.nonce, se.attached, se.pending = att.Nonce, true, slices.Clone(att.Pending)
	}
	go se.watchExit(exit)
	s.mu.Lock()
	old := s.sessions[name]
	s.sessions[name] = se
	s.mu.Unlock()
	if old != nil {
		old.close()
	}
}

// attachedState is the session's state for a checkpoint's record when it is
// attached to an interactive command, nil when it is not: the nonce and the
// last attachedKeep bytes of the output past the last answer (the sentinel,
// if the command ended since, is in them). That output is first read from
// the pipe, where a copy of the shell would not find it: the checkpoint has
// stopped the shell and the command, so it is all there is.
func (se *session) attachedState() *procstate.Attached {
	se.mu.Lock()
	defer se.mu.Unlock()
	if !se.attached || se.broken {
		return nil
	}
	se.pending = append(se.pending, se.readAvailable()...)
	return &procstate.Attached{Nonce: se.nonce, Pending: slices.Clone(se.pending[max(len(se.pending)-attachedKeep, 0):])}
}

// readAvailable reads what the shell's stdout holds now, without waiting.
// +checklocks:se.mu
func (se *session) readAvailable() []byte {
	if se.outF.SetReadDeadline(time.Now()) != nil {
		return nil
	}
	var out []byte
	buf := make([]byte, 32<<10)
	for {
		n, err := se.stdout.Read(buf)
		out = append(out, buf[:n]...)
		if err != nil {
			break
		}
	}
	if se.outF.SetReadDeadline(time.Time{}) != nil {
		se.broken = true
	}
	return out
}

// pipeKeys are the keys (pipe:[inode], as /proc names them) of the shell's
// stdin, stdout and stderr pipes; none if one is closed.
func (se *session) pipeKeys() [3]string {
	var keys [3]string
	for i, f := range []*os.File{se.stdin, se.outF, se.errF} {
		// Through Control: Fd would make the descriptor blocking, and its read
		// deadlines of no effect.
		rc, err := f.SyscallConn()
		if err != nil {
			return [3]string{}
		}
		var st unix.Stat_t
		var serr error
		if err := rc.Control(func(fd uintptr) { serr = unix.Fstat(int(fd), &st) }); err != nil || serr != nil {
			return [3]string{}
		}
		keys[i] = "pipe:[" + strconv.FormatUint(st.Ino, 10) + "]"
	}
	return keys
}

// attachedKeep bounds the output an attached session's record keeps.
const attachedKeep = interactKeep

func (se *session) watchExit(exit <-chan initproc.ExitEvent) {
	if ev, ok := <-exit; ok {
		se.status = ev.Status
	}
	close(se.exited)
}
