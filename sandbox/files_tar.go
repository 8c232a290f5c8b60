package sandbox

import (
	"archive/tar"
	"bytes"
	"compress/gzip"
	"context"
	"errors"
	"fmt"
	"io"
	"path"
	"slices"
	"strings"
	"time"

	"golang.org/x/sys/unix"
)

// Limits of Upload and Download.
const (
	// MaxArchiveBytes bounds an uploaded archive (compressed or not) and a
	// downloaded one.
	MaxArchiveBytes = 64 << 20
	// MaxUnpackedBytes bounds the file contents an upload writes.
	MaxUnpackedBytes = 1 << 30
	// MaxUploadEntries bounds the entries of an uploaded archive.
	MaxUploadEntries = 100000
	// maxUploadComponents bounds the path components of an upload's names in
	// all, and so the memory its check of them takes.
	maxUploadComponents = 1 << 21
	// maxUnpackedMeta bounds what an archive holds besides file contents
	// (headers, PAX records, padding) once decompressed.
	maxUnpackedMeta = 256 << 20
	// maxUploadNameBytes bounds the bytes of the distinct names of an upload's
	// entries, which its check keeps (their parents are slices of them): with
	// maxUploadComponents it bounds the check's memory, whatever the archive
	// unpacks to.
	maxUploadNameBytes = 16 << 20
	// maxNameComponent is the longest path component Linux takes (NAME_MAX).
	maxNameComponent = 255
)

// UploadStats is what an upload unpacked: its entries and the bytes of file
// contents written.
type UploadStats struct {
	Files int64
	Bytes int64
}

// archiveReader reads the tar stream of archive, gunzipped when it is
// gzip's, failing once it has given more than an archive may unpack to (a
// small archive that unpacks huge is refused, not written out).
func archiveReader(archive []byte) (*tar.Reader, error) {
	var r io.Reader = bytes.NewReader(archive)
	if len(archive) >= 2 && archive[0] == 0x1f && archive[1] == 0x8b {
		zr, err := gzip.NewReader(r)
		if err != nil {
			return nil, fmt.Errorf("%w: upload: the archive is not valid gzip: %v", ErrInvalid, err)
		}
		r = zr
	}
	return tar.NewReader(&cappedReader{r: r, left: MaxUnpackedBytes + maxUnpackedMeta}), nil
}

// errUnpacked is a cappedReader's failure past its cap.
var errUnpacked = fmt.Errorf("%w: upload: the archive unpacks to more than %d bytes", ErrInvalid, MaxUnpackedBytes+maxUnpackedMeta)

// cappedReader fails with errUnpacked once it has read left bytes.
type cappedReader struct {
	r    io.Reader
	left int64
}

func (c *cappedReader) Read(p []byte) (int, error) {
	if c.left <= 0 {
		return 0, errUnpacked
	}
	n, err := c.r.Read(p[:min(int64(len(p)), c.left)])
	c.left -= int64(n)
	return n, err
}

// nextEntry is tr's next header, with its name checked and cleaned (relative,
// no ".."; "." for the directory itself); nil at the end. A PAX global header
// (git archive's comment) is no entry: skipped.
func nextEntry(tr *tar.Reader) (*tar.Header, string, error) {
	hdr, err := tr.Next()
	for err == nil && hdr.Typeflag == tar.TypeXGlobalHeader {
		hdr, err = tr.Next()
	}
	if err == io.EOF {
		return nil, "", nil
	}
	if errors.Is(err, errUnpacked) {
		return nil, "", err
	}
	if err != nil {
		return nil, "", fmt.Errorf("%w: upload: the archive is not a valid tar archive (ustar, pax or GNU; plain or gzip): %v", ErrInvalid, err)
	}
	name, err := entryName(hdr.Name)
	return hdr, name, err
}

