package main

import (
	"bufio"
	"context"
	"encoding/json"
	"io"
	"net"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"connectrpc.com/connect"
	"google.golang.org/protobuf/encoding/protojson"

	deltagym "github.com/deltagym/deltagym/clients/go/deltagym"
	deltagymv1 "github.com/deltagym/deltagym/clients/go/gen/deltagym/v1"
	"github.com/deltagym/deltagym/sandbox"
)

// cli runs the CLI against the test server and fails the test unless it
// exits with want.
func cli(t *testing.T, want int, stdin string, args ...string) (stdout, stderr string) {
	t.Helper()
	stdout, stderr, code := runCLI(t, stdin, args...)
	if code != want {
		t.Fatalf("deltagym %q: exit %d, want %d\nstdout: %s\nstderr: %s", args, code, want, stdout, stderr)
	}
	return stdout, stderr
}

func mustContain(t *testing.T, what, got string, wants ...string) {
	t.Helper()
	for _, w := range wants {
		if !strings.Contains(got, w) {
			t.Fatalf("%s: %q does not contain %q", what, got, w)
		}
	}
}

// TestCLI walks every client subcommand once against the in-process server,
// as a user would in a shell.
func TestCLI(t *testing.T) {
	needServer(t)
	t.Setenv("DELTAGYM_ADDR", testAddr)
	t.Setenv("DELTAGYM_TOKEN", testToken)
	run := "cli-" + deltagym.NewIdempotencyKey()[:6]
	group := run + "-g"

	// Auth: the token comes from the environment; a wrong one is refused.
	out, _ := cli(t, exitOK, "", "envs")
	mustContain(t, "envs", out, "NAME", "shell")
	_, errOut := cli(t, exitError, "", "envs", "--token", "wrong")
	mustContain(t, "envs with a wrong token", errOut, "unauthenticated", "sent a token the server does not take")
	t.Setenv("DELTAGYM_TOKEN", "")
	t.Setenv("DELTAGYM_DATA", t.TempDir())
	_, errOut = cli(t, exitError, "", "envs")
	mustContain(t, "envs without a token", errOut, "unauthenticated", "found no token", "$DELTAGYM_TOKEN_FILE")
	t.Setenv("DELTAGYM_TOKEN", testToken)

	// reset, readable and machine forms.
	out, _ = cli(t, exitOK, "", "reset", "shell", "--seed", "5", "--option", "QUESTION=why", "--run", run, "--group", group)
	mustContain(t, "reset", out, "sandbox ", "episode ", "checkpoint ", "expires in", "seed=5")
	first := strings.Fields(strings.SplitN(out, "\n", 2)[0])[1]
	t.Cleanup(func() { runCLI(t, "", "close", first) })
	out, _ = cli(t, exitOK, "", "reset", "shell", "--run", run, "--json")
	var reset deltagymv1.ResetResponse
	if err := protojson.Unmarshal([]byte(out), &reset); err != nil || reset.GetSandboxId() == "" {
		t.Fatalf("reset --json printed %q: %v", out, err)
	}
	cli(t, exitOK, "", "close", reset.GetSandboxId())
	out, _ = cli(t, exitOK, "", "reset", "shell", "--run", run, "-q")
	sb := strings.TrimSpace(out)
	t.Cleanup(func() { runCLI(t, "", "close", sb) })

	// exec: argv, shell string, failure status, session state.
	out, _ = cli(t, exitOK, "", "exec", sb, "--", "echo", "hello", "world")
	if out != "hello world\n" {
		t.Fatalf("exec argv printed %q", out)
	}
	out, errOut = cli(t, 3, "", "exec", sb, "echo out; echo err >&2; exit 3") // the command's status
	if out != "out\n" || !strings.Contains(errOut, "err\ndeltagym: exit 3 in ") {
		t.Fatalf("exec failing command: stdout %q stderr %q", out, errOut)
	}
	cli(t, exitOK, "", "exec", sb, "--session", "s", "cd /tmp && X=7")
	out, _ = cli(t, exitOK, "", "exec", sb, "--session", "s", "--", "echo", "$X", "in", "$(pwd)")
	if out != "$X in $(pwd)\n" { // argv words are quoted for the session's shell
		t.Fatalf("exec session argv printed %q", out)
	}
	out, _ = cli(t, exitOK, "", "exec", sb, "--session", "s", "echo $X in $(pwd)")
	if out != "7 in /tmp\n" {
		t.Fatalf("exec session printed %q", out)
	}
	out, _ = cli(t, exitOK, "stdin text", "exec", sb, "--stdin", "-", "--env", "V=1", "--cwd", "/tmp", "cat; echo $V $(pwd)")
	if out != "stdin text1 /tmp\n" {
		t.Fatalf("exec with stdin, env, cwd printed %q", out)
	}
	_, errOut = cli(t, 124, "", "exec", sb, "--timeout", "200ms", "sleep 5")
	mustContain(t, "exec timeout", errOut, "timed out")
	_, errOut = cli(t, 124, "", "exec", sb, "--timeout", "0.2", "sleep 5") // plain seconds
	mustContain(t, "exec timeout in seconds", errOut, "timed out")

	// write and read.
	out, _ = cli(t, exitOK, "42", "write", sb, "/work/answer.txt")
	mustContain(t, "write", out, "wrote 2 bytes to /work/answer.txt (file size 2)")
	src := filepath.Join(t.TempDir(), "in.txt")
	if err := writeFile(src, "from a file\n"); err != nil {
		t.Fatal(err)
	}
	cli(t, exitOK, "", "write", sb, "/work/notes.txt", "--from", src, "--mode", "0600")
	out, _ = cli(t, exitOK, "", "read", sb, "/work/notes.txt")
	if out != "from a file\n" {
		t.Fatalf("read printed %q", out)
	}
	out, errOut = cli(t, exitOK, "", "read", sb, "/work/notes.txt", "--max-bytes", "4")
	if out != "from" || !strings.Contains(errOut, "printed 4 of 12 bytes") {
		t.Fatalf("read --max-bytes: stdout %q stderr %q", out, errOut)
	}

	// checkpoint, evaluate, restore.
	out, _ = cli(t, exitOK, "", "checkpoint", sb, "-q")
	ckpt := strings.TrimSpace(out)
	out, _ = cli(t, exitOK, "", "checkpoint", sb)
	mustContain(t, "checkpoint", out, "checkpoint ", "parent ")
	cli(t, exitOK, "", "exec", sb, "rm /work/answer.txt")
	out, _ = cli(t, exitOK, "", "evaluate", sb)
	mustContain(t, "evaluate after rm", out, "reward      0 (took ", "correct=0")
	out, _ = cli(t, exitOK, "", "restore", sb, ckpt)
	mustContain(t, "restore", out, "episode ", "next step ")
	restored := strings.Fields(strings.SplitN(out, "\n", 2)[0])[1]
	out, _ = cli(t, exitOK, "", "evaluate", sb, "--json")
	var ev deltagymv1.EvaluateResponse
	if err := protojson.Unmarshal([]byte(out), &ev); err != nil || ev.GetReward() != 1 {
		t.Fatalf("evaluate --json after restore printed %q: %v", out, err)
	}

	// fork from the sandbox and from the checkpoint; submit in the children.
	out, _ = cli(t, exitOK, "", "fork", sb, "-n", "2", "--group", group, "-q") // a sandbox as the argument
	kids := strings.Fields(out)
	if len(kids) != 2 {
		t.Fatalf("fork -q printed %q", out)
	}
	out, _ = cli(t, exitOK, "", "fork", ckpt, "-n", "1", "--group", group) // the checkpoint as an argument
	mustContain(t, "fork", out, "forked 1 sandbox from checkpoint "+ckpt, "SANDBOX")
	third := strings.Fields(strings.Split(out, "\n")[2])[0]
	kids = append(kids, third)
	out, _ = cli(t, exitOK, "", "submit", kids[0])
	mustContain(t, "submit", out, "reward      1 (episode ", "terminated)", "correct=1")
	cli(t, exitOK, "41", "write", kids[1], "/work/answer.txt")
	out, _ = cli(t, exitOK, "", "submit", kids[1], "my answer")
	mustContain(t, "submit wrong", out, "reward      0 (")
	_, errOut = cli(t, exitError, "", "exec", kids[0], "true")
	mustContain(t, "exec after submit", errOut, "failed_precondition")

	out, _ = cli(t, exitOK, "", "sandboxes", "--run", run)
	for _, id := range append([]string{first, sb}, kids...) {
		mustContain(t, "sandboxes", out, id)
	}
	out, _ = cli(t, exitOK, "", "close", kids[0], kids[1], kids[2])
	mustContain(t, "close", out, "closed "+kids[0], "closed "+kids[2])
	_, errOut = cli(t, exitError, "", "restore", sb, "ck-unknown")
	mustContain(t, "restore unknown", errOut, "not_found")

	// The ledger.
	out, errOut = cli(t, exitOK, "", "episodes", "--run", run, "--limit", "1")
	if strings.Count(out, "\n") != 2 || !strings.Contains(errOut, "--limit 0") {
		t.Fatalf("episodes --limit 1 printed %q, stderr %q: want one episode and a word that there are more", out, errOut)
	}
	out, _ = cli(t, exitOK, "", "episodes", "--run", run)
	mustContain(t, "episodes", out, "EPISODE", restored, "branched", "terminated")
	out, _ = cli(t, exitOK, "", "episodes", "--run", run, "--json")
	var eps deltagymv1.ListEpisodesResponse
	if err := protojson.Unmarshal([]byte(out), &eps); err != nil || len(eps.GetEpisodes()) < 6 {
		t.Fatalf("episodes --json printed %q: %v", out, err)
	}
	out, _ = cli(t, exitOK, "", "trajectory", restored)
	mustContain(t, "trajectory", out, "episode  "+restored, "inherited from ", "write /work/answer.txt")
	out, _ = cli(t, exitOK, "", "advantages", group)
	mustContain(t, "advantages", out, "counted 2, mean 0.5")
	cli(t, exitOK, "", "release", ckpt)

	out, _ = cli(t, exitOK, "", "traj", "export", "--run", run, "--format", "jsonl", "--database-url", testServer.DatabaseURL())
	lines, kinds := 0, map[string]bool{}
	sc := bufio.NewScanner(strings.NewReader(out))
	sc.Buffer(nil, 1<<24)
	for sc.Scan() {
		var line struct {
			Episode struct {
				ID  string `json:"id"`
				Run string `json:"run"`
			} `json:"episode"`
			Steps []struct {
				Observation map[string]json.RawMessage `json:"observation"`
			} `json:"steps"`
		}
		if err := json.Unmarshal(sc.Bytes(), &line); err != nil || line.Episode.Run != run {
			t.Fatalf("export line %q: %v", sc.Text(), err)
		}
		// Observations are exported as protojson, as actions are.
		for _, st := range line.Steps {
			if len(st.Observation) != 1 {
				t.Fatalf("export line %q: a step's observation is not one kind of result", sc.Text())
			}
			for k := range st.Observation {
				kinds[k] = true
			}
		}
		lines++
	}
	if !kinds["exec"] || !kinds["writeFile"] {
		t.Fatalf("exported observations of kinds %v, want exec and writeFile among them", kinds)
	}
	if lines != len(eps.GetEpisodes()) {
		t.Fatalf("export wrote %d episodes, the API lists %d", lines, len(eps.GetEpisodes()))
	}
	// db url, from the data directory: the URL the server uses.
	t.Setenv(envDatabaseURL, "")
	out, errOut = cli(t, exitOK, "", "db", "url", "--data", testDataDir)
	if strings.TrimSpace(out) != testServer.DatabaseURL() || errOut != "" {
		t.Fatalf("db url printed %q (stderr %q), the server uses %q", out, errOut, testServer.DatabaseURL())
	}
	// traj export through the private cluster the running server uses.
	out2, _ := cli(t, exitOK, "", "traj", "export", "--run", run, "--data", testDataDir)
	if out2 != out && strings.Count(out2, "\n") != lines {
		t.Fatalf("export through the data directory wrote %d lines, want %d", strings.Count(out2, "\n"), lines)
	}

	out, _ = cli(t, exitOK, "", "close", sb, first)
	mustContain(t, "close", out, "closed "+sb)
	_, errOut = cli(t, exitError, "", "exec", sb, "true")
	if !strings.Contains(errOut, "failed_precondition") && !strings.Contains(errOut, "not_found") {
		t.Fatalf("exec on a closed sandbox: stderr %q", errOut)
	}
}

