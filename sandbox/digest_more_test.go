package sandbox_test

import (
	"bytes"
	"context"
	"crypto/sha256"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"math/rand/v2"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/deltagym/deltagym/sandbox"
)

func digestOf(t *testing.T, b *bundle, id string) sandbox.StateDigest {
	t.Helper()
	d, err := b.rt.StateDigest(t.Context(), id)
	if err != nil {
		t.Fatal(err)
	}
	return d
}

// A flattened checkpoint's state hashes as before: a checkpoint taken on its merged stack
// with nothing changed has its digest, after a restart too, and a diff of the two is empty.
func TestStateDigestFlattenAndRestart(t *testing.T) {
	b := setup(t, func(c *sandbox.Config) { c.FlattenDepth = 3 })
	s := b.create(t, sandbox.Spec{})
	ctx := t.Context()
	sh(t, s, "mkdir -p /w/keep /w/gone; echo g > /w/gone/g; rm /bin/true")
	var last sandbox.CheckpointInfo
	for i := range 8 {
		cmd := fmt.Sprintf("echo %d > /w/f%d; rm -f /w/f%d", i, i, i-2)
		if i%3 == 1 {
			cmd += fmt.Sprintf("; rm -rf /w/gone; mkdir /w/gone; echo n%d > /w/gone/n", i)
		}
		sh(t, s, cmd)
		last, _ = ckDigest(t, b, s)
	}
	want := digestOf(t, b, last.ID)
	// The flattener merges in the background: restore until the stack is shallow.
	deadline := time.Now().Add(30 * time.Second)
	for {
		if err := s.Restore(ctx, last.ID); err != nil {
			t.Fatal(err)
		}
		if s.Depth() < last.Depth {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("not flattened: depth %d", s.Depth())
		}
		time.Sleep(10 * time.Millisecond)
	}
	again, d := ckDigest(t, b, s)
	if d != want {
		t.Fatalf("on the merged stack: %v, want %v", d, want)
	}
	b.restart(t)
	if got := digestOf(t, b, last.ID); got != want {
		t.Fatalf("after a restart: %v, want %v", got, want)
	}
	diff, err := b.rt.DiffCheckpoints(ctx, last.ID, again.ID, sandbox.DiffOptions{})
	if err != nil || len(diff.Paths) != 0 || diff.Base != want || diff.Target != want {
		t.Fatalf("diff after restart: %+v %v", diff, err)
	}
	s2 := b.create(t, sandbox.Spec{Checkpoint: last.ID})
	if _, d := ckDigest(t, b, s2); d != want {
		t.Fatalf("after a restart, a new checkpoint: %v, want %v", d, want)
	}
}

// A checkpoint adopted by another runtime (another node) has the digest its owner gave it.
func TestStateDigestAdopted(t *testing.T) {
	a := setup(t)
	bb := setup(t)
	s := a.create(t, sandbox.Spec{})
	ctx := t.Context()
	sh(t, s, "mkdir -p /w; echo one > /w/one; rm /bin/true")
	ckDigest(t, a, s)
	sh(t, s, "echo two > /w/two; mkfifo /w/p; ln -s one /w/l")
	ck, want := ckDigest(t, a, s)
	m, err := a.rt.CheckpointManifest(ctx, ck.ID)
	if err != nil {
		t.Fatal(err)
	}
	fetch := func(ctx context.Context, l sandbox.LayerRef) (io.ReadCloser, error) {
		pr, pw := io.Pipe()
		go func() { pw.CloseWithError(a.rt.ExportLayer(pw, l.Digest)) }()
		return pr, nil
	}
	if _, err := bb.rt.AdoptCheckpoint(ctx, m, fetch, nil); err != nil {
		t.Fatal(err)
	}
	if got := digestOf(t, bb, ck.ID); got != want {
		t.Fatalf("adopted: %v, want %v", got, want)
	}
}

