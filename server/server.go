package server

import (
	"context"
	"crypto/sha256"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"slices"
	"sync"
	"time"

	"connectrpc.com/connect"
	"connectrpc.com/grpchealth"
	"connectrpc.com/grpcreflect"

	"github.com/deltagym/deltagym/clients/go/deltagym"
	deltagymv1 "github.com/deltagym/deltagym/clients/go/gen/deltagym/v1"
	"github.com/deltagym/deltagym/clients/go/gen/deltagym/v1/deltagymv1connect"
	"github.com/deltagym/deltagym/envpool"
	"github.com/deltagym/deltagym/sandbox"
	"github.com/deltagym/deltagym/server/episode"
	"github.com/deltagym/deltagym/server/ledger"
	"github.com/deltagym/deltagym/server/ledger/pgserver"
	"github.com/deltagym/deltagym/server/openenv"
	"github.com/deltagym/deltagym/server/swerex"
	"github.com/deltagym/deltagym/server/webui"
)

// Server is a running deltagym service: the sandbox runtime, the env pools, the ledger and the
// RPC handler over them.
type Server struct {
	cfg       Config
	log       *slog.Logger
	rt        *sandbox.Runtime
	pools     *envpool.Manager
	pg        *pgserver.Server
	writer    *ledger.Writer
	store     *ledger.Store
	obs       *observability
	handler   http.Handler
	scrubbers [][2]string
	token     string // the bearer token clients send; "" with auth off
	imports   *importRoot

	peers   *deltagym.Cluster // the cluster's nodes (--peers); nil without
	openenv *openenv.Handler  // nil until the handler is built
	swerex  *swerex.Handler   // nil until the handler is built
	core    *episode.Core
	coreSet chan struct{} // closed once core is set: the runtime's expiry hook reads it then
	regMu   sync.Mutex    // serialises RegisterEnv's keeping of specs

	mu sync.Mutex
	// +checklocks:mu
	httpSrvs []*http.Server
	// +checklocks:mu
	closing bool // Close has begun: Serve refuses to start

	closeOnce sync.Once
	closeErr  error
}

// New starts the runtime, imports the default image if needed, loads the catalog, starts the
// ledger (and the private Postgres unless Config.DatabaseURL or NoLedger) and builds the
// handler. Close undoes it.
func New(ctx context.Context, cfg Config) (_ *Server, err error) {
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	s := &Server{cfg: cfg, log: cfg.Logger}
	s.scrubbers = [][2]string{{cfg.Import.Root, "$IMPORTS"}, {cfg.DataDir, "$DATA"}}
	if abs, err := filepath.Abs(cfg.EnvsDir); err == nil {
		s.scrubbers = append(s.scrubbers, [2]string{abs, "$ENVS"})
	}
	// The helpers' host paths (CRIU's private prefix, the init), which their errors name.
	if dir := filepath.Dir(filepath.Dir(cfg.CRIU)); filepath.IsAbs(cfg.CRIU) && dir != "/" {
		s.scrubbers = append(s.scrubbers, [2]string{dir, "$CRIU"})
	}
	if filepath.IsAbs(cfg.InitBinary) {
		s.scrubbers = append(s.scrubbers, [2]string{cfg.InitBinary, "$INIT"})
	}
	defer func() {
		if err != nil {
			_ = s.Close(context.WithoutCancel(ctx))
		}
	}()
	if err := checkDataDir(cfg.DataDir); err != nil {
		return nil, err
	}
	if err := s.identify(ctx); err != nil {
		return nil, err
	}
	if s.imports, err = openImportRoot(cfg.Import.Root, cfg.Import.MaxBytes); err != nil {
		return nil, err
	}
	specs, err := envpool.LoadDir(cfg.EnvsDir)
	if err != nil {
		return nil, fmt.Errorf("loading env catalog: %w", err)
	}
	if specs, err = s.withRegistered(specs); err != nil {
		return nil, err
	}
	if s.obs, err = newObservability(); err != nil {
		return nil, err
	}
	// Descriptors: every sandbox holds some of the server's, and the caps derive from the limit.
	if _, err := sandbox.RaiseNoFile(); err != nil {
		s.log.Warn("raising the descriptor limit", "err", err)
	}
	rcfg := sandbox.Config{DataDir: filepath.Join(cfg.DataDir, "sandbox"), Node: s.cfg.Cluster.Node, DigestAhead: cfg.Cluster.DigestAhead || cfg.Cluster.Peers != "", InitBinary: cfg.InitBinary, CRIU: cfg.CRIU,
		CgroupRoot: cfg.CgroupRoot, KeepCgroupOptions: cfg.KeepCgroupOptions, ForkAtRestore: cfg.ForkAtRestore, Logger: cfg.Logger}
	cfg.Admission.runtimeConfig(&rcfg, sandbox.ReadHost())
	s.coreSet = make(chan struct{})
	s.runtimeHooks(&rcfg)
	s.rt, err = sandbox.New(ctx, rcfg)
	if err != nil {
		return nil, fmt.Errorf("starting sandbox runtime: %w", err)
	}
	if err := s.importDefaultImage(ctx); err != nil {
		return nil, err
	}
	if err := s.startLedger(ctx); err != nil {
		return nil, err
	}
	if err := s.startEpisodes(specs); err != nil {
		return nil, err
	}
	if err := s.labelFromLedger(ctx); err != nil {
		return nil, err
	}
	s.registerRuntimeMetrics()
	s.handler = s.buildHandler()
	return s, nil
}