// TestServe runs `deltagym serve` in-process on its own port, data directory
// and cgroup root, and stops it by cancelling its context, as SIGINT would. Its
// default image is imported from where --default-image says (as the node
// image's entrypoint has it), not from the fresh data directory.
func TestServe(t *testing.T) {
	needServer(t)
	addr := closedAddr(t)
	ctx, cancel := context.WithCancel(t.Context())
	defer cancel()
	done := make(chan int, 1)
	stopped := false // the server's exit code was taken from done
	var stderr strings.Builder
	a := &app{stdin: strings.NewReader(""), stdout: io.Discard, stderr: &stderr}
	data, err := os.MkdirTemp("", "dgserve-")
	if err != nil {
		t.Fatal(err)
	}
	defer func() {
		// A test that failed while the server runs stops it before cleaning its data.
		if !stopped {
			cancel()
			<-done
		}
		// The runtime keeps checkpoint layers mounted for a restart.
		if err := sandbox.Purge(filepath.Join(data, "sandbox")); err != nil {
			t.Error(err)
		}
		if err := os.RemoveAll(data); err != nil {
			t.Error(err)
		}
	}()
	envs := t.TempDir()
	if err := os.WriteFile(filepath.Join(envs, "onbox.json"), []byte(`{"name": "onbox", "image": "default", "pool_size": 1}`), 0o644); err != nil {
		t.Fatal(err)
	}
	go func() {
		done <- a.main(ctx, []string{"serve", "--addr", addr, "--data", data, "--envs", envs, "--default-image", testImage,
			"--init", testInit, "--no-ledger", "--token", "serve-token"})
	}()
	c, err := deltagym.Dial(addr, deltagym.WithToken("serve-token"), deltagym.WithRetry(100, 20*time.Millisecond))
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	listed, err := c.ListEnvs(ctx) // retried until the server listens
	if err != nil || len(listed) != 1 {
		t.Fatalf("ListEnvs on `deltagym serve` with a catalog of one env = %v, %v", listed, err)
	}
	if _, err := c.Reset(ctx, "shell"); connect.CodeOf(err) != connect.CodeNotFound {
		t.Fatalf("Reset of an env not in the catalog = %v, want NotFound", err)
	}
	sb, err := c.Reset(ctx, "onbox")
	if err != nil {
		t.Fatalf("Reset of an env on the image --default-image names: %v", err)
	}
	if err := sb.Close(ctx); err != nil {
		t.Fatal(err)
	}
	t0 := time.Now()
	cancel()
	code := <-done
	stopped = true
	if code != exitOK {
		t.Fatalf("serve exited %d: %s", code, stderr.String())
	}
	t.Logf("serve stopped %v after its context ended", time.Since(t0))
	once, err := deltagym.Dial(addr, deltagym.WithToken("serve-token"), deltagym.WithRetry(1, 0))
	if err != nil {
		t.Fatal(err)
	}
	defer once.Close()
	if _, err := once.ListEnvs(context.Background()); connect.CodeOf(err) != connect.CodeUnavailable {
		t.Fatalf("ListEnvs after serve returned = %v, want Unavailable", err)
	}
}

