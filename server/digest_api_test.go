package server_test

import (
	"slices"
	"strings"
	"testing"

	"connectrpc.com/connect"

	deltagymv1 "github.com/deltagym/deltagym/clients/go/gen/deltagym/v1"
)

// State digests, deduplicating checkpoints and DiffCheckpoints through Connect and gRPC, with
// the ledger's graph of the checkpoints.
func TestDigestDedupeDiff(t *testing.T) {
	b := setup(t, nil)
	for _, cl := range b.clients() {
		t.Run(cl.name, func(t *testing.T) {
			c, ctx := cl.c, t.Context()
			run := "digest-" + cl.name
			write := func(sb, path string, checkpoint, wait, dedupe bool) *deltagymv1.StepResponse {
				t.Helper()
				r, err := c.Step(ctx, &deltagymv1.StepRequest{SandboxId: sb, Checkpoint: checkpoint, CheckpointWaitForDigest: wait, CheckpointDedupe: dedupe,
					Action: &deltagymv1.Action{Kind: &deltagymv1.Action_WriteFile{WriteFile: &deltagymv1.WriteFileAction{Path: path, Content: []byte(cl.name + "\n")}}}})
				must(t, err)
				return r
			}
			r1, err := c.Reset(ctx, &deltagymv1.ResetRequest{Env: "plain", Run: run})
			must(t, err)
			first := write(r1.GetSandboxId(), "/tmp/a", true, true, false)
			if d := first.GetCheckpointDigest(); !strings.HasPrefix(d.GetFiles(), "sha256:") || first.GetCheckpointDeduplicated() {
				t.Fatalf("a step that waits for its checkpoint's digest: %v", first)
			}
			// A second sandbox takes a checkpoint of its own, then comes to the first's state.
			r2, err := c.Reset(ctx, &deltagymv1.ResetRequest{Env: "plain", Run: run})
			must(t, err)
			sb := r2.GetSandboxId()
			own := write(sb, "/tmp/b", true, false, false)
			if own.GetCheckpointDigest() != nil {
				t.Fatalf("a step that did not wait has a digest: %v", own.GetCheckpointDigest())
			}
			_, err = c.Step(ctx, &deltagymv1.StepRequest{SandboxId: sb, Action: &deltagymv1.Action{Kind: &deltagymv1.Action_Remove{Remove: &deltagymv1.RemoveAction{Path: "/tmp/b"}}}})
			must(t, err)
			write(sb, "/tmp/a", false, false, false)
			ck, err := c.Checkpoint(ctx, &deltagymv1.CheckpointRequest{SandboxId: sb, Dedupe: true})
			must(t, err)
			if !ck.GetDeduplicated() || ck.GetCheckpointId() != first.GetCheckpointId() || ck.GetParentId() != own.GetCheckpointId() ||
				ck.GetDigest().GetFiles() != first.GetCheckpointDigest().GetFiles() {
				t.Fatalf("a deduplicating Checkpoint: %v, want %s with parent %s", ck, first.GetCheckpointId(), own.GetCheckpointId())
			}
			// Either flag without checkpoint is refused.
			_, err = c.Step(ctx, &deltagymv1.StepRequest{SandboxId: sb, CheckpointDedupe: true, Action: execAction("true")})
			if codeOf(err) != connect.CodeInvalidArgument {
				t.Fatalf("checkpoint_dedupe without checkpoint: %v", err)
			}
			// The diff from the second sandbox's own checkpoint to the state found.
			diff, err := c.DiffCheckpoints(ctx, &deltagymv1.DiffCheckpointsRequest{BaseCheckpointId: own.GetCheckpointId(), CheckpointId: ck.GetCheckpointId(),
				Detail: deltagymv1.DiffDetail_DIFF_DETAIL_UNIFIED, Path: "/tmp"})
			must(t, err)
			var paths []string
			for _, p := range diff.GetPaths() {
				paths = append(paths, p.GetPath()+" "+p.GetKind().String())
				if p.GetPath() == "/tmp/a" && (p.GetLinesAdded() != 1 || !strings.Contains(p.GetUnifiedDiff(), "+"+cl.name)) {
					t.Fatalf("/tmp/a: %v", p)
				}
			}
			if want := []string{"/tmp/a CHANGE_KIND_ADDED", "/tmp/b CHANGE_KIND_REMOVED"}; !slices.Equal(paths, want) {
				t.Fatalf("diff paths %v, want %v", paths, want)
			}
			if diff.GetDigest().GetFiles() != ck.GetDigest().GetFiles() || diff.GetBaseDigest().GetFiles() == "" {
				t.Fatalf("diff digests: %v, %v", diff.GetBaseDigest(), diff.GetDigest())
			}
			for _, bad := range []struct {
				name string
				req  *deltagymv1.DiffCheckpointsRequest
				code connect.Code
			}{
				{"no base", &deltagymv1.DiffCheckpointsRequest{CheckpointId: ck.GetCheckpointId()}, connect.CodeInvalidArgument},
				{"negative max_paths", &deltagymv1.DiffCheckpointsRequest{BaseCheckpointId: own.GetCheckpointId(), CheckpointId: ck.GetCheckpointId(), MaxPaths: -1}, connect.CodeInvalidArgument},
				{"relative path", &deltagymv1.DiffCheckpointsRequest{BaseCheckpointId: own.GetCheckpointId(), CheckpointId: ck.GetCheckpointId(), Path: "tmp"}, connect.CodeInvalidArgument},
				{"undefined detail", &deltagymv1.DiffCheckpointsRequest{BaseCheckpointId: own.GetCheckpointId(), CheckpointId: ck.GetCheckpointId(), Detail: 9}, connect.CodeInvalidArgument},
			} {
				if _, err := c.DiffCheckpoints(ctx, bad.req); codeOf(err) != bad.code {
					t.Fatalf("%s: %v, want %v", bad.name, err, bad.code)
				}
			}
			_, err = c.DiffCheckpoints(ctx, &deltagymv1.DiffCheckpointsRequest{BaseCheckpointId: own.GetCheckpointId(), CheckpointId: "ck_nope"})
			wantReason(t, "DiffCheckpoints of an unknown checkpoint", err, connect.CodeNotFound, "CHECKPOINT_NOT_FOUND", "checkpoint_id", "ck_nope")
			// An undo: the second sandbox goes back to its own checkpoint's state, which a
			// deduplicating Checkpoint finds: an edge from the first's checkpoint to an
			// ancestor of it, closing a cycle, which the ledger's graph keeps.
			_, err = c.Step(ctx, &deltagymv1.StepRequest{SandboxId: sb, Action: &deltagymv1.Action{Kind: &deltagymv1.Action_Remove{Remove: &deltagymv1.RemoveAction{Path: "/tmp/a"}}}})
			must(t, err)
			write(sb, "/tmp/b", false, false, false)
			back, err := c.Checkpoint(ctx, &deltagymv1.CheckpointRequest{SandboxId: sb, Dedupe: true})
			must(t, err)
			if !back.GetDeduplicated() || back.GetCheckpointId() != own.GetCheckpointId() || back.GetParentId() != first.GetCheckpointId() {
				t.Fatalf("a deduplicating Checkpoint back at %s: %v, want it with parent %s", own.GetCheckpointId(), back, first.GetCheckpointId())
			}
			// ListCheckpoints reports the digest; the ledger's graph the second parents.
			list, err := c.ListCheckpoints(ctx, &deltagymv1.ListCheckpointsRequest{Run: run})
			must(t, err)
			for _, s := range list.GetCheckpoints() {
				if s.GetCheckpointId() == first.GetCheckpointId() && s.GetDigest().GetFiles() != first.GetCheckpointDigest().GetFiles() {
					t.Fatalf("listed digest %v, want %v", s.GetDigest(), first.GetCheckpointDigest())
				}
			}
			tree, err := c.GetCheckpointTree(ctx, &deltagymv1.GetCheckpointTreeRequest{Scope: &deltagymv1.GetCheckpointTreeRequest_Run{Run: run}})
			must(t, err)
			in, seen := map[string]bool{}, map[string]bool{}
			for _, n := range tree.GetNodes() {
				in[n.GetCheckpointId()] = true
			}
			found := 0
			for _, n := range tree.GetNodes() {
				if p := n.GetParentId(); in[p] && !seen[p] {
					t.Fatalf("%s comes before its parent %s", n.GetCheckpointId(), p)
				}
				seen[n.GetCheckpointId()] = true
				ps := n.GetParentIds()
				switch n.GetCheckpointId() {
				case first.GetCheckpointId():
					found++
					if len(ps) != 2 || ps[0] != n.GetParentId() || ps[1] != own.GetCheckpointId() ||
						n.GetDigest().GetFiles() != first.GetCheckpointDigest().GetFiles() {
						t.Fatalf("the ledger's node of %s: %v", first.GetCheckpointId(), n)
					}
				case own.GetCheckpointId():
					found++
					if len(ps) != 2 || ps[0] != n.GetParentId() || ps[1] != first.GetCheckpointId() {
						t.Fatalf("the ledger's node of %s, found again by an undo: %v", own.GetCheckpointId(), n)
					}
				}
			}
			if found != 2 {
				t.Fatalf("%s and %s are not both in the run's graph: %v", first.GetCheckpointId(), own.GetCheckpointId(), tree.GetNodes())
			}
		})
	}
}
