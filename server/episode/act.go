package episode

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"os"
	"strings"
	"time"

	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/trace"
	"golang.org/x/sys/unix"

	"github.com/deltagym/deltagym/envpool"
	"github.com/deltagym/deltagym/internal/errdefs"
	"github.com/deltagym/deltagym/sandbox"
	"github.com/deltagym/deltagym/sandbox/initproc"
)

// Whose fault an action's failure is. Each failure of a step's action is charged to one of
// three, here and nowhere else:
//
//   - The caller's: the request is wrong whatever the sandbox holds (a missing field, an argv
//     past the init's limits, a NUL byte in a string, '=' in a variable's name, a timeout that
//     is negative, NaN or infinite). It is refused with invalid_argument before anything runs
//     (validate, then the runtime's own checks, sandbox.ExecRequest and initproc.CheckArgs, which
//     run before anything reaches the sandbox); nothing is recorded or changed.
//   - The agent's: the sandbox's own state, which the agent's steps made, refused the action (a
//     path that is missing, a directory, a FIFO, a socket or a running binary; a program that is
//     missing or not executable; a full writable layer). The step is answered with
//     Observation.Error, recorded and counted like any other, and the episode goes on
//     (agentError).
//   - The infrastructure's: the server or the machine failed (InfraFailure); the episode ends
//     failed with class infra.
//
// What is none of these (an abort by Restore or Close, the pids limit) fails the call with its
// own code and leaves the episode as it is. A call its caller ended while the action ran (the
// caller went away, or its deadline passed) fails with its own code too, but the action ran and
// what it did stays: it is a step, recorded and counted, its observation an ECANCELED error.

// validate checks an action before anything runs.
func validate(a Action) error {
	if ok, err := validateFiles(a); ok {
		return err
	}
	switch x := a.(type) {
	case Exec:
		return validateExec(x)
	case WriteFile:
		if x.Path == "" {
			return fmt.Errorf("write_file needs a path: %w", ErrInvalid)
		}
		if err := sandbox.CheckPath(x.Path); err != nil {
			return fmt.Errorf("write_file: %w", err)
		}
		if x.Mode&^os.ModePerm != 0 {
			return fmt.Errorf("write_file mode %o has bits other than permissions (0 to 0777): %w", uint32(x.Mode), ErrInvalid)
		}
		if len(x.Content) > sandbox.MaxFileBytes {
			return fmt.Errorf("write_file of %d bytes exceeds the file cap of %d bytes; write the file in parts (append): %w",
				len(x.Content), sandbox.MaxFileBytes, ErrInvalid)
		}
	case ReadFile:
		if x.Path == "" {
			return fmt.Errorf("read_file needs a path: %w", ErrInvalid)
		}
		if err := sandbox.CheckPath(x.Path); err != nil {
			return fmt.Errorf("read_file: %w", err)
		}
		if x.Offset < 0 || x.MaxBytes < 0 {
			return fmt.Errorf("read_file offset and max_bytes must not be negative: %w", ErrInvalid)
		}
	case Submit:
		// The answer reaches the verifier as a variable of its environment: one the init would
		// refuse is refused here, before a restore that goes with the step.
		if x.Answer != nil {
			if err := initproc.CheckArgs([]string{"sh"}, []string{"DELTAGYM_ANSWER=" + *x.Answer}, "/"); err != nil {
				return fmt.Errorf("submit's answer: %w: %w", err, ErrInvalid)
			}
		}
	case Refused:
		return x.Err
	case ListProcesses:
	case Signal:
		return validateSignal(x)
	default:
		return fmt.Errorf("action has no kind set (exec, write_file, read_file, submit, list_dir, stat, remove, make_dir, upload or download; in JSON exec, writeFile, readFile, submit, listDir, stat, remove, makeDir, upload or download, other names are ignored): %w", ErrInvalid)
	}
	return nil
}

