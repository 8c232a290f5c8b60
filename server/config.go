package server

import (
	"cmp"
	"errors"
	"flag"
	"fmt"
	"log/slog"
	"math"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"time"

	"github.com/deltagym/deltagym/sandbox"
	"github.com/deltagym/deltagym/sandbox/egress"
	"github.com/deltagym/deltagym/server/episode"
	"github.com/deltagym/deltagym/server/ledger/pgserver"
	"github.com/deltagym/deltagym/server/openenv"
)

// Config configures a Server.
type Config struct {
	// Addr is the listen address of Run. Default "127.0.0.1:8080".
	Addr string
	// DataDir holds images, layers, checkpoints, the ledger spool and the private Postgres.
	// Default ".data".
	DataDir string
	// EnvsDir is the catalog directory of env spec files (*.json). Default "envs"; a missing
	// directory means an empty catalog.
	EnvsDir string
	// InitBinary is the sandbox init, dg-init (sandbox.Config.InitBinary). Required;
	// `deltagym serve` takes it from --init, by default the one internal/locate.Init finds.
	InitBinary string
	// CRIU is the CRIU 4.2.1+ wrapper that saves and restores the processes templates cannot
	// (sandbox.Config.CRIU); it is checked when needed, so that one installed at this path
	// while the server runs is used. Empty: none, and the checkpoints, restores and forks that
	// need CRIU fail. `deltagym serve` takes it from --criu, by default internal/locate.CRIU's.
	CRIU string
	// PostgresBinDirs are the bin directories of PostgreSQL (initdb, postgres) for the private
	// cluster, in order of preference (pgserver.Config.BinDirs): a new cluster is made by the
	// first, an existing one run by the first of its own major version. Required unless
	// DatabaseURL or NoLedger; `deltagym serve` takes them from --postgres-bin, by default
	// internal/locate.PostgresBinDirs's.
	PostgresBinDirs []string
	// CgroupRoot names the sandboxes' cgroup parent. Default: one derived
	// from the data directory ("deltagym-<hash>"), so that servers on
	// different data directories never touch each other's sandboxes.
	CgroupRoot string
	// KeepCgroupOptions leaves the host's cgroup2 hierarchy as found, instead of turning on
	// its option favordynmods (sandbox.Config.KeepCgroupOptions).
	KeepCgroupOptions bool
	// ForkAtRestore forks a template's copies during each restore instead of ahead of it,
	// in the background after the previous one (sandbox.Config.ForkAtRestore): less CPU
	// per restore, more latency.
	ForkAtRestore bool
	// DefaultImageDir is imported as the image "default" at start when that image is missing
	// and the directory exists (a rootfs directory, or any other source ImportImage takes).
	// Default DataDir/images/default/rootfs; `deltagym serve` takes it from --default-image.
	DefaultImageDir string
	// DatabaseURL is an external Postgres for the ledger; "" starts the private cluster in
	// DataDir (unless NoLedger).
	DatabaseURL string
	// NoLedger turns the ledger off (for benchmarks); ledger queries then fail.
	NoLedger bool
	// Egress holds the settings of the sandboxes' egress proxy.
	Egress EgressSettings
	// PostgresMemoryMB caps the memory of the private Postgres (its shared buffers, backends
	// and the page cache of its files) with a control group of its own, in MiB. Default 512
	// (pgserver.DefaultMemoryLimit); negative: no cap. Ignored with DatabaseURL.
	PostgresMemoryMB int
	// LedgerVacuumSteps is how many steps the ledger writer delivers between two vacuums of
	// the steps table, which it runs itself (ledger.Config.VacuumSteps). Default 10,000;
	// negative: never (autovacuum alone).
	LedgerVacuumSteps int
	// LedgerSync makes a call answer only once its ledger rows are fsynced in the spool, not
	// only written to it (ledger.Config.Sync): they then survive a crash of the machine, not
	// only one of the server. Default false.
	LedgerSync bool
	// AuthToken is the bearer token every call must carry. Default "": the token kept in
	// DataDir/token, generated when missing (auth is on unless NoAuth).
	AuthToken string
	// NoAuth serves without a token; allowed only on a loopback Addr.
	NoAuth bool
	// TokenGroup, a group name or gid, may read the generated token file (mode 0640 instead of
	// 0600).
	TokenGroup string
	// PublicHealth serves health, reflection and /metrics without a token.
	PublicHealth bool
	// Import holds the settings of ImportImage.
	Import ImportSettings
	// Cluster holds the node's identity and its peers.
	Cluster ClusterSettings
	// MaxRequestBytes bounds one request message. Default RequestCapFor(sandbox.MaxFileBytes):
	// a write_file of the largest file a sandbox takes fits in every encoding.
	MaxRequestBytes int
	// Lease holds the settings of the sandboxes' leases.
	Lease LeaseSettings
	// OpenEnv holds the settings of the OpenEnv front end.
	OpenEnv OpenEnvSettings
	// AcquireTimeout bounds how long a Reset waits for a warm sandbox. Default 10s.
	AcquireTimeout time.Duration
	// DefaultPoolSize is the pool size of envs whose spec says 0. Default 2.
	DefaultPoolSize int
	// ShutdownTimeout bounds the graceful drain of Run. Default 30s.
	ShutdownTimeout time.Duration
	// Admission holds the server-wide caps on what the sandbox runtime holds at once.
	Admission Admission
	// Logger receives structured logs. Default slog.Default().
	Logger *slog.Logger
}

