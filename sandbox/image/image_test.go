package image

import (
	"archive/tar"
	"bytes"
	"compress/gzip"
	"context"
	"errors"
	"io"
	"maps"
	"os"
	"os/exec"
	"path/filepath"
	"reflect"
	"slices"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/deltagym/deltagym/internal/testenv"
	"github.com/deltagym/deltagym/sandbox/image/imagetest"
	"golang.org/x/sys/unix"
)

func requireRoot(t *testing.T) {
	t.Helper()
	testenv.Privileged(t, "creates device nodes, sets owners and trusted.* xattrs, mounts overlayfs")
}

var testConfig = imagetest.Config{
	Env:        []string{"PATH=/usr/bin:/bin", "LANG=C.UTF-8"},
	WorkingDir: "/work",
	User:       "1000:1000",
	Entrypoint: []string{"/bin/sh", "-c"},
	Cmd:        []string{"echo hi"},
}

var mtime = time.Unix(1700000000, 0)

// twoLayers is an image whose top layer deletes etc/gone, makes d opaque and adds files.
func twoLayers(c0, c1 imagetest.Compression) []imagetest.Layer {
	owned := imagetest.File("home/agent/notes", "mine", 0o600)
	owned.UID, owned.GID = 1000, 1001
	keep := imagetest.File("etc/keep", "hello-unique-content", 0o644)
	keep.Xattrs = map[string]string{"user.test": "value", "trusted.overlay.redirect": "/evil"}
	return []imagetest.Layer{
		{Compression: c0, Entries: []imagetest.Entry{
			imagetest.Dir(".", 0o755),
			imagetest.Dir("etc", 0o755),
			imagetest.File("etc/gone", "to be deleted", 0o644),
			keep,
			imagetest.Hardlink("etc/keep2", "etc/keep"),
			imagetest.Dir("d", 0o750),
			imagetest.File("d/x", "x", 0o644),
			imagetest.Dir("d/sub", 0o755),
			imagetest.File("d/sub/y", "y", 0o644),
			imagetest.File("bin/tool", "#!/bin/sh\n", 0o4755),
			imagetest.Dir("tmp", 0o1777),
			owned,
			imagetest.Symlink("lnk", "/etc/keep"),
			imagetest.Fifo("run/fifo"),
			imagetest.CharDev("dev/null", 1, 3),
		}},
		{Compression: c1, Entries: []imagetest.Entry{
			imagetest.Whiteout("etc/gone"),
			imagetest.Opaque("d"),
			imagetest.File("d/z", "z", 0o644),
			imagetest.File("etc/new", "new", 0o644),
		}},
	}
}

type format struct {
	name  string
	write func(t *testing.T, src string, cfg imagetest.Config, layers ...imagetest.Layer) (string, imagetest.Image)
}

var formats = []format{
	{"oci-layout", func(t *testing.T, base string, cfg imagetest.Config, layers ...imagetest.Layer) (string, imagetest.Image) {
		return base, imagetest.WriteOCILayout(t, base, cfg, layers...)
	}},
	{"docker-save", func(t *testing.T, base string, cfg imagetest.Config, layers ...imagetest.Layer) (string, imagetest.Image) {
		p := filepath.Join(base, "image.tar")
		return p, imagetest.WriteDockerSave(t, p, cfg, layers...)
	}},
	{"docker-save-oci", func(t *testing.T, base string, cfg imagetest.Config, layers ...imagetest.Layer) (string, imagetest.Image) {
		p := filepath.Join(base, "image.tar")
		return p, imagetest.WriteDockerSaveOCI(t, p, cfg, layers...)
	}},
	{"docker-save-gzipped", func(t *testing.T, base string, cfg imagetest.Config, layers ...imagetest.Layer) (string, imagetest.Image) {
		p := filepath.Join(base, "image.tar")
		img := imagetest.WriteDockerSave(t, p, cfg, layers...)
		data, err := os.ReadFile(p)
		if err != nil {
			t.Fatal(err)
		}
		var buf bytes.Buffer
		zw := gzip.NewWriter(&buf)
		zw.Write(data)
		zw.Close()
		gz := p + ".gz"
		if err := os.WriteFile(gz, buf.Bytes(), 0o644); err != nil {
			t.Fatal(err)
		}
		return gz, img
	}},
}

func lstat(t *testing.T, p string) unix.Stat_t {
	t.Helper()
	var st unix.Stat_t
	if err := unix.Lstat(p, &st); err != nil {
		t.Fatalf("lstat %s: %v", p, err)
	}
	return st
}

