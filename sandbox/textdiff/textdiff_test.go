package textdiff

import (
	"math/rand/v2"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
)

// lcs is the length of a longest common subsequence of a and b, by dynamic programming.
func lcs(a, b []string) int {
	prev, cur := make([]int, len(b)+1), make([]int, len(b)+1)
	for i := range a {
		for j := range b {
			if a[i] == b[j] {
				cur[j+1] = prev[j] + 1
			} else {
				cur[j+1] = max(prev[j+1], cur[j])
			}
		}
		prev, cur = cur, prev
	}
	return prev[len(b)]
}

// check fails unless ops is an edit script from a to b that keeps a longest common
// subsequence.
func check(t *testing.T, a, b []string, ops []Op) {
	t.Helper()
	var got []string
	ai, bi, eq := 0, 0, 0
	for _, op := range ops {
		switch op.Kind {
		case Equal:
			if op.A != ai || op.B != bi || a[op.A] != b[op.B] {
				t.Fatalf("equal op %+v at a=%d b=%d", op, ai, bi)
			}
			got = append(got, a[op.A])
			ai, bi, eq = ai+1, bi+1, eq+1
		case Delete:
			if op.A != ai {
				t.Fatalf("delete op %+v at a=%d", op, ai)
			}
			ai++
		case Insert:
			if op.B != bi {
				t.Fatalf("insert op %+v at b=%d", op, bi)
			}
			got = append(got, b[op.B])
			bi++
		}
	}
	if ai != len(a) || bi != len(b) || strings.Join(got, "") != strings.Join(b, "") {
		t.Fatalf("script from %q to %q ends at a=%d b=%d making %q", a, b, ai, bi, got)
	}
	if want := lcs(a, b); eq != want {
		t.Fatalf("script from %q to %q keeps %d lines, a longest common subsequence has %d", a, b, eq, want)
	}
}

func TestDiffTable(t *testing.T) {
	for _, tc := range []struct{ a, b string }{
		{"", ""}, {"a\n", ""}, {"", "a\n"}, {"a\nb\nc\n", "a\nc\n"}, {"a\nb\nc\n", "a\nx\nc\n"},
		{"abcabba", "cbabac"}, {"x", "y"}, {"a\nb", "a\nb\n"}, {"1\n2\n3\n4\n5\n", "5\n4\n3\n2\n1\n"},
	} {
		a, b := Lines(tc.a), Lines(tc.b)
		if !strings.Contains(tc.a, "\n") && len(tc.a) > 1 {
			a, b = strings.Split(tc.a, ""), strings.Split(tc.b, "")
		}
		check(t, a, b, Diff(a, b))
	}
}

func TestDiffRandom(t *testing.T) {
	rng := rand.New(rand.NewPCG(1, 2))
	for range 2000 {
		a, b := randLines(rng, 30), randLines(rng, 30)
		check(t, a, b, Diff(a, b))
	}
}

func randLines(rng *rand.Rand, n int) []string {
	out := make([]string, rng.IntN(n))
	for i := range out {
		out[i] = string(rune('a'+rng.IntN(4))) + "\n"
	}
	return out
}

func FuzzDiff(f *testing.F) {
	f.Add("a\nb\nc\n", "a\nc\nd\n")
	f.Add("", "x")
	f.Add("abcabba", "cbabac")
	f.Fuzz(func(t *testing.T, a, b string) {
		if len(a) > 300 || len(b) > 300 {
			return
		}
		// Characters as lines: short inputs with many repeats, the hard case.
		al, bl := strings.Split(a, ""), strings.Split(b, "")
		check(t, al, bl, Diff(al, bl))
		added, removed := Stat(a, b)
		la, lb := Lines(a), Lines(b)
		if k := lcs(la, lb); added != len(lb)-k || removed != len(la)-k {
			t.Fatalf("stat %q -> %q: +%d -%d, want +%d -%d", a, b, added, removed, len(lb)-k, len(la)-k)
		}
	})
}

