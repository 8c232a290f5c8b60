// Package textdiff compares texts line by line: Myers' O((N+M)D) algorithm in linear space
// (the middle-snake recursion of "An O(ND) Difference Algorithm and Its Variations", 1986),
// line counts as `git diff --stat` gives them, and unified diffs with context.
package textdiff

import (
	"fmt"
	"strings"
)

// Kind is what an Op does.
type Kind uint8

// Op kinds.
const (
	Equal Kind = iota
	Delete
	Insert
)

// Op is one step of an edit script from a to b: a line kept (a[A] == b[B]), deleted (a[A],
// at B in b) or inserted (b[B], at A in a).
type Op struct {
	Kind Kind
	A, B int
}

// maxWork bounds the steps of the search for one diff: past it, what is left is given as
// deletions and insertions (a correct script, not the shortest), so that a pathological pair
// of texts costs bounded time.
const maxWork = 4_000_000

// Lines splits text into lines, each with its "\n" but the last if text does not end in one.
func Lines(text string) []string {
	if text == "" {
		return nil
	}
	lines := strings.SplitAfter(text, "\n")
	if lines[len(lines)-1] == "" {
		lines = lines[:len(lines)-1]
	}
	return lines
}

// Budget is search work shared by a series of diffs (those of one request, say): each diff's
// search stops at maxWork or at what is left of the budget, whichever is less (the rest of
// its texts is then given as deletions and insertions, a correct script, not the shortest),
// and takes the work it did from it.
type Budget struct {
	// Work is the search steps left; at or below zero the budget is spent.
	Work int
}

// Spent reports whether b has no work left.
func (b *Budget) Spent() bool { return b.Work <= 0 }

// limit is the bound of the next diff's search; nil b bounds it by maxWork only.
func (b *Budget) limit() int {
	if b == nil {
		return maxWork
	}
	return max(0, min(maxWork, b.Work))
}

func (b *Budget) take(work int) {
	if b != nil {
		b.Work -= max(work, 1)
	}
}

// Diff returns an edit script from a to b, in order: a shortest one unless the search passed
// its bound.
func Diff(a, b []string) []Op { return (*Budget)(nil).Diff(a, b) }

// Diff is Diff within budget b.
func (bu *Budget) Diff(a, b []string) []Op {
	d := differ{a: a, b: b, limit: bu.limit()}
	d.compare(0, len(a), 0, len(b))
	bu.take(d.work)
	// Within each run of changes, deletions first (as diff(1) writes them), then number the
	// ops again.
	ops := d.ops
	for i := 0; i < len(ops); {
		if ops[i].Kind == Equal {
			i++
			continue
		}
		j := i
		for j < len(ops) && ops[j].Kind != Equal {
			j++
		}
		run := make([]Op, 0, j-i)
		for _, k := range []Kind{Delete, Insert} {
			for _, op := range ops[i:j] {
				if op.Kind == k {
					run = append(run, op)
				}
			}
		}
		copy(ops[i:j], run)
		i = j
	}
	ai, bi := 0, 0
	for i := range ops {
		ops[i].A, ops[i].B = ai, bi
		switch ops[i].Kind {
		case Equal:
			ai, bi = ai+1, bi+1
		case Delete:
			ai++
		case Insert:
			bi++
		}
	}
	return ops
}

type differ struct {
	a, b   []string
	ops    []Op
	vf, vb []int
	work   int
	limit  int // the bound of work
}

func (d *differ) compare(alo, ahi, blo, bhi int) {
	for alo < ahi && blo < bhi && d.a[alo] == d.b[blo] {
		d.ops = append(d.ops, Op{Equal, alo, blo})
		alo, blo = alo+1, blo+1
	}
	n := 0
	for alo < ahi-n && blo < bhi-n && d.a[ahi-1-n] == d.b[bhi-1-n] {
		n++
	}
	ahi, bhi = ahi-n, bhi-n
	switch {
	case alo == ahi || blo == bhi || d.work > d.limit:
		for i := alo; i < ahi; i++ {
			d.ops = append(d.ops, Op{Delete, i, blo})
		}
		for j := blo; j < bhi; j++ {
			d.ops = append(d.ops, Op{Insert, ahi, j})
		}
	default:
		x, y, u, v, ok := d.middleSnake(alo, ahi, blo, bhi)
		if !ok {
			d.work = d.limit + 1
			d.compare(alo, ahi, blo, bhi)
			break
		}
		d.compare(alo, x, blo, y)
		for i := x; i < u; i++ {
			d.ops = append(d.ops, Op{Equal, i, y + i - x})
		}
		d.compare(u, ahi, v, bhi)
	}
	for k := range n {
		d.ops = append(d.ops, Op{Equal, ahi + k, bhi + k})
	}
}

// middleSnake finds the middle snake of a shortest edit script from a[alo:ahi] to b[blo:bhi]
// (both non-empty, with no common first or last line): the diagonal run (x,y)-(u,v) that the
// forward and reverse searches meet on. Each side of it needs fewer edits than the whole.
// ok is false if the search passed its bound first.
func (d *differ) middleSnake(alo, ahi, blo, bhi int) (x0, y0, x1, y1 int, ok bool) {
	n, m := ahi-alo, bhi-blo
	s := snakeSearch{d: d, alo: alo, blo: blo, ahi: ahi, bhi: bhi, n: n, m: m, delta: n - m}
	maxD := (n + m + 1) / 2
	s.off = maxD + 1
	size := 2*maxD + 3
	if cap(d.vf) < size {
		d.vf, d.vb = make([]int, size), make([]int, size)
	}
	s.vf, s.vb = d.vf[:size], d.vb[:size]
	s.vf[s.off+1], s.vb[s.off+1] = 0, 0
	odd := s.delta&1 != 0
	for D := 0; D <= maxD; D++ {
		if d.work > d.limit {
			return 0, 0, 0, 0, false
		}
		for k := -D; k <= D; k += 2 {
			sx, sy, x, y := s.forward(D, k)
			if kr := s.delta - k; odd && kr >= -(D-1) && kr <= D-1 && x+s.vb[s.off+kr] >= n {
				return alo + sx, blo + sy, alo + x, blo + y, true
			}
		}
		for k := -D; k <= D; k += 2 {
			sx, sy, x, y := s.reverse(D, k)
			if kf := s.delta - k; !odd && kf >= -D && kf <= D && x+s.vf[s.off+kf] >= n {
				return alo + n - x, blo + m - y, alo + n - sx, blo + m - sy, true
			}
		}
	}
	// Unreachable: the searches meet by D = ceil((n+m)/2).
	return 0, 0, 0, 0, false
}