func xattr(t *testing.T, p, name string) string {
	t.Helper()
	buf := make([]byte, 256)
	n, err := unix.Lgetxattr(p, name, buf)
	if err != nil {
		t.Fatalf("getxattr %s %s: %v", p, name, err)
	}
	return string(buf[:n])
}

func readString(t *testing.T, p string) string {
	t.Helper()
	b, err := os.ReadFile(p)
	if err != nil {
		t.Fatal(err)
	}
	return string(b)
}

func entries(t *testing.T, dir string) []string {
	t.Helper()
	des, err := os.ReadDir(dir)
	if err != nil {
		t.Fatal(err)
	}
	var names []string
	for _, de := range des {
		names = append(names, de.Name())
	}
	return names
}

func TestImportFormats(t *testing.T) {
	requireRoot(t)
	compressions := []struct {
		name   string
		c0, c1 imagetest.Compression
	}{
		{"plain", imagetest.Uncompressed, imagetest.Uncompressed},
		{"gzip", imagetest.Gzip, imagetest.Gzip},
		{"mixed", imagetest.Uncompressed, imagetest.Gzip},
	}
	for _, f := range formats {
		for _, c := range compressions {
			t.Run(f.name+"/"+c.name, func(t *testing.T) {
				t.Parallel()
				src, img := f.write(t, t.TempDir(), testConfig, twoLayers(c.c0, c.c1)...)
				dir := t.TempDir()
				imp, err := Import(t.Context(), src, dir)
				if err != nil {
					t.Fatalf("Import: %v", err)
				}
				checkTwoLayers(t, dir, imp)
				if imp.Digest != img.ConfigDigest {
					t.Errorf("Digest = %s, want config digest %s", imp.Digest, img.ConfigDigest)
				}
				loaded, err := Load(dir)
				if err != nil {
					t.Fatalf("Load: %v", err)
				}
				if !reflect.DeepEqual(loaded, imp) {
					t.Errorf("Load = %+v, want %+v", loaded, imp)
				}
			})
		}
	}
}

func checkTwoLayers(t *testing.T, dir string, imp *Imported) {
	t.Helper()
	if got, want := entries(t, dir), []string{"0", "1", "image.json"}; !slices.Equal(got, want) {
		t.Fatalf("import dir holds %v, want %v", got, want)
	}
	want := Config{Env: testConfig.Env, WorkingDir: testConfig.WorkingDir, User: testConfig.User,
		Entrypoint: testConfig.Entrypoint, Cmd: testConfig.Cmd}
	if !reflect.DeepEqual(imp.Config, want) {
		t.Errorf("Config = %+v, want %+v", imp.Config, want)
	}
	if len(imp.Layers) != 2 {
		t.Fatalf("Layers = %v, want 2", imp.Layers)
	}
	l0, l1 := imp.Layers[0], imp.Layers[1]
	if l0 != filepath.Join(dir, "0") || l1 != filepath.Join(dir, "1") {
		t.Errorf("Layers = %v, want %s/{0,1}", imp.Layers, dir)
	}

	if got := readString(t, filepath.Join(l0, "etc/keep")); got != "hello-unique-content" {
		t.Errorf("etc/keep = %q", got)
	}
	keep := lstat(t, filepath.Join(l0, "etc/keep"))
	if keep.Mode&0o7777 != 0o644 || keep.Mtim.Sec != mtime.Unix() {
		t.Errorf("etc/keep mode %o mtime %d, want 644 %d", keep.Mode&0o7777, keep.Mtim.Sec, mtime.Unix())
	}
	if got := xattr(t, filepath.Join(l0, "etc/keep"), "user.test"); got != "value" {
		t.Errorf("etc/keep user.test = %q", got)
	}
	if _, err := unix.Lgetxattr(filepath.Join(l0, "etc/keep"), "trusted.overlay.redirect", nil); !errors.Is(err, unix.ENODATA) {
		t.Errorf("overlay xattr from the tar was kept (err %v)", err)
	}
	if keep2 := lstat(t, filepath.Join(l0, "etc/keep2")); keep2.Ino != keep.Ino || keep.Nlink != 2 {
		t.Errorf("etc/keep2 is not a hardlink of etc/keep (ino %d vs %d, nlink %d)", keep2.Ino, keep.Ino, keep.Nlink)
	}
	if st := lstat(t, filepath.Join(l0, "bin/tool")); st.Mode&0o7777 != 0o4755 {
		t.Errorf("bin/tool mode %o, want 4755", st.Mode&0o7777)
	}
	if st := lstat(t, filepath.Join(l0, "tmp")); st.Mode&0o7777 != 0o1777 || st.Mtim.Sec != mtime.Unix() {
		t.Errorf("tmp mode %o mtime %d, want 1777 %d", st.Mode&0o7777, st.Mtim.Sec, mtime.Unix())
	}
	if st := lstat(t, filepath.Join(l0, "d")); st.Mode&0o7777 != 0o750 || st.Mtim.Sec != mtime.Unix() {
		t.Errorf("d mode %o mtime %d, want 750 %d", st.Mode&0o7777, st.Mtim.Sec, mtime.Unix())
	}
	if st := lstat(t, filepath.Join(l0, "home/agent/notes")); st.Uid != 1000 || st.Gid != 1001 || st.Mode&0o7777 != 0o600 {
		t.Errorf("home/agent/notes owner %d:%d mode %o, want 1000:1001 600", st.Uid, st.Gid, st.Mode&0o7777)
	}
	if target, err := os.Readlink(filepath.Join(l0, "lnk")); err != nil || target != "/etc/keep" {
		t.Errorf("lnk -> %q (%v), want /etc/keep", target, err)
	}
	if st := lstat(t, filepath.Join(l0, "run/fifo")); st.Mode&unix.S_IFMT != unix.S_IFIFO {
		t.Errorf("run/fifo mode %o, want a fifo", st.Mode)
	}
	if st := lstat(t, filepath.Join(l0, "dev/null")); st.Mode&unix.S_IFMT != unix.S_IFCHR || unix.Major(st.Rdev) != 1 || unix.Minor(st.Rdev) != 3 {
		t.Errorf("dev/null mode %o rdev %d:%d, want char 1:3", st.Mode, unix.Major(st.Rdev), unix.Minor(st.Rdev))
	}

	wh := lstat(t, filepath.Join(l1, "etc/gone"))
	if wh.Mode&unix.S_IFMT != unix.S_IFCHR || wh.Rdev != 0 {
		t.Errorf("whiteout etc/gone mode %o rdev %d, want a 0:0 char device", wh.Mode, wh.Rdev)
	}
	if _, err := os.Lstat(filepath.Join(l1, "etc/.wh.gone")); !errors.Is(err, os.ErrNotExist) {
		t.Errorf("the .wh. entry itself was written (err %v)", err)
	}
	if got := xattr(t, filepath.Join(l1, "d"), "trusted.overlay.opaque"); got != "y" {
		t.Errorf("d trusted.overlay.opaque = %q, want y", got)
	}
	if _, err := os.Lstat(filepath.Join(l1, "d/.wh..wh..opq")); !errors.Is(err, os.ErrNotExist) {
		t.Errorf("the opaque marker itself was written (err %v)", err)
	}
	if got := readString(t, filepath.Join(l1, "d/z")); got != "z" {
		t.Errorf("d/z = %q", got)
	}
}

