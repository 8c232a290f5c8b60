package sandbox

import (
	"context"
	"errors"
	"fmt"
	"os"
	"slices"
	"strconv"
	"strings"
	"time"

	"golang.org/x/sys/unix"
	"mvdan.cc/sh/v3/syntax"

	"github.com/deltagym/deltagym/sandbox/cgroup"
	"github.com/deltagym/deltagym/sandbox/initproc"
	"github.com/deltagym/deltagym/sandbox/procstate"
)

// Defaults of ExecRequest.
const (
	DefaultTimeout   = 30 * time.Second
	DefaultMaxOutput = 1 << 20
	// MaxStdin caps the stdin a command can be given.
	MaxStdin = 16 << 20
)

// ExecRequest describes a command to run in a sandbox.
type ExecRequest struct {
	// Argv is the command and its arguments; or
	Argv []string
	// Command is a shell string run by /bin/sh -c (or in Session).
	Command string
	Stdin   []byte
	// Env is added to the sandbox's base environment, KEY=VALUE.
	Env []string
	Cwd string
	// Timeout ends the command and everything it started; 0 means 30 s.
	Timeout time.Duration
	// Background returns at once with Pid; the process keeps running until
	// it exits, the sandbox is restored or destroyed.
	Background bool
	// Session runs Command in the named persistent bash session, created on
	// first use: cwd, exported variables and functions carry over.
	Session string
	// MaxOutput caps each of stdout and stderr; 0 means 1 MiB.
	MaxOutput int
	// Interact runs a Session command as a terminal would run it for a person at the keyboard
	// (interact.go): the command reads the session's input, and what it prints is answered as
	// it comes, when it shows one of the expected strings.
	Interact *Interact
	// Output, when set, is given the command's output as it is read, in order per stream
	// (OutputStdout, OutputStderr), cut at MaxOutput as the result is: the pieces of one
	// stream, joined, begin with the result's bytes (a session's may hold a little more,
	// which is the next step's). It is called from the goroutines that read the output,
	// one per stream, so calls for different streams may overlap; p is the caller's to keep
	// and must not be written to. A call that blocks holds up the reading of that stream,
	// and so the command once its pipe is full; it must return promptly. Not for Background.
	Output func(stream int, p []byte)
}

// The streams of ExecRequest.Output.
const (
	OutputStdout = 1
	OutputStderr = 2
)

// ExecResult is the outcome of a command.
type ExecResult struct {
	Stdout, Stderr []byte
	// ExitCode is -1 when the command was killed by a signal, and for
	// background commands.
	ExitCode int
	// Signal names the signal that killed the command, e.g. "SIGKILL".
	Signal                           string
	TimedOut                         bool
	StdoutTruncated, StderrTruncated bool
	// Pid is the command's pid inside the sandbox.
	Pid      int
	Start    time.Time
	Duration time.Duration
	// Matched is the Interact.Expect string whose appearance in the output ended the wait of
	// an interactive command, which still runs; "" when the command ended or timed out.
	Matched string
	// Running is set when an interactive command is still attached to its session after the
	// call (it matched, or timed out without ending).
	Running bool
}

func (req *ExecRequest) validate() error {
	if len(req.Argv) == 0 && req.Command == "" && (req.Interact == nil || req.Session == "") {
		// An interactive command's input may be an empty line (the Enter key alone).
		return fmt.Errorf("%w: exec needs argv or a command", ErrInvalid)
	}
	if len(req.Argv) > 0 && req.Command != "" {
		return fmt.Errorf("%w: exec takes argv or a command, not both", ErrInvalid)
	}
	if req.Session != "" && len(req.Argv) > 0 {
		return fmt.Errorf("%w: a session runs a shell command, not argv", ErrInvalid)
	}
	if req.Session != "" && req.Background {
		return fmt.Errorf("%w: a session command cannot be background", ErrInvalid)
	}
	if len(req.Stdin) > MaxStdin {
		return fmt.Errorf("%w: stdin of %d bytes exceeds %d", ErrInvalid, len(req.Stdin), MaxStdin)
	}
	if req.Timeout < 0 || req.MaxOutput < 0 {
		return fmt.Errorf("%w: negative timeout or output cap", ErrInvalid)
	}
	for _, kv := range req.Env {
		if k, _, ok := strings.Cut(kv, "="); !ok || k == "" {
			return fmt.Errorf("%w: environment entry %.64q is not KEY=VALUE", ErrInvalid, kv)
		}
	}
	if strings.IndexByte(req.Command, 0) >= 0 {
		return fmt.Errorf("%w: NUL byte in command", ErrInvalid)
	}
	if err := req.Interact.validate(req.Session); err != nil {
		return err
	}
	if req.Session != "" {
		return nil // the command goes to the session's shell on its stdin
	}
	// The request's own part against the init's limits; Spawn checks the
	// whole, with the sandbox's environment, before it sends.
	argv, _ := execArgv(*req, req.Env)
	if err := initproc.CheckArgs(argv, req.Env, req.Cwd); err != nil {
		return invalidError{err}
	}
	return nil
}

