package main

import (
	"archive/tar"
	"bytes"
	"compress/gzip"
	"encoding/json"
	"errors"
	"io"
	"net"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	"golang.org/x/sys/unix"
)

var testEpoch = time.Unix(1_700_000_000, 0)

// longDir is a directory name that makes its entries' names longer than a ustar header holds.
var longDir = strings.Repeat("d", 120)

// makeTree writes the test tree into dir, returns dir and whether the tree carries the xattr
// user.deltagym (the file system may refuse user xattrs). Files written now are newer than
// testEpoch; a/b.txt is older.
func makeTree(t *testing.T, dir string) (string, bool) {
	t.Helper()
	must := func(err error) {
		t.Helper()
		if err != nil {
			t.Fatal(err)
		}
	}
	write := func(name, data string, mode os.FileMode) {
		t.Helper()
		p := filepath.Join(dir, name)
		must(os.MkdirAll(filepath.Dir(p), 0o755))
		must(os.WriteFile(p, []byte(data), mode))
		must(os.Chmod(p, mode))
	}
	write("a/b.txt", "hello", 0o644)
	write("a/exec.sh", "#!/bin/sh\necho hi\n", 0o755)
	write("a.txt", "newer than the epoch", 0o600)
	write("excluded.txt", "left out", 0o644)
	write(longDir+"/file", "long name", 0o644)
	write("suid", "set-id", 0o644)
	must(unix.Chmod(filepath.Join(dir, "suid"), 0o4755)) // os.Chmod spells set-uid otherwise
	must(os.Mkdir(filepath.Join(dir, "empty"), 0o700))
	must(os.Link(filepath.Join(dir, "a/b.txt"), filepath.Join(dir, "a/hard")))
	must(os.Symlink("a/b.txt", filepath.Join(dir, "link")))
	must(unix.Mkfifo(filepath.Join(dir, "fifo"), 0o640))
	old := testEpoch.Add(-1000 * time.Second)
	must(os.Chtimes(filepath.Join(dir, "a/b.txt"), old, old))
	xattr := unix.Lsetxattr(filepath.Join(dir, "a.txt"), "user.deltagym", []byte("kept"), 0) == nil
	return dir, xattr
}

// testTrees maps the test tree at / with a single file and a directory mapped below
// directories it does not have.
func testTrees(t *testing.T, root string) []mapping {
	t.Helper()
	extra := t.TempDir()
	if err := os.WriteFile(filepath.Join(extra, "x"), []byte("mapped file"), 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.MkdirAll(filepath.Join(extra, "z"), 0o750); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(extra, "z", "inner"), []byte("inner"), 0o644); err != nil {
		t.Fatal(err)
	}
	return []mapping{
		{dest: "/", src: root},
		{dest: "/opt/x", src: filepath.Join(extra, "x")},
		{dest: "/usr/share/y/z", src: filepath.Join(extra, "z")},
	}
}

func testOptions() treeOptions {
	return treeOptions{epoch: testEpoch, exclude: map[string]bool{"/excluded.txt": true}}
}

// readLayer returns the entries of a layer blob, in order, with their contents.
func readLayer(t *testing.T, layout string, d layerDesc) ([]*tar.Header, map[string]string) {
	t.Helper()
	name, err := blobPath(layout, d.Digest)
	if err != nil {
		t.Fatal(err)
	}
	f, err := os.Open(name)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	gz, err := gzip.NewReader(f)
	if err != nil {
		t.Fatal(err)
	}
	tr := tar.NewReader(gz)
	var hdrs []*tar.Header
	data := map[string]string{}
	for {
		h, err := tr.Next()
		if errors.Is(err, io.EOF) {
			return hdrs, data
		}
		if err != nil {
			t.Fatal(err)
		}
		b, err := io.ReadAll(tr)
		if err != nil {
			t.Fatal(err)
		}
		hdrs = append(hdrs, h)
		data[h.Name] = string(b)
	}
}

