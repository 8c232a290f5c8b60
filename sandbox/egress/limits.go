package egress

import (
	"errors"
	"fmt"
	"io"
	"math"
	"net"
	"os"
	"sync"
	"sync/atomic"
	"time"
)

// Limits bound one sandbox's use of the proxy, over the life of its listener. A zero field
// bounds nothing.
type Limits struct {
	// MaxConns caps the connections open at once, those still sending their request included.
	MaxConns int
	// ConnsPerSecond is the rate of a token bucket of ConnBurst tokens: a connection is
	// accepted only with a token.
	ConnsPerSecond float64
	ConnBurst      int
	// MaxBytesUp and MaxBytesDown cap the bytes through the proxy over the sandbox's life:
	// up, from the sandbox to its destinations; down, back.
	MaxBytesUp, MaxBytesDown int64
	// BytesPerSecondUp and BytesPerSecondDown cap the rate of each way, shared by the
	// sandbox's connections (a token bucket of a second's worth).
	BytesPerSecondUp, BytesPerSecondDown int64
	// IdleTimeout closes a connection through which nothing went either way for so long.
	IdleTimeout time.Duration
}

// DefaultLimits are the limits of a server that sets none.
func DefaultLimits() Limits {
	return Limits{
		MaxConns: 32, ConnsPerSecond: 10, ConnBurst: 20,
		MaxBytesUp: 256 << 20, MaxBytesDown: 4 << 30,
		BytesPerSecondUp: 8 << 20, BytesPerSecondDown: 64 << 20,
		IdleTimeout: time.Minute,
	}
}

// Within returns env's limits where it sets them (a positive field) and the server's, l,
// elsewhere; an env may lower the server's limits, not raise them. The error names the first
// field of env above l's, by its name in field.
func (l Limits) Within(env Limits) (Limits, error) {
	out := l
	var errs []error
	pick := func(name string, v, lim int64, set func(int64)) {
		switch {
		case v < 0:
			errs = append(errs, fmt.Errorf("%w: %s %d is negative", ErrBadLimit, name, v))
		case v == 0:
		case lim > 0 && v > lim:
			errs = append(errs, fmt.Errorf("%w: %s %d is above the server's %d", ErrBadLimit, name, v, lim))
		default:
			set(v)
		}
	}
	pick("max_connections", int64(env.MaxConns), int64(l.MaxConns), func(v int64) { out.MaxConns = int(v) })
	pick("connection_burst", int64(env.ConnBurst), int64(l.ConnBurst), func(v int64) { out.ConnBurst = int(v) })
	pick("max_bytes_up", env.MaxBytesUp, l.MaxBytesUp, func(v int64) { out.MaxBytesUp = v })
	pick("max_bytes_down", env.MaxBytesDown, l.MaxBytesDown, func(v int64) { out.MaxBytesDown = v })
	pick("bytes_per_second_up", env.BytesPerSecondUp, l.BytesPerSecondUp, func(v int64) { out.BytesPerSecondUp = v })
	pick("bytes_per_second_down", env.BytesPerSecondDown, l.BytesPerSecondDown, func(v int64) { out.BytesPerSecondDown = v })
	pick("idle_timeout", int64(env.IdleTimeout), int64(l.IdleTimeout), func(v int64) { out.IdleTimeout = time.Duration(v) })
	switch r := env.ConnsPerSecond; {
	case r < 0 || math.IsNaN(r) || r > 1e9:
		errs = append(errs, fmt.Errorf("%w: connections_per_second %v is not a rate", ErrBadLimit, r))
	case r == 0:
	case l.ConnsPerSecond > 0 && r > l.ConnsPerSecond:
		errs = append(errs, fmt.Errorf("%w: connections_per_second %v is above the server's %v", ErrBadLimit, r, l.ConnsPerSecond))
	default:
		out.ConnsPerSecond = r
	}
	if len(errs) > 0 {
		return Limits{}, errs[0]
	}
	if out.ConnsPerSecond > 0 && out.ConnBurst <= 0 {
		out.ConnBurst = max(1, int(2*out.ConnsPerSecond))
	}
	return out, nil
}

// bucket is a token bucket of rate tokens a second holding at most burst. A nil bucket has
// every token asked for.
type bucket struct {
	mu sync.Mutex
	// +checklocks:mu
	rate float64
	// +checklocks:mu
	burst float64
	// tokens may go below zero: a reservation beyond the tokens held is a debt that the next
	// ones wait for too.
	// +checklocks:mu
	tokens float64
	// +checklocks:mu
	last time.Time
}

func newBucket(rate, burst float64) *bucket {
	if rate <= 0 {
		return nil
	}
	return &bucket{rate: rate, burst: burst, tokens: burst, last: time.Now()}
}

// +checklocks:b.mu
func (b *bucket) refillLocked(now time.Time) {
	b.tokens = min(b.burst, b.tokens+now.Sub(b.last).Seconds()*b.rate)
	b.last = now
}