// invalidError marks err, which says what is wrong with a request (and has the class
// errdefs.ErrInvalidArgument already), as ErrInvalid, keeping its message.
type invalidError struct{ error }

// Unwrap returns ErrInvalid and the error.
func (e invalidError) Unwrap() []error { return []error{ErrInvalid, e.error} }

// env returns the sandbox's base environment with extra on top.
func (s *Sandbox) env(extra []string) []string {
	base := []string{"PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin", "HOME=/root", "TERM=dumb", "LANG=C.UTF-8"}
	if s.spec.UID != 0 {
		base[1] = "HOME=/tmp"
	}
	base = append(base, s.img.info.Config.Env...)
	base = append(base, s.spec.Env...)
	base = append(base, extra...)
	// Later entries win.
	seen := map[string]int{}
	out := make([]string, 0, len(base))
	for _, kv := range base {
		k, _, _ := strings.Cut(kv, "=")
		if i, ok := seen[k]; ok {
			out[i] = kv
			continue
		}
		seen[k] = len(out)
		out = append(out, kv)
	}
	return out
}

func (s *Sandbox) cwd(c string) string {
	if c != "" {
		return c
	}
	if s.spec.Workdir != "" {
		return s.spec.Workdir
	}
	if s.img.info.Config.WorkingDir != "" {
		return s.img.info.Config.WorkingDir
	}
	return "/"
}

// beginExec takes the shared lock, which the caller releases whatever it
// returns, and returns the abort context of the current generation.
// Processes that a restore killed are gone first: a command never sees one
// (in /proc, or holding a port), nor memory of theirs that the huge-page
// worker held (foldReleased), though the restore itself did not wait for
// them to exit.
// +checklocksacquireread:s.op
func (s *Sandbox) beginExec() (context.Context, error) {
	s.rt.hot.touch(s)
	s.op.RLock()
	if s.cmds.killPending.Load() {
		if !waitKilledGroups(s.killedGroups(), 2*time.Second) {
			s.cmds.stragglers.Store(true) // no longer waited for (keepRoot)
		}
		s.cmds.foldPending.Store(true)
		s.cmds.killPending.Store(false)
	}
	if s.cmds.foldPending.Load() {
		s.foldReleased(2 * time.Second)
		s.cmds.foldPending.Store(false)
	}
	s.mu.Lock()
	closed, gen := s.closed, s.gen
	s.mu.Unlock()
	if closed {
		return nil, fmt.Errorf("%w: sandbox %s", ErrClosed, s.id)
	}
	return gen, nil
}

// plainCommand returns the words of a shell command line that the shell
// would run as one simple command with those very arguments: words of plain
// characters only (no quotes, expansions, globs, redirections, separators or
// assignments), the first not a shell builtin or keyword. Such a line is
// spawned directly, saving the exec of /bin/sh.
func plainCommand(cmd string) ([]string, bool) {
	words := strings.Fields(cmd)
	if len(words) == 0 || len(words) > 64 || strings.ContainsAny(cmd, "\t\n\r\v\f") {
		return nil, false
	}
	for _, w := range words {
		for _, c := range w {
			if (c < 'a' || c > 'z') && (c < 'A' || c > 'Z') && (c < '0' || c > '9') && !strings.ContainsRune("_./,:+@%-", c) {
				return nil, false
			}
		}
	}
	if shellWords[words[0]] {
		return nil, false
	}
	return words, true
}