// runtimeHooks points the runtime's hooks at the episode core, once it has started.
func (s *Server) runtimeHooks(rcfg *sandbox.Config) {
	rcfg.OnCheckpointExpired = func(id string) {
		select {
		case <-s.coreSet:
			s.core.CheckpointExpired(id)
		default: // expired before the core started: no episode knew it
		}
	}
	rcfg.OnStateDigest = func(id string, d sandbox.StateDigest) {
		select {
		case <-s.coreSet:
			s.core.StateDigest(id, d)
		default: // a checkpoint of the previous run's, recomputed: its digest was recorded then
		}
	}
}

// identify settles the node's name, its token and its peers.
func (s *Server) identify(ctx context.Context) error {
	var err error
	if s.cfg.Cluster.Node, err = nodeName(s.cfg.DataDir, s.cfg.Cluster.Node); err != nil {
		return err
	}
	if err := s.setupAuth(); err != nil {
		return err
	}
	return s.dialPeers(ctx)
}

// startEpisodes starts the episode core and the pools whose sandboxes it hands out.
func (s *Server) startEpisodes(specs []*deltagymv1.EnvSpec) error {
	var rec episode.Recorder
	if s.writer != nil {
		rec = s.writer
	}
	core, err := episode.New(episode.Config{Runtime: s.rt, Ledger: rec, Logger: s.log, Observe: s.obs.op, Internal: isInternal,
		Scrub: s.scrub, Ended: s.rt.Ended(), MaxLeaseTTL: s.cfg.Lease.MaxTTL, Node: s.cfg.Cluster.Node, NodeAddr: s.peerAddr,
		Fetch: s.fetchCheckpoint})
	if err != nil {
		return err
	}
	s.core = core
	close(s.coreSet)
	proxy, err := s.newEgress()
	if err != nil {
		return err
	}
	s.pools, err = envpool.New(envpool.Config{
		Runtime: s.rt, LeaseTTL: s.cfg.Lease.TTL, AcquireTimeout: s.cfg.AcquireTimeout, DefaultPoolSize: s.cfg.DefaultPoolSize,
		Logger: s.log, OnCheckpoint: core.PoolCheckpoint, OnEnd: core.LeaseEnded, OpenVerifierFiles: s.imports.openVerifierFiles, Egress: proxy,
	}, specs)
	if err != nil {
		return err
	}
	core.UsePools(s.pools)
	return nil
}

