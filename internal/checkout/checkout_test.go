package checkout

import (
	"os"
	"path/filepath"
	"testing"
)

func TestRoot(t *testing.T) {
	top := t.TempDir()
	below := filepath.Join(top, "a", "b")
	if err := os.MkdirAll(below, 0o755); err != nil {
		t.Fatal(err)
	}
	if r := Root(below); r == top || r == below {
		t.Fatalf("Root(%s) = %s with no go.mod in the tree", below, r)
	}
	if err := os.WriteFile(filepath.Join(top, "go.mod"), []byte("module x\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	if r := Root(below); r != top {
		t.Fatalf("Root(%s) = %q, want %s", below, r, top)
	}
	if r := Root(top); r != top {
		t.Fatalf("Root(%s) = %q, want itself", top, r)
	}
}
