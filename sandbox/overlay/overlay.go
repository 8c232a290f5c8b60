// Package overlay builds the root filesystem of a sandbox as a detached
// overlayfs mount (fsopen/fsconfig/fsmount), ready to be handed to the
// sandbox's init, which makes it the root with one pivot_root.
//
// Layers are seen through idmapped mounts: a layer stores image-relative
// ownership (uid 0 is the image's root), and an idmapped clone of it made for
// a sandbox's user namespace shows those files as owned by the sandbox's
// shifted uids. The writable upper is idmapped the same way, so that what a
// sandbox writes is stored image-relative too, and a sealed upper can become
// a lower of any sandbox, whatever its uid range.
package overlay

import (
	"errors"
	"fmt"
	"path"
	"slices"
	"strconv"
	"strings"
	"sync/atomic"

	"golang.org/x/sys/unix"

	"github.com/deltagym/deltagym/sandbox/fscred"
)

// ErrTooDeep is returned for a stack deeper than the kernel accepts.
var ErrTooDeep = errors.New("layer stack exceeds the kernel's 500 lowers")

// MaxLowers is the kernel's limit on overlay lower layers (OVL_MAX_STACK).
const MaxLowers = 500

// IDMapped returns a detached, read-only or writable clone of the directory
// dir, idmapped through the user namespace usernsFD. The caller owns the fd.
func IDMapped(dir string, usernsFD int, readOnly bool) (int, error) {
	fd, err := unix.OpenTree(unix.AT_FDCWD, dir, unix.OPEN_TREE_CLONE|unix.OPEN_TREE_CLOEXEC)
	if err != nil {
		return -1, fmt.Errorf("cloning %s: %w", dir, err)
	}
	attr := &unix.MountAttr{Attr_set: unix.MOUNT_ATTR_IDMAP, Userns_fd: uint64(usernsFD)}
	if readOnly {
		attr.Attr_set |= unix.MOUNT_ATTR_RDONLY
	}
	attr.Attr_set |= unix.MOUNT_ATTR_NODEV
	if err := unix.MountSetattr(fd, "", unix.AT_EMPTY_PATH, attr); err != nil {
		unix.Close(fd)
		return -1, fmt.Errorf("idmapping %s: %w", dir, err)
	}
	return fd, nil
}

// Spec describes one overlay mount. Lowers are fds of directories (usually
// idmapped clones), top first. UpperDir and WorkDir are paths, relative to
// the fd UpperFD when it is set (an idmapped clone of the upper's parent).
//
// MounterID is the host uid and gid the overlay is created with. overlayfs
// does all its work in the upper (work dir, copy-up, whiteouts) with the
// credentials of its mounter; through an idmapped upper only uids of the
// sandbox's range can be written, so the mount is made with the range's
// root as fsuid and fsgid, keeping every capability.
type Spec struct {
	Lowers    []int
	UpperFD   int
	UpperDir  string
	WorkDir   string
	MounterID int
}

// Mount creates the overlay as a detached mount and returns its fd.
func Mount(s Spec) (int, error) {
	if s.MounterID == 0 {
		return mount(s)
	}
	var fd int
	err := fscred.Run(s.MounterID, s.MounterID, true, func() (err error) {
		fd, err = mount(s)
		return err
	})
	return fd, err
}

