package main

import (
	"context"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"testing"

	"golang.org/x/sys/unix"

	"github.com/deltagym/deltagym/internal/testenv"
	"github.com/deltagym/deltagym/sandbox"
	"github.com/deltagym/deltagym/sandbox/image"
)

// The test layout, imported by the project's own importer, is the image it was made from:
// contents, owners, modes, set-id bits, hard links, symlinks and xattrs, the top layer over
// the base.
func TestImportedByImporter(t *testing.T) {
	testenv.Privileged(t, "the importer gives entries their owners and xattrs")
	layout := buildLayout(t)
	dir := t.TempDir()
	imp, err := image.Import(t.Context(), layout, dir)
	if err != nil {
		t.Fatal(err)
	}
	if len(imp.Layers) != 2 || !slices.Equal(imp.Config.Entrypoint, []string{"/usr/local/bin/tool", "serve"}) {
		t.Fatalf("imported %d layers, entrypoint %q", len(imp.Layers), imp.Config.Entrypoint)
	}
	base, top := imp.Layers[0], imp.Layers[1]
	var b, hard, suid unix.Stat_t
	for p, st := range map[string]*unix.Stat_t{"a/b.txt": &b, "a/hard": &hard, "suid": &suid} {
		if err := unix.Lstat(filepath.Join(base, p), st); err != nil {
			t.Fatal(err)
		}
	}
	if b.Ino != hard.Ino {
		t.Error("a/hard is not a hard link of a/b.txt")
	}
	if suid.Mode&0o7777 != 0o4755 {
		t.Errorf("suid has mode %o", suid.Mode&0o7777)
	}
	if target, err := os.Readlink(filepath.Join(base, "link")); err != nil || target != "a/b.txt" {
		t.Errorf("link -> %q, %v", target, err)
	}
	buf := make([]byte, 16)
	if n, err := unix.Lgetxattr(filepath.Join(base, "a.txt"), "user.deltagym", buf); err == nil && string(buf[:n]) != "kept" {
		t.Errorf("a.txt's xattr user.deltagym is %q", buf[:n])
	}
	if _, err := os.Stat(filepath.Join(base, "excluded.txt")); !os.IsNotExist(err) {
		t.Errorf("excluded.txt was imported: %v", err)
	}
	var tool unix.Stat_t
	if err := unix.Lstat(filepath.Join(top, "usr/local/bin/tool"), &tool); err != nil || tool.Uid != 0 || tool.Mode&0o777 != 0o755 {
		t.Errorf("the top layer's tool: %v, owner %d, mode %o", err, tool.Uid, tool.Mode&0o777)
	}
}

// nodeLayout returns the layout `make node-image` built, or skips.
func nodeLayout(t *testing.T) string {
	t.Helper()
	out, err := exec.Command("go", "env", "GOMOD").Output()
	if err != nil {
		t.Fatal(err)
	}
	layout := filepath.Join(filepath.Dir(strings.TrimSpace(string(out))), ".data", "images", "node", "oci")
	if _, err := os.Stat(filepath.Join(layout, "index.json")); err != nil {
		t.Skipf("the node image is not built (make node-image): %v", err)
	}
	return layout
}

// flagValue returns the value of --name in args, or "".
func flagValue(args []string, name string) string {
	for i, a := range args {
		if a == "--"+name && i+1 < len(args) {
			return args[i+1]
		}
		if v, ok := strings.CutPrefix(a, "--"+name+"="); ok {
			return v
		}
	}
	return ""
}

