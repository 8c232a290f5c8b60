package main

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"slices"
	"strconv"
	"strings"
	"time"

	"connectrpc.com/connect"
	"github.com/alecthomas/kong"
	"github.com/posener/complete"
	"github.com/willabides/kongplete"

	deltagym "github.com/deltagym/deltagym/clients/go/deltagym"
	"github.com/deltagym/deltagym/internal/version"
)

// Exit statuses.
const (
	exitOK    = 0
	exitError = 1
	exitUsage = 2
)

// errUsage marks an error in the command line that only a command's Run can see; Main prints
// it with the command's usage and exits with status 2.
var errUsage = errors.New("usage")

func usageErrorf(format string, args ...any) error {
	return fmt.Errorf("%w: %s", errUsage, fmt.Sprintf(format, args...))
}

// clientFlags are the flags of every subcommand that calls a server. They sit on the root, so
// that they go before or after the subcommand (deltagym --addr X envs, deltagym envs --addr X).
type clientFlags struct {
	Addr  string `group:"client" placeholder:"HOST:PORT" help:"server address, host:port or URL; or a cluster, dns:NAME:PORT (every address of NAME a node) or a comma-separated list of addresses, whose commands then go to the node that holds their sandbox or checkpoint, and reset to the least loaded (default $DELTAGYM_ADDR or ${defaultAddr})"`
	Token string `group:"client" placeholder:"TOKEN" help:"bearer token (default $DELTAGYM_TOKEN, else the file $DELTAGYM_TOKEN_FILE, else the server's token file in its data directory, $DELTAGYM_DATA or .data)"`
	JSON  bool   `group:"client" name:"json" help:"print responses as JSON (protojson), one object per line"`
}

// app is one invocation of the CLI: its streams and its grammar, which kong fills in. Each
// command is a struct whose fields are its arguments and flags and whose Run method does it.
type app struct {
	stdin          io.Reader
	stdout, stderr io.Writer

	clientFlags

	Serve       serveCmd       `cmd:"" passthrough:"" help:"run the server in the foreground (deltagym serve -h lists its flags)"`
	Envs        envsCmd        `cmd:"" help:"list the env catalog and warm pools"`
	RegisterEnv registerEnvCmd `cmd:"" help:"add an env (the JSON of envs/*.json) to the catalog; the server keeps it across restarts"`
	ImportImage importImageCmd `cmd:"" help:"import an image from the server's import root (--import-root, default <data>/imports; PATH relative to it), for envs to name"`
	Reset       resetCmd       `cmd:"" help:"take a warm sandbox of an env and start an episode"`
	Exec        execCmd        `cmd:"" help:"run a command (one word: a shell string; several: argv, after --)"`
	Write       writeCmd       `cmd:"" help:"write a file (from stdin by default)"`
	Read        readCmd        `cmd:"" help:"print a file"`
	Checkpoint  checkpointCmd  `cmd:"" help:"checkpoint a sandbox"`
	Restore     restoreCmd     `cmd:"" help:"restore a sandbox to a checkpoint (starts a new episode)"`
	Fork        forkCmd        `cmd:"" help:"create N sandboxes at a checkpoint or a sandbox's state"`
	Release     releaseCmd     `cmd:"" help:"release a checkpoint"`
	Evaluate    evaluateCmd    `cmd:"" help:"run the verifier without ending the episode"`
	Submit      submitCmd      `cmd:"" help:"end the episode and run the verifier"`
	Close       closeCmd       `cmd:"" help:"close sandboxes"`
	Sandboxes   sandboxesCmd   `cmd:"" help:"list leased sandboxes"`
	Checkpoints checkpointsCmd `cmd:"" help:"list the checkpoints the server holds, each with its state digest in short (the first 12 hex digits of its files', +p when it holds processes, - until computed) and what keeps it (release frees them)"`
	Diff        diffCmd        `cmd:"" help:"compare two checkpoints of an env: the files changed, in git diff --stat's form with the sandbox's absolute paths (a directory's ending in /, not counted as a file), and the processes; two equal states print nothing"`
	Nodes       nodesCmd       `cmd:"" help:"list the nodes of the cluster --addr names (or the one server): name, address, version, load"`
	ledgerCmds
	Purge      purgeCmd      `cmd:"" help:"end what a crashed server left running and delete its sandbox store: checkpoints, layers and imported images (import them again; the default image is imported at start); keeps the ledger and the registered envs"`
	Completion completionCmd `cmd:"" help:"print the shell completion script for bash, zsh or fish"`
	Help       helpCmd       `cmd:"" help:"describe a command"`
	VersionCmd versionCmd    `cmd:"" name:"version" help:"print the version"`
}

