package envpool

import (
	"context"
	"time"

	"github.com/deltagym/deltagym/sandbox"
)

// Backend is the part of a sandbox runtime the Manager uses. A sandbox (Box) is created from an
// image or forked from a checkpoint; a checkpoint, taken of a Box, is named by its ID, is
// immutable, outlives the Box it was taken of, and lives until ReleaseCheckpoint. Unknown images
// and checkpoints fail with errors that wrap sandbox.ErrNotFound.
//
// The sandbox runtime (*sandbox.Runtime, through Config.Runtime) is the Backend of servers;
// package envpooltest has a fake one for tests, which the same tests hold to the real one.
type Backend interface {
	// Create starts a sandbox from spec.Image.
	Create(ctx context.Context, spec sandbox.Spec) (Box, error)
	// Fork starts n sandboxes at checkpoint; spec.Image is empty (the checkpoint's).
	Fork(ctx context.Context, checkpoint string, n int, spec sandbox.Spec) ([]Box, error)
	// ReleaseCheckpoint forgets a checkpoint.
	ReleaseCheckpoint(id string) error
}

// Box is one sandbox, as the Manager uses it: it runs the env's setup commands, reset hook and
// verifier (Exec), checkpoints its state, and is closed or destroyed. Close ends the sandbox for
// its callers at once and leaves its teardown to the background; Destroy returns once the
// teardown is over. Done is closed once the sandbox is gone: torn down, or dead on its own (its
// init exited). Close and Destroy are idempotent.
type Box interface {
	ID() string
	Done() <-chan struct{}
	Exec(ctx context.Context, req sandbox.ExecRequest) (sandbox.ExecResult, error)
	CheckpointWith(ctx context.Context, o sandbox.CheckpointOptions) (sandbox.CheckpointInfo, error)
	Close(ctx context.Context) error
	Destroy(ctx context.Context) error
}

var (
	_ Box     = (*sandbox.Sandbox)(nil)
	_ Backend = runtimeBackend{}
)

// runtimeBackend is the sandbox runtime as a Backend: its sandboxes are Boxes as they are.
type runtimeBackend struct{ rt *sandbox.Runtime }

func (b runtimeBackend) Create(ctx context.Context, spec sandbox.Spec) (Box, error) {
	sb, err := b.rt.Create(ctx, spec)
	if err != nil {
		return nil, err
	}
	return sb, nil
}

func (b runtimeBackend) Fork(ctx context.Context, checkpoint string, n int, spec sandbox.Spec) ([]Box, error) {
	sbs, err := b.rt.Fork(ctx, checkpoint, n, spec)
	if err != nil {
		return nil, err
	}
	out := make([]Box, len(sbs))
	for i, sb := range sbs {
		out[i] = sb
	}
	return out, nil
}

func (b runtimeBackend) ReleaseCheckpoint(id string) error { return b.rt.ReleaseCheckpoint(id) }

// Clock is the Manager's time: lease expiry, the reaper's rounds, acquire deadlines and the
// pools' refill back-off. Commands in sandboxes keep their own (real) time. Tests give a
// Clock they advance by hand (envpooltest.Clock), so that expiry needs no waiting.
type Clock interface {
	Now() time.Time
	// NewTimer returns a timer that fires once, d after Now.
	NewTimer(d time.Duration) Timer
}

// Timer is a one-shot timer of a Clock.
type Timer interface {
	// C delivers the time once the timer fires.
	C() <-chan time.Time
	// Stop prevents the timer from firing; it reports whether it did.
	Stop() bool
}

// systemClock is the Clock of the time package.
type systemClock struct{}

func (systemClock) Now() time.Time                 { return time.Now() }
func (systemClock) NewTimer(d time.Duration) Timer { return systemTimer{time.NewTimer(d)} }

type systemTimer struct{ t *time.Timer }

func (t systemTimer) C() <-chan time.Time { return t.t.C }
func (t systemTimer) Stop() bool          { return t.t.Stop() }
