package envpool_test

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	deltagymv1 "github.com/deltagym/deltagym/clients/go/gen/deltagym/v1"
	"github.com/deltagym/deltagym/envpool"
	"github.com/deltagym/deltagym/envpool/envpooltest"
	"github.com/deltagym/deltagym/internal/errdefs"
	"github.com/deltagym/deltagym/sandbox"
)

// TestSuite runs every case against every backend: the fake in milliseconds (the unit tier),
// the sandbox runtime as root (the privileged tier), so that the fake cannot drift from the real
// thing. Time is an envpooltest.Clock on both: expiry and reaping wait for nothing.
func TestSuite(t *testing.T) {
	for _, b := range backends {
		t.Run(b.name, func(t *testing.T) {
			start := b.open(t)
			for _, c := range suite {
				t.Run(c.name, func(t *testing.T) { c.fn(t, start(t)) })
			}
		})
	}
}

var suite = []struct {
	name string
	fn   func(*testing.T, *harness)
}{
	{"SetupOnceAndBurst", testSetupOnceAndBurst},
	{"Exhausted", testExhausted},
	{"ExhaustedNamesCap", testExhaustedNamesCap},
	{"RefillBackoff", testRefillBackoff},
	{"LeaseExpiry", testLeaseExpiry},
	{"LeaseOwnTTL", testLeaseOwnTTL},
	{"CallInFlightKeepsReaperAway", testCallInFlight},
	{"DiedSandboxReaped", testDiedSandbox},
	{"DeadWarmSandboxSkipped", testDeadWarmSandbox},
	{"CloseLeaseAbortsCall", testCloseLeaseAborts},
	{"CallsTakeTurns", testCallsTakeTurns},
	{"ResetTasks", testResetTasks},
	{"TaskCacheBound", testTaskCacheBound},
	{"EvaluateAndVerify", testEvaluateAndVerify},
	{"Budgets", testBudgets},
	{"Fork", testFork},
	{"SetupFails", testSetupFails},
	{"SetupWaitsForCapacity", testSetupWaitsForCapacity},
	{"RegisterReplace", testRegisterReplace},
	{"CloseEndsEverything", testCloseEndsEverything},
}

// The Manager's times in the suite. The reaper's period differs from every other timer's (the
// acquire deadline, the refill back-off's 10ms doublings, the 5s wait for a call's turn), so that
// WaitForTimer(reapEvery) sees the reaper come back from a sweep.
const (
	leaseTTL       = 10 * time.Minute
	reapEvery      = 1500 * time.Millisecond
	acquireTimeout = 30 * time.Second
	// watchdog bounds every wait of the suite; none is expected to come near it.
	watchdog = 2 * time.Minute
)

type bundle struct {
	h   *harness
	m   *envpool.Manager
	clk *envpooltest.Clock

	ends  chan ended
	ckpts chan checkpointed
}

// ended is a call of Config.OnEnd, with what was wrong while it ran.
type ended struct {
	id, reason string
	wrong      []string
}

type checkpointed struct {
	env  string
	kind envpool.CheckpointKind
	id   string
}

// setup starts a Manager on h with specs, closed (twice) at cleanup, which checks that no
// sandbox is left.
func setup(t *testing.T, h *harness, specs ...*deltagymv1.EnvSpec) *bundle {
	t.Helper()
	b := &bundle{h: h, clk: envpooltest.NewClock(), ends: make(chan ended, 64), ckpts: make(chan checkpointed, 2048)}
	cfg := envpool.Config{Clock: b.clk, LeaseTTL: leaseTTL, ReapInterval: reapEvery, AcquireTimeout: acquireTimeout,
		OnCheckpoint: func(env string, kind envpool.CheckpointKind, info sandbox.CheckpointInfo) {
			b.ckpts <- checkpointed{env, kind, info.ID}
		},
		OnEnd: b.onEnd,
	}
	h.config(&cfg)
	m, err := envpool.New(cfg, specs)
	if err != nil {
		t.Fatal(err)
	}
	b.m = m
	t.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), watchdog)
		defer cancel()
		if err := m.Close(ctx); err != nil {
			t.Errorf("closing the manager: %v", err)
		}
		if err := m.Close(ctx); err != nil {
			t.Errorf("closing the manager twice: %v", err)
		}
		if n := h.live(); n != 0 {
			t.Errorf("%d sandboxes left after Close", n)
		}
	})
	return b
}

// onEnd records an end. A lease that ends other than at shutdown is still listed while OnEnd
// runs (a client sees it until its end is recorded), and no call starts on it.
func (b *bundle) onEnd(l *envpool.Lease, reason string) {
	e := ended{id: l.ID(), reason: reason}
	if reason != envpool.EndShutdown {
		if _, err := b.m.Lease(l.ID()); err != nil {
			e.wrong = append(e.wrong, fmt.Sprintf("not listed during OnEnd: %v", err))
		}
		if _, end, err := l.Begin(context.Background()); !errors.Is(err, envpool.ErrLeaseEnded) {
			e.wrong = append(e.wrong, fmt.Sprintf("Begin during OnEnd: %v", err))
			if end != nil {
				end()
			}
		}
	}
	b.ends <- e
}

func (b *bundle) env(t *testing.T, name string) *envpool.Env {
	t.Helper()
	e, err := b.m.Env(name)
	if err != nil {
		t.Fatal(err)
	}
	return e
}

func (b *bundle) acquire(t *testing.T, env *envpool.Env) *envpool.Lease {
	t.Helper()
	ctx, cancel := context.WithTimeout(t.Context(), watchdog)
	defer cancel()
	l, err := b.m.Acquire(ctx, env)
	if err != nil {
		t.Fatalf("acquiring a sandbox of %s: %v", env.Name(), err)
	}
	return l
}

