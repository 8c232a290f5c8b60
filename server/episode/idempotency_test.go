package episode

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"sync/atomic"
	"testing"
	"time"
)

func TestIdempotency(t *testing.T) {
	ctx := t.Context()
	c := newIdempotency[int](time.Hour)
	fp := forkPrint(&ForkRequest{CheckpointID: "ck", N: 2})
	calls := 0
	f := func() (int, error) { calls++; return calls, nil }
	for range 3 {
		if v, err := c.do(ctx, "fork", "k", fp, f); err != nil || v != 1 {
			t.Fatalf("call with a key: %v, %v; want the first call's 1", v, err)
		}
	}
	if v, _ := c.do(ctx, "fork", "", fp, f); v != 2 {
		t.Fatalf("call without a key: %v, want a new call", v)
	}
	other := forkPrint(&ForkRequest{CheckpointID: "ck", N: 3})
	if _, err := c.do(ctx, "fork", "k", other, f); !errors.Is(err, ErrInvalid) {
		t.Fatalf("the key reused for another request: %v", err)
	}
	// A failed call is forgotten: the retry runs.
	failed := 0
	g := func() (int, error) {
		failed++
		if failed == 1 {
			return 0, errors.New("boom")
		}
		return 7, nil
	}
	if _, err := c.do(ctx, "fork", "g", fp, g); err == nil {
		t.Fatal("failing call succeeded")
	}
	if v, err := c.do(ctx, "fork", "g", fp, g); err != nil || v != 7 {
		t.Fatalf("retry after a failure: %v, %v", v, err)
	}
}

// Concurrent calls with one key run it once and all get its result.
func TestIdempotencyConcurrent(t *testing.T) {
	c := newIdempotency[int](time.Hour)
	fp := resetPrint(&ResetRequest{Env: "e"})
	release := make(chan struct{})
	var runs atomic.Int32
	var wg sync.WaitGroup
	results := make([]int, 8)
	for i := range results {
		wg.Go(func() {
			v, err := c.do(t.Context(), "reset", "k", fp, func() (int, error) {
				runs.Add(1)
				<-release
				return 42, nil
			})
			if err != nil {
				t.Error(err)
			}
			results[i] = v
		})
	}
	close(release)
	wg.Wait()
	if runs.Load() != 1 {
		t.Fatalf("%d runs, want 1", runs.Load())
	}
	for _, v := range results {
		if v != 42 {
			t.Fatalf("results %v", results)
		}
	}
}

// Keys expire after the TTL, and the expired ones are dropped as new keys come: the cache holds
// what one TTL brings, however long it runs.
func TestIdempotencyExpiry(t *testing.T) {
	c := newIdempotency[int](time.Nanosecond)
	fp := resetPrint(&ResetRequest{Env: "e"})
	one := func() (int, error) { return 1, nil }
	for i := range 10_000 {
		if _, err := c.do(t.Context(), "reset", fmt.Sprint(i), fp, one); err != nil {
			t.Fatal(err)
		}
	}
	if n := c.size(); n > 2 {
		t.Fatalf("%d keys remembered with a TTL of 1ns", n)
	}
	c.mu.Lock()
	n := c.order.Len()
	c.mu.Unlock()
	if n > 4 {
		t.Fatalf("%d entries kept in order", n)
	}
	// A call still running is not forgotten.
	started, running, done := make(chan struct{}), make(chan struct{}), make(chan struct{})
	go func() {
		defer close(done)
		_, _ = c.do(context.Background(), "reset", "slow", fp, func() (int, error) { close(started); <-running; return 2, nil })
	}()
	<-started // the call runs: its key is there
	if _, err := c.do(t.Context(), "reset", "next", fp, one); err != nil {
		t.Fatal(err)
	}
	if !c.has("slow") {
		t.Fatal("a running call's key was dropped")
	}
	close(running)
	<-done
}

