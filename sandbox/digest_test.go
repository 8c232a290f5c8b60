package sandbox_test

import (
	"context"
	"errors"
	"fmt"
	"io"
	"strings"
	"sync"
	"testing"

	"golang.org/x/sys/unix"

	"github.com/deltagym/deltagym/sandbox"
)

// ckDigest takes a checkpoint of s and waits for its state digest.
func ckDigest(t *testing.T, b *bundle, s *sandbox.Sandbox) (sandbox.CheckpointInfo, sandbox.StateDigest) {
	t.Helper()
	ck, err := s.Checkpoint(t.Context())
	if err != nil {
		t.Fatal(err)
	}
	d, err := b.rt.StateDigest(t.Context(), ck.ID)
	if err != nil {
		t.Fatal(err)
	}
	if !strings.HasPrefix(d.Files, "sha256:") || len(d.Files) != 71 {
		t.Fatalf("files digest %q", d.Files)
	}
	return ck, d
}

// Identical states reached by different paths have equal digests.
func TestStateDigestEqualAcrossPaths(t *testing.T) {
	b := setup(t)
	s := b.create(t, sandbox.Spec{})
	ctx := t.Context()
	sh(t, s, "mkdir -p /w; echo base > /w/base")
	base, dBase := ckDigest(t, b, s)
	if got, ok := b.rt.StateDigestReady(base.ID); !ok || got != dBase {
		t.Fatalf("ready %v %v, want %v", got, ok, dBase)
	}
	if dBase.Processes != "" {
		t.Fatalf("no process, processes digest %q", dBase.Processes)
	}
	// Written then deleted in a later checkpoint (a whiteout over nothing): as never written.
	sh(t, s, "echo tmp > /w/tmp; mkdir /w/d; echo x > /w/d/x")
	_, d1 := ckDigest(t, b, s)
	if d1 == dBase {
		t.Fatal("a new file left the digest as it was")
	}
	sh(t, s, "rm -r /w/tmp /w/d")
	_, d2 := ckDigest(t, b, s)
	if d2 != dBase {
		t.Fatalf("write then delete: %v, want %v", d2, dBase)
	}
	// chmod back and forth, in two checkpoints.
	sh(t, s, "chmod 600 /w/base")
	ckDigest(t, b, s)
	sh(t, s, "chmod 644 /w/base")
	if _, d := ckDigest(t, b, s); d != dBase {
		t.Fatalf("chmod back: %v, want %v", d, dBase)
	}
	// The same content written in two orders, from the base.
	sh(t, s, "echo x > /w/x; echo y > /w/y")
	_, dxy := ckDigest(t, b, s)
	if err := s.Restore(ctx, base.ID); err != nil {
		t.Fatal(err)
	}
	sh(t, s, "echo y > /w/y; echo x > /w/x")
	_, dyx := ckDigest(t, b, s)
	if dxy != dyx {
		t.Fatalf("two orders: %v and %v", dxy, dyx)
	}
	// Another sandbox, from the image, doing the same.
	o := b.create(t, sandbox.Spec{})
	sh(t, o, "mkdir -p /w; echo base > /w/base; echo x > /w/x; echo y > /w/y")
	if _, d := ckDigest(t, b, o); d != dxy {
		t.Fatalf("from the image: %v, want %v", d, dxy)
	}
	// A sandbox with live processes: the upper is copied, not sealed.
	sh(t, o, "rm /w/x /w/y")
	if _, err := o.Exec(ctx, sandbox.ExecRequest{Command: "sleep 1000", Background: true}); err != nil {
		t.Fatal(err)
	}
	ck, err := o.CheckpointWith(ctx, sandbox.CheckpointOptions{Processes: sandbox.ProcessesNone})
	if err != nil {
		t.Fatal(err)
	}
	if d, err := b.rt.StateDigest(ctx, ck.ID); err != nil || d.Files != dBase.Files {
		t.Fatalf("with live processes: %v %v, want files %v", d, err, dBase.Files)
	}
}