func mount(s Spec) (int, error) {
	if len(s.Lowers) > MaxLowers {
		return -1, ErrTooDeep
	}
	if len(s.Lowers) == 0 {
		return -1, errors.New("overlay needs at least one lower layer")
	}
	fsfd, err := unix.Fsopen("overlay", unix.FSOPEN_CLOEXEC)
	if err != nil {
		return -1, fmt.Errorf("opening overlay context: %w", err)
	}
	defer unix.Close(fsfd)
	set := func(k, v string) error {
		if err := unix.FsconfigSetString(fsfd, k, v); err != nil {
			return fmt.Errorf("overlay option %s=%s: %w", k, v, err)
		}
		return nil
	}
	if err := setLayers(fsfd, s, set); err != nil {
		return -1, err
	}
	// No metacopy, no redirects, no xino: layers must be self-contained
	// directories that can be stacked under any other upper later. The
	// index keeps hard links whole: a copied-up name's other names show
	// the copy while this upper is mounted, and Links.Materialize puts them
	// into the upper before it is sealed. With it, overlayfs refuses a
	// lower that another overlay holds as its upper, which is why a sealed
	// layer is a fresh directory (layers.Store.Seal).
	for _, kv := range [][2]string{{"index", "on"}, {"metacopy", "off"}, {"xino", "off"}, {"redirect_dir", "off"}} {
		if err := set(kv[0], kv[1]); err != nil {
			return -1, err
		}
	}
	if err := unix.FsconfigCreate(fsfd); err != nil {
		return -1, fmt.Errorf("creating overlay: %w", err)
	}
	mfd, err := unix.Fsmount(fsfd, unix.FSMOUNT_CLOEXEC, 0)
	if err != nil {
		return -1, fmt.Errorf("mounting overlay: %w", err)
	}
	return mfd, nil
}

// layersByFD is cleared when the kernel turns out to take overlay layers
// by path only (before Linux 6.13).
var layersByFD atomic.Bool

func init() { layersByFD.Store(true) }

// setLayers gives the overlay context fsfd its layers: as file descriptors
// (FSCONFIG_SET_FD) where the kernel takes them, else as /proc/self/fd
// paths, which the kernel must look up: a mount by descriptor is cheaper.
func setLayers(fsfd int, s Spec, set func(k, v string) error) error {
	if layersByFD.Load() {
		err := setLayersByFD(fsfd, s)
		if !errors.Is(err, unix.EINVAL) {
			return err
		}
		// The first lower was refused: this kernel takes paths only.
		layersByFD.Store(false)
	}
	for _, l := range s.Lowers {
		if err := set("lowerdir+", "/proc/self/fd/"+strconv.Itoa(l)); err != nil {
			return err
		}
	}
	if s.UpperDir != "" {
		up, work := s.UpperDir, s.WorkDir
		if s.UpperFD > 0 {
			base := "/proc/self/fd/" + strconv.Itoa(s.UpperFD) + "/"
			up, work = base+up, base+work
		}
		if err := set("upperdir", up); err != nil {
			return err
		}
		if err := set("workdir", work); err != nil {
			return err
		}
	}
	return nil
}

// setLayersByFD is setLayers by descriptor. It returns EINVAL, unwrapped,
// if the kernel refuses the first lower that way.
func setLayersByFD(fsfd int, s Spec) error {
	for i, l := range s.Lowers {
		if err := unix.FsconfigSetFd(fsfd, "lowerdir+", l); err != nil {
			if i == 0 && errors.Is(err, unix.EINVAL) {
				return unix.EINVAL
			}
			return fmt.Errorf("overlay lower %d: %w", i, err)
		}
	}
	if s.UpperDir == "" {
		return nil
	}
	for _, d := range [][2]string{{"upperdir", s.UpperDir}, {"workdir", s.WorkDir}} {
		dirfd := unix.AT_FDCWD
		if s.UpperFD > 0 {
			dirfd = s.UpperFD
		}
		fd, err := unix.Openat(dirfd, d[1], unix.O_PATH|unix.O_DIRECTORY|unix.O_CLOEXEC, 0)
		if err != nil {
			return fmt.Errorf("overlay %s %s: %w", d[0], d[1], err)
		}
		err = unix.FsconfigSetFd(fsfd, d[0], fd)
		unix.Close(fd)
		if err != nil {
			return fmt.Errorf("overlay %s %s: %w", d[0], d[1], err)
		}
	}
	return nil
}

