package deltagym

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"fmt"
	"math"
	"net"
	"net/http"
	"net/url"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"time"

	"connectrpc.com/connect"

	deltagymv1 "github.com/deltagym/deltagym/clients/go/gen/deltagym/v1"
	"github.com/deltagym/deltagym/clients/go/gen/deltagym/v1/deltagymv1connect"
)

// DefaultAddr is the server address used when Dial is given none and
// $DELTAGYM_ADDR is unset.
const DefaultAddr = "127.0.0.1:8080"

// Environment variables read by Dial.
const (
	// EnvAddr names the variable holding the default server address.
	EnvAddr = "DELTAGYM_ADDR"
	// EnvToken names the variable holding the default bearer token.
	EnvToken = "DELTAGYM_TOKEN"
	// EnvTokenFile names the variable holding the path of a file with the bearer token.
	EnvTokenFile = "DELTAGYM_TOKEN_FILE"
	// EnvData names the variable holding the server's data directory, whose file "token"
	// holds the token the server generated.
	EnvData = "DELTAGYM_DATA"
)

// DefaultDataDir is the data directory of a server started from the working directory
// (`make run`, `deltagym serve`) when $DELTAGYM_DATA is unset.
const DefaultDataDir = ".data"

// ResolveToken returns the bearer token a client sends when it is given none, from the first
// of: $DELTAGYM_TOKEN; the file named by $DELTAGYM_TOKEN_FILE (an error when it cannot be
// read); the file "token" in the server's data directory ($DELTAGYM_DATA, else .data), which
// the server writes when it is started without a token, if this user may read it. "" means
// none was found.
func ResolveToken() (string, error) {
	if tok := os.Getenv(EnvToken); tok != "" {
		return tok, nil
	}
	if p := os.Getenv(EnvTokenFile); p != "" {
		b, err := os.ReadFile(p)
		if err != nil {
			return "", fmt.Errorf("reading the token file of $%s: %w", EnvTokenFile, err)
		}
		return strings.TrimSpace(string(b)), nil
	}
	data := os.Getenv(EnvData)
	if data == "" {
		data = DefaultDataDir
	}
	b, err := os.ReadFile(filepath.Join(data, "token"))
	if err != nil {
		return "", nil // no server here, or not this user's to read: calls say unauthenticated
	}
	return strings.TrimSpace(string(b)), nil
}

// Option configures a Client.
type Option func(*config)

type config struct {
	token       string
	tokenSet    bool
	grpc        bool
	protoJSON   bool
	httpClient  connect.HTTPClient
	attempts    int
	backoff     time.Duration
	maxBackoff  time.Duration
	connectOpts []connect.ClientOption

	// A Cluster's settings (DialCluster); Dial ignores them.
	refresh   time.Duration
	resolver  *net.Resolver
	onRefresh func() // test hook, called after each refresh
	// node watches every attempt of a call to one node of a Cluster, innermost; nil for a
	// Client of its own.
	node connect.Interceptor
}

// WithToken sends token as a bearer token on every call. Without it, Dial uses
// ResolveToken, and when that finds none, an unauthenticated error says where
// the client looked; an empty token sends no Authorization header.
func WithToken(token string) Option {
	return func(c *config) { c.token, c.tokenSet = token, true }
}

// WithGRPC makes the client speak the gRPC protocol instead of Connect.
func WithGRPC() Option { return func(c *config) { c.grpc = true } }

// WithProtoJSON makes the client send and receive JSON instead of binary
// Protobuf (Connect or gRPC framing alike).
func WithProtoJSON() Option { return func(c *config) { c.protoJSON = true } }

// WithHTTPClient replaces the default HTTP client, which speaks HTTP/2 over
// cleartext (h2c) to http:// addresses and HTTP/2 over TLS to https:// ones.
// gRPC needs HTTP/2.
func WithHTTPClient(hc connect.HTTPClient) Option {
	return func(c *config) { c.httpClient = hc }
}

// WithRetry sets how many times in all a call that is safe to retry is
// attempted when the server is Unavailable (default 4; 1 disables retries),
// and the first delay between attempts (default 50ms), which doubles up to 2s
// with random jitter.
func WithRetry(attempts int, backoff time.Duration) Option {
	return func(c *config) { c.attempts, c.backoff = attempts, backoff }
}

