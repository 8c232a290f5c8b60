package envpool

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"maps"
	"os"
	"slices"
	"sync"
	"sync/atomic"
	"time"

	deltagymv1 "github.com/deltagym/deltagym/clients/go/gen/deltagym/v1"
	"github.com/deltagym/deltagym/sandbox"
	"github.com/deltagym/deltagym/sandbox/egress"
)

// Config configures a Manager.
type Config struct {
	// Runtime creates and forks the sandboxes. Required unless Backend is set.
	Runtime *sandbox.Runtime
	// Backend, if set, creates and forks the sandboxes instead of Runtime: another
	// implementation of what the Manager uses of a runtime (envpooltest's fake, in tests).
	Backend Backend
	// Clock is the Manager's time (lease expiry, reaper, acquire deadlines). Default the
	// system's.
	Clock Clock
	// LeaseTTL is how long a leased sandbox lives without a call or heartbeat. Default 10m.
	LeaseTTL time.Duration
	// ReapInterval is how often the reaper looks for expired leases: a lease is reaped at most
	// about one interval after it expired. Default LeaseTTL/10, between 10ms and 1s.
	ReapInterval time.Duration
	// AcquireTimeout bounds how long a Reset waits for a warm sandbox before failing with
	// ErrExhausted. Default 10s.
	AcquireTimeout time.Duration
	// DefaultPoolSize is the pool size of envs whose spec says 0. Default 2.
	DefaultPoolSize int
	// DefaultStepTimeout is the step timeout of envs whose limits say 0. Default 30s.
	DefaultStepTimeout time.Duration
	// DefaultOutputBytes is the output cap of envs whose limits say 0. Default 1 MiB.
	DefaultOutputBytes int
	// Logger receives pool and reaper events. Default slog.Default().
	Logger *slog.Logger
	// OnCheckpoint, if set, is called for every checkpoint the Manager takes (pool, task,
	// evaluate), for the ledger. It must not block.
	OnCheckpoint func(env string, kind CheckpointKind, info sandbox.CheckpointInfo)
	// OpenVerifierFiles, if set, opens a directory that an env spec names by
	// evaluation.verifier_files: below the server's import root, resolved so that nothing
	// leads out of it. Without it such an env is refused.
	OpenVerifierFiles func(name string) (*os.File, error)
	// OnEnd, if set, is called once for every lease that ends other than by CloseLease: reaped
	// after its TTL, its sandbox died, or the Manager closed; reason is EndExpired, EndDied or
	// EndShutdown. A reaped lease is still listed while it runs (see reap). It must not block.
	OnEnd func(l *Lease, reason string)
	// Egress serves the outbound connections of envs whose spec allows some. Without it such
	// an env is refused.
	Egress *egress.Proxy
}

// Validate checks the config and fills in defaults.
func (c *Config) Validate() error {
	if c.Backend == nil {
		if c.Runtime == nil {
			return errors.New("envpool: Runtime or Backend is required")
		}
		c.Backend = runtimeBackend{c.Runtime}
	}
	if c.Clock == nil {
		c.Clock = systemClock{}
	}
	if c.LeaseTTL <= 0 {
		c.LeaseTTL = 10 * time.Minute
	}
	if c.ReapInterval <= 0 {
		c.ReapInterval = min(max(c.LeaseTTL/10, 10*time.Millisecond), time.Second)
	}
	if c.AcquireTimeout <= 0 {
		c.AcquireTimeout = 10 * time.Second
	}
	if c.DefaultPoolSize <= 0 {
		c.DefaultPoolSize = 2
	}
	if c.DefaultStepTimeout <= 0 {
		c.DefaultStepTimeout = 30 * time.Second
	}
	if c.DefaultOutputBytes <= 0 {
		c.DefaultOutputBytes = 1 << 20
	}
	if c.Logger == nil {
		c.Logger = slog.Default()
	}
	return nil
}