// Two builds of the same tree, made at different times with different inodes, give the same
// layer, byte for byte; a change of contents or of a mode gives another.
func TestLayerReproducible(t *testing.T) {
	t.Parallel()
	build := func(layout string) layerDesc {
		t.Helper()
		root, _ := makeTree(t, t.TempDir())
		d, err := writeLayer(layout, testTrees(t, root), testOptions())
		if err != nil {
			t.Fatal(err)
		}
		return d
	}
	first := build(t.TempDir())
	// The second tree's files are written later: their times differ, but are past the epoch.
	layout := t.TempDir()
	second := build(layout)
	if first != second {
		t.Fatalf("two builds of one tree: %+v and %+v", first, second)
	}

	root, _ := makeTree(t, t.TempDir())
	for _, change := range []struct {
		name string
		do   func() error
	}{
		{"contents", func() error {
			return os.WriteFile(filepath.Join(root, "a/exec.sh"), []byte("#!/bin/sh\necho ho\n"), 0o755)
		}},
		{"mode", func() error { return os.Chmod(filepath.Join(root, "a/exec.sh"), 0o700) }},
		{"an older time", func() error {
			return os.Chtimes(filepath.Join(root, "a/exec.sh"), testEpoch.Add(-time.Hour), testEpoch.Add(-time.Hour))
		}},
	} {
		if err := change.do(); err != nil {
			t.Fatal(err)
		}
		d, err := writeLayer(layout, testTrees(t, root), testOptions())
		if err != nil {
			t.Fatal(err)
		}
		if d.Digest == first.Digest || d.DiffID == first.DiffID {
			t.Errorf("a change of %s left the layer %s", change.name, d.Digest)
		}
	}
}

