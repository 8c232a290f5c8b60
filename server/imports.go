package server

import (
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"strings"

	"golang.org/x/sys/unix"

	"github.com/deltagym/deltagym/sandbox/image"
)

// importRoot is the one host directory that ImportImage reads from (Config.Import.Root). A
// request names a path below it, relative to it or absolute; the path is resolved from a
// descriptor of the root with openat2(RESOLVE_BENEATH), so neither ".." nor a symlink leads out
// of it, and the import then reads through the descriptor of what was resolved, never by name
// again.
type importRoot struct {
	dir      string
	fd       int // O_PATH descriptor of dir
	maxBytes int64
}

// errOutsideImports is the one answer for every path that is not below the import root, so
// that the answer never tells whether something exists outside it.
var errOutsideImports = errors.New("is not below the server's import root (--import-root), or a symlink on its way leads out of it: put it there and name it by its path relative to that directory")

func openImportRoot(dir string, maxBytes int64) (*importRoot, error) {
	if err := os.MkdirAll(dir, 0o700); err != nil {
		return nil, fmt.Errorf("creating the import root: %w", err)
	}
	fd, err := unix.Open(dir, unix.O_PATH|unix.O_DIRECTORY|unix.O_CLOEXEC, 0)
	if err != nil {
		return nil, fmt.Errorf("opening the import root %s: %w", dir, err)
	}
	return &importRoot{dir: dir, fd: fd, maxBytes: maxBytes}, nil
}

// Close releases the root's descriptor. It is idempotent.
func (r *importRoot) Close() error {
	if r.fd < 0 {
		return nil
	}
	err := unix.Close(r.fd)
	r.fd = -1
	return err
}

// rel returns the path below the root that name (as a request gives it) stands for; what
// names the path in errors ("image path").
func (r *importRoot) rel(what, name string) (string, error) {
	if strings.ContainsRune(name, 0) {
		return "", fmt.Errorf("%s %q %w: %w", what, name, errOutsideImports, ErrInvalid)
	}
	if filepath.IsAbs(name) {
		rel, err := filepath.Rel(r.dir, filepath.Clean(name))
		if err != nil || rel == ".." || strings.HasPrefix(rel, "../") {
			return "", fmt.Errorf("%s %q %w: %w", what, name, errOutsideImports, ErrInvalid)
		}
		name = rel
	}
	clean := filepath.Clean(name)
	if clean == ".." || strings.HasPrefix(clean, "../") {
		return "", fmt.Errorf("%s %q %w: %w", what, name, errOutsideImports, ErrInvalid)
	}
	return clean, nil
}

// open resolves the image path name below the root (openBelow).
func (r *importRoot) open(name string) (*os.File, error) { return r.openBelow("image path", name) }

// openVerifierFiles resolves an env's verifier files directory below the root (openBelow),
// for envpool.Config.OpenVerifierFiles, which gives the error its class (an invalid spec).
func (r *importRoot) openVerifierFiles(name string) (*os.File, error) {
	f, err := r.openBelow("verifier files", name)
	if err != nil {
		return nil, errors.New(strings.TrimSuffix(err.Error(), ": "+ErrInvalid.Error()))
	}
	return f, nil
}

// openBelow resolves name below the root and returns an O_PATH descriptor of it; what names
// the path in errors. A path that leaves the root, by "..", an absolute symlink or one that
// climbs out, gets errOutsideImports; one that is missing inside the root gets a not-found
// error naming it as the request did.
func (r *importRoot) openBelow(what, name string) (*os.File, error) {
	rel, err := r.rel(what, name)
	if err != nil {
		return nil, err
	}
	how := unix.OpenHow{Flags: unix.O_PATH | unix.O_CLOEXEC, Resolve: unix.RESOLVE_BENEATH | unix.RESOLVE_NO_MAGICLINKS}
	fd, err := unix.Openat2(r.fd, rel, &how)
	for errors.Is(err, unix.EAGAIN) || errors.Is(err, unix.EINTR) {
		// The kernel's answer when a mount or rename anywhere raced the lookup.
		fd, err = unix.Openat2(r.fd, rel, &how)
	}
	switch {
	case err == nil:
		return os.NewFile(uintptr(fd), name), nil
	case errors.Is(err, unix.EXDEV), errors.Is(err, unix.ELOOP):
		return nil, fmt.Errorf("%s %q %w: %w", what, name, errOutsideImports, ErrInvalid)
	case errors.Is(err, unix.ENOENT), errors.Is(err, unix.ENOTDIR):
		return nil, fmt.Errorf("%s %q: nothing there below the server's import root: %w", what, name, ErrInvalid)
	}
	return nil, fmt.Errorf("opening %s %q below the import root: %w", what, name, err)
}

// options are the image options of every import from the root.
func (r *importRoot) options() []image.Option {
	return []image.Option{image.WithMaxBytes(r.maxBytes)}
}

// fdPath names an open descriptor for the code that takes paths: the magic link reopens
// exactly what the descriptor holds, whatever happens to names meanwhile.
func fdPath(f *os.File) string {
	return "/proc/self/fd/" + strconv.Itoa(int(f.Fd()))
}

// renamedError shows an error with one path replaced by the name the request gave it,
// keeping the error's chain for errors.Is.
type renamedError struct {
	err      error
	old, new string
}

func (e renamedError) Error() string { return strings.ReplaceAll(e.err.Error(), e.old, e.new) }
func (e renamedError) Unwrap() error { return e.err }
