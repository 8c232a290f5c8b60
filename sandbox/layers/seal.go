package layers

import (
	"errors"
	"fmt"
	"os"
	"path/filepath"

	"golang.org/x/sys/unix"
)

// moveUpper makes fs/ of layer directory d from its upper: a fresh
// directory with the upper root's owner, mode, times and xattrs (not
// overlayfs's marks), holding the upper's entries, moved. A layer written
// directly into fs/ (a copy, a merge) is left as it is, and moved is false.
func moveUpper(d string) (moved bool, err error) {
	fs, up := filepath.Join(d, "fs"), filepath.Join(d, UpperDir)
	if _, err := os.Lstat(fs); err == nil {
		return false, nil
	}
	var st unix.Stat_t
	if err := unix.Lstat(up, &st); err != nil {
		return false, &os.PathError{Op: "lstat", Path: up, Err: err}
	}
	if err := makeRoot(d, 0o700); err != nil { // the spare: no inode of the sandbox's
		return false, err
	}
	err = moveEntries(up, fs)
	if err == nil {
		// Last: the moves changed fs/'s times.
		err = copyMeta(up, fs, &st, false)
	}
	if err != nil {
		if uerr := unmoveUpper(d); uerr != nil {
			err = errors.Join(err, uerr)
		}
		return false, fmt.Errorf("moving the upper into the layer: %w", err)
	}
	return true, nil
}

// unmoveUpper undoes moveUpper: fs/'s entries go back to the upper, and fs/
// becomes the layer's spare again, for its next seal.
func unmoveUpper(d string) error {
	fs := filepath.Join(d, "fs")
	if err := moveEntries(fs, filepath.Join(d, UpperDir)); err != nil {
		return err
	}
	if err := unix.Rename(fs, filepath.Join(d, spareDir)); err != nil {
		return &os.PathError{Op: "rename", Path: fs, Err: err}
	}
	return nil
}

// indexLinks returns the names in the overlay index directory dir that link
// to a file with other names: a copied-up hard-linked file. Those links
// would count in the file's link count once the layer is a lower. An entry
// that is a file's only name stays (the overlay may hold the inode;
// unlinking it would make the remount fail with EBUSY), and so does the
// overlay's shared whiteout; neither is in fs/. A missing or unreadable
// index has none.
func indexLinks(dir string) []string {
	fd, err := unix.Open(dir, unix.O_RDONLY|unix.O_DIRECTORY|unix.O_CLOEXEC, 0)
	if err != nil {
		return nil
	}
	defer unix.Close(fd)
	names, _ := readNames(fd)
	var links []string
	for _, n := range names {
		var st unix.Stat_t
		if unix.Fstatat(fd, n, &st, unix.AT_SYMLINK_NOFOLLOW) == nil &&
			st.Mode&unix.S_IFMT != unix.S_IFDIR && st.Mode&unix.S_IFMT != unix.S_IFCHR && st.Nlink > 1 {
			links = append(links, n)
		}
	}
	return links
}

// moveEntries renames every entry of directory src into directory dst.
func moveEntries(src, dst string) error {
	sfd, err := unix.Open(src, unix.O_RDONLY|unix.O_DIRECTORY|unix.O_CLOEXEC, 0)
	if err != nil {
		return &os.PathError{Op: "open", Path: src, Err: err}
	}
	defer unix.Close(sfd)
	dfd, err := unix.Open(dst, unix.O_PATH|unix.O_DIRECTORY|unix.O_CLOEXEC, 0)
	if err != nil {
		return &os.PathError{Op: "open", Path: dst, Err: err}
	}
	defer unix.Close(dfd)
	names, err := readNames(sfd)
	if err != nil {
		return &os.PathError{Op: "readdir", Path: src, Err: err}
	}
	for _, n := range names {
		if err := unix.Renameat(sfd, n, dfd, n); err != nil {
			return &os.PathError{Op: "rename", Path: filepath.Join(src, n), Err: err}
		}
	}
	return nil
}

// readNames lists directory fd (without . and ..).
func readNames(fd int) ([]string, error) {
	var names []string
	buf := make([]byte, 4096)
	for {
		n, err := unix.Getdents(fd, buf)
		if err != nil {
			return nil, err
		}
		if n <= 0 {
			return names, nil
		}
		_, _, names = unix.ParseDirent(buf[:n], -1, names)
	}
}
