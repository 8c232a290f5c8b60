package main

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"io"
	"maps"
	"net"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	"connectrpc.com/connect"
	"golang.org/x/sys/unix"
	"google.golang.org/protobuf/types/known/timestamppb"

	deltagymv1 "github.com/deltagym/deltagym/clients/go/gen/deltagym/v1"
)

// runCLI runs the CLI in-process and returns its output and exit status.
func runCLI(t *testing.T, stdin string, args ...string) (stdout, stderr string, code int) {
	t.Helper()
	var out, errb bytes.Buffer
	code = Main(t.Context(), args, strings.NewReader(stdin), &out, &errb)
	return out.String(), errb.String(), code
}

// parse parses args with the CLI's grammar, as Main does, without running the command.
func parse(t *testing.T, args ...string) (*app, string, error) {
	t.Helper()
	a := &app{stdin: strings.NewReader(""), stdout: io.Discard, stderr: io.Discard}
	k, err := a.parser(t.Context())
	if err != nil {
		t.Fatal(err)
	}
	kctx, err := k.Parse(args)
	if err != nil {
		return a, "", err
	}
	return a, kctx.Command(), nil
}

// TestGrammar: client flags before or after the command, a command's flags before, after and
// between its arguments, everything after -- an argument, values taken whole (no splitting at
// commas or semicolons), serve's arguments passed through to its own flag set.
func TestGrammar(t *testing.T) {
	tests := []struct {
		name    string
		args    []string
		command string
		check   func(a *app) bool
		wantErr string
	}{
		{name: "flags first", args: []string{"reset", "--seed", "3", "shell"}, command: "reset <env>",
			check: func(a *app) bool { return a.Reset.Env == "shell" && *a.Reset.Seed == 3 }},
		{name: "flags after", args: []string{"reset", "shell", "--seed", "3", "-q"}, command: "reset <env>",
			check: func(a *app) bool { return a.Reset.Env == "shell" && *a.Reset.Seed == 3 && a.Reset.Quiet }},
		{name: "client flags before and after", args: []string{"--addr", "h:1", "reset", "shell", "--json", "--token=t"}, command: "reset <env>",
			check: func(a *app) bool { return a.Addr == "h:1" && a.JSON && a.Token == "t" }},
		{name: "interleaved", args: []string{"restore", "sb", "--fresh-entropy", "ck", "--addr", "h:1"}, command: "restore <sandbox> <checkpoint>",
			check: func(a *app) bool {
				return a.Restore.Sandbox == "sb" && a.Restore.Checkpoint == "ck" && a.Restore.FreshEntropy && a.Addr == "h:1"
			}},
		{name: "dash dash", args: []string{"exec", "sb", "--session", "s", "--", "ls", "-la", "--seed", "9"}, command: "exec <sandbox> <command>",
			check: func(a *app) bool {
				return a.Exec.Sandbox == "sb" && a.Exec.Session == "s" && slices.Equal(a.Exec.Command, []string{"ls", "-la", "--seed", "9"})
			}},
		{name: "dash dash first", args: []string{"exec", "--", "sb", "-q"}, command: "exec <sandbox> <command>",
			check: func(a *app) bool { return a.Exec.Sandbox == "sb" && slices.Equal(a.Exec.Command, []string{"-q"}) }},
		{name: "values whole", args: []string{"exec", "sb", "--env", "K=a,b;c", "--env", "L=", "echo a,b", "c;d"}, command: "exec <sandbox> <command>",
			check: func(a *app) bool {
				return maps.Equal(a.Exec.Env, map[string]string{"K": "a,b;c", "L": ""}) && slices.Equal(a.Exec.Command, []string{"echo a,b", "c;d"})
			}},
		{name: "timeout in seconds", args: []string{"exec", "sb", "--timeout", "1.5", "true"}, command: "exec <sandbox> <command>",
			check: func(a *app) bool { return time.Duration(a.Exec.Timeout) == 1500*time.Millisecond }},
		{name: "timeout as a duration", args: []string{"exec", "sb", "--timeout=2m", "true"}, command: "exec <sandbox> <command>",
			check: func(a *app) bool { return time.Duration(a.Exec.Timeout) == 2*time.Minute }},
		{name: "fork -n", args: []string{"fork", "ck-1", "-n", "3", "-q"}, command: "fork <source>",
			check: func(a *app) bool { return a.Fork.Source == "ck-1" && a.Fork.N == 3 && a.Fork.Quiet }},
		{name: "serve passes its flags through", args: []string{"serve", "--addr", "127.0.0.1:9", "-pool-size", "4", "-h"}, command: "serve <args>",
			check: func(a *app) bool {
				return slices.Equal(a.Serve.Args, []string{"--addr", "127.0.0.1:9", "-pool-size", "4", "-h"}) && a.Addr == ""
			}},
		{name: "submit answer", args: []string{"submit", "sb", "42"}, command: "submit <sandbox> <answer>",
			check: func(a *app) bool { return *a.Submit.Answer == "42" }},
		{name: "unknown flag", args: []string{"reset", "sb", "--nope"}, wantErr: "unknown flag --nope"},
		{name: "missing value", args: []string{"reset", "sb", "--seed"}, wantErr: "--seed: expected"},
		{name: "bad timeout", args: []string{"exec", "sb", "--timeout", "soon", "true"}, wantErr: "want a duration"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			a, command, err := parse(t, tt.args...)
			if tt.wantErr != "" {
				if err == nil || !strings.Contains(err.Error(), tt.wantErr) {
					t.Fatalf("parse(%q) = %q, %v; want an error with %q", tt.args, command, err, tt.wantErr)
				}
				return
			}
			if err != nil || command != tt.command || !tt.check(a) {
				t.Fatalf("parse(%q) = %q, %v; want %q", tt.args, command, err, tt.command)
			}
		})
	}
}

