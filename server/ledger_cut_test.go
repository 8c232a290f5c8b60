package server_test

import (
	"bytes"
	"crypto/sha256"
	"encoding/hex"
	"testing"

	deltagymv1 "github.com/deltagym/deltagym/clients/go/gen/deltagym/v1"
	"github.com/deltagym/deltagym/server/episode"
)

// The ledger keeps an action's bulk — a write_file's content, an exec's stdin — up to
// episode.ActionBytesCap, with the whole bulk's size and SHA-256, so that the largest write the
// API takes (64 MiB) is recorded, the ledger goes on, and a trajectory says what it cut.
func TestLedgerCutsActionBulk(t *testing.T) {
	b := setup(t, nil)
	c := b.clients()[0].c
	rr, err := c.Reset(t.Context(), &deltagymv1.ResetRequest{Env: "plain"})
	must(t, err)
	sb, ep := rr.GetSandboxId(), rr.GetEpisodeId()
	defer c.Close(t.Context(), &deltagymv1.CloseRequest{SandboxId: sb})
	big := bytes.Repeat([]byte("0123456789abcdef"), 4<<20) // 64 MiB
	stdin := bytes.Repeat([]byte("x"), episode.ActionBytesCap+1)
	small := []byte("small")
	steps := []struct {
		action *deltagymv1.Action
		bulk   []byte
		cut    bool
	}{
		{writeFileAction("/tmp/big", big), big, true},
		{argvAction(&deltagymv1.ExecAction{Argv: []string{"wc", "-c"}, Stdin: stdin}), stdin, true},
		{writeFileAction("/tmp/small", small), small, false},
	}
	for _, s := range steps {
		_, err := c.Step(t.Context(), &deltagymv1.StepRequest{SandboxId: sb, Action: s.action})
		must(t, err)
	}
	st, err := c.Step(t.Context(), &deltagymv1.StepRequest{SandboxId: sb, Action: execAction("wc -c < /tmp/big")})
	must(t, err)
	if out := stdout(t, st); out != "67108864\n" {
		t.Fatalf("the sandbox's file holds %q bytes", out)
	}
	tr, err := c.GetTrajectory(t.Context(), &deltagymv1.GetTrajectoryRequest{EpisodeId: ep})
	must(t, err)
	if n := len(tr.GetSteps()); n != len(steps)+1 {
		t.Fatalf("the trajectory has %d steps, want %d", n, len(steps)+1)
	}
	for i, s := range steps {
		got := tr.GetSteps()[i]
		a := got.GetAction()
		kept := a.GetWriteFile().GetContent()
		if a.GetExec() != nil {
			kept = a.GetExec().GetStdin()
		}
		sum := sha256.Sum256(s.bulk)
		switch {
		case a == nil:
			t.Fatalf("step %d: no action in the trajectory", i)
		case s.cut && (!bytes.Equal(kept, s.bulk[:episode.ActionBytesCap]) || got.GetActionBulkSizeBytes() != int64(len(s.bulk)) ||
			got.GetActionBulkSha256() != hex.EncodeToString(sum[:])):
			t.Fatalf("step %d: kept %d bytes, size %d, sha256 %q; want the first %d of %d and their hash", i, len(kept),
				got.GetActionBulkSizeBytes(), got.GetActionBulkSha256(), episode.ActionBytesCap, len(s.bulk))
		case !s.cut && (!bytes.Equal(kept, s.bulk) || got.GetActionBulkSizeBytes() != 0 || got.GetActionBulkSha256() != ""):
			t.Fatalf("step %d: an action under the cap is kept whole, without a cut: %v", i, got)
		}
	}
}
