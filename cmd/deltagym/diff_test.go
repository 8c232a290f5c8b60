package main

import (
	"flag"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"

	"google.golang.org/protobuf/encoding/protojson"

	deltagym "github.com/deltagym/deltagym/clients/go/deltagym"
	deltagymv1 "github.com/deltagym/deltagym/clients/go/gen/deltagym/v1"
)

// deltagym checkpoint --wait-digest / --dedupe and deltagym diff against the test server.
func TestCLIDiffDedupe(t *testing.T) {
	needServer(t)
	t.Setenv("DELTAGYM_ADDR", testAddr)
	t.Setenv("DELTAGYM_TOKEN", testToken)
	run := "diff-" + deltagym.NewIdempotencyKey()[:6]
	content := run + "\nsecond line\n"
	reset := func() string {
		out, _ := cli(t, exitOK, "", "reset", "shell", "--run", run, "-q")
		sb := strings.TrimSpace(out)
		t.Cleanup(func() { runCLI(t, "", "close", sb) })
		return sb
	}
	a := reset()
	cli(t, exitOK, content, "write", a, "/tmp/text")
	out, _ := cli(t, exitOK, "", "checkpoint", a, "--wait-digest")
	mustContain(t, "checkpoint --wait-digest", out, "digest", "sha256:")
	if strings.Contains(out, "deduplicated") {
		t.Fatalf("checkpoint --wait-digest printed %q", out)
	}
	first := strings.Fields(out)[1]

	b := reset()
	out, _ = cli(t, exitOK, "", "checkpoint", b, "-q")
	base := strings.TrimSpace(out)
	cli(t, exitOK, content, "write", b, "/tmp/text")
	cli(t, exitOK, "\x00\x01binary", "write", b, "/tmp/bin")
	out, _ = cli(t, exitOK, "", "checkpoint", b, "--dedupe")
	if strings.Contains(out, "deduplicated") {
		t.Fatalf("checkpoint --dedupe of a state no checkpoint holds printed %q", out)
	}
	target := strings.Fields(out)[1]
	out, _ = cli(t, exitOK, "", "diff", base, target, "--path", "/tmp")
	want := " /tmp/bin  | Bin 0 -> 8 bytes\n /tmp/text |   2 ++\n 2 files changed, 2 insertions(+)\n"
	if out != want {
		t.Fatalf("diff printed\n%s\nwant\n%s", out, want)
	}
	out, _ = cli(t, exitOK, "", "diff", base, target, "--path", "/tmp", "--unified")
	mustContain(t, "diff --unified", out, "+++ b/tmp/text", "+second line", "Binary files /dev/null and b/tmp/bin differ")
	out, _ = cli(t, exitOK, "", "diff", base, target, "--path", "/tmp", "--max-paths", "1")
	mustContain(t, "diff --max-paths 1", out, " /tmp/bin ", "1 file changed", "cover the first 1 only; --max-paths N")
	_, errOut := cli(t, exitError, "", "diff", base, target, "--path", "tmp")
	mustContain(t, "diff --path tmp", errOut, "invalid_argument")
	_, errOut = cli(t, exitError, "", "diff", base, "ck-nope")
	mustContain(t, "diff of an unknown checkpoint", errOut, "not_found")

	// The second sandbox comes back to the first's state: the checkpoint is the first's.
	cli(t, exitOK, "", "exec", b, "rm /tmp/bin")
	out, _ = cli(t, exitOK, "", "checkpoint", b, "--dedupe")
	mustContain(t, "checkpoint --dedupe", out, "deduplicated: "+first, "parent", target, "sha256:")
}

// TestDiffText: the stat and the patch of a diff holding every kind of path change, against
// the golden texts the Python SDK's CheckpointDiff.stat() and .unified() are tested against
// too (clients/python/tests/test_digests.py), so that the two print the same.
func TestDiffText(t *testing.T) {
	t.Parallel()
	in, err := os.ReadFile("testdata/diff.json")
	if err != nil {
		t.Fatal(err)
	}
	var m deltagymv1.DiffCheckpointsResponse
	if err := protojson.Unmarshal(in, &m); err != nil {
		t.Fatal(err)
	}
	for _, c := range []struct {
		golden string
		text   func(*deltagymv1.DiffCheckpointsResponse) string
	}{{"testdata/diff.stat.golden", statText}, {"testdata/diff.unified.golden", unifiedText}} {
		got := c.text(&m)
		if *updateGolden {
			if err := os.WriteFile(c.golden, []byte(got), 0o644); err != nil {
				t.Fatal(err)
			}
			continue
		}
		want, err := os.ReadFile(c.golden)
		if err != nil {
			t.Fatal(err)
		}
		if got != string(want) {
			t.Errorf("%s: got\n%s\nwant\n%s", c.golden, got, want)
		}
	}
	empty := &deltagymv1.DiffCheckpointsResponse{}
	if s, u := statText(empty), unifiedText(empty); s != "" || u != "" {
		t.Errorf("equal states: stat %q, patch %q; want both empty", s, u)
	}
}