// run runs cmd in the lease's sandbox, in its turn, and returns its stdout; it must exit 0.
func run(t *testing.T, l *envpool.Lease, cmd command) string {
	t.Helper()
	res, err := exec(t, l, cmd)
	if err != nil || res.ExitCode != 0 {
		t.Fatalf("%s: exit %d, %v: %s", cmd.text, res.ExitCode, err, res.Stderr)
	}
	return string(res.Stdout)
}

func exec(t *testing.T, l *envpool.Lease, cmd command) (sandbox.ExecResult, error) {
	t.Helper()
	ctx, end, err := l.Begin(t.Context())
	if err != nil {
		t.Fatalf("beginning a call on %s: %v", l.ID(), err)
	}
	defer end()
	return l.Box().Exec(ctx, sandbox.ExecRequest{Command: cmd.text})
}

// sweep moves the clock d (at least reapEvery) and waits until the reaper's sweep and the reaps
// it started are over: the reaper waits for its next round again.
func (b *bundle) sweep(t *testing.T, d time.Duration) {
	t.Helper()
	ctx, cancel := context.WithTimeout(t.Context(), watchdog)
	defer cancel()
	if err := b.clk.WaitForTimer(ctx, reapEvery); err != nil {
		t.Fatalf("reaper not waiting: %v", err)
	}
	b.clk.Advance(d)
	if err := b.clk.WaitForTimer(ctx, reapEvery); err != nil {
		t.Fatalf("reaper's sweep not over: %v", err)
	}
	b.m.WaitReaps()
}

// ended returns the next OnEnd, failing if what it saw was wrong.
func (b *bundle) ended(t *testing.T) ended {
	t.Helper()
	select {
	case e := <-b.ends:
		if len(e.wrong) > 0 {
			t.Fatalf("lease %s ended (%s): %s", e.id, e.reason, strings.Join(e.wrong, "; "))
		}
		return e
	case <-time.After(watchdog):
		t.Fatal("no lease ended")
	}
	return ended{}
}

// noneEnded fails if a lease ended.
func (b *bundle) noneEnded(t *testing.T) {
	t.Helper()
	select {
	case e := <-b.ends:
		t.Fatalf("lease %s ended: %s", e.id, e.reason)
	default:
	}
}

// checkpoints returns the checkpoints reported since its last call, only those of kinds if
// any are given (the pools' are taken in the background, in no set order).
func (b *bundle) checkpoints(kinds ...envpool.CheckpointKind) []checkpointed {
	var out []checkpointed
	for {
		select {
		case c := <-b.ckpts:
			if len(kinds) == 0 || slices.Contains(kinds, c.kind) {
				out = append(out, c)
			}
		default:
			return out
		}
	}
}

func wantErr(t *testing.T, err error, want ...error) {
	t.Helper()
	for _, w := range want {
		if !errors.Is(err, w) {
			t.Fatalf("error %v is not %v", err, w)
		}
	}
}

func spec(name, image string, setup ...command) *deltagymv1.EnvSpec {
	s := &deltagymv1.EnvSpec{Name: name, Image: image, PoolSize: 1}
	for _, c := range setup {
		s.Setup = append(s.Setup, c.text)
	}
	return s
}

// testSetupOnceAndBurst: setup runs once (its checkpoint is the pool's), and a burst of
// acquires past the pool's size waits for refills, each a fork of that checkpoint.
func testSetupOnceAndBurst(t *testing.T, h *harness) {
	s := spec("e", h.image, cmdSetup)
	s.PoolSize = 2
	b := setup(t, h, s)
	env := b.env(t, "e")
	leases := make([]*envpool.Lease, 5)
	var wg sync.WaitGroup
	errs := make([]error, len(leases))
	for i := range leases {
		wg.Go(func() {
			ctx, cancel := context.WithTimeout(t.Context(), watchdog)
			defer cancel()
			leases[i], errs[i] = b.m.Acquire(ctx, env)
		})
	}
	wg.Wait()
	if err := errors.Join(errs...); err != nil {
		t.Fatal(err)
	}
	ids := map[string]bool{}
	for _, l := range leases {
		ids[l.ID()] = true
		if got := run(t, l, cmdCatSetup); got != "once\n" {
			t.Fatalf("sandbox %s: setup's file %q, want it written once", l.ID(), got)
		}
		if l.Env() != env || l.Created().IsZero() || !l.Expires().Equal(b.clk.Now().Add(leaseTTL)) {
			t.Fatalf("lease %s: env %v, created %v, expires %v", l.ID(), l.Env().Name(), l.Created(), l.Expires())
		}
	}
	if len(ids) != len(leases) {
		t.Fatalf("%d distinct sandboxes for %d acquires", len(ids), len(leases))
	}
	if n := b.m.Active("e"); n != len(leases) {
		t.Fatalf("Active = %d, want %d", n, len(leases))
	}
	got := b.checkpoints()
	if len(got) != 1 || got[0].kind != envpool.KindPool || got[0].id != env.InitialCheckpoint() || got[0].env != "e" {
		t.Fatalf("checkpoints taken: %v, want the pool's (%s) alone", got, env.InitialCheckpoint())
	}
}

