package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"os"
	"strconv"
	"strings"
	"time"

	"connectrpc.com/connect"

	deltagym "github.com/deltagym/deltagym/clients/go/deltagym"
	deltagymv1 "github.com/deltagym/deltagym/clients/go/gen/deltagym/v1"
)

// The client subcommands call the generated clients that deltagym.Client wraps
// (with its auth and retry policy), so that --json prints the server's
// responses as they are.

func runEnvs(ctx context.Context, a *app, fs *flag.FlagSet, args []string) error {
	pos, _, err := parseArgs(fs, args)
	if err != nil {
		return err
	}
	if err := wantArgs(pos, 0, 0, ""); err != nil {
		return err
	}
	c, err := a.dial()
	if err != nil {
		return err
	}
	defer c.Close()
	res, err := c.EnvService().ListEnvs(ctx, connect.NewRequest(&deltagymv1.ListEnvsRequest{}))
	if err != nil {
		return err
	}
	if a.json {
		return printJSON(a.stdout, res.Msg)
	}
	return printEnvs(a.stdout, res.Msg)
}

func printEnvs(w io.Writer, m *deltagymv1.ListEnvsResponse) error {
	t := newTable(w, "NAME", "WARM", "ACTIVE", "IMAGE", "DESCRIPTION")
	for _, e := range m.GetEnvs() {
		s := e.GetSpec()
		t.row(s.GetName(), strconv.Itoa(int(e.GetWarmCount())), strconv.Itoa(int(e.GetActiveCount())),
			orDash(s.GetImage()), orDash(shortText(s.GetDescription(), 60)))
	}
	return t.flush()
}

func runReset(ctx context.Context, a *app, fs *flag.FlagSet, args []string) error {
	var (
		seed  = fs.String("seed", "", "seed handed to the reset hook (an integer)")
		opts  = kvFlag{}
		run   = fs.String("run", "", "run the episode belongs to")
		group = fs.String("group", "", "group (GRPO) the episode belongs to")
		key   = fs.String("idempotency-key", "", "idempotency key (default: a random one, so retries are safe)")
		quiet = fs.Bool("q", false, "print only the sandbox ID")
	)
	fs.Var(opts, "option", "task option key=value handed to the reset hook (repeatable)")
	pos, _, err := parseArgs(fs, args)
	if err != nil {
		return err
	}
	if err := wantArgs(pos, 1, 1, "ENV"); err != nil {
		return err
	}
	req := &deltagymv1.ResetRequest{Env: pos[0], Run: *run, GroupId: *group, IdempotencyKey: *key}
	if len(opts) > 0 {
		req.Options = opts
	}
	if *seed != "" {
		n, err := strconv.ParseInt(*seed, 10, 64)
		if err != nil {
			return usageErrorf("--seed %q is not an integer", *seed)
		}
		req.Seed = &n
	}
	if req.IdempotencyKey == "" {
		req.IdempotencyKey = deltagym.NewIdempotencyKey()
	}
	c, err := a.dial()
	if err != nil {
		return err
	}
	defer c.Close()
	res, err := c.EnvService().Reset(ctx, connect.NewRequest(req))
	if err != nil {
		return err
	}
	switch {
	case a.json:
		return printJSON(a.stdout, res.Msg)
	case *quiet:
		_, err := fmt.Fprintln(a.stdout, res.Msg.GetSandboxId())
		return err
	}
	return printReset(a.stdout, res.Msg, time.Now())
}

func printReset(w io.Writer, m *deltagymv1.ResetResponse, now time.Time) error {
	r := m.GetObservation().GetReset_()
	if err := fields(w,
		"sandbox", m.GetSandboxId(),
		"episode", m.GetEpisodeId(),
		"checkpoint", m.GetCheckpointId(),
		"lease", formatLease(m.GetLeaseExpireTime(), now),
	); err != nil {
		return err
	}
	if t := r.GetTask(); t != "" {
		fmt.Fprintf(w, "task:\n%s", ensureNewline(indent(t)))
	}
	if h := r.GetHook(); h != nil {
		fmt.Fprintf(w, "reset hook: %s\n", execStatus(h))
		if len(h.GetStdout()) > 0 {
			fmt.Fprint(w, ensureNewline(indent(string(h.GetStdout()))))
		}
	}
	return nil
}