// entryName checks an archive's name and returns it cleaned.
func entryName(name string) (string, error) {
	switch {
	case name == "", len(name) > maxPath, strings.IndexByte(name, 0) >= 0:
		return "", fmt.Errorf("%w: upload: entry name %.80q is empty, too long or has a NUL byte", ErrInvalid, name)
	case strings.HasPrefix(name, "/"):
		return "", fmt.Errorf("%w: upload: entry %.80q is absolute: names are relative to the directory", ErrInvalid, name)
	}
	for c := range strings.SplitSeq(name, "/") {
		switch {
		case c == "..":
			return "", fmt.Errorf("%w: upload: entry %.80q has a \"..\": names stay inside the directory", ErrInvalid, name)
		case len(c) > maxNameComponent:
			return "", fmt.Errorf("%w: upload: entry %.80q has a path component of %d bytes: at most %d (NAME_MAX)", ErrInvalid, name, len(c), maxNameComponent)
		}
	}
	return path.Clean(name), nil
}

// CheckArchive reads archive whole, refusing it (ErrInvalid) unless each
// entry is a file, directory, symlink or hard link to an earlier entry, named
// inside the directory, below no non-directory of the archive, and the
// limits hold. Upload checks its archive so; a caller that does something
// first (a restore before a step) checks it up front.
func CheckArchive(ctx context.Context, archive []byte) error {
	if len(archive) > MaxArchiveBytes {
		return fmt.Errorf("%w: upload: an archive of %d bytes: at most %d", ErrInvalid, len(archive), MaxArchiveBytes)
	}
	tr, err := archiveReader(archive)
	if err != nil {
		return err
	}
	seen := nameSet{types: map[string]byte{}}
	var entries, components int
	var contents int64
	for {
		hdr, name, err := nextEntry(tr)
		if err != nil || hdr == nil {
			return err
		}
		if entries++; entries > MaxUploadEntries {
			return fmt.Errorf("%w: upload: more than %d entries", ErrInvalid, MaxUploadEntries)
		}
		if entries%1024 == 0 && ctx.Err() != nil {
			return ctx.Err()
		}
		if components += strings.Count(name, "/") + 1; components > maxUploadComponents {
			return fmt.Errorf("%w: upload: the entries' names hold more than %d path components in all", ErrInvalid, maxUploadComponents)
		}
		if err := checkType(hdr, name, seen); err != nil {
			return err
		}
		if hdr.Typeflag == tar.TypeReg {
			if contents += hdr.Size; contents > MaxUnpackedBytes {
				return fmt.Errorf("%w: upload: file contents of more than %d bytes", ErrInvalid, MaxUnpackedBytes)
			}
		}
		if err := seen.add(name, hdr.Typeflag); err != nil {
			return err
		}
	}
}

// checkType refuses an entry of a type an upload does not write, and a hard
// link to anything but an earlier file of the archive.
func checkType(hdr *tar.Header, name string, seen nameSet) error {
	switch hdr.Typeflag {
	case tar.TypeReg, tar.TypeDir:
	case tar.TypeSymlink:
		if hdr.Linkname == "" || len(hdr.Linkname) >= maxPath || strings.IndexByte(hdr.Linkname, 0) >= 0 {
			return fmt.Errorf("%w: upload: symlink %.80q has an empty, too long or NUL-holding target", ErrInvalid, name)
		}
	case tar.TypeLink:
		target, err := entryName(hdr.Linkname)
		if err != nil {
			return err
		}
		if t, ok := seen.types[target]; !ok || (t != tar.TypeReg && t != tar.TypeLink) {
			return fmt.Errorf("%w: upload: hard link %.80q to %.80q: a hard link names an earlier file of the same archive", ErrInvalid, name, hdr.Linkname)
		}
	case tar.TypeChar, tar.TypeBlock, tar.TypeFifo:
		return fmt.Errorf("%w: upload: entry %.80q is a device or FIFO: only files, directories, symlinks and hard links are unpacked", ErrInvalid, name)
	default:
		return fmt.Errorf("%w: upload: entry %.80q of tar type %q: only files, directories, symlinks and hard links are unpacked", ErrInvalid, name, hdr.Typeflag)
	}
	return nil
}

