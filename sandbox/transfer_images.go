package sandbox

import (
	"archive/tar"
	"context"
	"crypto/rand"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"regexp"
	"slices"
	"strings"

	"golang.org/x/sys/unix"

	"github.com/deltagym/deltagym/sandbox/layers"
	"github.com/deltagym/deltagym/sandbox/procstate"
)

// A checkpoint's processes move between nodes as CRIU images: its trees' (procstate.Unit, made
// by CRIU at the checkpoint) and its templates' (made from them on demand, as for a restore in
// another sandbox: imagesForTemplates). The manifest carries the units, each Dir the name of
// its directory below the checkpoint's images directory, and the digest of their stream: a tar
// of every unit's files, in the order of the units' names then the files', with no owners,
// modes or times (ExportImages). The receiving node holds them as the checkpoint's CRIU trees:
// every restore and fork there is a CRIU restore.
//
// CRIU restores what an image says as root: a node trusts its peers' images as it trusts its
// own (a cluster has one token, and its nodes one operator).

// unitName is what the name of a unit's directory may be: a tree's number, or "t" and a
// template's.
var unitName = regexp.MustCompile(`^t?[0-9]{1,6}$`)

// maxTrailer bounds what a stream of process images may hold after the tar's end.
const maxTrailer = 1 << 16

// maxImageFiles bounds the files of a checkpoint's images from another node, all units
// together (criu writes a few per process), and maxUnits its units: what a peer's stream may
// make in the store whatever its manifest says.
const (
	maxImageFiles = 1 << 16
	maxUnits      = 1 << 12
)

// portableUnits returns c's process images for another node, making those of its templates if
// need be (the sandbox that holds them must be alive, or they must have been saved), each
// unit's Dir the name of its directory below c's images directory.
func (r *Runtime) portableUnits(ctx context.Context, c *checkpoint) ([]procstate.Unit, error) {
	imgs, err := r.imagesForTemplates(ctx, c)
	if err != nil {
		return nil, err
	}
	dir := r.criuDir(c.ID)
	units := slices.Concat(c.Images, imgs)
	out := make([]procstate.Unit, len(units))
	for i, u := range units {
		if filepath.Dir(u.Dir) != dir || !unitName.MatchString(filepath.Base(u.Dir)) {
			return nil, fmt.Errorf("checkpoint %s: images of %s not in the checkpoint's own directory", c.ID, u.Dir)
		}
		out[i] = u
		out[i].Dir = filepath.Base(u.Dir)
	}
	slices.SortFunc(out, func(a, b procstate.Unit) int { return strings.Compare(a.Dir, b.Dir) })
	return out, nil
}

// ExportImages writes the process images of checkpoint id (as its manifest names them) to w,
// and returns the stream's digest.
func (r *Runtime) ExportImages(ctx context.Context, w io.Writer, id string) (string, error) {
	r.mu.Lock()
	c := r.ckpts[id]
	r.mu.Unlock()
	if c == nil {
		return "", fmt.Errorf("%w: checkpoint %q: unknown or released checkpoint", ErrNotFound, id)
	}
	units, err := r.portableUnits(ctx, c)
	if err != nil {
		return "", err
	}
	return writeImages(w, r.criuDir(id), units)
}

// writeImages writes the tar of units' files, below dir, to w and returns its digest.
func writeImages(w io.Writer, dir string, units []procstate.Unit) (string, error) {
	h := sha256.New()
	tw := tar.NewWriter(io.MultiWriter(w, h))
	for _, u := range units {
		ents, err := os.ReadDir(filepath.Join(dir, u.Dir))
		if err != nil {
			return "", err
		}
		for _, e := range ents { // os.ReadDir sorts by name
			if !e.Type().IsRegular() {
				return "", fmt.Errorf("images of %s: %s is not a regular file", u.Dir, e.Name())
			}
			if err := writeImageFile(tw, filepath.Join(dir, u.Dir, e.Name()), u.Dir+"/"+e.Name()); err != nil {
				return "", err
			}
		}
	}
	if err := tw.Close(); err != nil {
		return "", err
	}
	return layers.DigestOf(h), nil
}

func writeImageFile(tw *tar.Writer, path, name string) error {
	f, err := os.Open(path)
	if err != nil {
		return err
	}
	defer f.Close()
	fi, err := f.Stat()
	if err != nil {
		return err
	}
	if err := tw.WriteHeader(&tar.Header{Typeflag: tar.TypeReg, Name: name, Mode: 0o600, Size: fi.Size(), Format: tar.FormatPAX}); err != nil {
		return err
	}
	_, err = io.CopyN(tw, f, fi.Size())
	return err
}

// ImagesFetcher opens the stream of a checkpoint's process images from the node that holds it.
type ImagesFetcher func(ctx context.Context) (io.ReadCloser, error)