// indent prefixes each line of s with two spaces.
func indent(s string) string {
	lines := strings.SplitAfter(s, "\n")
	for i, l := range lines {
		if l != "" {
			lines[i] = "  " + l
		}
	}
	return strings.Join(lines, "")
}

func runExec(ctx context.Context, a *app, fs *flag.FlagSet, args []string) error {
	var (
		session = fs.String("session", "", "persistent bash session to run the command in")
		timeout = new(time.Duration)
		cwd     = fs.String("cwd", "", "working directory inside the sandbox")
		stdin   = fs.String("stdin", "", "file to give the command as standard input (- for this process's stdin)")
		bg      = fs.Bool("background", false, "start the command in the background and return its pid")
		ckpt    = fs.Bool("checkpoint", false, "checkpoint the state after the command and print its ID on stderr (stdout is the command's; --json has it as checkpointId)")
		env     = kvFlag{}
	)
	fs.Var(env, "env", "environment variable key=value for the command (repeatable)")
	fs.Var((*secondsFlag)(timeout), "timeout", "wall-time limit of the command: a duration (1.5s, 2m) or seconds (default: the env's step timeout)")
	pos, _, err := parseArgs(fs, args)
	if err != nil {
		return err
	}
	if err := wantArgs(pos, 2, -1, "SANDBOX and CMD"); err != nil {
		return err
	}
	action := &deltagymv1.ExecAction{Cwd: *cwd, Session: *session, Background: *bg, TimeoutSeconds: timeout.Seconds()}
	if len(env) > 0 {
		action.Env = env
	}
	if err := setCommand(action, pos[1:]); err != nil {
		return err
	}
	if *stdin != "" {
		b, err := readInput(a.stdin, *stdin)
		if err != nil {
			return err
		}
		action.Stdin = b
	}
	c, err := a.dial()
	if err != nil {
		return err
	}
	defer c.Close()
	res, err := c.EnvService().Step(ctx, connect.NewRequest(&deltagymv1.StepRequest{
		SandboxId: pos[0], Action: &deltagymv1.Action{Kind: &deltagymv1.Action_Exec{Exec: action}}, Checkpoint: *ckpt,
	}))
	if err != nil {
		return err
	}
	if a.json {
		err = printJSON(a.stdout, res.Msg)
	} else {
		err = printExec(a.stdout, a.stderr, res.Msg)
	}
	if err != nil {
		return err
	}
	return commandStatus(res.Msg.GetObservation().GetExec())
}

// commandExit carries the exit status of a command run by `exec`, which the
// CLI exits with, as ssh and docker exec do: the command's own status,
// 128+N when signal N killed it, 124 when it timed out.
type commandExit int

func (e commandExit) Error() string { return fmt.Sprintf("command exited with status %d", int(e)) }

func commandStatus(e *deltagymv1.ExecResult) error {
	switch {
	case e.GetTimedOut():
		return commandExit(124)
	case e.GetSignal() != 0:
		return commandExit(128 + e.GetSignal())
	case e.GetPid() != 0 && e.GetExitCode() == -1:
		return nil // started in the background
	case e.GetExitCode() != 0:
		return commandExit(e.GetExitCode() & 0xff)
	}
	return nil
}

// setCommand fills the command of an exec: one word is a shell string, several
// are an argv (which, in a session, is quoted into a shell string).
func setCommand(action *deltagymv1.ExecAction, words []string) error {
	switch {
	case len(words) == 1:
		action.Command = words[0]
	case action.GetSession() != "":
		quoted := make([]string, len(words))
		for i, w := range words {
			quoted[i] = shellQuote(w)
		}
		action.Command = strings.Join(quoted, " ")
	default:
		action.Argv = words
	}
	if action.GetCommand() == "" && len(action.GetArgv()) == 0 {
		return usageErrorf("empty command")
	}
	return nil
}

// shellQuote quotes s for /bin/sh when it holds anything but safe characters.
func shellQuote(s string) string {
	if s != "" && strings.Trim(s, "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789-_./=:,+@%") == "" {
		return s
	}
	return "'" + strings.ReplaceAll(s, "'", `'\''`) + "'"
}

