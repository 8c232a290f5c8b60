package imagetest_test

import (
	"archive/tar"
	"bytes"
	"encoding/json"
	"errors"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"testing"

	"github.com/deltagym/deltagym/internal/testenv"
	"github.com/deltagym/deltagym/sandbox/image/imagetest"
)

// TestBusybox runs the busybox rootfs's shell chrooted into it.
func TestBusybox(t *testing.T) {
	testenv.Privileged(t, "chroot")
	root := imagetest.Busybox(t)
	for _, applet := range []string{"sh", "ls", "cat", "echo", "sleep", "true", "false", "mkdir", "rm", "mv",
		"ln", "chmod", "stat", "dd", "head", "tail", "wc", "id", "env", "kill", "ps", "setsid", "mount"} {
		if target, err := os.Readlink(filepath.Join(root, "bin", applet)); err != nil || target != "busybox" {
			t.Errorf("bin/%s -> %q (%v), want busybox", applet, target, err)
		}
	}
	cmd := exec.CommandContext(t.Context(), "/bin/sh", "-c", "id -u agent; id -g agent; stat -c '%u %a' /etc/passwd; echo $((6*7))")
	cmd.SysProcAttr = &syscall.SysProcAttr{Chroot: root}
	cmd.Dir = "/"
	cmd.Env = []string{"PATH=/bin"}
	out, err := cmd.CombinedOutput()
	if err != nil {
		t.Fatalf("running sh in the busybox rootfs: %v\n%s", err, out)
	}
	if got, want := string(out), "1000\n1000\n0 644\n42\n"; got != want {
		t.Errorf("output %q, want %q", got, want)
	}
	for _, d := range []string{"proc", "dev", "tmp", "etc", "root", "run", "sys", "home"} {
		if st, err := os.Stat(filepath.Join(root, d)); err != nil || !st.IsDir() {
			t.Errorf("%s is not a directory: %v", d, err)
		}
	}
}

// TestWriteOCILayout checks that the layout's index, manifest, config and blobs agree.
func TestWriteOCILayout(t *testing.T) {
	dir := t.TempDir()
	img := imagetest.WriteOCILayout(t, dir, imagetest.Config{Cmd: []string{"sh"}},
		imagetest.Layer{Entries: []imagetest.Entry{imagetest.File("a", "a", 0o644)}},
		imagetest.Layer{Entries: []imagetest.Entry{imagetest.Whiteout("a")}, Compression: imagetest.Gzip})
	var index struct {
		Manifests []struct{ Digest string } `json:"manifests"`
	}
	readJSON(t, filepath.Join(dir, "index.json"), &index)
	if len(index.Manifests) != 1 || index.Manifests[0].Digest != img.ManifestDigest {
		t.Fatalf("index.json manifests %+v, want %s", index.Manifests, img.ManifestDigest)
	}
	var m struct {
		Config struct{ Digest string }
		Layers []struct{ Digest, MediaType string }
	}
	readJSON(t, blobPath(dir, img.ManifestDigest), &m)
	if m.Config.Digest != img.ConfigDigest || len(m.Layers) != 2 || m.Layers[1].MediaType != "application/vnd.oci.image.layer.v1.tar+gzip" {
		t.Fatalf("manifest %+v does not match %+v", m, img)
	}
	for i, l := range m.Layers {
		if l.Digest != img.LayerDigests[i] {
			t.Errorf("layer %d digest %s, want %s", i, l.Digest, img.LayerDigests[i])
		}
		if _, err := os.Stat(blobPath(dir, l.Digest)); err != nil {
			t.Errorf("layer %d blob: %v", i, err)
		}
	}
	names := tarNames(t, mustRead(t, blobPath(dir, img.LayerDigests[0])))
	if strings.Join(names, ",") != "a" {
		t.Errorf("layer 0 holds %v, want [a]", names)
	}
}

// TestWriteDockerSave checks the classic docker save tarball's manifest against its members.
func TestWriteDockerSave(t *testing.T) {
	for _, write := range []func(testing.TB, string, imagetest.Config, ...imagetest.Layer) imagetest.Image{
		imagetest.WriteDockerSave, imagetest.WriteDockerSaveOCI,
	} {
		p := filepath.Join(t.TempDir(), "image.tar")
		write(t, p, imagetest.Config{}, imagetest.Layer{Entries: []imagetest.Entry{imagetest.File("a", "a", 0o644)}})
		members := map[string][]byte{}
		tr := tar.NewReader(bytes.NewReader(mustRead(t, p)))
		for {
			hdr, err := tr.Next()
			if errors.Is(err, io.EOF) {
				break
			}
			if err != nil {
				t.Fatal(err)
			}
			b, _ := io.ReadAll(tr)
			members[hdr.Name] = b
		}
		var manifest []struct {
			Config string
			Layers []string
		}
		if err := json.Unmarshal(members["manifest.json"], &manifest); err != nil || len(manifest) != 1 {
			t.Fatalf("manifest.json: %v %s", err, members["manifest.json"])
		}
		if _, ok := members[manifest[0].Config]; !ok {
			t.Errorf("config %s missing", manifest[0].Config)
		}
		for _, l := range manifest[0].Layers {
			if got := tarNames(t, members[l]); strings.Join(got, ",") != "a" {
				t.Errorf("layer %s holds %v, want [a]", l, got)
			}
		}
	}
}

func blobPath(dir, digest string) string {
	return filepath.Join(dir, "blobs", "sha256", strings.TrimPrefix(digest, "sha256:"))
}

func mustRead(t *testing.T, p string) []byte {
	t.Helper()
	b, err := os.ReadFile(p)
	if err != nil {
		t.Fatal(err)
	}
	return b
}

func readJSON(t *testing.T, p string, v any) {
	t.Helper()
	if err := json.Unmarshal(mustRead(t, p), v); err != nil {
		t.Fatalf("decoding %s: %v", p, err)
	}
}

func tarNames(t *testing.T, b []byte) []string {
	t.Helper()
	var names []string
	tr := tar.NewReader(bytes.NewReader(b))
	for {
		hdr, err := tr.Next()
		if errors.Is(err, io.EOF) {
			return names
		}
		if err != nil {
			t.Fatalf("reading tar: %v", err)
		}
		names = append(names, hdr.Name)
	}
}