// parseBytes reads a size: digits, with an optional unit (K, KB, KiB, M, … T; all powers of
// 1024, in any case).
func parseBytes(v string) (int64, error) {
	num := strings.TrimRight(v, "KkMmGgTtIiBb")
	unit := strings.ToLower(strings.TrimSpace(v[len(num):]))
	n, err := strconv.ParseInt(strings.TrimSpace(num), 10, 64)
	if err != nil {
		return 0, err
	}
	shift := map[string]uint{"": 0, "b": 0, "k": 10, "kb": 10, "kib": 10, "m": 20, "mb": 20, "mib": 20,
		"g": 30, "gb": 30, "gib": 30, "t": 40, "tb": 40, "tib": 40}
	sh, ok := shift[unit]
	if !ok {
		return 0, fmt.Errorf("unit %q", unit)
	}
	if n > math.MaxInt64>>sh || n < math.MinInt64>>sh {
		return 0, errors.New("out of range")
	}
	return n << sh, nil
}

// defaultImportMaxBytes is Config.Import.MaxBytes when unset.
const defaultImportMaxBytes = 16 << 30

// EgressSettings are the settings of the sandboxes' egress proxy.
type EgressSettings struct {
	// Resolver resolves the names sandboxes ask the egress proxy for. Default the system's
	// resolver.
	Resolver egress.Resolver
	// Limits are the server's limits of each sandbox's egress, which an env may lower: a field
	// left 0 is egress.DefaultLimits's; negative, no limit (--egress-* flags).
	Limits egress.Limits
}

// ImportSettings are the settings of ImportImage.
type ImportSettings struct {
	// Root is the only host directory ImportImage reads from: a request names a path below
	// it. Default DataDir/imports.
	Root string
	// MaxBytes caps what one image import may write (file contents, after decompression).
	// Default 16 GiB.
	MaxBytes int64
}

