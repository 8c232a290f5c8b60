package sandbox

import (
	"os"
	"path/filepath"
	"testing"

	"golang.org/x/sys/unix"

	"github.com/deltagym/deltagym/internal/testenv"
)

// An import adds the skeleton's directories its top layer lacks, with the
// skeleton's modes, unless a layer has something else at the path: then the
// image keeps the skeleton layer.
func TestAddSkeleton(t *testing.T) {
	testenv.Privileged(t, "gives the skeleton's directories their owners (lchown)")
	mk := func(t *testing.T, n int) []string {
		var ls []string
		for i := range n {
			d := filepath.Join(t.TempDir(), "l"+string(rune('0'+i)))
			if err := os.Mkdir(d, 0o755); err != nil {
				t.Fatal(err)
			}
			ls = append(ls, d)
		}
		return ls
	}
	t.Run("empty", func(t *testing.T) {
		ls := mk(t, 1)
		if skeletonCovered(ls) {
			t.Fatal("an empty layer covers the skeleton")
		}
		if err := addSkeleton(ls); err != nil {
			t.Fatal(err)
		}
		if !skeletonCovered(ls) {
			t.Fatal("the skeleton added does not cover it")
		}
		for _, d := range skeleton {
			st, err := os.Lstat(filepath.Join(ls[0], d.path))
			if err != nil || st.Mode()&(os.ModePerm|os.ModeSticky) != d.mode {
				t.Errorf("/%s: %v, %v, want mode %v", d.path, st.Mode(), err, d.mode)
			}
		}
		if st, err := os.Lstat(filepath.Join(ls[0], "run")); err != nil || st.Mode().Perm() != 0o755 {
			t.Errorf("/run: %v, %v, want 0755", st.Mode(), err)
		}
	})
	t.Run("existing directories kept", func(t *testing.T) {
		ls := mk(t, 1)
		if err := os.Mkdir(filepath.Join(ls[0], "tmp"), 0o700); err != nil {
			t.Fatal(err)
		}
		if err := addSkeleton(ls); err != nil {
			t.Fatal(err)
		}
		if st, _ := os.Lstat(filepath.Join(ls[0], "tmp")); st.Mode().Perm() != 0o700 {
			t.Errorf("the image's /tmp became %v", st.Mode())
		}
	})
	t.Run("link in the top layer", func(t *testing.T) {
		ls := mk(t, 1)
		if err := os.Symlink("/var/run", filepath.Join(ls[0], "run")); err != nil {
			t.Fatal(err)
		}
		if err := addSkeleton(ls); err != nil {
			t.Fatal(err)
		}
		if skeletonCovered(ls) {
			t.Fatal("covered with /run a link")
		}
		if _, err := os.Lstat(filepath.Join(ls[0], "proc")); err != nil {
			t.Errorf("/proc not added beside the link: %v", err)
		}
	})
	t.Run("file or whiteout below", func(t *testing.T) {
		ls := mk(t, 2)
		if err := os.WriteFile(filepath.Join(ls[0], "etc"), nil, 0o644); err != nil {
			t.Fatal(err)
		}
		if os.Getuid() == 0 {
			if err := unix.Mknod(filepath.Join(ls[0], "tmp"), unix.S_IFCHR|0o600, 0); err != nil {
				t.Fatal(err)
			}
		}
		if err := addSkeleton(ls); err != nil {
			t.Fatal(err)
		}
		if skeletonCovered(ls) {
			t.Fatal("covered over a file at /etc")
		}
		if _, err := os.Lstat(filepath.Join(ls[1], "etc")); err == nil {
			t.Error("/etc added over a file below")
		}
		if _, err := os.Lstat(filepath.Join(ls[1], "tmp")); err == nil && os.Getuid() == 0 {
			t.Error("/tmp added over a whiteout below")
		}
		if _, err := os.Lstat(filepath.Join(ls[1], "run/deltagym")); err != nil {
			t.Errorf("/run/deltagym not added: %v", err)
		}
	})
}