// testExhaustedNamesCap: an acquire past the warm sandboxes while a cap refuses the pool's
// refill fails at its deadline naming the cap, so that the caller sees what to raise.
func testExhaustedNamesCap(t *testing.T, h *harness) {
	h.needFake(t, "the sandbox cap is set on the fake backend")
	ctx, cancel := context.WithTimeout(t.Context(), watchdog)
	defer cancel()
	h.fake.LimitLive(2)
	b := setup(t, h, spec("a", h.image))
	a := b.env(t, "a")
	b.acquire(t, a)
	b.acquire(t, a)
	// The refill past the cap is refused, and waits on its back-off's first timer.
	if err := b.clk.WaitForTimer(ctx, 10*time.Millisecond); err != nil {
		t.Fatalf("a's refill past the cap is not waiting: %v", err)
	}
	res := make(chan error, 1)
	go func() {
		_, err := b.m.Acquire(ctx, a)
		res <- err
	}()
	if err := b.clk.WaitForTimer(ctx, acquireTimeout); err != nil {
		t.Fatal(err)
	}
	b.clk.Advance(acquireTimeout)
	err := <-res
	wantErr(t, err, envpool.ErrExhausted, errdefs.ErrResourceExhausted)
	if !strings.Contains(err.Error(), `cap "sandboxes"`) {
		t.Fatalf("an acquire the sandbox cap holds up: %v, want the cap named", err)
	}
}

// testExhausted: with refills failing, acquires past the warm sandboxes fail with ErrExhausted at
// the acquire deadline, and a caller's cancelled context with its own error.
func testExhausted(t *testing.T, h *harness) {
	b := setup(t, h, spec("e", h.image))
	env := b.env(t, "e")
	b.acquire(t, env)
	// Forks of a released checkpoint fail: the pool cannot refill.
	if err := h.release(env.InitialCheckpoint()); err != nil {
		t.Fatal(err)
	}
	type result struct {
		l   *envpool.Lease
		err error
	}
	// The pool may still hand over the sandbox it held and one forked before the release.
	for range 3 {
		res := make(chan result, 1)
		go func() {
			l, err := b.m.Acquire(t.Context(), env)
			res <- result{l, err}
		}()
		wctx, cancel := context.WithTimeout(t.Context(), watchdog)
		armed := make(chan error, 1)
		go func() { armed <- b.clk.WaitForTimer(wctx, acquireTimeout) }()
		var r result
		select {
		case r = <-res: // a warm one, without waiting
		case err := <-armed:
			if err != nil {
				t.Fatal(err)
			}
			b.clk.Advance(acquireTimeout)
			r = <-res
		}
		cancel()
		if r.err != nil {
			wantErr(t, r.err, envpool.ErrExhausted, errdefs.ErrResourceExhausted)
			ctx, cancel := context.WithCancel(t.Context())
			cancel()
			if _, err := b.m.Acquire(ctx, env); !errors.Is(err, context.Canceled) {
				t.Fatalf("acquire with a cancelled context: %v", err)
			}
			return
		}
	}
	t.Fatal("acquires went on succeeding with the pool unable to refill")
}

// testRefillBackoff: a pool whose forks fail retries on the Manager's clock, backing off, and
// refills once forks work again.
func testRefillBackoff(t *testing.T, h *harness) {
	h.needFake(t, "forks fail on demand")
	h.fake.Fail(envpooltest.OpFork, errors.New("no more sandboxes"))
	b := setup(t, h, spec("e", h.image))
	env := b.env(t, "e")
	ctx, cancel := context.WithTimeout(t.Context(), watchdog)
	defer cancel()
	for _, d := range []time.Duration{10 * time.Millisecond, 20 * time.Millisecond, 40 * time.Millisecond} {
		if err := b.clk.WaitForTimer(ctx, d); err != nil {
			t.Fatalf("no back-off of %v: %v", d, err)
		}
		b.clk.Advance(d)
	}
	if err := b.clk.WaitForTimer(ctx, 80*time.Millisecond); err != nil {
		t.Fatal(err)
	}
	if n := h.fake.Calls(envpooltest.OpFork); n != 4 {
		t.Fatalf("%d forks, want 4: the first and three retries", n)
	}
	h.fake.Fail(envpooltest.OpFork, nil)
	got := make(chan error, 1)
	go func() {
		l, err := b.m.Acquire(ctx, env)
		if err == nil && l.Env() != env {
			err = fmt.Errorf("lease of env %s", l.Env().Name())
		}
		got <- err
	}()
	b.clk.Advance(80 * time.Millisecond)
	if err := <-got; err != nil {
		t.Fatalf("acquire after the pool refilled: %v", err)
	}
}

// testLeaseExpiry: a lease left without calls for its TTL is reaped (OnEnd with EndExpired,
// sandbox destroyed, lookups fail); Touch and calls renew it.
func testLeaseExpiry(t *testing.T, h *harness) {
	s := spec("e", h.image)
	s.PoolSize = 2
	b := setup(t, h, s)
	env := b.env(t, "e")
	kept, left := b.acquire(t, env), b.acquire(t, env)
	b.sweep(t, leaseTTL/2)
	b.noneEnded(t)
	if exp := kept.Touch(); !exp.Equal(b.clk.Now().Add(leaseTTL)) || !kept.Expires().Equal(exp) {
		t.Fatalf("Touch: expires %v, want %v", exp, b.clk.Now().Add(leaseTTL))
	}
	b.sweep(t, leaseTTL/2+reapEvery)
	if e := b.ended(t); e.id != left.ID() || e.reason != envpool.EndExpired {
		t.Fatalf("ended %s (%s), want %s expired", e.id, e.reason, left.ID())
	}
	b.noneEnded(t)
	_, err := b.m.Lease(left.ID())
	wantErr(t, err, envpool.ErrUnknownSandbox, errdefs.ErrNotFound)
	select {
	case <-left.Box().Done(): // closed, its teardown over
	case <-time.After(watchdog):
		t.Fatal("reaped sandbox not torn down")
	}
	select {
	case <-left.Ended():
	default:
		t.Fatal("reaped lease not ended")
	}
	if _, _, err := left.Begin(t.Context()); !errors.Is(err, envpool.ErrLeaseEnded) {
		t.Fatalf("Begin on a reaped lease: %v", err)
	}
	if l, err := b.m.Lease(kept.ID()); err != nil || l != kept {
		t.Fatalf("touched lease: %v", err)
	}
	run(t, kept, cmdTrue) // a call renews the lease too
	b.sweep(t, leaseTTL/2+reapEvery)
	b.noneEnded(t)
	b.sweep(t, leaseTTL/2+reapEvery)
	if e := b.ended(t); e.id != kept.ID() || e.reason != envpool.EndExpired {
		t.Fatalf("ended %s (%s), want %s expired", e.id, e.reason, kept.ID())
	}
}