func TestSetCommand(t *testing.T) {
	tests := []struct {
		name    string
		session string
		words   []string
		command string
		argv    []string
		wantErr bool
	}{
		{name: "shell string", words: []string{"echo a | wc -c"}, command: "echo a | wc -c"},
		{name: "argv", words: []string{"ls", "-la", "/"}, argv: []string{"ls", "-la", "/"}},
		{name: "session quotes argv", session: "s", words: []string{"echo", "it's", "a b", "$HOME", "x=1"}, command: `echo 'it'\''s' 'a b' '$HOME' x=1`},
		{name: "session shell string", session: "s", words: []string{"cd /tmp"}, command: "cd /tmp"},
		{name: "empty", words: []string{""}, wantErr: true},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			a := &deltagymv1.ExecAction{Session: tt.session}
			err := setCommand(a, tt.words)
			if tt.wantErr {
				if err == nil {
					t.Fatal("no error")
				}
				return
			}
			if err != nil || a.GetCommand() != tt.command || !slices.Equal(a.GetArgv(), tt.argv) {
				t.Fatalf("setCommand(%q) = command %q argv %q, %v; want %q %q", tt.words, a.GetCommand(), a.GetArgv(), err, tt.command, tt.argv)
			}
		})
	}
}

// closedAddr returns a loopback address nothing listens on.
func closedAddr(t *testing.T) string {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	addr := ln.Addr().String()
	if err := ln.Close(); err != nil {
		t.Fatal(err)
	}
	return addr
}