var updateGolden = flag.Bool("update", false, "rewrite testdata/*.golden from the code")

// TestDiffSummary: git's summary line, zero counts left out as git leaves them out.
func TestDiffSummary(t *testing.T) {
	t.Parallel()
	for _, c := range []struct {
		files, ins, del int
		want            string
	}{
		{1, 3, 0, " 1 file changed, 3 insertions(+)"},
		{2, 0, 1, " 2 files changed, 1 deletion(-)"},
		{1, 0, 0, " 1 file changed, 0 insertions(+), 0 deletions(-)"},
		{3, 1, 2, " 3 files changed, 1 insertion(+), 2 deletions(-)"},
		{0, 0, 0, " 0 files changed"},
	} {
		if got := diffSummary(c.files, c.ins, c.del); got != c.want {
			t.Errorf("diffSummary(%d, %d, %d) = %q, want %q", c.files, c.ins, c.del, got, c.want)
		}
	}
}

// TestShortDigest: the checkpoints table's DIGEST column.
func TestShortDigest(t *testing.T) {
	t.Parallel()
	hex := strings.Repeat("0123456789abcdef", 4)
	for _, c := range []struct {
		d    *deltagymv1.StateDigest
		want string
	}{
		{nil, "-"},
		{&deltagymv1.StateDigest{Files: "sha256:" + hex}, "0123456789ab"},
		{&deltagymv1.StateDigest{Files: "sha256:" + hex, Processes: "sha256:" + hex}, "0123456789ab+p"},
	} {
		if got := shortDigest(c.d); got != c.want {
			t.Errorf("shortDigest(%v) = %q, want %q", c.d, got, c.want)
		}
	}
}

