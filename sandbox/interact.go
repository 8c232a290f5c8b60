package sandbox

import (
	"bytes"
	"context"
	"fmt"
	"os"
	"regexp"
	"regexp/syntax"
	"strconv"
	"strings"
	"time"

	"golang.org/x/sys/unix"
)

// Interact makes a session command interactive, as a terminal runs a program for a person at
// the keyboard (the way pexpect drives a shell). The command is not fed </dev/null: it reads
// the session's input, and its stderr goes with its stdout into Stdout, in the order written.
// The call returns when the output shows a match of one of Expect (ExecResult.Matched; the
// command still runs, ExitCode -1, and the session is attached to it), when the command ends
// (its status), or at the timeout, which leaves it running (TimedOut, ExitCode -1, Signal "").
// The output is what came before the match; what came after it is the start of the next
// call's. While a command is attached:
//
//   - a call with Interact sends its Command and a newline to the command's input (an empty
//     Command is the Enter key alone), and waits the same way;
//   - a call with Interact and Interrupt sends SIGINT to every process of the session but its
//     shell (a terminal's Ctrl-C) once none of them is runnable, as a person presses it at a
//     prompt the program waits at (or once they ran 100 ms on the CPU, a busy program, or half
//     the timeout passed), and waits the same way; if the timeout passes with no match, they
//     are killed. Its Command is not used (a caller may record there what the key sends,
//     "\x03"); without an attached command, an interrupt has nothing to do and returns at once;
//   - a call without Interact kills the attached command first (what it still printed is
//     dropped) and then runs.
//
// The matches are searched for in the output since the last one, outside the session's own
// sentinel, the earliest first (a tie goes to the first pattern), as pexpect does.
type Interact struct {
	Expect    []*regexp.Regexp
	Interrupt bool
}

// CheckInteract checks it, of a request for session, as Exec does (ErrInvalid): for a front
// end that checks a request before anything runs.
func CheckInteract(it *Interact, session string) error { return it.validate(session) }

// validate checks an Interact of a request for session (nil is valid): its patterns within
// the bounds below.
func (it *Interact) validate(session string) error {
	if it == nil {
		return nil
	}
	if session == "" {
		return fmt.Errorf("%w: an interactive command runs in a session", ErrInvalid)
	}
	if len(it.Expect) > MaxExpect {
		return fmt.Errorf("%w: %d expect patterns, more than %d", ErrInvalid, len(it.Expect), MaxExpect)
	}
	insts := 0
	for i, re := range it.Expect {
		if re == nil || re.String() == "" || re.MatchString("") {
			return fmt.Errorf("%w: expect pattern %d matches the empty string, so it would match at once", ErrInvalid, i)
		}
		// A pattern is text the ledger records with the step, which cannot hold NUL; \x00
		// matches one.
		if strings.IndexByte(re.String(), 0) >= 0 {
			return fmt.Errorf("%w: expect pattern %d holds a NUL byte: write \\x00 to match one", ErrInvalid, i)
		}
		n, err := ExpectSize(re.String())
		if err != nil {
			return fmt.Errorf("%w: expect pattern %d: %w", ErrInvalid, i, err)
		}
		if insts += n; insts > MaxExpectInsts {
			return fmt.Errorf("%w: the expect patterns compile to more than %d instructions", ErrInvalid, MaxExpectInsts)
		}
	}
	return nil
}

// Bounds of an Interact's patterns, which bound the work of their search (matcher): at most
// MaxExpect patterns of at most MaxExpectBytes each, whose compiled programs hold at most
// MaxExpectInsts instructions in all. A front end checks the count and the lengths before it
// compiles any (ExpectSize).
const (
	MaxExpect      = 16
	MaxExpectBytes = 1024
	MaxExpectInsts = 2000
)