// labelFromLedger labels the checkpoints whose records keep no place (taken by a server that
// kept places only in its ledger) with the place the ledger knows.
func (s *Server) labelFromLedger(ctx context.Context) error {
	if s.store == nil {
		return nil
	}
	n, err := s.core.LabelFrom(ctx, func(ctx context.Context, id string) (episode.Place, bool, error) {
		p, err := s.store.CheckpointPlace(ctx, id)
		if errors.Is(err, ledger.ErrNotFound) {
			return episode.Place{}, false, nil
		}
		if err != nil {
			return episode.Place{}, false, err
		}
		return episode.Place{Env: p.Env, Episode: p.Episode, Run: p.Run, Group: p.Group, Own: p.Own, Steps: p.Global, Agent: p.Agent}, true, nil
	})
	if n > 0 {
		s.log.Info("checkpoints labelled with their places from the ledger", "checkpoints", n)
	}
	if err != nil {
		// Not fatal: a checkpoint left unlabelled restores as one on no episode's path.
		s.log.Warn("labelling checkpoints from the ledger", "err", err)
	}
	return nil
}

func (s *Server) importDefaultImage(ctx context.Context) error {
	if _, err := s.rt.Image("default"); err == nil {
		return nil
	}
	if _, err := os.Stat(s.cfg.DefaultImageDir); err != nil {
		s.log.Warn("default image not built; envs on image \"default\" stay unready until it is imported (make image)", "dir", s.cfg.DefaultImageDir)
		return nil
	}
	s.log.Info("importing default image", "dir", s.cfg.DefaultImageDir)
	if _, err := s.rt.ImportImage(ctx, "default", s.cfg.DefaultImageDir); err != nil {
		return fmt.Errorf("importing default image: %w", err)
	}
	return nil
}

func (s *Server) startLedger(ctx context.Context) error {
	if s.cfg.NoLedger {
		return nil
	}
	url := s.cfg.DatabaseURL
	if url == "" {
		// Supervised: a postmaster that dies (the OOM killer, a full disk) is started again,
		// and the writer delivers what its spool kept meanwhile.
		// Its memory is capped (Config.PostgresMemoryMB), its files' page cache included.
		pg, err := pgserver.StartConfig(ctx, pgserver.Config{DataDir: filepath.Join(s.cfg.DataDir, "pg"), BinDirs: s.cfg.PostgresBinDirs,
			Supervise: true, Logger: s.log, MemoryLimit: s.cfg.postgresMemoryLimit()})
		if err != nil {
			return fmt.Errorf("starting private postgres: %w", err)
		}
		s.pg = pg
		url = pg.URL()
	}
	applied, err := ledger.MigrateURL(ctx, url)
	if err != nil {
		return fmt.Errorf("migrating ledger: %w", err)
	}
	if len(applied) > 0 {
		s.log.Info("ledger schema migrated", "applied", applied)
	}
	w, err := ledger.NewWriter(ledger.Config{URL: url, SpoolDir: filepath.Join(s.cfg.DataDir, "spool"), VacuumSteps: s.cfg.LedgerVacuumSteps,
		Sync: s.cfg.LedgerSync, PageCache: !s.cfg.LedgerSync, Logger: s.log})
	if err != nil {
		return fmt.Errorf("starting ledger writer: %w", err)
	}
	s.writer = w
	acked := "once in the spool's page cache: a server crash keeps them, a host crash may not (--ledger-sync fsyncs them)"
	if s.cfg.LedgerSync {
		acked = "once fsynced in the spool"
	}
	s.log.Info("ledger writer started", "ledger_sync", s.cfg.LedgerSync, "rows_acknowledged", acked)
	if s.store, err = ledger.Open(ctx, url, w); err != nil {
		return fmt.Errorf("opening ledger: %w", err)
	}
	// A crash left the episodes of the previous run's sandboxes running; they ended with it.
	if ended := s.rt.Ended(); len(ended) > 0 {
		s.ledgerErr(w.SandboxesEnded(ended, time.Time{}))
	}
	return nil
}

// DatabaseURL returns the ledger's Postgres URL ("" without a ledger).
func (s *Server) DatabaseURL() string {
	switch {
	case s.cfg.DatabaseURL != "":
		return s.cfg.DatabaseURL
	case s.pg != nil:
		return s.pg.URL()
	}
	return ""
}

// Runtime returns the server's sandbox runtime (for tests and tools in the same process).
func (s *Server) Runtime() *sandbox.Runtime { return s.rt }

// Pools returns the server's env pools.
func (s *Server) Pools() *envpool.Manager { return s.pools }

// Ledger returns the ledger store (nil without a ledger).
func (s *Server) Ledger() *ledger.Store { return s.store }

