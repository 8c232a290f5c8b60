package sandbox_test

import (
	"errors"
	"maps"
	"os"
	"path/filepath"
	"testing"

	"github.com/deltagym/deltagym/sandbox"
)

// A checkpoint's labels come back from the checkpoint and from a lookup, are added to
// afterwards, survive a restart of the runtime, and go with the checkpoint's record.
func TestCheckpointLabels(t *testing.T) {
	b := setup(t)
	s := b.create(t, sandbox.Spec{})
	ctx := t.Context()
	given := map[string]string{"env": "e", "episode": "ep_1"}
	ck, err := s.CheckpointWith(ctx, sandbox.CheckpointOptions{Labels: given})
	if err != nil {
		t.Fatal(err)
	}
	given["env"] = "changed after the call"
	if !maps.Equal(ck.Labels, map[string]string{"env": "e", "episode": "ep_1"}) {
		t.Fatalf("checkpoint's labels %v", ck.Labels)
	}
	ck.Labels["env"] = "changed in a copy"
	if err := b.rt.SetCheckpointLabels(ck.ID, map[string]string{"episode": "ep_2", "step": "3"}); err != nil {
		t.Fatal(err)
	}
	want := map[string]string{"env": "e", "episode": "ep_2", "step": "3"}
	if info, err := b.rt.Checkpoint(ck.ID); err != nil || !maps.Equal(info.Labels, want) {
		t.Fatalf("lookup: %v, %v; want labels %v", info.Labels, err, want)
	}
	plain, err := s.Checkpoint(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if plain.Labels != nil {
		t.Fatalf("a checkpoint without labels has %v", plain.Labels)
	}

	b.restart(t)
	if info, err := b.rt.Checkpoint(ck.ID); err != nil || !maps.Equal(info.Labels, want) {
		t.Fatalf("after a restart: %v, %v; want labels %v", info.Labels, err, want)
	}
	if err := b.rt.ReleaseCheckpoint(ck.ID); err != nil {
		t.Fatal(err)
	}
	if _, err := b.rt.Checkpoint(ck.ID); !errors.Is(err, sandbox.ErrNotFound) {
		t.Fatalf("lookup of a released checkpoint: %v", err)
	}
	if err := b.rt.SetCheckpointLabels(ck.ID, map[string]string{"x": "y"}); !errors.Is(err, sandbox.ErrNotFound) {
		t.Fatalf("labelling a released checkpoint: %v", err)
	}
	if _, err := os.Stat(filepath.Join(b.cfg.DataDir, "store", "meta", "checkpoints", ck.ID+".json")); !errors.Is(err, os.ErrNotExist) {
		t.Fatalf("a released checkpoint's record: %v", err)
	}
	b.restart(t)
	if _, err := b.rt.Checkpoint(ck.ID); !errors.Is(err, sandbox.ErrNotFound) {
		t.Fatalf("a released checkpoint after a restart: %v", err)
	}
}