// The entries of a layer: sorted depth first by name, directories made for the trees mapped
// below them, numeric owners, clamped times, hard links, symlinks, fifos, set-id bits, long
// names and xattrs kept; the excluded path left out.
func TestLayerEntries(t *testing.T) {
	t.Parallel()
	root, xattr := makeTree(t, t.TempDir())
	layout := t.TempDir()
	d, err := writeLayer(layout, testTrees(t, root), testOptions())
	if err != nil {
		t.Fatal(err)
	}
	if d.MediaType != mediaTypeLayerGzip {
		t.Errorf("media type %q", d.MediaType)
	}
	hdrs, data := readLayer(t, layout, d)
	var names []string
	byName := map[string]*tar.Header{}
	for _, h := range hdrs {
		names = append(names, h.Name)
		byName[h.Name] = h
	}
	want := []string{
		"a/", "a/b.txt", "a/exec.sh", "a/hard", "a.txt", longDir + "/", longDir + "/file", "empty/", "fifo", "link",
		"opt/", "opt/x", "suid", "usr/", "usr/share/", "usr/share/y/", "usr/share/y/z/", "usr/share/y/z/inner",
	}
	if !slices.Equal(names, want) {
		t.Fatalf("entries\n%q\nwant\n%q", names, want)
	}
	uid, gid := os.Getuid(), os.Getgid()
	for _, h := range hdrs {
		if h.Uname != "" || h.Gname != "" || !h.AccessTime.IsZero() || !h.ChangeTime.IsZero() || h.ModTime.After(testEpoch) {
			t.Errorf("%s: uname %q gname %q atime %v ctime %v mtime %v", h.Name, h.Uname, h.Gname, h.AccessTime, h.ChangeTime, h.ModTime)
		}
		made := slices.Contains([]string{"opt/", "usr/", "usr/share/", "usr/share/y/"}, h.Name)
		if made && (h.Uid != 0 || h.Gid != 0 || h.Mode != 0o755 || h.Typeflag != tar.TypeDir) {
			t.Errorf("%s, made for a tree below it: %d:%d mode %o type %c", h.Name, h.Uid, h.Gid, h.Mode, h.Typeflag)
		}
		if !made && (h.Uid != uid || h.Gid != gid) {
			t.Errorf("%s: owner %d:%d, want the file's %d:%d", h.Name, h.Uid, h.Gid, uid, gid)
		}
	}
	checks := []struct {
		name string
		ok   bool
	}{
		{"a/b.txt keeps its older time", byName["a/b.txt"].ModTime.Equal(testEpoch.Add(-1000*time.Second)) && data["a/b.txt"] == "hello"},
		{"a.txt is clamped to the epoch", byName["a.txt"].ModTime.Equal(testEpoch) && byName["a.txt"].Mode == 0o600},
		{"a/hard links to a/b.txt", byName["a/hard"].Typeflag == tar.TypeLink && byName["a/hard"].Linkname == "a/b.txt"},
		{"link is a symlink", byName["link"].Typeflag == tar.TypeSymlink && byName["link"].Linkname == "a/b.txt"},
		{"fifo is a fifo", byName["fifo"].Typeflag == tar.TypeFifo && byName["fifo"].Mode == 0o640},
		{"suid keeps its set-uid bit", byName["suid"].Mode == 0o4755},
		{"empty keeps its mode", byName["empty/"].Mode == 0o700},
		{"the long name is whole", data[longDir+"/file"] == "long name"},
		{"opt/x is the mapped file", data["opt/x"] == "mapped file" && byName["opt/x"].Mode == 0o755},
		{"usr/share/y/z is the mapped directory", byName["usr/share/y/z/"].Mode == 0o750 && data["usr/share/y/z/inner"] == "inner"},
		{"a.txt keeps its xattr", !xattr || byName["a.txt"].PAXRecords[paxXattr+"user.deltagym"] == "kept"},
	}
	for _, c := range checks {
		if !c.ok {
			t.Errorf("%s: no", c.name)
		}
	}

	// -chown owns everything by one user.
	opts := testOptions()
	opts.chown = &[2]int{0, 0}
	d, err = writeLayer(layout, testTrees(t, root), opts)
	if err != nil {
		t.Fatal(err)
	}
	hdrs, _ = readLayer(t, layout, d)
	for _, h := range hdrs {
		if h.Uid != 0 || h.Gid != 0 {
			t.Errorf("with -chown 0:0, %s is owned by %d:%d", h.Name, h.Uid, h.Gid)
		}
	}
}

// Trees that cannot make a layer are refused, and the layout keeps no partial blob.
func TestLayerRefused(t *testing.T) {
	t.Parallel()
	file := filepath.Join(t.TempDir(), "file")
	if err := os.WriteFile(file, []byte("x"), 0o644); err != nil {
		t.Fatal(err)
	}
	sockDir := t.TempDir()
	ln, err := net.Listen("unix", filepath.Join(sockDir, "sock"))
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	for _, tc := range []struct {
		name  string
		trees []mapping
		want  string
	}{
		{"a tree below a file", []mapping{{"/f", file}, {"/f/g", file}}, "non-directory"},
		{"two trees at one path", []mapping{{"/f", file}, {"/f", file}}, "two trees at /f"},
		{"a file at /", []mapping{{"/", file}}, "not a directory"},
		{"a socket", []mapping{{"/s", sockDir}}, "socket"},
		{"a missing source", []mapping{{"/m", filepath.Join(sockDir, "missing")}}, "no such file"},
	} {
		layout := t.TempDir()
		_, err := writeLayer(layout, tc.trees, testOptions())
		if err == nil || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("%s: %v, want an error saying %q", tc.name, err, tc.want)
		}
		if left, _ := os.ReadDir(blobsDir(layout)); len(left) != 0 {
			t.Errorf("%s: the layout keeps %d files", tc.name, len(left))
		}
	}
	for _, bad := range []string{"noequals", "relative=/x", "=/x", "/x="} {
		if _, err := parseMapping(bad); err == nil {
			t.Errorf("parseMapping(%q) = nil error", bad)
		}
	}
}

