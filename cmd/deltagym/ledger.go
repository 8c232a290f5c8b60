package main

import (
	"bufio"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/url"
	"os"
	"path/filepath"

	deltagymv1 "github.com/deltagym/deltagym/clients/go/gen/deltagym/v1"
	"github.com/deltagym/deltagym/internal/locate"
	"github.com/deltagym/deltagym/sandbox"
	"github.com/deltagym/deltagym/server/ledger"
	"github.com/deltagym/deltagym/server/ledger/pgserver"
	"google.golang.org/protobuf/encoding/protojson"
	"google.golang.org/protobuf/proto"
)

// Environment variables the ledger subcommands share with `deltagym serve`.
const (
	envDatabaseURL = "DELTAGYM_DATABASE_URL"
	envDataDir     = "DELTAGYM_DATA"
)

// dbFlags are the flags that locate the ledger database.
type dbFlags struct {
	URL  string `name:"database-url" env:"DELTAGYM_DATABASE_URL" placeholder:"URL" help:"Postgres URL of the ledger (default: the private cluster in the data directory)"`
	Data string `env:"DELTAGYM_DATA" default:".data" placeholder:"DIR" help:"server data directory holding the private Postgres cluster (default ${default})"`
}

// pgDir is where `deltagym serve` keeps its private Postgres cluster (the
// pgserver data directory) inside its data directory.
func pgDir(dataDir string) string { return filepath.Join(dataDir, "pg") }

// embeddedURL is the URL of the private cluster `deltagym serve` runs in
// dataDir, in pgserver's layout (socket directory pgsock, database
// "deltagym", user postgres). A test checks it against the server's own.
func embeddedURL(dataDir string) (string, error) {
	abs, err := filepath.Abs(dataDir)
	if err != nil {
		return "", fmt.Errorf("resolving data directory: %w", err)
	}
	return fmt.Sprintf("postgres:///%s?host=%s&user=postgres&sslmode=disable",
		url.PathEscape("deltagym"), url.QueryEscape(filepath.Join(pgDir(abs), "pgsock"))), nil
}

// embeddedRunning reports whether the private cluster of dataDir listens.
func embeddedRunning(dataDir string) bool {
	_, err := os.Stat(filepath.Join(pgDir(dataDir), "pgsock", ".s.PGSQL.5432"))
	return err == nil
}

// errNoCluster means the data directory has no Postgres cluster.
var errNoCluster = errors.New("no ledger database")

// openDatabase returns the URL of the ledger database and a function to call
// when done with it. When the private cluster of the data directory is not
// running (no server is), it is started for the duration of the command,
// with the PostgreSQL binaries internal/locate finds ($DELTAGYM_POSTGRES,
// else the installed ones).
func (d *dbFlags) openDatabase(ctx context.Context) (string, func(), error) {
	if d.URL != "" {
		return d.URL, func() {}, nil
	}
	u, err := embeddedURL(d.Data)
	if err != nil {
		return "", nil, err
	}
	if embeddedRunning(d.Data) {
		return u, func() {}, nil
	}
	if err := d.haveCluster(); err != nil {
		return "", nil, err
	}
	binDirs, err := locate.PostgresBinDirs()
	if err != nil {
		return "", nil, fmt.Errorf("starting the private Postgres of %s: %w", d.Data, err)
	}
	srv, err := pgserver.StartConfig(ctx, pgserver.Config{DataDir: pgDir(d.Data), BinDirs: binDirs})
	if err != nil {
		return "", nil, fmt.Errorf("starting the private Postgres of %s: %w", d.Data, postgresHint(ctx, err))
	}
	return srv.URL(), func() { _ = srv.Stop(context.WithoutCancel(ctx)) }, nil
}

// haveCluster fails with errNoCluster unless the data directory holds a private cluster.
func (d *dbFlags) haveCluster() error {
	if _, err := os.Stat(filepath.Join(pgDir(d.Data), "postgres", "PG_VERSION")); err == nil {
		return nil
	}
	abs, _ := filepath.Abs(d.Data)
	return fmt.Errorf("%w: %s holds no Postgres cluster. These commands read the ledger of the server whose data directory they are given, not the one at --addr: pass --data DIR (or set $%s; `make run` uses .data in the checkout), or --database-url for an external database",
		errNoCluster, abs, envDataDir)
}

