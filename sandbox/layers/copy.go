package layers

import (
	"fmt"
	"os"
	"path/filepath"

	"golang.org/x/sys/unix"
)

// copyTree copies the tree at src into dst, an existing directory, the way
// `cp -a` would but in-process (a checkpoint of a sandbox with live
// processes copies its upper, and starting cp cost more than copying a
// small upper): file types (whiteouts are character devices), owners,
// modes, times, every extended attribute (overlayfs's trusted.overlay.*
// included), and hard links within the tree. Symbolic links are copied,
// never followed. The tree must not change meanwhile (its writers are
// frozen).
func copyTree(src, dst string) error {
	links := map[[2]uint64]string{}
	var walk func(src, dst string, st *unix.Stat_t, exists bool) error
	walk = func(src, dst string, st *unix.Stat_t, exists bool) error {
		if !exists {
			if err := unix.Mkdir(dst, 0o700); err != nil {
				return &os.PathError{Op: "mkdir", Path: dst, Err: err}
			}
		}
		f, err := os.Open(src)
		if err != nil {
			return err
		}
		names, err := f.Readdirnames(-1)
		f.Close()
		if err != nil {
			return err
		}
		for _, n := range names {
			s, d := filepath.Join(src, n), filepath.Join(dst, n)
			var cst unix.Stat_t
			if err := unix.Lstat(s, &cst); err != nil {
				return &os.PathError{Op: "lstat", Path: s, Err: err}
			}
			if cst.Mode&unix.S_IFMT == unix.S_IFDIR {
				if err := walk(s, d, &cst, false); err != nil {
					return err
				}
				continue
			}
			key := [2]uint64{cst.Dev, cst.Ino}
			if first, ok := links[key]; ok && cst.Nlink > 1 {
				if err := unix.Link(first, d); err != nil {
					return &os.PathError{Op: "link", Path: d, Err: err}
				}
				continue
			}
			if err := copyEntry(s, d, &cst, true); err != nil {
				return fmt.Errorf("copying %s: %w", s, err)
			}
			if cst.Nlink > 1 {
				links[key] = d
			}
		}
		// Last, so that the directory's times survive its children.
		return copyMeta(src, dst, st, true)
	}
	var st unix.Stat_t
	if err := unix.Lstat(src, &st); err != nil {
		return &os.PathError{Op: "lstat", Path: src, Err: err}
	}
	return walk(src, dst, &st, true)
}