// printExec writes the command's output to stdout and stderr as it is, then,
// when the command did not simply succeed (or the step ended the episode),
// a status line to stderr.
func printExec(stdout, stderr io.Writer, m *deltagymv1.StepResponse) error {
	e := m.GetObservation().GetExec()
	if _, err := stdout.Write(e.GetStdout()); err != nil {
		return err
	}
	if _, err := stderr.Write(e.GetStderr()); err != nil {
		return err
	}
	var notes []string
	if e.GetExitCode() != 0 || e.GetSignal() != 0 || e.GetTimedOut() || e.GetStdoutTruncated() || e.GetStderrTruncated() {
		notes = append(notes, execStatus(e))
	}
	notes = append(notes, stepNotes(m)...)
	if len(notes) > 0 {
		fmt.Fprintf(stderr, "deltagym: %s\n", strings.Join(notes, "; "))
	}
	return nil
}

// stepNotes lists what a step's response says beyond its observation.
func stepNotes(m *deltagymv1.StepResponse) []string {
	var notes []string
	if m.GetCheckpointId() != "" {
		notes = append(notes, "checkpoint "+m.GetCheckpointId())
	}
	if m.GetReward() != 0 {
		notes = append(notes, "reward "+formatFloat(m.GetReward()))
	}
	if m.GetTerminated() {
		notes = append(notes, "episode terminated")
	}
	if m.GetTruncated() {
		notes = append(notes, "episode truncated (budget spent)")
	}
	return notes
}

// readInput reads a file, or stdin for "-".
func readInput(stdin io.Reader, name string) ([]byte, error) {
	if name == "-" {
		b, err := io.ReadAll(stdin)
		if err != nil {
			return nil, fmt.Errorf("reading standard input: %w", err)
		}
		return b, nil
	}
	b, err := os.ReadFile(name)
	if err != nil {
		return nil, fmt.Errorf("reading input: %w", err)
	}
	return b, nil
}

func runWrite(ctx context.Context, a *app, fs *flag.FlagSet, args []string) error {
	var (
		from    = fs.String("from", "-", "file to copy into the sandbox (- for standard input)")
		mode    = fs.String("mode", "", "permission bits of a new file, in octal (default 0644)")
		appendF = fs.Bool("append", false, "append instead of replacing")
	)
	pos, _, err := parseArgs(fs, args)
	if err != nil {
		return err
	}
	if err := wantArgs(pos, 2, 2, "SANDBOX and PATH"); err != nil {
		return err
	}
	action := &deltagymv1.WriteFileAction{Path: pos[1], Append: *appendF}
	if *mode != "" {
		m, err := strconv.ParseUint(*mode, 8, 32)
		if err != nil || m > 0o7777 {
			return usageErrorf("--mode %q is not an octal permission", *mode)
		}
		action.Mode = uint32(m)
	}
	if action.Content, err = readInput(a.stdin, *from); err != nil {
		return err
	}
	c, err := a.dial()
	if err != nil {
		return err
	}
	defer c.Close()
	res, err := c.EnvService().Step(ctx, connect.NewRequest(&deltagymv1.StepRequest{
		SandboxId: pos[0], Action: &deltagymv1.Action{Kind: &deltagymv1.Action_WriteFile{WriteFile: action}},
	}))
	if err != nil {
		return err
	}
	if a.json {
		return printJSON(a.stdout, res.Msg)
	}
	fmt.Fprintf(a.stdout, "wrote %d bytes to %s (file size %d)\n", len(action.Content), action.Path, res.Msg.GetObservation().GetWriteFile().GetSize())
	if notes := stepNotes(res.Msg); len(notes) > 0 {
		fmt.Fprintf(a.stderr, "deltagym: %s\n", strings.Join(notes, "; "))
	}
	return nil
}

func runRead(ctx context.Context, a *app, fs *flag.FlagSet, args []string) error {
	var (
		offset   = fs.Int64("offset", 0, "byte offset to start at")
		maxBytes = fs.Int64("max-bytes", 0, "most bytes to read (default: the env's output cap)")
	)
	pos, _, err := parseArgs(fs, args)
	if err != nil {
		return err
	}
	if err := wantArgs(pos, 2, 2, "SANDBOX and PATH"); err != nil {
		return err
	}
	c, err := a.dial()
	if err != nil {
		return err
	}
	defer c.Close()
	res, err := c.EnvService().Step(ctx, connect.NewRequest(&deltagymv1.StepRequest{
		SandboxId: pos[0], Action: &deltagymv1.Action{Kind: &deltagymv1.Action_ReadFile{ReadFile: &deltagymv1.ReadFileAction{
			Path: pos[1], Offset: *offset, MaxBytes: *maxBytes,
		}}},
	}))
	if err != nil {
		return err
	}
	if a.json {
		return printJSON(a.stdout, res.Msg)
	}
	r := res.Msg.GetObservation().GetReadFile()
	if _, err := a.stdout.Write(r.GetContent()); err != nil {
		return err
	}
	if r.GetTruncated() {
		fmt.Fprintf(a.stderr, "deltagym: printed %d of %d bytes from offset %d; use --offset to read on\n", len(r.GetContent()), r.GetSize(), *offset)
	}
	return nil
}