// ClusterSettings are a node's identity in a cluster.
type ClusterSettings struct {
	// Node is the node's name (internal/nodeid.CheckName), carried by every sandbox and
	// checkpoint ID it makes, stable across restarts: the Kubernetes node's name in a cluster.
	// Default: the name the data directory keeps (DataDir/node-name), else one made of the
	// host name; the name in use is kept there.
	Node string
	// AdvertiseAddr is the host:port other nodes and clients reach the node at, reported by
	// NodeService.GetNode. Default "": not reported (a node on its own).
	AdvertiseAddr string
	// DrainTimeout is how long Run drains before it shuts down: the node takes no new
	// sandboxes (Reset and Fork fail with DRAINING, GetNode reports it draining) while the
	// sandboxes it holds run until their leases end or this time does. Default 0: no drain.
	DrainTimeout time.Duration
	// Peers names the nodes of the cluster, this one among them or not, as the Go client's
	// DialCluster takes a target: "dns:NAME:PORT" (every address of NAME a node, as a
	// Kubernetes headless Service lists them) or a comma-separated list of host:port. The node
	// asks each for its report, with its own token (a cluster has one), when it starts and every
	// 10 s after, so that a call on another node's ID fails with WRONG_NODE giving that node's
	// address. Default "": a node that knows no peer (WRONG_NODE names the node alone).
	Peers string
	// DigestAhead hashes each checkpoint's new layers in the background
	// (sandbox.Config.DigestAhead), so that another node fetching it need not wait for their
	// digests. Default: on when Peers is set.
	DigestAhead bool
	// LayerTimeout is how long either end of a FetchLayer waits for the other: the node
	// serving it for its reader to take a message, the node fetching for its peer to send one;
	// then it ends the stream, so that a stalled reader pins no layer, nor the stream's
	// buffers, and a stalled peer holds no adoption. Default 1m.
	LayerTimeout time.Duration
}

// LeaseSettings are the settings of the sandboxes' leases.
type LeaseSettings struct {
	// TTL is how long a sandbox lives without a call or heartbeat, unless its Reset, Fork or a
	// Heartbeat set its own (lease_ttl_seconds). Default 10m.
	TTL time.Duration
	// MaxTTL bounds the TTL a call may set, and TTL. Default 24h.
	MaxTTL time.Duration
}

// OpenEnvSettings are the settings of the OpenEnv front end (server/openenv).
type OpenEnvSettings struct {
	// StepCap bounds a command run through the OpenEnv protocol. Default 55s: the step answers
	// inside the 60 s OpenEnv's clients wait for a message.
	StepCap time.Duration
	// MaxSessions bounds the OpenEnv sessions open at once (WebSockets with sessions of their
	// own and MCP sessions). Default 4096.
	MaxSessions int
}

// defaultLeaseTTL is the default of LeaseSettings.TTL.
const defaultLeaseTTL = 10 * time.Minute

// defaultOpenEnvMaxSessions is the default of OpenEnvSettings.MaxSessions.
const defaultOpenEnvMaxSessions = 4096

// minPostgresMemoryMB and maxPostgresMemoryMB bound the memory cap of the private Postgres.
const (
	minPostgresMemoryMB = 256
	maxPostgresMemoryMB = 1 << 24 // 16 TiB
)

// postgresMemoryLimit is pgserver.Config.MemoryLimit for PostgresMemoryMB.
func (c *Config) postgresMemoryLimit() int64 {
	if c.PostgresMemoryMB < 0 {
		return -1
	}
	return int64(c.PostgresMemoryMB) << 20 // 0: pgserver's default
}

