package sandbox

import (
	"context"
	"errors"
	"testing"
)

// One key's lock is held by one caller at a time, other keys' are free
// meanwhile, and a wait ends with its context.
func TestKeyedLocks(t *testing.T) {
	var k keyedLocks
	unlockA, err := k.lock(t.Context(), "a")
	if err != nil {
		t.Fatal(err)
	}
	unlockB, err := k.lock(t.Context(), "b") // another key: not held up
	if err != nil {
		t.Fatal(err)
	}
	unlockB()
	ctx, cancel := context.WithCancelCause(t.Context())
	gave := errors.New("gave up")
	got := make(chan error, 1)
	go func() {
		_, err := k.lock(ctx, "a")
		got <- err
	}()
	cancel(gave)
	if err := <-got; !errors.Is(err, gave) {
		t.Fatalf("a wait for a held key ended with %v, want its context's cause", err)
	}
	acquired := make(chan func(), 1)
	go func() {
		u, err := k.lock(t.Context(), "a")
		if err != nil {
			t.Error(err)
			u = func() {}
		}
		acquired <- u
	}()
	select {
	case <-acquired:
		t.Fatal("a key's lock taken while it is held")
	default:
	}
	unlockA()
	(<-acquired)()
	if len(k.held) != 0 {
		t.Fatalf("locks left held: %v", k.held)
	}
}
