package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"sort"
	"strconv"
	"strings"
	"time"

	"connectrpc.com/connect"

	deltagym "github.com/deltagym/deltagym/clients/go/deltagym"
)

// Exit statuses.
const (
	exitOK    = 0
	exitError = 1
	exitUsage = 2
)

// errUsage marks an error in the command line; Main prints it with the
// subcommand's usage and exits with status 2.
var errUsage = errors.New("usage")

func usageErrorf(format string, args ...any) error {
	return fmt.Errorf("%w: %s", errUsage, fmt.Sprintf(format, args...))
}

// app is one invocation of the CLI: its streams and the flags every client
// subcommand shares.
type app struct {
	stdin          io.Reader
	stdout, stderr io.Writer

	addr  string
	token string
	json  bool
}

// command is a subcommand.
type command struct {
	name     string
	args     string // synopsis of the arguments, for usage
	summary  string
	run      func(ctx context.Context, a *app, fs *flag.FlagSet, args []string) error
	noClient bool // no --addr/--token/--json (serve, db url, traj export)
}

// commands is the table of subcommands, in the order usage lists them.
var commands = []command{
	{name: "serve", args: "[server flags]", summary: "run the server in the foreground", run: runServe, noClient: true},
	{name: "envs", summary: "list the env catalog and warm pools", run: runEnvs},
	{name: "register-env", args: "SPEC.json|- [--replace]", summary: "add an env (the JSON of envs/*.json) to the catalog; the server keeps it across restarts", run: runRegisterEnv},
	{name: "import-image", args: "NAME PATH [--format oci|docker|rootfs]", summary: "import an image from the server's import root (--import-root, default <data>/imports; PATH relative to it), for envs to name", run: runImportImage},
	{name: "reset", args: "ENV [--seed N] [--option k=v]... [--run R] [--group G] [-q]", summary: "take a warm sandbox of ENV and start an episode", run: runReset},
	{name: "exec", args: "SANDBOX [--session S | --background] [--timeout D] [--cwd DIR] [--env k=v]... [--stdin FILE|-] [--checkpoint] -- CMD...", summary: "run a command (one word: a shell string; several: argv)", run: runExec},
	{name: "write", args: "SANDBOX PATH [--from FILE|-] [--mode 0644] [--append]", summary: "write a file (from stdin by default)", run: runWrite},
	{name: "read", args: "SANDBOX PATH [--offset N] [--max-bytes N]", summary: "print a file", run: runRead},
	{name: "checkpoint", args: "SANDBOX [--processes template|criu|files] [--durable] [-q]", summary: "checkpoint a sandbox", run: runCheckpoint},
	{name: "restore", args: "SANDBOX CHECKPOINT [--fresh-entropy]", summary: "restore a sandbox to a checkpoint (starts a new episode)", run: runRestore},
	{name: "fork", args: "(CHECKPOINT | SANDBOX | --checkpoint ID | --sandbox ID) -n N [--group G] [--run R] [-q]", summary: "create N sandboxes at a checkpoint or a sandbox's state", run: runFork},
	{name: "release", args: "CHECKPOINT", summary: "release a checkpoint", run: runRelease},
	{name: "evaluate", args: "SANDBOX", summary: "run the verifier without ending the episode", run: runEvaluate},
	{name: "submit", args: "SANDBOX [ANSWER]", summary: "end the episode and run the verifier", run: runSubmit},
	{name: "close", args: "SANDBOX...", summary: "close sandboxes", run: runClose},
	{name: "sandboxes", args: "[--env E] [--run R] [--group G]", summary: "list leased sandboxes", run: runSandboxes},
	{name: "episodes", args: "[--run R] [--group G] [--env E] [--limit N]", summary: "list recorded episodes", run: runEpisodes},
	{name: "trajectory", args: "EPISODE", summary: "print an episode's steps from its reset", run: runTrajectory},
	{name: "advantages", args: "GROUP [--source S]", summary: "group-relative (GRPO) advantages", run: runAdvantages},
	{name: "traj", args: "export [--run NAME] [--format jsonl] [--out FILE]", summary: "export trajectories from the ledger database", run: runTraj, noClient: true},
	{name: "db", args: "url", summary: "print the ledger database URL (for psql)", run: runDB, noClient: true},
	{name: "purge", args: "[--data DIR]", summary: "end what a crashed server left running and delete its sandbox state (checkpoints, layers); keeps the ledger and the image cache", run: runPurge, noClient: true},
}

func lookup(name string) (command, bool) {
	for _, c := range commands {
		if c.name == name {
			return c, true
		}
	}
	return command{}, false
}

