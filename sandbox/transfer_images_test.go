package sandbox_test

import (
	"errors"
	"os"
	"path/filepath"
	"testing"

	"github.com/deltagym/deltagym/sandbox"
)

// What an earlier run left of process images goes at a restart: an adoption it did not
// finish (a crash while a peer's images were read) and the images of a checkpoint it no longer
// holds; the images directory of a checkpoint it holds stays.
func TestRestartSweepsLeftoverImages(t *testing.T) {
	b := setup(t)
	s := b.create(t, sandbox.Spec{})
	ck, err := s.Checkpoint(t.Context())
	if err != nil {
		t.Fatal(err)
	}
	criu := filepath.Join(b.cfg.DataDir, "store", "criu")
	dirs := map[string]bool{".adopt-0123456789abcdef": false, "ck-gone-0000000000000001": false, ck.ID: true} // kept?
	for d := range dirs {
		if err := os.MkdirAll(filepath.Join(criu, d, "0"), 0o700); err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(filepath.Join(criu, d, "0", "pages-1.img"), make([]byte, 4096), 0o600); err != nil {
			t.Fatal(err)
		}
	}
	b.restart(t)
	for d, kept := range dirs {
		_, err := os.Stat(filepath.Join(criu, d, "0", "pages-1.img"))
		if kept && err != nil || !kept && !errors.Is(err, os.ErrNotExist) {
			t.Errorf("images of %s after a restart: %v, want kept %v", d, err, kept)
		}
	}
}