// nameSet holds each name of an archive and each of their parents, with its
// type (a parent is a directory).
type nameSet struct {
	types map[string]byte
	// bytes counts the bytes of the names kept: copies, since a name the
	// tar reader gives may be a slice of its whole PAX header. A parent is a
	// slice of the name that adds it.
	bytes int
}

// add records name, of type typ, and its parents as directories; an entry
// below a non-directory of the archive, or a name the archive gives twice but
// as two directories, is refused, as are names past maxUploadNameBytes.
func (ns *nameSet) add(name string, typ byte) error {
	seen := ns.types
	if name == "." {
		if typ != tar.TypeDir {
			return fmt.Errorf("%w: upload: the directory itself (\".\") as a non-directory", ErrInvalid)
		}
		return nil
	}
	if t, ok := seen[name]; ok {
		if t != tar.TypeDir || typ != tar.TypeDir {
			return fmt.Errorf("%w: upload: %.80q is in the archive twice, or both a parent of entries and not a directory", ErrInvalid, name)
		}
		// A directory named again: it and its parents are in the set. Storing the name
		// again would swap in the new key, a slice of its entry's whole PAX header,
		// keeping that alive uncounted.
		return nil
	}
	if ns.bytes += len(name); ns.bytes > maxUploadNameBytes {
		return fmt.Errorf("%w: upload: the archive's names take more than %d MiB", ErrInvalid, maxUploadNameBytes>>20)
	}
	name = strings.Clone(name) // not a slice of the header it came in
	seen[name] = typ
	for p := path.Dir(name); p != "."; p = path.Dir(p) {
		t, ok := seen[p]
		if ok && t != tar.TypeDir {
			return fmt.Errorf("%w: upload: %.80q is below %.80q, which the archive makes a symlink or file: nothing is written through one", ErrInvalid, name, p)
		}
		if ok {
			break // its parents were added with it
		}
		seen[p] = tar.TypeDir
	}
	return nil
}

// Upload unpacks archive, a tar archive (ustar, pax or GNU; plain or gzip),
// into the directory path (resolved in the root; created with its missing
// parents). The archive is checked whole first (CheckArchive): a bad one is
// ErrInvalid and writes nothing. Entries are then written below the
// directory's descriptor with beneath: a parent that is a symlink, in the
// archive or in the sandbox, or another mount, is refused, never written
// through. Files and symlinks replace what is at their name, but a
// directory (EISDIR); a directory already there stays as it is. Modes keep
// their permission bits only; everything is owned by the sandbox's user.
func (s *Sandbox) Upload(ctx context.Context, dir string, archive []byte) (UploadStats, error) {
	if err := CheckArchive(ctx, archive); err != nil {
		return UploadStats{}, err
	}
	var u *unpacker
	err := s.fileOpIn(dir, true, func(root int, rel string) error {
		fd, err := openTarget(root, rel)
		if err != nil {
			return err
		}
		if fd != root {
			defer unix.Close(fd)
		}
		u = &unpacker{ctx: ctx, dir: fd, shown: strings.TrimSuffix(dir, "/"), buf: make([]byte, 256<<10), lastFd: -1}
		defer u.closeLast()
		return u.unpack(archive)
	})
	if u == nil {
		return UploadStats{}, err
	}
	return u.stats, err
}

// openTarget opens the directory rel (resolved in root; "" is root itself),
// creating it and its missing parents.
func openTarget(root int, rel string) (int, error) {
	rel = strings.Trim(rel, "/")
	if rel == "" {
		return root, nil
	}
	how := &unix.OpenHow{Flags: unix.O_PATH | unix.O_DIRECTORY | unix.O_CLOEXEC, Resolve: resolve}
	fd, err := unix.Openat2(root, rel, how)
	if !errors.Is(err, unix.ENOENT) {
		return fd, err
	}
	if err := mkdirAll(root, rel+"/."); err != nil {
		return -1, err
	}
	return unix.Openat2(root, rel, how)
}