// shellWords are the builtins and keywords whose meaning inside a shell
// differs from an executable of the same name (or which have none).
var shellWords = map[string]bool{
	"cd": true, "export": true, "exit": true, "set": true, "unset": true, "alias": true, "unalias": true,
	"source": true, ".": true, "eval": true, "exec": true, "read": true, "shift": true, "trap": true,
	"ulimit": true, "umask": true, "wait": true, "jobs": true, "fg": true, "bg": true, "type": true,
	"command": true, "hash": true, "local": true, "return": true, "break": true, "continue": true,
	"readonly": true, "declare": true, "typeset": true, "let": true, "times": true, "getopts": true,
	"if": true, "then": true, "else": true, "elif": true, "fi": true, "for": true, "while": true,
	"until": true, "do": true, "done": true, "case": true, "esac": true, "function": true, "select": true,
	"time": true, "coproc": true, "history": true, "fc": true, "dirs": true, "pushd": true, "popd": true,
	"shopt": true, "enable": true, "builtin": true, "caller": true, "disown": true, "suspend": true,
	"logout": true, "help": true, "mapfile": true, "readarray": true, "compgen": true, "complete": true,
	"in": true, "{": true, "}": true, "!": true, "chdir": true, "bind": true, "compopt": true,
}

// execGroup is an empty cgroup for one command, with its cgroup.procs
// files open. Groups are reused: a command's group is empty once its
// command returns (everything it started was killed), and making, opening
// and removing one per command costs more than the rest of a short exec.
type execGroup struct {
	cg    *cgroup.Cgroup
	procs []*os.File
	work  *cgroup.Cgroup // the parent it belongs to: killed by a restore, it may serve again later
}

// execGroup returns an empty group for a command: an idle one, or a new
// one. Called with op read-held.
func (s *Sandbox) execGroup() (*execGroup, error) {
	s.cmds.mu.Lock()
	work := s.cmds.work
	if n := len(s.cmds.idle); n > 0 {
		eg := s.cmds.idle[n-1]
		s.cmds.idle = s.cmds.idle[:n-1]
		s.cmds.mu.Unlock()
		if eg.procs == nil { // closed while the sandbox was cold (hot.go)
			procs, err := eg.cg.OpenProcs()
			if err != nil {
				_ = eg.cg.Delete()
				return nil, fmt.Errorf("opening exec cgroup: %w", err)
			}
			eg.procs = procs
		}
		return eg, nil
	}
	s.cmds.mu.Unlock()
	cg, err := work.Sub(s.groupName("e"))
	if err != nil {
		return nil, fmt.Errorf("creating exec cgroup: %w", err)
	}
	procs, err := cg.OpenProcs()
	if err != nil {
		_ = cg.Delete()
		return nil, fmt.Errorf("opening exec cgroup: %w", err)
	}
	return &execGroup{cg: cg, procs: procs, work: work}, nil
}

// putExecGroup keeps an empty group for reuse. Called with op read-held.
func (s *Sandbox) putExecGroup(eg *execGroup) {
	s.mu.Lock()
	closed := s.closed
	s.mu.Unlock()
	s.cmds.mu.Lock()
	if eg.work == s.cmds.work && len(s.cmds.idle) < 8 && !closed {
		s.cmds.idle = append(s.cmds.idle, eg)
		s.cmds.mu.Unlock()
		return
	}
	s.cmds.mu.Unlock()
	closeAll(eg.procs)
	_ = eg.cg.Delete()
}

// keptSweep is how many groups kept for what commands left running (a
// background command, a command's leftovers) accumulate before those found
// empty again are removed: each is a directory that every listing of the
// command group's processes (a checkpoint's, for one) reads.
const keptSweep = 16

// keepExecGroup keeps eg for the processes its command left running, and
// removes kept groups whose processes have all exited, once enough have
// accumulated (twice as many as the last sweep left). Called with op
// read-held.
func (s *Sandbox) keepExecGroup(eg *execGroup) {
	closeAll(eg.procs)
	eg.procs = nil
	s.cmds.mu.Lock()
	// Those of an earlier command group went with it.
	work := s.cmds.work
	s.cmds.kept = slices.DeleteFunc(s.cmds.kept, func(k *execGroup) bool { return k.work != work })
	s.cmds.kept = append(s.cmds.kept, eg)
	if len(s.cmds.kept) < max(keptSweep, 2*s.cmds.keptLeft) {
		s.cmds.mu.Unlock()
		return
	}
	sweep := s.cmds.kept
	s.cmds.kept = nil
	s.cmds.mu.Unlock()
	// An empty group stays empty: only its processes could add one.
	var still []*execGroup
	for _, k := range sweep {
		if pop, err := k.cg.Populated(); err != nil || pop || k.cg.Delete() != nil {
			still = append(still, k)
		}
	}
	s.cmds.mu.Lock()
	s.cmds.kept = append(s.cmds.kept, still...)
	s.cmds.keptLeft = len(s.cmds.kept)
	s.cmds.mu.Unlock()
}

