package episode

import (
	"errors"
	"fmt"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/deltagym/deltagym/internal/errdefs"
	"github.com/deltagym/deltagym/sandbox"
	"github.com/deltagym/deltagym/sandbox/initproc"
)

// Each failure an action can meet is charged to the agent (an observation error with its
// errno) or not (nil: the caller's, refused with its class, or the infrastructure's).
func TestAgentError(t *testing.T) {
	live, gone := make(chan struct{}), make(chan struct{})
	close(gone)
	file := func(en unix.Errno) error { return &sandbox.FileError{Path: "/p", Errno: en, Msg: "m"} }
	spawn := func(step int, en unix.Errno) error { return &initproc.SpawnError{Step: step, Errno: en} }
	cases := []struct {
		name  string
		err   error
		gone  chan struct{}
		errno unix.Errno // 0: not the agent's
		a     Action     // nil: a read_file
	}{
		{"missing file", file(unix.ENOENT), live, unix.ENOENT, nil},
		{"FIFO with no reader", fmt.Errorf("writing: %w", file(unix.ENXIO)), live, unix.ENXIO, nil},
		{"running binary", file(unix.ETXTBSY), live, unix.ETXTBSY, nil},
		{"not a regular file", file(unix.EINVAL), live, unix.EINVAL, nil},
		{"full layer", file(unix.ENOSPC), live, unix.ENOSPC, nil},
		{"program missing", fmt.Errorf("%w: %w", sandbox.ErrInvalid, spawn(initproc.StepExec, unix.ENOENT)), live, unix.ENOENT, nil},
		{"program not executable", spawn(initproc.StepExec, unix.EACCES), live, unix.EACCES, nil},
		{"program busy", spawn(initproc.StepExec, unix.ETXTBSY), live, unix.ETXTBSY, nil},
		{"cwd missing", spawn(initproc.StepCwd, unix.ENOENT), live, unix.ENOENT, nil},
		{"argv too large for the kernel", spawn(initproc.StepExec, unix.E2BIG), live, 0, nil},
		{"argv too large for the init", spawn(initproc.StepInit, unix.E2BIG), live, 0, nil},
		{"exec fault", spawn(initproc.StepExec, unix.EFAULT), live, 0, nil},
		{"host out of files", spawn(initproc.StepExec, unix.ENFILE), live, 0, nil},
		{"joining the cgroup", spawn(initproc.StepCgroup, unix.ENOENT), live, 0, nil},
		{"switching uid", spawn(initproc.StepCreds, unix.EPERM), live, 0, nil},
		{"clone in the init", spawn(initproc.StepInit, unix.EAGAIN), live, 0, nil},
		{"session ended", fmt.Errorf("%w: session s", sandbox.ErrSessionEnded), live, unix.EPIPE, nil},
		{"session ended with its sandbox", fmt.Errorf("%w: session s", sandbox.ErrSessionEnded), gone, 0, nil},
		{"bare errno of the host", fmt.Errorf("reading: %w", unix.EIO), live, 0, nil},
		{"bare ENXIO, not from the sandbox's filesystem", unix.ENXIO, live, 0, nil},
		{"the init's limits", fmt.Errorf("%w: exec: argv has 6004 entries", initproc.ErrTooLarge), live, 0, nil},
		{"bad input", fmt.Errorf("%w: path", sandbox.ErrInvalid), live, 0, nil},
		{"aborted", sandbox.ErrAborted, live, 0, nil},
		{"closed", sandbox.ErrClosed, live, 0, nil},
		{"pids limit", fmt.Errorf("%w: the sandbox's pids limit: %w", sandbox.ErrBudget, unix.EAGAIN), live, 0, nil},
		{"a submit's verifier that cannot start", spawn(initproc.StepExec, unix.ENOENT), live, 0, Submit{}},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			a := tc.a
			if a == nil {
				a = ReadFile{Path: "/p"}
			}
			got := agentError(a, tc.err, tc.gone)
			switch {
			case tc.errno == 0 && got != nil:
				t.Fatalf("agentError(%v) = %+v, want nil", tc.err, got)
			case tc.errno != 0 && (got == nil || got.Errno != tc.errno || got.Message == ""):
				t.Fatalf("agentError(%v) = %+v, want errno %s", tc.err, got, unix.ErrnoName(tc.errno))
			}
		})
	}
}

// What the caller gets wrong is refused as invalid input before anything runs.
func TestValidateExec(t *testing.T) {
	for _, tc := range []struct {
		name string
		x    Exec
		ok   bool
	}{
		{"command", Exec{Command: "true", Env: map[string]string{"A": "b=c"}, Timeout: time.Second}, true},
		{"argv", Exec{Argv: []string{"true"}}, true},
		{"neither", Exec{}, false},
		{"both", Exec{Command: "true", Argv: []string{"true"}}, false},
		{"negative, NaN or infinite timeout", Exec{Command: "true", Timeout: -1}, false},
		{"= in a key", Exec{Command: "true", Env: map[string]string{"A=B": "x"}}, false},
		{"NUL in a key", Exec{Command: "true", Env: map[string]string{"A\x00": "x"}}, false},
		{"empty key", Exec{Command: "true", Env: map[string]string{"": "x"}}, false},
		{"NUL in a value", Exec{Command: "true", Env: map[string]string{"A": "x\x00"}}, false},
		{"interactive input: an empty line", Exec{Session: "s", Interact: &sandbox.Interact{}}, true},
		{"interactive without a session", Exec{Command: "cat", Interact: &sandbox.Interact{}}, false},
		{"interactive argv", Exec{Argv: []string{"cat"}, Session: "s", Interact: &sandbox.Interact{}}, false},
	} {
		err := validate(tc.x)
		if tc.ok != (err == nil) || err != nil && !errors.Is(err, errdefs.ErrInvalidArgument) {
			t.Errorf("%s: validate = %v, want ok %v or invalid argument", tc.name, err, tc.ok)
		}
	}
}
