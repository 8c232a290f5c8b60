package episode

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"sync"
	"sync/atomic"
	"time"

	"github.com/deltagym/deltagym/envpool"
	"github.com/deltagym/deltagym/sandbox"
	"github.com/deltagym/deltagym/server/ledger"
)

// Config configures a Core.
type Config struct {
	// Runtime holds the checkpoints. Required.
	Runtime *sandbox.Runtime
	// Ledger records episodes, steps, rewards and checkpoints; nil: none are recorded.
	Ledger Recorder
	// Logger receives warnings (ledger errors, infrastructure failures). Default slog.Default().
	Logger *slog.Logger
	// Observe times one sandbox operation (a span and a histogram); call the function it
	// returns with the operation's error. Default: not timed.
	Observe func(ctx context.Context, op string) (context.Context, func(error))
	// Internal reports whether an error is the server's own fault (the API's Internal code):
	// a step that fails so fails its episode (class infra). Default: Internal.
	Internal func(error) bool
	// Scrub removes host paths from a message that is recorded or returned. Default: none.
	Scrub func(string) string
	// Ended are the sandboxes that ended with the server's previous run: a call on one is told
	// so (NotFound).
	Ended []string
	// EndedFor and EndedMax bound how long and how many closed or reaped sandboxes are
	// remembered, so that a call on one fails as closed (envpool.ErrLeaseEnded) rather than
	// unknown. Defaults 1h and 65,536.
	EndedFor time.Duration
	EndedMax int
	// IdempotencyTTL is how long a Reset's or Fork's idempotency key is remembered. Default 1h.
	IdempotencyTTL time.Duration
	// MaxLeaseTTL bounds the lease TTL a Reset, Fork or Heartbeat asks for. Default 24h.
	MaxLeaseTTL time.Duration
	// Node is this node's name: a call on a sandbox or checkpoint whose ID names another
	// node fails with ErrWrongNode, naming it. Default "": IDs are not checked.
	Node string
	// NodeAddr returns the address of a node of the cluster by name, for ErrWrongNode's
	// message; "" when unknown. Default: none known.
	NodeAddr func(node string) string
	// Fetch makes the runtime hold checkpoint id, whose ID names another node, by fetching it
	// from that node, for a Restore or Fork of it here. Default nil: such a checkpoint is
	// another node's (ErrWrongNode).
	Fetch func(ctx context.Context, id string) error
}

// Validate checks the config and fills in defaults.
func (c *Config) Validate() error {
	if c.Runtime == nil {
		return errors.New("episode: Runtime is required")
	}
	if c.Logger == nil {
		c.Logger = slog.Default()
	}
	if c.Observe == nil {
		c.Observe = func(ctx context.Context, _ string) (context.Context, func(error)) { return ctx, func(error) {} }
	}
	if c.Internal == nil {
		c.Internal = Internal
	}
	if c.Scrub == nil {
		c.Scrub = func(s string) string { return s }
	}
	if c.EndedFor <= 0 {
		c.EndedFor = time.Hour
	}
	if c.EndedMax <= 0 {
		c.EndedMax = 1 << 16
	}
	if c.IdempotencyTTL <= 0 {
		c.IdempotencyTTL = time.Hour
	}
	if c.MaxLeaseTTL <= 0 {
		c.MaxLeaseTTL = DefaultMaxLeaseTTL
	}
	return nil
}

// Core drives the episodes of the sandboxes it hands out.
type Core struct {
	cfg   Config
	rt    *sandbox.Runtime
	pools *envpool.Manager // set once by UsePools, before any call
	rec   Recorder         // nil: no ledger
	log   *slog.Logger

	mu sync.RWMutex
	// +checklocks:mu
	boxes map[string]*box // by sandbox id: the sandboxes handed out and not ended

	gone    *recentIDs      // sandboxes closed or reaped lately
	prevRun map[string]bool // sandboxes that ended with the previous run; read only

	resets *idempotency[ResetResult]
	forks  *idempotency[ForkResult]

	draining atomic.Bool // Drain was called: no new sandboxes

	// relMu orders the core's releases of checkpoints (write) after deduplicating checkpoints
	// (read), so that the checkpoint a dedupe found is held when it is answered.
	relMu sync.RWMutex
}

// New returns a Core. Give it its pools with UsePools before any other call; the pools' hooks
// (PoolCheckpoint, LeaseEnded) may be called before that.
func New(cfg Config) (*Core, error) {
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	c := &Core{cfg: cfg, rt: cfg.Runtime, rec: cfg.Ledger, log: cfg.Logger, boxes: map[string]*box{},
		gone: newRecentIDs(cfg.EndedFor, cfg.EndedMax), prevRun: map[string]bool{},
		resets: newIdempotency[ResetResult](cfg.IdempotencyTTL), forks: newIdempotency[ForkResult](cfg.IdempotencyTTL)}
	for _, id := range cfg.Ended {
		c.prevRun[id] = true
	}
	return c, nil
}

// UsePools gives the core the pools whose sandboxes it hands out. Call it once, before any
// other call but the pools' hooks.
func (c *Core) UsePools(p *envpool.Manager) { c.pools = p }