// dropExecGroups forgets the idle groups (their parent is being removed).
func (s *Sandbox) dropExecGroups() { closeExecGroups(s.takeExecGroups()) }

// takeExecGroups takes the idle groups away, their files open.
func (s *Sandbox) takeExecGroups() []*execGroup {
	s.cmds.mu.Lock()
	defer s.cmds.mu.Unlock()
	idle := s.cmds.idle
	s.cmds.idle = nil
	return idle
}

func closeExecGroups(egs []*execGroup) {
	for _, eg := range egs {
		closeAll(eg.procs)
	}
}

// subgroup makes a new group under the command group, named prefix and a
// number. Called with op held.
func (s *Sandbox) subgroup(prefix string) (*cgroup.Cgroup, error) {
	return s.workGroup().Sub(s.groupName(prefix))
}

// groupName returns a cgroup name not used before in the sandbox.
func (s *Sandbox) groupName(prefix string) string {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.seq++
	return prefix + strconv.Itoa(s.seq)
}

// Exec runs a command in the sandbox.
func (s *Sandbox) Exec(ctx context.Context, req ExecRequest) (ExecResult, error) {
	if err := req.validate(); err != nil {
		return ExecResult{}, err
	}
	if req.Timeout == 0 {
		req.Timeout = DefaultTimeout
	}
	if req.MaxOutput == 0 {
		req.MaxOutput = DefaultMaxOutput
	}
	if req.Session != "" {
		return s.sessionExec(ctx, req)
	}
	gen, err := s.beginExec()
	defer s.op.RUnlock()
	if err != nil {
		return ExecResult{}, err
	}
	if err := s.materialize(); err != nil {
		return ExecResult{}, err
	}
	env := s.env(req.Env)
	argv, direct := execArgv(req, env)
	eg, err := s.execGroup()
	if err != nil {
		return ExecResult{}, err
	}
	sr := initproc.SpawnRequest{
		Argv: argv, Env: env, Cwd: s.cwd(req.Cwd), UID: s.spec.UID, GID: s.spec.GID,
		Flags: initproc.FlagSetsid, CgroupProcs: eg.procs,
		Stdin: s.rt.devnull, Stdout: s.rt.devnull, Stderr: s.rt.devnull,
	}
	var res ExecResult
	after := groupEnded
	if req.Background {
		res, err = s.spawnBackground(sr)
		if err == nil {
			after = groupKept
		}
	} else {
		res, after, err = s.runCommand(ctx, gen, req, sr, direct, eg.cg)
	}
	switch after {
	case groupKept:
		s.keepExecGroup(eg)
	case groupEmpty:
		s.putExecGroup(eg)
	default:
		closeAll(eg.procs)
		_ = eg.cg.Delete()
	}
	return res, err
}

// groupAfter is what becomes of a command's group once the exec returns.
type groupAfter int

const (
	// groupEnded: delete it (killing what may be left).
	groupEnded groupAfter = iota
	// groupEmpty: it is empty, for the next command.
	groupEmpty
	// groupKept: processes the command started run on in it (a
	// background command, or a command's leftovers).
	groupKept
)

// execArgv returns the argv that runs req: its Argv, or its Command through
// /bin/sh -c (a background one with its last program exec'd: lastExec, given
// env, the command's whole environment), or (direct) the words of a plain
// command line (plainCommand) spawned without the shell.
func execArgv(req ExecRequest, env []string) (argv []string, direct bool) {
	if req.Command == "" {
		return req.Argv, false
	}
	if words, ok := plainCommand(req.Command); ok {
		return words, true
	}
	if req.Background {
		return []string{"/bin/sh", "-c", lastExec(req.Command, env)}, false
	}
	return []string{"/bin/sh", "-c", req.Command}, false
}

