package sandbox_test

import (
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/deltagym/deltagym/internal/locate"
	"github.com/deltagym/deltagym/sandbox"
)

// needCRIU skips unless criu is installed (make criu).
func needCRIU(t testing.TB) {
	t.Helper()
	if _, err := locate.CRIU(); err != nil {
		t.Skipf("criu is not installed (make criu): %v", err)
	}
}

// treeCounterPy is counterPy with its paths under argv[1], and optionally
// a second thread (argv[2] == "thread") or a child process (argv[2] ==
// "child") that lives as long as it does.
const treeCounterPy = `
import os, sys, threading, time, subprocess
d = sys.argv[1]
if sys.argv[2] == "thread":
    threading.Thread(target=time.sleep, args=(1e6,), daemon=True).start()
elif sys.argv[2] == "child":
    subprocess.Popen(["sleep", "1000000"])
fd = os.open(d + "/ctl", os.O_RDWR)
f = os.fdopen(fd, "r")
i = 0
for line in f:
    i += 1
    with open(d + "/count.new", "w") as o:
        o.write(str(i))
    os.rename(d + "/count.new", d + "/count")
`

// startTreeCounter starts a counter in dir (kind: "plain", "thread" or
// "child").
func startTreeCounter(t testing.TB, s *sandbox.Sandbox, dir, kind string) {
	t.Helper()
	sh(t, s, fmt.Sprintf("mkdir -p %s && mkfifo %s/ctl", dir, dir))
	if err := s.WriteFile(t.Context(), "/tmp/tree-counter.py", []byte(treeCounterPy), 0o644, false); err != nil {
		t.Fatal(err)
	}
	if _, err := s.Exec(t.Context(), sandbox.ExecRequest{Argv: []string{"python3", "/tmp/tree-counter.py", dir, kind}, Background: true}); err != nil {
		t.Fatal(err)
	}
}

func incIn(t testing.TB, s *sandbox.Sandbox, dir string, want int) {
	t.Helper()
	sh(t, s, "echo inc > "+dir+"/ctl")
	waitFor(t, s, fmt.Sprintf(`[ "$(cat %s/count 2>/dev/null)" = %d ]`, dir, want))
}

func methods(ps []sandbox.ProcessCapture) string {
	var out []string
	for _, p := range ps {
		out = append(out, p.Command+":"+p.Method.String())
	}
	return strings.Join(out, " ")
}

