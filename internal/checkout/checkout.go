// Package checkout finds the root of the deltagym checkout a path lies in: the nearest directory
// at or above it that holds go.mod. The private installs `make` writes (.cache/criu,
// .cache/postgres) are looked for there, and only there.
package checkout

import (
	"os"
	"path/filepath"
)

// Root returns the nearest directory at or above dir that holds go.mod, or "" if none does.
func Root(dir string) string {
	for {
		if _, err := os.Stat(filepath.Join(dir, "go.mod")); err == nil {
			return dir
		}
		parent := filepath.Dir(dir)
		if parent == dir {
			return ""
		}
		dir = parent
	}
}