// testLeaseOwnTTL: a lease with a TTL of its own (SetTTL) is renewed for it, by Touch and by
// calls, and reaped by it, while one with the Manager's lives on; SetTTL(0) brings the
// Manager's back.
func testLeaseOwnTTL(t *testing.T, h *harness) {
	s := spec("e", h.image)
	s.PoolSize = 3
	b := setup(t, h, s)
	env := b.env(t, "e")
	short, long, back := b.acquire(t, env), b.acquire(t, env), b.acquire(t, env)
	const own = 4 * reapEvery
	if exp := short.SetTTL(own); !exp.Equal(b.clk.Now().Add(own)) || short.TTL() != own {
		t.Fatalf("SetTTL(%v): expires %v (TTL %v), want %v", own, exp, short.TTL(), b.clk.Now().Add(own))
	}
	back.SetTTL(own)
	if exp := back.SetTTL(0); !exp.Equal(b.clk.Now().Add(leaseTTL)) || back.TTL() != leaseTTL {
		t.Fatalf("SetTTL(0): expires %v (TTL %v), want the Manager's %v", exp, back.TTL(), leaseTTL)
	}
	run(t, short, cmdTrue) // a call renews for the lease's own TTL
	if !short.Expires().Equal(b.clk.Now().Add(own)) {
		t.Fatalf("after a call the lease expires %v, want %v", short.Expires(), b.clk.Now().Add(own))
	}
	b.sweep(t, own+reapEvery)
	if e := b.ended(t); e.id != short.ID() || e.reason != envpool.EndExpired {
		t.Fatalf("ended %s (%s), want %s expired", e.id, e.reason, short.ID())
	}
	b.noneEnded(t)
	for _, l := range []*envpool.Lease{long, back} {
		if got, err := b.m.Lease(l.ID()); err != nil || got != l {
			t.Fatalf("a lease on the Manager's TTL was reaped by another's: %v", err)
		}
	}
}

// testCallInFlight: the reaper leaves a lease alone while a call runs on it, however long.
func testCallInFlight(t *testing.T, h *harness) {
	b := setup(t, h, spec("e", h.image))
	l := b.acquire(t, b.env(t, "e"))
	_, end, err := l.Begin(t.Context())
	if err != nil {
		t.Fatal(err)
	}
	b.sweep(t, 2*leaseTTL)
	b.noneEnded(t)
	if _, err := b.m.Lease(l.ID()); err != nil {
		t.Fatalf("lease with a call in flight: %v", err)
	}
	end() // renews the lease
	b.sweep(t, leaseTTL-reapEvery)
	b.noneEnded(t)
	b.sweep(t, 2*reapEvery)
	if e := b.ended(t); e.id != l.ID() || e.reason != envpool.EndExpired {
		t.Fatalf("ended %s (%s)", e.id, e.reason)
	}
}

// testDiedSandbox: a leased sandbox that dies on its own is reaped with EndDied at the next
// sweep, whatever its lease.
func testDiedSandbox(t *testing.T, h *harness) {
	b := setup(t, h, spec("e", h.image))
	l := b.acquire(t, b.env(t, "e"))
	h.kill(t, l.Box())
	select {
	case <-l.Box().Done():
	case <-time.After(watchdog):
		t.Fatal("killed sandbox not gone")
	}
	b.sweep(t, reapEvery)
	if e := b.ended(t); e.id != l.ID() || e.reason != envpool.EndDied {
		t.Fatalf("ended %s (%s), want %s died", e.id, e.reason, l.ID())
	}
	if _, err := b.m.Lease(l.ID()); !errors.Is(err, envpool.ErrUnknownSandbox) {
		t.Fatalf("dead sandbox's lease: %v", err)
	}
}

// testDeadWarmSandbox: a warm sandbox that died in the pool is not handed over.
func testDeadWarmSandbox(t *testing.T, h *harness) {
	h.needFake(t, "a census of the warm sandboxes")
	b := setup(t, h, spec("e", h.image))
	env := b.env(t, "e")
	run(t, b.acquire(t, env), cmdTrue) // the pool is ready and refilling
	held := map[string]bool{}
	for _, l := range b.m.Leases() {
		held[l.ID()] = true
	}
	for _, s := range h.fake.Boxes() {
		if !held[s.ID()] {
			s.Kill()
		}
	}
	l := b.acquire(t, env)
	select {
	case <-l.Box().Done():
		t.Fatal("a dead sandbox was handed over")
	default:
	}
	run(t, l, cmdTrue)
}