// RegisterFlags binds the config's fields to flags of fs, with defaults from the config's
// current values, or, when those are empty, from the environment (DELTAGYM_DATABASE_URL,
// DELTAGYM_TOKEN, DELTAGYM_INIT, DELTAGYM_DATA) and the built-in defaults. The defaults of
// --criu and --postgres-bin are the config's values alone: the caller finds the programs
// (internal/locate) before it registers the flags.
func (c *Config) RegisterFlags(fs *flag.FlagSet) {
	def := func(v, env, d string) string {
		if v != "" {
			return v
		}
		if e := os.Getenv(env); e != "" {
			return e
		}
		return d
	}
	fs.StringVar(&c.Addr, "addr", def(c.Addr, "DELTAGYM_ADDR", "127.0.0.1:8080"), "listen address (Connect, gRPC, gRPC-Web, /metrics)")
	fs.StringVar(&c.DataDir, "data", def(c.DataDir, "DELTAGYM_DATA", ".data"), "data directory: images, checkpoints, ledger spool, private Postgres")
	fs.StringVar(&c.EnvsDir, "envs", def(c.EnvsDir, "DELTAGYM_ENVS", "envs"), "directory of env spec files (*.json)")
	fs.StringVar(&c.DefaultImageDir, "default-image", c.DefaultImageDir, "the image imported as \"default\" at start when the data directory has none: "+
		"a rootfs `directory`, an OCI layout or a docker save tarball (default <data>/images/default/rootfs, where make image builds it)")
	fs.StringVar(&c.InitBinary, "init", def(c.InitBinary, "DELTAGYM_INIT", ""), "path of the sandbox init binary (dg-init; make init builds bin/dg-init)")
	fs.StringVar(&c.CRIU, "criu", c.CRIU, "`path` of the CRIU 4.2.1+ wrapper that saves the processes templates cannot (make criu installs .cache/criu/bin/criu; "+
		"used once it is there, even if installed while the server runs; empty: none, and the checkpoints that need it fail)")
	fs.Var(dirList{&c.PostgresBinDirs}, "postgres-bin", "PostgreSQL bin `directories` (initdb, postgres) of the private Postgres, separated by colons, in order of preference: "+
		"a new cluster is made by the first, an existing one run by the first of its own major version (make postgres installs PostgreSQL 17 in .cache/postgres)")
	fs.StringVar(&c.DatabaseURL, "database-url", def(c.DatabaseURL, "DELTAGYM_DATABASE_URL", ""), "external Postgres URL for the ledger (default: private cluster in the data dir)")
	fs.BoolVar(&c.NoLedger, "no-ledger", c.NoLedger, "run without the trajectory ledger")
	c.Cluster.registerFlags(fs, def)
	c.PostgresMemoryMB = cmp.Or(c.PostgresMemoryMB, pgserver.DefaultMemoryLimit>>20)
	fs.Func("postgres-memory-mb", fmt.Sprintf("memory cap of the private Postgres in `MiB`, page cache included: a control group of its own, "+
		"in which the ledger's growing files reuse its pages (%d to %d; -1: no cap) (default %d)", minPostgresMemoryMB, maxPostgresMemoryMB, c.PostgresMemoryMB),
		func(v string) error {
			n, err := strconv.Atoi(v)
			if err != nil || n != -1 && (n < minPostgresMemoryMB || n > maxPostgresMemoryMB) {
				return fmt.Errorf("%q: a number of MiB from %d to %d (the shared buffers alone take 128), or -1 for no cap", v, minPostgresMemoryMB, maxPostgresMemoryMB)
			}
			c.PostgresMemoryMB = n
			return nil
		})
	fs.Func("ledger-vacuum-steps", "vacuum the ledger's steps table after every `N` steps delivered, while its new pages are still in Postgres's "+
		"shared buffers, which autovacuum would otherwise read back from disk and write again (-1: leave it to autovacuum) (default 10000)",
		func(v string) error {
			n, err := strconv.Atoi(v)
			if err != nil || n == 0 || n < -1 {
				return fmt.Errorf("%q: a number of steps (1 or more), or -1 to leave the steps table to autovacuum", v)
			}
			c.LedgerVacuumSteps = n
			return nil
		})
	fs.BoolVar(&c.LedgerSync, "ledger-sync", c.LedgerSync, "answer a call only once its ledger rows are fsynced in the spool, so that they survive "+
		"a crash of the machine, not only one of the server (by default a call waits for its rows' write to the spool, and the spool is fsynced every 10 ms)")
	fs.BoolVar(&c.KeepCgroupOptions, "keep-cgroup-options", c.KeepCgroupOptions, "leave the host's cgroup2 mount as found (by default the server turns on its option favordynmods, host-wide, so that moving a process between cgroups never waits 5-15 ms for an RCU grace period)")
	fs.BoolVar(&c.ForkAtRestore, "fork-at-restore", c.ForkAtRestore, "fork the copies of a checkpoint's processes during each restore, not ahead of it in the background (by default, a checkpoint restored twice in a row gets the copies of its next restore forked while the agent takes its step: a quicker restore for a little more CPU)")
	fs.StringVar(&c.AuthToken, "token", def(c.AuthToken, "DELTAGYM_TOKEN", ""), "bearer token required of clients; prefer $DELTAGYM_TOKEN, which other users cannot read in the process list "+
		"(default: a random token kept in the data directory's file \"token\", mode 0600, made at the first start)")
	fs.BoolVar(&c.NoAuth, "no-auth", c.NoAuth, "serve without a token (only on a loopback --addr: every local user can then drive the server)")
	fs.StringVar(&c.TokenGroup, "token-group", c.TokenGroup, "a `group` (name or gid) that may read the generated token file (mode 0640)")
	fs.BoolVar(&c.PublicHealth, "public-health", c.PublicHealth, "serve gRPC health, reflection and /metrics without a token")
	fs.StringVar(&c.Import.Root, "import-root", c.Import.Root, "the only host `directory` ImportImage reads images from; requests name paths below it (default <data>/imports)")
	fs.Func("import-max-bytes", "most `bytes` one image import may write, after decompression: a number, or one with a unit such as 500MiB or 16GiB (default 16GiB)", func(v string) error {
		n, err := parseBytes(v)
		if err != nil || n <= 0 {
			return fmt.Errorf("%q: a positive size in bytes, such as 1073741824, 500MiB or 16GiB", v)
		}
		c.Import.MaxBytes = n
		return nil
	})
	fs.IntVar(&c.MaxRequestBytes, "max-request-bytes", cmp.Or(c.MaxRequestBytes, RequestCapFor(sandbox.MaxFileBytes)),
		"largest accepted request message, in `bytes` (the default carries a write_file of the largest file a sandbox takes, 64 MiB, in every encoding: Connect JSON base64-encodes it)")
	fs.DurationVar(&c.Lease.TTL, "lease-ttl", max(c.Lease.TTL, defaultLeaseTTL),
		"sandbox lease TTL, renewed by every call and heartbeat, unless the sandbox's Reset, Fork or a Heartbeat set its own (lease_ttl_seconds)")
	fs.DurationVar(&c.Lease.MaxTTL, "max-lease-ttl", max(c.Lease.MaxTTL, episode.DefaultMaxLeaseTTL),
		"longest lease TTL a Reset, Fork or Heartbeat may set for its sandboxes (lease_ttl_seconds), and longest --lease-ttl")
	fs.IntVar(&c.OpenEnv.MaxSessions, "openenv-max-sessions", cmp.Or(c.OpenEnv.MaxSessions, defaultOpenEnvMaxSessions),
		"most OpenEnv sessions (WebSockets and MCP sessions) open at once; past it a session is refused with CAPACITY_REACHED")
	fs.DurationVar(&c.OpenEnv.StepCap, "openenv-step-cap", cmp.Or(c.OpenEnv.StepCap, openenv.DefaultStepCap),
		"longest a command runs through the OpenEnv protocol: its step answers, timed out with what it printed, inside the clients' wait for a message (60 s unless they set message_timeout_s)")
	fs.DurationVar(&c.AcquireTimeout, "acquire-timeout", max(c.AcquireTimeout, 10*time.Second), "how long Reset waits for a warm sandbox")
	fs.IntVar(&c.DefaultPoolSize, "pool-size", max(c.DefaultPoolSize, 2), "warm pool size of envs that do not set one")
	fs.DurationVar(&c.ShutdownTimeout, "shutdown-timeout", max(c.ShutdownTimeout, 30*time.Second), "graceful shutdown drain limit")
	c.Admission.registerFlags(fs)
	registerEgressFlags(fs, &c.Egress.Limits)
	// The trace exporter is configured by the standard OpenTelemetry environment (see
	// traceExporter); the flag is a shorthand for its endpoint variable.
	fs.Func("trace-endpoint", "OTLP collector `URL` to export traces to, such as http://127.0.0.1:4318 (sets OTEL_EXPORTER_OTLP_ENDPOINT; "+
		"OTEL_EXPORTER_OTLP_PROTOCOL=grpc for gRPC; default: $OTEL_EXPORTER_OTLP_ENDPOINT, else no export)", func(v string) error {
		return os.Setenv("OTEL_EXPORTER_OTLP_ENDPOINT", v)
	})
}