// buildLayout writes a two-layer image of the test tree through the commands, as make does,
// and returns the layout.
func buildLayout(t *testing.T) string {
	t.Helper()
	root, _ := makeTree(t, t.TempDir())
	layout, work := t.TempDir(), t.TempDir()
	t.Setenv("SOURCE_DATE_EPOCH", "1700000000")
	steps := [][]string{
		{"layer", "-layout", layout, "-o", filepath.Join(work, "base.json"), "-exclude", "/excluded.txt", "/=" + root},
		{"layer", "-layout", layout, "-o", filepath.Join(work, "top.json"), "-chown", "0:0", "/usr/local/bin/tool=" + filepath.Join(root, "a/exec.sh")},
		{"image", "-layout", layout, "-tag", "1.2.3", "-layer", filepath.Join(work, "base.json"), "-layer", filepath.Join(work, "top.json"),
			"-entrypoint", "/usr/local/bin/tool", "-entrypoint", "serve", "-cmd", "--flag", "-env", "PATH=/usr/bin:/bin",
			"-workdir", "/", "-port", "8080/tcp", "-label", "org.opencontainers.image.version=1.2.3"},
	}
	for _, args := range steps {
		if err := run(args, io.Discard); err != nil {
			t.Fatalf("ocilayout %s: %v", strings.Join(args, " "), err)
		}
	}
	return layout
}

// A layout as make writes it checks out: one image tagged in index.json, its config as given,
// every digest and size right; built again it is the same image, and blobs of earlier builds
// are deleted.
func TestImageLayout(t *testing.T) {
	layout := buildLayout(t)
	imgs, err := checkLayout(layout)
	if err != nil {
		t.Fatal(err)
	}
	if len(imgs) != 1 {
		t.Fatalf("%d images", len(imgs))
	}
	img := imgs[0]
	c := img.Config.Config
	switch {
	case img.Tag != "1.2.3":
		t.Errorf("tag %q", img.Tag)
	case !slices.Equal(c.Entrypoint, []string{"/usr/local/bin/tool", "serve"}) || !slices.Equal(c.Cmd, []string{"--flag"}):
		t.Errorf("entrypoint %q cmd %q", c.Entrypoint, c.Cmd)
	case !slices.Equal(c.Env, []string{"PATH=/usr/bin:/bin"}) || c.WorkingDir != "/":
		t.Errorf("env %q workdir %q", c.Env, c.WorkingDir)
	case len(c.ExposedPorts) != 1 || c.Labels["org.opencontainers.image.version"] != "1.2.3":
		t.Errorf("ports %v labels %v", c.ExposedPorts, c.Labels)
	case img.Config.Created != "2023-11-14T22:13:20Z" || img.Config.OS != "linux":
		t.Errorf("created %q os %q", img.Config.Created, img.Config.OS)
	case len(img.Layers) != 2 || img.Layers[0].MediaType != mediaTypeLayerGzip || img.Layers[1].MediaType != mediaTypeLayerGzip:
		t.Errorf("layers %+v", img.Layers)
	}

	stray := filepath.Join(blobsDir(layout), strings.Repeat("0", 64))
	if err := os.WriteFile(stray, []byte("an earlier build's layer"), 0o644); err != nil {
		t.Fatal(err)
	}
	var spec imageSpec
	spec.tag, spec.created, spec.config = img.Tag, testEpoch, c
	for i, l := range img.Layers {
		spec.layers = append(spec.layers, layerDesc{MediaType: l.MediaType, Digest: l.Digest, Size: l.Size, DiffID: img.Config.RootFS.DiffIDs[i]})
	}
	md, err := writeImage(layout, spec)
	if err != nil {
		t.Fatal(err)
	}
	if md.Digest != img.Manifest.Digest {
		t.Errorf("the same image written again has manifest %s, was %s", md.Digest, img.Manifest.Digest)
	}
	if _, err := os.Stat(stray); !errors.Is(err, os.ErrNotExist) {
		t.Errorf("an unreferenced blob is still there: %v", err)
	}
	left, _ := os.ReadDir(blobsDir(layout))
	if len(left) != 4 {
		t.Errorf("%d blobs, want 4 (config, manifest, two layers)", len(left))
	}
	if err := run([]string{"check", layout}, io.Discard); err != nil {
		t.Error(err)
	}
}