// ExpectSize is the size of pattern's program (its instructions, as regexp compiles it), for
// a pattern of at most MaxExpectBytes: what the search of its matches costs per byte.
func ExpectSize(pattern string) (int, error) {
	if len(pattern) > MaxExpectBytes {
		return 0, fmt.Errorf("%d bytes, more than %d", len(pattern), MaxExpectBytes)
	}
	prog, err := expectProg(pattern)
	if err != nil {
		return 0, err
	}
	return len(prog.Inst), nil
}

// expectProg compiles pattern as regexp.Compile does.
func expectProg(pattern string) (*syntax.Prog, error) {
	re, err := syntax.Parse(pattern, syntax.Perl)
	if err != nil {
		return nil, err
	}
	return syntax.Compile(re.Simplify())
}

// Bounds of the search of an interactive command's output for its patterns, as pexpect's
// searchwindowsize bounds its search: each search covers at most expectStep bytes not yet
// searched and the expectOverlap bytes before them (from the start of a line up to
// expectOverlap bytes earlier still, so that ^ and \b see what precedes them), so a match is
// found if it starts at most expectOverlap bytes before the output that completes it; a
// pattern anchored at the start of the text (\A, ^ without the m flag) matches only at the
// start of the output. The searches of one call take at most expectBudget in all (and one
// search more): past it the call fails with ErrExpectBudget.
const (
	expectStep    = 4 << 10
	expectOverlap = 2 << 10
	expectBudget  = 2 * time.Second
)

// Bounds of the output an interactive command's wait keeps: the sentinel and the patterns are
// searched for in the last interactWindow bytes (with interactKeep of them kept when the window
// slides), and what slid out of it is kept up to the request's MaxOutput.
const (
	interactWindow = 1 << 20
	interactKeep   = 64 << 10
)

// interactScript is what the shell is fed to start req interactively: the command with its
// environment and directory and its stderr on its stdout, then the stdout sentinel, on one line
// (the command reads the same input as the shell: whatever follows is the command's input).
func interactScript(req ExecRequest, tag string) string {
	script := ""
	for _, kv := range req.Env {
		k, v, _ := strings.Cut(kv, "=")
		script += "export " + k + "=" + ansiC(v) + "; "
	}
	if req.Cwd != "" {
		script += "cd " + ansiC(req.Cwd) + " && "
	}
	return script + "eval " + ansiC(req.Command) + " 2>&1; __dg_rc=$?; printf '\\n" + tag + "_RC=%d\\n' \"$__dg_rc\"\n"
}

// chunk is one read of a session's stdout.
type chunk struct {
	data []byte
	err  error
}

// interact runs req, which has Interact, in the session. Called with se.mu held.
// +checklocks:se.mu
func (se *session) interact(ctx, gen context.Context, req ExecRequest, tag string) (ExecResult, error) {
	start := time.Now()
	res := ExecResult{Start: start, ExitCode: -1}
	it := req.Interact
	switch {
	case se.attached && it.Interrupt:
		se.awaitWaiting(ctx, gen, start.Add(req.Timeout/2))
		se.signalChildren(unix.SIGINT)
	case it.Interrupt:
		res.ExitCode, res.Duration = 0, time.Since(start)
		return res, nil
	case se.attached:
		if _, err := se.stdin.Write([]byte(req.Command + "\n")); err != nil {
			se.broken = true
			return ExecResult{}, sessionEnded(se.name)
		}
	default:
		if _, err := se.stdin.Write([]byte(interactScript(req, tag))); err != nil {
			se.broken = true
			return ExecResult{}, sessionEnded(se.name)
		}
		se.attached = true
	}
	m := newMatcher(tag, it.Expect, req.MaxOutput, se.pending)
	m.emit = streamOutput(req.Output, OutputStdout)
	se.pending = nil
	err := se.converse(ctx, gen, m, req.Timeout-time.Since(start), it.Interrupt, &res)
	res.Duration = time.Since(start)
	res.Running = err == nil && se.attached && !se.broken
	return res, err
}

