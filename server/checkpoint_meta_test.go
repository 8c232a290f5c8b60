package server_test

import (
	"errors"
	"os"
	"path/filepath"
	"testing"

	"connectrpc.com/connect"

	deltagymv1 "github.com/deltagym/deltagym/clients/go/gen/deltagym/v1"
	"github.com/deltagym/deltagym/server"
)

// Where a checkpoint was taken lives in the checkpoint's own record: a released checkpoint
// leaves nothing behind, neither its record nor anything the server answers from.
func TestReleasedCheckpointLeavesNothing(t *testing.T) {
	b := setup(t, func(c *server.Config) { c.NoLedger = true })
	ctx := t.Context()
	rr, err := b.connect.Reset(ctx, connect.NewRequest(&deltagymv1.ResetRequest{Env: "plain", Run: "r"}))
	must(t, err)
	sb := rr.Msg.GetSandboxId()
	st, err := b.connect.Step(ctx, connect.NewRequest(&deltagymv1.StepRequest{SandboxId: sb, Action: execAction("true"), Checkpoint: true}))
	must(t, err)
	ck := st.Msg.GetCheckpointId()
	record := filepath.Join(b.data, "sandbox", "store", "meta", "checkpoints", ck+".json")
	if _, err := os.Stat(record); err != nil {
		t.Fatalf("the checkpoint's record: %v", err)
	}
	info, err := b.srv.Runtime().Checkpoint(ck)
	must(t, err)
	if l := info.Labels; l["deltagym.env"] != "plain" || l["deltagym.run"] != "r" || l["deltagym.episode"] != rr.Msg.GetEpisodeId() || l["deltagym.steps"] != "1" {
		t.Fatalf("the checkpoint's labels: %v", l)
	}
	_, err = b.connect.ReleaseCheckpoint(ctx, connect.NewRequest(&deltagymv1.ReleaseCheckpointRequest{CheckpointId: ck}))
	must(t, err)
	if _, err := os.Stat(record); !errors.Is(err, os.ErrNotExist) {
		t.Fatalf("the released checkpoint's record: %v", err)
	}
	_, err = b.connect.Restore(ctx, connect.NewRequest(&deltagymv1.RestoreRequest{SandboxId: sb, CheckpointId: ck}))
	if connect.CodeOf(err) != connect.CodeNotFound {
		t.Fatalf("restoring a released checkpoint: %v, want NotFound", err)
	}
	_, err = b.connect.Fork(ctx, connect.NewRequest(&deltagymv1.ForkRequest{Source: &deltagymv1.ForkRequest_CheckpointId{CheckpointId: ck}, N: 1}))
	if connect.CodeOf(err) != connect.CodeNotFound {
		t.Fatalf("forking a released checkpoint: %v, want NotFound", err)
	}
	_, err = b.connect.ReleaseCheckpoint(ctx, connect.NewRequest(&deltagymv1.ReleaseCheckpointRequest{CheckpointId: ck}))
	if connect.CodeOf(err) != connect.CodeNotFound {
		t.Fatalf("releasing it again: %v, want NotFound", err)
	}
}