// ledgerCmds are the commands that read the ledger, in the order of the CLI's help.
type ledgerCmds struct {
	Episodes   episodesCmd   `cmd:"" help:"list recorded episodes"`
	Trajectory trajectoryCmd `cmd:"" help:"print an episode's steps from its reset"`
	Advantages advantagesCmd `cmd:"" help:"group-relative (GRPO) advantages"`
	Traj       trajCmd       `cmd:"" help:"export trajectories from the ledger database"`
	DB         dbCmd         `cmd:"" name:"db" help:"print the ledger database URL (for psql)"`
}

// Main runs the CLI with args (without the program name) and returns the exit status.
func Main(ctx context.Context, args []string, stdin io.Reader, stdout, stderr io.Writer) int {
	a := &app{stdin: stdin, stdout: stdout, stderr: stderr}
	return a.main(ctx, args)
}

// exitPanic carries the status kong's help and completion exit with out of the parse, to main.
type exitPanic int

func (a *app) parser(ctx context.Context) (*kong.Kong, error) {
	return kong.New(a,
		kong.Name("deltagym"),
		kong.Description("Runs the deltagym server (deltagym serve) and talks to a running one. "+
			"Exit status: 0 ok, 1 error, 2 usage; exec exits with its command's status (128+N for signal N, 124 on timeout)."),
		kong.Writers(a.stdout, a.stderr),
		kong.Exit(func(code int) { panic(exitPanic(code)) }),
		kong.ExplicitGroups([]kong.Group{{Key: "client", Title: "Client flags (commands that call a server):"}}),
		kong.ConfigureHelp(kong.HelpOptions{Compact: true, WrapUpperBound: 100}),
		kong.Vars{"defaultAddr": deltagym.DefaultAddr},
		kong.BindTo(ctx, (*context.Context)(nil)),
		kong.Bind(a),
	)
}

func (a *app) main(ctx context.Context, args []string) (code int) {
	defer func() {
		if r := recover(); r != nil {
			p, ok := r.(exitPanic)
			if !ok {
				panic(r)
			}
			code = int(p)
		}
	}()
	k, err := a.parser(ctx)
	if err != nil { // the grammar itself is wrong: a bug, caught by every test
		fmt.Fprintf(a.stderr, "deltagym: %v\n", err)
		return exitError
	}
	if os.Getenv("COMP_LINE") != "" { // a shell asks for completions (deltagym completion)
		kongplete.Complete(k, kongplete.WithPredictors(map[string]complete.Predictor{
			"serve":     serveFlagPredictor(),
			"processes": complete.PredictSet("template", "criu", "files"),
			"format":    complete.PredictSet("oci", "docker", "rootfs"),
		}))
	}
	kctx, err := k.Parse(args)
	if err != nil {
		var pe *kong.ParseError
		if errors.As(err, &pe) {
			a.printUsageError(pe.Context, err)
			return exitUsage
		}
		fmt.Fprintf(a.stderr, "deltagym: %v\n", err)
		return exitError
	}
	return a.exitStatus(kctx, kctx.Run())
}

// exitStatus maps a command's outcome to an exit status, printing the error.
func (a *app) exitStatus(kctx *kong.Context, err error) int {
	var ce commandExit
	switch {
	case err == nil:
		return exitOK
	case errors.As(err, &ce):
		return int(ce)
	case errors.Is(err, errUsage):
		a.printUsageError(kctx, err)
		return exitUsage
	}
	fmt.Fprintf(a.stderr, "%s: %s\n", commandPath(kctx), describeError(err, a))
	return exitError
}

// printUsageError prints a command-line error and the usage line of the command it is in.
func (a *app) printUsageError(kctx *kong.Context, err error) {
	fmt.Fprintf(a.stderr, "%s: %s\n", commandPath(kctx), strings.TrimPrefix(err.Error(), errUsage.Error()+": "))
	if kctx != nil {
		kctx.Stdout = a.stderr
		_ = kctx.PrintUsage(true)
		kctx.Stdout = a.stdout
	}
}