// import-image and register-env: an image imported by path, an env on it registered from a
// spec file (kept in the server's data directory for its next start), a sandbox of it; bad
// input refused with the reason.
func TestCLICatalog(t *testing.T) {
	needServer(t)
	t.Setenv("DELTAGYM_ADDR", testAddr)
	t.Setenv("DELTAGYM_TOKEN", testToken)
	out, _ := cli(t, exitOK, "", "import-image", "cli-img", testImage, "--format", "rootfs")
	mustContain(t, "import-image", out, "cli-img", "sha256:")
	_, errOut := cli(t, exitUsage, "", "import-image", "cli-img", testImage, "--format", "zip")
	mustContain(t, "import-image --format zip", errOut, "want oci, docker or rootfs")
	_, errOut = cli(t, exitError, "", "import-image", "cli-img2", "none")
	mustContain(t, "import-image of a missing path", errOut, "invalid_argument", `"none": nothing there below the server's import root`)
	_, errOut = cli(t, exitError, "", "import-image", "cli-img2", t.TempDir())
	mustContain(t, "import-image of a path outside the import root", errOut, "invalid_argument", "is not below the server's import root")

	spec := filepath.Join(t.TempDir(), "cli-env.json")
	if err := os.WriteFile(spec, []byte(`{"name": "cli-env", "image": "cli-img", "poolSize": 1, "env": {"WHO": "cli"}}`), 0o644); err != nil {
		t.Fatal(err)
	}
	out, _ = cli(t, exitOK, "", "register-env", spec)
	mustContain(t, "register-env", out, "cli-env", "cli-img")
	_, errOut = cli(t, exitError, "", "register-env", spec)
	mustContain(t, "register-env again", errOut, "already_exists")
	out, _ = cli(t, exitOK, `{"name": "cli-env", "image": "cli-img", "poolSize": 1, "env": {"WHO": "cli2"}}`, "register-env", "-", "--replace")
	mustContain(t, "register-env --replace", out, "cli-env")
	_, errOut = cli(t, exitError, `{"name": "cli-env", "imag": "x"}`, "register-env", "-")
	mustContain(t, "register-env of a bad spec", errOut, "standard input: not an env spec", "imag")
	_, errOut = cli(t, exitUsage, "", "import-image", "cli-img")
	mustContain(t, "import-image without a path", errOut, "PATH")
	kept, err := os.ReadFile(filepath.Join(testDataDir, "envs", "cli-env.json"))
	if err != nil || !strings.Contains(string(kept), "cli2") {
		t.Fatalf("the server kept %q (%v), want the replaced spec", kept, err)
	}

	sb, _ := cli(t, exitOK, "", "reset", "cli-env", "-q")
	sb = strings.TrimSpace(sb)
	out, _ = cli(t, exitOK, "", "exec", sb, "echo $WHO")
	mustContain(t, "exec in the registered env", out, "cli2")
	cli(t, exitOK, "", "close", sb)
}

