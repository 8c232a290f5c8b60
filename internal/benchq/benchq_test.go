package benchq

import (
	"testing"
	"time"
)

func TestQuantileNearestRank(t *testing.T) {
	// 1..100 ms, shuffled: p50 is the 50th, p99 the 99th, p100 the 100th.
	d := make([]time.Duration, 100)
	for i := range d {
		d[i] = time.Duration((i*37)%100+1) * time.Millisecond
	}
	for _, c := range []struct {
		p    float64
		want time.Duration
	}{{0.50, 50 * time.Millisecond}, {0.99, 99 * time.Millisecond}, {1, 100 * time.Millisecond}, {0.001, time.Millisecond}} {
		if got := Quantile(d, c.p); got != c.want {
			t.Errorf("Quantile(1..100 ms, %v) = %v, want %v", c.p, got, c.want)
		}
	}
	if d[0] != time.Millisecond || d[1] != 38*time.Millisecond {
		t.Errorf("Quantile reordered its input: %v", d[:2])
	}
	// Of 3 samples, p50 is the 2nd and p99 the 3rd.
	three := []time.Duration{3, 1, 2}
	if got := Quantile(three, 0.5); got != 2 {
		t.Errorf("p50 of 1,2,3 = %v, want 2", got)
	}
	if got := Quantile(three, 0.99); got != 3 {
		t.Errorf("p99 of 1,2,3 = %v, want 3", got)
	}
	if got := Quantile(nil, 0.5); got != 0 {
		t.Errorf("Quantile(nil) = %v, want 0", got)
	}
}
