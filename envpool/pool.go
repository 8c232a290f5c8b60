package envpool

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/deltagym/deltagym/internal/errdefs"
	"github.com/deltagym/deltagym/sandbox"
)

// pool keeps up to size warm sandboxes of one env, forked from the env's initial checkpoint. Its
// run goroutine builds that checkpoint (setup) and then populates the warm channel; close stops
// it and destroys what is left.
//
// Its setup ends ready (ckpt set) or broken (err set: the env's own fault, such as a missing
// image or a setup command that fails), and ready is closed then. A setup that a cap of the
// server refuses (errdefs.ErrResourceExhausted: its live sandboxes, checkpoints, descriptors or
// mounts) is the server's state, not the env's: the pool is waiting for capacity, says why
// (waiting), and runs setup again after a back-off, or sooner once capacity may have freed
// (Manager.kick).
type pool struct {
	m    *Manager
	env  *Env
	size int

	ready chan struct{} // closed once ckpt or err is set
	ckpt  string
	err   error

	mu sync.Mutex
	// waiting is the refusal of the last setup, while setup waits for capacity (ready not
	// closed); it is never cleared: once ready is closed it no longer counts.
	// +checklocks:mu
	waiting *waitingError
	// refused is closed when waiting is first set, so that a take waiting for setup returns.
	refused chan struct{}
	// refill is why the last refill failed, if it did (nil once one succeeds): a take that
	// finds no warm sandbox says it, such as the cap that refused the refill.
	refill atomic.Pointer[error]

	warm      chan Box
	done      chan struct{}
	closeOnce sync.Once
	wg        sync.WaitGroup
}

func newPool(m *Manager, env *Env, size int) *pool {
	return &pool{m: m, env: env, size: size, ready: make(chan struct{}), refused: make(chan struct{}),
		warm: make(chan Box, size), done: make(chan struct{})}
}

// The back-off of a setup waiting for capacity: doubled after each refusal, from
// capacityRetryMin to capacityRetryMax. A sandbox torn down cuts it short (Manager.kick).
const (
	capacityRetryMin = 250 * time.Millisecond
	capacityRetryMax = time.Minute
)

// start runs setup and then populates the pool in the background.
func (p *pool) start(ctx context.Context) {
	p.wg.Go(func() {
		ckpt, err, ok := p.settle(ctx)
		if !ok {
			return // closed while waiting for capacity
		}
		p.ckpt, p.err = ckpt, err
		close(p.ready)
		if err != nil {
			p.m.log.Warn("env not ready", "env", p.env.Name(), "err", err)
			return
		}
		p.m.log.Info("env ready", "env", p.env.Name(), "checkpoint", ckpt, "pool_size", p.size)
		p.populate(ctx)
	})
}

// settle runs setup until it is ready or broken (see pool), waiting for capacity between
// attempts that a cap refused. ok is false when the pool was closed while it waited.
func (p *pool) settle(ctx context.Context) (ckpt string, err error, ok bool) {
	backoff := capacityRetryMin
	waited := false // counted in Manager.waiters (setWaiting)
	defer func() {
		if waited {
			p.m.waiters.Add(-1)
		}
	}()
	for {
		// Taken before the attempt: capacity freed during it cuts the back-off short.
		freed := p.m.capacityFreed()
		ckpt, err := p.setup(ctx)
		var w *waitingError
		if !errors.As(err, &w) || ctx.Err() != nil {
			return ckpt, err, true
		}
		if p.setWaiting(w) {
			p.m.log.Debug("env still waiting for capacity", "env", p.env.Name(), "retry_in", backoff, "err", err)
		} else {
			waited = true
			p.m.log.Warn("env waiting for capacity", "env", p.env.Name(), "retry_in", backoff, "err", err)
		}
		t := p.m.clock.NewTimer(backoff)
		select {
		case <-p.done:
			t.Stop()
			return "", nil, false
		case <-freed:
			t.Stop()
		case <-t.C():
		}
		backoff = min(backoff*2, capacityRetryMax)
	}
}

