package main

import (
	"strings"
	"testing"

	deltagym "github.com/deltagym/deltagym/clients/go/deltagym"
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
	want := " /tmp/bin  | Bin 0 -> 8 bytes\n /tmp/text | 2 ++\n 2 files changed, 2 insertions(+)\n"
	if out != want {
		t.Fatalf("diff printed\n%s\nwant\n%s", out, want)
	}
	out, _ = cli(t, exitOK, "", "diff", base, target, "--path", "/tmp", "--unified")
	mustContain(t, "diff --unified", out, "+++ b/tmp/text", "+second line", "Binary files a/tmp/bin and b/tmp/bin differ")
	out, _ = cli(t, exitOK, "", "diff", base, target, "--path", "/tmp", "--max-paths", "1")
	mustContain(t, "diff --max-paths 1", out, " /tmp/bin ", "1 file changed", "--max-paths lists more")
	_, errOut := cli(t, exitError, "", "diff", base, target, "--path", "tmp")
	mustContain(t, "diff --path tmp", errOut, "invalid_argument")
	_, errOut = cli(t, exitError, "", "diff", base, "ck-nope")
	mustContain(t, "diff of an unknown checkpoint", errOut, "not_found")

	// The second sandbox comes back to the first's state: the checkpoint is the first's.
	cli(t, exitOK, "", "exec", b, "rm /tmp/bin")
	out, _ = cli(t, exitOK, "", "checkpoint", b, "--dedupe")
	mustContain(t, "checkpoint --dedupe", out, "deduplicated: "+first, "parent", target, "sha256:")
}