func runCheckpoint(ctx context.Context, a *app, fs *flag.FlagSet, args []string) error {
	var (
		durable = fs.Bool("durable", false, "save processes kept as templates as CRIU images at once, so the checkpoint keeps them whatever happens to the sandbox (an agent's kill -9 -1 included)")
		procs   = fs.String("processes", "", "how to capture live processes: template (frozen copies, restorable in this sandbox; trees and multithreaded programs go to CRIU), criu (CRIU images, restorable anywhere, forks carry them) or files (none); default: the env's")
		quiet   = fs.Bool("q", false, "print only the checkpoint ID")
	)
	pos, _, err := parseArgs(fs, args)
	if err != nil {
		return err
	}
	if err := wantArgs(pos, 1, 1, "SANDBOX"); err != nil {
		return err
	}
	c, err := a.dial()
	if err != nil {
		return err
	}
	defer c.Close()
	mode := deltagymv1.ProcessMode_PROCESS_MODE_UNSPECIFIED
	switch *procs {
	case "":
	case "template":
		mode = deltagymv1.ProcessMode_PROCESS_MODE_TEMPLATE
	case "files":
		mode = deltagymv1.ProcessMode_PROCESS_MODE_FILESYSTEM
	case "criu":
		mode = deltagymv1.ProcessMode_PROCESS_MODE_CRIU
	default:
		return usageErrorf("--processes %q: want template, criu or files", *procs)
	}
	res, err := c.EnvService().Checkpoint(ctx, connect.NewRequest(&deltagymv1.CheckpointRequest{SandboxId: pos[0], Durable: *durable, ProcessMode: mode}))
	if err != nil {
		return err
	}
	switch {
	case a.json:
		return printJSON(a.stdout, res.Msg)
	case *quiet:
		_, err := fmt.Fprintln(a.stdout, res.Msg.GetCheckpointId())
		return err
	}
	if err := printCheckpoint(a.stdout, res.Msg); err != nil {
		return err
	}
	if mode == deltagymv1.ProcessMode_PROCESS_MODE_FILESYSTEM {
		err = fields(a.stdout, "processes", "not captured (--processes files): restores and forks of it start none of the sandbox's running processes")
	}
	return err
}

func printCheckpoint(w io.Writer, m *deltagymv1.CheckpointResponse) error {
	durable := "no (frozen copies in the sandbox; --durable saves them as CRIU images)"
	if m.GetDurable() {
		durable = "yes"
	}
	if err := fields(w,
		"checkpoint", m.GetCheckpointId(),
		"parent", m.GetParentId(),
		"depth", strconv.Itoa(int(m.GetDepth())),
		"durable", durable,
	); err != nil {
		return err
	}
	if len(m.GetProcesses()) > 0 {
		t := newTable(w, "PID", "CAPTURE", "COMMAND", "REASON")
		for _, p := range m.GetProcesses() {
			t.row(strconv.Itoa(int(p.GetPid())), strings.ToLower(strings.TrimPrefix(p.GetMethod().String(), "CAPTURE_METHOD_")),
				shortText(p.GetCommand(), 40), orDash(oneLine(p.GetReason())))
		}
		return t.flush()
	}
	return nil
}