// setWaiting records the refusal of the last setup and reports whether one was recorded
// before. The first counts the pool in Manager.waiters before it closes refused, so that a
// sandbox closed by whoever saw refused closed is watched (CloseLease) and kicks the retry.
func (p *pool) setWaiting(w *waitingError) bool {
	p.mu.Lock()
	defer p.mu.Unlock()
	was := p.waiting != nil
	p.waiting = w
	if !was {
		p.m.waiters.Add(1)
		close(p.refused)
	}
	return was
}

// waitingErr returns the refusal of the last setup while setup waits for capacity, or nil.
func (p *pool) waitingErr() *waitingError {
	select {
	case <-p.ready:
		return nil
	default:
	}
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.waiting
}

// setup creates a sandbox from the env's image, runs the setup commands in order, checkpoints
// the result (the env's pool checkpoint) and destroys the sandbox.
func (p *pool) setup(ctx context.Context) (string, error) {
	name := p.env.Name()
	sb, err := p.m.rt.Create(ctx, p.env.sandboxSpec())
	if err != nil {
		if errors.Is(err, sandbox.ErrNotFound) { // of a sandbox made from an image: the image's
			err = errdefs.WithDetail(err, "IMAGE_NOT_FOUND", "image", p.env.spec.GetImage())
		}
		return "", p.setupErr(fmt.Sprintf("creating setup sandbox from image %q", p.env.spec.GetImage()), err)
	}
	defer func() {
		if err := sb.Destroy(context.WithoutCancel(ctx)); err != nil {
			p.m.log.Warn("destroying setup sandbox", "env", name, "err", err)
		}
	}()
	for i, cmd := range p.env.spec.GetSetup() {
		// Setup runs in /: it may be what creates the env's workdir.
		res, err := sb.Exec(ctx, sandbox.ExecRequest{Command: cmd, Cwd: "/", Timeout: 10 * time.Minute, MaxOutput: 64 << 10})
		if err != nil {
			return "", p.setupErr(fmt.Sprintf("running setup[%d]", i), err)
		}
		if res.ExitCode != 0 || res.TimedOut {
			return "", p.setupErr(fmt.Sprintf("setup[%d] %q", i, cmd), errors.New(describeExit(res)))
		}
	}
	// Forked to fill the pool: files only (template copies live in one sandbox). Pinned: the
	// pool releases it, never the checkpoint TTL.
	info, err := sb.CheckpointWith(ctx, sandbox.CheckpointOptions{Processes: sandbox.ProcessesNone, Pinned: true})
	if err != nil {
		return "", p.setupErr("checkpointing after setup", err)
	}
	p.m.reportCheckpoint(name, KindPool, info)
	return info.ID, nil
}

// populate keeps the warm channel full until done is closed.
func (p *pool) populate(ctx context.Context) {
	backoff := 10 * time.Millisecond
	spec := p.env.forkSpec()
	for {
		select {
		case <-p.done:
			return
		default:
		}
		sbs, err := p.m.rt.Fork(ctx, p.ckpt, 1, spec)
		if err != nil {
			if ctx.Err() != nil {
				return
			}
			p.m.log.Warn("refilling pool", "env", p.env.Name(), "err", err)
			p.refill.Store(&err)
			t := p.m.clock.NewTimer(backoff)
			select {
			case <-p.done:
				t.Stop()
				return
			case <-t.C():
			}
			backoff = min(backoff*2, 5*time.Second)
			continue
		}
		backoff = 10 * time.Millisecond
		p.refill.Store(nil)
		for _, sb := range sbs {
			select {
			case p.warm <- sb:
			case <-p.done:
				p.destroy(sb)
			}
		}
	}
}

// setupErr is setup's failure at what: waiting for capacity if a cap refused it, else not
// ready.
func (p *pool) setupErr(what string, cause error) error {
	if errors.Is(cause, errdefs.ErrResourceExhausted) {
		return &waitingError{env: p.env.Name(), what: what, cause: cause}
	}
	return notReady(fmt.Sprintf("env %s: %s", p.env.Name(), what), cause)
}

