package server_test

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"slices"
	"strings"
	"syscall"
	"testing"

	"connectrpc.com/connect"

	deltagym "github.com/deltagym/deltagym/clients/go/deltagym"
	deltagymv1 "github.com/deltagym/deltagym/clients/go/gen/deltagym/v1"
	"github.com/deltagym/deltagym/clients/go/gen/deltagym/v1/deltagymv1connect"
	"github.com/deltagym/deltagym/server"
)

// localUserEnv makes the test binary act as an unprivileged local user (see localUser).
const localUserEnv = "DELTAGYM_TEST_LOCAL_USER"

type localUserPlan struct {
	Addr, Data string
}

// localUser is what an untrusted local user tries against a server on loopback: read the
// server's token, then import a host directory without it, by hand and through the Go client
// (which looks for the token file too). It prints one line per attempt.
func localUser() {
	var p localUserPlan
	if err := json.Unmarshal([]byte(os.Getenv(localUserEnv)), &p); err != nil {
		fmt.Println("plan:", err)
		os.Exit(2)
	}
	_, err := os.ReadFile(filepath.Join(p.Data, server.TokenFile))
	fmt.Println("token-read", err != nil && os.IsPermission(err))
	ctx := context.Background()
	var protos http.Protocols
	protos.SetUnencryptedHTTP2(true)
	c := deltagymv1connect.NewEnvServiceClient(&http.Client{Transport: &http.Transport{Protocols: &protos}}, "http://"+p.Addr)
	_, err = c.ImportImage(ctx, connect.NewRequest(&deltagymv1.ImportImageRequest{Name: "hostetc", Path: "/etc", Format: deltagymv1.ImageFormat_IMAGE_FORMAT_ROOTFS_DIR}))
	fmt.Println("import", connect.CodeOf(err))
	os.Setenv(deltagym.EnvData, p.Data)
	gc, err := deltagym.Dial(p.Addr, deltagym.WithRetry(1, 0))
	if err != nil {
		fmt.Println("client", err)
		return
	}
	defer gc.Close()
	_, err = gc.EnvService().ImportImage(ctx, connect.NewRequest(&deltagymv1.ImportImageRequest{Name: "hostetc", Path: "/etc"}))
	fmt.Println("client", connect.CodeOf(err))
}

// The reproduction of the host-file read: an unprivileged local user (uid 65534) cannot read
// the server's token, and without it cannot import /etc as an image; nothing is imported.
func TestImportAsLocalUser(t *testing.T) {
	b := setup(t, func(c *server.Config) { c.NoLedger = true })
	// Let the user reach the token file's own mode: the data directory is open to all.
	must(t, os.Chmod(b.data, 0o755))
	dir, err := os.MkdirTemp("", "dglocaluser")
	must(t, err)
	defer os.RemoveAll(dir)
	must(t, os.Chmod(dir, 0o755))
	bin := filepath.Join(dir, "server.test")
	self, err := os.Open(os.Args[0])
	must(t, err)
	out, err := os.OpenFile(bin, os.O_CREATE|os.O_WRONLY, 0o755)
	must(t, err)
	_, err = io.Copy(out, self)
	self.Close()
	must(t, err)
	must(t, out.Close())
	plan, _ := json.Marshal(localUserPlan{Addr: b.addr, Data: b.data})
	cmd := exec.CommandContext(t.Context(), bin)
	cmd.Dir = dir
	cmd.Env = []string{localUserEnv + "=" + string(plan), "HOME=" + dir, "PATH=/usr/bin:/bin"}
	cmd.SysProcAttr = &syscall.SysProcAttr{Credential: &syscall.Credential{Uid: 65534, Gid: 65534}}
	got, err := cmd.CombinedOutput()
	if err != nil {
		t.Fatalf("local user: %v\n%s", err, got)
	}
	want := "token-read true\nimport unauthenticated\nclient unauthenticated\n"
	if string(got) != want {
		t.Fatalf("local user saw:\n%s\nwant:\n%s", got, want)
	}
	images(t, b, "default")
	canary(t, b)
}

// images checks the images the server has, by name.
func images(t *testing.T, b *bundle, want ...string) {
	t.Helper()
	var got []string
	for _, im := range b.srv.Runtime().Images() {
		got = append(got, im.Name)
	}
	slices.Sort(got)
	slices.Sort(want)
	if !slices.Equal(got, want) {
		t.Fatalf("images %v, want %v", got, want)
	}
}