// detach ends the command the session is attached to (killing what the session runs) and reads
// its output to its sentinel, which it drops. Called with se.mu held.
// +checklocks:se.mu
func (se *session) detach(ctx, gen context.Context, tag string) error {
	se.signalChildren(unix.SIGKILL)
	m := newMatcher(tag, nil, 0, se.pending)
	se.pending = nil
	var res ExecResult
	if err := se.converse(ctx, gen, m, time.Second, false, &res); err != nil {
		return err
	}
	if res.TimedOut {
		// Its shell is stuck: end it.
		se.broken = true
		_ = se.cg.Kill()
	}
	return nil
}

// converse reads the attached command's output with m until m finds a match or the sentinel,
// the shell exits, or timeout passes (then, for an interrupt, it kills what the session runs
// and waits a second more). It fills res. The search stops between its steps for the
// timeout, ctx and gen; past its budget it fails (the command goes on, the session attached
// to it, its output kept for the next call). Called with se.mu held.
// +checklocks:se.mu
func (se *session) converse(ctx, gen context.Context, m *matcher, timeout time.Duration, interrupt bool, res *ExecResult) error {
	deadline := time.Now().Add(timeout)
	m.halt = func() bool { return ctx.Err() != nil || gen.Err() != nil || !time.Now().Before(deadline) }
	if found, err := m.scan(); found || err != nil {
		return se.settleOr(m, res, err)
	}
	chunks := make(chan chunk, 4)
	stop := make(chan struct{})
	go se.readChunks(chunks, stop)
	timer := time.NewTimer(timeout)
	defer timer.Stop()
	exited := se.exited
	killed := false
	for {
		var data []byte
		select {
		case c, ok := <-chunks:
			if !ok || c.err != nil {
				// The shell exited (or its stream broke): it is gone with what it printed.
				if ok {
					for range chunks {
					}
				}
				se.ended(m, res)
				return nil
			}
			data = c.data
		case <-exited:
			exited = nil
			se.stopReading(exitDrain)
		case <-timer.C:
			if interrupt && !killed {
				se.signalChildren(unix.SIGKILL)
				killed = true
				deadline = time.Now().Add(time.Second)
				timer.Reset(time.Second)
				continue
			}
			se.pending = append(se.pending, se.stopChunks(chunks, stop)...)
			res.TimedOut = true
			m.give(len(m.acc))
			res.Stdout, res.StdoutTruncated = m.output(len(m.acc))
			if killed {
				se.broken = true
				_ = se.cg.Kill()
			}
			return nil
		case <-ctx.Done():
			return se.abortConverse(chunks, fmt.Errorf("session command cut short: %w", context.Cause(ctx)))
		case <-gen.Done():
			return se.abortConverse(chunks, fmt.Errorf("%w: the sandbox was restored or closed", ErrAborted))
		}
		// Each turn searches what is left of the output: a search that stopped for an event
		// goes on in the next turn, if that event does not end the call.
		if found, err := m.add(data); found || err != nil {
			se.pending = append(se.pending, se.stopChunks(chunks, stop)...)
			return se.settleOr(m, res, err)
		}
	}
}

// settleOr ends converse's call: with the outcome m found (settle), or, when the search ran
// past its budget (err), with err, keeping the output for the next call (m's, then what
// se.pending holds).
// +checklocks:se.mu
func (se *session) settleOr(m *matcher, res *ExecResult, err error) error {
	if err != nil {
		se.pending = append(append([]byte(nil), m.acc...), se.pending...)
		return err
	}
	se.settle(m, res)
	return nil
}

// readChunks reads the session's stdout into out until a read fails or stop is closed, then
// closes out.
func (se *session) readChunks(out chan<- chunk, stop <-chan struct{}) {
	defer close(out)
	for {
		buf := make([]byte, 32<<10)
		n, err := se.stdout.Read(buf)
		out <- chunk{data: buf[:n], err: err}
		select {
		case <-stop:
			return
		default:
		}
		if err != nil {
			return
		}
	}
}