// TestCRIUTreeAndThreads: a counter with a child process takes the CRIU
// path, a plain counter and a multithreaded one beside it the template
// path, all in one checkpoint. Restored in place (twice) and forked into
// new sandboxes, every counter goes on from the checkpoint's count,
// independently; releasing the checkpoint removes its images.
func TestCRIUTreeAndThreads(t *testing.T) {
	needCRIU(t)
	b := setup(t)
	s := b.create(t, sandbox.Spec{Image: defaultImage(t, b)})
	ctx := t.Context()
	kinds := []string{"plain", "thread", "child"}
	for _, k := range kinds {
		startTreeCounter(t, s, "/tmp/"+k, k)
		for i := 1; i <= 3; i++ {
			incIn(t, s, "/tmp/"+k, i)
		}
	}
	ck, err := s.Checkpoint(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if got, want := methods(ck.Processes), "python3:template python3:template python3:criu sleep:criu"; got != want {
		t.Fatalf("captured %q, want %q", got, want)
	}
	images := filepath.Join(b.cfg.DataDir, "store", "criu", ck.ID)
	if _, err := os.Stat(images); err != nil {
		t.Fatalf("images: %v", err)
	}
	for _, k := range kinds {
		incIn(t, s, "/tmp/"+k, 4)
		incIn(t, s, "/tmp/"+k, 5)
	}
	for round := range 2 {
		if err := s.Restore(ctx, ck.ID); err != nil {
			t.Fatalf("round %d: %v", round, err)
		}
		for _, k := range kinds {
			if got := sh(t, s, "cat /tmp/"+k+"/count"); got != "3" {
				t.Fatalf("round %d: %s count file after restore %q", round, k, got)
			}
			incIn(t, s, "/tmp/"+k, 4)
		}
	}
	// The tree's child's template, a child of the init, is listed too.
	if got := sh(t, s, "for f in $(grep -l '[s]leep' /proc/[0-9]*/cmdline); do d=${f%/cmdline}; [ \"$(cut -d' ' -f4 $d/stat)\" != 1 ] && echo $d; done | wc -l"); got != "1\n" {
		t.Fatalf("%q sleep processes of the tree after restores, want 1", got)
	}
	// Forks get every counter: the template's through an image of it.
	all, err := b.rt.Fork(ctx, ck.ID, 1, sandbox.Spec{})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = all[0].Destroy(ctx) })
	for _, k := range kinds {
		incIn(t, all[0], "/tmp/"+k, 4)
	}
	kids, err := b.rt.Fork(ctx, ck.ID, 2, sandbox.Spec{SkipTemplates: true})
	if err != nil {
		t.Fatal(err)
	}
	for i, kid := range kids {
		t.Cleanup(func() { _ = kid.Destroy(ctx) })
		for _, k := range kinds[2:] { // templates stay with their own sandbox
			for n := 4; n <= 4+i; n++ {
				incIn(t, kid, "/tmp/"+k, n)
			}
		}
	}
	if err := b.rt.ReleaseCheckpoint(ck.ID); err != nil {
		t.Fatal(err)
	}
	if _, err := os.Stat(images); !os.IsNotExist(err) {
		t.Fatalf("images after release: %v", err)
	}
}

// TestCRIUForced: process mode criu saves even a plain process with CRIU.
func TestCRIUForced(t *testing.T) {
	needCRIU(t)
	b := setup(t)
	s := b.create(t, sandbox.Spec{Image: defaultImage(t, b)})
	ctx := t.Context()
	startTreeCounter(t, s, "/tmp/p", "plain")
	incIn(t, s, "/tmp/p", 1)
	ck, err := s.CheckpointWith(ctx, sandbox.CheckpointOptions{Processes: sandbox.ProcessesCRIU})
	if err != nil {
		t.Fatal(err)
	}
	if got := methods(ck.Processes); got != "python3:criu" {
		t.Fatalf("captured %q", got)
	}
	incIn(t, s, "/tmp/p", 2)
	if err := s.Restore(ctx, ck.ID); err != nil {
		t.Fatal(err)
	}
	incIn(t, s, "/tmp/p", 2)
	// A damaged image fails the restore clearly, leaves nothing behind (a
	// zombie root would keep the sandbox's init from exiting: Destroy in
	// the cleanup would hang), and the sandbox goes on.
	bad, err := s.CheckpointWith(ctx, sandbox.CheckpointOptions{Processes: sandbox.ProcessesCRIU})
	if err != nil {
		t.Fatal(err)
	}
	mm, err := filepath.Glob(filepath.Join(b.cfg.DataDir, "store", "criu", bad.ID, "0", "mm-*.img"))
	if err != nil || len(mm) == 0 {
		t.Fatalf("mm images: %v %v", mm, err)
	}
	for _, p := range mm {
		if err := os.Remove(p); err != nil {
			t.Fatal(err)
		}
	}
	if err := s.Restore(ctx, bad.ID); !errors.Is(err, sandbox.ErrProcesses) || !strings.Contains(err.Error(), "python3") {
		t.Fatalf("restore of a damaged image: %v, want ErrProcesses naming python3", err)
	}
	if err := s.Restore(ctx, ck.ID); err != nil {
		t.Fatal(err)
	}
	incIn(t, s, "/tmp/p", 2)
}

