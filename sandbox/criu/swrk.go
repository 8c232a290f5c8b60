package criu

import (
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"

	gocriu "github.com/checkpoint-restore/go-criu/v7"
	"golang.org/x/sys/unix"
	"google.golang.org/protobuf/proto"
)

// Swrk runs one `criu swrk` worker per request through go-criu. It needs no long-lived process,
// but pays CRIU's start-up on every call, and its kernel feature detection too unless the call is
// a tree's with CacheFeatures set.
type Swrk struct {
	bin string
	// keep is where the log of a failed request is kept (KeepLogs).
	keep *logKeeper
	// features is the directory criu keeps its kernel feature cache in (CacheFeatures); empty:
	// none. hostMounts counts the mounts a dump's private namespace would copy; nil: few.
	features   string
	hostMounts func() int
}

// KeepLogs makes the Swrk keep the log of each failed request in dir, the
// newest max of them, and name that copy in the error: the request's own
// log goes with its images directory, which callers remove on failure.
func (w *Swrk) KeepLogs(dir string, max int) { w.keep = &logKeeper{dir: dir, max: max} }

// CacheFeatures makes criu keep the kernel features it detects (criu.kdat) in a directory below
// dir named for the criu it runs, so that another criu installed under the same name never
// reads this one's cache. dir must be a directory of a tmpfs (criu keeps nothing elsewhere, so
// that a reboot, and with it a new kernel, drops the cache) that root alone may write: criu
// trusts what it reads there. Without it every request probes the kernel again: about 12 ms of
// a tree's restore (unprivileged: the cache is named by $XDG_RUNTIME_DIR) and most of a dump
// (privileged: criu's rule is /run/criu.kdat, so a dump's criu sees a directory of the cache
// over /run; see startInNS).
//
// hostMounts, if set, counts the mounts of the caller's mount namespace; a dump takes the cache
// only while they are at most maxCopiedMounts (see overRun). Call it before any request runs:
// it removes what a criu killed while it saved the cache left behind.
func (w *Swrk) CacheFeatures(dir string, hostMounts func() int) error {
	var fs unix.Statfs_t
	if err := unix.Statfs(dir, &fs); err != nil {
		return fmt.Errorf("inspecting criu's feature cache %s: %w", dir, err)
	}
	var fi unix.Stat_t
	if err := unix.Lstat(dir, &fi); err != nil {
		return fmt.Errorf("inspecting criu's feature cache %s: %w", dir, err)
	}
	if fs.Type != unix.TMPFS_MAGIC || fi.Mode&unix.S_IFMT != unix.S_IFDIR || fi.Uid != 0 || fi.Mode&0o022 != 0 {
		return fmt.Errorf("criu's feature cache %s must be a directory of a tmpfs that root alone may write", dir)
	}
	var st unix.Stat_t
	if err := unix.Stat(w.bin, &st); err != nil {
		return fmt.Errorf("inspecting criu %q: %w", w.bin, err)
	}
	sub := filepath.Join(dir, fmt.Sprintf("%x-%x-%x-%x", st.Dev, st.Ino, st.Size, st.Mtim.Nano()))
	if err := os.MkdirAll(filepath.Join(sub, "run"), 0o700); err != nil {
		return fmt.Errorf("creating criu's feature cache: %w", err)
	}
	// criu saves through this one name, opened O_EXCL: one left behind would have every later
	// criu skip the save.
	for _, d := range []string{sub, filepath.Join(sub, "run")} {
		if err := os.Remove(filepath.Join(d, "criu.kdat.tmp")); err != nil && !errors.Is(err, os.ErrNotExist) {
			return fmt.Errorf("clearing criu's feature cache: %w", err)
		}
	}
	w.features, w.hostMounts = sub, hostMounts
	return nil
}

// NewSwrk returns a Swrk that runs bin, the CRIU 4.2.1+ wrapper (internal/locate.CRIU finds
// it). It fails with ErrNotInstalled when bin is empty or not an executable file.
func NewSwrk(bin string) (*Swrk, error) {
	if err := executable(bin); err != nil {
		return nil, fmt.Errorf("checking criu %q: %w", bin, err)
	}
	return &Swrk{bin: bin}, nil
}

// executable fails with ErrNotInstalled unless p names an executable file.
func executable(p string) error {
	if p == "" {
		return fmt.Errorf("%w: no CRIU wrapper was given", ErrNotInstalled)
	}
	fi, err := os.Stat(p)
	if err != nil {
		return fmt.Errorf("%w: %w", ErrNotInstalled, err)
	}
	if fi.IsDir() || fi.Mode().Perm()&0o111 == 0 {
		return fmt.Errorf("%w: %s is not an executable file", ErrNotInstalled, p)
	}
	return nil
}

// Dump checkpoints the tree rooted at o.Pid into o.ImagesDir.
func (w *Swrk) Dump(ctx context.Context, o DumpOpts) error {
	if err := o.Validate(); err != nil {
		return err
	}
	if err := ctx.Err(); err != nil {
		return err
	}
	c := gocriu.MakeCriu()
	c.SetCriuPath(w.bin)
	if err := c.Dump(o.rpc(), nil); err != nil {
		return fmt.Errorf("criu swrk dump (see %s): %w: %w", filepath.Join(o.ImagesDir, "dump.log"), ErrRequest, err)
	}
	return nil
}

// Restore recreates the tree saved in o.ImagesDir as a child of the calling process and returns
// the host pid of its root; the caller reaps it.
func (w *Swrk) Restore(ctx context.Context, o RestoreOpts) (int, error) {
	if err := o.Validate(); err != nil {
		return 0, err
	}
	if err := ctx.Err(); err != nil {
		return 0, err
	}
	c := gocriu.MakeCriu()
	c.SetCriuPath(w.bin)
	opts := o.rpc()
	opts.RstSibling = proto.Bool(true)
	n := &pidNotify{}
	if err := c.Restore(opts, n); err != nil {
		return 0, fmt.Errorf("criu swrk restore (see %s): %w: %w", filepath.Join(o.ImagesDir, "restore.log"), ErrRequest, err)
	}
	return int(n.pid), nil
}

// pidNotify records the restored root's pid from CRIU's post-restore notification.
type pidNotify struct {
	gocriu.NoNotify
	pid int32
}

// PostRestore implements gocriu.Notify.
func (n *pidNotify) PostRestore(pid int32) error {
	n.pid = pid
	return nil
}

var _ gocriu.Notify = (*pidNotify)(nil)