// adoptImages fetches m's process images into the runtime's images directory of m.ID, checks
// them against m's digest, and returns m's units as the runtime's own (each Dir a path); on
// error nothing is left.
func (r *Runtime) adoptImages(ctx context.Context, m CheckpointManifest, fetch ImagesFetcher) ([]procstate.Unit, error) {
	if len(m.Units) > maxUnits {
		return nil, fmt.Errorf("checkpoint %s: %d units of process images, more than %d", m.ID, len(m.Units), maxUnits)
	}
	names := map[string]bool{}
	for _, u := range m.Units {
		if !unitName.MatchString(u.Dir) || names[u.Dir] {
			return nil, fmt.Errorf("checkpoint %s: a unit of process images named %q", m.ID, u.Dir)
		}
		if u.Session != "" && !sessionNameRE.MatchString(u.Session) {
			return nil, fmt.Errorf("checkpoint %s: a unit of process images of session %.64q, which is no session's name", m.ID, u.Session)
		}
		names[u.Dir] = true
	}
	var suffix [8]byte
	_, _ = rand.Read(suffix[:])
	tmp := filepath.Join(r.store, "criu", ".adopt-"+hex.EncodeToString(suffix[:]))
	if err := os.MkdirAll(tmp, 0o700); err != nil {
		return nil, err
	}
	ok := false
	defer func() {
		if !ok {
			_ = os.RemoveAll(tmp)
		}
	}()
	rc, err := fetch(ctx)
	if err != nil {
		return nil, fmt.Errorf("fetching the process images of checkpoint %s: %w", m.ID, err)
	}
	defer rc.Close()
	h := sha256.New()
	held, err := readImages(io.TeeReader(rc, h), tmp, names, m.ImagesBytes)
	if err != nil {
		return nil, fmt.Errorf("the process images of checkpoint %s: %w", m.ID, err)
	}
	// What follows the tar's end (nothing, from a node of this version) is hashed too, up to
	// a bound: a stream that goes on is refused, not read forever.
	if n, err := io.Copy(h, io.LimitReader(rc, maxTrailer+1)); err != nil || n > maxTrailer {
		return nil, fmt.Errorf("the process images of checkpoint %s: the stream goes on after its end (%d bytes): %v", m.ID, n, err)
	}
	if got := layers.DigestOf(h); got != m.ImagesDigest {
		return nil, fmt.Errorf("the process images of checkpoint %s: the stream's digest is %s, the manifest's %s", m.ID, got, m.ImagesDigest)
	}
	dir := r.criuDir(m.ID)
	_ = os.RemoveAll(dir) // a leftover of an adoption that did not finish
	if err := os.Rename(tmp, dir); err != nil {
		return nil, err
	}
	ok = true
	// Each unit counts against the checkpoint caps as what it holds here, not as the peer said.
	units := slices.Clone(m.Units)
	for i := range units {
		units[i].Bytes = held[units[i].Dir]
		units[i].Dir = filepath.Join(dir, units[i].Dir)
	}
	return units, nil
}

// readImages extracts a stream of process images into dir: regular files only, each named
// UNIT/FILE with UNIT one of units and FILE a plain name, at most limit bytes in all. It returns
// the bytes of each unit's files. The stream is another node's: names are checked before
// anything is made, files are created new (never through a link) in directories readImages
// made.
func readImages(r io.Reader, dir string, units map[string]bool, limit int64) (map[string]int64, error) {
	for u := range units {
		if err := os.Mkdir(filepath.Join(dir, u), 0o700); err != nil {
			return nil, err
		}
	}
	held := map[string]int64{}
	tr := tar.NewReader(r)
	var total int64
	files := 0
	for {
		hdr, err := tr.Next()
		if errors.Is(err, io.EOF) {
			return held, nil
		}
		if err != nil {
			return nil, err
		}
		unit, name, found := strings.Cut(hdr.Name, "/")
		if hdr.Typeflag != tar.TypeReg || !found || !units[unit] || name == "" || name == "." || name == ".." || strings.ContainsAny(name, "/\x00") {
			return nil, fmt.Errorf("an entry %q of type %q: want UNIT/FILE, a regular file of a unit the manifest names", hdr.Name, hdr.Typeflag)
		}
		if files++; files > maxImageFiles {
			return nil, errors.New("too many files")
		}
		if total += hdr.Size; hdr.Size < 0 || total > limit {
			return nil, fmt.Errorf("more than the %d bytes the manifest says", limit)
		}
		fd, err := unix.Open(filepath.Join(dir, unit, name), unix.O_WRONLY|unix.O_CREAT|unix.O_EXCL|unix.O_NOFOLLOW|unix.O_CLOEXEC, 0o600)
		if err != nil {
			return nil, fmt.Errorf("%s: %w", hdr.Name, err)
		}
		f := os.NewFile(uintptr(fd), hdr.Name)
		_, err = io.CopyN(f, tr, hdr.Size)
		if cerr := f.Close(); err == nil {
			err = cerr
		}
		if err != nil {
			return nil, fmt.Errorf("%s: %w", hdr.Name, err)
		}
		held[unit] += hdr.Size
	}
}