func TestExitCodes(t *testing.T) {
	down := closedAddr(t)
	tests := []struct {
		name   string
		args   []string
		code   int
		stdout string // substring expected on stdout
		stderr string // substring expected on stderr
	}{
		{name: "no command", args: nil, code: exitUsage, stderr: "Usage: deltagym"},
		{name: "unknown command", args: []string{"frobnicate"}, code: exitUsage, stderr: "unexpected argument frobnicate"},
		{name: "help", args: []string{"help"}, code: exitOK, stdout: "checkpoint"},
		{name: "help flag", args: []string{"-h"}, code: exitOK, stdout: "Commands:"},
		{name: "help command", args: []string{"help", "reset"}, code: exitOK, stdout: "-seed"},
		{name: "help serve", args: []string{"help", "serve"}, code: exitOK, stdout: "-lease-ttl"},
		{name: "serve -h", args: []string{"serve", "-h"}, code: exitOK, stdout: "-lease-ttl"},
		{name: "serve bad flag", args: []string{"serve", "--lease-ttl", "soon"}, code: exitUsage, stderr: "-lease-ttl"},
		{name: "help unknown", args: []string{"help", "frobnicate"}, code: exitUsage, stderr: "unexpected argument frobnicate"},
		{name: "checkpoint bad processes", args: []string{"checkpoint", "sb", "--processes", "all"}, code: exitUsage, stderr: "want template, criu or files"},
		{name: "completion of another shell", args: []string{"completion", "tcsh"}, code: exitUsage, stderr: `"bash","zsh","fish"`},
		{name: "command -h", args: []string{"fork", "-h"}, code: exitOK, stdout: "-checkpoint"},
		{name: "reset without env", args: []string{"reset"}, code: exitUsage, stderr: `expected "<env>"`},
		{name: "reset bad seed", args: []string{"reset", "shell", "--seed", "x"}, code: exitUsage, stderr: "expected a valid 64 bit int"},
		{name: "reset bad option", args: []string{"reset", "shell", "--option", "novalue"}, code: exitUsage, stderr: `expected "<key>=<value>"`},
		{name: "reset two envs", args: []string{"reset", "a", "b"}, code: exitUsage, stderr: "unexpected argument b"},
		{name: "exec without command", args: []string{"exec", "sb"}, code: exitUsage, stderr: `expected "<command> ..."`},
		{name: "fork without source", args: []string{"fork", "-n", "2"}, code: exitUsage, stderr: "exactly one of --checkpoint and --sandbox"},
		{name: "fork with both", args: []string{"fork", "--checkpoint", "c", "--sandbox", "s"}, code: exitUsage, stderr: "exactly one"},
		{name: "fork argument and flag", args: []string{"fork", "c", "--sandbox", "s"}, code: exitUsage, stderr: "not both"},
		{name: "fork two arguments", args: []string{"fork", "c", "d"}, code: exitUsage, stderr: "unexpected argument d"},
		{name: "exec bad timeout", args: []string{"exec", "sb", "--timeout", "soon", "true"}, code: exitUsage, stderr: "want a duration"},
		{name: "restore without checkpoint", args: []string{"restore", "sb"}, code: exitUsage, stderr: `expected "<checkpoint>"`},
		{name: "fork of zero", args: []string{"fork", "--checkpoint", "c", "-n", "0"}, code: exitUsage, stderr: "want at least 1"},
		{name: "write bad mode", args: []string{"write", "sb", "/p", "--mode", "9"}, code: exitUsage, stderr: "octal"},
		{name: "traj csv", args: []string{"traj", "export", "--format", "csv"}, code: exitUsage, stderr: `--format must be one of "jsonl"`},
		{name: "traj unknown", args: []string{"traj", "import"}, code: exitUsage, stderr: `unexpected argument import, did you mean "export"`},
		{name: "db unknown", args: []string{"db", "drop"}, code: exitUsage, stderr: "unexpected argument drop"},
		{name: "bad address", args: []string{"--addr", "nowhere", "envs"}, code: exitUsage, stderr: "bad server address"},
		{name: "server down", args: []string{"envs", "--addr", down}, code: exitError, stderr: "unavailable: "},
		{name: "server down hint", args: []string{"--addr", down, "close", "sb-1"}, code: exitError, stderr: "is a server running at http://" + down},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			stdout, stderr, code := runCLI(t, "", tt.args...)
			if code != tt.code || !strings.Contains(stdout, tt.stdout) || !strings.Contains(stderr, tt.stderr) {
				t.Fatalf("deltagym %q: exit %d, stdout %q, stderr %q; want exit %d, stdout with %q, stderr with %q",
					tt.args, code, stdout, stderr, tt.code, tt.stdout, tt.stderr)
			}
		})
	}
}