// unpacker is one upload's writing pass.
type unpacker struct {
	ctx   context.Context
	dir   int    // the directory unpacked into
	shown string // its path as asked, for errors
	stats UploadStats
	dirs  []dirMeta
	buf   []byte
	// last is the parent of the last entry, open as lastFd (-1: none).
	last   string
	lastFd int
}

// dirMeta is an unpacked directory's mode and time, set once everything is
// written into it (a read-only directory is written into first).
type dirMeta struct {
	name  string
	mode  uint32
	mtime time.Time
}

func (u *unpacker) unpack(archive []byte) error {
	tr, err := archiveReader(archive)
	if err != nil {
		return err
	}
	for {
		hdr, name, err := nextEntry(tr)
		if err != nil || hdr == nil {
			if err == nil {
				err = u.finishDirs()
			}
			return err
		}
		if err := u.ctx.Err(); err != nil {
			return err
		}
		if name == "." {
			continue // the directory itself: kept as it is
		}
		if err := u.entry(tr, hdr, name); err != nil {
			return withPath(u.shown+"/"+name, fileError(u.shown+"/"+name, err))
		}
		u.stats.Files++
	}
}

// entry writes one entry of the archive, named name below the directory.
func (u *unpacker) entry(tr *tar.Reader, hdr *tar.Header, name string) error {
	parent, base := path.Split(name)
	pfd, err := u.parent(strings.TrimSuffix(parent, "/"))
	if err != nil {
		return err
	}
	mode := uint32(hdr.Mode) & 0o777
	if hdr.Typeflag == tar.TypeDir {
		return u.mkdir(pfd, base, name, mode, hdr.ModTime)
	}
	if err := unlinkNonDir(pfd, base); err != nil {
		return err
	}
	switch hdr.Typeflag {
	case tar.TypeSymlink:
		if err := unix.Symlinkat(hdr.Linkname, pfd, base); err != nil {
			return err
		}
	case tar.TypeLink:
		target, _ := entryName(hdr.Linkname)
		tparent, tbase := path.Split(target)
		tfd, err := u.parentDir(strings.TrimSuffix(tparent, "/"))
		if err != nil {
			return err
		}
		if tfd != u.dir {
			defer unix.Close(tfd)
		}
		// Without AT_SYMLINK_FOLLOW: a target swapped for a symlink is
		// linked as the symlink.
		return unix.Linkat(tfd, tbase, pfd, base, 0)
	default:
		if err := u.file(tr, pfd, base, mode); err != nil {
			return err
		}
	}
	return setTimes(pfd, base, hdr.ModTime)
}

// unlinkNonDir removes what is at name in dir, unless it is a directory
// (EISDIR) or nothing.
func unlinkNonDir(dir int, name string) error {
	if err := unix.Unlinkat(dir, name, 0); err != nil && !errors.Is(err, unix.ENOENT) {
		return err
	}
	return nil
}

// file writes the contents of the current entry of tr to a new file name in
// dir.
func (u *unpacker) file(tr *tar.Reader, dir int, name string, mode uint32) error {
	fd, err := unix.Openat(dir, name, unix.O_WRONLY|unix.O_CREAT|unix.O_EXCL|unix.O_NOFOLLOW|unix.O_CLOEXEC|unix.O_NOCTTY, 0o600)
	if err != nil {
		return err
	}
	defer unix.Close(fd)
	for {
		n, rerr := tr.Read(u.buf)
		if n > 0 {
			if err := writeFull(fd, u.buf[:n]); err != nil {
				return err
			}
			u.stats.Bytes += int64(n)
		}
		if rerr == io.EOF {
			break
		}
		if rerr != nil {
			return fmt.Errorf("%w: upload: reading the archive: %v", ErrInvalid, rerr)
		}
	}
	return unix.Fchmod(fd, mode)
}