// A layout whose blobs or descriptors do not match fails the check, saying where.
func TestImageLayoutDamaged(t *testing.T) {
	for _, tc := range []struct {
		name   string
		damage func(t *testing.T, layout string, img checkedImage)
		want   string
	}{
		{"a layer's byte", func(t *testing.T, layout string, img checkedImage) {
			flipByte(t, layout, img.Layers[1].Digest, 100)
		}, "layer 1"},
		{"the config's byte", func(t *testing.T, layout string, img checkedImage) {
			var m manifest
			readBlobJSON(t, layout, img.Manifest.Digest, &m)
			flipByte(t, layout, m.Config.Digest, 3)
		}, "hashes to"},
		{"index.json's media type", func(t *testing.T, layout string, img checkedImage) {
			rewriteJSON(t, filepath.Join(layout, "index.json"), func(m map[string]any) {
				m["manifests"].([]any)[0].(map[string]any)["mediaType"] = mediaTypeConfig
			})
		}, "media type"},
		{"a manifest's size", func(t *testing.T, layout string, img checkedImage) {
			rewriteJSON(t, filepath.Join(layout, "index.json"), func(m map[string]any) {
				m["manifests"].([]any)[0].(map[string]any)["size"] = 1
			})
		}, "descriptor says 1"},
		{"oci-layout", func(t *testing.T, layout string, img checkedImage) {
			if err := os.WriteFile(filepath.Join(layout, "oci-layout"), []byte(`{"imageLayoutVersion":"2.0.0"}`), 0o644); err != nil {
				t.Fatal(err)
			}
		}, "version"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			layout := buildLayout(t)
			imgs, err := checkLayout(layout)
			if err != nil {
				t.Fatal(err)
			}
			tc.damage(t, layout, imgs[0])
			if _, err := checkLayout(layout); err == nil || !strings.Contains(err.Error(), tc.want) {
				t.Fatalf("check of a damaged layout: %v, want an error saying %q", err, tc.want)
			}
		})
	}
}

func flipByte(t *testing.T, layout, digest string, at int64) {
	t.Helper()
	name, err := blobPath(layout, digest)
	if err != nil {
		t.Fatal(err)
	}
	b, err := os.ReadFile(name)
	if err != nil {
		t.Fatal(err)
	}
	b[at] ^= 0xff
	if err := os.WriteFile(name, b, 0o644); err != nil {
		t.Fatal(err)
	}
}

func readBlobJSON(t *testing.T, layout, digest string, v any) {
	t.Helper()
	name, err := blobPath(layout, digest)
	if err != nil {
		t.Fatal(err)
	}
	b, err := os.ReadFile(name)
	if err != nil {
		t.Fatal(err)
	}
	if err := json.Unmarshal(b, v); err != nil {
		t.Fatal(err)
	}
}

func rewriteJSON(t *testing.T, name string, edit func(map[string]any)) {
	t.Helper()
	b, err := os.ReadFile(name)
	if err != nil {
		t.Fatal(err)
	}
	var m map[string]any
	if err := json.NewDecoder(bytes.NewReader(b)).Decode(&m); err != nil {
		t.Fatal(err)
	}
	edit(m)
	if b, err = json.Marshal(m); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(name, b, 0o644); err != nil {
		t.Fatal(err)
	}
}