// TestOverlayMount mounts the imported layers as overlayfs and checks that the whiteout and
// the opaque directory hide what they should.
func TestOverlayMount(t *testing.T) {
	requireRoot(t)
	src := t.TempDir()
	imagetest.WriteOCILayout(t, src, testConfig, twoLayers(imagetest.Uncompressed, imagetest.Gzip)...)
	dir := t.TempDir()
	imp, err := Import(t.Context(), src, dir)
	if err != nil {
		t.Fatalf("Import: %v", err)
	}
	mnt := t.TempDir()
	opts := "lowerdir=" + imp.Layers[1] + ":" + imp.Layers[0]
	if err := unix.Mount("overlay", mnt, "overlay", unix.MS_RDONLY, opts); err != nil {
		t.Fatalf("mounting overlay %s: %v", opts, err)
	}
	t.Cleanup(func() {
		if err := unix.Unmount(mnt, 0); err != nil {
			t.Errorf("unmounting overlay: %v", err)
		}
	})
	for _, hidden := range []string{"etc/gone", "d/x", "d/sub", "d/sub/y"} {
		if _, err := os.Lstat(filepath.Join(mnt, hidden)); !errors.Is(err, os.ErrNotExist) {
			t.Errorf("%s is visible in the overlay (err %v), want hidden", hidden, err)
		}
	}
	for p, want := range map[string]string{"etc/keep": "hello-unique-content", "etc/new": "new", "d/z": "z"} {
		if got := readString(t, filepath.Join(mnt, p)); got != want {
			t.Errorf("%s in the overlay = %q, want %q", p, got, want)
		}
	}
	if got, want := entries(t, filepath.Join(mnt, "d")), []string{"z"}; !slices.Equal(got, want) {
		t.Errorf("opaque d lists %v, want %v", got, want)
	}
	if got, want := entries(t, filepath.Join(mnt, "etc")), []string{"keep", "keep2", "new"}; !slices.Equal(got, want) {
		t.Errorf("etc lists %v, want %v", got, want)
	}
}