// canary checks that the server still runs a step in a fresh sandbox.
func canary(t *testing.T, b *bundle) {
	t.Helper()
	r, err := b.grpc.Reset(t.Context(), &deltagymv1.ResetRequest{Env: "plain"})
	must(t, err)
	defer b.grpc.Close(t.Context(), &deltagymv1.CloseRequest{SandboxId: r.GetSandboxId()})
	st, err := b.grpc.Step(t.Context(), &deltagymv1.StepRequest{SandboxId: r.GetSandboxId(), Action: execAction("cat /tmp/plain")})
	must(t, err)
	if got := stdout(t, st); got != "plain\n" {
		t.Fatalf("canary step: %q", got)
	}
}

// quotedPath is the path an import error echoes (host paths in it scrubbed).
var quotedPath = regexp.MustCompile(`image path "(?:[^"\\]|\\.)*"`)

// With the token, ImportImage reads only below the import root: every other path, by any
// route, gets the same refusal whether or not it exists, and nothing is imported.
func TestImportOutsideRoot(t *testing.T) {
	root := t.TempDir()
	b := setup(t, func(c *server.Config) { c.NoLedger = true; c.Import.Root = root })
	must(t, os.Symlink("/etc", filepath.Join(root, "abs-link")))
	must(t, os.Symlink("../../../../../../../../etc", filepath.Join(root, "rel-link")))
	must(t, os.Mkdir(filepath.Join(root, "d"), 0o755))
	must(t, os.Symlink("../../../../../../../../../", filepath.Join(root, "d", "up")))
	must(t, os.Symlink("/proc/self/root/etc", filepath.Join(root, "magic")))
	paths := []string{
		"/etc", "/nonexistent-deltagym-path", "/root", "/etc/shadow", "/", "..", "../..", "../../etc",
		"../nonexistent-deltagym-path", "d/../../etc", root + "/../etc", root + "/../nonexistent-deltagym-path",
		"abs-link", "abs-link/ssl", "rel-link", "d/up/etc", "d/up/nonexistent-deltagym-path", "magic", "/proc/self/root/etc",
		"a\x00b",
	}
	for _, c := range b.clients() {
		t.Run(c.name, func(t *testing.T) {
			var shape string
			for _, p := range paths {
				for _, format := range []deltagymv1.ImageFormat{deltagymv1.ImageFormat_IMAGE_FORMAT_UNSPECIFIED, deltagymv1.ImageFormat_IMAGE_FORMAT_ROOTFS_DIR} {
					_, err := c.c.ImportImage(t.Context(), &deltagymv1.ImportImageRequest{Name: "host", Path: p, Format: format})
					if codeOf(err) != connect.CodeInvalidArgument {
						t.Fatalf("ImportImage %q: %v, want invalid_argument", p, err)
					}
					// One message for all, but for the path it echoes.
					msg := quotedPath.ReplaceAllString(err.Error(), "image path PATH")
					if shape == "" {
						shape = msg
					}
					if msg != shape {
						t.Fatalf("ImportImage %q says %q; %q says %q: the answers differ", p, msg, paths[0], shape)
					}
					if strings.Contains(msg, root) {
						t.Fatalf("the refusal shows the import root's host path: %s", msg)
					}
				}
			}
			if !strings.Contains(shape, "import root") {
				t.Fatalf("refusal %q does not say where images may come from", shape)
			}
		})
	}
	images(t, b, "default")
	canary(t, b)
}