// WithConnectOptions adds connect-go client options (interceptors,
// compression, size limits) to both service clients.
func WithConnectOptions(opts ...connect.ClientOption) Option {
	return func(c *config) { c.connectOpts = append(c.connectOpts, opts...) }
}

// Client is a connection to one deltagym server. It is safe for concurrent
// use. Close it to stop the heartbeats of its sandboxes and free idle
// connections.
type Client struct {
	baseURL string
	env     deltagymv1connect.EnvServiceClient
	ledger  deltagymv1connect.LedgerServiceClient
	nodes   deltagymv1connect.NodeServiceClient
	ownHTTP *http.Client
	dialer  *shutDialer // ownHTTP's

	mu sync.Mutex
	// +checklocks:mu
	closed bool
	// +checklocks:mu
	keepalive map[*Sandbox]struct{}
}

// Dial returns a Client for the server at addr: "host:port" (spoken to over
// cleartext HTTP/2), or an http:// or https:// URL. An empty addr means
// $DELTAGYM_ADDR, or DefaultAddr when that is unset. Dial does not contact
// the server; the first call does.
func Dial(addr string, opts ...Option) (*Client, error) {
	cfg := config{attempts: 4, backoff: 50 * time.Millisecond, maxBackoff: 2 * time.Second}
	for _, o := range opts {
		o(&cfg)
	}
	if !cfg.tokenSet {
		tok, err := ResolveToken()
		if err != nil {
			return nil, err
		}
		cfg.token = tok
	}
	if cfg.attempts < 1 {
		cfg.attempts = 1
	}
	if cfg.backoff <= 0 {
		cfg.backoff = 50 * time.Millisecond
	}
	base, err := BaseURL(addr)
	if err != nil {
		return nil, err
	}
	c := &Client{baseURL: base, keepalive: make(map[*Sandbox]struct{})}
	hc := cfg.httpClient
	if hc == nil {
		c.ownHTTP, c.dialer = newHTTPClient()
		hc = c.ownHTTP
	}
	var copts []connect.ClientOption
	if cfg.grpc {
		copts = append(copts, connect.WithGRPC())
	}
	if cfg.protoJSON {
		copts = append(copts, connect.WithProtoJSON())
	}
	interceptors := []connect.Interceptor{retryInterceptor{attempts: cfg.attempts, backoff: cfg.backoff, max: cfg.maxBackoff}}
	if cfg.node != nil {
		interceptors = append(interceptors, cfg.node)
	}
	if cfg.token != "" {
		interceptors = append([]connect.Interceptor{bearerInterceptor("Bearer " + cfg.token)}, interceptors...)
	} else if !cfg.tokenSet {
		interceptors = append([]connect.Interceptor{noTokenInterceptor{}}, interceptors...)
	}
	copts = append(copts, connect.WithInterceptors(interceptors...))
	copts = append(copts, cfg.connectOpts...)
	c.env = deltagymv1connect.NewEnvServiceClient(hc, base, copts...)
	c.ledger = deltagymv1connect.NewLedgerServiceClient(hc, base, copts...)
	c.nodes = deltagymv1connect.NewNodeServiceClient(hc, base, copts...)
	return c, nil
}

// BaseURL turns a server address as Dial takes it into the base URL of the
// API. It is exported for tools (such as the CLI) that print or reuse it.
func BaseURL(addr string) (string, error) {
	if addr == "" {
		addr = os.Getenv(EnvAddr)
	}
	if addr == "" {
		addr = DefaultAddr
	}
	if IsClusterTarget(addr) {
		return "", fmt.Errorf("%w %q: a cluster (dns:NAME:PORT or a comma-separated list) is dialled with DialCluster", ErrBadAddress, addr)
	}
	if !strings.Contains(addr, "://") {
		if _, _, err := net.SplitHostPort(addr); err != nil {
			return "", fmt.Errorf("%w %q: want host:port or an http(s):// URL", ErrBadAddress, addr)
		}
		addr = "http://" + addr
	}
	u, err := url.Parse(addr)
	if err != nil {
		return "", fmt.Errorf("%w %q: %v", ErrBadAddress, addr, err)
	}
	if (u.Scheme != "http" && u.Scheme != "https") || u.Host == "" {
		return "", fmt.Errorf("%w %q: want host:port or an http(s):// URL", ErrBadAddress, addr)
	}
	return strings.TrimSuffix(u.String(), "/"), nil
}

