package episode

import (
	"container/list"
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

// MaxIdempotencyKey bounds an idempotency key's length in bytes.
const MaxIdempotencyKey = 256

// maxIdempotencyKeys bounds the keys one cache remembers: past it, a new key makes the oldest
// finished one be forgotten before its ttl.
const maxIdempotencyKeys = 1 << 16

// idempotency remembers the results of calls of one kind (Reset, Fork) by key, so that a retry
// returns the first call's result; concurrent calls with one key wait for the first. Failed
// calls are forgotten at once. A key reused for a different request (another n, another
// source) is refused: a retry must repeat its request. Keys are remembered for ttl after their
// call began, and at most max of them: every new key drops the expired ones (and, past max,
// the oldest finished ones) from the front of order, the keys by age, so a key costs O(1)
// amortized however many are remembered.
type idempotency[T any] struct {
	mu sync.Mutex
	// +checklocks:mu
	ttl time.Duration
	// +checklocks:mu
	max int
	// +checklocks:mu
	m map[string]*idemEntry[T]
	// +checklocks:mu
	order list.List // of *idemEntry[T], oldest first; exactly the entries of m
}

type idemEntry[T any] struct {
	key  string
	req  [sha256.Size]byte // fingerprint of the request
	at   time.Time
	elem *list.Element // in order, while remembered
	done chan struct{} // closed once resp and err are set
	resp T
	err  error
}

func newIdempotency[T any](ttl time.Duration) *idempotency[T] {
	return &idempotency[T]{ttl: ttl, max: maxIdempotencyKeys, m: map[string]*idemEntry[T]{}}
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
	e.elem = c.order.PushBack(e)
	c.mu.Unlock()
	e.resp, e.err = f()
	if e.err != nil {
		c.mu.Lock()
		c.forgetLocked(e)
		c.mu.Unlock()
	}
	close(e.done)
	return e.resp, e.err
}

// forgetLocked forgets e, if it is still remembered.
//
// +checklocks:c.mu
func (c *idempotency[T]) forgetLocked(e *idemEntry[T]) {
	if e.elem == nil {
		return
	}
	c.order.Remove(e.elem)
	e.elem = nil
	if c.m[e.key] == e {
		delete(c.m, e.key)
	}
}

// expireLocked forgets the finished keys older than ttl at now, and the oldest finished ones
// while max are remembered (one in progress stops the sweep until it is done: calls are short
// next to ttl).
//
// +checklocks:c.mu
func (c *idempotency[T]) expireLocked(now time.Time) {
	for f := c.order.Front(); f != nil; f = c.order.Front() {
		e := f.Value.(*idemEntry[T])
		if now.Sub(e.at) <= c.ttl && c.order.Len() < c.max {
			return
		}
		select {
		case <-e.done:
		default:
			return
		}
		c.forgetLocked(e)
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
	return p.str(r.Run).str(r.Group).num(int64(r.LeaseTTL)).sum()
}

// forkPrint fingerprints a Fork without its idempotency key.
func forkPrint(r *ForkRequest) [sha256.Size]byte {
	return newPrinter().str(r.CheckpointID).str(r.SandboxID).num(int64(r.N)).str(r.Run).str(r.Group).flag(r.FreshEntropy).
		num(int64(r.LeaseTTL)).sum()
}
