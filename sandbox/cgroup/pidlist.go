package cgroup

import (
	"bytes"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"os"
	"strconv"
	"sync"

	"golang.org/x/sys/unix"
)

// PidList lists a group's processes, its sub-groups' included, as Pids does,
// from file descriptors it keeps open: the directory and cgroup.procs of the
// group and of each sub-group it has met. A listing is then a pread and a
// getdents per group instead of opening and closing both, which costs
// several times as much (BenchmarkPids; what is left is mostly getdents
// going through every control file of each directory). A checkpoint with
// processes lists its command group twice.
//
// A group removed since is skipped (a sub-group) or reported as ErrNotExist
// (the group itself); one removed and made again under the same name is
// opened again.
//
// On a cgroup v1 tracking hierarchy cgroup.procs is opened at each listing
// (relative to the kept directory): v1 answers a re-read of an open
// cgroup.procs from the list it built at the first read, for up to a second.
type PidList struct {
	mu sync.Mutex
	// +checklocks:mu
	c *Cgroup
	// +checklocks:mu
	root *pidDir
	// +checklocks:mu
	buf []byte
}

// pidDir is one group's directory and cgroup.procs (-1 on v1), and its
// sub-groups'.
type pidDir struct {
	dir, procs int
	kids       map[string]*pidDir
	seen       bool // in the current listing
}

// OpenPids opens the group's process list. Close it when done.
func (c *Cgroup) OpenPids() (*PidList, error) {
	d, err := openPidDir(unix.AT_FDCWD, c.track, c.trackV2)
	if err != nil {
		return nil, c.wrap("opening the process list of", err)
	}
	return &PidList{c: c, root: d, buf: make([]byte, 4096)}, nil
}

func openPidDir(at int, name string, keepProcs bool) (*pidDir, error) {
	dfd, err := openatRetry(at, name, unix.O_RDONLY|unix.O_DIRECTORY|unix.O_CLOEXEC)
	if err != nil {
		return nil, &os.PathError{Op: "open", Path: name, Err: err}
	}
	d := &pidDir{dir: dfd, procs: -1, kids: map[string]*pidDir{}}
	if keepProcs {
		if d.procs, err = openatRetry(dfd, "cgroup.procs", unix.O_RDONLY|unix.O_CLOEXEC); err != nil {
			unix.Close(dfd)
			return nil, &os.PathError{Op: "open", Path: name + "/cgroup.procs", Err: err}
		}
	}
	return d, nil
}

func openatRetry(at int, name string, flags int) (int, error) {
	for {
		fd, err := unix.Openat(at, name, flags, 0)
		if err != unix.EINTR {
			return fd, err
		}
	}
}

func (d *pidDir) close() {
	for _, k := range d.kids {
		k.close()
	}
	if d.procs >= 0 {
		unix.Close(d.procs)
	}
	unix.Close(d.dir)
}

// groupGone reports whether err says that a group's files went with the group.
func groupGone(err error) bool {
	return errors.Is(err, unix.ENODEV) || errors.Is(err, unix.ENOENT)
}

// Pids lists the processes of the group and all its sub-groups.
func (l *PidList) Pids() ([]int, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	if l.root == nil {
		return nil, errors.New("listing processes with a closed process list")
	}
	out, err := l.walk(l.root, nil)
	if groupGone(err) {
		err = fmt.Errorf("%w: %w", os.ErrNotExist, err)
	}
	return out, l.c.wrap("listing processes of", err)
}

// walk appends the processes of d and its sub-groups to out.
// +checklocks:l.mu
func (l *PidList) walk(d *pidDir, out []int) ([]int, error) {
	b, err := l.procsOf(d)
	if err != nil {
		return out, err
	}
	for _, f := range bytes.Fields(b) {
		p, err := strconv.Atoi(string(f))
		if err != nil {
			return out, fmt.Errorf("parsing cgroup.procs: %w", err)
		}
		out = append(out, p)
	}
	names, err := l.subdirs(d.dir)
	if err != nil {
		return out, err
	}
	for _, k := range d.kids {
		k.seen = false
	}
	for _, name := range names {
		if out, err = l.walkKid(d, name, out); err != nil {
			return out, err
		}
	}
	for name, k := range d.kids {
		if !k.seen {
			k.close()
			delete(d.kids, name)
		}
	}
	return out, nil
}

// walkKid appends the processes of d's sub-group name, opened if new. A
// sub-group removed since is skipped; one found removed and made again under
// its name is opened again.
// +checklocks:l.mu
func (l *PidList) walkKid(d *pidDir, name string, out []int) ([]int, error) {
	for try := 0; try < 2; try++ {
		k := d.kids[name]
		if k == nil {
			var err error
			if k, err = openPidDir(d.dir, name, l.c.trackV2); groupGone(err) {
				return out, nil
			} else if err != nil {
				return out, err
			}
			d.kids[name] = k
		}
		more, err := l.walk(k, out)
		if err == nil {
			k.seen = true
			return more, nil
		}
		if !groupGone(err) {
			return out, err
		}
		k.close()
		delete(d.kids, name)
	}
	return out, nil
}

// procsOf reads the cgroup.procs of d.
// +checklocks:l.mu
func (l *PidList) procsOf(d *pidDir) ([]byte, error) {
	if d.procs >= 0 {
		return l.read(d.procs)
	}
	fd, err := openatRetry(d.dir, "cgroup.procs", unix.O_RDONLY|unix.O_CLOEXEC)
	if err != nil {
		return nil, err
	}
	defer unix.Close(fd)
	return l.read(fd)
}

// read reads the whole of the control file fd from its start.
// +checklocks:l.mu
func (l *PidList) read(fd int) ([]byte, error) {
	n := 0
	for {
		if n == len(l.buf) {
			l.buf = append(l.buf, make([]byte, len(l.buf))...)
		}
		k, err := unix.Pread(fd, l.buf[n:], int64(n))
		if err == unix.EINTR {
			continue
		}
		if err != nil {
			return nil, err
		}
		if k == 0 {
			return l.buf[:n], nil
		}
		n += k
	}
}

// subdirs lists the sub-directories of the directory fd, from its start.
// +checklocks:l.mu
func (l *PidList) subdirs(fd int) ([]string, error) {
	if _, err := unix.Seek(fd, 0, io.SeekStart); err != nil {
		return nil, err
	}
	var names []string
	var buf [4096]byte
	for {
		n, err := unix.Getdents(fd, buf[:])
		if err == unix.EINTR {
			continue
		}
		if err != nil {
			return nil, err
		}
		if n == 0 {
			return names, nil
		}
		for b := buf[:n]; len(b) > 0; {
			// struct linux_dirent64: ino, off, reclen, type, name.
			reclen := int(binary.NativeEndian.Uint16(b[16:18]))
			typ, name := b[18], b[19:reclen]
			name = name[:bytes.IndexByte(name, 0)]
			b = b[reclen:]
			if typ == unix.DT_DIR && string(name) != "." && string(name) != ".." {
				names = append(names, string(name))
			}
		}
	}
}

// Close closes the list's files. It is idempotent.
func (l *PidList) Close() {
	l.mu.Lock()
	defer l.mu.Unlock()
	if l.root != nil {
		l.root.close()
		l.root = nil
	}
}