// Covers stands in for the mounts a root gets only when it is swapped in.
// The init's /proc and /dev are moved onto a root as it becomes the root of
// the sandbox's mount namespace (launch.Init.Swap), so a root not swapped in
// yet shows the skeleton's empty directories there. A read-only, empty mount
// on each keeps file actions out of them as the real mounts do: they never
// cross a mount (RESOLVE_NO_XDEV), and nothing can be written below one.
// Once the root is swapped in, the real mounts stack on the covers.
//
// Two mounts on every root would cost a measurable share of the server's
// CPU under the rollback load test, so a root gets them only when a file
// action could reach one of their directories (Needed): most paths cannot,
// and a rollback loop's root never needs them.
// Directories of mode 0 made in each upper over /proc and /dev would be
// cheaper, but do not stop the sandbox root's file actions, which keep
// CAP_DAC_OVERRIDE; an immutable flag would stop writes, but the seal's
// renames and the reset's removal would have to clear it, and reads would
// find the files missing rather than out of reach.
type Covers struct {
	tpl  int // a detached read-only clone of an empty directory
	dirs []string
}

// NewCovers prepares covers for dirs (relative to a root), cloned from the
// empty directory empty.
func NewCovers(empty string, dirs ...string) (*Covers, error) {
	fd, err := unix.OpenTree(unix.AT_FDCWD, empty, unix.OPEN_TREE_CLONE|unix.OPEN_TREE_CLOEXEC)
	if err != nil {
		return nil, fmt.Errorf("cloning %s: %w", empty, err)
	}
	attr := &unix.MountAttr{Attr_set: unix.MOUNT_ATTR_RDONLY | unix.MOUNT_ATTR_NODEV | unix.MOUNT_ATTR_NOSUID | unix.MOUNT_ATTR_NOEXEC}
	if err := unix.MountSetattr(fd, "", unix.AT_EMPTY_PATH, attr); err != nil {
		unix.Close(fd)
		return nil, fmt.Errorf("making %s read-only: %w", empty, err)
	}
	return &Covers{tpl: fd, dirs: dirs}, nil
}

// Apply mounts a cover on each of the directories of the detached mount
// mountFD: a clone and a move per directory.
func (c *Covers) Apply(mountFD int) error {
	for _, d := range c.dirs {
		fd, err := unix.OpenTree(c.tpl, "", unix.OPEN_TREE_CLONE|unix.OPEN_TREE_CLOEXEC|unix.AT_EMPTY_PATH)
		if err != nil {
			return fmt.Errorf("cloning a cover: %w", err)
		}
		err = unix.MoveMount(fd, "", mountFD, d, unix.MOVE_MOUNT_F_EMPTY_PATH)
		unix.Close(fd)
		if err != nil {
			return fmt.Errorf("covering /%s: %w", d, err)
		}
	}
	return nil
}

// Needed reports whether resolving rel (a path relative to root, as file
// actions resolve it: RESOLVE_IN_ROOT) in the detached mount root could
// reach a directory a cover is for. It cannot when rel names none of them
// once cleaned, and no symbolic link lies on its way: without links and
// without mounts below root, resolution is lexical, ".." included. The
// way is probed with RESOLVE_NO_SYMLINKS: it fails with ELOOP at the first
// link, a trailing one included; ENOENT and ENOTDIR stop it before any
// link. Any other outcome counts as may reach. The answer holds while
// nothing can make a link or a mount in root: nothing runs in a root not
// swapped in, and file actions make only files and directories.
func (c *Covers) Needed(root int, rel string) bool {
	clean := path.Clean("/" + rel)[1:]
	first, _, _ := strings.Cut(clean, "/")
	if slices.Contains(c.dirs, first) {
		return true
	}
	fd, err := unix.Openat2(root, rel, &unix.OpenHow{Flags: unix.O_PATH | unix.O_CLOEXEC,
		Resolve: unix.RESOLVE_IN_ROOT | unix.RESOLVE_NO_SYMLINKS | unix.RESOLVE_NO_MAGICLINKS | unix.RESOLVE_NO_XDEV})
	if err == nil {
		unix.Close(fd)
		return false
	}
	return !errors.Is(err, unix.ENOENT) && !errors.Is(err, unix.ENOTDIR)
}

// Close releases the covers' template; covers already applied stay.
func (c *Covers) Close() error { return unix.Close(c.tpl) }
