package sandbox

import (
	"errors"
	"fmt"
	"strconv"

	"golang.org/x/sys/unix"
)

// shmSync makes a directory tree the same as another, by descriptors
// alone: every entry is reached below its parent's descriptor without
// following a symlink, and a regular file is opened (O_NOFOLLOW,
// O_NONBLOCK) and checked again before its contents are read or written.
// It carries regular files, directories, symlinks and FIFOs; sockets and
// device nodes are left out. Neither tree runs anything meanwhile (the
// sandbox's processes are stopped or gone), but a name the other side
// swapped all the same is at worst refused, never followed.
type shmSync struct {
	// shift is added to every owner id: -hostID into a checkpoint's layer
	// (ids relative to the sandbox's range), +hostID out of it.
	shift int64
	// deep: refuse a source nested deeper than shmDepth (a checkpoint's
	// copy; a restore's source is such a copy).
	deep bool
	// top is the destination's root: a directory to remove that is
	// nested deeper than shmDepth is moved there and removed from there,
	// so that removing holds at most shmDepth descriptors. -1 for none (a
	// fresh destination has nothing to remove).
	top   int
	moved []string
	seq   int
}

// tree makes directory dst hold what src holds (nothing, and the
// attributes of a fresh /dev/shm, for src -1), dst's own attributes
// included.
func (y *shmSync) tree(src, dst, depth int) error {
	if y.deep && depth > shmDepth {
		return fmt.Errorf("%w: /dev/shm nests directories more than %d deep", ErrUncopyable, shmDepth)
	}
	want := map[string]unix.Stat_t{}
	var srcNames []string
	if src >= 0 {
		var err error
		if srcNames, err = dirNames(src); err != nil {
			return err
		}
	}
	for _, n := range srcNames {
		var st unix.Stat_t
		if unix.Fstatat(src, n, &st, unix.AT_SYMLINK_NOFOLLOW) != nil || !carried(st.Mode) {
			continue
		}
		want[n] = st
	}
	keep, err := y.prune(dst, want, depth)
	if err != nil {
		return err
	}
	for _, n := range srcNames {
		st, ok := want[n]
		if !ok {
			continue
		}
		if err := y.entry(src, dst, n, &st, keep[n], depth); err != nil {
			return fmt.Errorf("%q: %w", n, err)
		}
	}
	if depth == 0 {
		if err := y.drain(dst); err != nil {
			return err
		}
	}
	if src < 0 {
		// A fresh /dev/shm: mode 1777, owned by the sandbox's root.
		return y.attrs(dst, &unix.Stat_t{Mode: unix.S_IFDIR | 0o1777})
	}
	var st unix.Stat_t
	if err := unix.Fstat(src, &st); err != nil {
		return err
	}
	return y.attrs(dst, &st)
}

// prune removes the entries of dst that want does not have as they are
// (same name and type, a regular file with no other name), and returns the
// names kept.
func (y *shmSync) prune(dst int, want map[string]unix.Stat_t, depth int) (map[string]bool, error) {
	names, err := dirNames(dst)
	if err != nil {
		return nil, err
	}
	keep := map[string]bool{}
	for _, n := range names {
		var st unix.Stat_t
		if err := unix.Fstatat(dst, n, &st, unix.AT_SYMLINK_NOFOLLOW); err != nil {
			continue
		}
		if w, ok := want[n]; ok && sameKind(&w, &st) {
			keep[n] = true
			continue
		}
		if err := y.remove(dst, n, st.Mode, depth); err != nil {
			return nil, err
		}
	}
	return keep, nil
}

// drain removes the directories moved up to top (remove), and those their
// removal moves up in turn.
func (y *shmSync) drain(top int) error {
	for len(y.moved) > 0 {
		n := y.moved[len(y.moved)-1]
		y.moved = y.moved[:len(y.moved)-1]
		if err := y.remove(top, n, unix.S_IFDIR, 0); err != nil {
			return err
		}
	}
	return nil
}

// carried reports whether an entry of this mode is carried.
func carried(mode uint32) bool {
	switch mode & unix.S_IFMT {
	case unix.S_IFREG, unix.S_IFDIR, unix.S_IFLNK, unix.S_IFIFO:
		return true
	}
	return false
}