func runRestore(ctx context.Context, a *app, fs *flag.FlagSet, args []string) error {
	fresh := fs.Bool("fresh-entropy", false, "give the restored processes new randomness (/run/deltagym/fork-seed, sessions' $RANDOM)")
	pos, _, err := parseArgs(fs, args)
	if err != nil {
		return err
	}
	if err := wantArgs(pos, 2, 2, "SANDBOX and CHECKPOINT"); err != nil {
		return err
	}
	c, err := a.dial()
	if err != nil {
		return err
	}
	defer c.Close()
	res, err := c.EnvService().Restore(ctx, connect.NewRequest(&deltagymv1.RestoreRequest{SandboxId: pos[0], CheckpointId: pos[1], FreshEntropy: *fresh}))
	if err != nil {
		return err
	}
	if a.json {
		return printJSON(a.stdout, res.Msg)
	}
	return fields(a.stdout, "episode", res.Msg.GetEpisodeId(), "next step", strconv.Itoa(int(res.Msg.GetNextStepIndex())))
}

func runFork(ctx context.Context, a *app, fs *flag.FlagSet, args []string) error {
	var (
		ckpt    = fs.String("checkpoint", "", "checkpoint to fork from")
		sandbox = fs.String("sandbox", "", "sandbox whose current state to fork (checkpointed first)")
		n       = fs.Int("n", 1, "number of sandboxes to create")
		group   = fs.String("group", "", "group (GRPO) of the new episodes")
		run     = fs.String("run", "", "run of the new episodes (default: the source's)")
		key     = fs.String("idempotency-key", "", "idempotency key (default: a random one, so retries are safe)")
		fresh   = fs.Bool("fresh-entropy", false, "give each child distinct randomness")
		quiet   = fs.Bool("q", false, "print only the new sandbox IDs, one per line")
	)
	pos, _, err := parseArgs(fs, args)
	if err != nil {
		return err
	}
	if err := wantArgs(pos, 0, 1, "CHECKPOINT"); err != nil {
		return err
	}
	if len(pos) == 1 { // fork CK (as restore SB CK takes it), or fork SB
		if *ckpt != "" || *sandbox != "" {
			return usageErrorf("give the checkpoint as an argument or with --checkpoint or --sandbox, not both")
		}
		if strings.HasPrefix(pos[0], "sb-") {
			*sandbox = pos[0]
		} else {
			*ckpt = pos[0]
		}
	}
	req := &deltagymv1.ForkRequest{GroupId: *group, Run: *run, IdempotencyKey: *key, FreshEntropy: *fresh}
	switch {
	case (*ckpt == "") == (*sandbox == ""):
		return usageErrorf("give exactly one of --checkpoint and --sandbox")
	case *ckpt != "":
		req.Source = &deltagymv1.ForkRequest_CheckpointId{CheckpointId: *ckpt}
	default:
		req.Source = &deltagymv1.ForkRequest_SandboxId{SandboxId: *sandbox}
	}
	if *n < 1 || *n > 1<<20 {
		return usageErrorf("-n %d: want at least 1", *n)
	}
	req.N = int32(*n)
	if req.IdempotencyKey == "" {
		req.IdempotencyKey = deltagym.NewIdempotencyKey()
	}
	c, err := a.dial()
	if err != nil {
		return err
	}
	defer c.Close()
	res, err := c.EnvService().Fork(ctx, connect.NewRequest(req))
	if err != nil {
		return err
	}
	switch {
	case a.json:
		return printJSON(a.stdout, res.Msg)
	case *quiet:
		for _, id := range res.Msg.GetSandboxIds() {
			fmt.Fprintln(a.stdout, id)
		}
		// Processes the children run without are worth a word even here.
		for _, p := range res.Msg.GetProcesses() {
			if p.GetMethod() == deltagymv1.CaptureMethod_CAPTURE_METHOD_NONE {
				fmt.Fprintf(a.stderr, "deltagym: pid %d (%s): %s\n", p.GetPid(), p.GetCommand(), oneLine(p.GetReason()))
			}
		}
		return nil
	}
	return printFork(a.stdout, res.Msg)
}