// The node image as `make node-image` built it: a valid layout tagged VERSION, with the
// entrypoint and config a container of a node needs; imported by the sandbox runtime, a sandbox
// of it runs the server binary, which says VERSION, the CRIU and PostgreSQL the entrypoint
// names, at their place in the image, and has every file the entrypoint names.
func TestNodeImage(t *testing.T) {
	testenv.Privileged(t, "a sandbox of the node image runs its programs")
	layout := nodeLayout(t)
	b, err := os.ReadFile("../../VERSION")
	if err != nil {
		t.Fatal(err)
	}
	version := strings.TrimSpace(string(b))
	imgs, err := checkLayout(layout)
	if err != nil {
		t.Fatal(err)
	}
	if len(imgs) != 1 || imgs[0].Tag != version {
		t.Fatalf("the layout holds %d images, the first tagged %q; want one tagged %s (make node-image again)", len(imgs), imgs[0].Tag, version)
	}
	c := imgs[0].Config.Config
	if _, ok := c.ExposedPorts["8080/tcp"]; !ok || c.Labels["org.opencontainers.image.version"] != version || c.WorkingDir == "" ||
		!slices.ContainsFunc(c.Env, func(e string) bool { return strings.HasPrefix(e, "PATH=") }) {
		t.Errorf("config: ports %v, labels %v, workdir %q, env %q", c.ExposedPorts, c.Labels, c.WorkingDir, c.Env)
	}
	ep := c.Entrypoint
	if len(ep) < 2 || ep[0] != "/usr/local/bin/deltagym" || ep[1] != "serve" || flagValue(ep, "addr") != "0.0.0.0:8080" || flagValue(ep, "data") != "/var/lib/deltagym" {
		t.Fatalf("entrypoint %q: want /usr/local/bin/deltagym serve --addr 0.0.0.0:8080 --data /var/lib/deltagym ...", ep)
	}

	s := nodeSandbox(t, layout)
	sh := func(cmd string) string {
		t.Helper()
		res, err := s.Exec(t.Context(), sandbox.ExecRequest{Command: cmd})
		if err != nil {
			t.Fatalf("%s: %v", cmd, err)
		}
		if res.ExitCode != 0 {
			t.Fatalf("%s: exit %d\nstdout: %s\nstderr: %s", cmd, res.ExitCode, res.Stdout, res.Stderr)
		}
		t.Logf("%s: %s%s", cmd, res.Stdout, res.Stderr)
		return string(res.Stdout) + string(res.Stderr)
	}
	if got := sh(ep[0] + " version"); got != "deltagym "+version+"\n" {
		t.Errorf("%s version printed %q, want deltagym %s", ep[0], got, version)
	}
	criu := flagValue(ep, "criu")
	checkCRIU(t, sh(criu+" --version"))
	pg := flagValue(ep, "postgres-bin")
	for _, p := range []string{"postgres", "initdb"} {
		if got := sh(pg + "/" + p + " --version"); !strings.Contains(got, "(PostgreSQL) 17.") {
			t.Errorf("%s/%s --version printed %q, want PostgreSQL 17", pg, p, got)
		}
	}
	// The private Postgres runs as the system user postgres, and its relocated initdb finds
	// what it needs (its share directory, the postgres binary beside it, the zoneinfo) there.
	if got := sh("id -u postgres"); got == "0\n" {
		t.Errorf("id -u postgres = %q", got)
	}
	sh("mkdir -m 0700 /tmp/pg && chown postgres:postgres /tmp/pg && " +
		"setpriv --reuid=postgres --regid=postgres --clear-groups " + pg + "/initdb -D /tmp/pg -U postgres -A trust -E UTF8 --locale=C >/dev/null")
	if got := sh("cat /tmp/pg/PG_VERSION"); got != "17\n" {
		t.Errorf("initdb made a cluster of version %q, want 17", got)
	}
	checks := []string{"test -x " + ep[0]}
	for _, f := range []struct{ flag, test string }{
		{"init", "-x"}, {"criu", "-x"}, {"envs", "-f"}, {"default-image", "-x"},
	} {
		v := flagValue(ep, f.flag)
		if v == "" {
			t.Errorf("the entrypoint has no --%s", f.flag)
			continue
		}
		if f.flag == "envs" {
			v += "/shell.json" // the default env
		}
		if f.flag == "default-image" {
			v += "/usr/bin/python3"
		}
		checks = append(checks, "test "+f.test+" "+v)
	}
	for _, d := range filepath.SplitList(pg) {
		checks = append(checks, "test -x "+d+"/postgres", "test -x "+d+"/initdb")
	}
	for _, c := range checks {
		sh(c)
	}
}

// checkCRIU fails t unless out is what criu --version prints for 4.2.1 or later.
func checkCRIU(t *testing.T, out string) {
	t.Helper()
	m := regexp.MustCompile(`Version: (\d+)\.(\d+)(?:\.(\d+))?`).FindStringSubmatch(out)
	if m == nil {
		t.Fatalf("criu --version printed %q, no version", out)
	}
	var v [3]int
	for i := range v {
		v[i], _ = strconv.Atoi(m[i+1])
	}
	if slices.Compare(v[:], []int{4, 2, 1}) < 0 {
		t.Errorf("the image's CRIU is %d.%d.%d, older than 4.2.1", v[0], v[1], v[2])
	}
}

// nodeSandbox imports the layout into a sandbox runtime of its own and returns a sandbox of it.
func nodeSandbox(t *testing.T, layout string) *sandbox.Sandbox {
	t.Helper()
	dir := t.TempDir()
	cfg := sandbox.Config{DataDir: filepath.Join(dir, "data"), InitBinary: testenv.Init(t), CgroupRoot: fmt.Sprintf("dgtest-ocilayout-%d", os.Getpid())}
	rt, err := sandbox.New(t.Context(), cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		if err := rt.Close(context.Background()); err != nil {
			t.Errorf("closing the runtime: %v", err)
		}
		if err := sandbox.Purge(cfg.DataDir); err != nil {
			t.Errorf("purging the data directory: %v", err)
		}
		// The runtime's empty cgroup roots, in each hierarchy it may have used.
		for _, h := range []string{"unified", "memory", "pids", "cpu", "freezer"} {
			_ = os.Remove(filepath.Join("/sys/fs/cgroup", h, cfg.CgroupRoot))
		}
	})
	if _, err := rt.ImportImage(t.Context(), "node", layout); err != nil {
		t.Fatal(err)
	}
	s, err := rt.Create(t.Context(), sandbox.Spec{Image: "node"})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = s.Destroy(context.Background()) })
	return s
}