// mkdir makes the directory name in dir and notes its mode and time for
// finishDirs, or keeps the directory there as it is (an upload into / does
// not change /tmp's mode).
func (u *unpacker) mkdir(dir int, name, full string, mode uint32, mtime time.Time) error {
	err := unix.Mkdirat(dir, name, 0o700)
	if errors.Is(err, unix.EEXIST) {
		// A symlink there is not a directory (O_PATH|O_NOFOLLOW opens the link).
		fd, oerr := unix.Openat2(dir, name, &unix.OpenHow{Flags: unix.O_PATH | unix.O_DIRECTORY | unix.O_NOFOLLOW | unix.O_CLOEXEC, Resolve: beneath})
		if oerr != nil {
			return &FileError{Errno: unix.EEXIST, Msg: "exists, not as a directory"}
		}
		return unix.Close(fd)
	}
	if err != nil {
		return err
	}
	u.dirs = append(u.dirs, dirMeta{name: full, mode: mode, mtime: mtime})
	return nil
}

// finishDirs sets the unpacked directories' modes and times, deepest first,
// through descriptors opened beneath.
func (u *unpacker) finishDirs() error {
	for _, d := range slices.Backward(u.dirs) {
		fd, err := unix.Openat2(u.dir, d.name, &unix.OpenHow{Flags: unix.O_RDONLY | unix.O_DIRECTORY | unix.O_NOFOLLOW | unix.O_CLOEXEC, Resolve: beneath})
		if err == nil {
			err = unix.Fchmod(fd, d.mode)
			if err == nil {
				err = unix.Futimes(fd, []unix.Timeval{unix.NsecToTimeval(d.mtime.UnixNano()), unix.NsecToTimeval(d.mtime.UnixNano())})
			}
			unix.Close(fd)
		}
		if err != nil {
			return withPath(u.shown+"/"+d.name, fileError(u.shown+"/"+d.name, err))
		}
	}
	return nil
}

// setTimes sets the times of name in dir, not following a symlink.
func setTimes(dir int, name string, mtime time.Time) error {
	ts := unix.NsecToTimespec(mtime.UnixNano())
	return unix.UtimesNanoAt(dir, name, []unix.Timespec{ts, ts}, unix.AT_SYMLINK_NOFOLLOW)
}

// parent is parentDir(rel), kept open for the entries that follow in the
// same directory (an archive lists a directory's entries together).
func (u *unpacker) parent(rel string) (int, error) {
	if u.lastFd >= 0 && u.last == rel {
		return u.lastFd, nil
	}
	u.closeLast()
	fd, err := u.parentDir(rel)
	if err != nil {
		return -1, err
	}
	if fd != u.dir {
		u.last, u.lastFd = rel, fd
	}
	return fd, nil
}

// closeLast closes the parent kept open.
func (u *unpacker) closeLast() {
	if u.lastFd >= 0 {
		unix.Close(u.lastFd)
		u.lastFd = -1
	}
}

// parentDir opens rel ("" for the directory itself) below the directory,
// with beneath (no symlink, no other mount on the way), creating what is
// missing. The directory itself is returned as is, not a copy.
func (u *unpacker) parentDir(rel string) (int, error) {
	if rel == "" {
		return u.dir, nil
	}
	// No O_NOFOLLOW: with RESOLVE_NO_SYMLINKS a symlink, the last name's
	// too, is ELOOP.
	how := &unix.OpenHow{Flags: unix.O_PATH | unix.O_DIRECTORY | unix.O_CLOEXEC, Resolve: beneath}
	fd, err := unix.Openat2(u.dir, rel, how)
	if errors.Is(err, unix.ENOENT) {
		// Made one name at a time below an fd already checked.
		fd, err = unix.Dup(u.dir)
		for _, name := range strings.Split(rel, "/") {
			if err != nil {
				break
			}
			if merr := unix.Mkdirat(fd, name, 0o755); merr != nil && !errors.Is(merr, unix.EEXIST) {
				unix.Close(fd)
				return -1, merr
			}
			var next int
			next, err = unix.Openat2(fd, name, how)
			unix.Close(fd)
			fd = next
		}
	}
	if errors.Is(err, unix.ELOOP) {
		return -1, &FileError{Errno: unix.ELOOP, Msg: "a parent is a symbolic link: an upload writes nothing through one"}
	}
	return fd, err
}