// testCloseLeaseAborts: CloseLease cuts short the call in progress (its context's cause is
// ErrAborted), destroys the sandbox and ends the lease; closing it again succeeds.
func testCloseLeaseAborts(t *testing.T, h *harness) {
	b := setup(t, h, spec("e", h.image))
	l := b.acquire(t, b.env(t, "e"))
	ctx, end, err := l.Begin(t.Context())
	if err != nil {
		t.Fatal(err)
	}
	done := make(chan error, 1)
	go func() {
		_, err := l.Box().Exec(ctx, sandbox.ExecRequest{Command: cmdSleep.text})
		done <- err
	}()
	if err := b.m.CloseLease(t.Context(), l); err != nil {
		t.Fatal(err)
	}
	select {
	case err := <-done:
		// Aborted while it ran, or refused if the close came first.
		if !errors.Is(err, envpool.ErrAborted) && !errors.Is(err, sandbox.ErrAborted) && !errors.Is(err, sandbox.ErrClosed) {
			t.Fatalf("command on a closed lease: %v", err)
		}
	case <-time.After(watchdog):
		t.Fatal("command not cut short by CloseLease")
	}
	if !envpool.Aborted(ctx) {
		t.Fatalf("call context's cause: %v, want ErrAborted", context.Cause(ctx))
	}
	end()
	if _, _, err := l.Begin(t.Context()); !errors.Is(err, envpool.ErrLeaseEnded) || !errors.Is(err, errdefs.ErrFailedPrecondition) {
		t.Fatalf("Begin on a closed lease: %v", err)
	}
	if err := b.m.CloseLease(t.Context(), l); err != nil {
		t.Fatalf("closing a closed lease: %v", err)
	}
	if _, err := b.m.Lease(l.ID()); !errors.Is(err, envpool.ErrUnknownSandbox) {
		t.Fatalf("closed lease: %v", err)
	}
	b.noneEnded(t) // OnEnd is for ends other than CloseLease
}

// testCallsTakeTurns: a second call waits for the first to end (and gives up with its context).
func testCallsTakeTurns(t *testing.T, h *harness) {
	b := setup(t, h, spec("e", h.image))
	l := b.acquire(t, b.env(t, "e"))
	_, end, err := l.Begin(t.Context())
	if err != nil {
		t.Fatal(err)
	}
	// The turn is held: the second Begin can only return when its context ends.
	ctx, cancel := context.WithCancel(t.Context())
	got := make(chan error, 1)
	go func() {
		_, end, err := l.Begin(ctx)
		if end != nil {
			end()
		}
		got <- err
	}()
	cancel()
	if err := <-got; !errors.Is(err, context.Canceled) {
		t.Fatalf("Begin while another call runs: %v, want it to wait until cancelled", err)
	}
	end()
	run(t, l, cmdTrue) // the turn is free again
}

// testResetTasks: a reset hook runs with the seed and options, the state after it is a task
// checkpoint, and the next reset of the same task forks it instead of running the hook.
func testResetTasks(t *testing.T, h *harness) {
	s := spec("t", h.image, cmdSetup)
	s.ResetHook = cmdHook.text
	b := setup(t, h, s, spec("plain", h.image))
	env := b.env(t, "t")
	seed := int64(7)
	reset := func(seed int64, opts map[string]string) (*envpool.Lease, envpool.ResetResult, error) {
		return b.m.Reset(t.Context(), env, envpool.ResetParams{Seed: &seed, Options: opts})
	}
	l1, r1, err := reset(seed, map[string]string{"LEVEL": "hard"})
	if err != nil {
		t.Fatal(err)
	}
	if r1.Cached || r1.Hook == nil || string(r1.Hook.Stdout) != "task 7 hard\n" || r1.Checkpoint == env.InitialCheckpoint() {
		t.Fatalf("first reset: %+v", r1)
	}
	if got := run(t, l1, cmdCatSeed) + run(t, l1, cmdCatSetup); got != "7\nonce\n" {
		t.Fatalf("state after the hook: %q", got)
	}
	if ck := b.checkpoints(envpool.KindTask, envpool.KindEvaluate); len(ck) != 1 || ck[0].kind != envpool.KindTask || ck[0].id != r1.Checkpoint {
		t.Fatalf("checkpoints: %v, want the task's (%s)", ck, r1.Checkpoint)
	}
	l2, r2, err := reset(seed, map[string]string{"LEVEL": "hard"})
	if err != nil {
		t.Fatal(err)
	}
	if !r2.Cached || r2.Checkpoint != r1.Checkpoint || string(r2.Hook.Stdout) != "task 7 hard\n" || l2.ID() == l1.ID() {
		t.Fatalf("second reset of the task: %+v", r2)
	}
	if got := run(t, l2, cmdCatSeed); got != "7\n" {
		t.Fatalf("cached task's state: %q", got)
	}
	if ck := b.checkpoints(envpool.KindTask, envpool.KindEvaluate); len(ck) != 0 {
		t.Fatalf("a cached task took checkpoints %v", ck)
	}
	if _, r3, err := reset(8, map[string]string{"LEVEL": "hard"}); err != nil || r3.Cached || r3.Checkpoint == r1.Checkpoint {
		t.Fatalf("another seed: %+v, %v", r3, err)
	}
	active := b.m.Active("t")
	for _, bad := range []map[string]string{{"bad-key": "x"}, {"DELTAGYM_SEED": "1"}, {"LEVEL": "bad"}} {
		_, _, err := reset(seed, bad)
		wantErr(t, err, envpool.ErrBadOption, errdefs.ErrInvalidArgument)
		if bad["LEVEL"] == "bad" && !strings.Contains(err.Error(), "refused") {
			t.Fatalf("refused task: %v does not say why", err)
		}
	}
	if n := b.m.Active("t"); n != active {
		t.Fatalf("failed resets left %d leases", n-active)
	}
	// A task whose checkpoint is gone runs its hook again.
	if err := h.release(r1.Checkpoint); err != nil {
		t.Fatal(err)
	}
	if _, r4, err := reset(seed, map[string]string{"LEVEL": "hard"}); err != nil || r4.Cached || r4.Checkpoint == r1.Checkpoint {
		t.Fatalf("reset of a task whose checkpoint was released: %+v, %v", r4, err)
	}
	plain := b.env(t, "plain")
	if _, r, err := b.m.Reset(t.Context(), plain, envpool.ResetParams{}); err != nil || r.Checkpoint != plain.InitialCheckpoint() || r.Hook != nil {
		t.Fatalf("reset without a hook: %+v, %v", r, err)
	}
}