// makeRootfs builds a source directory with every kind of entry a rootfs holds.
func makeRootfs(t *testing.T) string {
	t.Helper()
	src := t.TempDir()
	must := func(err error) {
		t.Helper()
		if err != nil {
			t.Fatal(err)
		}
	}
	must(os.Chmod(src, 0o755))
	must(os.MkdirAll(filepath.Join(src, "usr/bin"), 0o755))
	must(os.WriteFile(filepath.Join(src, "usr/bin/prog"), []byte("program"), 0o755))
	must(unix.Chmod(filepath.Join(src, "usr/bin/prog"), 0o6755))
	must(os.Symlink("usr/bin", filepath.Join(src, "bin")))
	must(os.Symlink("/nonexistent/dangling", filepath.Join(src, "dangling")))
	must(os.Mkdir(filepath.Join(src, "home"), 0o755))
	must(os.Mkdir(filepath.Join(src, "home/agent"), 0o700))
	must(os.Chown(filepath.Join(src, "home/agent"), 1000, 1000))
	must(os.WriteFile(filepath.Join(src, "home/agent/secret"), []byte("s3cret"), 0o640))
	must(os.Chown(filepath.Join(src, "home/agent/secret"), 1000, 1001))
	must(os.Lchown(filepath.Join(src, "dangling"), 1000, 1000))
	must(os.Link(filepath.Join(src, "usr/bin/prog"), filepath.Join(src, "usr/bin/prog2")))
	must(os.Mkdir(filepath.Join(src, "dev"), 0o755))
	must(unix.Mknod(filepath.Join(src, "dev/zero"), unix.S_IFCHR|0o666, int(unix.Mkdev(1, 5))))
	must(unix.Mknod(filepath.Join(src, "dev/loop9"), unix.S_IFBLK|0o660, int(unix.Mkdev(7, 9))))
	must(unix.Mkfifo(filepath.Join(src, "fifo"), 0o620))
	must(os.Mkdir(filepath.Join(src, "tmp"), 0o755))
	must(unix.Chmod(filepath.Join(src, "tmp"), 0o1777))
	must(os.WriteFile(filepath.Join(src, "empty"), nil, 0o644))
	must(unix.Lsetxattr(filepath.Join(src, "usr/bin/prog"), "user.kind", []byte("binary"), 0))
	must(unix.Lsetxattr(filepath.Join(src, "home"), "trusted.note", []byte("t"), 0))
	must(unix.Lsetxattr(filepath.Join(src, "home"), "trusted.overlay.opaque", []byte("y"), 0))
	old := []unix.Timespec{unix.NsecToTimespec(mtime.UnixNano()), unix.NsecToTimespec(mtime.UnixNano())}
	for _, p := range []string{"usr/bin/prog", "dangling", "home/agent", "home", "tmp", "fifo", "."} {
		must(unix.UtimesNanoAt(unix.AT_FDCWD, filepath.Join(src, p), old, unix.AT_SYMLINK_NOFOLLOW))
	}
	return src
}