// stopChunks stops readChunks and returns what it read that the caller did not take. The
// session's stdout is left as it was (its buffer keeps what was not read, and no error).
// +checklocks:se.mu
func (se *session) stopChunks(chunks <-chan chunk, stop chan struct{}) []byte {
	close(stop)
	_ = se.outF.SetReadDeadline(time.Now())
	var rest []byte
	for c := range chunks {
		rest = append(rest, c.data...)
	}
	if se.outF.SetReadDeadline(time.Time{}) != nil {
		se.broken = true
	}
	return rest
}

// abortConverse breaks the session on an abort and returns err.
// +checklocks:se.mu
func (se *session) abortConverse(chunks <-chan chunk, err error) error {
	se.broken = true
	_ = se.cg.Kill()
	se.outF.Close()
	se.errF.Close()
	for range chunks {
	}
	return err
}

// settle fills res from m's match or sentinel; the session is detached at the sentinel.
// +checklocks:se.mu
func (se *session) settle(m *matcher, res *ExecResult) {
	res.Stdout, res.StdoutTruncated = m.output(m.stop)
	se.pending = append(m.acc[m.next:len(m.acc):len(m.acc)], se.pending...)
	if m.matched != nil {
		res.Matched = m.matched.String()
		return
	}
	se.attached = false
	res.ExitCode = m.rc
	if m.rc > 128 {
		res.ExitCode, res.Signal = -1, signalName(m.rc-128)
	}
}

// ended fills res for a session whose shell exited during an interactive command.
// +checklocks:se.mu
func (se *session) ended(m *matcher, res *ExecResult) {
	se.broken = true
	m.give(len(m.acc))
	res.Stdout, res.StdoutTruncated = m.output(len(m.acc))
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
}

// interruptBusy is how long the command of a session may run on the CPU before an interrupt
// goes to it without waiting for it to wait (awaitWaiting): far more than a program needs from
// its prompt's write to its read, little for a person's Ctrl-C of a busy one.
const interruptBusy = 100 * time.Millisecond

// awaitWaiting waits, before an interrupt, until no thread of what the session runs (its shell
// aside) is runnable: until the program waits, as it does when a person at a terminal sees its
// prompt and presses Ctrl-C. A program may lose a SIGINT that comes between its prompt's write
// and its read: Busybox's ash and dash only note the signal in their handler, for the trap to
// run when the command in progress ends, and their read builtin looks at the note only when the
// signal cuts its wait short, so one noted just before the wait begins goes unseen until a line
// comes, which the caller, waiting for the answer to its interrupt, does not send. It returns
// once the command waits, once its threads ran interruptBusy on the CPU since the call (a busy
// program, which an interrupt is most for), at deadline, or when ctx or gen ends. Only the
// session's calls write its input, under se.mu, so a program found waiting for input still
// waits when the signal comes.
func (se *session) awaitWaiting(ctx, gen context.Context, deadline time.Time) {
	ran := map[int]uint64{} // a thread's CPU time (clock ticks) when last seen
	var busy uint64         // the CPU time of the threads since the call
	first := true
	for pause := 20 * time.Microsecond; ; pause = min(2*pause, time.Millisecond) {
		tids, err := se.cg.Threads()
		if err != nil {
			return
		}
		waiting := true
		for _, tid := range tids {
			if tid == se.hostPid {
				continue
			}
			state, ticks, ok := threadRun(tid)
			if !ok {
				continue // gone
			}
			last, seen := ran[tid]
			if !seen && first {
				last = ticks // what it ran before the call is not the call's
			}
			busy += ticks - min(last, ticks)
			ran[tid] = ticks
			waiting = waiting && state != 'R'
		}
		first = false
		if waiting || busy*uint64(time.Second/clockTicks) >= uint64(interruptBusy) ||
			!time.Now().Before(deadline) || ctx.Err() != nil || gen.Err() != nil {
			return
		}
		nap(pause)
	}
}

