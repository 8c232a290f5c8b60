package cgroup

import (
	"bytes"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"runtime"
	"strconv"
	"time"

	"golang.org/x/sys/unix"
)

// writeFile writes data to a cgroup control file with one write(2), as the
// kernel expects, without the bookkeeping of os.File.
func writeFile(path, data string) error {
	fd, err := openRetry(path, unix.O_WRONLY|unix.O_CLOEXEC)
	if err != nil {
		return &os.PathError{Op: "open", Path: path, Err: err}
	}
	defer unix.Close(fd)
	for {
		_, err = unix.Write(fd, []byte(data))
		if err != unix.EINTR {
			break
		}
	}
	if err != nil {
		return &os.PathError{Op: "write", Path: path, Err: err}
	}
	return nil
}

func openRetry(path string, flags int) (int, error) {
	for {
		fd, err := unix.Open(path, flags, 0)
		if err != unix.EINTR {
			return fd, err
		}
	}
}

// readFile reads a small control file.
func readFile(path string) ([]byte, error) {
	fd, err := openRetry(path, unix.O_RDONLY|unix.O_CLOEXEC)
	if err != nil {
		return nil, &os.PathError{Op: "open", Path: path, Err: err}
	}
	defer unix.Close(fd)
	var out []byte
	buf := make([]byte, 4096)
	for {
		n, err := unix.Read(fd, buf)
		if err == unix.EINTR {
			continue
		}
		if err != nil {
			return nil, &os.PathError{Op: "read", Path: path, Err: err}
		}
		if n == 0 {
			return out, nil
		}
		out = append(out, buf[:n]...)
	}
}

// readInt reads a file holding one integer or "max" (returned as -1).
func readInt(path string) (int64, error) {
	b, err := readFile(path)
	if err != nil {
		return 0, err
	}
	s := string(bytes.TrimSpace(b))
	if s == "max" {
		return -1, nil
	}
	v, err := strconv.ParseInt(s, 10, 64)
	if err != nil {
		return 0, fmt.Errorf("parsing %s: %w", path, err)
	}
	return v, nil
}

// keyValue returns the value of key in a flat-keyed file such as
// cgroup.events or memory.events ("key value" lines).
func keyValue(data []byte, key string) (int64, bool) {
	for len(data) > 0 {
		line := data
		if i := bytes.IndexByte(data, '\n'); i >= 0 {
			line, data = data[:i], data[i+1:]
		} else {
			data = nil
		}
		k, v, ok := bytes.Cut(line, []byte{' '})
		if !ok || string(k) != key {
			continue
		}
		n, err := strconv.ParseInt(string(bytes.TrimSpace(v)), 10, 64)
		if err != nil {
			return 0, false
		}
		return n, true
	}
	return 0, false
}

// readKey reads key from a flat-keyed file; a missing file or key gives 0.
func readKey(path, key string) (int64, error) {
	b, err := readFile(path)
	if err != nil {
		if errors.Is(err, os.ErrNotExist) {
			return 0, nil
		}
		return 0, err
	}
	v, _ := keyValue(b, key)
	return v, nil
}

// waitEvent waits until key in dir/cgroup.events has the value want. It
// sleeps in poll(2) for POLLPRI, which the kernel raises when the file
// changes, and re-reads the file after each wake-up. The kernel sends at most
// one notification per file every 10 ms and delays the next one to the end of
// that window (cgroup_file_notify), so a freeze that follows a thaw closely
// would be seen up to 10 ms late: the poll timeout therefore starts at 20 µs
// and doubles up to 1 ms, bounding that delay without busy reading.
func waitEvent(dir, key string, want int64, deadline time.Time) error {
	path := filepath.Join(dir, "cgroup.events")
	fd, err := openRetry(path, unix.O_RDONLY|unix.O_CLOEXEC)
	if err != nil {
		return &os.PathError{Op: "open", Path: path, Err: err}
	}
	defer unix.Close(fd)
	var buf [256]byte
	pfd := []unix.PollFd{{Fd: int32(fd), Events: unix.POLLPRI}}
	step := 20 * time.Microsecond
	for {
		// Reading the file re-arms POLLPRI: a notification after this
		// read makes the poll below return at once.
		n, err := unix.Pread(fd, buf[:], 0)
		if err == unix.EINTR {
			continue
		}
		if err != nil {
			return &os.PathError{Op: "read", Path: path, Err: err}
		}
		if v, ok := keyValue(buf[:n], key); ok && v == want {
			return nil
		} else if !ok {
			return fmt.Errorf("reading %s: no key %q", path, key)
		}
		left := time.Until(deadline)
		if left <= 0 {
			return fmt.Errorf("waiting for %s %d in %s: %w", key, want, path, ErrTimeout)
		}
		ts := unix.NsecToTimespec(int64(min(step, left)))
		if _, err := unix.Ppoll(pfd, &ts, nil); err != nil && err != unix.EINTR {
			return &os.PathError{Op: "poll", Path: path, Err: err}
		}
		step = min(2*step, time.Millisecond)
	}
}

