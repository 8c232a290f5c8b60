package image

import (
	"archive/tar"
	"errors"
	"fmt"
	"io"
	"os"
	"path"
	"strconv"
	"strings"
	"time"

	"golang.org/x/sys/unix"
)

const (
	whiteoutPrefix = ".wh."
	// whiteoutMeta prefixes AUFS bookkeeping entries (.wh..wh.plnk, .wh..wh.aufs) that carry
	// no meaning for overlayfs.
	whiteoutMeta   = ".wh..wh."
	whiteoutOpaque = ".wh..wh..opq"
	xattrOpaque    = "trusted.overlay.opaque"
	paxXattr       = "SCHILY.xattr."
)

// layerWriter writes tar entries into one layer directory. Every path is resolved from the
// layer root with openat2(RESOLVE_BENEATH|RESOLVE_NO_SYMLINKS|RESOLVE_NO_MAGICLINKS) and every
// final component is created with an *at call that does not follow symlinks, so no entry can
// reach outside the layer, even through a symlink made by an earlier entry.
type layerWriter struct {
	root int
	// whiteouts converts OCI whiteout entries into overlayfs whiteouts (image layers); a
	// rootfs copy keeps names as they are.
	whiteouts bool
	// dirTimes are applied last: creating entries in a directory changes its mtime.
	dirTimes []dirTime
	// budget is charged for every entry and its contents.
	budget *budget
	closed bool
}

type dirTime struct {
	name         string
	atime, mtime time.Time
}

func openLayerWriter(dir string, whiteouts bool, b *budget) (*layerWriter, error) {
	fd, err := unix.Open(dir, unix.O_DIRECTORY|unix.O_RDONLY|unix.O_NOFOLLOW|unix.O_CLOEXEC, 0)
	if err != nil {
		return nil, fmt.Errorf("opening layer directory: %w", err)
	}
	return &layerWriter{root: fd, whiteouts: whiteouts, budget: b}, nil
}

// Close releases the layer root. It is idempotent.
func (w *layerWriter) Close() error {
	if w.closed {
		return nil
	}
	w.closed = true
	return unix.Close(w.root)
}

// finish sets the times of the directories written so far.
func (w *layerWriter) finish() error {
	for _, d := range w.dirTimes {
		pfd, base, err := w.parent(d.name, false)
		if err != nil {
			return err
		}
		err = setTimes(pfd, base, d.atime, d.mtime)
		unix.Close(pfd)
		if err != nil {
			return fmt.Errorf("setting times of %s: %w", d.name, err)
		}
	}
	w.dirTimes = nil
	return nil
}

// applyTar writes every entry of a layer tar.
func (w *layerWriter) applyTar(r io.Reader, check func() error) error {
	tr := tar.NewReader(r)
	for {
		if err := check(); err != nil {
			return err
		}
		hdr, err := tr.Next()
		if errors.Is(err, io.EOF) {
			return w.finish()
		}
		if errors.Is(err, tar.ErrInsecurePath) {
			return fmt.Errorf("reading layer tar: %w: %w", ErrUnsafePath, err)
		}
		if err != nil {
			return fmt.Errorf("reading layer tar: %w", err)
		}
		if err := w.apply(hdr, tr); err != nil {
			return err
		}
	}
}

// apply writes one entry; r holds a regular file's contents.
func (w *layerWriter) apply(hdr *tar.Header, r io.Reader) error {
	if hdr.Typeflag == tar.TypeXGlobalHeader {
		return nil
	}
	if err := w.budget.take(entryCost); err != nil {
		return err
	}
	name, err := cleanEntryName(hdr.Name)
	if err != nil {
		return err
	}
	if w.whiteouts {
		if base := path.Base(name); strings.HasPrefix(base, whiteoutPrefix) {
			return w.whiteout(name, base)
		}
	}
	if name == "." {
		if hdr.Typeflag != tar.TypeDir {
			return fmt.Errorf("entry %q for the layer root is not a directory: %w", hdr.Name, ErrUnsafePath)
		}
		return w.setMeta(w.root, ".", hdr, true)
	}
	pfd, base, err := w.parent(name, true)
	if err != nil {
		return err
	}
	defer unix.Close(pfd)
	if err := w.write(pfd, base, name, hdr, r); err != nil {
		return fmt.Errorf("writing %s: %w", name, err)
	}
	return nil
}