// sameKind reports whether entry have can be made into want in place: the
// same type, not a symlink (written anew), and for a regular file no other
// name (a rewrite in place would change that name too).
func sameKind(want, have *unix.Stat_t) bool {
	t := want.Mode & unix.S_IFMT
	if t != have.Mode&unix.S_IFMT || t == unix.S_IFLNK {
		return false
	}
	return t != unix.S_IFREG || have.Nlink == 1
}

// entry makes name in dst what it is in src (st); exists: dst has it
// already, of the same kind.
func (y *shmSync) entry(src, dst int, name string, st *unix.Stat_t, exists bool, depth int) error {
	switch st.Mode & unix.S_IFMT {
	case unix.S_IFREG:
		return y.file(src, dst, name, exists)
	case unix.S_IFDIR:
		if !exists {
			if err := unix.Mkdirat(dst, name, 0o700); err != nil {
				return err
			}
		}
		sfd, err := openDir(src, name)
		if err != nil {
			return err
		}
		defer unix.Close(sfd)
		dfd, err := openDir(dst, name)
		if err != nil {
			return err
		}
		defer unix.Close(dfd)
		return y.tree(sfd, dfd, depth+1)
	case unix.S_IFLNK:
		buf := make([]byte, unix.PathMax)
		n, err := unix.Readlinkat(src, name, buf)
		if err != nil {
			return err
		}
		if err := unix.Symlinkat(string(buf[:n]), dst, name); err != nil {
			return err
		}
	case unix.S_IFIFO:
		if !exists {
			if err := unix.Mknodat(dst, name, unix.S_IFIFO|0o600, 0); err != nil {
				return err
			}
		}
	}
	if err := unix.Fchownat(dst, name, y.id(st.Uid), y.id(st.Gid), unix.AT_SYMLINK_NOFOLLOW); err != nil {
		return err
	}
	if st.Mode&unix.S_IFMT == unix.S_IFIFO {
		// Not opened: an open of a FIFO waits for its other end. The
		// name was made or checked a FIFO above, and nothing runs that
		// could swap it meanwhile.
		if err := unix.Fchmodat(dst, name, st.Mode&0o7777, 0); err != nil {
			return err
		}
	}
	return unix.UtimesNanoAt(dst, name, []unix.Timespec{st.Atim, st.Mtim}, unix.AT_SYMLINK_NOFOLLOW)
}

// file makes regular file name in dst a copy of src's: rewritten in place
// if it exists (a frozen template may map that very inode), else created.
func (y *shmSync) file(src, dst int, name string, exists bool) error {
	in, err := unix.Openat(src, name, unix.O_RDONLY|unix.O_NOFOLLOW|unix.O_NONBLOCK|unix.O_CLOEXEC, 0)
	if err != nil {
		return err
	}
	defer unix.Close(in)
	var st unix.Stat_t
	if err := unix.Fstat(in, &st); err != nil {
		return err
	}
	if st.Mode&unix.S_IFMT != unix.S_IFREG {
		return fmt.Errorf("%w: not a regular file", ErrUncopyable)
	}
	out := -1
	if exists {
		out, err = openRegular(dst, name, unix.O_WRONLY|unix.O_TRUNC)
		if err != nil {
			// Refused in place (a lease, say): a new file instead.
			if err := unix.Unlinkat(dst, name, 0); err != nil {
				return err
			}
			out = -1
		}
	}
	if out < 0 {
		if out, err = unix.Openat(dst, name, unix.O_WRONLY|unix.O_CREAT|unix.O_EXCL|unix.O_NOFOLLOW|unix.O_CLOEXEC, 0o600); err != nil {
			return err
		}
	}
	defer unix.Close(out)
	if err := copyData(out, in, st.Size); err != nil {
		return err
	}
	return y.attrs(out, &st)
}

// openRegular opens name below dir with flags, refusing anything but a
// regular file with one name.
func openRegular(dir int, name string, flags int) (int, error) {
	fd, err := unix.Openat(dir, name, flags|unix.O_NOFOLLOW|unix.O_NONBLOCK|unix.O_CLOEXEC, 0)
	if err != nil {
		return -1, err
	}
	var st unix.Stat_t
	if err := unix.Fstat(fd, &st); err != nil || st.Mode&unix.S_IFMT != unix.S_IFREG || st.Nlink != 1 {
		unix.Close(fd)
		return -1, errors.Join(err, unix.EINVAL)
	}
	return fd, nil
}

