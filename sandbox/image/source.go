package image

import (
	"archive/tar"
	"errors"
	"fmt"
	"io"
	"os"
	"path"

	"golang.org/x/sys/unix"
)

// source opens the files of an image layout (index.json, blobs/sha256/..., manifest.json)
// by their slash-separated names, from a directory or from inside a tarball.
type source interface {
	open(name string) (io.ReadCloser, error)
	has(name string) bool
}

// dirSource reads an image layout directory. Names resolve inside the directory even through
// symlinks (docker save links duplicate layers with relative symlinks).
type dirSource struct {
	root int
}

func openDirSource(dir string) (*dirSource, error) {
	fd, err := unix.Open(dir, unix.O_DIRECTORY|unix.O_RDONLY|unix.O_CLOEXEC, 0)
	if err != nil {
		return nil, fmt.Errorf("opening image directory: %w", err)
	}
	return &dirSource{root: fd}, nil
}

func (s *dirSource) open(name string) (io.ReadCloser, error) {
	clean, err := cleanEntryName(name)
	if err != nil {
		return nil, fmt.Errorf("image file %q: %w", name, err)
	}
	// O_NONBLOCK: a FIFO planted at the name must not hang the import (it is refused below as
	// not a regular file); reads of a regular file ignore the flag.
	how := unix.OpenHow{
		Flags:   unix.O_RDONLY | unix.O_CLOEXEC | unix.O_NONBLOCK,
		Resolve: unix.RESOLVE_IN_ROOT | unix.RESOLVE_NO_MAGICLINKS,
	}
	fd, err := unix.Openat2(s.root, clean, &how)
	if err != nil {
		return nil, fmt.Errorf("opening image file %s: %w", clean, err)
	}
	f := os.NewFile(uintptr(fd), clean)
	st, err := f.Stat()
	if err != nil {
		f.Close()
		return nil, err
	}
	if !st.Mode().IsRegular() {
		f.Close()
		return nil, fmt.Errorf("image file %s is not a regular file: %w", clean, ErrInvalidImage)
	}
	return f, nil
}

func (s *dirSource) has(name string) bool {
	r, err := s.open(name)
	if err != nil {
		return false
	}
	r.Close()
	return true
}

func (s *dirSource) Close() error { return unix.Close(s.root) }

// tarSource reads an uncompressed docker save tarball in place: it indexes where each
// member's data starts and hands out section readers.
type tarSource struct {
	f       *os.File
	members map[string]tarMember
}

type tarMember struct {
	typ      byte
	linkname string
	off      int64
	size     int64
}

// The index of a tarball is bounded: an image archive holds a few files per layer, with short
// names (a digest, a layer directory), so that a tarball of many members with long names cannot
// make the index take the server's memory.
const (
	maxMembers    = 1 << 16
	maxMemberName = 1024
)

func openTarSource(f *os.File) (*tarSource, error) {
	s := &tarSource{f: f, members: map[string]tarMember{}}
	if _, err := f.Seek(0, io.SeekStart); err != nil {
		return nil, err
	}
	// tar.Reader reads headers block by block and skips data by seeking, so after Next the
	// file offset is where the member's data starts.
	tr := tar.NewReader(f)
	for {
		hdr, err := tr.Next()
		if errors.Is(err, io.EOF) {
			break
		}
		if err != nil && !errors.Is(err, tar.ErrInsecurePath) {
			if len(s.members) == 0 {
				return nil, fmt.Errorf("reading image tarball: %w: %w", ErrUnknownFormat, err)
			}
			return nil, fmt.Errorf("reading image tarball: %w", err)
		}
		if len(hdr.Name) > maxMemberName || len(hdr.Linkname) > maxMemberName {
			continue // never looked up: no name the manifest gives is that long
		}
		name, err := cleanEntryName(hdr.Name)
		if err != nil {
			// Never looked up: names come from the manifest and are cleaned the same way.
			continue
		}
		if _, seen := s.members[name]; !seen && len(s.members) >= maxMembers {
			return nil, fmt.Errorf("image tarball has more than %d members, more than an image archive needs: %w", maxMembers, ErrInvalidImage)
		}
		m := tarMember{typ: hdr.Typeflag, linkname: hdr.Linkname, size: hdr.Size}
		if hdr.Typeflag == tar.TypeReg || hdr.Typeflag == tar.TypeRegA { //nolint:staticcheck // old tars
			if _, sparse := hdr.PAXRecords["GNU.sparse.map"]; sparse {
				continue
			}
			off, err := f.Seek(0, io.SeekCurrent)
			if err != nil {
				return nil, err
			}
			m.off = off
		}
		s.members[name] = m
	}
	return s, nil
}

// lookup resolves name, following symlinks and hardlinks between members.
func (s *tarSource) lookup(name string) (tarMember, error) {
	clean, err := cleanEntryName(name)
	if err != nil {
		return tarMember{}, fmt.Errorf("image file %q: %w", name, err)
	}
	for range 16 {
		m, ok := s.members[clean]
		if !ok {
			return tarMember{}, fmt.Errorf("image file %s: %w", clean, os.ErrNotExist)
		}
		switch m.typ {
		case tar.TypeReg, tar.TypeRegA: //nolint:staticcheck // old tars
			return m, nil
		case tar.TypeSymlink:
			target := m.linkname
			if !path.IsAbs(target) {
				target = path.Join(path.Dir(clean), target)
			}
			// Resolve as if the tarball were the root, like RESOLVE_IN_ROOT.
			clean = path.Clean("/" + target)[1:]
			if clean == "" {
				clean = "."
			}
		case tar.TypeLink:
			if clean, err = cleanEntryName(m.linkname); err != nil {
				return tarMember{}, err
			}
		default:
			return tarMember{}, fmt.Errorf("image file %s is not a regular file: %w", clean, ErrInvalidImage)
		}
	}
	return tarMember{}, fmt.Errorf("image file %s: too many links: %w", name, ErrInvalidImage)
}

func (s *tarSource) open(name string) (io.ReadCloser, error) {
	m, err := s.lookup(name)
	if err != nil {
		return nil, err
	}
	return io.NopCloser(io.NewSectionReader(s.f, m.off, m.size)), nil
}

func (s *tarSource) has(name string) bool {
	_, err := s.lookup(name)
	return err == nil
}