// testTaskCacheBound: past its bound, the task cache releases its least recently used task's
// checkpoint, and a reset of that task runs its hook again.
func testTaskCacheBound(t *testing.T, h *harness) {
	h.needFake(t, "1,025 reset hooks; the bound is the same code on either backend")
	s := spec("t", h.image)
	s.ResetHook = cmdHook.text
	b := setup(t, h, s)
	env := b.env(t, "t")
	reset := func(seed int64) envpool.ResetResult {
		l, r, err := b.m.Reset(t.Context(), env, envpool.ResetParams{Seed: &seed})
		if err != nil {
			t.Fatal(err)
		}
		if err := b.m.CloseLease(t.Context(), l); err != nil {
			t.Fatal(err)
		}
		return r
	}
	first := reset(0)
	for i := range int64(1024) {
		reset(i + 1)
	}
	if n := h.fake.Calls(envpooltest.OpRelease); n != 1 {
		t.Fatalf("%d checkpoints released, want the evicted task's", n)
	}
	if r := reset(0); r.Cached || r.Checkpoint == first.Checkpoint {
		t.Fatalf("evicted task: %+v", r)
	}
	if r := reset(1024); !r.Cached {
		t.Fatal("recent task not cached")
	}
}

// testEvaluateAndVerify: Evaluate runs the verifier on a fork of the current state (which it
// leaves as it was), Verify in the sandbox itself; rewards, components and failures.
func testEvaluateAndVerify(t *testing.T, h *harness) {
	v := spec("v", h.image)
	v.Verifier = cmdVerifier.text
	broken := spec("broken", h.image)
	broken.Verifier = cmdVerifierBroken.text
	answer := spec("answer", h.image)
	answer.Verifier = cmdVerifierAnswer.text
	loud := spec("loud", h.image)
	loud.Verifier = cmdVerifierLoud.text
	loud.Limits = &deltagymv1.Limits{OutputBytes: 16}
	b := setup(t, h, v, broken, answer, loud, spec("none", h.image))
	l := b.acquire(t, b.env(t, "v"))
	evaluate := func(l *envpool.Lease) (envpool.Verdict, error) {
		ctx, end, err := l.Begin(t.Context())
		if err != nil {
			t.Fatal(err)
		}
		defer end()
		return b.m.Evaluate(ctx, l)
	}
	if got, err := evaluate(l); err != nil || got.Reward != 0 {
		t.Fatalf("evaluate without the answer: %+v, %v", got, err)
	}
	run(t, l, cmdAnswer)
	got, err := evaluate(l)
	if err != nil || got.Reward != 1 || got.Components["correct"] != 1 || got.Checkpoint.ID == "" {
		t.Fatalf("evaluate with the answer: %+v, %v", got, err)
	}
	if ck := b.checkpoints(envpool.KindTask, envpool.KindEvaluate); len(ck) != 2 || ck[1].kind != envpool.KindEvaluate || ck[1].id != got.Checkpoint.ID {
		t.Fatalf("checkpoints: %v, want two evaluate ones, the last %s", ck, got.Checkpoint.ID)
	}
	if mark := run(t, l, cmdVerified); mark != "no\n" {
		t.Fatal("the verifier of Evaluate ran in the evaluated sandbox")
	}
	got, err = b.m.Verify(t.Context(), b.env(t, "v"), l.Box(), nil)
	if err != nil || got.Reward != 1 || got.Checkpoint.ID != "" {
		t.Fatalf("verify: %+v, %v", got, err)
	}
	if mark := run(t, l, cmdVerified); mark != "yes\n" {
		t.Fatal("the verifier of Verify did not run in the sandbox")
	}
	a := b.acquire(t, b.env(t, "answer"))
	answerText := "0.25"
	if got, err := b.m.Verify(t.Context(), a.Env(), a.Box(), &answerText); err != nil || got.Reward != 0.25 {
		t.Fatalf("verify with an answer: %+v, %v", got, err)
	}
	lo := b.acquire(t, b.env(t, "loud"))
	if got, err := b.m.Verify(t.Context(), lo.Env(), lo.Box(), nil); err != nil || got.Reward != 0.5 || got.Output != "0.5\n"+strings.Repeat("x", 12) {
		t.Fatalf("verify with output past the cap: %+v, %v", got, err)
	}
	br := b.acquire(t, b.env(t, "broken"))
	got, err = evaluate(br)
	wantErr(t, err, envpool.ErrVerifier, errdefs.ErrFailedPrecondition)
	if !strings.Contains(got.Output, "verifier broke") {
		t.Fatalf("broken verifier's output: %q", got.Output)
	}
	no := b.acquire(t, b.env(t, "none"))
	_, err = evaluate(no)
	wantErr(t, err, envpool.ErrNoVerifier, errdefs.ErrFailedPrecondition)
	_, err = b.m.Verify(t.Context(), no.Env(), no.Box(), nil)
	wantErr(t, err, envpool.ErrNoVerifier)
}