type dbCmd struct {
	URL dbURLCmd `cmd:"" name:"url" help:"print the ledger database URL (for psql)"`
}

type dbURLCmd struct {
	dbFlags
}

func (d *dbURLCmd) Run(a *app) error {
	u := d.URL
	if u == "" {
		var err error
		if err := d.haveCluster(); err != nil {
			return err
		}
		if u, err = embeddedURL(d.Data); err != nil {
			return err
		}
		if !embeddedRunning(d.Data) {
			fmt.Fprintf(a.stderr, "deltagym: the private Postgres of %s is not running now (start the server with `make run`)\n", d.Data)
		}
	}
	_, err := fmt.Fprintln(a.stdout, u)
	return err
}

type trajCmd struct {
	Export trajExportCmd `cmd:"" help:"export trajectories from the ledger database"`
}

type trajExportCmd struct {
	dbFlags
	RunName string `name:"run" placeholder:"NAME" help:"export this run only (default: every run)"`
	Format  string `enum:"jsonl" default:"jsonl" help:"output format (jsonl: one JSON object per episode)"`
	Out     string `default:"-" placeholder:"FILE" help:"file to write (- for standard output, the default)"`
}

func (t *trajExportCmd) Run(ctx context.Context, a *app) error {
	u, done, err := t.openDatabase(ctx)
	if err != nil {
		return err
	}
	defer done()
	store, err := ledger.Open(ctx, u, nil)
	if err != nil {
		return fmt.Errorf("opening the ledger: %w", err)
	}
	defer store.Close()
	return writeOutput(a.stdout, t.Out, func(w io.Writer) error {
		if err := store.ExportWith(ctx, w, ledger.ExportOptions{Run: t.RunName, Observation: observationJSON}); err != nil {
			return fmt.Errorf("exporting trajectories: %w", err)
		}
		return nil
	})
}

// observationJSON turns a step's stored observation, a deltagym.v1.Observation as the server
// records it, into its protojson form, as actions are stored.
func observationJSON(stored []byte) (json.RawMessage, bool) {
	var o deltagymv1.Observation
	if err := proto.Unmarshal(stored, &o); err != nil {
		return nil, false
	}
	j, err := protojson.Marshal(&o)
	return j, err == nil
}

// writeOutput runs write on stdout or on a file created (through a temporary
// file renamed into place) at path.
func writeOutput(stdout io.Writer, path string, write func(io.Writer) error) error {
	if path == "-" {
		bw := bufio.NewWriterSize(stdout, 1<<16)
		if err := write(bw); err != nil {
			return err
		}
		return bw.Flush()
	}
	f, err := os.CreateTemp(filepath.Dir(path), "."+filepath.Base(path)+".*")
	if err != nil {
		return fmt.Errorf("creating output: %w", err)
	}
	bw := bufio.NewWriterSize(f, 1<<16)
	err = write(bw)
	if err == nil {
		err = bw.Flush()
	}
	if err == nil {
		err = f.Close()
	} else {
		_ = f.Close()
	}
	if err == nil {
		err = os.Rename(f.Name(), path)
	}
	if err != nil {
		_ = os.Remove(f.Name())
		return err
	}
	return nil
}

// purgeCmd deletes the sandbox runtime's state in a stopped server's data
// directory (its checkpoints, layers and imported images) and ends what a
// crashed server left running: the sandboxes waiting for the next server
// (their inits keep the templates of process checkpoints) and the private
// Postgres. `make clean-data` runs it, then deletes the rest.
type purgeCmd struct {
	Data string `env:"DELTAGYM_DATA" default:".data" placeholder:"DIR" help:"server data directory (default ${default})"`
}

func (p *purgeCmd) Run(ctx context.Context, a *app) error {
	data := p.Data
	dir := filepath.Join(data, "sandbox")
	if err := sandbox.Purge(dir); err != nil {
		if errors.Is(err, sandbox.ErrExists) {
			return fmt.Errorf("a server is running on %s: stop it first", data)
		}
		return err
	}
	// The server is not running (Purge holds its lock): a postmaster of
	// its private cluster is an orphan of a crash.
	if err := pgserver.StopOrphan(ctx, pgDir(data)); err != nil {
		return err
	}
	_, err := fmt.Fprintf(a.stdout, "purged %s\n", dir)
	return err
}
