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

// A checkpoint restored twice in a row has its small top layers merged in
// the background: later restores mount a shorter stack with the same
// contents, over the layer too large to copy, which stays as it is.
func TestFlattenHot(t *testing.T) {
	b := setup(t)
	s := b.create(t, sandbox.Spec{})
	ctx := t.Context()
	list := func() string {
		return sh(t, s, "cd /w && find . | sort | while read f; do if [ -f \"$f\" ]; then echo \"$f $(head -c 16 \"$f\") $(stat -c '%h %s' \"$f\")\"; elif [ -L \"$f\" ]; then echo \"$f -> $(readlink \"$f\")\"; else echo \"$f\"; fi; done; ls /bin/true 2>&1 || true")
	}
	steps := []string{
		// Over 4 MiB: kept below the merge.
		"mkdir -p /w/keep /w/gone; echo k > /w/keep/k; echo g > /w/gone/g; head -c 5242880 /dev/zero > /w/big; rm /bin/true",
		"rm /w/gone/g; echo a > /w/a",
		"rm -rf /w/gone; mkdir /w/gone; echo n > /w/gone/n; ln -s /w/a /w/link",
		"mv /w/keep /w/kept; echo b > /w/b; ln /w/b /w/hard; rm /w/big",
	}
	var ids, want []string
	for _, cmd := range steps {
		sh(t, s, cmd)
		ck, err := s.Checkpoint(ctx)
		if err != nil {
			t.Fatal(err)
		}
		ids = append(ids, ck.ID)
		want = append(want, list())
	}
	sh(t, s, "echo changed > /w/a; rm -rf /w/kept /w/hard")
	top := ids[len(ids)-1]
	if err := s.Restore(ctx, top); err != nil {
		t.Fatal(err)
	}
	if d := s.Depth(); d != 4 {
		t.Fatalf("depth %d after the first restore, want 4 (no merge yet)", d)
	}
	deadline := time.Now().Add(30 * time.Second)
	for s.Depth() != 2 {
		if time.Now().After(deadline) {
			t.Fatalf("restores of a hot checkpoint still at depth %d, want 2 (the large layer and one merged)", s.Depth())
		}
		if err := s.Restore(ctx, top); err != nil {
			t.Fatal(err)
		}
		time.Sleep(10 * time.Millisecond)
	}
	if got := list(); got != want[3] {
		t.Fatalf("hot checkpoint after merging:\n%s\nwant:\n%s", got, want[3])
	}
	// The others are as they were; the one over the large layer alone is
	// not merged (one small layer).
	for _, i := range []int{1, 1, 2, 0} {
		if err := s.Restore(ctx, ids[i]); err != nil {
			t.Fatal(err)
		}
		if got := list(); got != want[i] {
			t.Fatalf("checkpoint %d:\n%s\nwant:\n%s", i, got, want[i])
		}
	}
	if err := s.Restore(ctx, ids[1]); err != nil {
		t.Fatal(err)
	}
	if d := s.Depth(); d != 2 {
		t.Errorf("checkpoint 1 restored at depth %d, want 2", d)
	}
}