// TestCRIUSurvivesRestart: a checkpoint whose processes were saved with CRIU brings them back
// in a sandbox of a new runtime on the same data directory.
func TestCRIUSurvivesRestart(t *testing.T) {
	needCRIU(t)
	b := setup(t)
	img := defaultImage(t, b)
	s := b.create(t, sandbox.Spec{Image: img})
	ctx := t.Context()
	startTreeCounter(t, s, "/tmp/c", "child")
	incIn(t, s, "/tmp/c", 1)
	incIn(t, s, "/tmp/c", 2)
	ck, err := s.Checkpoint(ctx)
	if err != nil {
		t.Fatal(err)
	}
	b.restart(t)
	s2 := b.create(t, sandbox.Spec{Checkpoint: ck.ID})
	if got := sh(t, s2, "cat /tmp/c/count"); got != "2" {
		t.Fatalf("count file %q", got)
	}
	incIn(t, s2, "/tmp/c", 3)
}

// TestCRIUForkFreshEntropy: a session saved with CRIU runs in every fork; with fresh entropy
// each fork's $RANDOM differs.
func TestCRIUForkFreshEntropy(t *testing.T) {
	needCRIU(t)
	b := setup(t)
	s := b.create(t, sandbox.Spec{Image: defaultImage(t, b)})
	ctx := t.Context()
	inSession(t, s, "export X=kept; RANDOM=7")
	ck, err := s.CheckpointWith(ctx, sandbox.CheckpointOptions{Processes: sandbox.ProcessesCRIU})
	if err != nil {
		t.Fatal(err)
	}
	kids, err := b.rt.Fork(ctx, ck.ID, 4, sandbox.Spec{FreshEntropy: true})
	if err != nil {
		t.Fatal(err)
	}
	seen := map[string]bool{}
	for _, kid := range kids {
		t.Cleanup(func() { _ = kid.Destroy(context.Background()) })
		out := inSession(t, kid, "echo $X $RANDOM")
		if !strings.HasPrefix(out, "kept ") {
			t.Fatalf("fork's session: %q", out)
		}
		seen[out] = true
	}
	if len(seen) != len(kids) {
		t.Fatalf("%d forks, %d distinct $RANDOM: %v", len(kids), len(seen), seen)
	}
}