// Manager owns the catalog, the warm pools and the leases (lock order in the package doc).
type Manager struct {
	cfg   Config
	rt    Backend
	clock Clock
	log   *slog.Logger

	ctx    context.Context // of the pools' goroutines, cancelled by Close
	cancel context.CancelFunc

	mu sync.Mutex
	// +checklocks:mu
	envs map[string]*Env
	// +checklocks:mu
	leases map[string]*Lease
	// +checklocks:mu
	closed bool

	// tearing holds the sandboxes CloseLease closed whose teardown may not be over (their Done
	// not closed yet): Close waits for them.
	// +checklocks:mu
	tearing []Box

	// freed is closed, and replaced, when capacity may have freed (kick), for the pools whose
	// setup waits for it; waiters counts those pools.
	// +checklocks:mu
	freed   chan struct{}
	waiters atomic.Int32

	reaperDone chan struct{}
	reaping    sync.WaitGroup // reaps in progress (sweep)
	retiring   sync.WaitGroup // pools of replaced envs being drained
	discard    sync.WaitGroup // verifiers' sandboxes being destroyed (Pristine)
	watching   sync.WaitGroup // teardowns watched for waiting pools (CloseLease)
	closeOnce  sync.Once
	closeErr   error
}

// New starts a Manager with the given catalog: every env's pool starts warming in the
// background.
func New(cfg Config, specs []*deltagymv1.EnvSpec) (*Manager, error) {
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	ctx, cancel := context.WithCancel(context.Background())
	m := &Manager{cfg: cfg, rt: cfg.Backend, clock: cfg.Clock, log: cfg.Logger, ctx: ctx, cancel: cancel,
		envs: map[string]*Env{}, leases: map[string]*Lease{}, freed: make(chan struct{}), reaperDone: make(chan struct{})}
	for _, s := range specs {
		if _, err := m.Register(s, false); err != nil {
			cancel()
			m.closePools()
			return nil, err
		}
	}
	go m.reap()
	return m, nil
}

// Register adds an env to the catalog and starts warming its pool. With replace, an env of the
// same name is replaced (its pool is drained; its leased sandboxes keep running); without it the
// name must be new (ErrEnvExists).
func (m *Manager) Register(spec *deltagymv1.EnvSpec, replace bool) (*Env, error) {
	return m.register(spec, replace, nil)
}

// errSuperseded: the env to be replaced is no longer the catalog's (register with expect).
var errSuperseded = errors.New("env replaced meanwhile")

// register is Register; with expect, it replaces only that entry, not one registered since.
func (m *Manager) register(spec *deltagymv1.EnvSpec, replace bool, expect *Env) (*Env, error) {
	if err := ValidateSpec(spec); err != nil {
		return nil, err
	}
	if err := m.checkVerifierFiles(spec); err != nil {
		return nil, err
	}
	spec = cloneSpec(spec)
	env := &Env{spec: spec, stepTimeout: m.cfg.DefaultStepTimeout, outputCap: m.cfg.DefaultOutputBytes, tasks: newTaskCache()}
	if err := env.setEgress(m.cfg.Egress); err != nil {
		return nil, err
	}
	if t := spec.GetLimits().GetStepTimeoutSeconds(); t > 0 {
		env.stepTimeout = time.Duration(t * float64(time.Second))
	}
	if o := spec.GetLimits().GetOutputBytes(); o > 0 {
		env.outputCap = int(min(o, 64<<20))
	}
	size := int(spec.GetPoolSize())
	if size == 0 {
		size = m.cfg.DefaultPoolSize
	}
	env.pool = newPool(m, env, size)
	m.mu.Lock()
	if m.closed {
		m.mu.Unlock()
		return nil, ErrClosed
	}
	old := m.envs[spec.GetName()]
	if old != nil && !replace {
		m.mu.Unlock()
		return nil, fmt.Errorf("env %s: %w", spec.GetName(), ErrEnvExists)
	}
	if expect != nil && old != expect {
		m.mu.Unlock()
		return nil, errSuperseded
	}
	m.envs[spec.GetName()] = env
	env.pool.start(m.ctx)
	m.mu.Unlock()
	if old != nil {
		m.retiring.Go(old.pool.close)
	}
	return env, nil
}