// lastExec returns cmd with `exec ` before its last command when that is a simple command the
// shell would otherwise run as a child it waits for before it exits (dash does not exec the
// last command of `sh -c`): a program named by a plain word that is no builtin or keyword,
// without assignments, not in the background, negated or piped, at the end of the line or of
// its top-level `;`, `&&` and `||` lists (`cd /srv && python3 app.py`). The program then takes
// the shell's place, pid included (so `$$` names it), and a checkpoint meets one process, which a
// template copies, instead of a shell and its child, a tree, which CRIU takes. Its arguments,
// expansions and redirections are the shell's as before, and what ran before it ran as before.
//
// Only background commands take it: their output and exit status are nobody's, so what exec
// changes besides, the shell's words when the program is not found, the `_` and `SHLVL` a bash
// would have set, a SIGQUIT busybox ash ignores in what it execs itself, is seen by no one or
// harmless. The line is parsed as POSIX sh and as bash, and a line is left to its shell
// whenever a shell might do otherwise than the parses say: if the two disagree on its last
// command, or either fails; if it has more to do after its last command (an EXIT trap); if it
// runs jobs (they would become the program's children); if it holds a heredoc (the last
// command's has a writer that would become its child, and a parse may end one where a shell
// does not) or a carriage return; if it may define functions or aliases (one could take the
// program's name), run a builtin by another name (`command`, `builtin`, a quoted, escaped,
// globbed, braced or expanded command name) or forbid exec (bash's `enable`, restricted mode);
// if a comment may end in a backslash, which the parser reads as a continuation and shells do
// not. Every line is left so when env carries an exported bash function (a /bin/sh that is
// bash would run the function, exec the program).
func lastExec(cmd string, env []string) string {
	if len(cmd) > maxExecRewrite || strings.ContainsAny(cmd, "\r") ||
		strings.Contains(cmd, "#") && strings.Contains(cmd, "\\\n") {
		return cmd
	}
	for _, e := range env {
		if strings.HasPrefix(e, "BASH_FUNC_") {
			return cmd
		}
	}
	// The line is read as POSIX sh and as bash (a /bin/sh may be either): both reads must
	// accept it, find nothing that leaves it to its shell, and end in the same command.
	at := -1
	for _, lang := range []syntax.LangVariant{syntax.LangPOSIX, syntax.LangBash} {
		f, err := syntax.NewParser(syntax.Variant(lang)).Parse(strings.NewReader(cmd), "")
		if err != nil || len(f.Stmts) == 0 || !plainScript(f) {
			return cmd
		}
		st := lastProgram(f)
		if st == nil || at >= 0 && int(st.Pos().Offset()) != at {
			return cmd
		}
		at = int(st.Pos().Offset())
	}
	return cmd[:at] + "exec " + cmd[at:]
}

// lastProgram returns the statement of f that runs last when it runs a program lastExec may
// exec (see there); else nil.
func lastProgram(f *syntax.File) *syntax.Stmt {
	st := lastCall(f.Stmts[len(f.Stmts)-1])
	if st == nil {
		return nil
	}
	call := st.Cmd.(*syntax.CallExpr)
	if len(call.Assigns) > 0 || len(call.Args) == 0 {
		return nil
	}
	name := call.Args[0].Lit()
	if shellWords[name] || builtinTwins[name] || strings.HasPrefix(name, "-") {
		return nil
	}
	return st
}

// plainScript says whether f starts no job, defines no function, holds no heredoc (a parse
// may end one where a shell does not, and the last command's has a writer), names every
// command it runs by a plain word (commandName) none of scriptWords, and sets no restricted
// mode (bash's, which forbids exec).
func plainScript(f *syntax.File) bool {
	plain := true
	syntax.Walk(f, func(n syntax.Node) bool {
		switch n := n.(type) {
		case *syntax.Stmt:
			plain = plain && !n.Background && !n.Coprocess && !n.Disown
		case *syntax.FuncDecl:
			plain = false
		case *syntax.Redirect:
			plain = plain && n.Op != syntax.Hdoc && n.Op != syntax.DashHdoc
		case *syntax.CallExpr:
			if len(n.Args) > 0 {
				name, ok := commandName(n.Args[0])
				plain = plain && ok && !scriptWords[name] && (name != "set" || !restricts(n.Args[1:]))
			}
		}
		return plain
	})
	return plain
}

// commandName returns the word w when it is a plain word: a literal with no quotes, no
// expansion, no backslash and nothing a glob, brace or tilde expansion reads, which every
// shell takes as it is.
func commandName(w *syntax.Word) (string, bool) {
	name := w.Lit()
	return name, name != "" && !strings.ContainsAny(name, "\\*?[]{}~")
}