// TestCLILeaseTTL: reset --lease-ttl sets the sandbox's own TTL, which the server bounds by its
// --max-lease-ttl; exec --setup takes a setup step.
func TestCLILeaseTTL(t *testing.T) {
	needServer(t)
	t.Setenv("DELTAGYM_ADDR", testAddr)
	t.Setenv("DELTAGYM_TOKEN", testToken)
	out, _ := cli(t, exitOK, "", "reset", "shell", "--lease-ttl", "2h", "--json")
	var reset deltagymv1.ResetResponse
	if err := protojson.Unmarshal([]byte(out), &reset); err != nil || reset.GetSandboxId() == "" {
		t.Fatalf("reset --json printed %q: %v", out, err)
	}
	t.Cleanup(func() { runCLI(t, "", "close", reset.GetSandboxId()) })
	if left := time.Until(reset.GetLeaseExpireTime().AsTime()); left <= 119*time.Minute || left > 2*time.Hour {
		t.Fatalf("reset --lease-ttl 2h: the lease expires in %v", left)
	}
	out, _ = cli(t, exitOK, "", "exec", reset.GetSandboxId(), "--setup", "--json", "true")
	var st deltagymv1.StepResponse
	if err := protojson.Unmarshal([]byte(out), &st); err != nil || st.GetStepIndex() != 0 {
		t.Fatalf("exec --setup --json printed %q: %v", out, err)
	}
	_, errOut := cli(t, exitError, "", "reset", "shell", "--lease-ttl", "48h")
	mustContain(t, "reset --lease-ttl past the server's maximum", errOut, "invalid_argument", "--max-lease-ttl")
}