// ImageImported restarts the pools of envs on image whose setup failed (typically because the
// image was missing).
func (m *Manager) ImageImported(image string) {
	m.mu.Lock()
	var retry []*Env
	for _, e := range m.envs {
		if e.spec.GetImage() == image && e.Err() != nil {
			retry = append(retry, e)
		}
	}
	m.mu.Unlock()
	for _, e := range retry {
		// Only if it is still the catalog's: a RegisterEnv may have replaced it meanwhile.
		if _, err := m.register(e.spec, true, e); err != nil && !errors.Is(err, errSuperseded) {
			m.log.Warn("rewarming env", "env", e.Name(), "err", err)
		}
	}
}

// Env returns the catalog entry of name.
func (m *Manager) Env(name string) (*Env, error) {
	m.mu.Lock()
	defer m.mu.Unlock()
	e, ok := m.envs[name]
	if !ok {
		return nil, fmt.Errorf("env %q: %w", name, ErrUnknownEnv)
	}
	return e, nil
}

// Envs returns the catalog sorted by name.
func (m *Manager) Envs() []*Env {
	m.mu.Lock()
	defer m.mu.Unlock()
	return slices.SortedFunc(maps.Values(m.envs), func(a, b *Env) int {
		if a.Name() < b.Name() {
			return -1
		}
		if a.Name() > b.Name() {
			return 1
		}
		return 0
	})
}

// EnvForImage returns an env (the first by name) whose image is image, for checkpoints whose env
// the caller does not know.
func (m *Manager) EnvForImage(image string) (*Env, error) {
	for _, e := range m.Envs() {
		if e.spec.GetImage() == image {
			return e, nil
		}
	}
	return nil, fmt.Errorf("no env uses image %q: %w", image, ErrUnknownEnv)
}

// Active returns the number of live leases of the env named name.
func (m *Manager) Active(name string) int {
	m.mu.Lock()
	defer m.mu.Unlock()
	n := 0
	for _, l := range m.leases {
		if l.env.Name() == name {
			n++
		}
	}
	return n
}

// Acquire takes a warm sandbox of env, waiting up to Config.AcquireTimeout (or ctx) for one.
func (m *Manager) Acquire(ctx context.Context, env *Env) (*Lease, error) {
	deadline := m.clock.NewTimer(m.cfg.AcquireTimeout)
	defer deadline.Stop()
	sb, err := env.pool.take(ctx, deadline.C())
	if err != nil {
		return nil, err
	}
	return m.adopt(env, sb)
}

// ForkOptions tunes Fork.
type ForkOptions struct {
	// FreshEntropy gives each child a seed of its own (sandbox.SeedPath).
	FreshEntropy bool
	// FilesOnly starts the children from the checkpoint's files even if it
	// captured processes (sandbox.Spec.FilesOnly).
	FilesOnly bool
	// SkipTemplates starts the children without the processes the
	// checkpoint keeps as templates (sandbox.Spec.SkipTemplates).
	SkipTemplates bool
}

// Fork creates n leased sandboxes of env at checkpoint.
func (m *Manager) Fork(ctx context.Context, env *Env, checkpoint string, n int, o ...ForkOptions) ([]*Lease, error) {
	spec := env.forkSpec()
	for _, x := range o {
		spec.FreshEntropy = spec.FreshEntropy || x.FreshEntropy
		spec.FilesOnly = spec.FilesOnly || x.FilesOnly
		spec.SkipTemplates = spec.SkipTemplates || x.SkipTemplates
	}
	sbs, err := m.rt.Fork(ctx, checkpoint, n, spec)
	if err != nil {
		return nil, fmt.Errorf("forking %d from checkpoint %s: %w", n, checkpoint, err)
	}
	out := make([]*Lease, 0, len(sbs))
	for i, sb := range sbs {
		l, err := m.adopt(env, sb)
		if err != nil {
			for _, rest := range sbs[i:] {
				_ = rest.Destroy(context.WithoutCancel(ctx))
			}
			for _, l := range out {
				_ = m.CloseLease(context.WithoutCancel(ctx), l)
			}
			return nil, err
		}
		out = append(out, l)
	}
	return out, nil
}