// restricts says whether set's arguments args may turn on bash's restricted mode (-r, -o
// restricted) or are not all plain words.
func restricts(args []*syntax.Word) bool {
	for _, a := range args {
		v, ok := commandName(a)
		if !ok || v == "restricted" || strings.HasPrefix(v, "-") && !strings.HasPrefix(v, "--") && strings.ContainsRune(v, 'r') {
			return true
		}
	}
	return false
}

// lastCall returns the statement that st runs last when it is a simple command, at the end of
// st's `&&` and `||` lists, not negated; else nil.
func lastCall(st *syntax.Stmt) *syntax.Stmt {
	for {
		if st.Negated || len(st.Redirs) > 0 && !isCall(st) {
			return nil
		}
		bin, ok := st.Cmd.(*syntax.BinaryCmd)
		if !ok {
			break
		}
		if bin.Op != syntax.AndStmt && bin.Op != syntax.OrStmt {
			return nil
		}
		st = bin.Y
	}
	if !isCall(st) {
		return nil
	}
	return st
}

// isCall says whether st runs a simple command.
func isCall(st *syntax.Stmt) bool {
	_, ok := st.Cmd.(*syntax.CallExpr)
	return ok
}

// scriptWords are the commands for which lastExec leaves a line to its shell: they may set an
// EXIT trap, define a function or alias, wait for jobs, run a builtin by another name, or be
// bash syntax a POSIX parse reads as a command.
var scriptWords = map[string]bool{
	"trap": true, "alias": true, "eval": true, ".": true, "source": true, "wait": true,
	"command": true, "builtin": true, "[[": true, "]]": true, "coproc": true, "function": true,
	"select": true, "mapfile": true, "readarray": true, "enable": true, "bind": true, "complete": true,
	"compopt": true,
}

// maxExecRewrite bounds the lines lastExec parses, whose parse takes time in proportion to
// their length (most for deep nesting such as `((((…`); well below initproc.MaxString less
// the five bytes it adds.
const maxExecRewrite = 8 << 10

// builtinTwins are the shell builtins that have an executable of the same name which behaves
// otherwise (dash's echo reads backslash escapes, coreutils' does not): a line that runs one
// stays the shell's.
var builtinTwins = map[string]bool{
	"echo": true, "printf": true, "test": true, "[": true, "kill": true, "pwd": true, "true": true,
	"false": true, ":": true,
}

// spawnBackground starts a background command (sr) and returns at once: the
// process lives in its group until it exits, or the sandbox is restored or
// destroyed, which remove the groups of every command.
func (s *Sandbox) spawnBackground(sr initproc.SpawnRequest) (ExecResult, error) {
	// The sandbox's own /dev/null, so that CRIU can save the command with
	// the rest of the sandbox (it cannot take the host's).
	if null := s.devNull(); null != nil {
		defer null.Close()
		sr.Stdin, sr.Stdout, sr.Stderr = null, null, null
	}
	s.shmMayChange()
	pid, _, err := s.init.Conn.Spawn(sr)
	if err != nil {
		return ExecResult{}, s.spawnError(err)
	}
	s.init.Conn.Forget(pid)
	return ExecResult{ExitCode: -1, Pid: pid, Start: time.Now()}, nil
}

// running is a foreground command started, its output being read.
type running struct {
	pid            int
	exitc          <-chan initproc.ExitEvent
	start          time.Time
	stdout, stderr *capture
	// pipes are the inodes of the command's stdin (if it has one of its
	// own), stdout and stderr pipes, which its leftovers give up
	// (releaseLeftovers).
	pipes []uint64
}