// threadRun reads thread tid's state (R: runnable) and the CPU time it ran (user and system,
// in clock ticks) from /proc; ok is false once it is gone.
func threadRun(tid int) (state byte, ticks uint64, ok bool) {
	b, err := os.ReadFile("/proc/" + strconv.Itoa(tid) + "/stat")
	if err != nil {
		return 0, 0, false
	}
	// pid (comm) state ppid … utime stime …, 14th and 15th; comm may hold spaces and
	// parentheses.
	i := bytes.LastIndexByte(b, ')')
	if i < 0 {
		return 0, 0, false
	}
	f := bytes.Fields(b[i+1:])
	if len(f) < 13 || len(f[0]) == 0 {
		return 0, 0, false
	}
	utime, uerr := strconv.ParseUint(string(f[11]), 10, 64)
	stime, serr := strconv.ParseUint(string(f[12]), 10, 64)
	if uerr != nil || serr != nil {
		return 0, 0, false
	}
	return f[0][0], utime + stime, true
}

// signalChildren sends sig to every process of the session but its shell.
func (se *session) signalChildren(sig unix.Signal) {
	if se.cg.Freeze() != nil {
		return
	}
	pids, _ := se.cg.Pids()
	for _, p := range pids {
		if p != se.hostPid {
			_ = unix.Kill(p, sig)
		}
	}
	_ = se.cg.Thaw()
}

// matcher finds, in an interactive command's output, the earliest match of its patterns or the
// session's sentinel ("\n" + tag + "_RC=<status>\n"), whichever comes first. The patterns'
// search is bounded (expectStep, expectOverlap, expectBudget); the sentinel's, a literal, is
// not, but looks at each byte once.
type matcher struct {
	sentinel []byte
	expect   []*regexp.Regexp
	anchored []bool // expect[i] matches only at the start of the text
	limit    int
	acc      []byte // the search window
	out      []byte // what slid out of the window, up to limit
	slid     bool   // more slid out than out keeps
	shifted  bool   // acc[0] is not the start of the output: some slid out
	base     int    // how much of the output slid out before acc[0]

	// emit, when not nil, is given the output as it is searched (ExecRequest.Output): up to
	// the sentinel (or what may be its start), or to the match, and up to limit in all; given
	// counts what it was given. What it is given past a match is the next call's output too.
	emit  func([]byte)
	given int

	scanned  int           // the patterns were searched for in acc[:scanned]
	sentFrom int           // no sentinel starts before acc[sentFrom]
	sentAt   int           // the sentinel's start in acc, -1 before it is found
	spent    time.Duration // the patterns' search in this call
	halt     func() bool   // the search stops between its steps when it reports true

	// The outcome (scan returned true): the output ends at acc[:stop]; acc[next:] is the
	// next call's; matched is the pattern that matched, nil at the sentinel (status rc).
	stop, next int
	matched    *regexp.Regexp
	rc         int
}

// newMatcher is the matcher of the session's sentinel of tag and patterns expect, with the
// output acc read before the call.
func newMatcher(tag string, expect []*regexp.Regexp, limit int, acc []byte) *matcher {
	m := &matcher{sentinel: []byte("\n" + tag + "_RC="), expect: expect, limit: limit, acc: acc, sentAt: -1,
		anchored: make([]bool, len(expect))}
	for i, re := range expect {
		prog, err := expectProg(re.String())
		m.anchored[i] = err == nil && prog.StartCond()&syntax.EmptyBeginText != 0
	}
	return m
}

// add takes more output and reports whether the match or the sentinel is in.
func (m *matcher) add(b []byte) (bool, error) {
	m.acc = append(m.acc, b...)
	if found, err := m.scan(); found || err != nil {
		return found, err
	}
	if len(m.acc) > interactWindow {
		cut := len(m.acc) - interactKeep
		room := max(m.limit-len(m.out), 0)
		m.out = append(m.out, m.acc[:min(cut, room)]...)
		m.slid = m.slid || cut > room
		m.acc = append([]byte(nil), m.acc[cut:]...)
		m.shifted, m.base = true, m.base+cut
		m.scanned, m.sentFrom = max(m.scanned-cut, 0), max(m.sentFrom-cut, 0)
		if m.sentAt >= 0 {
			m.sentAt -= cut
		}
	}
	return false, nil
}