// compressMinBytes is the smallest response a server compresses when the client accepts it.
const compressMinBytes = 32 << 10

func (s *Server) buildHandler() http.Handler {
	opts := []connect.HandlerOption{
		connect.WithReadMaxBytes(s.cfg.MaxRequestBytes),
		// No answer is unbounded: one past the cap fails ResourceExhausted rather than being sent.
		connect.WithSendMaxBytes(ResponseCap(s.cfg.MaxRequestBytes)),
		// Small responses go uncompressed: gzip costs more CPU than the bytes it saves (resetting
		// a pooled compressor alone is a measurable share of the server's CPU under a Step load).
		connect.WithCompressMinBytes(compressMinBytes),
		connect.WithInterceptors(s.obs.interceptor(s.log)),
	}
	opts = append(opts, codecs()...)
	mux := http.NewServeMux()
	mux.Handle(deltagymv1connect.NewEnvServiceHandler(&envService{s}, opts...))
	mux.Handle(deltagymv1connect.NewLedgerServiceHandler(&ledgerService{s}, opts...))
	// NodeService answers uncompressed: its big answers, FetchLayer's layers, go between nodes
	// on a fast network, and gzip would cost a node's CPU more time than the bytes take.
	mux.Handle(withSendDeadlines(deltagymv1connect.NewNodeServiceHandler(&nodeService{s}, append(slices.Clone(opts), connect.WithCompression("gzip", nil, nil))...)))
	s.mountSwerex(mux)
	mux.Handle(grpchealth.NewHandler(grpchealth.NewStaticChecker(deltagymv1connect.EnvServiceName, deltagymv1connect.LedgerServiceName, deltagymv1connect.NodeServiceName)))
	reflector := grpcreflect.NewStaticReflector(deltagymv1connect.EnvServiceName, deltagymv1connect.LedgerServiceName, deltagymv1connect.NodeServiceName)
	mux.Handle(grpcreflect.NewHandlerV1(reflector))
	mux.Handle(grpcreflect.NewHandlerV1Alpha(reflector))
	mux.Handle("/metrics", s.obs.metricsHandler())
	s.openenv = openenv.New(openenv.Config{Core: s.core, Pools: s.pools, Log: s.log, Describe: s.describe, Node: s.cfg.Cluster.Node,
		MaxMessageBytes: int64(s.cfg.MaxRequestBytes), LeaseTTL: s.cfg.Lease.TTL, StepCap: s.cfg.OpenEnv.StepCap, MaxSessions: s.cfg.OpenEnv.MaxSessions})
	mux.Handle(openenv.Prefix, s.openenvFirst(s.openenv))
	g := &gate{on: !s.cfg.NoAuth, public: s.cfg.PublicHealth, errw: connect.NewErrorWriter(opts...),
		refuse: s.obs.authRefused, next: capBodies(s.swerexFirst(mux), s.cfg.MaxRequestBytes)}
	if g.on {
		g.want = sha256.Sum256([]byte(s.token))
		g.ui = newUISessions(s.token)
	}
	// The web view: its page (a client of the API above) and its session endpoint.
	mux.Handle(webui.Prefix, webui.Handler())
	mux.Handle(uiSessionPath, &uiSessionHandler{g: g})
	return growStacks(g)
}

// Handler returns the HTTP handler of every service, health, reflection and /metrics.
func (s *Server) Handler() http.Handler { return s.handler }

// idleTimeout closes a connection that has had no request in flight for that long: clients
// that went away leave no descriptors behind (the clients' own HTTP/2 pings keep theirs alive).
const idleTimeout = 2 * time.Minute

// Serve serves on ln (HTTP/1.1 and unencrypted HTTP/2) until Close; it then returns
// http.ErrServerClosed.
func (s *Server) Serve(ln net.Listener) error {
	if s.cfg.NoAuth && !listensOnLoopback(ln) {
		// A name (localhost) may resolve anywhere: what counts is where ln listens.
		ln.Close()
		return fmt.Errorf("serving on %s: %w", ln.Addr(), errNoAuthExposed)
	}
	var p http.Protocols
	p.SetHTTP1(true)
	p.SetUnencryptedHTTP2(true)
	hs := &http.Server{Handler: s.handler, Protocols: &p, ReadHeaderTimeout: 10 * time.Second,
		IdleTimeout: idleTimeout, ErrorLog: slog.NewLogLogger(s.log.Handler(), slog.LevelWarn)}
	s.mu.Lock()
	if s.closing {
		// Close ran first (a Serve started in a goroutine just before it):
		// it could not shut this one down.
		s.mu.Unlock()
		ln.Close()
		return http.ErrServerClosed
	}
	s.httpSrvs = append(s.httpSrvs, hs)
	s.mu.Unlock()
	return hs.Serve(ln)
}

