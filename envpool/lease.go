package envpool

import (
	"context"
	"fmt"
	"sync"
	"sync/atomic"
	"time"

	"github.com/deltagym/deltagym/internal/errdefs"
	"github.com/deltagym/deltagym/sandbox"
)

// Lease is a sandbox handed to a client. Calls on it are serialised by Begin; each call and
// Touch renew its TTL, and a call in flight (or waiting its turn) keeps the reaper away.
type Lease struct {
	m       *Manager
	env     *Env
	box     Box
	created time.Time

	turn     chan struct{} // capacity 1: held by the call in progress
	inflight atomic.Int32
	expires  atomic.Int64 // unix nanoseconds of the Manager's Clock
	ttl      atomic.Int64 // the lease's own TTL (SetTTL); 0: Config.LeaseTTL

	mu sync.Mutex
	// cancel is the context cancel of the call in progress (nil between calls).
	// +checklocks:mu
	cancel context.CancelCauseFunc
	ended  chan struct{}
	once   sync.Once

	value atomic.Value // the owner's per-sandbox state
	task  atomic.Pointer[map[string]string]
}

// Task returns the variables of the task the sandbox works on (Reset's options and
// DELTAGYM_SEED), which a pristine verifier gets; nil for none. The map is not to be changed.
func (l *Lease) Task() map[string]string {
	if t := l.task.Load(); t != nil {
		return *t
	}
	return nil
}

// SetTask sets the variables of the task the sandbox works on: Reset sets them, and the owner
// when the sandbox's state comes from a checkpoint of another task (Restore, Fork; see
// TaskOf). The map is not to be changed afterwards.
func (l *Lease) SetTask(task map[string]string) { l.task.Store(&task) }

// Value returns the state the owner attached with SetValue (nil if none).
func (l *Lease) Value() any { return l.value.Load() }

// SetValue attaches the owner's per-sandbox state (the server's episode); the Manager does not
// use it. Every call must store the same concrete type.
func (l *Lease) SetValue(v any) { l.value.Store(v) }

// ID returns the sandbox id.
func (l *Lease) ID() string { return l.box.ID() }

// Env returns the env the sandbox belongs to.
func (l *Lease) Env() *Env { return l.env }

// Sandbox returns the leased sandbox of the sandbox runtime (Config.Runtime), or nil when the
// Manager's Backend is another (Box returns that one's).
func (l *Lease) Sandbox() *sandbox.Sandbox {
	sb, _ := l.box.(*sandbox.Sandbox)
	return sb
}

// Box returns the leased sandbox as the Backend made it.
func (l *Lease) Box() Box { return l.box }

// Created returns when the sandbox was handed over.
func (l *Lease) Created() time.Time { return l.created }

// Expires returns when the lease runs out unless renewed.
func (l *Lease) Expires() time.Time { return time.Unix(0, l.expires.Load()) }

// Ended is closed once the lease was closed or reaped.
func (l *Lease) Ended() <-chan struct{} { return l.ended }

// Touch renews the lease for its TTL and returns its new expiry.
func (l *Lease) Touch() time.Time {
	t := l.m.clock.Now().Add(l.TTL())
	l.expires.Store(t.UnixNano())
	return t
}

// TTL returns how long the lease lives without a call or Touch: its own (SetTTL), else
// Config.LeaseTTL.
func (l *Lease) TTL() time.Duration {
	if d := time.Duration(l.ttl.Load()); d > 0 {
		return d
	}
	return l.m.cfg.LeaseTTL
}

// SetTTL makes d the lease's TTL from now on (0 or less: Config.LeaseTTL), renews the lease
// for it, and returns its new expiry. A shorter TTL brings the expiry nearer: the reaper goes
// by the expiry alone.
func (l *Lease) SetTTL(d time.Duration) time.Time {
	l.ttl.Store(int64(max(d, 0)))
	return l.Touch()
}

// Begin waits for the sandbox's turn (calls on one sandbox run one at a time, in arrival order
// as far as Go's channel fairness goes) and renews the lease. It returns the context the call
// must use — cancelled with cause ErrAborted by Abort — and the function that ends the call.
func (l *Lease) Begin(ctx context.Context) (context.Context, func(), error) {
	l.inflight.Add(1)
	l.Touch()
	select {
	case l.turn <- struct{}{}:
	case <-ctx.Done():
		l.inflight.Add(-1)
		return nil, nil, ctx.Err()
	case <-l.ended:
		l.inflight.Add(-1)
		return nil, nil, errdefs.WithDetail(fmt.Errorf("sandbox %s: %w", l.ID(), ErrLeaseEnded), "", "sandbox_id", l.ID())
	}
	cctx, cancel := context.WithCancelCause(ctx)
	// The ended check and the cancel's store under one lock, which Abort takes too: an end and
	// Abort between them would otherwise cancel nothing.
	l.mu.Lock()
	select {
	case <-l.ended:
		l.mu.Unlock()
		cancel(nil)
		<-l.turn
		l.inflight.Add(-1)
		return nil, nil, errdefs.WithDetail(fmt.Errorf("sandbox %s: %w", l.ID(), ErrLeaseEnded), "", "sandbox_id", l.ID())
	default:
	}
	l.cancel = cancel
	l.mu.Unlock()
	end := func() {
		l.mu.Lock()
		l.cancel = nil
		l.mu.Unlock()
		cancel(nil)
		l.Touch()
		<-l.turn
		l.inflight.Add(-1)
	}
	return cctx, end, nil
}

// Abort cancels the call in progress on the sandbox, if any, with cause ErrAborted.
func (l *Lease) Abort() {
	l.mu.Lock()
	if l.cancel != nil {
		l.cancel(ErrAborted)
	}
	l.mu.Unlock()
}

// Aborted reports whether ctx (from Begin) was cancelled by Abort.
func Aborted(ctx context.Context) bool { return context.Cause(ctx) == ErrAborted }

// end marks the lease ended (once) and reports whether this call ended it.
func (l *Lease) end() bool {
	first := false
	l.once.Do(func() {
		first = true
		close(l.ended)
	})
	return first
}