func TestPrintExec(t *testing.T) {
	tests := []struct {
		name           string
		res            *deltagymv1.StepResponse
		stdout, stderr string
	}{
		{
			name:   "success is quiet",
			res:    execResponse(&deltagymv1.ExecResult{Stdout: []byte("hi\n"), DurationSeconds: 0.001, Pid: 2}),
			stdout: "hi\n",
		},
		{
			name:   "failure",
			res:    execResponse(&deltagymv1.ExecResult{Stdout: []byte("a"), Stderr: []byte("oops\n"), ExitCode: 3, DurationSeconds: 0.0123}),
			stdout: "a",
			stderr: "oops\ndeltagym: exit 3 in 12.3ms\n",
		},
		{
			name:   "timeout truncated",
			res:    execResponse(&deltagymv1.ExecResult{ExitCode: -1, Signal: 9, TimedOut: true, StdoutTruncated: true, DurationSeconds: 2}),
			stderr: "deltagym: timed out in 2s, stdout truncated\n",
		},
		{
			name:   "killed",
			res:    execResponse(&deltagymv1.ExecResult{ExitCode: -1, Signal: 9, DurationSeconds: 0.0004}),
			stderr: "deltagym: killed by signal 9 in 0.400ms\n",
		},
		{
			name:   "background",
			res:    execResponse(&deltagymv1.ExecResult{ExitCode: -1, Pid: 12}),
			stderr: "deltagym: started in background, pid 12\n",
		},
		{
			name: "checkpoint and truncation",
			res: func() *deltagymv1.StepResponse {
				r := execResponse(&deltagymv1.ExecResult{})
				r.CheckpointId, r.Truncated, r.Reward = "ck-1", true, 0.5
				return r
			}(),
			stderr: "deltagym: checkpoint ck-1; reward 0.5; episode truncated (budget spent)\n",
		},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			var out, errb bytes.Buffer
			if err := printExec(&out, &errb, tt.res); err != nil {
				t.Fatal(err)
			}
			if out.String() != tt.stdout || errb.String() != tt.stderr {
				t.Fatalf("stdout %q stderr %q; want %q %q", out.String(), errb.String(), tt.stdout, tt.stderr)
			}
		})
	}
}

// An action the sandbox's state refused is said on stderr with its errno and the step's notes,
// and gives the CLI's exit status.
func TestObservedError(t *testing.T) {
	var errb bytes.Buffer
	res := &deltagymv1.StepResponse{CheckpointId: "ck-1", Observation: &deltagymv1.Observation{
		Error: &deltagymv1.ActionError{Errno: 6, ErrnoName: "ENXIO", Message: "/tmp/sock: a socket, or a FIFO with no reader: not a regular file"}}}
	err := observedError(&errb, res, 1)
	if want := "deltagym: /tmp/sock: a socket, or a FIFO with no reader: not a regular file (ENXIO); checkpoint ck-1\n"; errb.String() != want || err != commandExit(1) {
		t.Fatalf("stderr %q, err %v; want %q, status 1", errb.String(), err, want)
	}
	if got := summarizeObservation(res.GetObservation()); got != "error ENXIO" {
		t.Fatalf("summary %q", got)
	}
}

func execResponse(e *deltagymv1.ExecResult) *deltagymv1.StepResponse {
	return &deltagymv1.StepResponse{Observation: &deltagymv1.Observation{Kind: &deltagymv1.Observation_Exec{Exec: e}}}
}

