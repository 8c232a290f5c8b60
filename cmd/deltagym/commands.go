package main

import (
	"cmp"
	"context"
	"errors"
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

type envsCmd struct{}

func (*envsCmd) Run(ctx context.Context, a *app) error {
	c, err := a.dial(ctx)
	if err != nil {
		return err
	}
	defer c.Close()
	node, err := c.any()
	if err != nil {
		return err
	}
	res, err := node.EnvService().ListEnvs(ctx, connect.NewRequest(&deltagymv1.ListEnvsRequest{}))
	if err != nil {
		return err
	}
	if a.JSON {
		return printJSON(a.stdout, res.Msg)
	}
	return printEnvs(a.stdout, res.Msg)
}

func printEnvs(w io.Writer, m *deltagymv1.ListEnvsResponse) error {
	t := newTable(w, "NAME", "WARM", "ACTIVE", "IMAGE", "DESCRIPTION")
	var notes []string
	for _, e := range m.GetEnvs() {
		s := e.GetSpec()
		warm := strconv.Itoa(int(e.GetWarmCount()))
		switch {
		case e.GetNotReady() != "":
			warm = "broken"
			notes = append(notes, fmt.Sprintf("env %s is not ready: %s", s.GetName(), e.GetNotReady()))
		case e.GetWaitingForCapacity() != "":
			warm = "waiting"
			notes = append(notes, fmt.Sprintf("env %s is waiting for capacity (its setup is retried): %s", s.GetName(), e.GetWaitingForCapacity()))
		}
		t.row(s.GetName(), warm, strconv.Itoa(int(e.GetActiveCount())),
			orDash(s.GetImage()), orDash(shortText(s.GetDescription(), 60)))
	}
	if err := t.flush(); err != nil {
		return err
	}
	for _, n := range notes {
		if _, err := fmt.Fprintln(w, n); err != nil {
			return err
		}
	}
	return nil
}

type resetCmd struct {
	Env            string            `arg:"" help:"the env to take a sandbox of"`
	Seed           *int64            `placeholder:"N" help:"seed handed to the reset hook (an integer)"`
	Option         map[string]string `mapsep:"none" placeholder:"KEY=VALUE" help:"task option handed to the reset hook (repeatable)"`
	RunName        string            `name:"run" help:"run the episode belongs to"`
	Group          string            `help:"group (GRPO) the episode belongs to"`
	IdempotencyKey string            `help:"idempotency key (default: a random one, so retries are safe)"`
	LeaseTTL       seconds           `name:"lease-ttl" placeholder:"DURATION" help:"how long the sandbox lives without a call or heartbeat: a duration (90s, 2h) or seconds (default: the server's --lease-ttl; at most its --max-lease-ttl)"`
	Quiet          bool              `short:"q" name:"quiet" help:"print only the sandbox ID"`
}

func (r *resetCmd) Run(ctx context.Context, a *app) error {
	req := &deltagymv1.ResetRequest{Env: r.Env, Run: r.RunName, GroupId: r.Group, IdempotencyKey: r.IdempotencyKey, Seed: r.Seed,
		LeaseTtlSeconds: time.Duration(r.LeaseTTL).Seconds()}
	if len(r.Option) > 0 {
		req.Options = r.Option
	}
	if req.IdempotencyKey == "" {
		req.IdempotencyKey = deltagym.NewIdempotencyKey()
	}
	c, err := a.dial(ctx)
	if err != nil {
		return err
	}
	defer c.Close()
	env, err := c.place()
	if err != nil {
		return err
	}
	res, err := env.Reset(ctx, connect.NewRequest(req))
	if err != nil {
		return err
	}
	switch {
	case a.JSON:
		return printJSON(a.stdout, res.Msg)
	case r.Quiet:
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

type execCmd struct {
	Sandbox    string            `arg:"" help:"the sandbox to run the command in"`
	Command    []string          `arg:"" sep:"none" help:"the command: one word is a shell string, several an argv (after --, so that its flags stay its own)"`
	Session    string            `help:"persistent bash session to run the command in"`
	Background bool              `help:"start the command in the background and return its pid"`
	Timeout    seconds           `placeholder:"DURATION" help:"wall-time limit of the command: a duration (1.5s, 2m) or seconds (default: the env's step timeout)"`
	Cwd        string            `placeholder:"DIR" help:"working directory inside the sandbox"`
	Env        map[string]string `mapsep:"none" placeholder:"KEY=VALUE" help:"environment variable for the command (repeatable)"`
	Stdin      string            `placeholder:"FILE" help:"file to give the command as standard input (- for this process's stdin)"`
	Checkpoint bool              `help:"checkpoint the state after the command and print its ID on stderr (stdout is the command's; --json has it as checkpointId)"`
	Setup      bool              `help:"run it as a setup step: recorded as any step, counted against none of the env's budgets"`
}

func (e *execCmd) Run(ctx context.Context, a *app) error {
	action := &deltagymv1.ExecAction{Cwd: e.Cwd, Session: e.Session, Background: e.Background, TimeoutSeconds: time.Duration(e.Timeout).Seconds()}
	if len(e.Env) > 0 {
		action.Env = e.Env
	}
	if err := setCommand(action, e.Command); err != nil {
		return err
	}
	if e.Stdin != "" {
		b, err := readInput(a.stdin, e.Stdin)
		if err != nil {
			return err
		}
		action.Stdin = b
	}
	c, err := a.dial(ctx)
	if err != nil {
		return err
	}
	defer c.Close()
	env, err := c.owner(e.Sandbox)
	if err != nil {
		return err
	}
	res, err := env.Step(ctx, connect.NewRequest(&deltagymv1.StepRequest{
		SandboxId: e.Sandbox, Action: &deltagymv1.Action{Kind: &deltagymv1.Action_Exec{Exec: action}}, Checkpoint: e.Checkpoint, Setup: e.Setup,
	}))
	if err != nil {
		return err
	}
	if a.JSON {
		err = printJSON(a.stdout, res.Msg)
	} else if e := res.Msg.GetObservation().GetError(); e != nil {
		// As a shell says of a command it cannot run: 127 not found, 126 otherwise.
		status := commandExit(126)
		if e.GetErrnoName() == "ENOENT" {
			status = 127
		}
		return observedError(a.stderr, res.Msg, status)
	} else {
		err = printExec(a.stdout, a.stderr, res.Msg)
	}
	if err != nil {
		return err
	}
	return commandStatus(res.Msg.GetObservation().GetExec())
}

// observedError reports an action that the sandbox's own state refused (the observation's
// error) on stderr, with the step's notes, and returns status, the CLI's exit status.
func observedError(stderr io.Writer, m *deltagymv1.StepResponse, status commandExit) error {
	e := m.GetObservation().GetError()
	notes := append([]string{fmt.Sprintf("%s (%s)", e.GetMessage(), e.GetErrnoName())}, stepNotes(m)...)
	fmt.Fprintf(stderr, "deltagym: %s\n", strings.Join(notes, "; "))
	return status
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

type writeCmd struct {
	Sandbox string `arg:"" help:"the sandbox to write in"`
	Path    string `arg:"" help:"the file's path inside the sandbox"`
	From    string `default:"-" placeholder:"FILE" help:"file to copy into the sandbox (- for standard input, the default)"`
	Mode    string `placeholder:"0644" help:"permission bits of a new file, in octal (default 0644)"`
	Append  bool   `help:"append instead of replacing"`
}

func (wc *writeCmd) Run(ctx context.Context, a *app) error {
	action := &deltagymv1.WriteFileAction{Path: wc.Path, Append: wc.Append}
	if wc.Mode != "" {
		m, err := strconv.ParseUint(wc.Mode, 8, 32)
		if err != nil || m > 0o7777 {
			return usageErrorf("--mode %q is not an octal permission", wc.Mode)
		}
		action.Mode = uint32(m)
	}
	var err error
	if action.Content, err = readInput(a.stdin, wc.From); err != nil {
		return err
	}
	c, err := a.dial(ctx)
	if err != nil {
		return err
	}
	defer c.Close()
	env, err := c.owner(wc.Sandbox)
	if err != nil {
		return err
	}
	res, err := env.Step(ctx, connect.NewRequest(&deltagymv1.StepRequest{
		SandboxId: wc.Sandbox, Action: &deltagymv1.Action{Kind: &deltagymv1.Action_WriteFile{WriteFile: action}},
	}))
	if err != nil {
		return err
	}
	if a.JSON {
		return printJSON(a.stdout, res.Msg)
	}
	if res.Msg.GetObservation().GetError() != nil {
		return observedError(a.stderr, res.Msg, 1)
	}
	fmt.Fprintf(a.stdout, "wrote %d bytes to %s (file size %d)\n", len(action.Content), action.Path, res.Msg.GetObservation().GetWriteFile().GetSize())
	if notes := stepNotes(res.Msg); len(notes) > 0 {
		fmt.Fprintf(a.stderr, "deltagym: %s\n", strings.Join(notes, "; "))
	}
	return nil
}

type readCmd struct {
	Sandbox  string `arg:"" help:"the sandbox to read from"`
	Path     string `arg:"" help:"the file's path inside the sandbox"`
	Offset   int64  `placeholder:"N" help:"byte offset to start at"`
	MaxBytes int64  `placeholder:"N" help:"most bytes to read (default: the env's output cap)"`
}

func (r *readCmd) Run(ctx context.Context, a *app) error {
	c, err := a.dial(ctx)
	if err != nil {
		return err
	}
	defer c.Close()
	env, err := c.owner(r.Sandbox)
	if err != nil {
		return err
	}
	res, err := env.Step(ctx, connect.NewRequest(&deltagymv1.StepRequest{
		SandboxId: r.Sandbox, Action: &deltagymv1.Action{Kind: &deltagymv1.Action_ReadFile{ReadFile: &deltagymv1.ReadFileAction{
			Path: r.Path, Offset: r.Offset, MaxBytes: r.MaxBytes,
		}}},
	}))
	if err != nil {
		return err
	}
	if a.JSON {
		return printJSON(a.stdout, res.Msg)
	}
	if res.Msg.GetObservation().GetError() != nil {
		return observedError(a.stderr, res.Msg, 1)
	}
	rf := res.Msg.GetObservation().GetReadFile()
	if _, err := a.stdout.Write(rf.GetContent()); err != nil {
		return err
	}
	if rf.GetTruncated() {
		fmt.Fprintf(a.stderr, "deltagym: printed %d of %d bytes from offset %d; use --offset to read on\n", len(rf.GetContent()), rf.GetSize(), r.Offset)
	}
	return nil
}

// processModes are the values of checkpoint --processes ("": the env's).
var processModes = map[string]deltagymv1.ProcessMode{
	"":         deltagymv1.ProcessMode_PROCESS_MODE_UNSPECIFIED,
	"template": deltagymv1.ProcessMode_PROCESS_MODE_TEMPLATE,
	"criu":     deltagymv1.ProcessMode_PROCESS_MODE_CRIU,
	"files":    deltagymv1.ProcessMode_PROCESS_MODE_FILESYSTEM,
	// The API's name, which the server's messages use.
	"filesystem": deltagymv1.ProcessMode_PROCESS_MODE_FILESYSTEM,
}

type checkpointCmd struct {
	Sandbox   string `arg:"" help:"the sandbox to checkpoint"`
	Durable   bool   `help:"save processes kept as templates as CRIU images at once, so the checkpoint keeps them whatever happens to the sandbox (closed, reaped, its init killed) or the server"`
	Processes string `predictor:"processes" placeholder:"template|criu|files" help:"how to capture live processes: template (frozen copies, restorable in this sandbox; process trees go to CRIU), criu (CRIU images, restorable anywhere, forks carry them) or files (none; also filesystem); default: the env's"`
	Quiet     bool   `short:"q" name:"quiet" help:"print only the checkpoint ID"`
	Wait      bool   `name:"wait-digest" help:"wait for the checkpoint's state digest and print it"`
	Dedupe    bool   `help:"answer with an existing checkpoint of the env holding the same state, if there is one, instead of keeping a second copy (implies --wait-digest)"`
}

func (ck *checkpointCmd) Run(ctx context.Context, a *app) error {
	mode, ok := processModes[ck.Processes]
	if !ok {
		return usageErrorf("--processes %q: want template, criu or files", ck.Processes)
	}
	c, err := a.dial(ctx)
	if err != nil {
		return err
	}
	defer c.Close()
	env, err := c.owner(ck.Sandbox)
	if err != nil {
		return err
	}
	res, err := env.Checkpoint(ctx, connect.NewRequest(&deltagymv1.CheckpointRequest{SandboxId: ck.Sandbox, Durable: ck.Durable, ProcessMode: mode,
		WaitForDigest: ck.Wait, Dedupe: ck.Dedupe}))
	if err != nil {
		return err
	}
	switch {
	case a.JSON:
		return printJSON(a.stdout, res.Msg)
	case ck.Quiet:
		_, err := fmt.Fprintln(a.stdout, res.Msg.GetCheckpointId())
		return err
	}
	if err := printCheckpoint(a.stdout, res.Msg, ck.Durable); err != nil {
		return err
	}
	if mode == deltagymv1.ProcessMode_PROCESS_MODE_FILESYSTEM {
		err = fields(a.stdout, "processes", "not captured (--processes files): restores and forks of it start none of the sandbox's running processes")
	}
	return err
}

// printCheckpoint prints checkpoint m; durable says it was asked for, so a
// process left unsaved is a failure to report, not the default.
func printCheckpoint(w io.Writer, m *deltagymv1.CheckpointResponse, durable bool) error {
	var unsaved []*deltagymv1.ProcessCapture
	for _, p := range m.GetProcesses() {
		if !p.GetSaved() {
			unsaved = append(unsaved, p)
		}
	}
	state := "yes"
	switch {
	case m.GetDurable():
	case durable && len(unsaved) == 1:
		state = "no: a process could not be saved (below)"
	case durable:
		state = fmt.Sprintf("no: %d processes could not be saved (below)", len(unsaved))
	default:
		state = "no (frozen copies in the sandbox; --durable saves them as CRIU images)"
	}
	if err := fields(w,
		"checkpoint", m.GetCheckpointId(),
		"parent", m.GetParentId(),
		"depth", strconv.Itoa(int(m.GetDepth())),
		"durable", state,
		"digest", m.GetDigest().GetFiles(),
		"processes digest", m.GetDigest().GetProcesses(),
	); err != nil {
		return err
	}
	if m.GetDeduplicated() {
		if _, err := fmt.Fprintf(w, "deduplicated: %s (an existing checkpoint of the env holds this state; the sandbox descends from it)\n", m.GetCheckpointId()); err != nil {
			return err
		}
	}
	if len(m.GetProcesses()) == 0 {
		return nil
	}
	t := newTable(w, "PID", "CAPTURE", "SAVED", "COMMAND", "REASON")
	for _, p := range m.GetProcesses() {
		t.row(strconv.Itoa(int(p.GetPid())), strings.ToLower(strings.TrimPrefix(p.GetMethod().String(), "CAPTURE_METHOD_")),
			yesNo(p.GetSaved()), shortText(p.GetCommand(), 40), orDash(oneLine(p.GetReason())))
	}
	if err := t.flush(); err != nil {
		return err
	}
	if !durable {
		return nil
	}
	for _, p := range unsaved {
		if _, err := fmt.Fprintf(w, "not saved: pid %d (%s): %s\n", p.GetPid(), shortText(p.GetCommand(), 40), oneLine(p.GetUnsavedReason())); err != nil {
			return err
		}
	}
	return nil
}

type restoreCmd struct {
	Sandbox      string `arg:"" help:"the sandbox to restore"`
	Checkpoint   string `arg:"" help:"the checkpoint to restore it to"`
	FreshEntropy bool   `help:"give the restored processes new randomness (/run/deltagym/fork-seed, sessions' $RANDOM)"`
}

func (r *restoreCmd) Run(ctx context.Context, a *app) error {
	c, err := a.dial(ctx)
	if err != nil {
		return err
	}
	defer c.Close()
	env, err := c.owner(r.Sandbox)
	if err != nil {
		return err
	}
	res, err := env.Restore(ctx, connect.NewRequest(&deltagymv1.RestoreRequest{SandboxId: r.Sandbox, CheckpointId: r.Checkpoint, FreshEntropy: r.FreshEntropy}))
	if err != nil {
		return err
	}
	if a.JSON {
		return printJSON(a.stdout, res.Msg)
	}
	return fields(a.stdout, "episode", res.Msg.GetEpisodeId(), "next step", strconv.Itoa(int(res.Msg.GetNextStepIndex())))
}

type forkCmd struct {
	Source         string  `arg:"" optional:"" help:"the checkpoint to fork from, or a sandbox (sb-…) whose current state to fork"`
	Checkpoint     string  `placeholder:"ID" help:"checkpoint to fork from"`
	Sandbox        string  `placeholder:"ID" help:"sandbox whose current state to fork (checkpointed first)"`
	N              int     `short:"n" name:"count" default:"1" placeholder:"N" help:"number of sandboxes to create (default ${default})"`
	Group          string  `help:"group (GRPO) of the new episodes"`
	RunName        string  `name:"run" help:"run of the new episodes (default: the source's)"`
	IdempotencyKey string  `help:"idempotency key (default: a random one, so retries are safe)"`
	FreshEntropy   bool    `help:"give each child distinct randomness"`
	LeaseTTL       seconds `name:"lease-ttl" placeholder:"DURATION" help:"how long each child lives without a call or heartbeat, as reset's --lease-ttl"`
	Quiet          bool    `short:"q" name:"quiet" help:"print only the new sandbox IDs, one per line"`
}

func (f *forkCmd) Help() string {
	return "Give the source as an argument (a checkpoint, or a sandbox: sb-…) or with --checkpoint or --sandbox."
}

func (f *forkCmd) Run(ctx context.Context, a *app) error {
	ckpt, sandbox := f.Checkpoint, f.Sandbox
	if f.Source != "" { // fork CK (as restore SB CK takes it), or fork SB
		if ckpt != "" || sandbox != "" {
			return usageErrorf("give the checkpoint as an argument or with --checkpoint or --sandbox, not both")
		}
		if strings.HasPrefix(f.Source, "sb-") {
			sandbox = f.Source
		} else {
			ckpt = f.Source
		}
	}
	req := &deltagymv1.ForkRequest{GroupId: f.Group, Run: f.RunName, IdempotencyKey: f.IdempotencyKey, FreshEntropy: f.FreshEntropy,
		LeaseTtlSeconds: time.Duration(f.LeaseTTL).Seconds()}
	switch {
	case (ckpt == "") == (sandbox == ""):
		return usageErrorf("give exactly one of --checkpoint and --sandbox")
	case ckpt != "":
		req.Source = &deltagymv1.ForkRequest_CheckpointId{CheckpointId: ckpt}
	default:
		req.Source = &deltagymv1.ForkRequest_SandboxId{SandboxId: sandbox}
	}
	if f.N < 1 || f.N > 1<<20 {
		return usageErrorf("-n %d: want at least 1", f.N)
	}
	req.N = int32(f.N)
	if req.IdempotencyKey == "" {
		req.IdempotencyKey = deltagym.NewIdempotencyKey()
	}
	c, err := a.dial(ctx)
	if err != nil {
		return err
	}
	defer c.Close()
	var res *connect.Response[deltagymv1.ForkResponse]
	var partErr error // a cluster's fork: the parts that failed, beside the children made
	if c.cluster != nil && ckpt != "" {
		// A checkpoint's children spread over the nodes, as the cluster client's Fork spreads them.
		res, partErr = clusterFork(ctx, c.cluster, ckpt, f, req.GetIdempotencyKey())
		if res == nil {
			return partErr
		}
	} else {
		env, err := c.owner(cmp.Or(ckpt, sandbox))
		if err != nil {
			return err
		}
		if res, err = env.Fork(ctx, connect.NewRequest(req)); err != nil {
			return err
		}
	}
	return errors.Join(f.print(a, res.Msg), partErr)
}

// print prints a Fork's answer as the command's flags ask.
func (f *forkCmd) print(a *app, m *deltagymv1.ForkResponse) error {
	switch {
	case a.JSON:
		return printJSON(a.stdout, m)
	case f.Quiet:
		for _, id := range m.GetSandboxIds() {
			fmt.Fprintln(a.stdout, id)
		}
		// Processes the children run without are worth a word even here.
		for _, p := range m.GetProcesses() {
			if p.GetMethod() == deltagymv1.CaptureMethod_CAPTURE_METHOD_NONE {
				fmt.Fprintf(a.stderr, "deltagym: pid %d (%s): %s\n", p.GetPid(), p.GetCommand(), oneLine(p.GetReason()))
			}
		}
		return nil
	}
	return printFork(a.stdout, m)
}

// clusterFork forks checkpoint ckpt over the cluster's nodes (deltagym.Cluster.Fork) and
// answers as one node's Fork would: the children's sandboxes and episodes, in order.
func clusterFork(ctx context.Context, cl *deltagym.Cluster, ckpt string, f *forkCmd, key string) (*connect.Response[deltagymv1.ForkResponse], error) {
	opts := []deltagym.EpisodeOption{deltagym.WithGroup(f.Group), deltagym.WithRun(f.RunName), deltagym.WithIdempotencyKey(key),
		deltagym.WithLeaseTTL(time.Duration(f.LeaseTTL))}
	if f.FreshEntropy {
		opts = append(opts, deltagym.WithFreshEntropy())
	}
	fr, err := cl.Fork(ctx, ckpt, f.N, opts...)
	if fr == nil {
		return nil, err
	}
	m := &deltagymv1.ForkResponse{CheckpointId: cmp.Or(fr.CheckpointID, ckpt)}
	for _, s := range fr.Sandboxes {
		m.SandboxIds = append(m.SandboxIds, s.ID())
		m.EpisodeIds = append(m.EpisodeIds, s.EpisodeID())
	}
	return connect.NewResponse(m), err
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

type releaseCmd struct {
	Checkpoint string `arg:"" help:"the checkpoint to release"`
}

func (r *releaseCmd) Run(ctx context.Context, a *app) error {
	c, err := a.dial(ctx)
	if err != nil {
		return err
	}
	defer c.Close()
	env, err := c.owner(r.Checkpoint)
	if err != nil {
		return err
	}
	res, err := env.ReleaseCheckpoint(ctx, connect.NewRequest(&deltagymv1.ReleaseCheckpointRequest{CheckpointId: r.Checkpoint}))
	if err != nil {
		return err
	}
	if a.JSON {
		return printJSON(a.stdout, res.Msg)
	}
	_, err = fmt.Fprintf(a.stdout, "released %s\n", r.Checkpoint)
	return err
}

type evaluateCmd struct {
	Sandbox string `arg:"" help:"the sandbox to evaluate"`
}

func (e *evaluateCmd) Run(ctx context.Context, a *app) error {
	c, err := a.dial(ctx)
	if err != nil {
		return err
	}
	defer c.Close()
	env, err := c.owner(e.Sandbox)
	if err != nil {
		return err
	}
	res, err := env.Evaluate(ctx, connect.NewRequest(&deltagymv1.EvaluateRequest{SandboxId: e.Sandbox}))
	if err != nil {
		return err
	}
	if a.JSON {
		return printJSON(a.stdout, res.Msg)
	}
	return printEvaluate(a.stdout, res.Msg)
}

// printEvaluate prints Evaluate's verdict, with the verifier's time if it ran: a state the
// server refused to judge (its output says why) took none.
func printEvaluate(w io.Writer, m *deltagymv1.EvaluateResponse) error {
	note := ""
	if d := m.GetDurationSeconds(); d > 0 {
		note = "took " + formatSeconds(d)
	}
	return printVerdict(w, m.GetReward(), m.GetComponents(), m.GetOutput(), note)
}

// printVerdict prints a verifier's reward, with note in parentheses if there is one,
// components and output.
func printVerdict(w io.Writer, reward float64, components map[string]float64, output, note string) error {
	r := formatFloat(reward)
	if note != "" {
		r += " (" + note + ")"
	}
	if err := fields(w, "reward", r, "components", formatComponents(components)); err != nil {
		return err
	}
	if output != "" {
		fmt.Fprintf(w, "verifier output:\n%s", ensureNewline(indent(output)))
	}
	return nil
}

type submitCmd struct {
	Sandbox string  `arg:"" help:"the sandbox whose episode to end"`
	Answer  *string `arg:"" optional:"" help:"the answer handed to the verifier"`
}

func (sc *submitCmd) Run(ctx context.Context, a *app) error {
	action := &deltagymv1.SubmitAction{Answer: sc.Answer}
	c, err := a.dial(ctx)
	if err != nil {
		return err
	}
	defer c.Close()
	env, err := c.owner(sc.Sandbox)
	if err != nil {
		return err
	}
	res, err := env.Step(ctx, connect.NewRequest(&deltagymv1.StepRequest{
		SandboxId: sc.Sandbox, Action: &deltagymv1.Action{Kind: &deltagymv1.Action_Submit{Submit: action}},
	}))
	if err != nil {
		return err
	}
	if a.JSON {
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

type closeCmd struct {
	Sandboxes []string `arg:"" name:"sandbox" sep:"none" help:"the sandboxes to close"`
}

func (cc *closeCmd) Run(ctx context.Context, a *app) error {
	c, err := a.dial(ctx)
	if err != nil {
		return err
	}
	defer c.Close()
	var errs []error
	for _, id := range cc.Sandboxes {
		env, err := c.owner(id)
		if err != nil {
			errs = append(errs, err)
			continue
		}
		res, err := env.Close(ctx, connect.NewRequest(&deltagymv1.CloseRequest{SandboxId: id}))
		switch {
		case err != nil:
			errs = append(errs, fmt.Errorf("%s: %w", id, err))
		case a.JSON:
			if err := printJSON(a.stdout, res.Msg); err != nil {
				return err
			}
		default:
			fmt.Fprintf(a.stdout, "closed %s\n", id)
		}
	}
	return errors.Join(errs...)
}

type sandboxesCmd struct {
	Env     string `help:"only sandboxes of this env"`
	RunName string `name:"run" help:"only sandboxes of this run"`
	Group   string `help:"only sandboxes of this group"`
}

func (sc *sandboxesCmd) Run(ctx context.Context, a *app) error {
	c, err := a.dial(ctx)
	if err != nil {
		return err
	}
	defer c.Close()
	sandboxes, lerr := c.listSandboxes(ctx, deltagym.SandboxFilter{Env: sc.Env, Run: sc.RunName, Group: sc.Group})
	if sandboxes == nil && lerr != nil {
		return lerr
	}
	if a.JSON {
		return errors.Join(printJSON(a.stdout, &deltagymv1.ListSandboxesResponse{Sandboxes: sandboxes}), lerr)
	}
	now := time.Now()
	t := newTable(a.stdout, "SANDBOX", "ENV", "STATE", "EPISODE", "STEP", "RUN", "GROUP", "LEASE")
	for _, s := range sandboxes {
		t.row(s.GetSandboxId(), s.GetEnv(), sandboxState(s.GetState()), orDash(s.GetEpisodeId()),
			strconv.Itoa(int(s.GetNextStepIndex())), orDash(s.GetRun()), orDash(s.GetGroupId()), orDash(formatLease(s.GetLeaseExpireTime(), now)))
	}
	return errors.Join(t.flush(), lerr) // what the nodes that answered hold, then what failed
}

type checkpointsCmd struct {
	Env     string `help:"only checkpoints of this env"`
	RunName string `name:"run" help:"only checkpoints taken in episodes of this run"`
	Group   string `help:"only checkpoints taken in episodes of this group"`
	Episode string `help:"only checkpoints taken in this episode"`
}

func (cc *checkpointsCmd) Run(ctx context.Context, a *app) error {
	c, err := a.dial(ctx)
	if err != nil {
		return err
	}
	defer c.Close()
	checkpoints, lerr := c.listCheckpoints(ctx, deltagym.CheckpointFilter{Env: cc.Env, Run: cc.RunName, Group: cc.Group, Episode: cc.Episode})
	if checkpoints == nil && lerr != nil {
		return lerr
	}
	if a.JSON {
		return errors.Join(printJSON(a.stdout, &deltagymv1.ListCheckpointsResponse{Checkpoints: checkpoints}), lerr)
	}
	now := time.Now()
	t := newTable(a.stdout, "CHECKPOINT", "ENV", "EPISODE", "STEP", "CREATED", "BYTES", "PROCS", "DIGEST", "HELD BY")
	for _, k := range checkpoints {
		t.row(k.GetCheckpointId(), k.GetEnv(), orDash(k.GetEpisodeId()), strconv.Itoa(int(k.GetStepIndex())), formatTime(k.GetCreateTime()),
			strconv.FormatInt(k.GetSizeBytes(), 10), strconv.Itoa(int(k.GetProcesses())), shortDigest(k.GetDigest()), checkpointHold(k, now))
	}
	return errors.Join(t.flush(), lerr)
}

// shortDigest is state digest d in short: the first 12 hex digits of its files' digest, with
// "+p" when it has a processes' digest (the checkpoint holds processes); "-" until computed.
func shortDigest(d *deltagymv1.StateDigest) string {
	files := strings.TrimPrefix(d.GetFiles(), "sha256:")
	if files == "" {
		return "-"
	}
	short := files[:min(12, len(files))]
	if d.GetProcesses() != "" {
		short += "+p"
	}
	return short
}

// checkpointHold says what keeps checkpoint k: its pool, live sandboxes descending from it, or
// the time left before the TTL releases it.
func checkpointHold(k *deltagymv1.CheckpointSummary, now time.Time) string {
	switch {
	case k.GetPinned():
		return "its env (pinned)"
	case k.GetLiveDescendants() > 0:
		return fmt.Sprintf("%d live sandboxes", k.GetLiveDescendants())
	case k.GetExpireTime() != nil:
		return formatLease(k.GetExpireTime(), now)
	}
	return "-"
}

type episodesCmd struct {
	RunName string `name:"run" help:"only episodes of this run"`
	Group   string `help:"only episodes of this group"`
	Env     string `help:"only episodes of this env"`
	Limit   int    `default:"100" placeholder:"N" help:"most episodes to print (0: all; default ${default})"`
}

func (ec *episodesCmd) Run(ctx context.Context, a *app) error {
	limit := ec.Limit
	if limit < 0 {
		return usageErrorf("--limit %d: want 0 or more", limit)
	}
	c, err := a.dial(ctx)
	if err != nil {
		return err
	}
	defer c.Close()
	pageSize := 1000 // the server's largest page
	if limit > 0 {
		pageSize = min(limit+1, pageSize) // one more tells whether there are more
	}
	var episodes []*deltagymv1.Episode
	more := false
	led, err := c.any()
	if err != nil {
		return err
	}
	for e, err := range led.Episodes(ctx, deltagym.EpisodeFilter{Run: ec.RunName, Group: ec.Group, Env: ec.Env, PageSize: pageSize}) {
		if err != nil {
			return err
		}
		if limit > 0 && len(episodes) == limit {
			more = true
			break
		}
		episodes = append(episodes, e)
	}
	if more {
		fmt.Fprintf(a.stderr, "deltagym: showing the oldest %d; there are more (--limit 0 lists them all)\n", limit)
	}
	if a.JSON {
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

type trajectoryCmd struct {
	Episode string `arg:"" help:"the episode to print"`
}

func (tc *trajectoryCmd) Run(ctx context.Context, a *app) error {
	c, err := a.dial(ctx)
	if err != nil {
		return err
	}
	defer c.Close()
	led, err := c.any()
	if err != nil {
		return err
	}
	res, err := led.Trajectory(ctx, tc.Episode)
	if err != nil {
		return err
	}
	if a.JSON {
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

type advantagesCmd struct {
	Group  string `arg:"" help:"the group (GRPO)"`
	Source string `help:"reward source (default: the verifier's reward)"`
}

func (ac *advantagesCmd) Run(ctx context.Context, a *app) error {
	c, err := a.dial(ctx)
	if err != nil {
		return err
	}
	defer c.Close()
	led, err := c.any()
	if err != nil {
		return err
	}
	res, err := led.GroupAdvantages(ctx, ac.Group, ac.Source)
	if err != nil {
		return err
	}
	if a.JSON {
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

// yesNo prints a flag.
func yesNo(b bool) string {
	if b {
		return "yes"
	}
	return "no"
}