func printFork(w io.Writer, m *deltagymv1.ForkResponse) error {
	noun := "sandboxes"
	if len(m.GetSandboxIds()) == 1 {
		noun = "sandbox"
	}
	fmt.Fprintf(w, "forked %d %s from checkpoint %s\n", len(m.GetSandboxIds()), noun, m.GetCheckpointId())
	t := newTable(w, "SANDBOX", "EPISODE")
	for i, id := range m.GetSandboxIds() {
		ep := ""
		if i < len(m.GetEpisodeIds()) {
			ep = m.GetEpisodeIds()[i]
		}
		t.row(id, orDash(ep))
	}
	if err := t.flush(); err != nil {
		return err
	}
	if len(m.GetProcesses()) == 0 {
		return nil
	}
	fmt.Fprintln(w, "processes of the checkpoint in each child:")
	t = newTable(w, "PID", "CAPTURE", "COMMAND", "REASON")
	for _, p := range m.GetProcesses() {
		t.row(strconv.Itoa(int(p.GetPid())), strings.ToLower(strings.TrimPrefix(p.GetMethod().String(), "CAPTURE_METHOD_")),
			shortText(p.GetCommand(), 40), orDash(oneLine(p.GetReason())))
	}
	return t.flush()
}

func runRelease(ctx context.Context, a *app, fs *flag.FlagSet, args []string) error {
	pos, _, err := parseArgs(fs, args)
	if err != nil {
		return err
	}
	if err := wantArgs(pos, 1, 1, "CHECKPOINT"); err != nil {
		return err
	}
	c, err := a.dial()
	if err != nil {
		return err
	}
	defer c.Close()
	res, err := c.EnvService().ReleaseCheckpoint(ctx, connect.NewRequest(&deltagymv1.ReleaseCheckpointRequest{CheckpointId: pos[0]}))
	if err != nil {
		return err
	}
	if a.json {
		return printJSON(a.stdout, res.Msg)
	}
	_, err = fmt.Fprintf(a.stdout, "released %s\n", pos[0])
	return err
}

func runEvaluate(ctx context.Context, a *app, fs *flag.FlagSet, args []string) error {
	pos, _, err := parseArgs(fs, args)
	if err != nil {
		return err
	}
	if err := wantArgs(pos, 1, 1, "SANDBOX"); err != nil {
		return err
	}
	c, err := a.dial()
	if err != nil {
		return err
	}
	defer c.Close()
	res, err := c.EnvService().Evaluate(ctx, connect.NewRequest(&deltagymv1.EvaluateRequest{SandboxId: pos[0]}))
	if err != nil {
		return err
	}
	if a.json {
		return printJSON(a.stdout, res.Msg)
	}
	m := res.Msg
	return printVerdict(a.stdout, m.GetReward(), m.GetComponents(), m.GetOutput(), "took "+formatSeconds(m.GetDurationSeconds()))
}

// printVerdict prints a verifier's reward, components and output.
func printVerdict(w io.Writer, reward float64, components map[string]float64, output, note string) error {
	if err := fields(w, "reward", formatFloat(reward)+" ("+note+")", "components", formatComponents(components)); err != nil {
		return err
	}
	if output != "" {
		fmt.Fprintf(w, "verifier output:\n%s", ensureNewline(indent(output)))
	}
	return nil
}

func runSubmit(ctx context.Context, a *app, fs *flag.FlagSet, args []string) error {
	pos, _, err := parseArgs(fs, args)
	if err != nil {
		return err
	}
	if err := wantArgs(pos, 1, 2, "SANDBOX"); err != nil {
		return err
	}
	action := &deltagymv1.SubmitAction{}
	if len(pos) == 2 {
		action.Answer = &pos[1]
	}
	c, err := a.dial()
	if err != nil {
		return err
	}
	defer c.Close()
	res, err := c.EnvService().Step(ctx, connect.NewRequest(&deltagymv1.StepRequest{
		SandboxId: pos[0], Action: &deltagymv1.Action{Kind: &deltagymv1.Action_Submit{Submit: action}},
	}))
	if err != nil {
		return err
	}
	if a.json {
		return printJSON(a.stdout, res.Msg)
	}
	m := res.Msg
	note := "episode " + m.GetEpisodeId()
	switch {
	case m.GetTerminated():
		note += " terminated"
	case m.GetTruncated():
		note += " truncated"
	}
	sub := m.GetObservation().GetSubmit()
	return printVerdict(a.stdout, m.GetReward(), sub.GetComponents(), sub.GetOutput(), note)
}

