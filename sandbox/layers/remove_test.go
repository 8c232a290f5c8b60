package layers

import (
	"os"
	"path/filepath"
	"testing"

	"golang.org/x/sys/unix"
)

func TestRemoveTree(t *testing.T) {
	dir := t.TempDir()
	outside := filepath.Join(dir, "outside")
	must := func(err error) {
		t.Helper()
		if err != nil {
			t.Fatal(err)
		}
	}
	must(os.MkdirAll(filepath.Join(outside, "keep"), 0o755))
	top := filepath.Join(dir, "top")
	for _, d := range []string{"a/b/c", "empty", "a/empty", "locked/in"} {
		must(os.MkdirAll(filepath.Join(top, d), 0o755))
	}
	for _, f := range []string{"f", "a/f", "a/b/f", "a/b/c/f", "locked/in/f"} {
		must(os.WriteFile(filepath.Join(top, f), []byte("x"), 0o644))
	}
	// Many entries: more than one getdents buffer.
	for i := range 300 {
		must(os.WriteFile(filepath.Join(top, "a", "many-"+string(rune('a'+i%26))+string(rune('a'+i/26))), nil, 0o644))
	}
	must(os.Symlink(outside, filepath.Join(top, "dirlink")))
	must(os.Symlink("missing", filepath.Join(top, "a/dangling")))
	must(unix.Mkfifo(filepath.Join(top, "fifo"), 0o644))
	must(os.Chmod(filepath.Join(top, "locked"), 0o500))

	dfd, err := unix.Open(dir, unix.O_PATH|unix.O_DIRECTORY, 0)
	must(err)
	defer unix.Close(dfd)
	if os.Geteuid() != 0 {
		must(os.Chmod(filepath.Join(top, "locked"), 0o755)) // only root may empty it as it is
	}
	must(removeTree(dfd, "top"))
	if _, err := os.Lstat(top); !os.IsNotExist(err) {
		t.Fatalf("top still there: %v", err)
	}
	if _, err := os.Stat(filepath.Join(outside, "keep")); err != nil {
		t.Fatalf("a symlink's target went too: %v", err)
	}
	// A missing directory is no error; a file in its place is one.
	must(removeTree(dfd, "top"))
	must(os.WriteFile(filepath.Join(dir, "file"), nil, 0o644))
	if err := removeTree(dfd, "file"); err == nil {
		t.Fatal("removeTree of a file: no error")
	}
}

// BenchmarkReset empties the upper a rollback loop leaves behind: one
// changed file in a copied-up directory, and overlayfs's empty work and
// index directories.
func BenchmarkReset(b *testing.B) {
	if os.Geteuid() != 0 {
		b.Skip("needs root: each layer is a tmpfs")
	}
	s, err := New(b.TempDir())
	if err != nil {
		b.Fatal(err)
	}
	id, err := s.NewUpper(1<<20, 0)
	if err != nil {
		b.Fatal(err)
	}
	defer s.Wait()
	defer s.Unref(id)
	for b.Loop() {
		b.StopTimer()
		for _, d := range []string{UpperDir + "/work", WorkDir + "/work", WorkDir + "/index"} {
			if err := os.Mkdir(filepath.Join(s.Dir(id), d), 0o755); err != nil {
				b.Fatal(err)
			}
		}
		if err := os.WriteFile(filepath.Join(s.UpperPath(id), "work", "loadtest.dat"), make([]byte, 4096), 0o644); err != nil {
			b.Fatal(err)
		}
		b.StartTimer()
		if err := s.Reset(id); err != nil {
			b.Fatal(err)
		}
	}
}