// Dedupe finds an equal checkpoint of the image, releases the new one and moves the sandbox
// onto the one found; concurrent dedupes into each other keep one.
func TestDedupe(t *testing.T) {
	b := setup(t)
	ctx := t.Context()
	s := b.create(t, sandbox.Spec{})
	sh(t, s, "mkdir -p /w; echo v > /w/v")
	first, _ := ckDigest(t, b, s)
	// Not found: its own info.
	if info, dup, err := b.rt.Dedupe(ctx, first.ID, nil); err != nil || dup || info.ID != first.ID {
		t.Fatalf("unique: %+v %v %v", info, dup, err)
	}
	o := b.create(t, sandbox.Spec{})
	sh(t, o, "mkdir -p /w; echo v > /w/v")
	second, _ := ckDigest(t, b, o)
	// A match that refuses the one equal checkpoint: kept, not deduplicated.
	var asked []string
	refuse := func(o sandbox.CheckpointInfo) bool { asked = append(asked, o.ID); return false }
	if info, dup, err := b.rt.Dedupe(ctx, second.ID, refuse); err != nil || dup || info.ID != second.ID {
		t.Fatalf("refused by match: %+v %v %v", info, dup, err)
	}
	if !slices.Equal(asked, []string{first.ID}) {
		t.Fatalf("match was asked of %v, want only %s", asked, first.ID)
	}
	info, dup, err := b.rt.Dedupe(ctx, second.ID, func(o sandbox.CheckpointInfo) bool { return o.ID == first.ID })
	if err != nil || !dup || info.ID != first.ID {
		t.Fatalf("dedupe: %+v %v %v", info, dup, err)
	}
	if _, err := b.rt.Checkpoint(second.ID); !errors.Is(err, sandbox.ErrNotFound) {
		t.Fatalf("the duplicate is still held: %v", err)
	}
	if o.Head() != first.ID {
		t.Fatalf("head %s, want %s", o.Head(), first.ID)
	}
	sh(t, o, "echo more > /w/m")
	next, _ := ckDigest(t, b, o)
	if next.Parent != first.ID {
		t.Fatalf("next parent %s, want %s", next.Parent, first.ID)
	}
	if got := sh(t, o, "cat /w/v /w/m"); got != "v\nmore\n" {
		t.Fatalf("sandbox after dedupe: %q", got)
	}
	// Two sandboxes at one state dedupe at once: exactly one checkpoint is left.
	for range 5 {
		x := b.create(t, sandbox.Spec{})
		y := b.create(t, sandbox.Spec{})
		for _, z := range []*sandbox.Sandbox{x, y} {
			sh(t, z, "mkdir -p /c; echo same > /c/s")
		}
		cx, _ := ckDigest(t, b, x)
		cy, _ := ckDigest(t, b, y)
		var wg sync.WaitGroup
		res := make([]sandbox.CheckpointInfo, 2)
		errs := make([]error, 2)
		for i, id := range []string{cx.ID, cy.ID} {
			wg.Go(func() { res[i], _, errs[i] = b.rt.Dedupe(ctx, id, nil) })
		}
		wg.Wait()
		if errs[0] != nil || errs[1] != nil || res[0].ID != res[1].ID {
			t.Fatalf("concurrent dedupe: %+v %v", res, errs)
		}
		if _, err := b.rt.Checkpoint(res[0].ID); err != nil {
			t.Fatalf("kept checkpoint: %v", err)
		}
		if x.Head() != res[0].ID || y.Head() != res[0].ID {
			t.Fatalf("heads %s %s, want %s", x.Head(), y.Head(), res[0].ID)
		}
		for _, id := range []string{cx.ID, cy.ID} {
			if id != res[0].ID {
				_, err := b.rt.Checkpoint(id)
				if !errors.Is(err, sandbox.ErrNotFound) {
					t.Fatalf("duplicate %s kept: %v", id, err)
				}
			}
		}
		x.Destroy(ctx)
		y.Destroy(ctx)
		b.rt.ReleaseCheckpoint(res[0].ID)
	}
}

// treeEntry is what the brute-force diff compares of a path.
type treeEntry struct {
	typ  fs.FileMode
	mode uint32
	uid  uint32
	sum  [32]byte
}