// validateExec checks an exec action before anything runs; the limits of the sandbox's init
// on argv and the environment are checked by the runtime (sandbox.ExecRequest), which knows the
// sandbox's own environment.
func validateExec(x Exec) error {
	if x.Interact != nil && x.Session == "" {
		return fmt.Errorf("an interactive exec runs in a session: %w", ErrInvalid)
	}
	if err := sandbox.CheckInteract(x.Interact, x.Session); err != nil {
		return fmt.Errorf("exec: %w", err)
	}
	if (x.Command == "") == (len(x.Argv) == 0) && (x.Interact == nil || len(x.Argv) > 0) {
		return fmt.Errorf("exec needs exactly one of command and argv: %w", ErrInvalid)
	}
	if x.Session != "" && len(x.Argv) > 0 {
		return fmt.Errorf("exec with a session takes a command, not argv: %w", ErrInvalid)
	}
	if x.Session != "" {
		if err := sandbox.CheckSessionName(x.Session); err != nil {
			return err
		}
	}
	if strings.IndexByte(x.Cwd, 0) >= 0 {
		return fmt.Errorf("exec cwd %.64q has a NUL byte: %w", x.Cwd, ErrInvalid)
	}
	if x.Timeout < 0 {
		return fmt.Errorf("exec timeout_seconds must be a finite number of seconds, 0 or more (0: the env's step timeout), not a negative, NaN or infinite one: %w", ErrInvalid)
	}
	for k, v := range x.Env {
		switch {
		case k == "":
			return fmt.Errorf("exec env has a variable with an empty name: %w", ErrInvalid)
		case strings.ContainsAny(k, "=\x00"):
			return fmt.Errorf("exec env variable name %.64q contains '=' or a NUL byte: %w", k, ErrInvalid)
		case strings.IndexByte(v, 0) >= 0:
			return fmt.Errorf("exec env variable %.64q has a NUL byte in its value: %w", k, ErrInvalid)
		}
	}
	return nil
}

// outcome is what an action did. verr is a submit's verifier failure (the episode still ends);
// refused says why a pristine verifier refused the agent's state (reward 0, the agent's fault).
type outcome struct {
	obs        Observation
	reward     float64
	terminated bool
	verr       error
	refused    string
}

// act performs an action in b's sandbox. left, when positive, is the time left in the
// episode's time budget, which bounds an exec's timeout.
func (c *Core) act(ctx context.Context, b *box, a Action, left time.Duration) (outcome, error) {
	l := b.lease
	attrs := []attribute.KeyValue{attribute.String("deltagym.sandbox_id", l.ID()), attribute.String("deltagym.env", l.Env().Name())}
	if out, ok, err := c.treeAction(ctx, l, a, attrs); ok {
		return out, err
	}
	switch x := a.(type) {
	case Exec:
		return c.exec(ctx, l, x, left, attrs)
	case WriteFile:
		return c.writeFile(ctx, l, x, attrs)
	case ReadFile:
		return c.readFile(ctx, l, x, attrs)
	case ListProcesses, Signal:
		return c.processAction(ctx, l, x, attrs)
	case Submit:
		ctx, done := c.cfg.Observe(ctx, "verify")
		trace.SpanFromContext(ctx).SetAttributes(attrs...)
		v, err := c.pools.Submit(ctx, l, x.Answer)
		done(err)
		if err != nil && !errors.Is(err, envpool.ErrVerifier) && !errors.Is(err, envpool.ErrNoVerifier) {
			return outcome{}, err
		}
		return outcome{obs: Observation{Submit: &SubmitResult{Components: v.Components, Output: v.Output}},
			reward: v.Reward, terminated: true, verr: err, refused: v.Refused}, nil
	}
	return outcome{}, fmt.Errorf("unknown action kind: %w", ErrInvalid)
}

