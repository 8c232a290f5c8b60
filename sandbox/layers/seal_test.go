package layers

import (
	"errors"
	"os"
	"path/filepath"
	"slices"
	"testing"

	"golang.org/x/sys/unix"

	"github.com/deltagym/deltagym/internal/testenv"
)

func newStore(t testing.TB) *Store {
	t.Helper()
	testenv.Privileged(t, "layers are tmpfs mounts")
	dir := t.TempDir()
	s, err := New(dir)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		s.Wait()
		if err := Purge(dir); err != nil {
			t.Error(err)
		}
	})
	return s
}

func names(t *testing.T, dir string) []string {
	t.Helper()
	es, err := os.ReadDir(dir)
	if err != nil {
		t.Fatal(err)
	}
	var out []string
	for _, e := range es {
		out = append(out, e.Name())
	}
	return out
}

// writtenUpper makes an upper of sizeBytes and fills it the way an overlay
// leaves it: files, a hard-link group, and an index holding a link into the
// group, a file's only name (a copy made for an unlink) and the shared
// whiteout.
func writtenUpper(t *testing.T, s *Store, sizeBytes int64) string {
	t.Helper()
	id, err := s.NewUpper(sizeBytes, 0)
	if err != nil {
		t.Fatal(err)
	}
	up := s.UpperPath(id)
	must := func(err error) {
		t.Helper()
		if err != nil {
			t.Fatal(err)
		}
	}
	must(os.MkdirAll(filepath.Join(up, "w"), 0o755))
	must(os.WriteFile(filepath.Join(up, "w", "a"), []byte("a"), 0o644))
	must(os.Link(filepath.Join(up, "w", "a"), filepath.Join(up, "w", "b")))
	must(os.Chmod(up, 0o711))
	index := filepath.Join(s.Dir(id), WorkDir, "index")
	must(os.Mkdir(index, 0o700))
	must(os.Link(filepath.Join(up, "w", "a"), filepath.Join(index, "00fb21")))
	must(os.WriteFile(filepath.Join(index, "00fb22"), []byte("orphan"), 0o644))
	must(unix.Mknod(filepath.Join(index, "#1"), unix.S_IFCHR, 0))
	return id
}

func TestSealMovesTheUpperAndDropsIndexLinks(t *testing.T) {
	s := newStore(t)
	id := writtenUpper(t, s, 0)
	if _, err := s.Seal(id); err != nil {
		t.Fatal(err)
	}
	if got := names(t, s.UpperPath(id)); len(got) != 0 {
		t.Fatalf("upper after the seal: %v, want empty", got)
	}
	if got := names(t, filepath.Join(s.Path(id), "w")); !slices.Equal(got, []string{"a", "b"}) {
		t.Fatalf("layer: %v, want [a b]", got)
	}
	var st unix.Stat_t
	if err := unix.Stat(filepath.Join(s.Path(id), "w", "b"), &st); err != nil || st.Nlink != 2 {
		t.Fatalf("link count of the layer's w/b: %d (%v), want 2 (the index's link dropped)", st.Nlink, err)
	}
	if err := unix.Stat(s.Path(id), &st); err != nil || st.Mode&0o7777 != 0o711 {
		t.Fatalf("mode of the layer's root: %o (%v), want the upper's 711", st.Mode&0o7777, err)
	}
	if got := names(t, filepath.Join(s.Dir(id), WorkDir, "index")); !slices.Equal(got, []string{"#1", "00fb22"}) {
		t.Fatalf("index after the seal: %v, want the whiteout and the orphan kept", got)
	}
	if err := os.WriteFile(filepath.Join(s.Path(id), "x"), nil, 0o644); !errors.Is(err, unix.EROFS) {
		t.Fatalf("writing into a sealed layer: %v, want EROFS", err)
	}
	if err := s.Unseal(id); err != nil {
		t.Fatal(err)
	}
	if got := names(t, filepath.Join(s.UpperPath(id), "w")); !slices.Equal(got, []string{"a", "b"}) {
		t.Fatalf("upper after unsealing: %v, want [a b]", got)
	}
	if _, err := os.Lstat(s.Path(id)); !errors.Is(err, os.ErrNotExist) {
		t.Fatalf("fs/ after unsealing: %v, want it gone", err)
	}
	s.Unref(id)
}