// newHTTPClient returns a client that speaks HTTP/2 only: with prior knowledge
// over cleartext for http:// URLs, over TLS for https:// ones; and its dialer,
// which a Close of the Client shuts.
func newHTTPClient() (*http.Client, *shutDialer) {
	var protocols http.Protocols
	protocols.SetUnencryptedHTTP2(true)
	protocols.SetHTTP2(true)
	dialer := &shutDialer{d: net.Dialer{Timeout: 10 * time.Second, KeepAlive: 30 * time.Second}}
	return &http.Client{Transport: &http.Transport{
		Protocols:   &protocols,
		DialContext: dialer.DialContext,
		HTTP2: &http.HTTP2Config{
			// Detect a dead connection rather than hang on it.
			SendPingTimeout: 30 * time.Second,
			PingTimeout:     15 * time.Second,
		},
		TLSHandshakeTimeout: 10 * time.Second,
	}}, dialer
}

// shutDialer is the dialer of a Client's own HTTP client, which the Client's Close shuts so
// that no connection outlives it (each keeps a reader goroutine until the server closes it):
// the connections it made are closed, in use or not, and one a call began to dial before the
// shut and made after it is closed at once.
type shutDialer struct {
	d  net.Dialer
	mu sync.Mutex
	// +checklocks:mu
	shut bool
	// +checklocks:mu
	conns map[*shutConn]struct{}
}

