package main

import "testing"

// TestProcsPolicy: the Ps double after procsRaiseAfter samples in a row with
// a queue (as many runnable goroutines as Ps), not after fewer nor with a
// shorter queue; they go back after procsLowerAfter calm samples in a row
// (fewer runnable than the default Ps), and a queue in between starts the
// count again.
func TestProcsPolicy(t *testing.T) {
	const base = 2
	type sample struct {
		runnable uint64
		want     procsChange
	}
	repeat := func(n int, s sample) []sample {
		out := make([]sample, n)
		for i := range out {
			out[i] = s
		}
		return out
	}
	cat := func(parts ...[]sample) []sample {
		var out []sample
		for _, p := range parts {
			out = append(out, p...)
		}
		return out
	}
	cases := []struct {
		name    string
		samples []sample
	}{
		{"no queue", repeat(200, sample{1, procsKeep})},
		{"queue too short", cat(
			repeat(procsRaiseAfter-1, sample{base, procsKeep}),
			[]sample{{base - 1, procsKeep}},
			repeat(procsRaiseAfter-1, sample{100, procsKeep}),
		)},
		{"queue raises", cat(
			repeat(procsRaiseAfter-1, sample{base, procsKeep}),
			[]sample{{base, procsRaise}},
		)},
		{"busy stays high, calm lowers", cat(
			repeat(procsRaiseAfter-1, sample{64, procsKeep}),
			[]sample{{64, procsRaise}},
			repeat(500, sample{base, procsKeep}), // still a queue for the default Ps
			repeat(procsLowerAfter-1, sample{0, procsKeep}),
			[]sample{{0, procsLower}},
		)},
		{"a queue resets the calm count", cat(
			repeat(procsRaiseAfter-1, sample{64, procsKeep}),
			[]sample{{64, procsRaise}},
			repeat(procsLowerAfter-1, sample{1, procsKeep}),
			[]sample{{base, procsKeep}},
			repeat(procsLowerAfter-1, sample{1, procsKeep}),
			[]sample{{1, procsLower}},
			repeat(procsRaiseAfter-1, sample{base, procsKeep}),
			[]sample{{base, procsRaise}},
		)},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			var p procsPolicy
			procs := base
			for i, s := range c.samples {
				got := p.step(s.runnable, procs)
				if got != s.want {
					t.Fatalf("sample %d (%d runnable, %d Ps): %v, want %v", i, s.runnable, procs, got, s.want)
				}
				switch got {
				case procsRaise:
					procs = 2 * base
				case procsLower:
					procs = base
				}
			}
		})
	}
}