// backoff paces the loops that have no kernel notification (v1 freezer
// state, v1 emptiness): a few yields first, then sleeps doubling from 20 µs
// to 1 ms.
type backoff struct {
	n        int
	deadline time.Time
}

// wait pauses before the next check, or reports that the deadline passed.
func (b *backoff) wait() bool {
	if time.Now().After(b.deadline) {
		return false
	}
	b.n++
	if b.n <= 3 {
		runtime.Gosched()
		return true
	}
	d := 20 * time.Microsecond << min(b.n-4, 6)
	sleep(d)
	return true
}

// sleep pauses the calling thread for d. Not time.Sleep: with its CPUs
// idle, the Go runtime waits for its timers in epoll_wait, whose timeout is
// in milliseconds, so a 20 µs time.Sleep lasts a millisecond.
func sleep(d time.Duration) {
	ts := unix.NsecToTimespec(int64(d))
	for unix.Nanosleep(&ts, &ts) == unix.EINTR {
	}
}

// readPids lists cgroup.procs of dir.
func readPids(dir string) ([]int, error) { return readIDs(dir, "cgroup.procs") }

// readIDs lists the ids in file of dir (cgroup.procs, cgroup.threads, tasks).
func readIDs(dir, file string) ([]int, error) {
	b, err := readFile(filepath.Join(dir, file))
	if err != nil {
		return nil, err
	}
	var out []int
	for _, f := range bytes.Fields(b) {
		p, err := strconv.Atoi(string(f))
		if err != nil {
			return nil, fmt.Errorf("parsing %s/%s: %w", dir, file, err)
		}
		out = append(out, p)
	}
	return out, nil
}

// childDirs lists the sub-directories (child groups) of dir.
func childDirs(dir string) ([]string, error) {
	ents, err := os.ReadDir(dir)
	if err != nil {
		return nil, err
	}
	var out []string
	for _, e := range ents {
		if e.IsDir() {
			out = append(out, e.Name())
		}
	}
	return out, nil
}

// walkPids lists the processes of dir and all its descendants.
func walkPids(dir string, out []int) ([]int, error) { return walkIDs(dir, "cgroup.procs", out) }

// walkIDs lists the ids in file (cgroup.procs, cgroup.threads, tasks) of
// dir and all its descendants.
func walkIDs(dir, file string, out []int) ([]int, error) {
	p, err := readIDs(dir, file)
	if err != nil {
		return out, err
	}
	out = append(out, p...)
	kids, err := childDirs(dir)
	if err != nil {
		return out, err
	}
	for _, k := range kids {
		if out, err = walkIDs(filepath.Join(dir, k), file, out); err != nil && !errors.Is(err, os.ErrNotExist) {
			return out, err
		}
	}
	return out, nil
}

// removeTree removes dir and its child groups, deepest first. A missing
// directory is not an error. rmdir of a group whose last process exited a
// moment ago can report EBUSY briefly; it is retried until the deadline.
func removeTree(dir string, deadline time.Time) error {
	kids, err := childDirs(dir)
	if err != nil {
		if errors.Is(err, os.ErrNotExist) {
			return nil
		}
		return err
	}
	for _, k := range kids {
		if err := removeTree(filepath.Join(dir, k), deadline); err != nil {
			return err
		}
	}
	b := backoff{deadline: deadline}
	for {
		err := unix.Rmdir(dir)
		switch {
		case err == nil, err == unix.ENOENT:
			return nil
		case err == unix.EINTR:
			continue
		case err == unix.EBUSY && b.wait():
			continue
		}
		return &os.PathError{Op: "rmdir", Path: dir, Err: err}
	}
}