func runClose(ctx context.Context, a *app, fs *flag.FlagSet, args []string) error {
	pos, _, err := parseArgs(fs, args)
	if err != nil {
		return err
	}
	if err := wantArgs(pos, 1, -1, "SANDBOX"); err != nil {
		return err
	}
	c, err := a.dial()
	if err != nil {
		return err
	}
	defer c.Close()
	var errs []error
	for _, id := range pos {
		res, err := c.EnvService().Close(ctx, connect.NewRequest(&deltagymv1.CloseRequest{SandboxId: id}))
		switch {
		case err != nil:
			errs = append(errs, fmt.Errorf("%s: %w", id, err))
		case a.json:
			if err := printJSON(a.stdout, res.Msg); err != nil {
				return err
			}
		default:
			fmt.Fprintf(a.stdout, "closed %s\n", id)
		}
	}
	return errors.Join(errs...)
}

func runSandboxes(ctx context.Context, a *app, fs *flag.FlagSet, args []string) error {
	var (
		env   = fs.String("env", "", "only sandboxes of this env")
		run   = fs.String("run", "", "only sandboxes of this run")
		group = fs.String("group", "", "only sandboxes of this group")
	)
	pos, _, err := parseArgs(fs, args)
	if err != nil {
		return err
	}
	if err := wantArgs(pos, 0, 0, ""); err != nil {
		return err
	}
	c, err := a.dial()
	if err != nil {
		return err
	}
	defer c.Close()
	res, err := c.EnvService().ListSandboxes(ctx, connect.NewRequest(&deltagymv1.ListSandboxesRequest{Env: *env, Run: *run, GroupId: *group}))
	if err != nil {
		return err
	}
	if a.json {
		return printJSON(a.stdout, res.Msg)
	}
	now := time.Now()
	t := newTable(a.stdout, "SANDBOX", "ENV", "STATE", "EPISODE", "STEP", "RUN", "GROUP", "LEASE")
	for _, s := range res.Msg.GetSandboxes() {
		t.row(s.GetSandboxId(), s.GetEnv(), sandboxState(s.GetState()), orDash(s.GetEpisodeId()),
			strconv.Itoa(int(s.GetNextStepIndex())), orDash(s.GetRun()), orDash(s.GetGroupId()), orDash(formatLease(s.GetLeaseExpireTime(), now)))
	}
	return t.flush()
}

func runEpisodes(ctx context.Context, a *app, fs *flag.FlagSet, args []string) error {
	var (
		run   = fs.String("run", "", "only episodes of this run")
		group = fs.String("group", "", "only episodes of this group")
		env   = fs.String("env", "", "only episodes of this env")
		limit = fs.Int("limit", 100, "most episodes to print (0: all)")
	)
	pos, _, err := parseArgs(fs, args)
	if err != nil {
		return err
	}
	if err := wantArgs(pos, 0, 0, ""); err != nil {
		return err
	}
	if *limit < 0 {
		return usageErrorf("--limit %d: want 0 or more", *limit)
	}
	c, err := a.dial()
	if err != nil {
		return err
	}
	defer c.Close()
	pageSize := 1000 // the server's largest page
	if *limit > 0 {
		pageSize = min(*limit+1, pageSize) // one more tells whether there are more
	}
	var episodes []*deltagymv1.Episode
	more := false
	for e, err := range c.Episodes(ctx, deltagym.EpisodeFilter{Run: *run, Group: *group, Env: *env, PageSize: pageSize}) {
		if err != nil {
			return err
		}
		if *limit > 0 && len(episodes) == *limit {
			more = true
			break
		}
		episodes = append(episodes, e)
	}
	if more {
		fmt.Fprintf(a.stderr, "deltagym: showing the oldest %d; there are more (--limit 0 lists them all)\n", *limit)
	}
	if a.json {
		return printJSON(a.stdout, &deltagymv1.ListEpisodesResponse{Episodes: episodes})
	}
	return printEpisodes(a.stdout, episodes)
}

func printEpisodes(w io.Writer, episodes []*deltagymv1.Episode) error {
	t := newTable(w, "EPISODE", "ENV", "RUN", "GROUP", "STATUS", "STEPS", "REWARD", "STARTED")
	for _, e := range episodes {
		status := episodeStatus(e.GetStatus())
		if fc := failureClass(e.GetFailureClass()); fc != "" {
			status += " (" + fc + ")"
		}
		t.row(e.GetEpisodeId(), e.GetEnv(), orDash(e.GetRun()), orDash(e.GetGroupId()), status,
			strconv.Itoa(int(e.GetStepCount())), formatFloat(e.GetTotalReward()), formatTime(e.GetStartTime()))
	}
	return t.flush()
}