// dirList is a flag.Value of directories separated by colons, as in $PATH.
type dirList struct{ dirs *[]string }

// String implements flag.Value.
func (l dirList) String() string {
	if l.dirs == nil {
		return ""
	}
	return strings.Join(*l.dirs, string(os.PathListSeparator))
}

// Set implements flag.Value: v replaces the list.
func (l dirList) Set(v string) error {
	*l.dirs = nil
	for _, d := range filepath.SplitList(v) {
		if d != "" {
			*l.dirs = append(*l.dirs, d)
		}
	}
	return nil
}

// Validate checks the config and fills in defaults.
func (c *Config) Validate() error {
	if err := c.defaults(); err != nil {
		return err
	}
	return c.check()
}

// defaults fills in the fields left empty.
func (c *Config) defaults() error {
	if c.Addr == "" {
		c.Addr = "127.0.0.1:8080"
	}
	abs, err := filepath.Abs(cmp.Or(c.DataDir, ".data"))
	if err != nil {
		return err
	}
	c.DataDir = abs
	c.EnvsDir = cmp.Or(c.EnvsDir, "envs")
	if c.DefaultImageDir == "" {
		c.DefaultImageDir = filepath.Join(c.DataDir, "images", "default", "rootfs")
	}
	if c.Import.Root == "" {
		c.Import.Root = filepath.Join(c.DataDir, "imports")
	}
	if c.Import.Root, err = filepath.Abs(c.Import.Root); err != nil {
		return err
	}
	if c.Import.MaxBytes <= 0 {
		c.Import.MaxBytes = defaultImportMaxBytes
	}
	if c.MaxRequestBytes <= 0 {
		c.MaxRequestBytes = RequestCapFor(sandbox.MaxFileBytes)
	}
	if c.ShutdownTimeout <= 0 {
		c.ShutdownTimeout = 30 * time.Second
	}
	if c.Lease.TTL <= 0 {
		c.Lease.TTL = defaultLeaseTTL
	}
	if c.Lease.MaxTTL <= 0 {
		c.Lease.MaxTTL = max(episode.DefaultMaxLeaseTTL, c.Lease.TTL)
	}
	if c.Cluster.LayerTimeout <= 0 {
		c.Cluster.LayerTimeout = defaultLayerTimeout
	}
	if c.OpenEnv.MaxSessions <= 0 {
		c.OpenEnv.MaxSessions = defaultOpenEnvMaxSessions
	}
	if c.Logger == nil {
		c.Logger = slog.Default()
	}
	return nil
}

