package main

import (
	"os"
	"path/filepath"
	"strings"
	"testing"
)

// TestVersion: `deltagym version` and `deltagym --version` print the version that the file
// VERSION at the repository's root holds, and exit 0.
func TestVersion(t *testing.T) {
	b, err := os.ReadFile(filepath.Join("..", "..", "VERSION"))
	if err != nil {
		t.Fatal(err)
	}
	want := "deltagym " + strings.TrimSpace(string(b)) + "\n"
	for _, args := range [][]string{{"version"}, {"--version"}} {
		stdout, stderr, code := runCLI(t, "", args...)
		if code != exitOK || stdout != want || stderr != "" {
			t.Errorf("%v: exit %d, stdout %q, stderr %q; want exit 0 and %q", args, code, stdout, stderr, want)
		}
	}
}
