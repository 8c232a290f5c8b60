package episode

import (
	"context"
	"crypto/sha256"
	"encoding/binary"
	"fmt"
	"hash"
	"maps"
	"slices"
	"sync"
	"time"
)

// idempotency remembers the results of calls of one kind (Reset, Fork) by key, so that a retry
// returns the first call's result; concurrent calls with one key wait for the first. Failed
// calls are forgotten. A key reused for a different request (another n, another source) is
// refused: a retry must repeat its request. Keys are remembered for ttl after their call began:
// every new key drops the expired ones from the front of order, the keys by age, so a key
// costs O(1) amortized however many are remembered.
type idempotency[T any] struct {
	mu sync.Mutex
	// +checklocks:mu
	ttl time.Duration
	// +checklocks:mu
	m map[string]*idemEntry[T]
	// +checklocks:mu
	order []*idemEntry[T] // every entry made, oldest first from head; failed ones until they expire
	// +checklocks:mu
	head int
}

type idemEntry[T any] struct {
	key  string
	req  [sha256.Size]byte // fingerprint of the request
	at   time.Time
	done chan struct{} // closed once resp and err are set
	resp T
	err  error
}

func newIdempotency[T any](ttl time.Duration) *idempotency[T] {
	return &idempotency[T]{ttl: ttl, m: map[string]*idemEntry[T]{}}
}

// do runs f for a request of fingerprint fp under key (none: f runs), or returns what the
// first call with key returned.
func (c *idempotency[T]) do(ctx context.Context, kind, key string, fp [sha256.Size]byte, f func() (T, error)) (T, error) {
	var zero T
	if key == "" {
		return f()
	}
	for {
		c.mu.Lock()
		e, ok := c.m[key]
		if !ok {
			break
		}
		c.mu.Unlock()
		if e.req != fp {
			return zero, fmt.Errorf("idempotency key %q was first used for a different %s request; a retry must repeat its request, a new request needs a new key: %w",
				key, kind, ErrInvalid)
		}
		select {
		case <-e.done:
			if e.err == nil {
				return e.resp, nil
			}
			// The first call failed and its key was forgotten: this one runs.
		case <-ctx.Done():
			return zero, ctx.Err()
		}
	}
	now := time.Now()
	c.expireLocked(now)
	e := &idemEntry[T]{key: key, req: fp, at: now, done: make(chan struct{})}
	c.m[key] = e
	c.order = append(c.order, e)
	c.mu.Unlock()
	e.resp, e.err = f()
	if e.err != nil {
		c.mu.Lock()
		if c.m[key] == e {
			delete(c.m, key)
		}
		c.mu.Unlock()
	}
	close(e.done)
	return e.resp, e.err
}

// expireLocked forgets the keys older than ttl at now whose calls are done (one in progress
// stops the sweep until it is done: calls are short next to ttl).
//
// +checklocks:c.mu
func (c *idempotency[T]) expireLocked(now time.Time) {
	for c.head < len(c.order) {
		e := c.order[c.head]
		if now.Sub(e.at) <= c.ttl {
			break
		}
		select {
		case <-e.done:
		default:
			return
		}
		if c.m[e.key] == e {
			delete(c.m, e.key)
		}
		c.order[c.head] = nil
		c.head++
	}
	if c.head > 0 && 2*c.head >= len(c.order) {
		n := copy(c.order, c.order[c.head:])
		clear(c.order[n:])
		c.order, c.head = c.order[:n], 0
	}
}

// size returns the number of keys remembered.
func (c *idempotency[T]) size() int {
	c.mu.Lock()
	defer c.mu.Unlock()
	return len(c.m)
}

// printer fingerprints a request: each field is written with its length first, so that no two
// requests write the same bytes.
type printer struct{ h hash.Hash }

func newPrinter() printer { return printer{sha256.New()} }

func (p printer) str(s string) printer {
	p.num(int64(len(s)))
	p.h.Write([]byte(s))
	return p
}

func (p printer) num(n int64) printer {
	var b [8]byte
	binary.LittleEndian.PutUint64(b[:], uint64(n))
	p.h.Write(b[:])
	return p
}

func (p printer) flag(v bool) printer {
	if v {
		return p.num(1)
	}
	return p.num(0)
}

func (p printer) sum() (s [sha256.Size]byte) {
	p.h.Sum(s[:0])
	return s
}

// resetPrint fingerprints a Reset without its idempotency key.
func resetPrint(r *ResetRequest) [sha256.Size]byte {
	p := newPrinter().str(r.Env).flag(r.Seed != nil)
	if r.Seed != nil {
		p.num(*r.Seed)
	}
	p.num(int64(len(r.Options)))
	for _, k := range slices.Sorted(maps.Keys(r.Options)) {
		p.str(k).str(r.Options[k])
	}
	return p.str(r.Run).str(r.Group).sum()
}

// forkPrint fingerprints a Fork without its idempotency key.
func forkPrint(r *ForkRequest) [sha256.Size]byte {
	return newPrinter().str(r.CheckpointID).str(r.SandboxID).num(int64(r.N)).str(r.Run).str(r.Group).flag(r.FreshEntropy).sum()
}