// DialContext dials as net.Dialer does, unless the dialer is shut.
func (s *shutDialer) DialContext(ctx context.Context, network, addr string) (net.Conn, error) {
	conn, err := s.d.DialContext(ctx, network, addr)
	if err != nil {
		return nil, err
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.shut {
		conn.Close()
		return nil, ErrClientClosed
	}
	c := &shutConn{Conn: conn, s: s}
	if s.conns == nil {
		s.conns = map[*shutConn]struct{}{}
	}
	s.conns[c] = struct{}{}
	return c, nil
}

// shutDown closes every connection the dialer made and makes every later dial fail.
func (s *shutDialer) shutDown() {
	s.mu.Lock()
	s.shut = true
	conns := s.conns
	s.conns = nil
	s.mu.Unlock()
	for c := range conns {
		_ = c.Conn.Close()
	}
}

// shutConn is a connection of a shutDialer, which forgets it when it is closed.
type shutConn struct {
	net.Conn
	s *shutDialer
}

func (c *shutConn) Close() error {
	c.s.mu.Lock()
	delete(c.s.conns, c)
	c.s.mu.Unlock()
	return c.Conn.Close()
}

// Addr returns the base URL of the server.
func (c *Client) Addr() string { return c.baseURL }

// EnvService returns the generated EnvService client this Client wraps, with
// its authentication and retry policy, for calls this package does not wrap.
func (c *Client) EnvService() deltagymv1connect.EnvServiceClient { return c.env }

// LedgerService returns the generated LedgerService client this Client wraps.
func (c *Client) LedgerService() deltagymv1connect.LedgerServiceClient { return c.ledger }

// NodeService returns the generated NodeService client this Client wraps.
func (c *Client) NodeService() deltagymv1connect.NodeServiceClient { return c.nodes }

// GetNode returns the server's report of itself: its node name, address, version and load.
func (c *Client) GetNode(ctx context.Context) (*deltagymv1.NodeInfo, error) {
	if err := c.checkOpen(); err != nil {
		return nil, err
	}
	res, err := c.nodes.GetNode(ctx, connect.NewRequest(&deltagymv1.GetNodeRequest{}))
	if err != nil {
		return nil, fmt.Errorf("asking for the node's report: %w", err)
	}
	return res.Msg.GetNode(), nil
}

// Close stops the heartbeats of every Sandbox of this client (the sandboxes
// themselves stay open on the server until closed or reaped) and closes its
// connections (with its own HTTP client: those of calls still in flight too, which
// fail). Close is idempotent; calls after it fail with ErrClientClosed.
func (c *Client) Close() error {
	c.mu.Lock()
	if c.closed {
		c.mu.Unlock()
		return nil
	}
	c.closed = true
	handles := make([]*Sandbox, 0, len(c.keepalive))
	for s := range c.keepalive {
		handles = append(handles, s)
	}
	c.mu.Unlock()
	for _, s := range handles {
		s.stopKeepAlive()
	}
	if c.ownHTTP != nil {
		c.dialer.shutDown()
		c.ownHTTP.CloseIdleConnections()
	}
	return nil
}

func (c *Client) checkOpen() error {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.closed {
		return ErrClientClosed
	}
	return nil
}

// NewIdempotencyKey returns a random key for Reset or Fork.
func NewIdempotencyKey() string {
	var b [16]byte
	_, _ = rand.Read(b[:]) // crypto/rand.Read never fails on Linux.
	return hex.EncodeToString(b[:])
}

// ListEnvs returns the server's env catalog with the state of each warm pool.
func (c *Client) ListEnvs(ctx context.Context) ([]*deltagymv1.EnvInfo, error) {
	if err := c.checkOpen(); err != nil {
		return nil, err
	}
	res, err := c.env.ListEnvs(ctx, connect.NewRequest(&deltagymv1.ListEnvsRequest{}))
	if err != nil {
		return nil, fmt.Errorf("listing envs: %w", err)
	}
	return res.Msg.GetEnvs(), nil
}

// RegisterEnv adds spec to the catalog (replacing an env of the same name when
// replace is set) and returns the registered env.
func (c *Client) RegisterEnv(ctx context.Context, spec *deltagymv1.EnvSpec, replace bool) (*deltagymv1.EnvInfo, error) {
	if err := c.checkOpen(); err != nil {
		return nil, err
	}
	res, err := c.env.RegisterEnv(ctx, connect.NewRequest(&deltagymv1.RegisterEnvRequest{Spec: spec, Replace: replace}))
	if err != nil {
		return nil, fmt.Errorf("registering env %q: %w", spec.GetName(), err)
	}
	return res.Msg.GetEnv(), nil
}

// ImportImage imports a base image from a path on the server's filesystem.
func (c *Client) ImportImage(ctx context.Context, req *deltagymv1.ImportImageRequest) (*deltagymv1.ImportImageResponse, error) {
	if err := c.checkOpen(); err != nil {
		return nil, err
	}
	res, err := c.env.ImportImage(ctx, connect.NewRequest(req))
	if err != nil {
		return nil, fmt.Errorf("importing image %q: %w", req.GetName(), err)
	}
	return res.Msg, nil
}

// EpisodeOption sets a field of a Reset or a Fork. Options that do not apply
// to a call (a seed on Fork) are ignored.
type EpisodeOption func(*episodeConfig)

type episodeConfig struct {
	seed         *int64
	options      map[string]string
	run, group   string
	key          string
	freshEntropy bool
	leaseTTL     time.Duration
}

// WithSeed sets the Reset seed, handed to the env's reset hook as
// DELTAGYM_SEED and recorded in the episode.
func WithSeed(seed int64) EpisodeOption { return func(e *episodeConfig) { e.seed = &seed } }

// WithTaskOption adds a Reset option, handed to the env's reset hook as the
// environment variable key.
func WithTaskOption(key, value string) EpisodeOption {
	return func(e *episodeConfig) {
		if e.options == nil {
			e.options = make(map[string]string)
		}
		e.options[key] = value
	}
}

// WithRun names the run of the episodes started.
func WithRun(run string) EpisodeOption { return func(e *episodeConfig) { e.run = run } }

// WithGroup names the group (a GRPO group) of the episodes started.
func WithGroup(group string) EpisodeOption { return func(e *episodeConfig) { e.group = group } }

// WithIdempotencyKey sets the idempotency key instead of a generated one: a
// second call with the same key returns the first call's sandboxes.
func WithIdempotencyKey(key string) EpisodeOption { return func(e *episodeConfig) { e.key = key } }

// WithFreshEntropy gives each child of a Fork distinct randomness.
func WithFreshEntropy() EpisodeOption { return func(e *episodeConfig) { e.freshEntropy = true } }

// WithLeaseTTL sets the lease TTL of the sandboxes started (lease_ttl_seconds: up to the
// server's --max-lease-ttl); 0, the server's --lease-ttl.
func WithLeaseTTL(d time.Duration) EpisodeOption { return func(e *episodeConfig) { e.leaseTTL = d } }

func episodeOptions(opts []EpisodeOption) episodeConfig {
	var e episodeConfig
	for _, o := range opts {
		o(&e)
	}
	if e.key == "" {
		e.key = NewIdempotencyKey()
	}
	return e
}

// Reset takes a warm sandbox of env from the server's pool and starts an
// episode in it. The call carries an idempotency key (generated unless
// WithIdempotencyKey gives one), so it is retried safely when the server is
// Unavailable.
func (c *Client) Reset(ctx context.Context, env string, opts ...EpisodeOption) (*Sandbox, error) {
	if err := c.checkOpen(); err != nil {
		return nil, err
	}
	e := episodeOptions(opts)
	res, err := c.env.Reset(ctx, connect.NewRequest(&deltagymv1.ResetRequest{
		Env:             env,
		Seed:            e.seed,
		Options:         e.options,
		IdempotencyKey:  e.key,
		Run:             e.run,
		GroupId:         e.group,
		LeaseTtlSeconds: e.leaseTTL.Seconds(),
	}))
	if err != nil {
		return nil, fmt.Errorf("reset of env %q: %w", env, err)
	}
	m := res.Msg
	s := c.Sandbox(m.GetSandboxId())
	s.reset = m
	s.mu.Lock()
	s.episodeID = m.GetEpisodeId()
	s.startCheckpoint = m.GetCheckpointId()
	if t := m.GetLeaseExpireTime(); t != nil {
		s.leaseExpiry = t.AsTime()
	}
	s.mu.Unlock()
	return s, nil
}

// ForkResult is the outcome of a Fork.
type ForkResult struct {
	// CheckpointID is the checkpoint the children start from.
	CheckpointID string
	// Sandboxes are the children, each with its own episode.
	Sandboxes []*Sandbox
}

// Fork creates n sandboxes at the state of checkpoint checkpointID. Like
// Reset, it carries an idempotency key and is retried safely.
func (c *Client) Fork(ctx context.Context, checkpointID string, n int, opts ...EpisodeOption) (*ForkResult, error) {
	req := &deltagymv1.ForkRequest{Source: &deltagymv1.ForkRequest_CheckpointId{CheckpointId: checkpointID}}
	res, err := c.fork(ctx, req, n, opts)
	if err != nil {
		return nil, fmt.Errorf("fork of checkpoint %s: %w", checkpointID, err)
	}
	return res, nil
}

func (c *Client) fork(ctx context.Context, req *deltagymv1.ForkRequest, n int, opts []EpisodeOption) (*ForkResult, error) {
	if err := c.checkOpen(); err != nil {
		return nil, err
	}
	e := episodeOptions(opts)
	req.N = int32(min(max(n, math.MinInt32), math.MaxInt32)) // the server rejects n < 1
	req.GroupId = e.group
	req.Run = e.run
	req.IdempotencyKey = e.key
	req.FreshEntropy = e.freshEntropy
	req.LeaseTtlSeconds = e.leaseTTL.Seconds()
	res, err := c.env.Fork(ctx, connect.NewRequest(req))
	if err != nil {
		return nil, err
	}
	m := res.Msg
	out := &ForkResult{CheckpointID: m.GetCheckpointId()}
	for i, id := range m.GetSandboxIds() {
		s := c.Sandbox(id)
		s.mu.Lock()
		if i < len(m.GetEpisodeIds()) {
			s.episodeID = m.GetEpisodeIds()[i]
		}
		s.startCheckpoint = m.GetCheckpointId()
		s.mu.Unlock()
		out.Sandboxes = append(out.Sandboxes, s)
	}
	return out, nil
}

// ReleaseCheckpoint drops the caller's hold on a checkpoint.
func (c *Client) ReleaseCheckpoint(ctx context.Context, checkpointID string) error {
	if err := c.checkOpen(); err != nil {
		return err
	}
	if _, err := c.env.ReleaseCheckpoint(ctx, connect.NewRequest(&deltagymv1.ReleaseCheckpointRequest{CheckpointId: checkpointID})); err != nil {
		return fmt.Errorf("releasing checkpoint %s: %w", checkpointID, err)
	}
	return nil
}

// DiffOption sets a field of a DiffCheckpoints call.
type DiffOption func(*deltagymv1.DiffCheckpointsRequest)

// WithDiffDetail says how much to tell of each changed file: paths (the
// default), line counts, or unified diffs too.
func WithDiffDetail(d deltagymv1.DiffDetail) DiffOption {
	return func(r *deltagymv1.DiffCheckpointsRequest) { r.Detail = d }
}

// WithDiffPath keeps the changes at an absolute path and below it only.
func WithDiffPath(path string) DiffOption {
	return func(r *deltagymv1.DiffCheckpointsRequest) { r.Path = path }
}

// WithMaxPaths bounds the path changes returned (the server's default is
// 10,000); past it the response is truncated.
func WithMaxPaths(n int) DiffOption {
	return func(r *deltagymv1.DiffCheckpointsRequest) { r.MaxPaths = int32(min(n, math.MaxInt32)) }
}

// DiffCheckpoints compares checkpoint checkpointID against base, both of one
// env: the paths added, removed and changed, and the processes that differ.
func (c *Client) DiffCheckpoints(ctx context.Context, base, checkpointID string, opts ...DiffOption) (*deltagymv1.DiffCheckpointsResponse, error) {
	if err := c.checkOpen(); err != nil {
		return nil, err
	}
	req := &deltagymv1.DiffCheckpointsRequest{BaseCheckpointId: base, CheckpointId: checkpointID}
	for _, o := range opts {
		o(req)
	}
	res, err := c.env.DiffCheckpoints(ctx, connect.NewRequest(req))
	if err != nil {
		return nil, fmt.Errorf("diff of checkpoint %s against %s: %w", checkpointID, base, err)
	}
	return res.Msg, nil
}

// HeartbeatResult is the outcome of a Heartbeat.
type HeartbeatResult struct {
	// Leases maps each live sandbox asked about to its new lease expiry.
	Leases map[string]time.Time
	// Unknown lists the sandboxes asked about that are unknown or closed.
	Unknown []string
}

// Heartbeat renews the leases of the sandboxes with the given IDs.
func (c *Client) Heartbeat(ctx context.Context, sandboxIDs ...string) (*HeartbeatResult, error) {
	if err := c.checkOpen(); err != nil {
		return nil, err
	}
	res, err := c.env.Heartbeat(ctx, connect.NewRequest(&deltagymv1.HeartbeatRequest{SandboxIds: sandboxIDs}))
	if err != nil {
		return nil, fmt.Errorf("heartbeat: %w", err)
	}
	out := &HeartbeatResult{Leases: make(map[string]time.Time, len(res.Msg.GetLeases())), Unknown: res.Msg.GetUnknownSandboxIds()}
	for _, l := range res.Msg.GetLeases() {
		out.Leases[l.GetSandboxId()] = l.GetExpireTime().AsTime()
	}
	return out, nil
}

// SandboxFilter selects sandboxes in ListSandboxes; empty fields match all.
type SandboxFilter struct {
	Env, Run, Group string
}

// ListSandboxes lists the sandboxes leased to clients.
func (c *Client) ListSandboxes(ctx context.Context, f SandboxFilter) ([]*deltagymv1.Sandbox, error) {
	if err := c.checkOpen(); err != nil {
		return nil, err
	}
	res, err := c.env.ListSandboxes(ctx, connect.NewRequest(&deltagymv1.ListSandboxesRequest{Env: f.Env, Run: f.Run, GroupId: f.Group}))
	if err != nil {
		return nil, fmt.Errorf("listing sandboxes: %w", err)
	}
	return res.Msg.GetSandboxes(), nil
}

// CheckpointFilter selects checkpoints in ListCheckpoints; empty fields match all.
type CheckpointFilter struct {
	Env, Run, Group, Episode string
}

// ListCheckpoints lists the checkpoints the server holds, oldest first, with where each was
// taken and what keeps it from expiring.
func (c *Client) ListCheckpoints(ctx context.Context, f CheckpointFilter) ([]*deltagymv1.CheckpointSummary, error) {
	if err := c.checkOpen(); err != nil {
		return nil, err
	}
	res, err := c.env.ListCheckpoints(ctx, connect.NewRequest(&deltagymv1.ListCheckpointsRequest{Env: f.Env, Run: f.Run,
		GroupId: f.Group, EpisodeId: f.Episode}))
	if err != nil {
		return nil, fmt.Errorf("listing checkpoints: %w", err)
	}
	return res.Msg.GetCheckpoints(), nil
}

// Sandbox returns a handle for an existing sandbox, for example one whose ID
// another process printed. It does not contact the server; its EpisodeID is
// empty until a call tells it.
func (c *Client) Sandbox(id string) *Sandbox {
	return &Sandbox{c: c, id: id}
}
