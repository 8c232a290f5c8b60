package envpool

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"sync"
	"time"

	"github.com/deltagym/deltagym/sandbox"
)

// pool keeps up to size warm sandboxes of one env, forked from the env's initial checkpoint. Its
// run goroutine builds that checkpoint (setup) and then populates the warm channel; close stops
// it and destroys what is left.
type pool struct {
	m    *Manager
	env  *Env
	size int

	ready chan struct{} // closed once ckpt or err is set
	ckpt  string
	err   error

	warm      chan Box
	done      chan struct{}
	closeOnce sync.Once
	wg        sync.WaitGroup
}

func newPool(m *Manager, env *Env, size int) *pool {
	return &pool{m: m, env: env, size: size, ready: make(chan struct{}), warm: make(chan Box, size),
		done: make(chan struct{})}
}

// start runs setup and then populates the pool in the background.
func (p *pool) start(ctx context.Context) {
	p.wg.Go(func() {
		ckpt, err := p.setup(ctx)
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

// setup creates a sandbox from the env's image, runs the setup commands in order, checkpoints
// the result (the env's pool checkpoint) and destroys the sandbox.
func (p *pool) setup(ctx context.Context) (string, error) {
	name := p.env.Name()
	sb, err := p.m.rt.Create(ctx, p.env.sandboxSpec())
	if err != nil {
		return "", notReady(fmt.Sprintf("env %s: creating setup sandbox from image %q", name, p.env.spec.GetImage()), err)
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
			return "", notReady(fmt.Sprintf("env %s: running setup[%d]", name, i), err)
		}
		if res.ExitCode != 0 || res.TimedOut {
			return "", notReady(fmt.Sprintf("env %s: setup[%d] %q", name, i, cmd), errors.New(describeExit(res)))
		}
	}
	// Forked to fill the pool: files only (template copies live in one sandbox). Pinned: the
	// pool releases it, never the checkpoint TTL.
	info, err := sb.CheckpointWith(ctx, sandbox.CheckpointOptions{Processes: sandbox.ProcessesNone, Pinned: true})
	if err != nil {
		return "", notReady(fmt.Sprintf("env %s: checkpointing after setup", name), err)
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
		for _, sb := range sbs {
			select {
			case p.warm <- sb:
			case <-p.done:
				p.destroy(sb)
			}
		}
	}
}

// take hands over a warm sandbox, waiting for setup and then for a refill until ctx ends
// or deadline fires (ErrExhausted).
func (p *pool) take(ctx context.Context, deadline <-chan time.Time) (Box, error) {
	select {
	case <-p.ready:
	case <-p.done:
		return nil, fmt.Errorf("env %s: %w", p.env.Name(), ErrClosed)
	case <-ctx.Done():
		return nil, ctx.Err()
	case <-deadline:
		return nil, p.exhausted()
	}
	if p.err != nil {
		return nil, p.err
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

func (p *pool) exhausted() error {
	return fmt.Errorf("env %s: all %d warm sandboxes taken: %w", p.env.Name(), p.size, ErrExhausted)
}

func (p *pool) destroy(sb Box) {
	if err := sb.Destroy(context.Background()); err != nil {
		p.m.log.Warn("destroying warm sandbox", "env", p.env.Name(), "sandbox", sb.ID(), "err", err)
	}
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
