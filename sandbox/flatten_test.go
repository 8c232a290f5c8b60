package sandbox_test

import (
	"fmt"
	"testing"
	"time"

	"github.com/deltagym/deltagym/sandbox"
)

// A long chain of checkpoints is flattened in the background: the live
// stack stays shallow, and every checkpoint, old or new, restores to exactly
// what it held — whiteouts, opaque directories and renames included.
func TestFlattenKeepsContents(t *testing.T) {
	b := setup(t, func(c *sandbox.Config) { c.FlattenDepth = 4 })
	s := b.create(t, sandbox.Spec{})
	ctx := t.Context()
	sh(t, s, "mkdir -p /w/keep /w/gone; echo k > /w/keep/k; echo g > /w/gone/g; rm /bin/true")
	var ids []string
	var want []string
	for i := range 40 {
		cmd := fmt.Sprintf("echo %d > /w/f%d; rm -f /w/f%d", i, i, i-3)
		switch i % 5 {
		case 1: // an opaque directory
			cmd += fmt.Sprintf("; rm -rf /w/gone; mkdir /w/gone; echo new%d > /w/gone/n", i)
		case 2: // a directory rename
			cmd += fmt.Sprintf("; rm -rf /w/kept; mv /w/keep /w/kept; mkdir /w/keep; echo %d > /w/keep/k", i)
		case 3:
			cmd += fmt.Sprintf("; ln -sf /w/f%d /w/link; ln -f /w/f%d /w/hard", i, i)
		}
		sh(t, s, cmd)
		ck, err := s.Checkpoint(ctx)
		if err != nil {
			t.Fatal(err)
		}
		ids = append(ids, ck.ID)
		want = append(want, sh(t, s, "cd /w && find . | sort | while read f; do if [ -f \"$f\" ]; then echo \"$f $(cat \"$f\") $(stat -c %h \"$f\")\"; else echo \"$f\"; fi; done; ls /bin/true 2>&1 || true"))
	}
	// Wait for the flattener to catch up with the chain (bounded).
	deadline := time.Now().Add(30 * time.Second)
	for {
		sh(t, s, "echo x > /w/tick")
		if _, err := s.Checkpoint(ctx); err != nil {
			t.Fatal(err)
		}
		if s.Depth() <= 8 {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("stack still %d deep", s.Depth())
		}
		time.Sleep(20 * time.Millisecond)
	}
	for _, i := range []int{39, 0, 20, 5, 38, 13} {
		if err := s.Restore(ctx, ids[i]); err != nil {
			t.Fatal(err)
		}
		got := sh(t, s, "cd /w && find . | sort | while read f; do if [ -f \"$f\" ]; then echo \"$f $(cat \"$f\") $(stat -c %h \"$f\")\"; else echo \"$f\"; fi; done; ls /bin/true 2>&1 || true")
		if got != want[i] {
			t.Fatalf("checkpoint %d after flattening:\n%s\nwant:\n%s", i, got, want[i])
		}
		if d := s.Depth(); d > 8 && i >= 8 {
			t.Errorf("restored checkpoint %d at depth %d: not flattened", i, d)
		}
	}
}