// lookup finds the live sandbox id.
func (c *Core) lookup(id string) (*box, error) {
	if id == "" {
		return nil, fmt.Errorf("sandbox_id is required: %w", ErrInvalid)
	}
	if err := checkID("sandbox_id", id); err != nil {
		return nil, err
	}
	c.mu.RLock()
	b := c.boxes[id]
	c.mu.RUnlock()
	switch {
	case b != nil:
		return b, nil
	case c.gone.has(id):
		return nil, about(fmt.Errorf("sandbox %s: %w", id, envpool.ErrLeaseEnded), "sandbox_id", id)
	case c.prevRun[id]:
		return nil, about(fmt.Errorf("sandbox %s ended with the server's previous run (its episode failed, class infra); Reset for a new one: %w",
			id, envpool.ErrUnknownSandbox), "sandbox_id", id)
	}
	if err := c.wrongNode("sandbox_id", id); err != nil {
		return nil, err
	}
	return nil, about(fmt.Errorf("sandbox %q: %w", id, envpool.ErrUnknownSandbox), "sandbox_id", id)
}

// adopt starts keeping b.
func (c *Core) adopt(b *box) {
	c.mu.Lock()
	c.boxes[b.lease.ID()] = b
	c.mu.Unlock()
}

// forget stops keeping b (closed or reaped): calls on it fail as closed from now on. It reports
// whether this call forgot it.
func (c *Core) forget(b *box) bool {
	id := b.lease.ID()
	c.mu.Lock()
	mine := c.boxes[id] == b
	if mine {
		delete(c.boxes, id)
	}
	c.mu.Unlock()
	if mine {
		c.gone.add(id)
	}
	return mine
}

// Touch renews the lease of sandbox id and returns its new expiry.
func (c *Core) Touch(id string) (time.Time, error) {
	b, err := c.lookup(id)
	if err != nil {
		return time.Time{}, err
	}
	return b.lease.Touch(), nil
}

// DefaultMaxLeaseTTL is Config.MaxLeaseTTL when unset.
const DefaultMaxLeaseTTL = 24 * time.Hour

// CheckLeaseTTL checks a lease TTL a call asks for: 0 (the sandbox's own, or the pools'
// default) up to Config.MaxLeaseTTL. The wire's NaN and infinities arrive negative.
func (c *Core) CheckLeaseTTL(d time.Duration) error {
	if d < 0 || d > c.cfg.MaxLeaseTTL {
		return fmt.Errorf("lease_ttl_seconds must be a number of seconds from 0 (the default) up to the server's --max-lease-ttl, %v: %w",
			c.cfg.MaxLeaseTTL, ErrInvalid)
	}
	return nil
}

// Renew renews the lease of sandbox id, for ttl from now on when it is positive (checked by
// CheckLeaseTTL) or else its own TTL, and returns its new expiry.
func (c *Core) Renew(id string, ttl time.Duration) (time.Time, error) {
	if err := c.CheckLeaseTTL(ttl); err != nil {
		return time.Time{}, err
	}
	b, err := c.lookup(id)
	if err != nil {
		return time.Time{}, err
	}
	if ttl > 0 {
		return b.lease.SetTTL(ttl), nil
	}
	return b.lease.Touch(), nil
}

// Sandbox describes sandbox id and its episode.
func (c *Core) Sandbox(id string) (SandboxInfo, error) {
	b, err := c.lookup(id)
	if err != nil {
		return SandboxInfo{}, err
	}
	return b.describe(), nil
}

// Sandboxes describes the live sandboxes that f selects, oldest first.
func (c *Core) Sandboxes(f Filter) []SandboxInfo {
	c.mu.RLock()
	boxes := make([]*box, 0, len(c.boxes))
	for _, b := range c.boxes {
		boxes = append(boxes, b)
	}
	c.mu.RUnlock()
	var out []SandboxInfo
	for _, b := range boxes {
		d := b.describe()
		if (f.Env != "" && d.Env != f.Env) || (f.Run != "" && d.Run != f.Run) || (f.Group != "" && d.Group != f.Group) {
			continue
		}
		out = append(out, d)
	}
	sortByCreation(out)
	return out
}

// Close closes sandbox id, truncating its running episode. Closing a closed sandbox succeeds.
func (c *Core) Close(ctx context.Context, id string) error {
	b, err := c.lookup(id)
	if errors.Is(err, envpool.ErrLeaseEnded) {
		return nil
	}
	if err != nil {
		return err
	}
	c.forget(b)
	err = c.pools.CloseLease(ctx, b.lease)
	c.endEpisode(b, ended{status: ledger.StatusTruncated})
	return c.stored(ctx, err)
}

// LeaseEnded is the pools' hook (envpool.Config.OnEnd) for a lease that ended other than by
// Close: its episode is truncated when the lease expired (its client went away and the episode
// just stops there), failed with class infra when the sandbox died under it or the server shut
// down with it running.
func (c *Core) LeaseEnded(l *envpool.Lease, reason string) {
	c.mu.RLock()
	b := c.boxes[l.ID()]
	c.mu.RUnlock()
	if b == nil || b.lease != l {
		c.gone.add(l.ID())
		return
	}
	c.forget(b)
	switch reason {
	case envpool.EndExpired:
		c.endEpisode(b, ended{status: ledger.StatusTruncated})
	case envpool.EndDied:
		c.log.Warn("episode failed: its sandbox died", "sandbox", l.ID(), "env", l.Env().Name())
		c.endEpisode(b, ended{status: ledger.StatusFailed, class: ledger.FailureInfra, msg: "its sandbox died (its init exited)"})
	default:
		c.endEpisode(b, ended{status: ledger.StatusFailed, class: ledger.FailureInfra, msg: "the server shut down while the episode ran"})
	}
}