// describe lists a tree as one line per entry: type, mode, owner, size, link, device, xattrs,
// mtime and contents, with hardlinks named by their first path.
func describe(t *testing.T, root string) []string {
	t.Helper()
	var out []string
	first := map[uint64]string{}
	err := filepath.WalkDir(root, func(p string, _ os.DirEntry, err error) error {
		if err != nil {
			return err
		}
		rel, _ := filepath.Rel(root, p)
		st := lstat(t, p)
		line := []string{rel, strings.TrimSpace(os.FileMode(st.Mode).String()), itoa(st.Mode & 0o7777),
			itoa(st.Uid) + ":" + itoa(st.Gid), itoa(st.Size), itoa(st.Rdev), itoa(st.Mtim.Sec)}
		if st.Mode&unix.S_IFMT != unix.S_IFDIR && st.Nlink > 1 {
			if f, ok := first[st.Ino]; ok {
				line = append(line, "link="+f)
			}
			first[st.Ino] = rel
		}
		switch st.Mode & unix.S_IFMT {
		case unix.S_IFLNK:
			target, _ := os.Readlink(p)
			line = append(line, "->"+target)
		case unix.S_IFREG:
			line = append(line, readString(t, p))
		}
		xa, err := listXattrs(p)
		if err != nil {
			return err
		}
		for _, k := range slices.Sorted(maps.Keys(xa)) {
			line = append(line, k+"="+xa[k])
		}
		out = append(out, strings.Join(line, " "))
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	return out
}

func itoa[T ~int64 | ~uint64 | ~uint32 | ~int32](v T) string {
	return strconv.FormatInt(int64(v), 10)
}

func TestImportRootfs(t *testing.T) {
	requireRoot(t)
	src := makeRootfs(t)
	dir := t.TempDir()
	imp, err := Import(t.Context(), src, dir)
	if err != nil {
		t.Fatalf("Import: %v", err)
	}
	if len(imp.Layers) != 1 {
		t.Fatalf("Layers = %v, want one", imp.Layers)
	}
	got, want := describe(t, imp.Layers[0]), describe(t, src)
	// overlayfs' own xattrs are not copied.
	for i, l := range want {
		want[i] = strings.Replace(l, " trusted.overlay.opaque=y", "", 1)
	}
	if !slices.Equal(got, want) {
		t.Errorf("layer differs from source:\n got %q\nwant %q", got, want)
	}
	for p, mode := range map[string]uint32{"usr/bin/prog": 0o6755, "tmp": 0o1777, "home/agent": 0o700} {
		if st := lstat(t, filepath.Join(imp.Layers[0], p)); st.Mode&0o7777 != mode {
			t.Errorf("%s mode %o, want %o", p, st.Mode&0o7777, mode)
		}
	}
	if !reflect.DeepEqual(imp.Config, Config{}) {
		t.Errorf("Config = %+v, want zero", imp.Config)
	}
	if !strings.HasPrefix(imp.Digest, "sha256:") || len(imp.Digest) != 71 {
		t.Errorf("Digest = %q", imp.Digest)
	}

	// The digest is a function of the contents, not of times.
	now := time.Now()
	if err := os.Chtimes(filepath.Join(src, "empty"), now, now); err != nil {
		t.Fatal(err)
	}
	again, err := Import(t.Context(), src, t.TempDir())
	if err != nil {
		t.Fatal(err)
	}
	if again.Digest != imp.Digest {
		t.Errorf("digest changed with an mtime: %s then %s", imp.Digest, again.Digest)
	}
	if err := os.WriteFile(filepath.Join(src, "empty"), []byte("x"), 0o644); err != nil {
		t.Fatal(err)
	}
	changed, err := Import(t.Context(), src, t.TempDir())
	if err != nil {
		t.Fatal(err)
	}
	if changed.Digest == imp.Digest {
		t.Errorf("digest did not change with the contents: %s", imp.Digest)
	}
}

// TestImportBusybox imports the busybox rootfs and runs its shell chrooted into the layer.
func TestImportBusybox(t *testing.T) {
	requireRoot(t)
	src := imagetest.Busybox(t)
	for _, f := range []format{{name: "rootfs"}, formats[0], formats[1]} {
		t.Run(f.name, func(t *testing.T) {
			from := src
			if f.write != nil {
				from, _ = f.write(t, t.TempDir(), imagetest.Config{}, imagetest.LayerFromDir(t, src))
			}
			imp, err := Import(t.Context(), from, t.TempDir())
			if err != nil {
				t.Fatalf("Import: %v", err)
			}
			cmd := exec.CommandContext(t.Context(), "/bin/sh", "-c", "id -un; id -u agent; ls /bin/sh; stat -c %A /tmp")
			cmd.SysProcAttr = &syscall.SysProcAttr{Chroot: imp.Layers[0]}
			cmd.Dir = "/"
			cmd.Env = []string{"PATH=/bin"}
			out, err := cmd.CombinedOutput()
			if err != nil {
				t.Fatalf("running sh in the imported layer: %v\n%s", err, out)
			}
			if got, want := string(out), "root\n1000\n/bin/sh\ndrwxrwxrwt\n"; got != want {
				t.Errorf("output %q, want %q", got, want)
			}
		})
	}
}

func TestImportHostile(t *testing.T) {
	requireRoot(t)
	const hostEtc = "/etc/deltagym-image-hostile-test"
	cases := []struct {
		name    string
		entries func(outside string) []imagetest.Entry
	}{
		{"dotdot", func(string) []imagetest.Entry { return []imagetest.Entry{imagetest.File("../../../x", "x", 0o644)} }},
		{"dotdot-inner", func(string) []imagetest.Entry {
			return []imagetest.Entry{imagetest.Dir("a", 0o755), imagetest.File("a/../../../../x", "x", 0o644)}
		}},
		{"absolute", func(string) []imagetest.Entry { return []imagetest.Entry{imagetest.File(hostEtc, "x", 0o644)} }},
		{"symlink-absolute", func(outside string) []imagetest.Entry {
			return []imagetest.Entry{imagetest.Symlink("l", outside), imagetest.File("l/x", "x", 0o644)}
		}},
		{"symlink-relative", func(string) []imagetest.Entry {
			return []imagetest.Entry{imagetest.Symlink("l", "../../../outside"), imagetest.File("l/x", "x", 0o644)}
		}},
		{"symlink-deep", func(outside string) []imagetest.Entry {
			return []imagetest.Entry{imagetest.Dir("a", 0o755), imagetest.Symlink("a/b", "/"),
				imagetest.File("a/b"+outside+"/x", "x", 0o644)}
		}},
		{"symlink-dir-entry", func(outside string) []imagetest.Entry {
			return []imagetest.Entry{imagetest.Symlink("l", outside), imagetest.Dir("l/newdir", 0o755)}
		}},
		{"symlink-then-symlink", func(outside string) []imagetest.Entry {
			return []imagetest.Entry{imagetest.Symlink("l", outside), imagetest.Symlink("l/x", "/etc/passwd")}
		}},
		{"hardlink-dotdot", func(string) []imagetest.Entry {
			return []imagetest.Entry{imagetest.Hardlink("h", "../../../outside/secret")}
		}},
		{"hardlink-absolute", func(outside string) []imagetest.Entry {
			return []imagetest.Entry{imagetest.Hardlink("h", outside+"/secret")}
		}},
		{"hardlink-through-symlink", func(outside string) []imagetest.Entry {
			return []imagetest.Entry{imagetest.Symlink("l", outside), imagetest.Hardlink("h", "l/secret")}
		}},
		{"whiteout-through-symlink", func(outside string) []imagetest.Entry {
			return []imagetest.Entry{imagetest.Symlink("l", outside), imagetest.Whiteout("l/secret")}
		}},
		{"opaque-through-symlink", func(outside string) []imagetest.Entry {
			return []imagetest.Entry{imagetest.Symlink("l", outside), imagetest.Opaque("l")}
		}},
		{"whiteout-dotdot", func(string) []imagetest.Entry {
			return []imagetest.Entry{{Name: "a/.wh..", Type: tar.TypeReg}}
		}},
		{"root-as-file", func(string) []imagetest.Entry { return []imagetest.Entry{imagetest.File(".", "x", 0o644)} }},
	}
	for _, c := range cases {
		for _, f := range formats[:2] {
			t.Run(c.name+"/"+f.name, func(t *testing.T) {
				base := t.TempDir()
				outside := filepath.Join(base, "outside")
				dir := filepath.Join(base, "import")
				srcDir := filepath.Join(base, "src")
				for _, d := range []string{outside, dir, srcDir} {
					if err := os.Mkdir(d, 0o755); err != nil {
						t.Fatal(err)
					}
				}
				if err := os.WriteFile(filepath.Join(outside, "secret"), []byte("secret"), 0o600); err != nil {
					t.Fatal(err)
				}
				good := imagetest.Layer{Entries: []imagetest.Entry{imagetest.File("ok", "ok", 0o644)}}
				src, _ := f.write(t, srcDir, imagetest.Config{}, good, imagetest.Layer{Entries: c.entries(outside)})
				_, err := Import(t.Context(), src, dir)
				if !errors.Is(err, ErrUnsafePath) {
					t.Fatalf("Import = %v, want ErrUnsafePath", err)
				}
				t.Log(err)
				if got := entries(t, dir); len(got) != 0 {
					t.Errorf("import dir holds %v after the error, want nothing", got)
				}
				if got := entries(t, outside); !slices.Equal(got, []string{"secret"}) {
					t.Errorf("outside holds %v, want [secret]", got)
				}
				if st := lstat(t, filepath.Join(outside, "secret")); st.Nlink != 1 || st.Mode&unix.S_IFMT != unix.S_IFREG {
					t.Errorf("outside/secret was linked or replaced: nlink %d mode %o", st.Nlink, st.Mode)
				}
				if got := entries(t, base); !slices.Equal(got, []string{"import", "outside", "src"}) {
					t.Errorf("base holds %v, want [import outside src]", got)
				}
				if _, err := os.Lstat(hostEtc); !errors.Is(err, os.ErrNotExist) {
					t.Errorf("%s was written", hostEtc)
				}
			})
		}
	}
}

func TestImportDigestMismatch(t *testing.T) {
	requireRoot(t)
	layers := func(c imagetest.Compression) []imagetest.Layer {
		return []imagetest.Layer{{Compression: c, Entries: []imagetest.Entry{imagetest.File("f", "hello-unique-content", 0o644)}}}
	}
	replaceIn := func(t *testing.T, p, old, new string) {
		t.Helper()
		b, err := os.ReadFile(p)
		if err != nil {
			t.Fatal(err)
		}
		if !bytes.Contains(b, []byte(old)) {
			t.Fatalf("%s does not contain %q", p, old)
		}
		if err := os.WriteFile(p, bytes.ReplaceAll(b, []byte(old), []byte(new)), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	blob := func(base, digest string) string {
		return filepath.Join(base, "blobs/sha256", strings.TrimPrefix(digest, "sha256:"))
	}
	cases := []struct {
		name   string
		tamper func(t *testing.T, base string) string
	}{
		{"oci-layer", func(t *testing.T, base string) string {
			img := imagetest.WriteOCILayout(t, base, testConfig, layers(imagetest.Uncompressed)...)
			replaceIn(t, blob(base, img.LayerDigests[0]), "hello-unique", "jello-unique")
			return base
		}},
		{"oci-gzip-blob", func(t *testing.T, base string) string {
			// Same uncompressed tar (diff_id matches), different compressed bytes.
			img := imagetest.WriteOCILayout(t, base, testConfig, layers(imagetest.Gzip)...)
			p := blob(base, img.LayerDigests[0])
			zr, err := gzip.NewReader(bytes.NewReader(must(os.ReadFile(p))))
			if err != nil {
				t.Fatal(err)
			}
			raw := must(io.ReadAll(zr))
			var buf bytes.Buffer
			zw, _ := gzip.NewWriterLevel(&buf, gzip.NoCompression)
			zw.Write(raw)
			zw.Close()
			if err := os.WriteFile(p, buf.Bytes(), 0o644); err != nil {
				t.Fatal(err)
			}
			return base
		}},
		{"oci-config", func(t *testing.T, base string) string {
			img := imagetest.WriteOCILayout(t, base, testConfig, layers(imagetest.Uncompressed)...)
			replaceIn(t, blob(base, img.ConfigDigest), "echo hi", "echo HI")
			return base
		}},
		{"oci-manifest", func(t *testing.T, base string) string {
			img := imagetest.WriteOCILayout(t, base, testConfig, layers(imagetest.Uncompressed)...)
			replaceIn(t, blob(base, img.ManifestDigest), "v1.tar", "v1.TAR")
			return base
		}},
		{"docker-layer-diffid", func(t *testing.T, base string) string {
			p := filepath.Join(base, "image.tar")
			imagetest.WriteDockerSave(t, p, testConfig, layers(imagetest.Uncompressed)...)
			replaceIn(t, p, "hello-unique", "jello-unique")
			return p
		}},
		{"docker-config", func(t *testing.T, base string) string {
			p := filepath.Join(base, "image.tar")
			imagetest.WriteDockerSave(t, p, testConfig, layers(imagetest.Uncompressed)...)
			replaceIn(t, p, "echo hi", "echo HI")
			return p
		}},
		{"docker-oci-layer", func(t *testing.T, base string) string {
			p := filepath.Join(base, "image.tar")
			imagetest.WriteDockerSaveOCI(t, p, testConfig, layers(imagetest.Uncompressed)...)
			replaceIn(t, p, "hello-unique", "jello-unique")
			return p
		}},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			t.Parallel()
			src := c.tamper(t, t.TempDir())
			dir := t.TempDir()
			_, err := Import(t.Context(), src, dir)
			if !errors.Is(err, ErrDigestMismatch) {
				t.Fatalf("Import = %v, want ErrDigestMismatch", err)
			}
			if got := entries(t, dir); len(got) != 0 {
				t.Errorf("import dir holds %v after the error, want nothing", got)
			}
		})
	}
}

func must[T any](v T, err error) T {
	if err != nil {
		panic(err)
	}
	return v
}

func TestImportErrors(t *testing.T) {
	requireRoot(t)
	ok := []imagetest.Layer{{Entries: []imagetest.Entry{imagetest.File("f", "f", 0o644)}}}
	cases := []struct {
		name  string
		setup func(t *testing.T, base, dir string) string
		want  error
	}{
		{"dir-not-empty", func(t *testing.T, base, dir string) string {
			imagetest.WriteOCILayout(t, base, testConfig, ok...)
			os.WriteFile(filepath.Join(dir, "x"), nil, 0o644)
			return base
		}, ErrDirNotEmpty},
		{"not-a-tar", func(t *testing.T, base, _ string) string {
			p := filepath.Join(base, "junk")
			os.WriteFile(p, bytes.Repeat([]byte("not a tar "), 100), 0o644)
			return p
		}, ErrUnknownFormat},
		{"tar-without-manifest", func(t *testing.T, base, _ string) string {
			p := filepath.Join(base, "plain.tar")
			os.WriteFile(p, imagetest.Tar(t, []imagetest.Entry{imagetest.File("etc/passwd", "root", 0o644)}), 0o644)
			return p
		}, ErrUnknownFormat},
		{"zstd-layer", func(t *testing.T, base, _ string) string {
			imagetest.WriteOCILayout(t, base, testConfig, imagetest.Layer{Raw: []byte{0x28, 0xb5, 0x2f, 0xfd, 0, 0, 0, 0}})
			return base
		}, ErrUnsupportedCompression},
		{"missing-blob", func(t *testing.T, base, _ string) string {
			img := imagetest.WriteOCILayout(t, base, testConfig, ok...)
			os.Remove(filepath.Join(base, "blobs/sha256", strings.TrimPrefix(img.LayerDigests[0], "sha256:")))
			return base
		}, os.ErrNotExist},
		{"truncated-layer", func(t *testing.T, base, _ string) string {
			imagetest.WriteOCILayout(t, base, testConfig, imagetest.Layer{
				Raw: imagetest.Tar(t, []imagetest.Entry{imagetest.File("big", strings.Repeat("x", 4000), 0o644)})[:2000]})
			return base
		}, io.ErrUnexpectedEOF},
		{"missing-source", func(t *testing.T, base, _ string) string { return filepath.Join(base, "nope") }, os.ErrNotExist},
		{"cancelled", func(t *testing.T, base, _ string) string {
			imagetest.WriteOCILayout(t, base, testConfig, ok...)
			return base
		}, context.Canceled},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			base, dir := t.TempDir(), t.TempDir()
			src := c.setup(t, base, dir)
			ctx := t.Context()
			if c.want == context.Canceled {
				cctx, cancel := context.WithCancel(ctx)
				cancel()
				ctx = cctx
			}
			before := entries(t, dir)
			_, err := Import(ctx, src, dir)
			if !errors.Is(err, c.want) {
				t.Fatalf("Import = %v, want %v", err, c.want)
			}
			if got := entries(t, dir); !slices.Equal(got, before) {
				t.Errorf("import dir holds %v after the error, want %v", got, before)
			}
		})
	}
}