// testBudgets: an env's limits and budgets, or the Config's defaults, bound its commands: a
// reset hook past the step timeout is cut at it.
func testBudgets(t *testing.T, h *harness) {
	slow := spec("slow", h.image)
	slow.ResetHook = cmdSleep.text
	slow.Limits = &deltagymv1.Limits{StepTimeoutSeconds: 0.05, OutputBytes: 100}
	slow.Budgets = &deltagymv1.Budgets{MaxSteps: 7, MaxSeconds: 1.5}
	b := setup(t, h, slow, spec("plain", h.image))
	env := b.env(t, "slow")
	if env.StepTimeout() != 50*time.Millisecond || env.OutputCap() != 100 || env.MaxSteps() != 7 || env.MaxDuration() != 1500*time.Millisecond {
		t.Fatalf("budgets: step %v, output %d, steps %d, duration %v", env.StepTimeout(), env.OutputCap(), env.MaxSteps(), env.MaxDuration())
	}
	plain := b.env(t, "plain")
	if plain.StepTimeout() != 30*time.Second || plain.OutputCap() != 1<<20 || plain.MaxSteps() != 0 || plain.MaxDuration() != 0 {
		t.Fatalf("defaults: step %v, output %d, steps %d, duration %v", plain.StepTimeout(), plain.OutputCap(), plain.MaxSteps(), plain.MaxDuration())
	}
	start := time.Now()
	_, _, err := b.m.Reset(t.Context(), env, envpool.ResetParams{})
	wantErr(t, err, envpool.ErrBadOption)
	if !strings.Contains(err.Error(), "timed out true") {
		t.Fatalf("slow hook: %v, want it timed out", err)
	}
	if d := time.Since(start); d > watchdog/2 {
		t.Fatalf("the hook ran %v", d)
	}
}

// testFork: Fork makes n leased sandboxes at a checkpoint; an unknown checkpoint is NotFound.
func testFork(t *testing.T, h *harness) {
	b := setup(t, h, spec("f", h.image, cmdSetup))
	env := b.env(t, "f")
	l := b.acquire(t, env)
	run(t, l, cmdAnswer)
	ctx, end, err := l.Begin(t.Context())
	if err != nil {
		t.Fatal(err)
	}
	info, err := l.Box().CheckpointWith(ctx, sandbox.CheckpointOptions{Processes: sandbox.ProcessesNone})
	end()
	if err != nil {
		t.Fatal(err)
	}
	kids, err := b.m.Fork(t.Context(), env, info.ID, 3, envpool.ForkOptions{FreshEntropy: true})
	if err != nil {
		t.Fatal(err)
	}
	ids := map[string]bool{l.ID(): true}
	for _, k := range kids {
		ids[k.ID()] = true
		if got := run(t, k, cmdCatSetup) + run(t, k, cmdCatAnswer); got != "once\n42\n" {
			t.Fatalf("fork %s: state %q", k.ID(), got)
		}
	}
	if len(ids) != 4 || b.m.Active("f") != 4 {
		t.Fatalf("%d distinct sandboxes, %d active, want 4", len(ids), b.m.Active("f"))
	}
	_, err = b.m.Fork(t.Context(), env, "ck-unknown", 2)
	wantErr(t, err, sandbox.ErrNotFound)
	if n := b.m.Active("f"); n != 4 {
		t.Fatalf("a failed fork left %d leases", n-4)
	}
}

// testSetupFails: an env whose setup fails, or whose image is missing, is not ready (and says
// why); once the image is imported, ImageImported warms it again.
func testSetupFails(t *testing.T, h *harness) {
	image := fmt.Sprintf("late%d", time.Now().UnixNano())
	b := setup(t, h, spec("broken", h.image, cmdFail), spec("late", image, cmdSetup))
	ctx, cancel := context.WithTimeout(t.Context(), watchdog)
	defer cancel()
	broken := b.env(t, "broken")
	_, err := b.m.Acquire(ctx, broken)
	wantErr(t, err, envpool.ErrNotReady, errdefs.ErrFailedPrecondition)
	if !strings.Contains(err.Error(), "setup broke") || broken.Err() == nil || broken.InitialCheckpoint() != "" {
		t.Fatalf("broken env: %v (Err %v, checkpoint %q)", err, broken.Err(), broken.InitialCheckpoint())
	}
	late := b.env(t, "late")
	_, err = b.m.Acquire(ctx, late)
	wantErr(t, err, envpool.ErrNotReady, sandbox.ErrNotFound)
	h.addImage(t, image)
	b.m.ImageImported(image)
	again := b.env(t, "late")
	if again == late {
		t.Fatal("ImageImported kept the failed env")
	}
	if got := run(t, b.acquire(t, again), cmdCatSetup); got != "once\n" {
		t.Fatalf("rewarmed env's state: %q", got)
	}
	b.m.ImageImported(image) // ready now: nothing to do
	if b.env(t, "late") != again {
		t.Fatal("ImageImported replaced a ready env")
	}
}

// testSetupWaitsForCapacity: a setup refused by the server's sandbox cap leaves its env waiting
// for capacity, not broken: Reset is refused at once as resource exhausted, naming the cap; a
// sandbox torn down runs setup again at once, and the back-off runs it again when capacity
// frees otherwise. The clock moves only where the back-off is the point.
func testSetupWaitsForCapacity(t *testing.T, h *harness) {
	h.needFake(t, "the sandbox cap is changed while the runtime runs (TestSetupWaitsForCapacityRuntime holds the runtime to the first part)")
	ctx, cancel := context.WithTimeout(t.Context(), watchdog)
	defer cancel()
	h.fake.LimitLive(2)
	b := waitForCapacity(ctx, t, h)

	later, err := b.m.Register(spec("c", h.image), false)
	if err != nil {
		t.Fatal(err)
	}
	select {
	case <-later.Refused():
	case <-ctx.Done():
		t.Fatal("setup past the cap was not refused")
	}
	h.fake.LimitLive(8)
	if err := b.clk.WaitForTimer(ctx, envpool.CapacityRetryMin); err != nil {
		t.Fatalf("no retry armed: %v", err)
	}
	b.clk.Advance(envpool.CapacityRetryMin)
	settled(ctx, t, later)
}

