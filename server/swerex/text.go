package swerex

import (
	"fmt"
	"regexp"
	"strings"
	"unicode/utf8"

	"golang.org/x/sys/unix"

	"github.com/deltagym/deltagym/sandbox"
	"github.com/deltagym/deltagym/server/episode"
)

// execOf returns the result of exec step x; a step the sandbox's state refused raises the
// OSError the errno names.
func execOf(res episode.StepResult, x episode.Exec) (*sandbox.ExecResult, error) {
	o := res.Observation
	switch {
	case o.Error != nil:
		what := x.Command
		if len(x.Argv) > 0 {
			what = x.Argv[0]
		}
		if o.Error.Path != "" {
			what = o.Error.Path // the directory it could not start in, say, not its program
		}
		return nil, osError(o.Error, what)
	case o.Exec == nil:
		return nil, raise(excSwerex, "the step was not performed: %s", skipped(res))
	}
	return o.Exec, nil
}

// skipped says why a step has no observation.
func skipped(res episode.StepResult) string {
	if why := res.Info["action_skipped"]; why != "" {
		return why
	}
	return "no observation"
}

// osError is the Python OSError subclass of an action on path the sandbox's state refused, as
// the client's own runtime raises it (subprocess, pathlib), with its message's form.
func osError(e *episode.ActionError, path string) *exception {
	class := "builtins.OSError"
	switch e.Errno {
	case unix.ENOENT:
		class = "builtins.FileNotFoundError"
	case unix.EACCES, unix.EPERM:
		class = excPermission
	case unix.EISDIR:
		class = "builtins.IsADirectoryError"
	case unix.ENOTDIR:
		class = "builtins.NotADirectoryError"
	case unix.EEXIST:
		class = "builtins.FileExistsError"
	}
	msg := e.Errno.Error()
	if msg != "" {
		msg = strings.ToUpper(msg[:1]) + msg[1:]
	}
	return &exception{class: class, msg: fmt.Sprintf("[Errno %d] %s: %s", int(e.Errno), msg, pyRepr(path)),
		extra: map[string]any{"errno": int(e.Errno), "errno_name": unix.ErrnoName(e.Errno), "detail": e.Message}}
}

// ansiEscape is what SWE-ReX strips from a session's output (_strip_control_chars).
var ansiEscape = regexp.MustCompile(`\x1B[@-_][0-?]*[ -/]*[@-~]`)

// output is a session command's output as SWE-ReX's session gives it: its stdout and then its
// stderr (an interactive command's come together already), without terminal escapes.
func output(r *sandbox.ExecResult) string {
	s := text(r.Stdout)
	if len(r.Stderr) > 0 {
		s += text(r.Stderr)
	}
	return strings.ReplaceAll(ansiEscape.ReplaceAllString(s, ""), "\r\n", "\n")
}

// text decodes output as UTF-8 with Python's errors="backslashreplace": a byte that is not UTF-8
// is \xNN.
func text(b []byte) string {
	if utf8.Valid(b) {
		return string(b)
	}
	var sb strings.Builder
	for len(b) > 0 {
		r, n := utf8.DecodeRune(b)
		if r == utf8.RuneError && n == 1 {
			fmt.Fprintf(&sb, "\\x%02x", b[0])
		} else {
			sb.Write(b[:n])
		}
		b = b[n:]
	}
	return sb.String()
}

// pyRepr quotes s as Python's repr does (near enough for messages).
func pyRepr(s string) string {
	q := byte('\'')
	if strings.IndexByte(s, '\'') >= 0 && strings.IndexByte(s, '"') < 0 {
		q = '"'
	}
	var b strings.Builder
	b.WriteByte(q)
	for _, r := range s {
		switch {
		case r == '\\' || r == rune(q):
			b.WriteByte('\\')
			b.WriteRune(r)
		case r == '\n':
			b.WriteString(`\n`)
		case r == '\r':
			b.WriteString(`\r`)
		case r == '\t':
			b.WriteString(`\t`)
		case r < 0x20 || r == 0x7f:
			fmt.Fprintf(&b, `\x%02x`, r)
		default:
			b.WriteRune(r)
		}
	}
	b.WriteByte(q)
	return b.String()
}

// shellQuote quotes s as one word for bash.
func shellQuote(s string) string { return "'" + strings.ReplaceAll(s, "'", `'\''`) + "'" }

// signalNumber is the number of a signal's name ("SIGKILL"), 0 if unknown.
func signalNumber(name string) int { return int(unix.SignalNum(name)) }