// failureClass is a failure class's name ("infra"), or "" for none.
func failureClass(fc deltagymv1.FailureClass) string {
	if fc == deltagymv1.FailureClass_FAILURE_CLASS_UNSPECIFIED {
		return ""
	}
	return strings.ToLower(strings.TrimPrefix(fc.String(), "FAILURE_CLASS_"))
}

// failureText is a failed episode's failure class and message ("infra: its sandbox died"), or "".
func failureText(e *deltagymv1.Episode) string {
	fc, m := failureClass(e.GetFailureClass()), e.GetFailureMessage()
	if fc != "" && m != "" {
		return fc + ": " + m
	}
	return fc + m
}

func runTrajectory(ctx context.Context, a *app, fs *flag.FlagSet, args []string) error {
	pos, _, err := parseArgs(fs, args)
	if err != nil {
		return err
	}
	if err := wantArgs(pos, 1, 1, "EPISODE"); err != nil {
		return err
	}
	c, err := a.dial()
	if err != nil {
		return err
	}
	defer c.Close()
	res, err := c.Trajectory(ctx, pos[0])
	if err != nil {
		return err
	}
	if a.json {
		return printJSON(a.stdout, res)
	}
	return printTrajectory(a.stdout, res)
}

func printTrajectory(w io.Writer, m *deltagymv1.GetTrajectoryResponse) error {
	e := m.GetEpisode()
	seed := ""
	if e.Seed != nil {
		seed = strconv.FormatInt(e.GetSeed(), 10)
	}
	if err := fields(w,
		"episode", e.GetEpisodeId(),
		"env", e.GetEnv(),
		"run", e.GetRun(),
		"group", e.GetGroupId(),
		"seed", seed,
		"status", episodeStatus(e.GetStatus()),
		"failure", failureText(e),
		"reward", formatFloat(e.GetTotalReward()),
		"from", e.GetStartCheckpointId(),
		"parent", e.GetParentEpisodeId(),
	); err != nil {
		return err
	}
	t := newTable(w, "STEP", "ACTION", "RESULT", "REWARD", "DONE", "FROM")
	for _, s := range m.GetSteps() {
		done := ""
		switch {
		case s.GetTerminated():
			done = "terminated"
		case s.GetTruncated():
			done = "truncated"
		}
		from := ""
		if s.GetInherited() {
			from = "inherited from " + s.GetEpisodeId()
		}
		t.row(strconv.Itoa(int(s.GetStepIndex())), summarizeAction(s.GetAction()), summarizeObservation(s.GetObservation()),
			formatFloat(s.GetReward()), orDash(done), orDash(from))
	}
	if err := t.flush(); err != nil {
		return err
	}
	for _, r := range e.GetRewards() {
		fmt.Fprintf(w, "reward %s = %s (source %s)\n", r.GetName(), formatFloat(r.GetValue()), r.GetSource())
	}
	return nil
}

func runAdvantages(ctx context.Context, a *app, fs *flag.FlagSet, args []string) error {
	source := fs.String("source", "", "reward source (default: the verifier's reward)")
	pos, _, err := parseArgs(fs, args)
	if err != nil {
		return err
	}
	if err := wantArgs(pos, 1, 1, "GROUP"); err != nil {
		return err
	}
	c, err := a.dial()
	if err != nil {
		return err
	}
	defer c.Close()
	res, err := c.GroupAdvantages(ctx, pos[0], *source)
	if err != nil {
		return err
	}
	if a.json {
		return printJSON(a.stdout, res)
	}
	return printAdvantages(a.stdout, res)
}

func printAdvantages(w io.Writer, m *deltagymv1.GetGroupAdvantagesResponse) error {
	t := newTable(w, "EPISODE", "REWARD", "ADVANTAGE", "COUNTED")
	for _, adv := range m.GetAdvantages() {
		counted := "yes"
		if !adv.GetCounted() {
			counted = "no: " + orDash(adv.GetReason())
		}
		t.row(adv.GetEpisodeId(), formatFloat(adv.GetReward()), formatFloat(adv.GetAdvantage()), counted)
	}
	if err := t.flush(); err != nil {
		return err
	}
	_, err := fmt.Fprintf(w, "counted %d, mean %s, std %s\n", m.GetCountedCount(), formatFloat(m.GetMean()), formatFloat(m.GetStd()))
	return err
}