// attrs gives the open file or directory fd the owner, mode and times of
// st (the owner first: a chown clears set-id bits).
func (y *shmSync) attrs(fd int, st *unix.Stat_t) error {
	if err := unix.Fchown(fd, y.id(st.Uid), y.id(st.Gid)); err != nil {
		return err
	}
	if err := unix.Fchmod(fd, st.Mode&0o7777); err != nil {
		return err
	}
	if st.Mtim == (unix.Timespec{}) {
		return nil // a fresh /dev/shm's: its times are the restore's
	}
	return unix.UtimesNanoAt(fd, "", []unix.Timespec{st.Atim, st.Mtim}, unix.AT_EMPTY_PATH)
}

// id shifts an owner id; one outside the sandbox's range (none the
// sandbox can make) becomes its nobody.
func (y *shmSync) id(v uint32) int {
	n := int64(v) + y.shift
	if y.shift < 0 && (n < 0 || n >= idRange) {
		n = 65534
	}
	return int(n)
}

// remove removes name (of mode) from dir, with whatever it holds.
func (y *shmSync) remove(dir int, name string, mode uint32, depth int) error {
	if mode&unix.S_IFMT != unix.S_IFDIR {
		return ignoreGone(unix.Unlinkat(dir, name, 0))
	}
	err := unix.Unlinkat(dir, name, unix.AT_REMOVEDIR)
	if !errors.Is(err, unix.ENOTEMPTY) && !errors.Is(err, unix.EEXIST) {
		return ignoreGone(err)
	}
	if depth >= shmDepth && y.top >= 0 {
		for {
			y.seq++
			up := ".dg-shm-removed-" + strconv.Itoa(y.seq)
			err := unix.Renameat2(dir, name, y.top, up, unix.RENAME_NOREPLACE)
			if errors.Is(err, unix.EEXIST) {
				continue
			}
			if err != nil {
				return err
			}
			y.moved = append(y.moved, up)
			return nil
		}
	}
	fd, err := openDir(dir, name)
	if err != nil {
		return ignoreGone(err)
	}
	err = y.removeEntries(fd, depth+1)
	unix.Close(fd)
	if err != nil {
		return err
	}
	return ignoreGone(unix.Unlinkat(dir, name, unix.AT_REMOVEDIR))
}

// removeEntries removes every entry of directory fd.
func (y *shmSync) removeEntries(fd, depth int) error {
	names, err := dirNames(fd)
	if err != nil {
		return err
	}
	for _, n := range names {
		var st unix.Stat_t
		if err := unix.Fstatat(fd, n, &st, unix.AT_SYMLINK_NOFOLLOW); err != nil {
			continue
		}
		if err := y.remove(fd, n, st.Mode, depth); err != nil {
			return err
		}
	}
	return nil
}

func ignoreGone(err error) error {
	if errors.Is(err, unix.ENOENT) {
		return nil
	}
	return err
}

func openDir(dir int, name string) (int, error) {
	return unix.Openat(dir, name, unix.O_RDONLY|unix.O_DIRECTORY|unix.O_NOFOLLOW|unix.O_CLOEXEC, 0)
}

// dirNames lists directory fd from its start, without . and ..
func dirNames(fd int) ([]string, error) {
	if _, err := unix.Seek(fd, 0, 0); err != nil {
		return nil, err
	}
	return dirNamesHere(fd)
}

// dirNamesHere lists directory fd from its offset, without . and ..
func dirNamesHere(fd int) ([]string, error) {
	var names []string
	buf := make([]byte, 8192)
	for {
		n, err := unix.Getdents(fd, buf)
		if err != nil {
			return nil, err
		}
		if n == 0 {
			return names, nil
		}
		_, _, names = unix.ParseDirent(buf[:n], -1, names)
	}
}

// copyData copies the size bytes of in into out (empty): the data
// regions only, so holes stay holes.
func copyData(out, in int, size int64) error {
	for off := int64(0); off < size; {
		data, err := unix.Seek(in, off, unix.SEEK_DATA)
		if errors.Is(err, unix.ENXIO) {
			break // a hole to the end
		}
		if err != nil {
			return err
		}
		hole, err := unix.Seek(in, data, unix.SEEK_HOLE)
		if err != nil {
			return err
		}
		if _, err := unix.Seek(out, data, 0); err != nil {
			return err
		}
		for data < hole {
			n, err := unix.Sendfile(out, in, &data, int(min(hole-data, 1<<30)))
			if err != nil {
				return err
			}
			if n == 0 {
				break // shrunk meanwhile
			}
		}
		off = hole
	}
	return unix.Ftruncate(out, size)
}