// take hands over a warm sandbox, waiting for setup and then for a refill until ctx ends
// or deadline fires (ErrExhausted). While setup waits for capacity, it refuses at once with
// ErrWaiting.
func (p *pool) take(ctx context.Context, deadline <-chan time.Time) (Box, error) {
	if err := p.waitSetup(ctx, deadline); err != nil {
		return nil, err
	}
	for {
		select {
		case sb := <-p.warm:
			select {
			case <-sb.Done(): // died while waiting in the pool
				p.destroy(sb)
				continue
			default:
			}
			return sb, nil
		case <-p.done:
			return nil, fmt.Errorf("env %s: %w", p.env.Name(), ErrClosed)
		case <-ctx.Done():
			return nil, ctx.Err()
		case <-deadline:
			return nil, p.exhausted()
		}
	}
}

// waitSetup waits until setup is over and returns its error, or returns the refusal of the
// setup waiting for capacity.
func (p *pool) waitSetup(ctx context.Context, deadline <-chan time.Time) error {
	for {
		select {
		case <-p.ready:
			return p.err
		default:
		}
		if w := p.waitingErr(); w != nil {
			return w
		}
		select {
		case <-p.ready:
			return p.err
		case <-p.refused: // waiting from now on, unless ready meanwhile: one more round
		case <-p.done:
			return fmt.Errorf("env %s: %w", p.env.Name(), ErrClosed)
		case <-ctx.Done():
			return ctx.Err()
		case <-deadline:
			return p.exhausted()
		}
	}
}

func (p *pool) exhausted() error {
	if why := p.refill.Load(); why != nil {
		return fmt.Errorf("env %s: all %d warm sandboxes taken, and refilling fails: %v: %w", p.env.Name(), p.size, *why, ErrExhausted)
	}
	return fmt.Errorf("env %s: all %d warm sandboxes taken: %w", p.env.Name(), p.size, ErrExhausted)
}

func (p *pool) destroy(sb Box) {
	if err := sb.Destroy(context.Background()); err != nil {
		p.m.log.Warn("destroying warm sandbox", "env", p.env.Name(), "sandbox", sb.ID(), "err", err)
	}
	p.m.kick()
}

// close stops the populate goroutine and destroys the warm sandboxes. It is idempotent.
func (p *pool) close() {
	p.closeOnce.Do(func() {
		close(p.done)
		p.wg.Wait()
		for {
			select {
			case sb := <-p.warm:
				p.destroy(sb)
			default:
				return
			}
		}
	})
}

// tail returns the last n bytes of b as a string.
func tail(b []byte, n int) string {
	if len(b) > n {
		b = b[len(b)-n:]
	}
	return string(b)
}

// notReadyError is an env that could not be warmed: ErrNotReady, with its cause. It unwraps to
// ErrNotReady first, so that its class is FailedPrecondition whatever the cause's (an image
// that is not found, say).
type notReadyError struct {
	what  string
	cause error
}

func notReady(what string, cause error) error { return &notReadyError{what, cause} }

func (e *notReadyError) Error() string {
	return e.what + ": " + e.cause.Error() + ": " + ErrNotReady.Error()
}

func (e *notReadyError) Unwrap() []error { return []error{ErrNotReady, e.cause} }

// waitingError is a setup that a cap of the server refused: ErrWaiting, with the refusal. It
// unwraps to ErrWaiting and to the refusal, both of class ResourceExhausted.
type waitingError struct {
	env, what string
	cause     error
}

func (e *waitingError) Error() string {
	return "env " + e.env + " is waiting for capacity (its setup is retried as capacity frees): " + e.refusal()
}

// refusal says what was refused and why.
func (e *waitingError) refusal() string { return e.what + ": " + e.cause.Error() }

func (e *waitingError) Unwrap() []error { return []error{ErrWaiting, e.cause} }

// describeExit says how a setup command ended, leaving out what did not happen.
func describeExit(res sandbox.ExecResult) string {
	var b strings.Builder
	switch {
	case res.TimedOut:
		b.WriteString("timed out")
	case res.Signal != "":
		fmt.Fprintf(&b, "killed by signal %s", res.Signal)
	default:
		fmt.Fprintf(&b, "exited %d", res.ExitCode)
	}
	if out := strings.TrimSpace(tail(res.Stderr, 512)); out != "" {
		fmt.Fprintf(&b, ", stderr: %s", out)
	}
	return b.String()
}
