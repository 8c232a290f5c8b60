package episode

import (
	"fmt"
	"testing"
	"time"
)

func TestRecentIDs(t *testing.T) {
	r := newRecentIDs(time.Hour, 3)
	for i := range 5 {
		r.add(fmt.Sprint(i))
	}
	for i, want := range []bool{false, false, true, true, true} {
		if got := r.has(fmt.Sprint(i)); got != want {
			t.Errorf("has(%d) = %v, want %v (the newest 3 are kept)", i, got, want)
		}
	}
	r.add("2") // added again: kept as the newest
	r.add("5")
	r.add("6")
	if !r.has("2") || r.has("3") || r.len() != 3 {
		t.Fatalf("after re-adding: has 2 %v, has 3 %v, %d ids", r.has("2"), r.has("3"), r.len())
	}
	old := newRecentIDs(time.Nanosecond, 1<<20)
	for i := range 10_000 {
		old.add(fmt.Sprint(i))
	}
	if n := old.len(); n > 2 {
		t.Fatalf("%d ids remembered with a TTL of 1ns", n)
	}
	old.mu.Lock()
	n := len(old.order)
	old.mu.Unlock()
	if n > 4 {
		t.Fatalf("%d entries kept in order", n)
	}
}
