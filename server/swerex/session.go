package swerex

import (
	"fmt"
	"regexp"
	"strconv"
	"strings"
	"sync/atomic"
	"time"

	"github.com/deltagym/deltagym/sandbox"
	"github.com/deltagym/deltagym/server/episode"
)

// ps1 is the prompt of SWE-ReX's own shells: its expect_string when a command ran to its end.
const ps1 = "SHELLPS1PREFIX"

// sessionNameRE is what a session's name may be: the sandbox's session names with room for
// sessionPrefix.
var sessionNameRE = regexp.MustCompile(`^[a-zA-Z0-9_.-]{1,57}$`)

// sessionPrefix keeps SWE-ReX's sessions apart from the sandbox's other sessions.
const sessionPrefix = "swerex."

// shell is a SWE-ReX session: a persistent shell of the sandbox (episode.Exec.Session).
type shell struct {
	name    string      // the sandbox's name for it
	started atomic.Bool // a step ran in it: its shell exists
}

// sessionName checks a client's session name (nil: "default").
func sessionName(name *string) (string, error) {
	n := "default"
	if name != nil {
		n = *name
	}
	if !sessionNameRE.MatchString(n) {
		return "", invalid("session name %q: use 1-57 letters, digits, '_', '.', '-'", n)
	}
	return n, nil
}

// bashOnly refuses a session type other than bash.
func bashOnly(t *string) error {
	if t != nil && *t != "bash" {
		return invalid("session_type %q: the sessions here are bash sessions", *t)
	}
	return nil
}

// session returns the sandbox's session name, or SessionDoesNotExistError.
func (h *Handler) session(id, name string) (*shell, error) {
	h.mu.Lock()
	defer h.mu.Unlock()
	if sh := h.sessions[id][name]; sh != nil {
		return sh, nil
	}
	// A sandbox that is gone (or never was) is said as such, not as a session to create.
	if _, err := h.core.Sandbox(id); err != nil {
		return nil, err
	}
	return nil, raise(excSessionNotFound, "session %s does not exist", pyRepr(name))
}

// prune forgets the sessions of sandboxes that ended.
func (h *Handler) prune() {
	h.mu.Lock()
	ids := make([]string, 0, len(h.sessions))
	for id := range h.sessions {
		ids = append(ids, id)
	}
	h.mu.Unlock()
	for _, id := range ids {
		if _, err := h.core.Sandbox(id); err != nil {
			h.mu.Lock()
			delete(h.sessions, id)
			h.mu.Unlock()
		}
	}
}

func (h *Handler) createSession(c *call) (any, error) {
	var req createSessionRequest
	if err := h.decode(c.r, "create_session", &req); err != nil {
		return nil, err
	}
	name, err := sessionName(req.Session)
	if err != nil {
		return nil, err
	}
	if err := bashOnly(req.SessionType); err != nil {
		return nil, err
	}
	timeout, err := seconds("startup_timeout", req.StartupTimeout)
	if err != nil {
		return nil, err
	}
	if _, err := h.core.Touch(c.id); err != nil {
		return nil, err
	}
	h.prune()
	sh := &shell{name: sessionPrefix + name}
	h.mu.Lock()
	if h.sessions[c.id][name] != nil {
		h.mu.Unlock()
		return nil, raise(excSessionExists, "session %s already exists", name)
	}
	if h.sessions[c.id] == nil {
		h.sessions[c.id] = map[string]*shell{}
	}
	h.sessions[c.id][name] = sh
	h.mu.Unlock()
	resp := createSessionResponse{SessionType: "bash"}
	if len(req.StartupSource) == 0 {
		return resp, nil
	}
	cmds := make([]string, len(req.StartupSource))
	for i, p := range req.StartupSource {
		cmds[i] = "source " + shellQuote(p)
	}
	src := episode.Exec{Command: strings.Join(cmds, " ; "), Session: sh.name, Timeout: timeout}
	res, err := h.step(c, src)
	sh.started.Store(true)
	if err != nil {
		return nil, err
	}
	x, err := execOf(res, src)
	if err != nil {
		return nil, err
	}
	if x.TimedOut {
		return nil, raise(excTimeout, "timeout after %s while sourcing the startup files %s", timeoutWords(req.StartupTimeout), pyRepr(strings.Join(req.StartupSource, ", ")))
	}
	resp.Output = output(x)
	return resp, nil
}

func (h *Handler) closeSession(c *call) (any, error) {
	var req closeSessionRequest
	if err := h.decode(c.r, "close_session", &req); err != nil {
		return nil, err
	}
	name, err := sessionName(req.Session)
	if err != nil {
		return nil, err
	}
	if err := bashOnly(req.SessionType); err != nil {
		return nil, err
	}
	sh, err := h.session(c.id, name)
	if err != nil {
		return nil, err
	}
	if sh.started.Load() {
		// The shell ends as one that its user told to exit (a program it still runs ends
		// first, sandbox.Interact); a shell that is gone already is closed too.
		if _, err := h.step(c, episode.Exec{Command: "exit", Session: sh.name}); err != nil {
			return nil, err
		}
	}
	h.mu.Lock()
	if h.sessions[c.id][name] == sh {
		delete(h.sessions[c.id], name)
	}
	h.mu.Unlock()
	return closeSessionResponse{SessionType: "bash"}, nil
}

