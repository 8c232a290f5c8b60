package envpooltest

import (
	"context"
	"slices"
	"sync"
	"time"

	"github.com/deltagym/deltagym/envpool"
)

// Clock is an envpool.Clock that moves only when Advance moves it. Its timers fire inside
// Advance, in the order they are due; a goroutine woken by one runs after Advance returns, so a
// test waits for what it does (WaitForTimer, or the event it causes).
type Clock struct {
	mu sync.Mutex
	// +checklocks:mu
	now time.Time
	// +checklocks:mu
	pending []*timer
	// changed is closed, and replaced, whenever a timer is added or leaves pending.
	// +checklocks:mu
	changed chan struct{}
}

var _ envpool.Clock = (*Clock)(nil)

// NewClock returns a Clock at a fixed instant.
func NewClock() *Clock {
	return &Clock{now: time.Date(2030, 1, 1, 0, 0, 0, 0, time.UTC), changed: make(chan struct{})}
}

// Now returns the clock's time.
func (c *Clock) Now() time.Time {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.now
}

// NewTimer returns a timer due d after Now; d <= 0 fires at once.
func (c *Clock) NewTimer(d time.Duration) envpool.Timer {
	c.mu.Lock()
	defer c.mu.Unlock()
	t := &timer{c: c, ch: make(chan time.Time, 1), due: c.now.Add(d)}
	if d <= 0 {
		t.ch <- c.now
		return t
	}
	c.pending = append(c.pending, t)
	c.notifyLocked()
	return t
}

// Advance moves the clock d forward and fires every timer due by then.
func (c *Clock) Advance(d time.Duration) {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.now = c.now.Add(d)
	slices.SortStableFunc(c.pending, func(a, b *timer) int { return a.due.Compare(b.due) })
	n := 0
	for _, t := range c.pending {
		if t.due.After(c.now) {
			break
		}
		t.ch <- c.now
		n++
	}
	if n > 0 {
		c.pending = slices.Delete(c.pending, 0, n)
		c.notifyLocked()
	}
}

// Pending returns the number of timers that have not fired and were not stopped.
func (c *Clock) Pending() int {
	c.mu.Lock()
	defer c.mu.Unlock()
	return len(c.pending)
}

// WaitForTimer waits until a timer due exactly d after Now is pending: a goroutine that arms a
// timer of a known period (the Manager's reaper arms ReapInterval after each sweep) has come
// back to wait on it.
func (c *Clock) WaitForTimer(ctx context.Context, d time.Duration) error {
	for {
		c.mu.Lock()
		due := c.now.Add(d)
		found := slices.ContainsFunc(c.pending, func(t *timer) bool { return t.due.Equal(due) })
		changed := c.changed
		c.mu.Unlock()
		if found {
			return nil
		}
		select {
		case <-ctx.Done():
			return context.Cause(ctx)
		case <-changed:
		}
	}
}

// +checklocks:c.mu
func (c *Clock) notifyLocked() {
	close(c.changed)
	c.changed = make(chan struct{})
}

// timer is a Clock's timer.
type timer struct {
	c   *Clock
	ch  chan time.Time
	due time.Time
}

func (t *timer) C() <-chan time.Time { return t.ch }

func (t *timer) Stop() bool {
	c := t.c
	c.mu.Lock()
	defer c.mu.Unlock()
	i := slices.Index(c.pending, t)
	if i < 0 {
		return false
	}
	c.pending = slices.Delete(c.pending, i, i+1)
	c.notifyLocked()
	return true
}