// TestTemplateImages: a checkpoint whose process is kept as a template brings it back away
// from the template through a CRIU image made from it: restored in another sandbox, forked,
// restored in place after the template was killed, and after its sandbox was destroyed. A
// template copied after a restore maps files of a root since detached: its image works too.
// A durable checkpoint's image is made in the background and outlives the runtime.
func TestTemplateImages(t *testing.T) {
	needCRIU(t)
	b := setup(t)
	s, ck := counterCheckpoint(t, b)
	img := s.Image()
	ctx := t.Context()
	inc(t, s, 2)
	// In another sandbox: from the checkpoint's count, on its own.
	other := b.create(t, sandbox.Spec{Image: img})
	if err := other.Restore(ctx, ck.ID); err != nil {
		t.Fatal(err)
	}
	if got := sh(t, other, "cat /tmp/count"); got != "1" {
		t.Fatalf("count file in another sandbox %q", got)
	}
	inc(t, other, 2)
	inc(t, other, 3)
	// Forks, each its own counter.
	kids, err := b.rt.Fork(ctx, ck.ID, 2, sandbox.Spec{})
	if err != nil {
		t.Fatal(err)
	}
	for i, kid := range kids {
		t.Cleanup(func() { _ = kid.Destroy(context.Background()) })
		for n := 2; n <= 2+i; n++ {
			inc(t, kid, n)
		}
		if got := sh(t, kid, countCounters); got != "1\n" {
			t.Fatalf("fork %d runs %q counters", i, got)
		}
	}
	// In place, the template serves; a checkpoint of the restored copy
	// (which maps the first root's files) forks too.
	if err := s.Restore(ctx, ck.ID); err != nil {
		t.Fatal(err)
	}
	inc(t, s, 2)
	ck2, err := s.Checkpoint(ctx)
	if err != nil {
		t.Fatal(err)
	}
	kids2, err := b.rt.Fork(ctx, ck2.ID, 1, sandbox.Spec{})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = kids2[0].Destroy(context.Background()) })
	inc(t, kids2[0], 3)
	// Templates killed (from outside: no command can): the in-place
	// restore falls back on the image.
	if n := b.rt.KillTemplates(ck.ID); n != 1 {
		t.Fatalf("killed %d templates", n)
	}
	if err := s.Restore(ctx, ck.ID); err != nil {
		t.Fatal(err)
	}
	inc(t, s, 2)
	// A checkpoint whose sandbox is destroyed keeps its processes (two
	// templates of one checkpoint: neither may run while the other is
	// copied).
	s3 := b.create(t, sandbox.Spec{Image: img})
	startCounter(t, s3)
	inc(t, s3, 1)
	inc(t, s3, 2)
	inSession(t, s3, "export X=kept")
	ck3, err := s3.Checkpoint(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if len(ck3.Processes) != 2 {
		t.Fatalf("captured %+v", ck3.Processes)
	}
	if err := s3.Destroy(ctx); err != nil {
		t.Fatal(err)
	}
	s4 := b.create(t, sandbox.Spec{Checkpoint: ck3.ID})
	inc(t, s4, 3)
	if got := inSession(t, s4, "echo $X"); got != "kept\n" {
		t.Fatalf("session from a destroyed sandbox's checkpoint: %q", got)
	}
	// A durable checkpoint outlives the runtime.
	ck4, err := s4.CheckpointWith(ctx, sandbox.CheckpointOptions{Durable: true})
	if err != nil {
		t.Fatal(err)
	}
	b.restart(t) // waits for the background image
	s5 := b.create(t, sandbox.Spec{Checkpoint: ck4.ID})
	inc(t, s5, 4)
	// The images are charged to the checkpoint budget; released, they go.
	before := b.rt.CheckpointBytes()
	for _, id := range []string{ck.ID, ck2.ID, ck3.ID, ck4.ID} {
		if err := b.rt.ReleaseCheckpoint(id); err != nil && !errors.Is(err, sandbox.ErrNotFound) {
			t.Fatal(err)
		}
	}
	if ents, _ := os.ReadDir(filepath.Join(b.cfg.DataDir, "store", "criu")); len(ents) > 1 { // run/
		var names []string
		for _, e := range ents {
			names = append(names, e.Name())
		}
		t.Fatalf("images left after release: %v", names)
	}
	// Four checkpoints, each with at least one image of a python3 (a few MB).
	if after := b.rt.CheckpointBytes(); before-after < 4<<20 {
		t.Fatalf("checkpoint bytes %d before releasing the images, %d after", before, after)
	}
}

// TestTemplatesLeavePids: frozen copies count against the sandbox's pids
// limit, and once they would hold more than three quarters of it, a
// checkpoint saves its processes with CRIU instead, saying why; the
// sandbox can still run commands, and both kinds of checkpoint restore.
func TestTemplatesLeavePids(t *testing.T) {
	needCRIU(t)
	b := setup(t)
	s := b.create(t, sandbox.Spec{Image: defaultImage(t, b), Limits: sandbox.Limits{Pids: 16}})
	ctx := t.Context()
	startCounter(t, s)
	var templates []string
	var criuCk string
	for i := 1; i <= 14 && criuCk == ""; i++ {
		inc(t, s, i)
		ck, err := s.Checkpoint(ctx)
		if err != nil {
			t.Fatalf("checkpoint %d: %v", i, err)
		}
		if len(ck.Processes) != 1 {
			t.Fatalf("checkpoint %d captured %+v", i, ck.Processes)
		}
		switch p := ck.Processes[0]; p.Method {
		case sandbox.CaptureTemplate:
			templates = append(templates, ck.ID)
		case sandbox.CaptureCRIU:
			if !strings.Contains(p.Reason, "limit 16") {
				t.Fatalf("checkpoint %d went to CRIU for %q, want the pids limit named", i, p.Reason)
			}
			criuCk = ck.ID
		}
	}
	// The init, the counter and 10 templates are 12: the 11th would be 13.
	if criuCk == "" || len(templates) != 10 {
		t.Fatalf("%d template checkpoints before CRIU took over (%q), want 10", len(templates), criuCk)
	}
	sh(t, s, "true")
	if err := s.Restore(ctx, templates[0]); err != nil {
		t.Fatal(err)
	}
	inc(t, s, 2)
	if err := s.Restore(ctx, criuCk); err != nil {
		t.Fatal(err)
	}
	inc(t, s, 12)
}