// Close drains in-flight calls (until ctx ends), frees every sandbox, flushes the ledger and
// stops the private Postgres. It is idempotent.
func (s *Server) Close(ctx context.Context) error {
	s.closeOnce.Do(func() {
		var errs []error
		s.mu.Lock()
		s.closing = true
		srvs := s.httpSrvs
		s.mu.Unlock()
		if s.openenv != nil {
			// Its WebSockets are hijacked connections, which the HTTP servers' shutdown leaves be.
			s.openenv.Close(ctx)
		}
		for _, hs := range srvs {
			if err := hs.Shutdown(ctx); err != nil {
				errs = append(errs, fmt.Errorf("draining http: %w", err))
				_ = hs.Close()
			}
		}
		if s.pools != nil {
			errs = append(errs, s.pools.Close(ctx))
		}
		if s.rt != nil {
			errs = append(errs, s.rt.Close(ctx))
		}
		if s.store != nil {
			s.store.Close()
		}
		if s.writer != nil {
			errs = append(errs, s.writer.Close(ctx))
		}
		if s.pg != nil {
			errs = append(errs, s.pg.Stop(context.WithoutCancel(ctx)))
		}
		if s.obs != nil {
			errs = append(errs, s.obs.shutdown(ctx))
		}
		if s.imports != nil {
			errs = append(errs, s.imports.Close())
		}
		if s.peers != nil {
			errs = append(errs, s.peers.Close())
		}
		s.closeErr = errors.Join(errs...)
	})
	return s.closeErr
}

// Run starts a Server on cfg.Addr and serves until ctx is cancelled, then shuts down
// gracefully within cfg.ShutdownTimeout (see Close).
func Run(ctx context.Context, cfg Config) error {
	s, err := New(ctx, cfg)
	if err != nil {
		return err
	}
	ln, err := net.Listen("tcp", s.cfg.Addr)
	if err != nil {
		_ = s.Close(context.WithoutCancel(ctx))
		return fmt.Errorf("listening on %s: %w", s.cfg.Addr, err)
	}
	s.log.Info("deltagym serving", "node", s.cfg.Cluster.Node, "addr", ln.Addr().String(), "data", s.cfg.DataDir, "ledger", s.writer != nil, "auth", !s.cfg.NoAuth,
		"openenv", openenv.Prefix+"{env}", "swerex", "/swerex/{sandbox_id}")
	errc := make(chan error, 1)
	go func() { errc <- s.Serve(ln) }()
	var serveErr error
	select {
	case <-ctx.Done():
	case serveErr = <-errc:
	}
	if d := s.cfg.Cluster.DrainTimeout; d > 0 && serveErr == nil {
		s.BeginDrain()
		dctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), d)
		if left := s.Drained(dctx); left > 0 {
			s.log.Warn("drain timed out: ending the sandboxes still leased", "leased", left, "after", d)
		}
		cancel()
	}
	s.log.Info("shutting down")
	start := time.Now()
	kept := s.rt.Checkpoints()
	sctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), s.cfg.ShutdownTimeout)
	defer cancel()
	err = s.Close(sctx)
	if serveErr != nil && !errors.Is(serveErr, http.ErrServerClosed) {
		err = errors.Join(fmt.Errorf("serving: %w", serveErr), err)
	}
	if err == nil {
		s.log.Info("stopped: sandboxes ended, checkpoints kept for the next start", "checkpoints", kept, "data", s.cfg.DataDir, "took", time.Since(start).Round(time.Millisecond))
	}
	return err
}

func (s *Server) ledgerErr(err error) {
	if err != nil {
		s.log.Warn("recording to ledger", "err", err)
	}
}