// write makes the entry hdr (contents r) as base in directory pfd, name
// being its path in the layer, by its type.
func (w *layerWriter) write(pfd int, base, name string, hdr *tar.Header, r io.Reader) error {
	switch hdr.Typeflag {
	case tar.TypeDir:
		return w.writeDir(pfd, base, name, hdr)
	case tar.TypeReg, tar.TypeRegA: //nolint:staticcheck // old tars still use TypeRegA
		return w.writeFile(pfd, base, name, hdr, r)
	case tar.TypeSymlink:
		if hdr.Linkname == "" {
			return fmt.Errorf("symlink with an empty target: %w", ErrUnsupportedEntry)
		}
		if err := removeExisting(pfd, base); err != nil {
			return err
		}
		if err := unix.Symlinkat(hdr.Linkname, pfd, base); err != nil {
			return fmt.Errorf("creating symlink: %w", err)
		}
		return w.setMeta(pfd, base, hdr, false)
	case tar.TypeLink:
		return w.writeLink(pfd, base, name, hdr)
	case tar.TypeChar, tar.TypeBlock, tar.TypeFifo:
		mode := map[byte]uint32{tar.TypeChar: unix.S_IFCHR, tar.TypeBlock: unix.S_IFBLK, tar.TypeFifo: unix.S_IFIFO}[hdr.Typeflag]
		if err := removeExisting(pfd, base); err != nil {
			return err
		}
		dev := unix.Mkdev(uint32(hdr.Devmajor), uint32(hdr.Devminor))
		if err := unix.Mknodat(pfd, base, mode|0o600, int(dev)); err != nil {
			return fmt.Errorf("creating node: %w", err)
		}
		return w.setMeta(pfd, base, hdr, false)
	default:
		return fmt.Errorf("entry type %q: %w", hdr.Typeflag, ErrUnsupportedEntry)
	}
}

// writeDir makes a directory entry: a directory already there keeps its
// contents (and an opaque mark) and takes the entry's metadata; anything
// else there is replaced. Its times are set last (dirTimes), once its
// contents are written.
func (w *layerWriter) writeDir(pfd int, base, name string, hdr *tar.Header) error {
	var st unix.Stat_t
	err := unix.Fstatat(pfd, base, &st, unix.AT_SYMLINK_NOFOLLOW)
	switch {
	case err == nil && st.Mode&unix.S_IFMT == unix.S_IFDIR:
		// Keep it (and its contents, and an opaque mark); only its metadata changes.
	case err == nil || errors.Is(err, unix.ENOENT):
		// Replace a non-directory, or make a new one.
		if err := removeExisting(pfd, base); err != nil {
			return err
		}
		if err := unix.Mkdirat(pfd, base, 0o700); err != nil {
			return fmt.Errorf("creating directory: %w", err)
		}
	default:
		return err
	}
	if err := w.setMeta(pfd, base, hdr, false); err != nil {
		return err
	}
	w.dirTimes = append(w.dirTimes, dirTime{name: name, atime: hdr.AccessTime, mtime: hdr.ModTime})
	return nil
}

// writeFile makes a regular file of exactly hdr.Size bytes read from r,
// within the import's budget.
func (w *layerWriter) writeFile(pfd int, base, name string, hdr *tar.Header, r io.Reader) error {
	if err := w.budget.take(hdr.Size); err != nil {
		return err
	}
	if err := removeExisting(pfd, base); err != nil {
		return err
	}
	fd, err := unix.Openat(pfd, base, unix.O_WRONLY|unix.O_CREAT|unix.O_EXCL|unix.O_NOFOLLOW|unix.O_CLOEXEC, 0o600)
	if err != nil {
		return fmt.Errorf("creating file: %w", err)
	}
	f := os.NewFile(uintptr(fd), name)
	defer f.Close()
	// A tar reader writes a sparse file's holes as holes (its WriteTo seeks); a rootfs copy
	// hands a reader cut at the size it listed.
	n, err := io.Copy(f, r)
	if err != nil {
		return fmt.Errorf("copying contents: %w", err)
	}
	if n != hdr.Size {
		return fmt.Errorf("copied %d bytes of %d", n, hdr.Size)
	}
	if err := w.setMeta(pfd, base, hdr, false); err != nil {
		return err
	}
	return f.Close()
}