func (m *Manager) adopt(env *Env, sb Box) (*Lease, error) {
	l := &Lease{m: m, env: env, box: sb, created: m.clock.Now(), turn: make(chan struct{}, 1), ended: make(chan struct{})}
	l.Touch()
	m.mu.Lock()
	defer m.mu.Unlock()
	if m.closed {
		_ = sb.Destroy(context.Background())
		return nil, ErrClosed
	}
	m.leases[sb.ID()] = l
	return l, nil
}

// Lease returns the live lease of sandbox id.
func (m *Manager) Lease(id string) (*Lease, error) {
	m.mu.Lock()
	l, ok := m.leases[id]
	m.mu.Unlock()
	if !ok {
		return nil, fmt.Errorf("sandbox %q: %w", id, ErrUnknownSandbox)
	}
	return l, nil
}

// Leases returns the live leases.
func (m *Manager) Leases() []*Lease {
	m.mu.Lock()
	defer m.mu.Unlock()
	return slices.Collect(maps.Values(m.leases))
}

// CloseLease aborts the call in progress on the sandbox, closes it (its teardown goes on in the
// background) and ends the lease. Closing an ended lease succeeds.
func (m *Manager) CloseLease(ctx context.Context, l *Lease) error {
	m.mu.Lock()
	if m.leases[l.ID()] == l {
		delete(m.leases, l.ID())
	}
	m.mu.Unlock()
	l.end()
	l.Abort()
	// Close, not Destroy: the sandbox's teardown (saving its checkpoints' templates, ending its
	// processes) is the runtime's background work, never the caller's or the reaper's wait.
	if err := l.box.Close(context.WithoutCancel(ctx)); err != nil {
		return fmt.Errorf("closing sandbox %s: %w", l.ID(), err)
	}
	m.mu.Lock()
	m.tearing = append(slices.DeleteFunc(m.tearing, gone), l.box)
	m.mu.Unlock()
	if m.waiters.Load() > 0 {
		// Its sandbox counts against the caps until its teardown is over.
		m.watching.Go(func() {
			select {
			case <-l.box.Done():
				m.kick()
			case <-m.ctx.Done():
			}
		})
	}
	return nil
}

// capacityFreed returns a channel closed at the next kick.
func (m *Manager) capacityFreed() <-chan struct{} {
	m.mu.Lock()
	defer m.mu.Unlock()
	return m.freed
}

// kick tells the pools whose setup waits for capacity that some may have freed: a sandbox was
// torn down or a checkpoint released. Without such pools it costs an atomic load.
func (m *Manager) kick() {
	if m.waiters.Load() == 0 {
		return
	}
	m.mu.Lock()
	defer m.mu.Unlock()
	close(m.freed)
	m.freed = make(chan struct{})
}

// gone reports whether b's teardown is over.
func gone(b Box) bool {
	select {
	case <-b.Done():
		return true
	default:
		return false
	}
}

// waitTorn waits until the teardown of every sandbox CloseLease closed is over, or ctx is done.
func (m *Manager) waitTorn(ctx context.Context) error {
	m.mu.Lock()
	boxes := slices.Clone(m.tearing)
	m.tearing = nil
	m.mu.Unlock()
	for _, b := range boxes {
		select {
		case <-b.Done():
		case <-ctx.Done():
			return fmt.Errorf("waiting for closed sandboxes to be torn down: %w", ctx.Err())
		}
	}
	return nil
}

// Why a lease ended other than by CloseLease (the reason given to Config.OnEnd).
const (
	// EndExpired: the lease's TTL ran out with no call in flight (its client went away).
	EndExpired = "lease expired"
	// EndDied: the sandbox's init exited, so the sandbox is gone.
	EndDied = "sandbox died"
	// EndShutdown: the Manager was closed with the lease still held.
	EndShutdown = "server shutdown"
)

// reapTurnWait bounds how long the reaper waits for a call on a sandbox it reaps to return.
const reapTurnWait = 5 * time.Second