// Main runs the CLI with args (without the program name) and returns the exit
// status.
func Main(ctx context.Context, args []string, stdin io.Reader, stdout, stderr io.Writer) int {
	a := &app{stdin: stdin, stdout: stdout, stderr: stderr}
	return a.main(ctx, args)
}

func (a *app) main(ctx context.Context, args []string) int {
	// Client flags may come before the subcommand too: deltagym --addr X envs.
	global := flag.NewFlagSet("deltagym", flag.ContinueOnError)
	global.SetOutput(io.Discard)
	a.clientFlags(global)
	if err := global.Parse(args); err != nil {
		if errors.Is(err, flag.ErrHelp) {
			a.usage(a.stdout)
			return exitOK
		}
		fmt.Fprintf(a.stderr, "deltagym: %v\n", err)
		a.usage(a.stderr)
		return exitUsage
	}
	args = global.Args()
	if len(args) == 0 {
		a.usage(a.stderr)
		return exitUsage
	}
	name := args[0]
	if name == "help" || name == "-h" || name == "--help" {
		if len(args) > 1 {
			if c, ok := lookup(args[1]); ok {
				// The command's flags are defined by its run function: let it parse -h.
				return a.runCommand(ctx, c, []string{"-h"})
			}
		}
		a.usage(a.stdout)
		return exitOK
	}
	c, ok := lookup(name)
	if !ok {
		fmt.Fprintf(a.stderr, "deltagym: unknown command %q\n", name)
		a.usage(a.stderr)
		return exitUsage
	}
	return a.runCommand(ctx, c, args[1:])
}

// runCommand runs one subcommand and maps its outcome to an exit status.
func (a *app) runCommand(ctx context.Context, c command, args []string) int {
	fs := a.flagSet(c)
	err := c.run(ctx, a, fs, args)
	var ce commandExit
	switch {
	case err == nil:
		return exitOK
	case errors.As(err, &ce):
		return int(ce)
	case errors.Is(err, flag.ErrHelp):
		a.commandUsage(a.stdout, c, fs)
		return exitOK
	case errors.Is(err, errUsage):
		fmt.Fprintf(a.stderr, "deltagym %s: %s\n", c.name, strings.TrimPrefix(err.Error(), errUsage.Error()+": "))
		a.commandUsage(a.stderr, c, fs)
		return exitUsage
	default:
		fmt.Fprintf(a.stderr, "deltagym %s: %s\n", c.name, describeError(err, a))
		return exitError
	}
}

// describeError renders an error for stderr: the Connect code and message,
// with a hint when the server cannot be reached.
func describeError(err error, a *app) string {
	msg := err.Error()
	if connect.CodeOf(err) == connect.CodeUnauthenticated {
		if tok, _ := deltagym.ResolveToken(); a.token == "" && tok == "" {
			msg += " (this client found no token: give --token, set $DELTAGYM_TOKEN or $DELTAGYM_TOKEN_FILE, " +
				"or run from the directory that holds the server's data directory .data, or set $DELTAGYM_DATA to it)"
		} else {
			msg += " (this client sent a token the server does not take: the server's is in its data directory's file \"token\")"
		}
	}
	if connect.CodeOf(err) == connect.CodeUnavailable {
		addr, aerr := deltagym.BaseURL(a.addr)
		if aerr == nil {
			msg += fmt.Sprintf(" (is a server running at %s? start one with `make run` or `deltagym serve`)", addr)
		}
	}
	return msg
}

func (a *app) clientFlags(fs *flag.FlagSet) {
	usage := "server address, host:port or URL"
	if a.addr == "" { // else the flag package prints it as the default
		usage += " (default $DELTAGYM_ADDR or " + deltagym.DefaultAddr + ")"
	}
	fs.StringVar(&a.addr, "addr", a.addr, usage)
	fs.StringVar(&a.token, "token", a.token, "bearer token (default $DELTAGYM_TOKEN, else the file $DELTAGYM_TOKEN_FILE, else the server's token file in its data directory, $DELTAGYM_DATA or .data)")
	fs.BoolVar(&a.json, "json", a.json, "print responses as JSON (protojson), one object per line")
}

// flagSet returns a subcommand's flag set, with the client flags unless the
// command has none of its own.
func (a *app) flagSet(c command) *flag.FlagSet {
	fs := flag.NewFlagSet("deltagym "+c.name, flag.ContinueOnError)
	fs.SetOutput(io.Discard) // Main prints errors and usage itself
	if !c.noClient {
		a.clientFlags(fs)
	}
	return fs
}

