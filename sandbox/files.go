package sandbox

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"strings"

	"golang.org/x/sys/unix"

	"github.com/deltagym/deltagym/sandbox/fscred"
)

// File actions run in the server, not in the sandbox: every path is resolved
// with openat2 against the sandbox's root (/proc/<init>/root) with
// RESOLVE_IN_ROOT (so "..", absolute symlinks and symlink races stay inside
// the root), RESOLVE_NO_MAGICLINKS and RESOLVE_NO_XDEV (so /proc, /dev and
// any other mount are out of reach: only the sandbox's own filesystem). The
// thread doing it takes the sandbox user's host uid and gid as fsuid/fsgid,
// so permissions and the owner of new files are those of the sandbox's user.

// MaxFileBytes caps one read or write.
const MaxFileBytes = 64 << 20

const resolve = unix.RESOLVE_IN_ROOT | unix.RESOLVE_NO_MAGICLINKS | unix.RESOLVE_NO_XDEV

// ReadFile reads up to max bytes (0: up to MaxFileBytes) of path from
// offset, and returns them with the file's size.
func (s *Sandbox) ReadFile(ctx context.Context, path string, offset, max int64) ([]byte, int64, error) {
	if offset < 0 || max < 0 {
		return nil, 0, fmt.Errorf("%w: negative offset or length", ErrInvalid)
	}
	if max == 0 || max > MaxFileBytes {
		max = MaxFileBytes
	}
	var data []byte
	var size int64
	err := s.fileOp(path, func(root int, rel string) error {
		fd, err := unix.Openat2(root, rel, &unix.OpenHow{Flags: unix.O_RDONLY | unix.O_CLOEXEC | unix.O_NOCTTY | unix.O_NONBLOCK, Resolve: resolve})
		if err != nil {
			return err
		}
		defer unix.Close(fd)
		if size, err = regularSize(fd, path); err != nil {
			return err
		}
		n := min(max, size-offset)
		if n <= 0 {
			data = []byte{}
			return nil
		}
		data = make([]byte, n)
		k, err := preadFull(fd, data, offset)
		data = data[:k]
		return err
	})
	return data, size, err
}

// WriteFile writes data to path (creating missing parent directories),
// replacing its contents or appending to them. mode applies to a new file
// (0 means 0644).
func (s *Sandbox) WriteFile(ctx context.Context, path string, data []byte, mode os.FileMode, appendTo bool) error {
	if len(data) > MaxFileBytes {
		return fmt.Errorf("%w: write of %d bytes exceeds the file cap of %d bytes; write the file in parts (append)", ErrInvalid, len(data), MaxFileBytes)
	}
	if mode == 0 {
		mode = 0o644
	}
	if mode&^os.ModePerm != 0 {
		return fmt.Errorf("%w: mode %o has bits other than permissions", ErrInvalid, mode)
	}
	flags := unix.O_WRONLY | unix.O_CREAT | unix.O_CLOEXEC | unix.O_NOCTTY | unix.O_NONBLOCK
	if appendTo {
		flags |= unix.O_APPEND
	} else {
		flags |= unix.O_TRUNC
	}
	how := &unix.OpenHow{Flags: uint64(flags), Mode: uint64(mode), Resolve: resolve}
	return s.fileOp(path, func(root int, rel string) error {
		// Parents are made only when the open finds one missing: most
		// writes go to existing directories.
		fd, err := unix.Openat2(root, rel, how)
		if errors.Is(err, unix.ENOENT) && strings.IndexByte(rel, '/') >= 0 {
			if err := mkdirAll(root, rel); err != nil {
				return err
			}
			fd, err = unix.Openat2(root, rel, how)
		}
		if err != nil {
			return err
		}
		_, err = regularSize(fd, path)
		if err == nil {
			err = writeFull(fd, data)
		}
		return errors.Join(err, unix.Close(fd))
	})
}

// regularSize returns the size of the open file fd, or a *FileError if it
// is not a regular file (EISDIR for a directory, else EINVAL). File actions
// use raw descriptors, not os.File, which would ask the poller to take each
// one (refused for regular files).
func regularSize(fd int, path string) (int64, error) {
	var st unix.Stat_t
	if err := unix.Fstat(fd, &st); err != nil {
		return 0, err
	}
	switch st.Mode & unix.S_IFMT {
	case unix.S_IFREG:
	case unix.S_IFDIR:
		return 0, &FileError{Path: path, Errno: unix.EISDIR, Msg: "is a directory", class: ErrInvalid}
	default:
		return 0, &FileError{Path: path, Errno: unix.EINVAL, Msg: fileType(st.Mode) + ", not a regular file", class: ErrInvalid}
	}
	return st.Size, nil
}

// fileType names the type of a file that is not a regular file or a
// directory.
func fileType(mode uint32) string {
	switch mode & unix.S_IFMT {
	case unix.S_IFLNK:
		return "a symbolic link"
	case unix.S_IFIFO:
		return "a FIFO"
	case unix.S_IFSOCK:
		return "a socket"
	case unix.S_IFCHR:
		return "a character device"
	case unix.S_IFBLK:
		return "a block device"
	}
	return "a special file"
}

// preadFull reads into b from offset until b is full or the file ends.
func preadFull(fd int, b []byte, offset int64) (int, error) {
	n := 0
	for n < len(b) {
		k, err := unix.Pread(fd, b[n:], offset+int64(n))
		if err == unix.EINTR {
			continue
		}
		if err != nil {
			return n, err
		}
		if k == 0 {
			break
		}
		n += k
	}
	return n, nil
}

