package sandbox

import (
	"fmt"
	"strings"
)

// Checks of a request that the runtime makes before anything runs, exported so that callers
// that do something first (a restore before a step) can refuse the whole request up front.

// CheckSessionName refuses a session name the runtime would refuse.
func CheckSessionName(name string) error {
	if !sessionNameRE.MatchString(name) {
		return fmt.Errorf("%w: session name %.80q: use 1-64 letters, digits, '_', '.', '-'", ErrInvalid, name)
	}
	return nil
}

// maxPath is the longest path a file operation takes.
const maxPath = 4096

// CheckPath refuses a file path the runtime would refuse whatever the sandbox holds: empty,
// with a NUL byte, or longer than 4096 bytes.
func CheckPath(path string) error {
	switch {
	case path == "":
		return fmt.Errorf("%w: empty path", ErrInvalid)
	case strings.IndexByte(path, 0) >= 0:
		return fmt.Errorf("%w: path %.80q has a NUL byte", ErrInvalid, path)
	case len(path) > maxPath:
		return fmt.Errorf("%w: path of %d bytes: at most %d", ErrInvalid, len(path), maxPath)
	}
	return nil
}