func TestLoadNotImported(t *testing.T) {
	if _, err := Load(t.TempDir()); !errors.Is(err, ErrNotImported) {
		t.Fatalf("Load of an empty dir = %v, want ErrNotImported", err)
	}
}

func TestCleanEntryName(t *testing.T) {
	cases := []struct {
		in, want string
		unsafe   bool
	}{
		{"a/b", "a/b", false},
		{"./a//b/", "a/b", false},
		{"./", ".", false},
		{".", ".", false},
		{"a/./b", "a/b", false},
		{"..a/b..", "..a/b..", false},
		{"", "", true},
		{"/etc/passwd", "", true},
		{"../x", "", true},
		{"a/../b", "", true},
		{"a/..", "", true},
		{"a\x00b", "", true},
	}
	for _, c := range cases {
		t.Run(c.in, func(t *testing.T) {
			got, err := cleanEntryName(c.in)
			if c.unsafe {
				if !errors.Is(err, ErrUnsafePath) {
					t.Fatalf("cleanEntryName(%q) = %q, %v; want ErrUnsafePath", c.in, got, err)
				}
				return
			}
			if err != nil || got != c.want {
				t.Fatalf("cleanEntryName(%q) = %q, %v; want %q", c.in, got, err, c.want)
			}
		})
	}
}