// waitForCapacity is the part of testSetupWaitsForCapacity that needs only a sandbox cap of 2
// on h: an env registered at the cap waits for capacity, is refused as such, and is set up
// once a lease is closed, the clock standing still. It returns with the cap held by a lease
// of env a and a warm sandbox of env b.
func waitForCapacity(ctx context.Context, t *testing.T, h *harness) *bundle {
	b := setup(t, h, spec("a", h.image))
	a := b.env(t, "a")
	// Two leases hold the cap: a's refill after the second is refused, and waits on its
	// back-off's first timer (10ms), which never fires while the clock stands still; so that
	// only b takes the capacity a close frees.
	l1, _ := b.acquire(t, a), b.acquire(t, a)
	if err := b.clk.WaitForTimer(ctx, 10*time.Millisecond); err != nil {
		t.Fatalf("a's refill past the cap is not waiting: %v", err)
	}
	env, err := b.m.Register(spec("b", h.image, cmdSetup), false)
	if err != nil {
		t.Fatal(err)
	}
	select {
	case <-env.Refused():
	case <-env.Settled():
		t.Fatalf("setup past the cap settled: checkpoint %q, err %v", env.InitialCheckpoint(), env.Err())
	case <-ctx.Done():
		t.Fatal("setup past the cap was not refused")
	}
	wantErr(t, env.Waiting(), sandbox.ErrCap, errdefs.ErrResourceExhausted)
	if env.Err() != nil {
		t.Fatalf("an env waiting for capacity is broken: %v", env.Err())
	}
	_, err = b.m.Acquire(ctx, env)
	wantErr(t, err, envpool.ErrWaiting, sandbox.ErrCap)
	if errdefs.Class(err) != errdefs.ErrResourceExhausted || !strings.Contains(err.Error(), `cap "sandboxes"`) {
		t.Fatalf("Reset of an env waiting for capacity: %v (class %v)", err, errdefs.Class(err))
	}
	if err := b.m.CloseLease(ctx, l1); err != nil {
		t.Fatal(err)
	}
	settled(ctx, t, env)
	if got := run(t, b.acquire(t, env), cmdCatSetup); got != "once\n" {
		t.Fatalf("the env's state once ready: %q", got)
	}
	return b
}

// TestSetupWaitsForCapacityRuntime holds the sandbox runtime, capped at 2 live sandboxes, to
// what testSetupWaitsForCapacity asks of the fake without changing the cap.
func TestSetupWaitsForCapacityRuntime(t *testing.T) {
	h := openRuntimeCapped(t, sandbox.Caps{Sandboxes: 2})(t)
	ctx, cancel := context.WithTimeout(t.Context(), watchdog)
	defer cancel()
	waitForCapacity(ctx, t, h)
}

// settled waits for env's setup to be over and fails unless the env is ready.
func settled(ctx context.Context, t *testing.T, env *envpool.Env) {
	t.Helper()
	select {
	case <-env.Settled():
	case <-ctx.Done():
		t.Fatalf("env %s still waiting: %v", env.Name(), env.Waiting())
	}
	if env.Err() != nil || env.Waiting() != nil || env.InitialCheckpoint() == "" {
		t.Fatalf("env %s: err %v, waiting %v, checkpoint %q", env.Name(), env.Err(), env.Waiting(), env.InitialCheckpoint())
	}
}

// testRegisterReplace: names are unique unless replaced; a replaced env's leased sandboxes keep
// running.
func testRegisterReplace(t *testing.T, h *harness) {
	b := setup(t, h, spec("r", h.image, cmdSetup))
	old := b.env(t, "r")
	l := b.acquire(t, old)
	_, err := b.m.Register(spec("r", h.image), false)
	wantErr(t, err, envpool.ErrEnvExists, errdefs.ErrAlreadyExists)
	_, err = b.m.Register(&deltagymv1.EnvSpec{Name: "Bad Name", Image: h.image}, false)
	wantErr(t, err, envpool.ErrInvalidSpec, errdefs.ErrInvalidArgument)
	repl, err := b.m.Register(spec("r", h.image, cmdSetup, cmdSetup), true)
	if err != nil {
		t.Fatal(err)
	}
	if b.env(t, "r") != repl {
		t.Fatal("the catalog kept the replaced env")
	}
	if got := run(t, l, cmdCatSetup); got != "once\n" {
		t.Fatalf("the replaced env's sandbox: %q", got)
	}
	if got := run(t, b.acquire(t, repl), cmdCatSetup); got != "once\nonce\n" {
		t.Fatalf("the replacement's sandbox: %q", got)
	}
	_, err = b.m.Env("nope")
	wantErr(t, err, envpool.ErrUnknownEnv, errdefs.ErrNotFound)
	names := []string{}
	for _, e := range b.m.Envs() {
		names = append(names, e.Name())
	}
	if !slices.Equal(names, []string{"r"}) {
		t.Fatalf("catalog %v", names)
	}
}

// testCloseEndsEverything: Close ends every lease (OnEnd with EndShutdown) and destroys every
// sandbox; afterwards the Manager refuses with ErrClosed.
func testCloseEndsEverything(t *testing.T, h *harness) {
	b := setup(t, h, spec("e", h.image))
	env := b.env(t, "e")
	l := b.acquire(t, env)
	if err := b.m.Close(t.Context()); err != nil {
		t.Fatal(err)
	}
	if e := b.ended(t); e.id != l.ID() || e.reason != envpool.EndShutdown {
		t.Fatalf("ended %s (%s)", e.id, e.reason)
	}
	if n := h.live(); n != 0 {
		t.Fatalf("%d sandboxes left", n)
	}
	_, err := b.m.Acquire(t.Context(), env)
	wantErr(t, err, envpool.ErrClosed, errdefs.ErrUnavailable)
	_, err = b.m.Register(spec("other", h.image), false)
	wantErr(t, err, envpool.ErrClosed)
	if _, _, err := l.Begin(t.Context()); !errors.Is(err, envpool.ErrLeaseEnded) {
		t.Fatalf("Begin after Close: %v", err)
	}
}
