package episode_test

import (
	"errors"
	"slices"
	"testing"

	"github.com/deltagym/deltagym/internal/errdefs"
	"github.com/deltagym/deltagym/sandbox"
	"github.com/deltagym/deltagym/server/episode"
)

// Deduplicating checkpoints through the core: the state found again in a checkpoint of the
// env is answered with that checkpoint and the sandbox descends from it, while a checkpoint of
// another env on the same image, or one released, is never found; and DiffCheckpoints between
// them.
func TestDedupeAndDiff(t *testing.T) {
	other := baseSpec()
	other.Name = "f"
	core, rt, rec, _ := setupEnvs(t, nil, baseSpec(), other)
	ctx := t.Context()
	write := func(sb, path, content string) {
		t.Helper()
		stepOK(t, core, sb, episode.WriteFile{Path: path, Content: []byte(content)})
	}
	reset := func(env string) string {
		t.Helper()
		rr, err := core.Reset(ctx, episode.ResetRequest{Env: env, Run: "r"})
		must(t, err)
		return rr.SandboxID
	}
	// The first of a state is kept: nothing holds it yet.
	a := reset("e")
	write(a, "/tmp/y", "2\n")
	first, err := core.Checkpoint(ctx, episode.CheckpointRequest{SandboxID: a, Dedupe: true})
	must(t, err)
	if first.Deduplicated || first.Digest.IsZero() || first.Parent != first.Info.Parent {
		t.Fatalf("first checkpoint of a state: %+v", first)
	}
	// Again with nothing changed: the same one, whose parent is its own parent, not itself.
	same, err := core.Checkpoint(ctx, episode.CheckpointRequest{SandboxID: a, Dedupe: true})
	must(t, err)
	if !same.Deduplicated || same.Info.ID != first.Info.ID || same.Parent != first.Parent || same.Parent == same.Info.ID {
		t.Fatalf("a deduplicating checkpoint with nothing changed: %+v, want %s with parent %s", same, first.Info.ID, first.Parent)
	}
	if e := rec.edgesOf(first.Info.ID); len(e) != 0 {
		t.Fatalf("edges into %s after a checkpoint of an unchanged sandbox: %v", first.Info.ID, e)
	}
	// Another sandbox of the env reaches it after a checkpoint of its own.
	b := reset("e")
	write(b, "/tmp/z", "1\n")
	prev, err := core.Checkpoint(ctx, episode.CheckpointRequest{SandboxID: b, WaitDigest: true})
	must(t, err)
	if prev.Digest.IsZero() || prev.Digest == first.Digest {
		t.Fatalf("digest of another state: %+v, first %+v", prev.Digest, first.Digest)
	}
	stepOK(t, core, b, episode.Remove{Path: "/tmp/z"})
	held := len(rt.ListCheckpoints())
	recorded := len(rec.ckptsOf(""))
	write(b, "/tmp/y", "2\n")
	dup, err := core.Checkpoint(ctx, episode.CheckpointRequest{SandboxID: b, Dedupe: true})
	must(t, err)
	if !dup.Deduplicated || dup.Info.ID != first.Info.ID || dup.Parent != prev.Info.ID || dup.Digest != first.Digest {
		t.Fatalf("deduplicated checkpoint: %+v, want %s with parent %s", dup, first.Info.ID, prev.Info.ID)
	}
	if n := len(rt.ListCheckpoints()); n != held {
		t.Fatalf("the runtime holds %d checkpoints, %d before: the new one is not released", n, held)
	}
	if n := len(rec.ckptsOf("")); n != recorded {
		t.Fatalf("the ledger has %d checkpoint rows, %d before: the released one is recorded", n, recorded)
	}
	if e := rec.edgesOf(first.Info.ID); !slices.Equal(e, []string{prev.Info.ID}) {
		t.Fatalf("edges into %s: %v, want from %s", first.Info.ID, e, prev.Info.ID)
	}
	// The sandbox descends from the one found; the one found keeps where it was taken.
	next, err := core.Checkpoint(ctx, episode.CheckpointRequest{SandboxID: b})
	must(t, err)
	if next.Info.Parent != first.Info.ID {
		t.Fatalf("the sandbox's next checkpoint descends from %s, want %s", next.Info.Parent, first.Info.ID)
	}
	if p, err := core.CheckpointPlace(ctx, first.Info.ID); err != nil || p.Episode == "" || p.Own != 1 {
		t.Fatalf("the found checkpoint's place: %+v, %v", p, err)
	}
	// Through a step: the same, and either flag alone is refused.
	c := reset("e")
	r, err := core.Step(ctx, episode.StepRequest{SandboxID: c, Action: episode.WriteFile{Path: "/tmp/y", Content: []byte("2\n")},
		Checkpoint: true, CheckpointDedupe: true})
	must(t, err)
	if !r.CheckpointDeduplicated || r.CheckpointID != first.Info.ID || r.CheckpointDigest != first.Digest {
		t.Fatalf("a deduplicating step: %+v", r)
	}
	if s := rec.stepsOf(r.EpisodeID); len(s) != 1 || s[0].CheckpointID != first.Info.ID {
		t.Fatalf("the step's row: %+v", s)
	}
	for _, req := range []episode.StepRequest{{SandboxID: c, Action: episode.Exec{Command: "true"}, CheckpointDedupe: true},
		{SandboxID: c, Action: episode.Exec{Command: "true"}, CheckpointWaitDigest: true}} {
		if _, err := core.Step(ctx, req); !errors.Is(err, episode.ErrInvalid) {
			t.Fatalf("a checkpoint flag without checkpoint: %v, want ErrInvalid", err)
		}
	}
	// Another env on the same image holds the same state apart.
	f := reset("f")
	write(f, "/tmp/y", "2\n")
	fck, err := core.Checkpoint(ctx, episode.CheckpointRequest{SandboxID: f, Dedupe: true})
	must(t, err)
	if fck.Deduplicated || fck.Info.ID == first.Info.ID || fck.Digest != first.Digest {
		t.Fatalf("a checkpoint of env f with env e's state: %+v", fck)
	}
	// A released checkpoint is not found: the state is found in the next oldest, b's.
	must(t, core.ReleaseCheckpoint(first.Info.ID))
	d := reset("e")
	write(d, "/tmp/y", "2\n")
	found, err := core.Checkpoint(ctx, episode.CheckpointRequest{SandboxID: d, Dedupe: true})
	must(t, err)
	if !found.Deduplicated || found.Info.ID != next.Info.ID {
		t.Fatalf("after the release of %s: %+v, want %s", first.Info.ID, found, next.Info.ID)
	}
	// DiffCheckpoints: what b did from prev to next (removed /tmp/z, wrote /tmp/y).
	diff, err := core.DiffCheckpoints(ctx, episode.DiffRequest{Base: prev.Info.ID, ID: next.Info.ID, Detail: sandbox.DiffLines})
	must(t, err)
	var got []string
	for _, p := range diff.Paths {
		if p.Path == "/tmp/y" || p.Path == "/tmp/z" {
			got = append(got, p.Path)
			if p.Path == "/tmp/y" && (p.Kind != sandbox.ChangeAdded || p.LinesAdded != 1) {
				t.Fatalf("/tmp/y: %+v", p)
			}
			if p.Path == "/tmp/z" && p.Kind != sandbox.ChangeRemoved {
				t.Fatalf("/tmp/z: %+v", p)
			}
		}
	}
	if !slices.Equal(got, []string{"/tmp/y", "/tmp/z"}) || diff.Base != prev.Digest || diff.Target != first.Digest {
		t.Fatalf("diff: %+v", diff)
	}
	if only, err := core.DiffCheckpoints(ctx, episode.DiffRequest{Base: prev.Info.ID, ID: next.Info.ID, Path: "/tmp/z"}); err != nil ||
		len(only.Paths) != 1 || only.Paths[0].Path != "/tmp/z" {
		t.Fatalf("diff under /tmp/z: %+v, %v", only, err)
	}
	if one, err := core.DiffCheckpoints(ctx, episode.DiffRequest{Base: prev.Info.ID, ID: next.Info.ID, MaxPaths: 1}); err != nil ||
		len(one.Paths) != 1 || !one.Truncated {
		t.Fatalf("diff of one path at most: %+v, %v", one, err)
	}
	for _, c := range []struct {
		name string
		req  episode.DiffRequest
		want error
	}{
		{"no base", episode.DiffRequest{ID: next.Info.ID}, episode.ErrInvalid},
		{"no checkpoint", episode.DiffRequest{Base: prev.Info.ID}, episode.ErrInvalid},
		{"negative max_paths", episode.DiffRequest{Base: prev.Info.ID, ID: next.Info.ID, MaxPaths: -1}, episode.ErrInvalid},
		{"relative path", episode.DiffRequest{Base: prev.Info.ID, ID: next.Info.ID, Path: "tmp"}, episode.ErrInvalid},
		{"path with ..", episode.DiffRequest{Base: prev.Info.ID, ID: next.Info.ID, Path: "/tmp/../etc"}, episode.ErrInvalid},
		{"different envs", episode.DiffRequest{Base: fck.Info.ID, ID: next.Info.ID}, episode.ErrInvalid},
		{"unknown checkpoint", episode.DiffRequest{Base: prev.Info.ID, ID: "nope"}, sandbox.ErrNotFound},
		{"unknown base", episode.DiffRequest{Base: "nope", ID: next.Info.ID}, sandbox.ErrNotFound},
		{"released base", episode.DiffRequest{Base: first.Info.ID, ID: next.Info.ID}, sandbox.ErrNotFound},
	} {
		if _, err := core.DiffCheckpoints(ctx, c.req); !errors.Is(err, c.want) {
			t.Fatalf("%s: %v, want %v", c.name, err, c.want)
		}
	}
	if _, err := core.DiffCheckpoints(ctx, episode.DiffRequest{Base: fck.Info.ID, ID: next.Info.ID}); errdefs.DetailOf(err).Reason != "CHECKPOINT_OF_OTHER_ENV" {
		t.Fatalf("different envs: reason %q", errdefs.DetailOf(err).Reason)
	}
	// ListCheckpoints reports the digests computed.
	for _, cd := range core.Checkpoints(episode.CheckpointFilter{Env: "e"}) {
		if cd.Info.ID == next.Info.ID {
			if want, _ := rt.StateDigestReady(next.Info.ID); cd.Digest != want {
				t.Fatalf("listed digest %+v, want %+v", cd.Digest, want)
			}
		}
	}
	// With every one of env e released, env f's is the oldest of the state: env e keeps a new
	// one, and the next of env e finds that one, not the older of env f.
	must(t, core.ReleaseCheckpoint(next.Info.ID))
	g := reset("e")
	write(g, "/tmp/y", "2\n")
	kept, err := core.Checkpoint(ctx, episode.CheckpointRequest{SandboxID: g, Dedupe: true})
	must(t, err)
	if kept.Deduplicated || kept.Info.ID == fck.Info.ID {
		t.Fatalf("with only env f's holding the state: %+v", kept)
	}
	h := reset("e")
	write(h, "/tmp/y", "2\n")
	again, err := core.Checkpoint(ctx, episode.CheckpointRequest{SandboxID: h, Dedupe: true})
	must(t, err)
	if !again.Deduplicated || again.Info.ID != kept.Info.ID {
		t.Fatalf("env e's own past env f's older one: %+v, want %s", again, kept.Info.ID)
	}
}