func (c *Core) exec(ctx context.Context, l *envpool.Lease, x Exec, left time.Duration, attrs []attribute.KeyValue) (outcome, error) {
	env := l.Env()
	timeout := env.StepTimeout()
	if x.Timeout > 0 && x.Timeout < timeout {
		timeout = x.Timeout
	}
	if left > 0 && left < timeout {
		timeout = left
	}
	ctx, done := c.cfg.Observe(ctx, "exec")
	span := trace.SpanFromContext(ctx)
	span.SetAttributes(append(attrs, attribute.Float64("deltagym.exec.timeout_seconds", timeout.Seconds()),
		attribute.Bool("deltagym.exec.background", x.Background))...)
	res, err := l.Sandbox().Exec(ctx, sandbox.ExecRequest{Argv: x.Argv, Command: x.Command, Stdin: x.Stdin, Env: sortedEnv(x.Env),
		Cwd: x.Cwd, Timeout: timeout, Background: x.Background, Session: x.Session, MaxOutput: env.OutputCap(), Interact: x.Interact,
		Output: x.Output})
	if err == nil {
		span.SetAttributes(attribute.Int("deltagym.exec.exit_code", res.ExitCode), attribute.Bool("deltagym.exec.timed_out", res.TimedOut))
	}
	done(err)
	if err != nil {
		return outcome{}, err
	}
	return outcome{obs: Observation{Exec: &res}}, nil
}

func (c *Core) writeFile(ctx context.Context, l *envpool.Lease, w WriteFile, attrs []attribute.KeyValue) (outcome, error) {
	mode := w.Mode
	if mode == 0 {
		mode = 0o644
	}
	ctx, done := c.cfg.Observe(ctx, "write_file")
	trace.SpanFromContext(ctx).SetAttributes(append(attrs, attribute.Int("deltagym.file.bytes", len(w.Content)))...)
	box := l.Sandbox()
	err := box.WriteFile(ctx, w.Path, w.Content, mode, w.Append)
	done(err)
	if err != nil {
		return outcome{}, err
	}
	_, size, err := box.ReadFile(ctx, w.Path, 0, 0)
	if err != nil {
		return outcome{}, err
	}
	return outcome{obs: Observation{WriteFile: &WriteFileResult{Size: size}}}, nil
}

func (c *Core) readFile(ctx context.Context, l *envpool.Lease, r ReadFile, attrs []attribute.KeyValue) (outcome, error) {
	limit := int64(l.Env().OutputCap())
	if r.MaxBytes > 0 && r.MaxBytes < limit {
		limit = r.MaxBytes
	}
	ctx, done := c.cfg.Observe(ctx, "read_file")
	trace.SpanFromContext(ctx).SetAttributes(attrs...)
	data, size, err := l.Sandbox().ReadFile(ctx, r.Path, r.Offset, limit)
	done(err)
	if err != nil {
		return outcome{}, err
	}
	return outcome{obs: Observation{ReadFile: &ReadFileResult{Content: data, Size: size, Truncated: r.Offset+int64(len(data)) < size}}}, nil
}

// agentError returns what the agent observes of err, the failure of action a in a sandbox
// (whose Done channel is gone), when the sandbox's own state caused it; nil when the caller or
// the infrastructure did (see "Whose fault" above). The agent's: a file action's *sandbox.FileError (whose errnos
// are only those the sandbox's filesystem gives); a command the init could not start for its
// directory or its program (initproc.StepCwd, initproc.StepExec), but for E2BIG (the request's
// size) and the errnos of a fault of the host (EFAULT, EBADF, EIO, ENFILE); a shell session
// whose shell exited while the sandbox lives. Never for a submit: how its verifier fails is the
// verifier's (the episode ends failed, class verifier).
func agentError(a Action, err error, gone <-chan struct{}) *ActionError {
	if _, ok := a.(Submit); ok {
		return nil
	}
	var fe *sandbox.FileError
	if errors.As(err, &fe) {
		return &ActionError{Errno: fe.Errno, Message: fe.Path + ": " + fe.Msg, Path: fe.Path}
	}
	var pe *sandbox.ProcError
	if errors.As(err, &pe) {
		return &ActionError{Errno: pe.Errno, Message: pe.Msg}
	}
	var se *initproc.SpawnError
	if errors.As(err, &se) {
		switch {
		case se.Step != initproc.StepCwd && se.Step != initproc.StepExec:
			return nil
		case se.Errno == unix.E2BIG, se.Errno == unix.EFAULT, se.Errno == unix.EBADF, se.Errno == unix.EIO, se.Errno == unix.ENFILE:
			return nil
		}
		ae := &ActionError{Errno: se.Errno, Message: se.Error()}
		if x, ok := a.(Exec); ok && se.Step == initproc.StepCwd {
			ae.Path = x.Cwd // the directory the command was to start in, not its program
		}
		return ae
	}
	if errors.Is(err, sandbox.ErrSessionEnded) {
		select {
		case <-gone: // the sandbox went with it: InfraFailure's
			return nil
		default:
		}
		return &ActionError{Errno: unix.EPIPE, Message: "the session's shell has exited; its next command starts another"}
	}
	return nil
}