// A seal refused (a file open for writing) leaves the upper as it was.
func TestFailedSealLeavesTheUpper(t *testing.T) {
	s := newStore(t)
	id := writtenUpper(t, s, 0)
	f, err := os.OpenFile(filepath.Join(s.UpperPath(id), "w", "a"), os.O_WRONLY, 0)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := s.Seal(id); !errors.Is(err, unix.EBUSY) {
		t.Fatalf("seal with a file open for writing: %v, want EBUSY", err)
	}
	f.Close()
	if got := names(t, filepath.Join(s.UpperPath(id), "w")); !slices.Equal(got, []string{"a", "b"}) {
		t.Fatalf("upper after a failed seal: %v, want [a b]", got)
	}
	if got := names(t, filepath.Join(s.Dir(id), WorkDir, "index")); len(got) != 3 {
		t.Fatalf("index after a failed seal: %v, want all three entries", got)
	}
	if _, err := os.Lstat(s.Path(id)); !errors.Is(err, os.ErrNotExist) {
		t.Fatalf("fs/ after a failed seal: %v, want none", err)
	}
	// It can be sealed once the writer is gone.
	if _, err := s.Seal(id); err != nil {
		t.Fatal(err)
	}
	s.Unref(id)
}

// A layer written straight into fs/ (a copy) is sealed as it is.
func TestCopyIntoSeals(t *testing.T) {
	s := newStore(t)
	src := writtenUpper(t, s, 0)
	dst, err := s.NewUpper(0, 0)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := s.CopyInto(src, dst); err != nil {
		t.Fatal(err)
	}
	if got := names(t, filepath.Join(s.Path(dst), "w")); !slices.Equal(got, []string{"a", "b"}) {
		t.Fatalf("copy: %v, want [a b]", got)
	}
	var st unix.Stat_t
	if err := unix.Stat(filepath.Join(s.Path(dst), "w", "b"), &st); err != nil || st.Nlink != 2 {
		t.Fatalf("link count in the copy: %d (%v), want 2", st.Nlink, err)
	}
	if got := names(t, filepath.Join(s.UpperPath(src), "w")); !slices.Equal(got, []string{"a", "b"}) {
		t.Fatalf("source after the copy: %v, want it untouched", got)
	}
	s.Unref(src)
	s.Unref(dst)
}

// TestResetUnused: ResetUnused empties a reclaimed layer like Reset, without
// Reset's check, and the layer seals afterwards.
func TestResetUnused(t *testing.T) {
	s := newStore(t)
	id := writtenUpper(t, s, 1<<20)
	if !s.Reclaim(id) {
		t.Fatal("Reclaim of an unsealed layer's last reference: false, want true")
	}
	if err := s.ResetUnused(id); err != nil {
		t.Fatal(err)
	}
	for _, sub := range []string{UpperDir, WorkDir} {
		if got := names(t, filepath.Join(s.Dir(id), sub)); len(got) != 0 {
			t.Fatalf("%s after ResetUnused: %v, want empty", sub, got)
		}
	}
	if err := os.WriteFile(filepath.Join(s.UpperPath(id), "x"), []byte("x"), 0o644); err != nil {
		t.Fatal(err)
	}
	if _, err := s.Seal(id); err != nil {
		t.Fatal(err)
	}
	s.Unref(id)
	s.Wait()
}

func TestReclaimAndReset(t *testing.T) {
	s := newStore(t)
	id := writtenUpper(t, s, 1<<20)
	// A file still held (as an old overlay holds its upper's files): the
	// reset must refuse, or the tmpfs could not be sealed later.
	f, err := os.Open(filepath.Join(s.UpperPath(id), "w", "a"))
	if err != nil {
		t.Fatal(err)
	}
	if !s.Reclaim(id) {
		t.Fatal("Reclaim of an unsealed layer's last reference: false, want true")
	}
	if err := s.Reset(id); !errors.Is(err, unix.EBUSY) {
		t.Fatalf("Reset while a removed file is held: %v, want EBUSY", err)
	}
	f.Close()
	if err := s.Reset(id); err != nil {
		t.Fatal(err)
	}
	for _, sub := range []string{UpperDir, WorkDir} {
		if got := names(t, filepath.Join(s.Dir(id), sub)); len(got) != 0 {
			t.Fatalf("%s after Reset: %v, want empty", sub, got)
		}
	}
	// The reset layer seals like a new one.
	if err := os.WriteFile(filepath.Join(s.UpperPath(id), "x"), []byte("x"), 0o644); err != nil {
		t.Fatal(err)
	}
	if _, err := s.Seal(id); err != nil {
		t.Fatal(err)
	}
	// A sealed layer is not reclaimed: its last reference discards it.
	if s.Reclaim(id) {
		t.Fatal("Reclaim of a sealed layer: true, want false")
	}
	s.Wait()
	if _, err := os.Lstat(s.Dir(id)); !errors.Is(err, os.ErrNotExist) {
		t.Fatalf("sealed layer after its last reference: %v, want it discarded", err)
	}
	// Nor is a layer someone else still holds.
	id2, err := s.NewUpper(0, 0)
	if err != nil {
		t.Fatal(err)
	}
	if err := s.Ref(id2); err != nil {
		t.Fatal(err)
	}
	if s.Reclaim(id2) {
		t.Fatal("Reclaim of a layer with another reference: true, want false")
	}
	s.Unref(id2)
}