// Download packs path (a final symlink is packed as the symlink) as a PAX
// tar archive, its entries named relative to path's parent, and returns it
// with its count of entries. Regular files, directories and symlinks are
// packed, a file with several links within the tree as a hard link to its
// first name; FIFOs, sockets and devices are left out, and mount points are
// packed as empty directories. An archive that would pass max bytes (0 or
// more than MaxArchiveBytes: MaxArchiveBytes) is an EFBIG *FileError, not a
// cut archive.
func (s *Sandbox) Download(ctx context.Context, path string, max int64) ([]byte, int64, error) {
	if max < 0 {
		return nil, 0, fmt.Errorf("%w: negative max_bytes", ErrInvalid)
	}
	if max == 0 || max > MaxArchiveBytes {
		max = MaxArchiveBytes
	}
	var p *packer
	err := s.fileOpIn(path, true, func(root int, rel string) error {
		if strings.Trim(rel, "/") == "" {
			return fmt.Errorf("%w: download of the sandbox's root: name a directory below it", ErrInvalid)
		}
		parent, name, err := splitLast(path, rel)
		if err != nil {
			return err
		}
		dir, err := openParent(root, parent)
		if err != nil {
			return err
		}
		defer unix.Close(dir)
		p = &packer{ctx: ctx, max: max, hostID: s.hostID, links: map[[2]uint64]string{}}
		p.tw = tar.NewWriter(&p.out)
		if err := p.entry(dir, name, name, 0); err != nil {
			return withPath(path, err)
		}
		if err := p.tw.Close(); err != nil {
			return err
		}
		return p.room(0)
	})
	if err != nil {
		return nil, 0, err
	}
	return p.out.Bytes(), p.files, nil
}

// packer is one download's walk.
type packer struct {
	ctx    context.Context
	max    int64
	hostID int
	out    bytes.Buffer
	tw     *tar.Writer
	files  int64
	links  map[[2]uint64]string // the first name of each file with several links
}

// room fails with EFBIG unless n more bytes and the archive's end fit in max.
func (p *packer) room(n int64) error {
	if int64(p.out.Len())+n+1024 > p.max {
		return &FileError{Errno: unix.EFBIG, Msg: fmt.Sprintf("the archive would be more than %d bytes (max_bytes)", p.max)}
	}
	return nil
}

// entry packs name of the directory dir as tarName, with its tree; depth is
// dir's below the downloaded path's parent.
func (p *packer) entry(dir int, name, tarName string, depth int) error {
	if err := p.ctx.Err(); err != nil {
		return err
	}
	var st unix.Stat_t
	if err := unix.Fstatat(dir, name, &st, unix.AT_SYMLINK_NOFOLLOW); err != nil {
		if depth > 0 && errors.Is(err, unix.ENOENT) { // removed since it was listed
			return nil
		}
		return err
	}
	if raceHook != nil {
		raceHook(dir, name)
	}
	switch st.Mode & unix.S_IFMT {
	case unix.S_IFREG:
		return p.file(dir, name, tarName, depth)
	case unix.S_IFDIR:
		return p.dir(dir, name, tarName, &st, depth)
	case unix.S_IFLNK:
		target, err := readlinkAt(dir, name)
		if err != nil {
			return err
		}
		return p.header(p.hdr(tarName, tar.TypeSymlink, &st, target), 0)
	}
	if depth == 0 {
		return &FileError{Errno: unix.EINVAL, Msg: fileType(st.Mode) + ": only files, directories and symlinks are packed"}
	}
	return nil // a FIFO, socket or device in the tree: left out
}

