//go:build linux && amd64

package ptfork

import (
	"errors"
	"slices"
	"testing"
)

// planStash places each mapping congruent to its address modulo a huge
// page, in one range free of both processes' mappings (one of them where
// the search starts), and fails when there is no such range.
func TestPlanStash(t *testing.T) {
	own := []vma{
		{start: 0x400000, end: 0x600000, perms: "r-xp", ino: 1, path: "/bin/x"},
		{start: stashLow, end: stashLow + 5<<20 + 0x3000, perms: "rw-p"},
		{start: 0x7ffff7fc0000, end: 0x7ffff7fc2000, perms: "r-xp", path: "[vdso]"},
	}
	src := []vma{
		{start: 0x555555554000, end: 0x555555556000, perms: "r--p", ino: 2, path: "/bin/sh"},
		{start: 0x555555556000, end: 0x555555d80000, perms: "rw-p", path: "[heap]"},
		{start: stashLow + 9<<20, end: stashLow + 9<<20 + 0x5000, perms: "rw-p"},
		{start: 0x7ffff7fc4000, end: 0x7ffff7fc6000, perms: "r-xp", path: "[vdso]"},
		{start: 0x7ffffffde000, end: 0x7ffffffff000, perms: "rw-p", path: "[stack]"},
	}
	st, err := planStash(own, src)
	if err != nil {
		t.Fatal(err)
	}
	if st.lo < stashLow || st.lo%hugeSize != 0 || st.hi > userTop {
		t.Fatalf("stash %#x-%#x", st.lo, st.hi)
	}
	var placed []vma
	for k, v := range src {
		if v.special() {
			if st.from[k] != 0 {
				t.Errorf("%s stashed at %#x", v.path, st.from[k])
			}
			continue
		}
		at := vma{start: st.from[k], end: st.from[k] + v.end - v.start}
		if at.start%hugeSize != v.start%hugeSize || at.start < st.lo || at.end > st.hi {
			t.Errorf("mapping %#x stashed at %#x, in %#x-%#x", v.start, at.start, st.lo, st.hi)
		}
		placed = append(placed, at)
	}
	for _, u := range append(append(own, src...), placed...) {
		if u.start < st.hi && st.lo < u.end && !slices.ContainsFunc(placed, func(p vma) bool { return p.start == u.start && p.end == u.end }) {
			t.Errorf("the stash %#x-%#x meets %#x-%#x", st.lo, st.hi, u.start, u.end)
		}
	}
	for i, a := range placed {
		for _, b := range placed[i+1:] {
			if a.start < b.end && b.start < a.end {
				t.Errorf("stashed %#x-%#x and %#x-%#x meet", a.start, a.end, b.start, b.end)
			}
		}
	}
	// A process that maps all above where the search starts leaves no room.
	full := append(src, vma{start: stashLow, end: userTop, perms: "---p"})
	if _, err := planStash(own, full); !errors.Is(err, ErrBecome) {
		t.Fatalf("no room: %v, want ErrBecome", err)
	}
}

// A stash costs the pages the process wrote; where THP is "always", each
// 2 MiB of an anonymous mapping it wrote a page of costs a huge page, but
// for the mapping's ends short of 2 MiB and file mappings.
func TestStashCost(t *testing.T) {
	const base = 0x7f0000000000 // 2 MiB aligned
	s := &Source{Layout: Layout{maps: []vma{
		{start: base - 0x3000, end: base + 8<<20, perms: "rw-p"},
		{start: base + 16<<20, end: base + 16<<20 + 0x5000, perms: "rw-p", ino: 7, path: "/lib/x.so"},
		{start: base + 32<<20, end: base + 32<<20 + 0x2000, perms: "r-xp", path: "[vdso]"},
	}}}
	s.written = [][]span{
		{{0, 1}, {3, 5}, {3 + 512, 3 + 513}}, // a page before the first 2 MiB, two in it, one in the next
		{{0, 2}},
		nil,
	}
	if got, want := s.stashCost(false), int64(6*pageSize); got != want {
		t.Errorf("cost, THP madvise: %d, want %d", got, want)
	}
	if got, want := s.stashCost(true), int64(pageSize+2*hugeSize+2*pageSize); got != want {
		t.Errorf("cost, THP always: %d, want %d", got, want)
	}
}