// TestPidsLimitError: a command the pids limit leaves no room for fails
// with ErrBudget naming the limit, not an internal error.
func TestPidsLimitError(t *testing.T) {
	b := setup(t)
	s := b.create(t, sandbox.Spec{Limits: sandbox.Limits{Pids: 8}})
	ctx := t.Context()
	var err error
	for range 10 {
		if _, err = s.Exec(ctx, sandbox.ExecRequest{Argv: []string{"sleep", "1000"}, Background: true}); err != nil {
			break
		}
	}
	if !errors.Is(err, sandbox.ErrBudget) || !strings.Contains(err.Error(), "pids limit (8)") {
		t.Fatalf("exec past the pids limit: %v, want ErrBudget naming the limit", err)
	}
}

// TestTemplatesFullWithoutCRIU: past three quarters of the pids limit,
// without CRIU to save processes holding no pid, a checkpoint fails with
// ErrBudget saying so, and the sandbox goes on.
func TestTemplatesFullWithoutCRIU(t *testing.T) {
	b := setup(t, func(c *sandbox.Config) { c.CRIU = "" })
	s := b.create(t, sandbox.Spec{Image: defaultImage(t, b), Limits: sandbox.Limits{Pids: 8}})
	ctx := t.Context()
	startCounter(t, s)
	var err error
	n := 0
	for ; n < 8; n++ {
		inc(t, s, n+1)
		if _, err = s.Checkpoint(ctx); err != nil {
			break
		}
	}
	// The init and the counter are 2: 4 templates make the 6 allowed.
	if n != 4 || !errors.Is(err, sandbox.ErrBudget) || !strings.Contains(err.Error(), "CRIU") {
		t.Fatalf("after %d checkpoints: %v, want ErrBudget naming CRIU after 4", n, err)
	}
	sh(t, s, "true")
	inc(t, s, n+2)
}

// A process restored by CRIU signals its own processes as before: its
// seccomp filter comes back without the init's listener, so the calls the
// init answers are let through in it (criu.dropNotify) rather than failing
// with ENOSYS.
func TestCRIURestoredSignals(t *testing.T) {
	needCRIU(t)
	b := setup(t)
	s := b.create(t, sandbox.Spec{Image: defaultImage(t, b)})
	ctx := t.Context()
	inSession(t, s, "sleep 1000 &")
	ck, err := s.CheckpointWith(ctx, sandbox.CheckpointOptions{Processes: sandbox.ProcessesCRIU})
	if err != nil {
		t.Fatal(err)
	}
	for _, sb := range []*sandbox.Sandbox{s, nil} {
		if sb == s {
			if err := s.Restore(ctx, ck.ID); err != nil {
				t.Fatal(err)
			}
		} else {
			kids, err := b.rt.Fork(ctx, ck.ID, 1, sandbox.Spec{})
			if err != nil {
				t.Fatal(err)
			}
			t.Cleanup(func() { _ = kids[0].Destroy(context.Background()) })
			sb = kids[0]
		}
		if got := inSession(t, sb, "kill -0 $$ 2>&1; echo $?; kill %1 2>&1; wait %1; echo $?"); got != "0\n143\n" {
			t.Fatalf("signals in a session restored by CRIU: %q", got)
		}
	}
}
