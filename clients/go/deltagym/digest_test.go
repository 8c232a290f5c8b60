package deltagym_test

import (
	"errors"
	"strings"
	"testing"

	"connectrpc.com/connect"

	deltagym "github.com/deltagym/deltagym/clients/go/deltagym"
	deltagymv1 "github.com/deltagym/deltagym/clients/go/gen/deltagym/v1"
)

// Checkpoint's WaitDigest and Dedupe, and DiffCheckpoints, against a real server over each
// protocol.
func TestDedupeAndDiff(t *testing.T) {
	needServer(t)
	for _, p := range protocols {
		t.Run(p.name, func(t *testing.T) {
			ctx := t.Context()
			c := dial(t, p.opts...)
			content := []byte(p.name + "-" + deltagym.NewIdempotencyKey())
			a := reset(t, c)
			if _, err := a.WriteFile(ctx, "/tmp/state", content); err != nil {
				t.Fatal(err)
			}
			first, err := a.Checkpoint(ctx, deltagym.WaitDigest())
			if err != nil || !strings.HasPrefix(first.Digest.GetFiles(), "sha256:") || first.Deduplicated {
				t.Fatalf("Checkpoint(WaitDigest) = %+v, %v", first, err)
			}
			b := reset(t, c)
			base, err := b.Checkpoint(ctx)
			if err != nil || base.Digest != nil {
				t.Fatalf("Checkpoint = %+v, %v", base, err)
			}
			if _, err := b.WriteFile(ctx, "/tmp/state", content); err != nil {
				t.Fatal(err)
			}
			dup, err := b.Checkpoint(ctx, deltagym.Dedupe())
			if err != nil || !dup.Deduplicated || dup.ID != first.ID || dup.ParentID != base.ID || dup.Digest.GetFiles() != first.Digest.GetFiles() {
				t.Fatalf("Checkpoint(Dedupe) = %+v, %v; want %s with parent %s", dup, err, first.ID, base.ID)
			}
			diff, err := c.DiffCheckpoints(ctx, base.ID, dup.ID, deltagym.WithDiffDetail(deltagymv1.DiffDetail_DIFF_DETAIL_LINES),
				deltagym.WithDiffPath("/tmp"), deltagym.WithMaxPaths(5))
			if err != nil || len(diff.GetPaths()) != 1 || diff.GetPaths()[0].GetPath() != "/tmp/state" || diff.GetPaths()[0].GetLinesAdded() != 1 ||
				diff.GetPaths()[0].GetKind() != deltagymv1.ChangeKind_CHANGE_KIND_ADDED {
				t.Fatalf("DiffCheckpoints = %v, %v", diff, err)
			}
			// Through a step: a third sandbox writes the state and checkpoints it with dedupe.
			third := reset(t, c)
			w, err := third.WriteFile(ctx, "/tmp/state", content, deltagym.WithCheckpointDedupe())
			if err != nil || !w.CheckpointDeduplicated || w.CheckpointID != first.ID || w.CheckpointDigest.GetFiles() != first.Digest.GetFiles() {
				t.Fatalf("WriteFile(WithCheckpointDedupe) = %+v, %v; want %s", w, err, first.ID)
			}
			e, err := third.Exec(ctx, "echo more > /tmp/more", deltagym.WithCheckpointDigest())
			if err != nil || e.CheckpointID == "" || e.CheckpointDeduplicated || !strings.HasPrefix(e.CheckpointDigest.GetFiles(), "sha256:") ||
				e.CheckpointDigest.GetFiles() == first.Digest.GetFiles() {
				t.Fatalf("Exec(WithCheckpointDigest) = %+v, %v", e.StepResult, err)
			}
			var ce *connect.Error
			if _, err := c.DiffCheckpoints(ctx, base.ID, "ck_nope"); !errors.As(err, &ce) || ce.Code() != connect.CodeNotFound {
				t.Fatalf("DiffCheckpoints of an unknown checkpoint: %v", err)
			}
		})
	}
}