// commandPath names the command kctx selected ("deltagym reset"), or the program.
func commandPath(kctx *kong.Context) string {
	if kctx != nil && kctx.Selected() != nil {
		return kctx.Selected().FullPath()
	}
	return "deltagym"
}

// describeError renders an error for stderr: the Connect code and message,
// with a hint when the server cannot be reached.
func describeError(err error, a *app) string {
	msg := err.Error()
	if connect.CodeOf(err) == connect.CodeUnauthenticated {
		if tok, _ := deltagym.ResolveToken(); a.Token == "" && tok == "" {
			msg += " (this client found no token: give --token, set $DELTAGYM_TOKEN or $DELTAGYM_TOKEN_FILE, " +
				"or run from the directory that holds the server's data directory .data, or set $DELTAGYM_DATA to it)"
		} else {
			msg += " (this client sent a token the server does not take: the server's is in its data directory's file \"token\")"
		}
	}
	if connect.CodeOf(err) == connect.CodeFailedPrecondition && strings.Contains(msg, "(process mode filesystem)") {
		msg += " (with this CLI: checkpoint --processes files)"
	}
	// An unavailable with a reason is the server's own answer (DRAINING, NODE_UNAVAILABLE): it
	// is running, and says why.
	if connect.CodeOf(err) == connect.CodeUnavailable && deltagym.ErrorReason(err) == "" {
		if addr := cmp.Or(a.Addr, os.Getenv(deltagym.EnvAddr)); deltagym.IsClusterTarget(addr) {
			msg += " (`deltagym nodes` lists the cluster's nodes)"
		} else if addr, aerr := deltagym.BaseURL(a.Addr); aerr == nil {
			msg += fmt.Sprintf(" (is a server running at %s? start one with `make run` or `deltagym serve`)", addr)
		}
	}
	return msg
}

// helpCmd is `deltagym help [COMMAND]`: the command's --help.
type helpCmd struct {
	Command []string `arg:"" optional:"" help:"the command to describe"`
}

func (h *helpCmd) Run(kctx *kong.Context) error {
	sub, err := kctx.Parse(slices.Concat(h.Command, []string{"--help"}))
	if err != nil {
		return usageErrorf("%v", err)
	}
	return sub.Run() // serve passes --help on to its own flags; kong printed the others' help and exited
}

// versionCmd is `deltagym version`: the program's name and version (the file VERSION at the
// repository's root).
type versionCmd struct{}

func (versionCmd) Run(a *app) error {
	_, err := fmt.Fprintln(a.stdout, "deltagym "+version.Version)
	return err
}

// seconds is a duration flag that also takes a plain number of seconds.
type seconds time.Duration

func (f *seconds) UnmarshalText(b []byte) error {
	v := string(b)
	if s, err := strconv.ParseFloat(v, 64); err == nil {
		if !(s >= 0 && s <= 1e9) { // NaN too
			return fmt.Errorf("%s: want a duration (1.5s, 2m) or seconds", v)
		}
		*f = seconds(time.Duration(s * float64(time.Second)))
		return nil
	}
	d, err := time.ParseDuration(v)
	if err != nil {
		return fmt.Errorf("%s: want a duration (1.5s, 2m) or seconds", v)
	}
	*f = seconds(d)
	return nil
}

// dial connects to the server or the cluster the client flags name.
func (a *app) dial(ctx context.Context) (*conn, error) {
	// The token is resolved here so that describeError, not the client, gives the advice
	// about a missing one, in terms of this CLI's flags.
	tok := a.Token
	if tok == "" {
		var err error
		if tok, err = deltagym.ResolveToken(); err != nil {
			return nil, usageErrorf("%v", err)
		}
	}
	addr := cmp.Or(a.Addr, os.Getenv(deltagym.EnvAddr))
	if deltagym.IsClusterTarget(addr) {
		if err := deltagym.CheckClusterTarget(addr); err != nil {
			return nil, usageErrorf("--addr: %v", err)
		}
		cl, err := deltagym.DialCluster(ctx, addr, deltagym.WithToken(tok))
		if err != nil {
			return nil, err
		}
		return &conn{cluster: cl}, nil
	}
	c, err := deltagym.Dial(addr, deltagym.WithToken(tok))
	if err != nil {
		return nil, usageErrorf("%v", err)
	}
	return &conn{one: c, addr: cmp.Or(addr, deltagym.DefaultAddr)}, nil
}