// A durable checkpoint is never answered by one whose processes have no images: the state
// found again in a checkpoint taken without durable is kept anew, durable, and that one
// answers the next durable checkpoint of the same state.
func TestDedupeDurable(t *testing.T) {
	core, _, _, _ := setupEnvs(t, nil, baseSpec())
	ctx := t.Context()
	rr, err := core.Reset(ctx, episode.ResetRequest{Env: "e", Run: "r"})
	must(t, err)
	sb := rr.SandboxID
	stepOK(t, core, sb, episode.Exec{Command: "sleep 1000", Background: true})
	plain, err := core.Checkpoint(ctx, episode.CheckpointRequest{SandboxID: sb, Dedupe: true})
	must(t, err)
	if plain.Durable || len(plain.Info.Processes) != 1 {
		t.Fatalf("a checkpoint of a process as a template: %+v", plain)
	}
	durable, err := core.Checkpoint(ctx, episode.CheckpointRequest{SandboxID: sb, Durable: true, Dedupe: true})
	must(t, err)
	if durable.Deduplicated || !durable.Durable || durable.Info.ID == plain.Info.ID {
		t.Fatalf("a durable checkpoint of the state of a checkpoint that is not: %+v, not %s", durable, plain.Info.ID)
	}
	again, err := core.Checkpoint(ctx, episode.CheckpointRequest{SandboxID: sb, Durable: true, Dedupe: true})
	must(t, err)
	if !again.Durable || again.Deduplicated && again.Info.ID != durable.Info.ID {
		t.Fatalf("a durable checkpoint of the same state again: %+v, want %s or a new durable one", again, durable.Info.ID)
	}
}
