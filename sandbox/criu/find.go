package criu

import (
	"fmt"
	"os"
	"path/filepath"

	"github.com/deltagym/deltagym/internal/checkout"
)

// EnvBinary names the environment variable that overrides where the CRIU wrapper is.
const EnvBinary = "DELTAGYM_CRIU"

// wrapperInRepo is where `make criu` (scripts/criu.sh) puts the wrapper, relative to the checkout.
const wrapperInRepo = ".cache/criu/bin/criu"

// Find returns the path of the CRIU 4.2.1+ wrapper written by scripts/criu.sh. It honours
// DELTAGYM_CRIU, then looks for .cache/criu/bin/criu at the root of the checkout (the directory
// with go.mod) holding the working directory. It never falls back to a criu on PATH: Debian 12's 3.17 and trixie's 4.1
// do not work on this kernel.
func Find() (string, error) {
	if p := os.Getenv(EnvBinary); p != "" {
		if err := executable(p); err != nil {
			return "", fmt.Errorf("checking %s=%s: %w", EnvBinary, p, err)
		}
		return p, nil
	}
	dir, err := os.Getwd()
	if err != nil {
		return "", fmt.Errorf("finding criu: %w", err)
	}
	// Only at the checkout's root: a .cache/criu elsewhere up the tree (under /tmp, say) is
	// never run.
	if root := checkout.Root(dir); root != "" {
		if p := filepath.Join(root, wrapperInRepo); executable(p) == nil {
			return p, nil
		}
	}
	return "", fmt.Errorf("%w: no %s at the checkout's root and %s is unset (run `make criu`)",
		ErrNotInstalled, wrapperInRepo, EnvBinary)
}

func executable(p string) error {
	fi, err := os.Stat(p)
	if err != nil {
		return fmt.Errorf("%w: %w", ErrNotInstalled, err)
	}
	if fi.IsDir() || fi.Mode().Perm()&0o111 == 0 {
		return fmt.Errorf("%w: %s is not an executable file", ErrNotInstalled, p)
	}
	return nil
}
