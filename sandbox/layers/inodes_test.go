package layers

import (
	"errors"
	"os"
	"path/filepath"
	"strconv"
	"testing"

	"golang.org/x/sys/unix"
)

// TestUpperInodeLimit: an upper made with an inode limit holds that many
// entries (files and directories alike) and refuses the next with ENOSPC,
// whatever bytes are left; one made without a limit takes more.
func TestUpperInodeLimit(t *testing.T) {
	s := newStore(t)
	const limit = 50
	id, err := s.NewUpper(64<<20, limit)
	if err != nil {
		t.Fatal(err)
	}
	defer s.Unref(id)
	up := s.UpperPath(id)
	if err := os.Mkdir(filepath.Join(up, "d"), 0o755); err != nil {
		t.Fatal(err)
	}
	made := 1
	for ; made < 10*limit; made++ {
		err := os.WriteFile(filepath.Join(up, "d", strconv.Itoa(made)), nil, 0o644)
		if errors.Is(err, unix.ENOSPC) {
			break
		}
		if err != nil {
			t.Fatal(err)
		}
	}
	if made != limit {
		t.Fatalf("the upper took %d entries, want %d (its inode limit)", made, limit)
	}

	free, err := s.NewUpper(64<<20, 0)
	if err != nil {
		t.Fatal(err)
	}
	defer s.Unref(free)
	for i := range 2 * limit {
		if err := os.WriteFile(filepath.Join(s.UpperPath(free), strconv.Itoa(i)), nil, 0o644); err != nil {
			t.Fatalf("an upper without an inode limit refused entry %d: %v", i, err)
		}
	}
}

// TestSealFullUpper: an upper whose writer used every inode of its limit is
// sealed all the same, the root of the layer it becomes taking an inode
// kept aside for it, again after a seal that failed; the layer holds what was
// written.
func TestSealFullUpper(t *testing.T) {
	s := newStore(t)
	const limit = 20
	id, err := s.NewUpper(64<<20, limit)
	if err != nil {
		t.Fatal(err)
	}
	up := s.UpperPath(id)
	made := 0
	for ; made < 10*limit; made++ {
		err := os.WriteFile(filepath.Join(up, strconv.Itoa(made)), nil, 0o644)
		if errors.Is(err, unix.ENOSPC) {
			break
		}
		if err != nil {
			t.Fatal(err)
		}
	}
	if made != limit {
		t.Fatalf("the upper took %d entries, want %d", made, limit)
	}
	if err := os.Mkdir(filepath.Join(s.Dir(id), "x"), 0o755); !errors.Is(err, unix.ENOSPC) {
		t.Fatalf("the layer has an inode left beside its spare: %v", err)
	}
	// A seal that fails (a file open for writing) leaves the spare for the next.
	f, err := os.OpenFile(filepath.Join(up, "0"), os.O_WRONLY, 0)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := s.Seal(id); !errors.Is(err, unix.EBUSY) {
		t.Fatalf("seal with a file open for writing: %v, want EBUSY", err)
	}
	f.Close()
	if _, err := s.Seal(id); err != nil {
		t.Fatalf("sealing a full upper: %v", err)
	}
	ents, err := os.ReadDir(s.Path(id))
	if err != nil || len(ents) != limit {
		t.Fatalf("the sealed layer holds %d entries (%v), want %d", len(ents), err, limit)
	}
	s.Unref(id)
}