// Below the root, an image imports by a relative or an absolute path and through symlinks that
// stay inside; a symlink in the imported tree stays a symlink of the image, so a sandbox that
// follows it lands in its own files, never the host's.
func TestImportInsideRoot(t *testing.T) {
	root := t.TempDir()
	b := setup(t, func(c *server.Config) { c.NoLedger = true; c.Import.Root = root })
	img := filepath.Join(root, "images", "bb")
	must(t, os.MkdirAll(filepath.Dir(img), 0o755))
	if out, err := exec.Command("cp", "-a", b.busybox, img).CombinedOutput(); err != nil {
		t.Fatalf("copying the busybox rootfs: %v\n%s", err, out)
	}
	must(t, os.Symlink("/etc/shadow", filepath.Join(img, "leak")))
	must(t, os.WriteFile(filepath.Join(img, "etc", "marker"), []byte("inside\n"), 0o644))
	must(t, os.Symlink("images/bb", filepath.Join(root, "bb-link")))
	ctx := t.Context()
	for name, p := range map[string]string{"bb-rel": "images/bb", "bb-abs": img, "bb-link": "bb-link", "bb-dots": "images/../images/bb"} {
		res, err := b.grpc.ImportImage(ctx, &deltagymv1.ImportImageRequest{Name: name, Path: p, Format: deltagymv1.ImageFormat_IMAGE_FORMAT_ROOTFS_DIR})
		if err != nil {
			t.Fatalf("ImportImage %s from %q: %v", name, p, err)
		}
		if !strings.HasPrefix(res.GetDigest(), "sha256:") {
			t.Fatalf("ImportImage %s: %v", name, res)
		}
	}
	_, err := b.grpc.RegisterEnv(ctx, &deltagymv1.RegisterEnvRequest{Spec: &deltagymv1.EnvSpec{Name: "bb", Image: "bb-rel", PoolSize: 1}})
	must(t, err)
	r, err := b.grpc.Reset(ctx, &deltagymv1.ResetRequest{Env: "bb"})
	must(t, err)
	defer b.grpc.Close(ctx, &deltagymv1.CloseRequest{SandboxId: r.GetSandboxId()})
	st, err := b.grpc.Step(ctx, &deltagymv1.StepRequest{SandboxId: r.GetSandboxId(), Action: execAction("cat /etc/marker; readlink /leak; cat /leak 2>&1 || true")})
	must(t, err)
	host, _ := os.ReadFile("/etc/shadow")
	out := stdout(t, st)
	if !strings.HasPrefix(out, "inside\n/etc/shadow\n") || len(host) > 0 && strings.Contains(out, strings.SplitN(string(host), "\n", 2)[0]) {
		t.Fatalf("sandbox of the imported image: %q", out)
	}
	rf, err := b.grpc.Step(ctx, &deltagymv1.StepRequest{SandboxId: r.GetSandboxId(),
		Action: &deltagymv1.Action{Kind: &deltagymv1.Action_ReadFile{ReadFile: &deltagymv1.ReadFileAction{Path: "/leak"}}}})
	if err == nil && len(host) > 0 && strings.Contains(string(rf.GetObservation().GetReadFile().GetContent()), strings.SplitN(string(host), "\n", 2)[0]) {
		t.Fatal("read_file through the image's symlink reached the host's /etc/shadow")
	}
}

// An import that would write more than --import-max-bytes is refused with ResourceExhausted
// and leaves nothing behind; one under the cap imports.
func TestImportSizeCap(t *testing.T) {
	root := t.TempDir()
	b := setup(t, func(c *server.Config) { c.NoLedger = true; c.Import.Root = root; c.Import.MaxBytes = 1 << 20 })
	for _, d := range []string{"big", "many", "small"} {
		must(t, os.Mkdir(filepath.Join(root, d), 0o755))
	}
	must(t, os.WriteFile(filepath.Join(root, "big", "blob"), make([]byte, 2<<20), 0o644))
	for i := range 3000 { // 3000 empty files: their entries alone pass the cap
		must(t, os.WriteFile(filepath.Join(root, "many", fmt.Sprint(i)), nil, 0o644))
	}
	must(t, os.WriteFile(filepath.Join(root, "small", "blob"), make([]byte, 100<<10), 0o644))
	for _, p := range []string{"big", "many"} {
		_, err := b.grpc.ImportImage(t.Context(), &deltagymv1.ImportImageRequest{Name: p, Path: p})
		if codeOf(err) != connect.CodeResourceExhausted || !strings.Contains(err.Error(), "1048576") {
			t.Fatalf("ImportImage %s over the cap: %v, want resource_exhausted naming the cap", p, err)
		}
	}
	images(t, b, "default")
	left, err := filepath.Glob(filepath.Join(b.data, "sandbox", "store", "images", ".import-*"))
	must(t, err)
	if len(left) > 0 {
		t.Fatalf("a refused import left %v", left)
	}
	if _, err := b.grpc.ImportImage(t.Context(), &deltagymv1.ImportImageRequest{Name: "small", Path: "small"}); err != nil {
		t.Fatalf("ImportImage under the cap: %v", err)
	}
	images(t, b, "default", "small")
	canary(t, b)
}