func TestPrintTables(t *testing.T) {
	now := time.Date(2026, 11, 30, 12, 0, 0, 0, time.UTC)
	ts := timestamppb.New(now)
	seed := int64(7)
	answer := "42"
	tests := []struct {
		name  string
		print func(w io.Writer) error
		want  string
	}{
		{"envs", func(w io.Writer) error {
			return printEnvs(w, &deltagymv1.ListEnvsResponse{Envs: []*deltagymv1.EnvInfo{
				{Spec: &deltagymv1.EnvSpec{Name: "shell", Image: "default", Description: "A shell.\nMore."}, WarmCount: 4, ActiveCount: 1},
				{Spec: &deltagymv1.EnvSpec{Name: "x"}},
				{Spec: &deltagymv1.EnvSpec{Name: "y", Image: "default"}, NotReady: `env y: setup[0] "false": exited 1: env not ready`},
				{Spec: &deltagymv1.EnvSpec{Name: "z", Image: "default"}, WaitingForCapacity: `creating setup sandbox from image "default": the server's cap "sandboxes" of 2 live sandboxes would be exceeded (2 in use, 1 asked)`},
			}})
		}, "" +
			"NAME   WARM     ACTIVE  IMAGE    DESCRIPTION\n" +
			"shell  4        1       default  A shell.…\n" +
			"x      0        0       -        -\n" +
			"y      broken   0       default  -\n" +
			"z      waiting  0       default  -\n" +
			`env y is not ready: env y: setup[0] "false": exited 1: env not ready` + "\n" +
			`env z is waiting for capacity (its setup is retried): creating setup sandbox from image "default": the server's cap "sandboxes" of 2 live sandboxes would be exceeded (2 in use, 1 asked)` + "\n"},
		{"reset", func(w io.Writer) error {
			return printReset(w, &deltagymv1.ResetResponse{
				SandboxId: "sb-1", EpisodeId: "ep-1", CheckpointId: "ck-1", LeaseExpireTime: timestamppb.New(now.Add(10 * time.Minute)),
				Observation: &deltagymv1.Observation{Kind: &deltagymv1.Observation_Reset_{Reset_: &deltagymv1.ResetResult{
					Task: "Do it.\nWell.", Hook: &deltagymv1.ExecResult{Stdout: []byte("seed=7"), DurationSeconds: 0.002},
				}}},
			}, now)
		}, "" +
			"sandbox     sb-1\n" +
			"episode     ep-1\n" +
			"checkpoint  ck-1\n" +
			"lease       expires in 10m0s\n" +
			"task:\n  Do it.\n  Well.\n" +
			"reset hook: exit 0 in 2.0ms\n  seed=7\n"},
		{"checkpoint", func(w io.Writer) error {
			return printCheckpoint(w, &deltagymv1.CheckpointResponse{CheckpointId: "ck-2", ParentId: "ck-1", Depth: 2,
				Processes: []*deltagymv1.ProcessCapture{{Pid: 5, Command: "python3", Method: deltagymv1.CaptureMethod_CAPTURE_METHOD_TEMPLATE}}}, false)
		}, "" +
			"checkpoint  ck-2\n" +
			"parent      ck-1\n" +
			"depth       2\n" +
			"durable     no (frozen copies in the sandbox; --durable saves them as CRIU images)\n" +
			"PID  CAPTURE   SAVED  COMMAND  REASON\n" +
			"5    template  no     python3  -\n"},
		{"checkpoint durable, one process unsaved", func(w io.Writer) error {
			return printCheckpoint(w, &deltagymv1.CheckpointResponse{CheckpointId: "ck-3", ParentId: "ck-2", Depth: 3,
				Processes: []*deltagymv1.ProcessCapture{
					{Pid: 5, Command: "python3", Method: deltagymv1.CaptureMethod_CAPTURE_METHOD_TEMPLATE, Saved: true},
					{Pid: 9, Command: "vf", Method: deltagymv1.CaptureMethod_CAPTURE_METHOD_TEMPLATE, UnsavedReason: "criu DUMP: it failed"}}}, true)
		}, "" +
			"checkpoint  ck-3\n" +
			"parent      ck-2\n" +
			"depth       3\n" +
			"durable     no: a process could not be saved (below)\n" +
			"PID  CAPTURE   SAVED  COMMAND  REASON\n" +
			"5    template  yes    python3  -\n" +
			"9    template  no     vf       -\n" +
			"not saved: pid 9 (vf): criu DUMP: it failed\n"},
		{"fork", func(w io.Writer) error {
			return printFork(w, &deltagymv1.ForkResponse{SandboxIds: []string{"sb-2", "sb-3"}, EpisodeIds: []string{"ep-2", "ep-3"}, CheckpointId: "ck-1"})
		}, "" +
			"forked 2 sandboxes from checkpoint ck-1\n" +
			"SANDBOX  EPISODE\n" +
			"sb-2     ep-2\n" +
			"sb-3     ep-3\n"},
		{"verdict", func(w io.Writer) error {
			return printEvaluate(w, &deltagymv1.EvaluateResponse{Reward: 1, Components: map[string]float64{"tests": 0.5, "correct": 1}, Output: "ok", DurationSeconds: 0.003})
		}, "" +
			"reward      1 (took 3.0ms)\n" +
			"components  correct=1 tests=0.5\n" +
			"verifier output:\n  ok\n"},
		{"verdict refused", func(w io.Writer) error {
			return printEvaluate(w, &deltagymv1.EvaluateResponse{Output: "deltagym: the agent's state was not judged (reward 0): /tmp/x is a symbolic link\n"})
		}, "" +
			"reward  0\n" +
			"verifier output:\n  deltagym: the agent's state was not judged (reward 0): /tmp/x is a symbolic link\n"},
		{"episodes", func(w io.Writer) error {
			return printEpisodes(w, []*deltagymv1.Episode{
				{EpisodeId: "ep-1", Env: "shell", Run: "r", GroupId: "g", Status: deltagymv1.EpisodeStatus_EPISODE_STATUS_TERMINATED, StepCount: 3, TotalReward: 1, StartTime: ts},
				{EpisodeId: "ep-2", Env: "shell", Status: deltagymv1.EpisodeStatus_EPISODE_STATUS_FAILED, FailureClass: deltagymv1.FailureClass_FAILURE_CLASS_INFRA},
			})
		}, "" +
			"EPISODE  ENV    RUN  GROUP  STATUS          STEPS  REWARD  STARTED\n" +
			"ep-1     shell  r    g      terminated      3      1       2026-11-30 12:00:00\n" +
			"ep-2     shell  -    -      failed (infra)  0      0       -\n"},
		{"trajectory", func(w io.Writer) error {
			return printTrajectory(w, &deltagymv1.GetTrajectoryResponse{
				Episode: &deltagymv1.Episode{EpisodeId: "ep-2", Env: "shell", Seed: &seed, Status: deltagymv1.EpisodeStatus_EPISODE_STATUS_TERMINATED,
					TotalReward: 1, StartCheckpointId: "ck-1", ParentEpisodeId: "ep-1",
					Rewards: []*deltagymv1.ReportedReward{{Name: "judge", Value: 0.5, Source: "llm"}}},
				Steps: []*deltagymv1.TrajectoryStep{
					{StepIndex: 0, EpisodeId: "ep-1", Inherited: true, Action: &deltagymv1.Action{Kind: &deltagymv1.Action_Exec{Exec: &deltagymv1.ExecAction{Command: "echo hi\necho more"}}},
						Observation: execResponse(&deltagymv1.ExecResult{DurationSeconds: 0.001}).GetObservation()},
					{StepIndex: 1, EpisodeId: "ep-2", Action: &deltagymv1.Action{Kind: &deltagymv1.Action_Submit{Submit: &deltagymv1.SubmitAction{Answer: &answer}}},
						Observation: &deltagymv1.Observation{Kind: &deltagymv1.Observation_Submit{Submit: &deltagymv1.SubmitResult{Components: map[string]float64{"correct": 1}}}},
						Reward:      1, Terminated: true},
				},
			})
		}, "" +
			"episode  ep-2\n" +
			"env      shell\n" +
			"seed     7\n" +
			"status   terminated\n" +
			"reward   1\n" +
			"from     ck-1\n" +
			"parent   ep-1\n" +
			"STEP  ACTION         RESULT           REWARD  DONE        FROM\n" +
			"0     exec echo hi…  exit 0 in 1.0ms  0       -           inherited from ep-1\n" +
			"1     submit 42      correct=1        1       terminated  -\n" +
			"reward judge = 0.5 (source llm)\n"},
		{"advantages", func(w io.Writer) error {
			return printAdvantages(w, &deltagymv1.GetGroupAdvantagesResponse{
				Advantages: []*deltagymv1.GroupAdvantage{
					{EpisodeId: "ep-1", Reward: 1, Advantage: 0.70711, Counted: true},
					{EpisodeId: "ep-2", Reason: "still running"},
				}, Mean: 0.5, Std: 0.70711, CountedCount: 1,
			})
		}, "" +
			"EPISODE  REWARD  ADVANTAGE  COUNTED\n" +
			"ep-1     1       0.70711    yes\n" +
			"ep-2     0       0          no: still running\n" +
			"counted 1, mean 0.5, std 0.70711\n"},
		{"failed trajectory", func(w io.Writer) error {
			return printTrajectory(w, &deltagymv1.GetTrajectoryResponse{
				Episode: &deltagymv1.Episode{EpisodeId: "ep-3", Env: "shell", Status: deltagymv1.EpisodeStatus_EPISODE_STATUS_FAILED,
					FailureClass: deltagymv1.FailureClass_FAILURE_CLASS_INFRA, FailureMessage: "its sandbox died (its init exited)"}})
		}, "" +
			"episode  ep-3\n" +
			"env      shell\n" +
			"status   failed\n" +
			"failure  infra: its sandbox died (its init exited)\n" +
			"reward   0\n" +
			"STEP  ACTION  RESULT  REWARD  DONE  FROM\n"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			var b bytes.Buffer
			if err := tt.print(&b); err != nil {
				t.Fatal(err)
			}
			if b.String() != tt.want {
				t.Fatalf("got:\n%s\nwant:\n%s", b.String(), tt.want)
			}
		})
	}
}

