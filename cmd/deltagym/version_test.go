package main

import (
	"os"
	"path/filepath"
	"strings"
	"testing"
)

// TestVersion: `deltagym version` prints the version that the file VERSION at the repository's
// root holds, and exits 0.
func TestVersion(t *testing.T) {
	b, err := os.ReadFile(filepath.Join("..", "..", "VERSION"))
	if err != nil {
		t.Fatal(err)
	}
	want := "deltagym " + strings.TrimSpace(string(b)) + "\n"
	stdout, stderr, code := runCLI(t, "", "version")
	if code != exitOK || stdout != want || stderr != "" {
		t.Errorf("version: exit %d, stdout %q, stderr %q; want exit 0 and %q", code, stdout, stderr, want)
	}
}