// check refuses settings that exclude each other or are out of range.
func (c *Config) check() error {
	if c.NoAuth && (c.AuthToken != "" || c.TokenGroup != "") {
		return errors.New("server: --no-auth excludes --token and --token-group")
	}
	if c.NoAuth && !isLoopback(c.Addr) {
		return fmt.Errorf("server: --addr %s: %w", c.Addr, errNoAuthExposed)
	}
	if strings.ContainsAny(c.AuthToken, " \t\r\n") {
		return errors.New("server: the token may not contain white space")
	}
	if c.NoLedger && c.DatabaseURL != "" {
		return errors.New("server: --no-ledger and --database-url exclude each other")
	}
	if err := c.Admission.check(); err != nil {
		return err
	}
	if err := c.Cluster.check(); err != nil {
		return err
	}
	if c.Lease.TTL > c.Lease.MaxTTL {
		return fmt.Errorf("server: --lease-ttl %v is longer than --max-lease-ttl %v", c.Lease.TTL, c.Lease.MaxTTL)
	}
	if c.NoLedger && c.LedgerSync {
		return errors.New("server: --no-ledger and --ledger-sync exclude each other: without a ledger there are no rows to fsync")
	}
	if c.PostgresMemoryMB > 0 && (c.PostgresMemoryMB < minPostgresMemoryMB || c.PostgresMemoryMB > maxPostgresMemoryMB) {
		return fmt.Errorf("server: --postgres-memory-mb %d: from %d to %d (the shared buffers alone take 128), or -1 for no cap",
			c.PostgresMemoryMB, minPostgresMemoryMB, maxPostgresMemoryMB)
	}
	return nil
}