func TestUnifiedFormat(t *testing.T) {
	a := "1\n2\n3\n4\n5\n6\n7\n8\n9\n10\n11\n12\n13\n14\n15\n"
	b := "1\n2\nthree\n4\n5\n6\n7\n8\n9\n10\n11\n12\n13\nfourteen\n15\n"
	got, added, removed := Unified("a/f", "b/f", a, b, 3)
	want := "--- a/f\n+++ b/f\n@@ -1,6 +1,6 @@\n 1\n 2\n-3\n+three\n 4\n 5\n 6\n@@ -11,5 +11,5 @@\n 11\n 12\n 13\n-14\n+fourteen\n 15\n"
	if got != want || added != 2 || removed != 2 {
		t.Fatalf("unified:\n%s\nwant:\n%s(+%d -%d)", got, want, added, removed)
	}
	got, _, _ = Unified("a/f", "b/f", "x", "x\ny", 3)
	if want := "--- a/f\n+++ b/f\n@@ -1 +1,2 @@\n-x\n\\ No newline at end of file\n+x\n+y\n\\ No newline at end of file\n"; got != want {
		t.Fatalf("no newline:\n%q\nwant\n%q", got, want)
	}
	if got, _, _ := Unified("a", "b", "same\n", "same\n", 3); got != "" {
		t.Fatalf("equal texts: %q", got)
	}
	if got, _, _ := Unified("/dev/null", "b/f", "", "n\n", 3); got != "--- /dev/null\n+++ b/f\n@@ -0,0 +1 @@\n+n\n" {
		t.Fatalf("added: %q", got)
	}
}

// TestUnifiedPatch applies random diffs with patch(1) and checks they make the new text.
func TestUnifiedPatch(t *testing.T) {
	patch, err := exec.LookPath("patch")
	if err != nil {
		t.Skip("patch(1) is not installed")
	}
	rng := rand.New(rand.NewPCG(3, 4))
	dir := t.TempDir()
	for i := range 200 {
		a := strings.Join(randLines(rng, 60), "")
		b := strings.Join(randLines(rng, 60), "")
		if rng.IntN(4) == 0 {
			b = strings.TrimSuffix(b, "\n")
		}
		if a == "" {
			a = "seed\n"
		}
		d, _, _ := Unified("a/f", "b/f", a, b, 3)
		f := filepath.Join(dir, "f")
		if err := os.WriteFile(f, []byte(a), 0o644); err != nil {
			t.Fatal(err)
		}
		cmd := exec.Command(patch, "-s", "-p1", "--no-backup-if-mismatch", "-r", "-", "-d", dir)
		cmd.Stdin = strings.NewReader(d)
		if out, err := cmd.CombinedOutput(); err != nil && d != "" {
			t.Fatalf("case %d: patch: %v: %s\n%s", i, err, out, d)
		}
		got, err := os.ReadFile(f)
		if err != nil {
			t.Fatal(err)
		}
		if string(got) != b {
			t.Fatalf("case %d: patched %q, want %q\n%s", i, got, b, d)
		}
	}
}

func BenchmarkDiff64K(b *testing.B) {
	rng := rand.New(rand.NewPCG(5, 6))
	var x, y strings.Builder
	for x.Len() < 64<<10 {
		l := string(rune('a'+rng.IntN(20))) + "\n"
		x.WriteString(l)
		if rng.IntN(10) == 0 {
			y.WriteString("changed\n")
		} else {
			y.WriteString(l)
		}
	}
	for b.Loop() {
		Stat(x.String(), y.String())
	}
}

// A budget bounds the work of several diffs together: once spent, a pathological pair is
// given as deletions and insertions at once (still a correct script), and the budget says so.
func TestBudget(t *testing.T) {
	a, b := strings.Repeat("a\n", 4000), strings.Repeat("b\nc\n", 2000)+"a\n"
	exactAdded, exactRemoved := Stat(a, b)
	bu := Budget{Work: 1000}
	added, removed := bu.Stat(a, b)
	if !bu.Spent() {
		t.Fatalf("budget left %d after a diff past it", bu.Work)
	}
	if added < exactAdded || removed < exactRemoved || added-removed != exactAdded-exactRemoved {
		t.Fatalf("within a budget: +%d -%d; exact +%d -%d", added, removed, exactAdded, exactRemoved)
	}
	// Spent, the next diff still yields a correct script, at once.
	hunks, added, removed := bu.Hunks("x\ny\n", "x\nz\n", 3)
	if added != 1 || removed != 1 || Header("a/f", "b/f")+hunks != "--- a/f\n+++ b/f\n@@ -1,2 +1,2 @@\n x\n-y\n+z\n" {
		t.Fatalf("spent budget: %q +%d -%d", hunks, added, removed)
	}
	// Enough budget: the shortest script, and the work taken.
	bu = Budget{Work: 1 << 30}
	if added, removed := bu.Stat(a, b); added != exactAdded || removed != exactRemoved || bu.Work == 1<<30 {
		t.Fatalf("ample budget: +%d -%d, left %d", added, removed, bu.Work)
	}
	if u, _, _ := Unified("a/f", "b/f", a, b, 3); u != Header("a/f", "b/f")+func() string { h, _, _ := (&Budget{Work: 1 << 30}).Hunks(a, b, 3); return h }() {
		t.Fatal("Unified is not Header and Hunks")
	}
}
