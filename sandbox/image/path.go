package image

import (
	"fmt"
	"path"
	"strings"
)

// cleanEntryName returns the cleaned, layer-relative form of a tar entry name ("." for the
// layer root). Absolute names, names with a ".." component and names holding a NUL byte are
// refused with ErrUnsafePath rather than rewritten: a layer that names them is hostile or
// broken.
func cleanEntryName(name string) (string, error) {
	switch {
	case name == "":
		return "", fmt.Errorf("empty entry name: %w", ErrUnsafePath)
	case strings.IndexByte(name, 0) >= 0:
		return "", fmt.Errorf("entry name %q holds a NUL byte: %w", name, ErrUnsafePath)
	case strings.HasPrefix(name, "/"):
		return "", fmt.Errorf("absolute entry name %q: %w", name, ErrUnsafePath)
	}
	for _, c := range strings.Split(name, "/") {
		if c == ".." {
			return "", fmt.Errorf("entry name %q has a .. component: %w", name, ErrUnsafePath)
		}
	}
	return path.Clean(name), nil
}
