package sandbox_test

import (
	"context"
	"errors"
	"testing"
	"time"

	"github.com/deltagym/deltagym/sandbox"
)

// A closed sandbox is ended for its callers at once, and its checkpoints
// keep their processes: the templates are saved in the background, and a
// fork made meanwhile gets them too.
func TestCloseKeepsProcessCheckpoints(t *testing.T) {
	needCRIU(t)
	b := setup(t)
	s, ck := counterCheckpoint(t, b)
	inc(t, s, 2)
	ck2, err := s.Checkpoint(t.Context())
	if err != nil {
		t.Fatal(err)
	}
	ctx := t.Context()
	for range 2 { // idempotent
		if err := s.Close(ctx); err != nil {
			t.Fatal(err)
		}
	}
	if _, err := s.Exec(ctx, sandbox.ExecRequest{Command: "true"}); !errors.Is(err, sandbox.ErrClosed) {
		t.Fatalf("exec in a closed sandbox: %v", err)
	}
	for i, c := range []sandbox.CheckpointInfo{ck, ck2} {
		kids, err := b.rt.Fork(ctx, c.ID, 1, sandbox.Spec{})
		if err != nil {
			t.Fatalf("fork of checkpoint %d after Close: %v", i, err)
		}
		kid := kids[0]
		inc(t, kid, i+2) // the counter came back at the checkpoint's count
		if got := sh(t, kid, countCounters); got != "1\n" {
			t.Fatalf("fork %d runs %q counters", i, got)
		}
		if err := kid.Close(ctx); err != nil {
			t.Fatal(err)
		}
	}
	watchdog := time.NewTimer(2 * time.Minute)
	defer watchdog.Stop()
	select {
	case <-s.Done():
	case <-watchdog.C:
		t.Fatalf("closed sandbox not torn down; %d retiring", b.rt.Retiring())
	}
	if err := s.Destroy(context.Background()); err != nil {
		t.Fatalf("destroy after close: %v", err)
	}
	// The templates are gone with their sandbox; the images stay.
	kids, err := b.rt.Fork(ctx, ck.ID, 1, sandbox.Spec{})
	if err != nil {
		t.Fatalf("fork once the sandbox is torn down: %v", err)
	}
	inc(t, kids[0], 2)
	_ = kids[0].Destroy(context.Background())
}