// --json writes one line, every field at its zero value too: a script
// finds "durable": false, not a missing key.
func TestPrintJSON(t *testing.T) {
	var b bytes.Buffer
	if err := printJSON(&b, &deltagymv1.CheckpointResponse{CheckpointId: "ck-1",
		Processes: []*deltagymv1.ProcessCapture{{Pid: 5, UnsavedReason: "why"}}}); err != nil {
		t.Fatal(err)
	}
	var got map[string]any
	if err := json.Unmarshal(b.Bytes(), &got); err != nil || strings.Count(b.String(), "\n") != 1 {
		t.Fatalf("printJSON = %q: %v", b.String(), err)
	}
	ps, _ := got["processes"].([]any)
	if got["checkpointId"] != "ck-1" || got["durable"] != false || got["depth"] != float64(0) || len(ps) != 1 || ps[0].(map[string]any)["saved"] != false {
		t.Fatalf("printJSON = %q", b.String())
	}
}

func TestEmbeddedURL(t *testing.T) {
	got, err := embeddedURL("/srv/dg data")
	if err != nil {
		t.Fatal(err)
	}
	want := "postgres:///deltagym?host=%2Fsrv%2Fdg+data%2Fpg%2Fpgsock&user=postgres&sslmode=disable"
	if got != want {
		t.Fatalf("embeddedURL = %q, want %q", got, want)
	}
}