// take takes one token if there is one.
func (b *bucket) take() bool {
	if b == nil {
		return true
	}
	b.mu.Lock()
	defer b.mu.Unlock()
	b.refillLocked(time.Now())
	if b.tokens < 1 {
		return false
	}
	b.tokens--
	return true
}

// reserve takes n tokens and returns how long the caller waits until they are there.
func (b *bucket) reserve(n int) time.Duration {
	if b == nil {
		return 0
	}
	b.mu.Lock()
	defer b.mu.Unlock()
	b.refillLocked(time.Now())
	b.tokens -= float64(n)
	if b.tokens >= 0 {
		return 0
	}
	return time.Duration(-b.tokens / b.rate * float64(time.Second))
}

// way is one direction of a sandbox's traffic: its total so far and its rate.
type way struct {
	name  string // "up" or "down"
	max   int64
	used  atomic.Int64
	rate  *bucket
	field string // the spec's field of max
}

func newWay(name string, maxBytes, perSecond int64) *way {
	return &way{name: name, max: maxBytes, field: "egress.limits.max_bytes_" + name,
		rate: newBucket(float64(perSecond), float64(max(perSecond, 32<<10)))}
}

// spent reports why no byte may go this way any more ("" while some may).
func (w *way) spent() string {
	if w.max > 0 && w.used.Load() >= w.max {
		return fmt.Sprintf("the sandbox's %d bytes %s are used up (%s)", w.max, w.name, w.field)
	}
	return ""
}

// errCut ends a connection that went past a limit; the message says which.
type errCut struct{ why string }

func (e errCut) Error() string { return e.why }

// meter writes to conn what one connection sends one way, within the way's total and rate;
// done ends a wait for the rate. A write that cannot go on for idle (the reader stopped
// reading) fails with errCut.
type meter struct {
	conn net.Conn
	idle time.Duration
	way  *way
	act  *activity
	done <-chan struct{}
	n    atomic.Int64
}

// Write charges p to the way's total (writing only what is left of it, then failing with
// errCut) and waits for the way's rate before writing.
func (m *meter) Write(p []byte) (int, error) {
	var cut error
	if m.way.max > 0 {
		after := m.way.used.Add(int64(len(p)))
		if over := after - m.way.max; over > 0 {
			keep := max(int64(len(p))-over, 0)
			m.way.used.Add(keep - int64(len(p)))
			p = p[:keep]
			cut = errCut{"cut: " + m.way.spent()}
		}
	}
	if d := m.way.rate.reserve(len(p)); d > 0 {
		m.act.touchAt(time.Now().Add(d)) // a wait for the rate is no idleness
		t := time.NewTimer(d)
		select {
		case <-t.C:
		case <-m.done:
			t.Stop()
			return 0, net.ErrClosed
		}
	}
	n, err := m.write(p)
	if err == nil {
		err = cut
	}
	return n, err
}

// write writes p to the connection while something goes through it either way.
func (m *meter) write(p []byte) (int, error) {
	written := 0
	for {
		if m.idle > 0 {
			_ = m.conn.SetWriteDeadline(time.Now().Add(m.idle))
		}
		n, err := m.conn.Write(p[written:])
		written += n
		m.n.Add(int64(n))
		if n > 0 {
			m.act.touch()
		}
		if !errors.Is(err, os.ErrDeadlineExceeded) {
			return written, err
		}
		if m.act.idleFor(m.idle) {
			return written, errCut{fmt.Sprintf("closed: nothing read for %v (egress.limits.idle_timeout_seconds)", m.idle)}
		}
	}
}

// activity is when bytes last went through a connection, either way, or when a wait for a
// rate ends if later (Unix nanoseconds).
type activity struct{ at atomic.Int64 }

func (a *activity) touch() { a.touchAt(time.Now()) }

// idleFor reports whether nothing went through for d.
func (a *activity) idleFor(d time.Duration) bool {
	return time.Since(time.Unix(0, a.at.Load())) >= d
}

// touchAt moves the activity to t unless it is later already.
func (a *activity) touchAt(t time.Time) {
	n := t.UnixNano()
	for {
		old := a.at.Load()
		if old >= n || a.at.CompareAndSwap(old, n) {
			return
		}
	}
}

// idleReader reads from a connection (through r: a buffer in front of it, say) and fails with
// errCut once nothing went either way for idle. Set idle before the first Read; zero waits
// for ever.
type idleReader struct {
	r    io.Reader
	conn net.Conn
	idle time.Duration
	act  *activity
}

func (i *idleReader) Read(p []byte) (int, error) {
	for {
		if i.idle > 0 {
			_ = i.conn.SetReadDeadline(time.Now().Add(i.idle))
		}
		n, err := i.r.Read(p)
		if n > 0 {
			i.act.touch()
		}
		if !errors.Is(err, os.ErrDeadlineExceeded) || n > 0 {
			return n, err
		}
		if i.act.idleFor(i.idle) {
			return 0, errCut{fmt.Sprintf("closed: idle for %v (egress.limits.idle_timeout_seconds)", i.idle)}
		}
	}
}