// TestCLINodes: `nodes` lists the server --addr names, or every node of a cluster target; a
// cluster's commands go to the node an ID names, reset to the least loaded. The cluster here
// is the test server at two addresses: one node, keyed by the name it reports.
func TestCLINodes(t *testing.T) {
	needServer(t)
	t.Setenv("DELTAGYM_ADDR", testAddr)
	t.Setenv("DELTAGYM_TOKEN", testToken)
	c, err := deltagym.Dial(testAddr, deltagym.WithToken(testToken))
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	info, err := c.GetNode(t.Context())
	if err != nil {
		t.Fatal(err)
	}
	name := info.GetName()
	out, _ := cli(t, exitOK, "", "nodes")
	mustContain(t, "nodes", out, "NAME", "ADDRESS", "SANDBOXES", "CPU LOAD", "MEMORY AVAILABLE", name, " "+testAddr+" ", " ok")
	out, _ = cli(t, exitOK, "", "nodes", "--json")
	var gn deltagymv1.GetNodeResponse
	if err := protojson.Unmarshal([]byte(out), &gn); err != nil || gn.GetNode().GetName() != name || gn.GetNode().GetCpus() < 1 {
		t.Fatalf("nodes --json printed %q: %v", out, err)
	}

	_, port, err := net.SplitHostPort(testAddr)
	if err != nil {
		t.Fatal(err)
	}
	cluster := testAddr + ",localhost:" + port
	t.Setenv("DELTAGYM_ADDR", cluster)
	out, _ = cli(t, exitOK, "", "nodes")
	if rows := strings.Count(out, "\n"); rows != 2 || !strings.Contains(out, name+"  ") || !strings.Contains(out, " ok") {
		t.Fatalf("nodes of %s: %q, want one node, %s", cluster, out, name)
	}
	out, _ = cli(t, exitOK, "", "reset", "shell", "-q")
	sb := strings.TrimSpace(out)
	t.Cleanup(func() { runCLI(t, "", "close", sb) })
	if deltagym.NodeOf(sb) != name {
		t.Fatalf("reset through the cluster made %q, not a sandbox of %s", sb, name)
	}
	out, _ = cli(t, exitOK, "", "exec", sb, "--", "echo", "routed")
	if out != "routed\n" {
		t.Fatalf("exec through the cluster printed %q", out)
	}
	out, _ = cli(t, exitOK, "", "sandboxes")
	mustContain(t, "sandboxes through the cluster", out, sb)
	out, _ = cli(t, exitOK, "", "checkpoint", sb, "-q")
	ck := strings.TrimSpace(out)
	out, _ = cli(t, exitOK, "", "fork", ck, "-q")
	kid := strings.TrimSpace(out)
	cli(t, exitOK, "", "close", kid, sb)
	cli(t, exitOK, "", "release", ck)
	_, errOut := cli(t, exitError, "", "exec", "sb-node-z-0123456789abcdef", "true")
	mustContain(t, "exec in a sandbox of a node the cluster lacks", errOut, "unavailable", "node node-z is unreachable", "nodes: "+name)
	_, errOut = cli(t, exitUsage, "", "envs", "--addr", "dns:nope")
	mustContain(t, "a bad cluster target", errOut, "want dns:NAME:PORT")
}
