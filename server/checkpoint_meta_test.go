package server_test

import (
	"context"
	"errors"
	"os"
	"path/filepath"
	"testing"
	"time"

	"connectrpc.com/connect"
	"github.com/jackc/pgx/v5"

	deltagymv1 "github.com/deltagym/deltagym/clients/go/gen/deltagym/v1"
	"github.com/deltagym/deltagym/sandbox"
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

// A checkpoint its TTL released is recorded as released in the ledger, as one a call released.
func TestExpiredCheckpointRecorded(t *testing.T) {
	b := setup(t, func(c *server.Config) { c.Admission.CheckpointTTL = 300 * time.Millisecond })
	ctx := t.Context()
	rr, err := b.connect.Reset(ctx, connect.NewRequest(&deltagymv1.ResetRequest{Env: "plain"}))
	must(t, err)
	sb := rr.Msg.GetSandboxId()
	ck, err := b.connect.Checkpoint(ctx, connect.NewRequest(&deltagymv1.CheckpointRequest{SandboxId: sb}))
	must(t, err)
	id := ck.Msg.GetCheckpointId()
	// Closed, the sandbox no longer descends from it: nothing references it.
	_, err = b.connect.Close(ctx, connect.NewRequest(&deltagymv1.CloseRequest{SandboxId: sb}))
	must(t, err)
	conn, err := pgx.Connect(ctx, b.dbURL)
	must(t, err)
	defer conn.Close(context.Background())
	deadline := time.Now().Add(time.Minute) // a watchdog: the TTL is 300 ms
	for {
		var released bool
		err := conn.QueryRow(ctx, `SELECT released_at IS NOT NULL FROM checkpoints WHERE id = $1`, id).Scan(&released)
		if err != nil && !errors.Is(err, pgx.ErrNoRows) {
			t.Fatal(err)
		}
		if released {
			break
		}
		if time.Now().After(deadline) {
			_, rtErr := b.srv.Runtime().Checkpoint(id)
			t.Fatalf("checkpoint %s not recorded as released (in the runtime: %v)", id, rtErr)
		}
		time.Sleep(20 * time.Millisecond) // polling the ledger's delivery
	}
	if _, err := b.srv.Runtime().Checkpoint(id); !errors.Is(err, sandbox.ErrNotFound) {
		t.Fatalf("recorded as released but still held: %v", err)
	}
}