// writeFull writes all of b to fd.
func writeFull(fd int, b []byte) error {
	for len(b) > 0 {
		k, err := unix.Write(fd, b)
		if err == unix.EINTR {
			continue
		}
		if err != nil {
			return err
		}
		if k == 0 {
			return io.ErrShortWrite
		}
		b = b[k:]
	}
	return nil
}

// mkdirAll creates the missing parents of rel. Each prefix is resolved
// from the root (so a symlink among the parents resolves as the sandbox
// would resolve it), and a missing one is made relative to its parent's
// verified fd.
func mkdirAll(root int, rel string) error {
	parts := strings.Split(rel, "/")
	how := &unix.OpenHow{Flags: unix.O_PATH | unix.O_DIRECTORY | unix.O_CLOEXEC, Resolve: resolve}
	for i := range len(parts) - 1 {
		if parts[i] == "" || parts[i] == "." || parts[i] == ".." {
			continue
		}
		prefix := strings.Join(parts[:i+1], "/")
		fd, err := unix.Openat2(root, prefix, how)
		if err == nil {
			unix.Close(fd)
			continue
		}
		if !errors.Is(err, unix.ENOENT) {
			return err
		}
		parent := "."
		if i > 0 {
			parent = strings.Join(parts[:i], "/")
		}
		pfd, err := unix.Openat2(root, parent, how)
		if err != nil {
			return err
		}
		err = unix.Mkdirat(pfd, parts[i], 0o755)
		unix.Close(pfd)
		if err != nil && !errors.Is(err, unix.EEXIST) {
			return err
		}
	}
	return nil
}

// fileOp runs fn on a thread with the sandbox user's fsuid, with an fd of
// the sandbox's root and path made relative to it.
func (s *Sandbox) fileOp(path string, fn func(root int, rel string) error) error {
	return s.fileOpIn(path, false, fn)
}

// fileOpIn is fileOp; with orRoot, a path that names the sandbox's root
// itself is given to fn as "", else it is refused.
func (s *Sandbox) fileOpIn(path string, orRoot bool, fn func(root int, rel string) error) error {
	if err := CheckPath(path); err != nil {
		return err
	}
	if !strings.HasPrefix(path, "/") {
		// Relative paths are relative to the sandbox's working directory.
		path = s.cwd("") + "/" + path
	}
	rel := strings.TrimLeft(path, "/")
	if rel == "" && !orRoot {
		return fmt.Errorf("%w: %s is a directory", ErrInvalid, path)
	}
	_, err := s.beginExec()
	defer s.op.RUnlock()
	if err != nil {
		return err
	}
	uid, gid := s.hostID+int(s.spec.UID), s.hostID+int(s.spec.GID)
	// Only what fn meets on the sandbox's filesystem is a *FileError; the
	// failures of reaching the root or taking the user's ids are the host's.
	op := func(root int, rel string) error { return fileError(path, fn(root, rel)) }
	// openat2 fails with EAGAIN when a rename races the lookup: retry.
	for try := 0; try < 8; try++ {
		if err = s.fileOpOnce(uid, gid, rel, op); !errors.Is(err, unix.EAGAIN) {
			break
		}
	}
	return err
}

// fileErrors words the errnos that the sandbox's filesystem gives a file
// action, with their class (ErrInvalid where none is given). Other errnos
// (EIO, EMFILE, ENOMEM, …) are the host's, and stay bare.
var fileErrors = map[unix.Errno]struct {
	msg   string
	class error
}{
	unix.ENOENT:       {"no such file or directory", ErrNotFound},
	unix.EISDIR:       {"is a directory", nil},
	unix.ENOTDIR:      {"a parent is not a directory", nil},
	unix.EACCES:       {"permission denied", nil},
	unix.EPERM:        {"operation not permitted", nil},
	unix.EXDEV:        {"leaves the sandbox's filesystem", nil},
	unix.ELOOP:        {"leaves the sandbox's filesystem (or too many symbolic links)", nil},
	unix.ENXIO:        {"a socket, or a FIFO with no reader: not a regular file", nil},
	unix.ETXTBSY:      {"a running program's file (text file busy)", nil},
	unix.ENOSPC:       {"the sandbox's writable layer is full", ErrBudget},
	unix.EDQUOT:       {"the sandbox's writable layer is full", ErrBudget},
	unix.EFBIG:        {"file too large", nil},
	unix.EMLINK:       {"too many links", nil},
	unix.EROFS:        {"read-only file system", nil},
	unix.ENAMETOOLONG: {"name too long", nil},
	unix.EAGAIN:       {"changed while being resolved; try again", nil},
	unix.EEXIST:       {"already exists", nil},
	unix.ENOTEMPTY:    {"directory not empty", nil},
	unix.EBUSY:        {"a mount point, or in use", nil},
}

// fileError turns err, a file action's failure on path, into a *FileError
// when the sandbox's filesystem gave it (fileErrors); other errors return
// as they are.
func fileError(path string, err error) error {
	var fe *FileError
	if err == nil || errors.As(err, &fe) {
		return err
	}
	var en unix.Errno
	if !errors.As(err, &en) {
		return err
	}
	e, ok := fileErrors[en]
	if !ok {
		return err
	}
	return &FileError{Path: path, Errno: en, Msg: e.msg, class: cmp.Or(e.class, ErrInvalid)}
}

// fileOpOnce runs fn on the sandbox's root (opened as host root: the init
// runs as the range's root, which the user's fsuid may not inspect) with the
// user's fsuid; the sandbox's root keeps its file capabilities, since it may
// write any file of its own filesystem.
func (s *Sandbox) fileOpOnce(uid, gid int, rel string, fn func(int, string) error) error {
	return s.withRootFor(rel, func(root int) error {
		return fscred.Run(uid, gid, uid == s.hostID, func() error { return fn(root, rel) })
	})
}