// Each attribute of a path changes the digest.
func TestStateDigestAttributes(t *testing.T) {
	b := setup(t)
	s := b.create(t, sandbox.Spec{})
	ctx := t.Context()
	sh(t, s, "mkdir -p /w/dir; echo data > /w/f; ln -s /w/f /w/l")
	base, dBase := ckDigest(t, b, s)
	setX := func(name, value string) func() {
		return func() {
			p := fmt.Sprintf("/proc/%d/root/w/f", s.InitPid())
			if err := unix.Lsetxattr(p, name, []byte(value), 0); err != nil {
				t.Fatal(err)
			}
		}
	}
	seen := map[sandbox.StateDigest]string{dBase: "base"}
	for _, tc := range []struct {
		name string
		cmd  string
		fn   func()
	}{
		{"content", "echo datb > /w/f", nil},
		{"content size", "echo data2 > /w/f", nil},
		{"mode", "chmod 600 /w/f", nil},
		{"setuid", "chmod 4644 /w/f", nil},
		{"owner", "chown 1000 /w/f", nil},
		{"group", "chgrp 1000 /w/f", nil},
		{"xattr", "", setX("user.k", "v")},
		{"xattr value", "", setX("user.k", "w")},
		{"symlink target", "ln -sfn /w/g /w/l", nil},
		{"type", "rm /w/f; mkdir /w/f", nil},
		{"dir mode", "chmod 700 /w/dir", nil},
		{"whiteout", "rm /bin/true", nil},
		{"fifo", "mkfifo /w/p", nil},
		{"empty file", "touch /w/e", nil},
	} {
		if err := s.Restore(ctx, base.ID); err != nil {
			t.Fatal(err)
		}
		sh(t, s, "true")
		if tc.cmd != "" {
			sh(t, s, tc.cmd)
		}
		if tc.fn != nil {
			tc.fn()
		}
		_, d := ckDigest(t, b, s)
		if prev, ok := seen[d]; ok {
			t.Errorf("%s: digest as %s's", tc.name, prev)
		}
		seen[d] = tc.name
	}
	// Times are not state.
	if err := s.Restore(ctx, base.ID); err != nil {
		t.Fatal(err)
	}
	sh(t, s, "touch -d 2001-01-01 /w/f /w/dir")
	if _, d := ckDigest(t, b, s); d != dBase {
		t.Fatalf("times changed the digest")
	}
}

// StateDigest of an unknown or released checkpoint is ErrNotFound; the digest hook is called
// once per checkpoint.
func TestStateDigestReleasedAndHook(t *testing.T) {
	var mu sync.Mutex
	calls := map[string]int{}
	b := setup(t, func(c *sandbox.Config) {
		c.OnStateDigest = func(id string, d sandbox.StateDigest) {
			mu.Lock()
			calls[id]++
			mu.Unlock()
		}
	})
	s := b.create(t, sandbox.Spec{})
	ctx := t.Context()
	if _, err := b.rt.StateDigest(ctx, "ck-nope"); !errorsIs(err, sandbox.ErrNotFound) {
		t.Fatalf("unknown: %v", err)
	}
	ck, d := ckDigest(t, b, s)
	if err := b.rt.ReleaseCheckpoint(ck.ID); err != nil {
		t.Fatal(err)
	}
	if _, err := b.rt.StateDigest(ctx, ck.ID); !errorsIs(err, sandbox.ErrNotFound) {
		t.Fatalf("released: %v", err)
	}
	ck2, d2 := ckDigest(t, b, s)
	if d2 != d {
		t.Fatalf("same state: %v, %v", d2, d)
	}
	mu.Lock()
	defer mu.Unlock()
	if calls[ck.ID] != 1 || calls[ck2.ID] != 1 {
		t.Fatalf("hook calls %v", calls)
	}
}

var _ = io.EOF
var _ = context.Background

func errorsIs(err, target error) bool { return err != nil && errors.Is(err, target) }