// walkTree reads the tree below dir (a sandbox's path through /proc/PID/root).
func walkTree(t *testing.T, dir string) map[string]treeEntry {
	t.Helper()
	out := map[string]treeEntry{}
	err := filepath.WalkDir(dir, func(p string, d fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		var st unix.Stat_t
		if err := unix.Lstat(p, &st); err != nil {
			return err
		}
		e := treeEntry{typ: d.Type(), mode: st.Mode & 0o7777, uid: st.Uid}
		switch {
		case d.Type().IsRegular():
			b, err := os.ReadFile(p)
			if err != nil {
				return err
			}
			e.sum = sha256.Sum256(b)
		case d.Type()&fs.ModeSymlink != 0:
			l, _ := os.Readlink(p)
			e.sum = sha256.Sum256([]byte(l))
		}
		rel, _ := filepath.Rel(dir, p)
		out[rel] = e
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	return out
}

// Diffs match a brute-force diff of the two trees walked, over random file operations.
func TestDiffModel(t *testing.T) {
	b := setup(t)
	ctx := t.Context()
	s := b.create(t, sandbox.Spec{})
	rng := rand.New(rand.NewPCG(41, 7))
	sh(t, s, "mkdir -p /w")
	var cks []string
	var trees []map[string]treeEntry
	names := []string{"a", "b", "c", "d/e", "d/f", "g/h/i", "g/j"}
	for step := range 300 {
		n := names[rng.IntN(len(names))]
		var cmd string
		switch rng.IntN(8) {
		case 0, 1:
			cmd = fmt.Sprintf("mkdir -p $(dirname /w/%s) 2>/dev/null; rm -rf /w/%s; printf 'l1\\nl%d\\nl3\\n' > /w/%s", n, n, rng.IntN(5), n)
		case 2:
			cmd = fmt.Sprintf("rm -rf /w/%s", strings.Split(n, "/")[0])
		case 3:
			cmd = fmt.Sprintf("chmod %o /w/%s", 0o600+rng.IntN(0o100), n)
		case 4:
			cmd = fmt.Sprintf("mkdir -p $(dirname /w/%s) 2>/dev/null; rm -rf /w/%s; ln -s /w/%s /w/%s", n, n, names[rng.IntN(len(names))], n)
		case 5:
			cmd = fmt.Sprintf("echo more%d >> /w/%s", step, n)
		case 6:
			cmd = fmt.Sprintf("rm -rf /w/%s; mkdir -p /w/%s", n, n)
		case 7:
			cmd = fmt.Sprintf("chown %d /w/%s", rng.IntN(3), n)
		}
		sh(t, s, cmd+" 2>/dev/null; true")
		if step%20 != 19 {
			continue
		}
		ck, err := s.Checkpoint(ctx)
		if err != nil {
			t.Fatal(err)
		}
		cks = append(cks, ck.ID)
		trees = append(trees, walkTree(t, fmt.Sprintf("/proc/%d/root/w", s.InitPid())))
		if rng.IntN(3) == 0 && len(cks) > 1 {
			i := rng.IntN(len(cks))
			if err := s.Restore(ctx, cks[i]); err != nil {
				t.Fatal(err)
			}
			sh(t, s, "true")
		}
	}
	for i := range cks {
		j := rng.IntN(len(cks))
		d, err := b.rt.DiffCheckpoints(ctx, cks[j], cks[i], sandbox.DiffOptions{Path: "/w", Detail: sandbox.DiffLines})
		if err != nil {
			t.Fatal(err)
		}
		want := map[string]sandbox.ChangeKind{}
		for p, e := range trees[i] {
			if o, ok := trees[j][p]; !ok {
				want[p] = sandbox.ChangeAdded
			} else if o != e {
				want[p] = sandbox.ChangeModified
			}
		}
		for p := range trees[j] {
			if _, ok := trees[i][p]; !ok {
				want[p] = sandbox.ChangeRemoved
			}
		}
		got := map[string]sandbox.ChangeKind{}
		for _, c := range d.Paths {
			rel, _ := filepath.Rel("/w", c.Path)
			got[rel] = c.Kind
		}
		if fmt.Sprint(got) != fmt.Sprint(want) {
			t.Fatalf("diff %d -> %d:\n got %v\nwant %v", j, i, got, want)
		}
		if !slices.IsSortedFunc(d.Paths, func(a, b sandbox.PathChange) int { return strings.Compare(a.Path, b.Path) }) {
			t.Fatal("paths not sorted")
		}
	}
}

// A unified diff applied with patch(1) to the base's file gives the checkpoint's; bad paths
// are refused; MaxPaths truncates.
func TestDiffUnifiedPatch(t *testing.T) {
	patch, err := exec.LookPath("patch")
	if err != nil {
		t.Skip("patch(1) is not installed")
	}
	b := setup(t)
	ctx := t.Context()
	s := b.create(t, sandbox.Spec{})
	rng := rand.New(rand.NewPCG(9, 9))
	var lines []string
	for i := range 200 {
		lines = append(lines, fmt.Sprintf("line %d %d", i, rng.IntN(1000)))
	}
	orig := strings.Join(lines, "\n") + "\n"
	if err := s.WriteFile(ctx, "/w/t.txt", []byte(orig), 0, false); err != nil {
		t.Fatal(err)
	}
	base, _ := ckDigest(t, b, s)
	for i := range lines {
		if rng.IntN(10) == 0 {
			lines[i] = "changed " + lines[i]
		}
	}
	lines = slices.Insert(lines, 50, "inserted")
	changed := strings.Join(lines[5:], "\n")
	if err := s.WriteFile(ctx, "/w/t.txt", []byte(changed), 0, false); err != nil {
		t.Fatal(err)
	}
	sh(t, s, "echo new > /w/new.txt; head -c 100 /dev/urandom > /w/bin")
	ck, _ := ckDigest(t, b, s)
	d, err := b.rt.DiffCheckpoints(ctx, base.ID, ck.ID, sandbox.DiffOptions{Detail: sandbox.DiffUnified, Path: "/w"})
	if err != nil {
		t.Fatal(err)
	}
	var unified string
	for _, c := range d.Paths {
		switch c.Path {
		case "/w/t.txt":
			unified = c.Unified
			if c.Kind != sandbox.ChangeModified || c.LinesAdded == 0 || c.Binary {
				t.Fatalf("t.txt: %+v", c)
			}
		case "/w/bin":
			if !c.Binary || c.Unified != "" {
				t.Fatalf("binary: %+v", c)
			}
		case "/w/new.txt":
			if c.Kind != sandbox.ChangeAdded || c.LinesAdded != 1 || !strings.HasPrefix(c.Unified, "--- /dev/null\n+++ b/w/new.txt\n") {
				t.Fatalf("new.txt: %+v", c)
			}
		}
	}
	dir := t.TempDir()
	os.MkdirAll(filepath.Join(dir, "w"), 0o755)
	os.WriteFile(filepath.Join(dir, "w/t.txt"), []byte(orig), 0o644)
	cmd := exec.Command(patch, "-s", "-p1", "-d", dir)
	cmd.Stdin = strings.NewReader(unified)
	if out, err := cmd.CombinedOutput(); err != nil {
		t.Fatalf("patch: %v %s\n%s", err, out, unified)
	}
	if got, _ := os.ReadFile(filepath.Join(dir, "w/t.txt")); string(got) != changed {
		t.Fatalf("patched file differs")
	}
	for _, p := range []string{"w", "/w/", "/w/../etc", "/w/./x", "//w"} {
		if _, err := b.rt.DiffCheckpoints(ctx, base.ID, ck.ID, sandbox.DiffOptions{Path: p}); !errors.Is(err, sandbox.ErrInvalid) {
			t.Errorf("path %q: %v", p, err)
		}
	}
	d, err = b.rt.DiffCheckpoints(ctx, base.ID, ck.ID, sandbox.DiffOptions{MaxPaths: 1})
	if err != nil || len(d.Paths) != 1 || !d.Truncated {
		t.Fatalf("max paths: %+v %v", d, err)
	}
	if _, err := b.rt.DiffCheckpoints(ctx, base.ID, "ck-nope", sandbox.DiffOptions{}); !errors.Is(err, sandbox.ErrNotFound) {
		t.Fatalf("unknown: %v", err)
	}
}

// Hostile files in a diff with unified detail: symlinks out of the sandbox, a FIFO, a device
// the sandbox cannot make but a layer may hold, a huge sparse file: none is followed, opened
// or read whole.
func TestDiffHostile(t *testing.T) {
	b := setup(t)
	ctx := t.Context()
	s := b.create(t, sandbox.Spec{})
	sh(t, s, "mkdir -p /w; echo a > /w/a")
	base, _ := ckDigest(t, b, s)
	secret := filepath.Join(t.TempDir(), "secret")
	os.WriteFile(secret, []byte("host secret\n"), 0o644)
	sh(t, s, fmt.Sprintf("ln -s %s /w/a2; ln -s ../../../../../../../%s /w/a3; mkfifo /w/fifo; truncate -s 900M /w/huge; rm /w/a; ln -s %s /w/a; mkdir /w/d; ln -s /etc /w/d/up", secret, secret, secret))
	ck, _ := ckDigest(t, b, s)
	done := make(chan struct{})
	var d sandbox.Diff
	var err error
	go func() {
		defer close(done)
		d, err = b.rt.DiffCheckpoints(ctx, base.ID, ck.ID, sandbox.DiffOptions{Detail: sandbox.DiffUnified})
	}()
	select {
	case <-done:
	case <-time.After(30 * time.Second):
		t.Fatal("diff hangs")
	}
	if err != nil {
		t.Fatal(err)
	}
	for _, c := range d.Paths {
		if strings.Contains(c.Unified, "host secret") {
			t.Fatalf("%s: read through a symlink: %q", c.Path, c.Unified)
		}
		if c.Path == "/w/huge" && (!c.Binary || c.NewSize != 900<<20) {
			t.Fatalf("huge: %+v", c)
		}
		if c.Path == "/w/fifo" && c.NewType != sandbox.TypeOther {
			t.Fatalf("fifo: %+v", c)
		}
	}
	if len(d.Paths) < 7 {
		t.Fatalf("paths %+v", d.Paths)
	}
	_ = bytes.MinRead
}

// A checkpoint with a live process has a processes digest; a diff names the process by pid;
// released checkpoints leave no digest state behind.
func TestStateDigestProcessesAndFreed(t *testing.T) {
	b := setup(t)
	ctx := t.Context()
	s := b.create(t, sandbox.Spec{})
	noProc, d0 := ckDigest(t, b, s)
	res, err := s.Exec(ctx, sandbox.ExecRequest{Command: "cd /tmp && exec sleep 1000", Background: true})
	if err != nil {
		t.Fatal(err)
	}
	withProc, d1 := ckDigest(t, b, s)
	if d1.Processes == "" || d1.Processes == d0.Processes || d1.Files != d0.Files {
		t.Fatalf("with a process: %v (without: %v)", d1, d0)
	}
	diff, err := b.rt.DiffCheckpoints(ctx, noProc.ID, withProc.ID, sandbox.DiffOptions{})
	if err != nil {
		t.Fatal(err)
	}
	if len(diff.Processes) != 1 || diff.Processes[0].Kind != sandbox.ChangeAdded || !strings.Contains(diff.Processes[0].Command, "sleep") {
		t.Fatalf("process diff %+v (pid %d)", diff.Processes, res.Pid)
	}
	for _, id := range []string{noProc.ID, withProc.ID} {
		if err := b.rt.ReleaseCheckpoint(id); err != nil {
			t.Fatal(err)
		}
	}
	if n, st := b.rt.DigestIndexes(); n != 0 || st != 0 {
		t.Fatalf("after release: %d digests, %d stack indexes kept", n, st)
	}
}

// restingIn waits until process pid of s rests in system call nr (its
// /proc/PID/syscall names it: blocked in it, not running).
func restingIn(t *testing.T, s *sandbox.Sandbox, pid, nr int) {
	t.Helper()
	waitFor(t, s, fmt.Sprintf("grep -qs '^%d ' /proc/%d/syscall", nr, pid))
}

// Processes at rest checkpointed twice have equal processes digests: a
// coreutils sleep (its relative clock_nanosleep writes the time it has left
// back at each stop, the second time through restart_syscall), a Python
// sleep and a session's shell at its prompt, each thread's rseq area
// rewritten by the kernel on whatever CPU it last ran.
func TestStateDigestIdleProcessesEqual(t *testing.T) {
	b := setup(t)
	s := b.create(t, sandbox.Spec{Image: defaultImage(t, b)})
	ctx := t.Context()
	if _, err := s.Exec(ctx, sandbox.ExecRequest{Session: "main", Command: "cd /tmp; X=1"}); err != nil {
		t.Fatal(err)
	}
	for _, argv := range [][]string{{"sleep", "1000"}, {"python3", "-c", "import time; time.sleep(1000)"}} {
		res, err := s.Exec(ctx, sandbox.ExecRequest{Argv: argv, Background: true})
		if err != nil {
			t.Fatal(err)
		}
		restingIn(t, s, res.Pid, unix.SYS_CLOCK_NANOSLEEP)
	}
	first, d1 := ckDigest(t, b, s)
	for i := range 3 {
		ck, d := ckDigest(t, b, s)
		if d != d1 {
			diff, err := b.rt.DiffCheckpoints(ctx, first.ID, ck.ID, sandbox.DiffOptions{})
			t.Fatalf("checkpoint %d: %v, first %v (diff %+v %v)", i+2, d, d1, diff.Processes, err)
		}
	}
}

// counterFifoPy counts the lines it reads from the FIFO /tmp/ctl in memory
// alone, and marks each by creating /tmp/ack.
const counterFifoPy = `
import os
fd = os.open("/tmp/ctl", os.O_RDWR)
n = 0
while True:
    os.read(fd, 1)
    n += 1
    open("/tmp/ack", "w").close()
`

// A process that changed its memory between two checkpoints has another
// processes digest, though it rests in the same call and the files are
// the same: copied as a template, and saved by CRIU (its images hashed as
// criu writes them: two dumps of a process at rest may differ, in the
// kernel's rseq fields, so that only a template at rest hashes alike).
func TestStateDigestChangedProcessDiffers(t *testing.T) {
	t.Run("template", func(t *testing.T) { testChangedProcessDiffers(t, sandbox.ProcessesTemplate) })
	t.Run("criu", func(t *testing.T) {
		needCRIU(t)
		testChangedProcessDiffers(t, sandbox.ProcessesCRIU)
	})
}

func testChangedProcessDiffers(t *testing.T, mode sandbox.ProcessMode) {
	b := setup(t)
	s := b.create(t, sandbox.Spec{Image: defaultImage(t, b)})
	ctx := t.Context()
	sh(t, s, "mkfifo /tmp/ctl")
	if err := s.WriteFile(ctx, "/tmp/counter.py", []byte(counterFifoPy), 0o644, false); err != nil {
		t.Fatal(err)
	}
	res, err := s.Exec(ctx, sandbox.ExecRequest{Argv: []string{"python3", "/tmp/counter.py"}, Background: true})
	if err != nil {
		t.Fatal(err)
	}
	step := func() {
		t.Helper()
		sh(t, s, "echo > /tmp/ctl")
		waitFor(t, s, "[ -e /tmp/ack ]")
		sh(t, s, "rm /tmp/ack")
		restingIn(t, s, res.Pid, unix.SYS_READ)
	}
	digest := func() sandbox.StateDigest {
		t.Helper()
		ck, err := s.CheckpointWith(ctx, sandbox.CheckpointOptions{Processes: mode})
		if err != nil {
			t.Fatal(err)
		}
		d, err := b.rt.StateDigest(ctx, ck.ID)
		if err != nil {
			t.Fatal(err)
		}
		return d
	}
	step() // past its first read: the loop's objects made
	before := digest()
	if again := digest(); again != before && mode == sandbox.ProcessesTemplate {
		t.Fatalf("at rest twice: %v then %v", before, again)
	}
	step()
	after := digest()
	if after.Files != before.Files || after.Processes == before.Processes {
		t.Fatalf("counted once more: %v, before %v", after, before)
	}
}

// A directory of many files, hashed ahead on two goroutines: the same files written in
// another order (with a file made and removed, and names that are links) digest alike, one
// byte changed in one file does not, and a link's content is read once.
func TestStateDigestManyFiles(t *testing.T) {
	b := setup(t)
	const make100 = "mkdir -p /w && cd /w && i=0; while [ $i -lt 100 ]; do echo file $i > f$i; i=$((i+1)); done; ln f7 l7; ln f7 m7"
	s1 := b.create(t, sandbox.Spec{})
	sh(t, s1, make100)
	_, d1 := ckDigest(t, b, s1)
	s2 := b.create(t, sandbox.Spec{})
	sh(t, s2, "mkdir -p /w && cd /w && touch gone && i=99; while [ $i -ge 0 ]; do echo file $i > f$i; i=$((i-1)); done; ln f7 l7; ln f7 m7; rm gone")
	_, d2 := ckDigest(t, b, s2)
	if d1 != d2 {
		t.Fatalf("the same files in another order: %v, want %v", d2, d1)
	}
	s3 := b.create(t, sandbox.Spec{})
	sh(t, s3, make100+"; echo file 57. > f57")
	_, d3 := ckDigest(t, b, s3)
	if d3.Files == d1.Files {
		t.Fatal("a file changed: the same files digest")
	}
}