// runCommand runs a foreground command (sr) in group cg and waits for it
// (waitCommand), and says what becomes of the group.
func (s *Sandbox) runCommand(ctx, gen context.Context, req ExecRequest, sr initproc.SpawnRequest, direct bool, cg *cgroup.Cgroup) (res ExecResult, after groupAfter, err error) {
	var stdinW *os.File
	pipes := []*os.File{}
	if len(req.Stdin) > 0 {
		r, w, err := os.Pipe()
		if err != nil {
			return ExecResult{}, groupEnded, err
		}
		defer r.Close()
		sr.Stdin, stdinW = r, w
		pipes = append(pipes, r)
	}
	outR, outW, err := os.Pipe()
	if err != nil {
		return ExecResult{}, groupEnded, err
	}
	defer outR.Close()
	errR, errW, err := os.Pipe()
	if err != nil {
		outW.Close()
		return ExecResult{}, groupEnded, err
	}
	defer errR.Close()
	sr.Stdout, sr.Stderr = outW, errW
	rc := running{start: time.Now()}
	if rc.pipes, err = pipeInodes(append(pipes, outR, errR)...); err != nil {
		outW.Close()
		errW.Close()
		return ExecResult{}, groupEnded, err
	}
	s.shmMayChange()
	rc.pid, rc.exitc, err = s.init.Conn.Spawn(sr)
	if direct && errors.Is(err, initproc.ErrSpawn) && !errors.Is(err, initproc.ErrClosed) {
		// Not found or not executable: let the shell run it and say so,
		// as it would have (exit 126 or 127 with its message).
		sr.Argv = []string{"/bin/sh", "-c", req.Command}
		rc.pid, rc.exitc, err = s.init.Conn.Spawn(sr)
	}
	outW.Close()
	errW.Close()
	if sr.Stdin != s.rt.devnull {
		sr.Stdin.Close()
	}
	if err != nil {
		if stdinW != nil {
			stdinW.Close()
		}
		return ExecResult{}, groupEnded, s.spawnError(err)
	}
	if stdinW != nil {
		go func() {
			_, _ = stdinW.Write(req.Stdin)
			stdinW.Close()
		}()
	}
	rc.stdout = newCapture(outR, req.MaxOutput, streamOutput(req.Output, OutputStdout))
	rc.stderr = newCapture(errR, req.MaxOutput, streamOutput(req.Output, OutputStderr))
	return s.waitCommand(ctx, gen, req.Timeout, cg, rc)
}

// waitCommand waits for command rc to exit, time out, or be cut short (by
// ctx, or by a restore or Destroy ending gen). Once its own process has
// exited, what it left running runs on (releaseLeftovers); whatever else
// ended the wait, everything in group cg is killed. The output is read to
// its end either way.
func (s *Sandbox) waitCommand(ctx, gen context.Context, timeout time.Duration, cg *cgroup.Cgroup, rc running) (res ExecResult, after groupAfter, err error) {
	res = ExecResult{Pid: rc.pid, Start: rc.start, ExitCode: -1}
	timer := time.NewTimer(timeout)
	defer timer.Stop()
	var ev initproc.ExitEvent
	var ok bool
	var aborted error
	select {
	case ev, ok = <-rc.exitc:
	case <-timer.C:
		res.TimedOut = true
	case <-ctx.Done():
		// The caller's own deadline or cancellation, not an abort by Restore or Destroy.
		aborted = fmt.Errorf("command cut short: %w", context.Cause(ctx))
	case <-gen.Done():
		aborted = fmt.Errorf("%w: the sandbox was restored or closed", ErrAborted)
	}
	var kerr error
	left, kill := false, true
	if ok {
		// Its leftovers give up its pipes, or end with it.
		var lerr error
		left, lerr = releaseLeftovers(cg, rc.pipes)
		kill = lerr != nil
		if lerr != nil {
			s.rt.log.Warn("ending what a command left running", "sandbox", s.id, "pid", rc.pid, "err", lerr)
			left = false
		}
	}
	if kill {
		kerr = cg.Kill() // nothing the command started outlives it
	}
	if !ok && aborted == nil {
		ev, ok = <-rc.exitc
	}
	s.init.Conn.Forget(rc.pid)
	if !rc.outputEnds(leftoverWait) && left {
		// A reference to the pipes the handover cannot see (one in
		// flight in a unix socket, a poll of another thread): the
		// command's group ends after all.
		s.rt.log.Warn("ending what a command left running: its output did not end", "sandbox", s.id, "pid", rc.pid)
		left, kerr = false, cg.Kill()
	}
	res.Stdout, res.StdoutTruncated = rc.stdout.wait()
	res.Stderr, res.StderrTruncated = rc.stderr.wait()
	res.Duration = time.Since(rc.start)
	if aborted != nil {
		return res, groupEnded, aborted
	}
	if !ok {
		return res, groupEnded, fmt.Errorf("%w: the sandbox's init went away", ErrClosed)
	}
	if kerr != nil {
		return res, groupEnded, fmt.Errorf("ending the command's processes: %w", kerr)
	}
	switch {
	case ev.Status.Exited():
		res.ExitCode = ev.Status.ExitStatus()
	case ev.Status.Signaled():
		res.Signal = unix.SignalName(ev.Status.Signal())
	}
	if left {
		return res, groupKept, nil
	}
	return res, groupEmpty, nil
}

