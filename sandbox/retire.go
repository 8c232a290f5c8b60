package sandbox

import (
	"context"
	"runtime"
	"sync"
	"sync/atomic"
	"time"
)

// Retirement: the teardown of closed sandboxes, off their callers' path.
//
// Sandbox.Close shuts the sandbox (no call begins on it any more, the
// running ones are aborted) and hands it to the runtime, which tears it
// down in the background: it waits for the state change in progress, saves
// the templates of the sandbox's checkpoints as CRIU images (about a second
// of CPU each), ends its processes and frees its mounts, groups, namespaces
// and id range. So a Close costs microseconds, whatever the sandbox holds
// and whatever its kernel objects take to go.
//
// Bounded: at most retireSlots teardowns run at once (each sandbox's
// images are made one at a time, under its process state's lock), and a teardown saves
// images for at most retireImagesFor; the checkpoints it has not reached
// by then keep their files and lose their processes, which is logged.
// Observable: Runtime.Retiring counts the sandboxes closed and not yet
// torn down, and each teardown is logged with its duration. Until its
// teardown is over a closed sandbox is still the runtime's (Get finds it,
// Sandboxes counts it, and its templates still serve forks of its
// checkpoints); Done is closed once it is over. So admission counts it
// too, with its descriptors and mounts: closing sandboxes faster than they
// are torn down holds no more than the caps, and a refusal says how many
// of those in use are retiring. Runtime.Close waits for every teardown.
type retirement struct {
	// slots bounds the teardowns running at once.
	slots chan struct{}
	// pending counts the sandboxes handed over and not yet torn down.
	pending atomic.Int64
	wg      sync.WaitGroup
}

// retireImagesFor bounds the time a retiring sandbox spends saving its
// checkpoints' templates as images.
const retireImagesFor = 2 * time.Minute

// retireSlots is how many teardowns run at once.
func retireSlots() int { return max(2, runtime.NumCPU()) }

// retire tears s down in the background (s is shut). Once the runtime is
// closing it does nothing: Runtime.Close destroys every sandbox it holds,
// s among them. Under mu, so that no Add races Close's Wait.
func (r *Runtime) retire(s *Sandbox) {
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.closed {
		return
	}
	r.ret.pending.Add(1)
	r.ret.wg.Go(func() {
		defer r.ret.pending.Add(-1)
		r.ret.slots <- struct{}{}
		defer func() { <-r.ret.slots }()
		start := time.Now()
		ctx, cancel := context.WithTimeout(context.Background(), retireImagesFor)
		defer cancel()
		if err := s.teardown(ctx); err != nil {
			r.log.Warn("tearing down a closed sandbox", "sandbox", s.id, "took", time.Since(start), "err", err)
			return
		}
		r.log.Debug("closed sandbox torn down", "sandbox", s.id, "took", time.Since(start))
	})
}

// Retiring returns the number of sandboxes closed whose teardown (saving
// their templates, ending their processes, freeing what they hold) is not
// over yet.
func (r *Runtime) Retiring() int { return int(r.ret.pending.Load()) }