func FuzzCleanEntryName(f *testing.F) {
	for _, s := range []string{"a/b", "./a/../b", "/etc/passwd", "..", "a/..", "....//x", ".wh..wh..opq", "a\x00"} {
		f.Add(s)
	}
	f.Fuzz(func(t *testing.T, name string) {
		got, err := cleanEntryName(name)
		if err != nil {
			if !errors.Is(err, ErrUnsafePath) {
				t.Fatalf("cleanEntryName(%q) error %v is not ErrUnsafePath", name, err)
			}
			return
		}
		if got == "" || strings.HasPrefix(got, "/") || strings.IndexByte(got, 0) >= 0 {
			t.Fatalf("cleanEntryName(%q) = %q", name, got)
		}
		for _, c := range strings.Split(got, "/") {
			if c == ".." || c == "" || (c == "." && got != ".") {
				t.Fatalf("cleanEntryName(%q) = %q has component %q", name, got, c)
			}
		}
		joined := filepath.Join("/layer", got)
		if joined != "/layer" && !strings.HasPrefix(joined, "/layer/") {
			t.Fatalf("cleanEntryName(%q) = %q escapes: %s", name, got, joined)
		}
		if again, err := cleanEntryName(got); err != nil || again != got {
			t.Fatalf("cleanEntryName not idempotent on %q: %q, %v", got, again, err)
		}
	})
}