func (a *app) usage(w io.Writer) {
	fmt.Fprintf(w, "Usage: deltagym [--addr ADDR] [--token T] [--json] COMMAND [ARGS]\n\nCommands:\n")
	width := 0
	for _, c := range commands {
		width = max(width, len(c.name))
	}
	for _, c := range commands {
		fmt.Fprintf(w, "  %-*s  %s\n", width, c.name, c.summary)
	}
	fmt.Fprintf(w, "\n`deltagym help COMMAND` describes a command. Exit status: 0 ok, 1 error, 2 usage; exec exits with its command's status (128+N for signal N, 124 on timeout).\n")
}

func (a *app) commandUsage(w io.Writer, c command, fs *flag.FlagSet) {
	fmt.Fprintf(w, "Usage: deltagym %s %s\n  %s\n", c.name, c.args, c.summary)
	if hasFlags(fs) {
		fmt.Fprintf(w, "\nFlags:\n")
		fs.SetOutput(w)
		fs.PrintDefaults()
		fs.SetOutput(io.Discard)
	}
}

func hasFlags(fs *flag.FlagSet) bool {
	n := 0
	fs.VisitAll(func(*flag.Flag) { n++ })
	return n > 0
}

// parseArgs parses fs's flags from args, allowing flags after positional
// arguments (deltagym reset shell --seed 3). Everything after "--" is
// positional. It returns the positional arguments and whether "--" was seen
// (and at which index of them it stood).
func parseArgs(fs *flag.FlagSet, args []string) (pos []string, dashAt int, err error) {
	dashAt = -1
	for {
		if err := fs.Parse(args); err != nil {
			if errors.Is(err, flag.ErrHelp) {
				return nil, -1, err
			}
			return nil, -1, usageErrorf("%v", err)
		}
		rest := fs.Args()
		consumed := len(args) - len(rest)
		if consumed > 0 && args[consumed-1] == "--" {
			return append(pos, rest...), len(pos), nil
		}
		if len(rest) == 0 {
			return pos, dashAt, nil
		}
		pos = append(pos, rest[0])
		args = rest[1:]
	}
}

// wantArgs checks the number of positional arguments; names are theirs,
// joined by " and ".
func wantArgs(pos []string, minN, maxN int, names string) error {
	if len(pos) < minN {
		if parts := strings.Split(names, " and "); len(pos) < len(parts) {
			names = strings.Join(parts[len(pos):], " and ") // the ones not given
		}
		return usageErrorf("missing %s", names)
	}
	if maxN >= 0 && len(pos) > maxN {
		return usageErrorf("unexpected argument %q", pos[maxN])
	}
	return nil
}

// secondsFlag is a duration flag that also takes a plain number of seconds.
type secondsFlag time.Duration

func (f *secondsFlag) String() string {
	if f == nil || *f == 0 {
		return ""
	}
	return time.Duration(*f).String()
}

func (f *secondsFlag) Set(v string) error {
	if s, err := strconv.ParseFloat(v, 64); err == nil {
		if s < 0 || s > 1e9 {
			return fmt.Errorf("%s: want a duration (1.5s, 2m) or seconds", v)
		}
		*f = secondsFlag(time.Duration(s * float64(time.Second)))
		return nil
	}
	d, err := time.ParseDuration(v)
	if err != nil {
		return fmt.Errorf("%s: want a duration (1.5s, 2m) or seconds", v)
	}
	*f = secondsFlag(d)
	return nil
}

// kvFlag is a repeatable key=value flag.
type kvFlag map[string]string

func (k kvFlag) String() string {
	keys := make([]string, 0, len(k))
	for key := range k {
		keys = append(keys, key)
	}
	sort.Strings(keys)
	parts := make([]string, len(keys))
	for i, key := range keys {
		parts[i] = key + "=" + k[key]
	}
	return strings.Join(parts, ",")
}

func (k kvFlag) Set(s string) error {
	key, value, ok := strings.Cut(s, "=")
	if !ok || key == "" {
		return fmt.Errorf("want key=value, got %q", s)
	}
	k[key] = value
	return nil
}

// dial connects to the server named by the client flags.
func (a *app) dial() (*deltagym.Client, error) {
	var opts []deltagym.Option
	if a.token != "" {
		opts = append(opts, deltagym.WithToken(a.token))
	}
	c, err := deltagym.Dial(a.addr, opts...)
	if err != nil {
		return nil, usageErrorf("%v", err)
	}
	return c, nil
}
