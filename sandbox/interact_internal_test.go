package sandbox

import (
	"bytes"
	"errors"
	"regexp"
	"strings"
	"testing"
	"time"
)

// feed adds chunks to m one by one and returns whether, and after which chunk, it found the
// outcome.
func feed(t *testing.T, m *matcher, chunks ...string) int {
	t.Helper()
	for i, c := range chunks {
		found, err := m.add([]byte(c))
		if err != nil {
			t.Fatalf("chunk %d: %v", i, err)
		}
		if found {
			return i
		}
	}
	return -1
}

// The search of a growing output finds a match that spans reads, the earliest first, and reads
// ^, (?m)^ and \b as they read the whole output, however far in the output is.
func TestMatcherWindow(t *testing.T) {
	expect := func(p ...string) []*regexp.Regexp {
		out := make([]*regexp.Regexp, len(p))
		for i, s := range p {
			out[i] = regexp.MustCompile(s)
		}
		return out
	}
	long := strings.Repeat("x", 3*expectStep+17)

	m := newMatcher("__T", expect(`>>> `), 1<<20, nil)
	if i := feed(t, m, long, "ok\n>", ">> tail"); i != 2 || string(m.acc[:m.stop]) != long+"ok\n" || string(m.acc[m.next:]) != "tail" {
		t.Fatalf("a prompt over two reads: chunk %d, output %q, rest %q", i, m.acc[:m.stop], m.acc[m.next:])
	}

	// Not at the start of the output, so not a match of ^ (without m) nor of \b.
	m = newMatcher("__T", expect(`^foo`, `\bbar`), 1<<20, nil)
	if i := feed(t, m, long, "foo", "xbar", "\n"); i != -1 {
		t.Fatalf("^foo or \\bbar matched inside a line: chunk %d at %d", i, m.stop)
	}
	if i := feed(t, m, "bar"); i != 0 || m.stop != len(long)+len("fooxbar\n") {
		t.Fatalf("\\bbar at a line's start: chunk %d at %d", i, m.stop)
	}
	m = newMatcher("__T", expect(`^foo`), 1<<20, []byte("fo"))
	if i := feed(t, m, "o and more"); i != 0 || m.stop != 0 {
		t.Fatalf("^foo at the start of the output: chunk %d at %d", i, m.stop)
	}
	m = newMatcher("__T", expect(`(?m)^prompt> `), 1<<20, nil)
	if i := feed(t, m, long, "prompt> ", "\nprompt> "); i != 2 || m.stop != len(long)+len("prompt> \n") {
		t.Fatalf("(?m)^ after a newline: chunk %d at %d", i, m.stop)
	}

	// The sentinel ends the search for the patterns: a match past it is the next call's.
	m = newMatcher("__T", expect(`never`, `after`), 1<<20, nil)
	if i := feed(t, m, long, "\n__", "T_RC=3\nafter"); i != 2 || m.matched != nil || m.rc != 3 || string(m.acc[m.next:]) != "after" {
		t.Fatalf("sentinel: chunk %d matched %v rc %d rest %q", i, m.matched, m.rc, m.acc[m.next:])
	}
}

// However costly the patterns and however fast the output, the search takes at most its budget
// and one step more, then fails saying so; each step is short enough that halt is obeyed.
func TestMatcherBudget(t *testing.T) {
	costly := regexp.MustCompile(`(?:.{100}){10}q`) // 1003 instructions: every byte is a start
	if n, err := ExpectSize(costly.String()); err != nil || n > MaxExpectInsts {
		t.Fatalf("the pattern is not within the bounds: %d %v", n, err)
	}
	expect := []*regexp.Regexp{costly, regexp.MustCompile(`(?:[a-z]{100}){9}Q`)}
	m := newMatcher("__T", expect, 1<<20, nil)
	chunk := bytes.Repeat([]byte("abcdefgh"), 4<<10)
	start := time.Now()
	var err error
	longest := time.Duration(0)
	for n := 0; err == nil; n++ {
		before := m.spent
		_, err = m.add(chunk)
		longest = max(longest, m.spent-before)
		if n > 100_000 {
			t.Fatal("the search never ran out of its budget")
		}
	}
	took := time.Since(start)
	if !errors.Is(err, ErrExpectBudget) || !strings.Contains(err.Error(), "took more than 2s") {
		t.Fatalf("err %v, want ErrExpectBudget", err)
	}
	if took > expectBudget+2*time.Second {
		t.Fatalf("the search took %v, over its budget of %v", took, expectBudget)
	}
	t.Logf("budget spent in %v, the longest add %v", took, longest)

	// A halt stops the search between its steps: no step runs once halt is true.
	halted := false
	m = newMatcher("__T", expect, 1<<20, nil)
	m.halt = func() bool { return halted }
	halted = true
	if found, err := m.add(chunk); found || err != nil || m.scanned != 0 || m.spent != 0 {
		t.Fatalf("halted search: found %v err %v scanned %d spent %v", found, err, m.scanned, m.spent)
	}
	halted = false
	if found, err := m.add(nil); found || err != nil || m.scanned != len(chunk) {
		t.Fatalf("resumed search: found %v err %v scanned %d of %d", found, err, m.scanned, len(chunk))
	}
}
