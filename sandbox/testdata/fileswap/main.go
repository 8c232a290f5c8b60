// Command fileswap races the server's tree actions from inside a sandbox: it keeps swapping
// each DIR/dK with DIR/sK (K below N), one a directory tree and the other a symlink to a
// TARGET (the Kth, cycling), with renameat2's RENAME_EXCHANGE (atomic, as fast as the kernel
// goes), putting back what a removal took, until killed.
//
// Usage: fileswap DIR N TARGET...
package main

import (
	"fmt"
	"os"
	"path/filepath"
	"strconv"

	"golang.org/x/sys/unix"
)

func main() {
	n, err := strconv.Atoi(os.Args[min(2, len(os.Args)-1)])
	if len(os.Args) < 4 || err != nil || n < 1 {
		fmt.Fprintln(os.Stderr, "usage: fileswap DIR N TARGET...")
		os.Exit(2)
	}
	dir, targets := os.Args[1], os.Args[3:]
	for i := 0; ; i++ {
		k := strconv.Itoa(i % n)
		if i%(4*n) == 0 {
			for k := range n {
				heal(dir, k, targets[k%len(targets)])
			}
		}
		_ = unix.Renameat2(unix.AT_FDCWD, filepath.Join(dir, "s"+k), unix.AT_FDCWD, filepath.Join(dir, "d"+k), unix.RENAME_EXCHANGE)
	}
}

// heal puts back what a removal took of pair k: DIR itself, the directory (with a file and a
// subdirectory holding one) and the symlink to target.
func heal(dir string, k int, target string) {
	_ = os.MkdirAll(dir, 0o755)
	d, s := filepath.Join(dir, "d"+strconv.Itoa(k)), filepath.Join(dir, "s"+strconv.Itoa(k))
	di, derr := os.Lstat(d)
	si, serr := os.Lstat(s)
	switch {
	case derr == nil && serr == nil:
	case derr != nil && serr != nil:
		_ = os.Symlink(target, s)
		_ = os.Mkdir(d, 0o755)
	case derr != nil && si.IsDir(), serr != nil && di.IsDir():
		_ = os.Symlink(target, d)
		_ = os.Symlink(target, s)
	default:
		_ = os.Mkdir(d, 0o755)
		_ = os.Mkdir(s, 0o755)
	}
	for _, p := range []string{d, s} {
		if fi, err := os.Lstat(p); err == nil && fi.IsDir() {
			_ = os.Mkdir(filepath.Join(p, "keep"), 0o755)
			_ = os.WriteFile(filepath.Join(p, "keep", "f"), []byte("x"), 0o644)
			_ = os.WriteFile(filepath.Join(p, "f"), []byte("x"), 0o644)
		}
	}
}