// scan looks for the outcome in acc, searching for the patterns a step at a time until it
// finds one, has searched all, the halt function stops it, or the budget is spent.
func (m *matcher) scan() (bool, error) {
	end, complete := m.findSentinel()
	for m.scanned < end {
		if m.spent > expectBudget {
			return false, ErrExpectBudget
		}
		if m.halt != nil && m.halt() {
			return false, nil
		}
		hi := min(end, m.scanned+expectStep)
		start := time.Now()
		found := m.search(hi)
		m.spent += time.Since(start)
		m.scanned = hi
		if found {
			m.give(m.stop)
			return true, nil
		}
	}
	if complete {
		m.matched, m.stop = nil, end
	}
	m.give(end)
	return complete, nil
}

// give gives emit the output up to acc[upto] that it was not given yet, within limit.
func (m *matcher) give(upto int) {
	if m.emit == nil {
		return
	}
	from := max(m.given-m.base, 0)
	upto = min(upto, from+m.limit-m.given)
	if upto <= from {
		return
	}
	p := append([]byte(nil), m.acc[from:upto]...)
	m.given += len(p)
	m.emit(p)
}

// findSentinel looks for the sentinel in what it has not looked at yet and returns where the
// output the patterns are searched in ends (before the sentinel, or a start of it) and
// whether the sentinel is complete (m.rc and m.next set).
func (m *matcher) findSentinel() (end int, complete bool) {
	if m.sentAt < 0 {
		from := max(0, m.sentFrom-len(m.sentinel)+1)
		if i := bytes.Index(m.acc[from:], m.sentinel); i >= 0 {
			m.sentAt = from + i
		} else {
			m.sentFrom = len(m.acc)
			return len(m.acc) - partialSuffix(m.acc, m.sentinel), false
		}
	}
	digits := m.acc[m.sentAt+len(m.sentinel):]
	if nl := bytes.IndexByte(digits, '\n'); nl >= 0 {
		if rc, err := strconv.Atoi(string(digits[:nl])); err == nil {
			m.rc, m.next = rc, m.sentAt+len(m.sentinel)+nl+1
			return m.sentAt, true
		}
	}
	return m.sentAt, false
}

// search searches acc[:hi] past m.scanned (and the overlap before it) for the earliest match
// of the patterns (a tie goes to the first pattern).
func (m *matcher) search(hi int) bool {
	from := 0
	if lo := m.scanned - expectOverlap; lo > 0 {
		// From the start of a line, for ^ (with m) and \b at the search's start.
		from = lo
		back := max(0, lo-expectOverlap)
		if nl := bytes.LastIndexByte(m.acc[back:lo], '\n'); nl >= 0 {
			from = back + nl + 1
		}
	}
	atStart := from == 0 && !m.shifted
	best := -1
	for i, re := range m.expect {
		if m.anchored[i] && !atStart {
			continue
		}
		loc := re.FindIndex(m.acc[from:hi])
		if loc != nil && (best < 0 || from+loc[0] < best) {
			best, m.matched, m.stop, m.next = from+loc[0], re, from+loc[0], from+loc[1]
		}
	}
	return best >= 0
}

// partialSuffix returns the length of the longest suffix of b, at least 2 bytes long, that is
// a proper prefix of s: a sentinel that may still be coming.
func partialSuffix(b, s []byte) int {
	for n := min(len(b), len(s)-1); n >= 2; n-- {
		if bytes.Equal(b[len(b)-n:], s[:n]) {
			return n
		}
	}
	return 0
}

// output returns what slid out of the window and acc[:stop], up to limit, and whether it was
// cut.
func (m *matcher) output(stop int) ([]byte, bool) {
	out := append(append([]byte(nil), m.out...), m.acc[:stop]...)
	if len(out) > m.limit {
		return out[:m.limit], true
	}
	return out, m.slid
}