func (h *Handler) runInSession(c *call) (any, error) {
	var a action
	if err := h.decode(c.r, "run_in_session", &a); err != nil {
		return nil, err
	}
	name, err := sessionName(a.Session)
	if err != nil {
		return nil, err
	}
	kind := "bash"
	if a.ActionType != nil {
		kind = *a.ActionType
	}
	if kind != "bash" && kind != "bash_interrupt" {
		return nil, invalid("action_type %q: an action is a bash or a bash_interrupt one", kind)
	}
	// The sandbox and the session first: the patterns are compiled only for a call that
	// would run.
	if _, err := h.core.Touch(c.id); err != nil {
		return nil, err
	}
	sh, err := h.session(c.id, name)
	if err != nil {
		return nil, err
	}
	expect, err := patterns(a.Expect)
	if err != nil {
		return nil, err
	}
	if kind == "bash_interrupt" {
		return h.interrupt(c, sh, &a, expect)
	}
	return h.run(c, sh, &a, expect)
}

// patterns compiles the expect strings as pexpect does, as regular expressions, within the
// bounds of sandbox.Interact (their count and lengths checked before any is compiled).
func patterns(expect []string) ([]*regexp.Regexp, error) {
	if len(expect) > sandbox.MaxExpect {
		return nil, invalid("%d expect strings, more than the %d this server takes", len(expect), sandbox.MaxExpect)
	}
	for _, e := range expect {
		if len(e) > sandbox.MaxExpectBytes {
			return nil, invalid("expect string %s is %d bytes long, more than the %d this server takes", pyRepr(truncate(e, 64)), len(e), sandbox.MaxExpectBytes)
		}
	}
	out := make([]*regexp.Regexp, len(expect))
	insts := 0
	for i, e := range expect {
		n, err := sandbox.ExpectSize(e)
		if err != nil {
			return nil, invalid("expect string %s is not a regular expression this server reads (Go's RE2 syntax; pexpect takes them as regular expressions too): %v", pyRepr(e), err)
		}
		if insts += n; insts > sandbox.MaxExpectInsts {
			return nil, invalid("the expect strings compile to more than %d instructions in all (the work of their search per byte of output), "+
				"more than this server takes: use fewer or simpler ones (a literal prompt is one instruction a byte)", sandbox.MaxExpectInsts)
		}
		re, err := regexp.Compile(e)
		if err != nil {
			return nil, invalid("expect string %s is not a regular expression this server reads (Go's RE2 syntax; pexpect takes them as regular expressions too): %v", pyRepr(e), err)
		}
		if re.MatchString("") {
			return nil, invalid("expect string %s matches the empty string, so it would match at once", pyRepr(e))
		}
		out[i] = re
	}
	return out, nil
}

// run runs a BashAction: a plain command runs to its end; an interactive one, or one with
// expect strings, runs as sandbox.Interact.
func (h *Handler) run(c *call, sh *shell, a *action, expect []*regexp.Regexp) (any, error) {
	if a.Command == nil {
		return nil, invalid("a bash action needs a command")
	}
	check := "raise"
	if a.Check != nil {
		check = *a.Check
	}
	if check != "raise" && check != "silent" && check != "ignore" {
		return nil, invalid("check %q is not one of 'raise', 'silent' and 'ignore'", check)
	}
	if a.IsInteractiveCommand && a.IsInteractiveQuit {
		return nil, invalid("an action is an interactive command or an interactive quit, not both")
	}
	timeout, err := seconds("timeout", a.Timeout)
	if err != nil {
		return nil, err
	}
	interactive := a.IsInteractiveCommand || a.IsInteractiveQuit || len(expect) > 0
	if *a.Command == "" && !interactive {
		return nil, invalid("the bash action's command is empty: give a command; an empty one is the Enter key alone, " +
			"input to an interactive program (is_interactive_command)")
	}
	x := episode.Exec{Command: *a.Command, Session: sh.name, Timeout: timeout}
	if interactive {
		x.Interact = &sandbox.Interact{Expect: expect}
	}
	res, err := h.step(c, x)
	sh.started.Store(true)
	if err != nil {
		return nil, err
	}
	r, err := execOf(res, x)
	if err != nil {
		return nil, err
	}
	if r.TimedOut {
		return nil, raise(excTimeout, "timeout after %s while running command %s", ranFor(a.Timeout, r.Duration), pyRepr(*a.Command))
	}
	obs := observation{Output: output(r), ExpectString: ps1, SessionType: "bash"}
	if r.Matched != "" {
		obs.ExpectString = matchedString(a.Expect, r.Matched)
	}
	if a.IsInteractiveCommand || a.IsInteractiveQuit {
		if a.IsInteractiveCommand {
			obs.Output = strings.TrimSpace(obs.Output)
		}
		obs.ExitCode = ptr(0)
		return obs, nil
	}
	return checked(a, check, r, obs)
}