func TestDBURL(t *testing.T) {
	t.Setenv(envDatabaseURL, "")
	data := t.TempDir()
	if stdout, stderr, code := runCLI(t, "", "db", "url", "--data", data); code != exitError || stdout != "" || !strings.Contains(stderr, "no ledger database") || !strings.Contains(stderr, "--data") {
		t.Fatalf("db url of a data directory without a cluster: exit %d, stdout %q, stderr %q", code, stdout, stderr)
	}
	// A cluster that is not running (no server is).
	if err := os.MkdirAll(filepath.Join(pgDir(data), "postgres"), 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(pgDir(data), "postgres", "PG_VERSION"), []byte("15\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	stdout, stderr, code := runCLI(t, "", "db", "url", "--data", data)
	want, _ := embeddedURL(data)
	if code != exitOK || stdout != want+"\n" || !strings.Contains(stderr, "not running") {
		t.Fatalf("db url: exit %d, stdout %q, stderr %q; want %q", code, stdout, stderr, want)
	}
	t.Setenv(envDatabaseURL, "postgres://db.example/x")
	if stdout, _, code := runCLI(t, "", "db", "url"); code != exitOK || stdout != "postgres://db.example/x\n" {
		t.Fatalf("db url from the environment: exit %d, %q", code, stdout)
	}
	if _, stderr, code := runCLI(t, "", "traj", "export", "--database-url", "", "--data", t.TempDir()); code != exitError || !strings.Contains(stderr, "no ledger database") {
		t.Fatalf("traj export without a cluster: exit %d, stderr %q", code, stderr)
	}
}

func TestWriteOutput(t *testing.T) {
	path := filepath.Join(t.TempDir(), "out.jsonl")
	write := func(s string) func(io.Writer) error {
		return func(w io.Writer) error { _, err := io.WriteString(w, s); return err }
	}
	if err := writeOutput(nil, path, write("one\n")); err != nil {
		t.Fatal(err)
	}
	if err := writeOutput(nil, path, func(io.Writer) error { return context.Canceled }); err == nil {
		t.Fatal("a failed write succeeded")
	}
	b, err := os.ReadFile(path)
	if err != nil || string(b) != "one\n" {
		t.Fatalf("file holds %q, %v: a failed write must leave the old content", b, err)
	}
	entries, _ := os.ReadDir(filepath.Dir(path))
	if len(entries) != 1 {
		t.Fatalf("temporary files left: %v", entries)
	}
	var out bytes.Buffer
	if err := writeOutput(&out, "-", write("two\n")); err != nil || out.String() != "two\n" {
		t.Fatalf("stdout got %q, %v", out.String(), err)
	}
}

func writeFile(path, content string) error { return os.WriteFile(path, []byte(content), 0o644) }

// TestServePprofLoopbackOnly: --pprof refuses an address off loopback before anything starts.
func TestServePprofLoopbackOnly(t *testing.T) {
	for _, addr := range []string{"0.0.0.0:6061", "10.1.2.3:6061", "nonsense"} {
		if _, err := servePprof(addr); err == nil || !strings.Contains(err.Error(), "--pprof") {
			t.Fatalf("--pprof %s: %v, want a usage error", addr, err)
		}
	}
	stop, err := servePprof("127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	stop()
}

func TestPurge(t *testing.T) {
	data := t.TempDir()
	store := filepath.Join(data, "sandbox", "store")
	if err := os.MkdirAll(filepath.Join(store, "meta", "checkpoints"), 0o700); err != nil {
		t.Fatal(err)
	}
	// A running server holds the lock on its store.
	lock, err := os.OpenFile(filepath.Join(store, "lock"), os.O_RDWR|os.O_CREATE, 0o600)
	if err != nil {
		t.Fatal(err)
	}
	if err := unix.Flock(int(lock.Fd()), unix.LOCK_EX); err != nil {
		t.Fatal(err)
	}
	if _, stderr, code := runCLI(t, "", "purge", "--data", data); code != exitError || !strings.Contains(stderr, "a server is running on "+data+": stop it first") {
		t.Fatalf("purge under a running server: exit %d, stderr %q", code, stderr)
	}
	if _, err := os.Stat(store); err != nil {
		t.Fatalf("purge under a running server removed its store: %v", err)
	}
	lock.Close()
	if stdout, stderr, code := runCLI(t, "", "purge", "--data", data); code != exitOK || stdout != "purged "+filepath.Join(data, "sandbox")+"\n" {
		t.Fatalf("purge: exit %d, stdout %q, stderr %q", code, stdout, stderr)
	}
	if _, err := os.Stat(filepath.Join(data, "sandbox")); !os.IsNotExist(err) {
		t.Fatalf("purge left %v", err)
	}
	if _, stderr, code := runCLI(t, "", "purge", "extra"); code != exitUsage || !strings.Contains(stderr, "unexpected argument extra") {
		t.Fatalf("purge with an argument: exit %d, stderr %q", code, stderr)
	}
}

// The CLI adds its own flag to the server's advice where the advice is the process mode.
func TestDescribeErrorHints(t *testing.T) {
	a := &app{}
	capture := connect.NewError(connect.CodeFailedPrecondition, errors.New("processes: session \"sh\" cannot be captured: its shell is not the root of its process tree; end it, or checkpoint files only (process mode filesystem)"))
	if got := describeError(capture, a); !strings.Contains(got, "checkpoint --processes files") {
		t.Errorf("a capture refusal: %q", got)
	}
	other := connect.NewError(connect.CodeFailedPrecondition, errors.New("episode ended"))
	if got := describeError(other, a); strings.Contains(got, "--processes") {
		t.Errorf("another refusal got the process-mode hint: %q", got)
	}
}