// A failed call leaves nothing behind; past its bound the cache forgets its oldest keys.
func TestIdempotencyBounded(t *testing.T) {
	c := newIdempotency[int](time.Hour)
	fp := resetPrint(&ResetRequest{Env: "e"})
	boom := func() (int, error) { return 0, errors.New("boom") }
	for i := range 1000 {
		if _, err := c.do(t.Context(), "reset", fmt.Sprint("failing-", i), fp, boom); err == nil {
			t.Fatal("failing call succeeded")
		}
	}
	c.mu.Lock()
	kept, ordered := len(c.m), c.order.Len()
	c.max = 100
	c.mu.Unlock()
	if kept != 0 || ordered != 0 {
		t.Fatalf("after 1000 failed calls: %d keys, %d entries in order; want none", kept, ordered)
	}
	one := func() (int, error) { return 1, nil }
	for i := range 1000 {
		if _, err := c.do(t.Context(), "reset", fmt.Sprint("ok-", i), fp, one); err != nil {
			t.Fatal(err)
		}
	}
	if n := c.size(); n != 100 {
		t.Fatalf("%d keys remembered, want the bound 100", n)
	}
	if c.has("ok-0") || !c.has("ok-999") {
		t.Fatal("the bound did not forget the oldest keys first")
	}
}

func (c *idempotency[T]) has(key string) bool {
	c.mu.Lock()
	defer c.mu.Unlock()
	_, ok := c.m[key]
	return ok
}

// Prints tell requests apart by every field but the key.
func TestRequestPrints(t *testing.T) {
	seed := int64(3)
	resets := []ResetRequest{{Env: "e"}, {Env: "f"}, {Env: "e", Seed: &seed}, {Env: "e", Options: map[string]string{"A": "1"}},
		{Env: "e", Options: map[string]string{"A": "1", "B": ""}}, {Env: "e", Run: "r"}, {Env: "e", Group: "r"}}
	seen := map[[32]byte]int{}
	for i, r := range resets {
		p := resetPrint(&r)
		if j, ok := seen[p]; ok {
			t.Fatalf("resets %d and %d print alike", i, j)
		}
		seen[p] = i
		r.IdempotencyKey = "other"
		if resetPrint(&r) != p {
			t.Fatalf("reset %d's print depends on its key", i)
		}
	}
	forks := []ForkRequest{{CheckpointID: "a", N: 1}, {SandboxID: "a", N: 1}, {CheckpointID: "a", N: 2}, {CheckpointID: "a", N: 1, Run: "r"},
		{CheckpointID: "a", N: 1, Group: "r"}, {CheckpointID: "a", N: 1, FreshEntropy: true}}
	fseen := map[[32]byte]int{}
	for i, r := range forks {
		p := forkPrint(&r)
		if j, ok := fseen[p]; ok {
			t.Fatalf("forks %d and %d print alike", i, j)
		}
		fseen[p] = i
	}
}

// BenchmarkIdempotencyNewKey: the cost of a new key with 100k keys remembered (and, with a
// TTL shorter than the run, as many expiring as come).
func BenchmarkIdempotencyNewKey(b *testing.B) {
	for _, tc := range []struct {
		name string
		ttl  time.Duration
	}{{"kept", time.Hour}, {"expiring", 50 * time.Millisecond}} {
		b.Run(tc.name, func(b *testing.B) {
			c := newIdempotency[int](tc.ttl)
			fp := resetPrint(&ResetRequest{Env: "e"})
			one := func() (int, error) { return 1, nil }
			ctx := context.Background()
			const held = 100_000
			keys := make([]string, held+b.N)
			for i := range keys {
				keys[i] = fmt.Sprint("key-", i)
			}
			for _, k := range keys[:held] {
				_, _ = c.do(ctx, "reset", k, fp, one)
			}
			b.ResetTimer()
			for i := range b.N {
				_, _ = c.do(ctx, "reset", keys[held+i], fp, one)
			}
			b.ReportMetric(float64(c.size()), "keys")
		})
	}
}