// snakeSearch is the state of one middleSnake: the furthest x reached on each diagonal k
// (offset by off) going forward (vf) and, in reversed coordinates, backward (vb).
type snakeSearch struct {
	d                        *differ
	alo, blo, ahi, bhi, n, m int
	delta, off               int
	vf, vb                   []int
}

// forward extends the furthest D-path on diagonal k from the start: the snake it ends with.
func (s *snakeSearch) forward(D, k int) (sx, sy, x, y int) {
	v := s.vf
	if k == -D || k != D && v[s.off+k-1] < v[s.off+k+1] {
		x = v[s.off+k+1]
	} else {
		x = v[s.off+k-1] + 1
	}
	y = x - k
	sx, sy = x, y
	a, b := s.d.a, s.d.b
	for x < s.n && y < s.m && a[s.alo+x] == b[s.blo+y] {
		x, y = x+1, y+1
	}
	s.d.work += x - sx + 1
	v[s.off+k] = x
	return sx, sy, x, y
}

// reverse extends the furthest D-path on reversed diagonal k from the end.
func (s *snakeSearch) reverse(D, k int) (sx, sy, x, y int) {
	v := s.vb
	if k == -D || k != D && v[s.off+k-1] < v[s.off+k+1] {
		x = v[s.off+k+1]
	} else {
		x = v[s.off+k-1] + 1
	}
	y = x - k
	sx, sy = x, y
	a, b := s.d.a, s.d.b
	for x < s.n && y < s.m && a[s.ahi-1-x] == b[s.bhi-1-y] {
		x, y = x+1, y+1
	}
	s.d.work += x - sx + 1
	v[s.off+k] = x
	return sx, sy, x, y
}

// Stat returns the lines added and removed from a to b.
func Stat(a, b string) (added, removed int) { return (*Budget)(nil).Stat(a, b) }

// Stat is Stat within budget bu.
func (bu *Budget) Stat(a, b string) (added, removed int) {
	for _, op := range bu.Diff(Lines(a), Lines(b)) {
		switch op.Kind {
		case Insert:
			added++
		case Delete:
			removed++
		}
	}
	return added, removed
}

// Unified returns the unified diff from a to b with context lines of context, headed
// "--- oldName" and "+++ newName"; "" when they are equal. It also returns the lines added
// and removed.
func Unified(oldName, newName, a, b string, context int) (diff string, added, removed int) {
	hunks, added, removed := (*Budget)(nil).Hunks(a, b, context)
	if hunks == "" {
		return "", 0, 0
	}
	return Header(oldName, newName) + hunks, added, removed
}

// Header is a unified diff's header: "--- oldName" and "+++ newName".
func Header(oldName, newName string) string {
	return fmt.Sprintf("--- %s\n+++ %s\n", oldName, newName)
}

// Hunks is Unified without its header, within budget bu: "" when a and b are equal.
func (bu *Budget) Hunks(a, b string, context int) (diff string, added, removed int) {
	al, bl := Lines(a), Lines(b)
	ops := bu.Diff(al, bl)
	var changes []int
	for i, op := range ops {
		switch op.Kind {
		case Insert:
			added++
			changes = append(changes, i)
		case Delete:
			removed++
			changes = append(changes, i)
		}
	}
	if len(changes) == 0 {
		return "", 0, 0
	}
	var sb strings.Builder
	for i := 0; i < len(changes); {
		j := i
		for j+1 < len(changes) && changes[j+1]-changes[j] <= 2*context+1 {
			j++
		}
		lo, hi := max(0, changes[i]-context), min(len(ops), changes[j]+context+1)
		var na, nb int
		for _, op := range ops[lo:hi] {
			if op.Kind != Insert {
				na++
			}
			if op.Kind != Delete {
				nb++
			}
		}
		fmt.Fprintf(&sb, "@@ -%s +%s @@\n", hunkRange(ops[lo].A, na), hunkRange(ops[lo].B, nb))
		for _, op := range ops[lo:hi] {
			var line string
			switch op.Kind {
			case Equal:
				sb.WriteByte(' ')
				line = al[op.A]
			case Delete:
				sb.WriteByte('-')
				line = al[op.A]
			case Insert:
				sb.WriteByte('+')
				line = bl[op.B]
			}
			sb.WriteString(line)
			if !strings.HasSuffix(line, "\n") {
				sb.WriteString("\n\\ No newline at end of file\n")
			}
		}
		i = j + 1
	}
	return sb.String(), added, removed
}

// hunkRange is a hunk header's range of count lines from 0-based line start, as GNU diff
// writes it: "N" for one line, "N,0" (N the line before) for none, else "N,count".
func hunkRange(start, count int) string {
	switch count {
	case 0:
		return fmt.Sprintf("%d,0", start)
	case 1:
		return fmt.Sprintf("%d", start+1)
	}
	return fmt.Sprintf("%d,%d", start+1, count)
}