// TestCLIDiffGitApply: deltagym diff's stat of a real diff (directories not counted, a link and
// a mode change counted), its silence on equal states, and its -u patch applied by git apply to
// a copy of the base's files giving the checkpoint's.
func TestCLIDiffGitApply(t *testing.T) {
	needServer(t)
	git, err := exec.LookPath("git")
	if err != nil {
		t.Skip("needs git, to apply the patch: not on PATH")
	}
	t.Setenv("DELTAGYM_ADDR", testAddr)
	t.Setenv("DELTAGYM_TOKEN", testToken)
	run := "diffapply-" + deltagym.NewIdempotencyKey()[:6]
	out, _ := cli(t, exitOK, "", "reset", "shell", "--run", run, "-q")
	sb := strings.TrimSpace(out)
	t.Cleanup(func() { runCLI(t, "", "close", sb) })
	base := map[string]struct {
		content string
		mode    os.FileMode
	}{
		"b.txt": {"one\ntwo\n", 0o600},
		"x.sh":  {"echo hi\n", 0o644},
		"gone":  {"bye\n", 0o644},
		"nonl":  {"a", 0o644},
	}
	cli(t, exitOK, "", "exec", sb, "mkdir -p /tmp/p && cd /tmp/p && printf 'one\\ntwo\\n' > b.txt && chmod 600 b.txt && "+
		"printf 'echo hi\\n' > x.sh && printf 'bye\\n' > gone && printf a > nonl")
	out, _ = cli(t, exitOK, "", "checkpoint", sb, "-q")
	ckBase := strings.TrimSpace(out)
	cli(t, exitOK, "", "exec", sb, "cd /tmp/p && printf 'one\\nTWO\\nthree\\n' > b.txt && chmod 644 b.txt && chmod 755 x.sh && "+
		"rm gone && printf 'a\\nb' > nonl && mkdir d && printf 'new\\n' > d/new.txt && : > empty && ln -s b.txt link && "+
		"(sleep 600 >/dev/null 2>&1 &)")
	out, _ = cli(t, exitOK, "", "checkpoint", sb, "-q", "--wait-digest")
	ck := strings.TrimSpace(out)

	out, _ = cli(t, exitOK, "", "diff", ckBase, ck, "--path", "/tmp/p")
	want := "" +
		" /tmp/p/b.txt     | 3 ++-\n" +
		" /tmp/p/d/        | 0\n" +
		" /tmp/p/d/new.txt | 1 +\n" +
		" /tmp/p/empty     | 0\n" +
		" /tmp/p/gone      | 1 -\n" +
		" /tmp/p/link      | 0\n" +
		" /tmp/p/nonl      | 3 ++-\n" +
		" /tmp/p/x.sh      | 0\n" +
		" 7 files changed, 5 insertions(+), 3 deletions(-)\n"
	if out != want {
		t.Fatalf("diff printed\n%s\nwant\n%s", out, want)
	}
	// Without --path the processes follow (with it, as above, they are left out); the one
	// started is among them.
	out, _ = cli(t, exitOK, "", "diff", ckBase, ck)
	mustContain(t, "diff of the whole tree", out, "\nprocesses:\n", " + pid ", " sleep 600\n")
	if out, _ = cli(t, exitOK, "", "diff", ck, ck); out != "" {
		t.Fatalf("diff of a checkpoint with itself printed %q, want nothing", out)
	}
	if out, _ = cli(t, exitOK, "", "diff", ckBase, ck, "--path", "/tmp/p/x.sh"); out != " /tmp/p/x.sh | 0\n 1 file changed, 0 insertions(+), 0 deletions(-)\n" {
		t.Fatalf("diff of a mode change printed %q", out)
	}
	out, _ = cli(t, exitOK, "", "diff", ckBase, ck, "--path", "/tmp/p", "--max-paths", "2")
	mustContain(t, "diff --max-paths 2", out, " /tmp/p/d/    | 0\n", " 1 file changed, 2 insertions(+), 1 deletion(-)\n",
		"the list and the totals cover the first 2 only; --max-paths N")
	out, _ = cli(t, exitOK, "", "checkpoints", "--run", run)
	mustContain(t, "checkpoints", out, "DIGEST", ck)
	out, _ = cli(t, exitOK, "", "checkpoint", sb, "--wait-digest")
	mustContain(t, "checkpoint --wait-digest", out, "sha256:")
	digest := out[strings.Index(out, "sha256:")+len("sha256:"):][:12]
	out, _ = cli(t, exitOK, "", "checkpoints", "--run", run)
	mustContain(t, "checkpoints after --wait-digest (of a sandbox running a process)", out, " "+digest+"+p ")

	patch, _ := cli(t, exitOK, "", "diff", ckBase, ck, "--path", "/tmp/p", "-u")
	mustContain(t, "diff -u", patch, "diff --git a/tmp/p/b.txt b/tmp/p/b.txt\nold mode 100600\nnew mode 100644\n--- a/tmp/p/b.txt\n",
		"diff --git a/tmp/p/x.sh b/tmp/p/x.sh\nold mode 100644\nnew mode 100755\n",
		"diff --git a/tmp/p/empty b/tmp/p/empty\nnew file mode 100644\n",
		"diff --git a/tmp/p/gone b/tmp/p/gone\ndeleted file mode 100644\n",
		"# /tmp/p/d/: new directory, mode 755\n", "# /tmp/p/link: new symlink (its target is not in the diff)\n")
	dir := t.TempDir()
	for name, f := range base {
		p := filepath.Join(dir, "tmp/p", name)
		if err := os.MkdirAll(filepath.Dir(p), 0o755); err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(p, []byte(f.content), f.mode); err != nil {
			t.Fatal(err)
		}
		if err := os.Chmod(p, f.mode); err != nil {
			t.Fatal(err)
		}
	}
	apply := exec.CommandContext(t.Context(), git, "apply", "-")
	apply.Dir, apply.Stdin = dir, strings.NewReader(patch)
	apply.Env = append(os.Environ(), "GIT_CEILING_DIRECTORIES="+filepath.Dir(dir))
	if msg, err := apply.CombinedOutput(); err != nil {
		t.Fatalf("git apply: %v\n%s\npatch:\n%s", err, msg, patch)
	}
	for name, content := range map[string]string{"b.txt": "one\nTWO\nthree\n", "x.sh": "echo hi\n", "nonl": "a\nb", "d/new.txt": "new\n", "empty": ""} {
		got, err := os.ReadFile(filepath.Join(dir, "tmp/p", name))
		if err != nil || string(got) != content {
			t.Errorf("after git apply, %s holds %q (%v), want %q", name, got, err, content)
		}
	}
	if _, err := os.Lstat(filepath.Join(dir, "tmp/p/gone")); !os.IsNotExist(err) {
		t.Errorf("after git apply, gone: %v, want it removed", err)
	}
	// git apply keeps only the executable bit of a mode, as git does.
	for name, exe := range map[string]bool{"x.sh": true, "b.txt": false} {
		st, err := os.Stat(filepath.Join(dir, "tmp/p", name))
		if err != nil || (st.Mode()&0o100 != 0) != exe {
			t.Errorf("after git apply, %s: %v (%v), want executable %v", name, st.Mode(), err, exe)
		}
	}
}