func (s *Sandbox) spawnError(err error) error {
	if errors.Is(err, initproc.ErrClosed) {
		select {
		case <-s.init.Done():
			return fmt.Errorf("%w: the sandbox's init went away (%v)", ErrClosed, s.init.ExitErr())
		case <-time.After(100 * time.Millisecond):
		}
		return fmt.Errorf("%w: the sandbox's init went away (still running)", ErrClosed)
	}
	if errors.Is(err, initproc.ErrTooLarge) || errors.Is(err, initproc.ErrBadArg) {
		return invalidError{err} // past the init's limits with the sandbox's environment
	}
	var en unix.Errno
	if errors.As(err, &en) {
		switch en {
		case unix.ENOENT, unix.EACCES, unix.ENOTDIR, unix.ENOEXEC, unix.ETXTBSY, unix.ELOOP, unix.ENAMETOOLONG, unix.EISDIR:
			return fmt.Errorf("%w: %w", ErrInvalid, err)
		case unix.E2BIG:
			return fmt.Errorf("%w: arguments and environment are too large for exec: %w", ErrInvalid, err)
		case unix.EAGAIN:
			return procstate.PidsError(err, s.spec.Limits.Pids, s.cg)
		}
	}
	return err
}

func closeAll(fs []*os.File) {
	for _, f := range fs {
		f.Close()
	}
}

// outputEnds waits up to d for the command's output to end, and stops
// reading it then if it has not: something outside the command's group
// may hold its pipes (a process the command handed them to), and the
// command's own process has exited or been killed. It reports whether the
// output ended by itself.
func (rc running) outputEnds(d time.Duration) bool {
	t := time.NewTimer(d)
	defer t.Stop()
	for _, c := range []*capture{rc.stdout, rc.stderr} {
		select {
		case <-c.done:
			continue
		case <-t.C:
		}
		rc.stdout.stop()
		rc.stderr.stop()
		return false
	}
	return true
}

// capture reads a stream to its end, keeping at most max bytes.
type capture struct {
	f         *os.File
	done      chan struct{}
	buf       []byte
	truncated bool
}

// stop ends the reading where it is.
func (c *capture) stop() { _ = c.f.SetReadDeadline(time.Now()) }

// newCapture reads r, keeping at most limit bytes, and gives each piece it keeps to out (when
// not nil): a slice of the kept bytes themselves, which are only appended to, never written
// over (a reallocation copies them and leaves the old array as it was), so nothing is copied
// for out.
func newCapture(r *os.File, limit int, out func([]byte)) *capture {
	c := &capture{f: r, done: make(chan struct{})}
	go func() {
		defer close(c.done)
		chunk := make([]byte, 32*1024)
		for {
			n, err := r.Read(chunk)
			if n > 0 {
				room := limit - len(c.buf)
				if n > room {
					c.truncated = true
					n = max(room, 0)
				}
				from := len(c.buf)
				c.buf = append(c.buf, chunk[:n]...)
				if out != nil && n > 0 {
					out(c.buf[from:len(c.buf):len(c.buf)])
				}
			}
			if err != nil {
				return
			}
		}
	}()
	return c
}

// streamOutput is out bound to stream, or nil without out.
func streamOutput(out func(int, []byte), stream int) func([]byte) {
	if out == nil {
		return nil
	}
	return func(p []byte) { out(stream, p) }
}

func (c *capture) wait() ([]byte, bool) {
	<-c.done
	return c.buf, c.truncated
}

// devNull opens the sandbox's /dev/null, or returns nil if it is not the
// null device (the sandbox's root may have replaced it). An O_RDWR open of
// a FIFO put in its place does not block.
func (s *Sandbox) devNull() *os.File {
	fd := -1
	err := s.withRoot(func(root int) (err error) {
		fd, err = unix.Openat2(root, "dev/null", &unix.OpenHow{Flags: unix.O_RDWR | unix.O_CLOEXEC | unix.O_NOFOLLOW,
			Resolve: unix.RESOLVE_IN_ROOT | unix.RESOLVE_NO_SYMLINKS | unix.RESOLVE_NO_MAGICLINKS})
		return err
	})
	if err != nil {
		return nil
	}
	var st unix.Stat_t
	if unix.Fstat(fd, &st) != nil || st.Mode&unix.S_IFMT != unix.S_IFCHR || st.Rdev != unix.Mkdev(1, 3) {
		unix.Close(fd)
		return nil
	}
	return os.NewFile(uintptr(fd), "/dev/null")
}