// hdr is the header of the file st as name.
func (p *packer) hdr(name string, typ byte, st *unix.Stat_t, link string) *tar.Header {
	id := func(host uint32) int {
		if n := int(host) - p.hostID; n >= 0 && n < 1<<16 {
			return n
		}
		return 65534 // outside the sandbox's range: nobody
	}
	return &tar.Header{Typeflag: typ, Name: name, Linkname: link, Mode: int64(st.Mode & 0o7777), Uid: id(st.Uid), Gid: id(st.Gid),
		ModTime: time.Unix(st.Mtim.Unix()), Format: tar.FormatPAX}
}

// header writes h, followed by size bytes of contents, if they fit.
func (p *packer) header(h *tar.Header, size int64) error {
	if err := p.room(1536 + (size+511)&^511); err != nil {
		return err
	}
	if err := p.tw.WriteHeader(h); err != nil {
		return err
	}
	p.files++
	return p.room(size)
}

// file packs the regular file name of dir, read through a descriptor
// opened beneath without following a name swapped for a symlink.
func (p *packer) file(dir int, name, tarName string, depth int) error {
	fd, err := unix.Openat2(dir, name, &unix.OpenHow{Flags: unix.O_RDONLY | unix.O_NOFOLLOW | unix.O_NONBLOCK | unix.O_NOCTTY | unix.O_CLOEXEC, Resolve: beneath})
	if err != nil {
		if depth > 0 && (errors.Is(err, unix.ENOENT) || errors.Is(err, unix.ELOOP)) {
			return nil // removed or swapped since it was listed
		}
		return err
	}
	defer unix.Close(fd)
	var st unix.Stat_t
	if err := unix.Fstat(fd, &st); err != nil {
		return err
	}
	if st.Mode&unix.S_IFMT != unix.S_IFREG {
		return nil // swapped since it was listed
	}
	if st.Nlink > 1 {
		key := [2]uint64{st.Dev, st.Ino}
		if first, ok := p.links[key]; ok {
			return p.header(p.hdr(tarName, tar.TypeLink, &st, first), 0)
		}
		p.links[key] = tarName
	}
	h := p.hdr(tarName, tar.TypeReg, &st, "")
	h.Size = st.Size
	if err := p.header(h, st.Size); err != nil {
		return err
	}
	// The file may change while it is read: exactly the size its header
	// says is packed, what is missing as zeros.
	buf := make([]byte, min(st.Size, 256<<10))
	for off := int64(0); off < st.Size; {
		n := min(int64(len(buf)), st.Size-off)
		k, err := preadFull(fd, buf[:n], off)
		if err != nil {
			return err
		}
		clear(buf[k:n])
		if _, err := p.tw.Write(buf[:n]); err != nil {
			return err
		}
		off += n
	}
	return nil
}

// dir packs the directory name of dir and its tree; a mount point is
// packed empty.
func (p *packer) dir(dir int, name, tarName string, st *unix.Stat_t, depth int) error {
	if err := p.header(p.hdr(tarName+"/", tar.TypeDir, st, ""), 0); err != nil {
		return err
	}
	if depth >= MaxTreeDepth {
		return &FileError{Errno: unix.ELOOP, Msg: fmt.Sprintf("nested more than %d directories deep", MaxTreeDepth)}
	}
	fd, err := unix.Openat2(dir, name, &unix.OpenHow{Flags: unix.O_RDONLY | unix.O_DIRECTORY | unix.O_NOFOLLOW | unix.O_CLOEXEC, Resolve: beneath})
	switch {
	case depth > 0 && (errors.Is(err, unix.EXDEV) || errors.Is(err, unix.ENOENT) || errors.Is(err, unix.ELOOP) || errors.Is(err, unix.ENOTDIR)):
		return nil // a mount point, or removed or swapped since it was listed
	case err != nil:
		return err
	}
	defer unix.Close(fd)
	// Each entry takes a header block at least: more than fit are EFBIG.
	names, more, err := readNamesMax(fd, int(p.max/512)+1)
	if err != nil {
		return err
	}
	if more {
		return p.room(p.max)
	}
	slices.Sort(names)
	for _, n := range names {
		if err := p.entry(fd, n, tarName+"/"+n, depth+1); err != nil {
			return err
		}
	}
	return nil
}
