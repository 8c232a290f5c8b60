package sandbox_test

import (
	"fmt"
	"strings"
	"testing"

	"github.com/deltagym/deltagym/sandbox"
)

// A diff's file details are bounded per request: names of one pair of contents share one
// result, the unified text stops at its budget (the answer says so), and distinct
// pathological pairs stop at the work budget.
func TestDiffBudgets(t *testing.T) {
	b := setup(t)
	ctx := t.Context()

	t.Run("one pair, many names", func(t *testing.T) {
		base, ck := linkShape(t, b, 200, strings.Repeat("a\n", 4000), strings.Repeat("b\n", 4000))
		d, err := b.rt.DiffCheckpoints(ctx, base, ck, sandbox.DiffOptions{Detail: sandbox.DiffLines, Path: "/w"})
		if err != nil {
			t.Fatal(err)
		}
		links := 0
		for _, c := range d.Paths {
			if strings.HasPrefix(c.Path, "/w/l") {
				links++
				if c.LinesAdded != 4000 || c.LinesRemoved != 4000 || c.Binary {
					t.Fatalf("%s: %+v", c.Path, c)
				}
			}
		}
		if links != 200 || d.DetailsTruncated {
			t.Fatalf("%d links, details truncated %v", links, d.DetailsTruncated)
		}
	})

	t.Run("unified text budget", func(t *testing.T) {
		base, ck := linkShape(t, b, 300, strings.Repeat("a\n", 32767), "")
		d, err := b.rt.DiffCheckpoints(ctx, base, ck, sandbox.DiffOptions{Detail: sandbox.DiffUnified, Path: "/w"})
		if err != nil {
			t.Fatal(err)
		}
		total, with, without := 0, 0, 0
		for _, c := range d.Paths {
			if !strings.HasPrefix(c.Path, "/w/l") {
				continue
			}
			if c.LinesAdded != 32767 {
				t.Fatalf("%s: %+v", c.Path, c)
			}
			total += len(c.Unified)
			if c.Unified == "" {
				without++
				continue
			}
			with++
			if !strings.HasPrefix(c.Unified, "--- /dev/null\n+++ b"+c.Path+"\n@@ -0,0 +1,32767 @@\n+a\n") {
				t.Fatalf("%s: unified %.80q", c.Path, c.Unified)
			}
		}
		if !d.DetailsTruncated || total > 16<<20 || with == 0 || without == 0 {
			t.Fatalf("unified: %d bytes, %d files with, %d without, details truncated %v", total, with, without, d.DetailsTruncated)
		}
	})

	t.Run("work budget", func(t *testing.T) {
		s := b.create(t, sandbox.Spec{})
		for i := range 20 {
			if err := s.WriteFile(ctx, fmt.Sprintf("/w/f%02d", i), []byte(strings.Repeat("a\n", 4000)+fmt.Sprint(i)), 0, false); err != nil {
				t.Fatal(err)
			}
		}
		base, _ := ckDigest(t, b, s)
		for i := range 20 {
			if err := s.WriteFile(ctx, fmt.Sprintf("/w/f%02d", i), []byte(strings.Repeat("b\n", 4000)+fmt.Sprint(i)), 0, false); err != nil {
				t.Fatal(err)
			}
		}
		ck, _ := ckDigest(t, b, s)
		d, err := b.rt.DiffCheckpoints(ctx, base.ID, ck.ID, sandbox.DiffOptions{Detail: sandbox.DiffLines, Path: "/w"})
		if err != nil {
			t.Fatal(err)
		}
		counted := 0
		for _, c := range d.Paths {
			if c.LinesAdded > 0 {
				counted++
			}
		}
		if len(d.Paths) != 20 || !d.DetailsTruncated || counted == 0 || counted == 20 {
			t.Fatalf("%d paths, %d counted, details truncated %v", len(d.Paths), counted, d.DetailsTruncated)
		}
	})
}