// writeLink makes a hard link to an entry written before, in the layer;
// a link to a symlink links the symlink itself.
func (w *layerWriter) writeLink(pfd int, base, name string, hdr *tar.Header) error {
	target, err := cleanEntryName(hdr.Linkname)
	if err != nil {
		return fmt.Errorf("hardlink target: %w", err)
	}
	if target == "." || target == name {
		return fmt.Errorf("hardlink to %q: %w", hdr.Linkname, ErrUnsupportedEntry)
	}
	tfd, tbase, err := w.parent(target, false)
	if err != nil {
		return fmt.Errorf("hardlink target: %w", err)
	}
	defer unix.Close(tfd)
	if err := removeExisting(pfd, base); err != nil {
		return err
	}
	// Flags 0: a symlink target is linked itself, never followed.
	if err := unix.Linkat(tfd, tbase, pfd, base, 0); err != nil {
		return fmt.Errorf("hardlinking to %s: %w", target, err)
	}
	return nil
}

// whiteout converts an OCI whiteout entry: ".wh..wh..opq" marks its directory opaque,
// ".wh.NAME" becomes the overlayfs whiteout NAME (a 0:0 character device). Per the OCI spec a
// whiteout hides only lower layers, so an entry of the same layer already at NAME stays.
func (w *layerWriter) whiteout(name, base string) error {
	dir := path.Dir(name)
	if base == whiteoutOpaque {
		fd, err := w.openDir(dir, true)
		if err != nil {
			return err
		}
		defer unix.Close(fd)
		if err := unix.Fsetxattr(fd, xattrOpaque, []byte("y"), 0); err != nil {
			return fmt.Errorf("marking %s opaque: %w", dir, err)
		}
		return nil
	}
	if strings.HasPrefix(base, whiteoutMeta) {
		return nil
	}
	hidden := strings.TrimPrefix(base, whiteoutPrefix)
	if hidden == "" || hidden == "." || hidden == ".." {
		return fmt.Errorf("whiteout %q: %w", name, ErrUnsafePath)
	}
	pfd, _, err := w.parent(name, true)
	if err != nil {
		return err
	}
	defer unix.Close(pfd)
	var st unix.Stat_t
	err = unix.Fstatat(pfd, hidden, &st, unix.AT_SYMLINK_NOFOLLOW)
	if err == nil {
		return nil
	}
	if !errors.Is(err, unix.ENOENT) {
		return fmt.Errorf("writing whiteout %s: %w", name, err)
	}
	if err := unix.Mknodat(pfd, hidden, unix.S_IFCHR, 0); err != nil {
		return fmt.Errorf("writing whiteout %s: %w", name, err)
	}
	return nil
}

// parent opens the directory holding name and returns it with name's last component.
// Missing ancestors are created (mode 0755) when create is set.
func (w *layerWriter) parent(name string, create bool) (int, string, error) {
	fd, err := w.openDir(path.Dir(name), create)
	if err != nil {
		return -1, "", err
	}
	return fd, path.Base(name), nil
}

var beneath = unix.OpenHow{
	Flags:   unix.O_DIRECTORY | unix.O_RDONLY | unix.O_NOFOLLOW | unix.O_CLOEXEC,
	Resolve: unix.RESOLVE_BENEATH | unix.RESOLVE_NO_SYMLINKS | unix.RESOLVE_NO_MAGICLINKS,
}

// openDir opens the layer-relative directory dir without following any symlink.
func (w *layerWriter) openDir(dir string, create bool) (int, error) {
	fd, err := openat2(w.root, dir)
	if err == nil || !create || !errors.Is(err, unix.ENOENT) {
		return fd, dirError(dir, err)
	}
	// Walk down, making what is missing.
	cur, err := unix.Dup(w.root)
	if err != nil {
		return -1, err
	}
	for _, c := range strings.Split(dir, "/") {
		next, err := openat2(cur, c)
		if errors.Is(err, unix.ENOENT) {
			if err := unix.Mkdirat(cur, c, 0o755); err != nil && !errors.Is(err, unix.EEXIST) {
				unix.Close(cur)
				return -1, fmt.Errorf("creating directory %s: %w", dir, err)
			}
			next, err = openat2(cur, c)
		}
		unix.Close(cur)
		if err != nil {
			return -1, dirError(dir, err)
		}
		cur = next
	}
	return cur, nil
}

func openat2(dirfd int, name string) (int, error) {
	how := beneath
	for {
		fd, err := unix.Openat2(dirfd, name, &how)
		if errors.Is(err, unix.EINTR) || errors.Is(err, unix.EAGAIN) {
			continue
		}
		return fd, err
	}
}