// callErr turns an error of a call begun on a lease into envpool.ErrAborted when Restore or
// Close aborted it.
func callErr(ctx context.Context, err error) error {
	if err != nil && envpool.Aborted(ctx) && !errors.Is(err, envpool.ErrAborted) {
		return fmt.Errorf("%w: %w", envpool.ErrAborted, err)
	}
	return err
}

// infraFailure is InfraFailure with the core's idea of an internal error (Config.Internal).
func (c *Core) infraFailure(ctx context.Context, box *sandbox.Sandbox, err error) (gone, infra bool) {
	return InfraFailure(ctx, box, err, c.cfg.Internal)
}

// InfraFailure reports whether err, from a call begun on a lease of box with context ctx (from
// Begin), is the infrastructure's fault rather than the client's, and whether the sandbox is
// gone. Infrastructure failures: the sandbox was destroyed under the call by the runtime because
// its init died (the call ends aborted though neither the client nor the pools aborted it, or
// closed with the init dead), or the server failed internally (internal(err), such as a spawn
// failing for a reason of the host). Not: bad input, exhausted limits, a shell session the
// agent ended, aborts by Restore, Close or the reaper (which end the episode themselves), and
// the caller's own cancellation or deadline.
func InfraFailure(ctx context.Context, box *sandbox.Sandbox, err error, internal func(error) bool) (gone, infra bool) {
	switch {
	case err == nil, envpool.Aborted(ctx), ctx.Err() != nil:
		return false, false
	case errors.Is(err, sandbox.ErrAborted): // only Restore and Destroy abort an exec
		return true, true
	case errors.Is(err, sandbox.ErrClosed):
		gone = initDead(box)
		return gone, gone
	}
	return false, internal(err)
}

// Internal reports whether err is the server's own fault by its class alone: of class
// errdefs.ErrInternal or of none, and not a context's end (Config.Internal's default).
func Internal(err error) bool {
	class := errdefs.Class(err)
	return (class == nil || class == errdefs.ErrInternal) && !errors.Is(err, context.Canceled) && !errors.Is(err, context.DeadlineExceeded)
}

// initDeathGrace is how long initDead gives a dying init to finish exiting: a call can see the
// init's connection close while the kernel is still tearing the process down.
const initDeathGrace = 250 * time.Millisecond

// initDead reports whether box's init has exited (the runtime then destroys the sandbox). It
// waits up to initDeathGrace for the runtime to notice, then asks the kernel.
func initDead(box *sandbox.Sandbox) bool {
	t := time.NewTimer(initDeathGrace)
	defer t.Stop()
	select {
	case <-box.Done():
		return true
	case <-t.C:
	}
	st, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", box.InitPid()))
	if err != nil {
		return true
	}
	i := bytes.LastIndexByte(st, ')') // the state follows the command name in parentheses
	return i < 0 || i+2 >= len(st) || st[i+2] == 'Z' || st[i+2] == 'X'
}