// reap runs a sweep every ReapInterval until the Manager closes.
func (m *Manager) reap() {
	defer close(m.reaperDone)
	for {
		// Armed after each sweep, not on a ticker: a sweep that outlasts the interval is not
		// followed at once by another.
		t := m.clock.NewTimer(m.cfg.ReapInterval)
		select {
		case <-m.ctx.Done():
			t.Stop()
			return
		case <-t.C():
		}
		m.sweep()
	}
}

// sweep reaps the sandboxes whose lease expired with no call in flight, or whose sandbox died.
// Each reap runs on its own goroutine (Close waits for them): one that waits for a call to stop
// (holdTurn) or for its sandbox to close delays no other lease's.
func (m *Manager) sweep() {
	now := m.clock.Now().UnixNano()
	for _, l := range m.Leases() {
		reason := ""
		select {
		case <-l.box.Done():
			reason = EndDied
		default:
			if l.inflight.Load() == 0 && l.expires.Load() < now {
				reason = EndExpired
			}
		}
		// Ended already: reaped by an earlier sweep (still listed until its CloseLease) or
		// closed by its client.
		if reason == "" || !l.end() {
			continue
		}
		m.reaping.Go(func() { m.reapLease(l, reason) })
	}
}

// reapLease ends lease l, ended already (l.end), for reason.
func (m *Manager) reapLease(l *Lease, reason string) {
	m.log.Info("reaping sandbox", "sandbox", l.ID(), "env", l.env.Name(), "reason", reason)
	// OnEnd before the lease leaves the list, so that a client that sees the sandbox gone
	// finds its episode ended (the server records the end in its ledger there), and with no
	// call running on it: calls from now on are refused, the one in progress is cut short,
	// and OnEnd runs holding the sandbox's turn (waiting at most reapTurnWait for a call
	// that does not stop).
	l.Abort()
	held := m.holdTurn(l)
	if m.cfg.OnEnd != nil {
		m.cfg.OnEnd(l, reason)
	}
	if held {
		<-l.turn
	}
	if err := m.CloseLease(m.ctx, l); err != nil {
		m.log.Warn("reaping sandbox", "sandbox", l.ID(), "err", err)
	}
}

// holdTurn takes l's turn, waiting at most reapTurnWait (or until Close) for the call that
// holds it, and reports whether it did.
func (m *Manager) holdTurn(l *Lease) bool {
	select {
	case l.turn <- struct{}{}:
		return true
	default:
	}
	w := m.clock.NewTimer(reapTurnWait)
	defer w.Stop()
	select {
	case l.turn <- struct{}{}:
		return true
	case <-w.C():
	case <-m.ctx.Done():
	}
	return false
}

func (m *Manager) reportCheckpoint(env string, kind CheckpointKind, info sandbox.CheckpointInfo) {
	if m.cfg.OnCheckpoint != nil {
		m.cfg.OnCheckpoint(env, kind, info)
	}
}

func (m *Manager) closePools() {
	m.mu.Lock()
	envs := slices.Collect(maps.Values(m.envs))
	m.mu.Unlock()
	var wg sync.WaitGroup
	for _, e := range envs {
		wg.Go(e.pool.close)
	}
	wg.Wait()
}

// Close stops the pools and the reaper and destroys every warm and leased sandbox (checkpoints
// stay), and returns once every sandbox it closed, and every one closed before, is torn down (or
// ctx is done). It is idempotent.
func (m *Manager) Close(ctx context.Context) error {
	m.closeOnce.Do(func() {
		m.mu.Lock()
		m.closed = true
		m.mu.Unlock()
		m.cancel()
		<-m.reaperDone
		m.reaping.Wait()
		m.closePools()
		m.retiring.Wait()
		var errs []error
		for _, l := range m.Leases() {
			if err := m.CloseLease(ctx, l); err != nil {
				errs = append(errs, err)
			}
			if m.cfg.OnEnd != nil {
				m.cfg.OnEnd(l, EndShutdown)
			}
		}
		m.discard.Wait()
		m.watching.Wait()
		errs = append(errs, m.waitTorn(ctx))
		m.closeErr = errors.Join(errs...)
	})
	return m.closeErr
}