func dirError(dir string, err error) error {
	switch {
	case err == nil:
		return nil
	case errors.Is(err, unix.ELOOP), errors.Is(err, unix.EXDEV):
		return fmt.Errorf("directory %s goes through a symlink: %w", dir, ErrUnsafePath)
	case errors.Is(err, unix.ENOTDIR):
		return fmt.Errorf("directory %s is (or goes through) a symlink or a non-directory: %w", dir, ErrUnsafePath)
	default:
		return fmt.Errorf("opening directory %s: %w", dir, err)
	}
}

// removeExisting removes whatever is at base, so that a later entry replaces an earlier one.
func removeExisting(pfd int, base string) error {
	err := unix.Unlinkat(pfd, base, 0)
	switch {
	case err == nil, errors.Is(err, unix.ENOENT):
		return nil
	case errors.Is(err, unix.EISDIR):
		// The path goes through /proc/self/fd/N, a directory of this layer that was opened
		// without following symlinks; os.RemoveAll does not follow symlinks below it.
		if err := os.RemoveAll(procPath(pfd, base)); err != nil {
			return fmt.Errorf("replacing directory: %w", err)
		}
		return nil
	default:
		return fmt.Errorf("replacing existing entry: %w", err)
	}
}

func procPath(fd int, base string) string {
	return "/proc/self/fd/" + strconv.Itoa(fd) + "/" + base
}

// setMeta gives base (in directory pfd, not a symlink followed) the header's owner, mode,
// xattrs and, unless it is a directory (see finish), times.
func (w *layerWriter) setMeta(pfd int, base string, hdr *tar.Header, isRoot bool) error {
	flags := unix.AT_SYMLINK_NOFOLLOW
	if isRoot {
		// The root is a directory: "." names it, with nothing to follow.
		base, flags = ".", 0
	}
	if err := unix.Fchownat(pfd, base, hdr.Uid, hdr.Gid, flags); err != nil {
		return fmt.Errorf("setting owner: %w", err)
	}
	if hdr.Typeflag != tar.TypeSymlink {
		// After chown, which clears set-id bits.
		if err := unix.Fchmodat(pfd, base, unixMode(hdr.Mode), flags); err != nil {
			return fmt.Errorf("setting mode: %w", err)
		}
	}
	for k, v := range hdr.PAXRecords {
		attr, ok := strings.CutPrefix(k, paxXattr)
		if !ok || isOverlayXattr(attr) {
			continue
		}
		if err := unix.Lsetxattr(procPath(pfd, base), attr, []byte(v), 0); err != nil {
			if attr == "security.selinux" && errors.Is(err, unix.EOPNOTSUPP) {
				continue
			}
			return fmt.Errorf("setting xattr %s: %w", attr, err)
		}
	}
	if isRoot {
		w.dirTimes = append(w.dirTimes, dirTime{name: ".", atime: hdr.AccessTime, mtime: hdr.ModTime})
		return nil
	}
	if hdr.Typeflag == tar.TypeDir {
		return nil
	}
	if err := setTimes(pfd, base, hdr.AccessTime, hdr.ModTime); err != nil {
		return fmt.Errorf("setting times: %w", err)
	}
	return nil
}

// isOverlayXattr reports whether attr is private to overlayfs. A layer must not carry them:
// whiteouts are expressed as .wh. entries, and forged redirect or metacopy xattrs could point
// lookups elsewhere.
func isOverlayXattr(attr string) bool {
	return strings.HasPrefix(attr, "trusted.overlay.") || strings.HasPrefix(attr, "user.overlay.")
}

func unixMode(m int64) uint32 {
	const setuid, setgid, sticky = 0o4000, 0o2000, 0o1000
	mode := uint32(m) & 0o777
	if m&setuid != 0 {
		mode |= unix.S_ISUID
	}
	if m&setgid != 0 {
		mode |= unix.S_ISGID
	}
	if m&sticky != 0 {
		mode |= unix.S_ISVTX
	}
	return mode
}

func setTimes(pfd int, base string, atime, mtime time.Time) error {
	if mtime.IsZero() {
		return nil
	}
	if atime.IsZero() {
		atime = mtime
	}
	flags := unix.AT_SYMLINK_NOFOLLOW
	if base == "." {
		flags = 0
	}
	ts := []unix.Timespec{unix.NsecToTimespec(atime.UnixNano()), unix.NsecToTimespec(mtime.UnixNano())}
	return unix.UtimesNanoAt(pfd, base, ts, flags)
}