// checked applies a plain command's check to its observation.
func checked(a *action, check string, r *sandbox.ExecResult, obs observation) (any, error) {
	if syntaxError(r) {
		stdout, stderr := text(r.Stdout), text(r.Stderr)
		return nil, &exception{class: excSyntax, msg: "Error (exit code 2) while checking bash command \n" + pyRepr(*a.Command) +
			"\n---- Stderr ----\n" + stderr + "\n---- Stdout ----\n" + stdout,
			extra: map[string]any{"bash_stdout": stdout, "bash_stderr": stderr}}
	}
	if check == "ignore" {
		return obs, nil
	}
	if r.Matched != "" {
		// The command still runs (it printed an expect string): it has no exit code yet.
		if check == "raise" {
			return nil, raise(excNoExitCode, "command %s still runs: its output showed %s; quit it (is_interactive_quit) or interrupt it",
				pyRepr(*a.Command), pyRepr(obs.ExpectString))
		}
		return obs, nil
	}
	code := shellStatus(r)
	obs.ExitCode = &code
	if check == "raise" && code != 0 {
		msg := "Command " + pyRepr(*a.Command) + " failed with exit code " + strconv.Itoa(code) + ". Here is the output:\n" + pyRepr(obs.Output)
		if a.ErrorMsg != "" {
			msg = a.ErrorMsg + ": " + msg
		}
		return nil, &exception{class: excNonZero, msg: msg}
	}
	return obs, nil
}

// interrupt sends a BashInterruptAction's Ctrl-C to what the session runs and waits for an
// expect string or its end, timeout times n_retry in all.
func (h *Handler) interrupt(c *call, sh *shell, a *action, expect []*regexp.Regexp) (any, error) {
	t := 0.2
	if a.Timeout != nil {
		t = *a.Timeout
	}
	if _, err := seconds("timeout", &t); err != nil {
		return nil, err
	}
	n := 3
	if a.NRetry != nil {
		n = *a.NRetry
	}
	if n < 1 || n > 100 {
		return nil, invalid("n_retry %d is not between 1 and 100", n)
	}
	total := t * float64(n)
	timeout, err := seconds("timeout times n_retry", &total)
	if err != nil {
		return nil, err
	}
	x := episode.Exec{Session: sh.name, Timeout: timeout, Interact: &sandbox.Interact{Expect: expect, Interrupt: true}}
	res, err := h.step(c, x)
	sh.started.Store(true)
	if err != nil {
		return nil, err
	}
	r, err := execOf(res, x)
	if err != nil {
		return nil, err
	}
	obs := observation{Output: strings.TrimSpace(output(r)), ExitCode: ptr(0), ExpectString: ps1, SessionType: "bash"}
	if r.Matched != "" {
		obs.ExpectString = matchedString(a.Expect, r.Matched)
	}
	return obs, nil
}

// matchedString is the client's expect string whose pattern matched.
func matchedString(expect []string, pattern string) string {
	for _, e := range expect {
		if e == pattern {
			return e
		}
	}
	return pattern
}

// syntaxError reports whether a session command failed as bash does on a syntax error in it.
func syntaxError(r *sandbox.ExecResult) bool {
	return r.ExitCode == 2 && strings.HasPrefix(string(r.Stderr), "bash: eval: line ") && strings.Contains(string(r.Stderr), "syntax error")
}

// shellStatus is a command's status as bash's $? gives it: 128+N for one killed by signal N.
func shellStatus(r *sandbox.ExecResult) int {
	if r.Signal != "" {
		if n := signalNumber(r.Signal); n > 0 {
			return 128 + n
		}
	}
	return r.ExitCode
}

// timeoutWords is the timeout a message names: the client's, else the env's.
func timeoutWords(asked *float64) string {
	if asked != nil {
		return strconv.FormatFloat(*asked, 'g', -1, 64) + " seconds"
	}
	return "the env's step timeout"
}

// ranFor says the timeout a timed-out command ran into: the one asked, or the env's step timeout
// when that one is shorter (the least of the two wins).
func ranFor(asked *float64, ran time.Duration) string {
	if asked != nil && ran.Seconds() < *asked-0.5 {
		return fmt.Sprintf("%.0f seconds (the env's step timeout, shorter than the %s asked)", ran.Seconds(), timeoutWords(asked))
	}
	return timeoutWords(asked)
}

func ptr[T any](v T) *T { return &v }
