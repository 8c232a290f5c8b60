// Package image imports sandbox base images into read-only layer directories that are ready
// to be overlayfs lower dirs.
//
// Three sources are accepted: an OCI image layout directory (oci-layout, index.json,
// blobs/sha256), a `docker save` tarball (the classic manifest.json form, and the newer form
// that is an OCI layout inside a tar; an extracted one works too), and a plain rootfs
// directory, which becomes a single layer. OCI whiteouts become overlayfs whiteouts (a 0:0
// character device) and opaque directories the xattr trusted.overlay.opaque=y. Ownership is
// kept as the image states it (image-relative; sandboxes see layers through idmapped mounts),
// with modes, times, symlinks, hardlinks, xattrs, device nodes and fifos.
//
// Layers are untrusted input: no entry is written outside its layer directory (absolute names,
// ".." components and paths through symlinks are refused with ErrUnsafePath), and every blob
// is checked against its sha256 digest.
package image

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"strconv"
)

// Config is the part of an image's OCI config that says how to run it. Fields are zero when
// the image does not set them.
type Config struct {
	Env        []string `json:"Env,omitempty"`
	WorkingDir string   `json:"WorkingDir,omitempty"`
	User       string   `json:"User,omitempty"`
	Entrypoint []string `json:"Entrypoint,omitempty"`
	Cmd        []string `json:"Cmd,omitempty"`
}

// Imported describes an imported image.
type Imported struct {
	// Layers are absolute paths of the layer directories, bottom layer first. overlayfs lists
	// lower dirs top first, so reverse them for lowerdir=.
	Layers []string
	// Config is the image's run configuration.
	Config Config
	// Digest identifies the image: for OCI and docker images the digest of the config blob
	// (the image ID docker shows); for a rootfs directory a sha256 over every entry's name,
	// type, mode, owner, link target, device numbers, xattrs and contents (not times).
	Digest string
}

// metaFile records a completed import in its directory; it is written last.
const metaFile = "image.json"

type record struct {
	Layers []string `json:"layers"`
	Config Config   `json:"config"`
	Digest string   `json:"digest"`
}

// Import imports the image at src into dir, which must exist and be empty. It creates one
// directory per layer in dir (named 0, 1, … bottom first) and a record that Load reads. The
// layers are built in a temporary directory inside dir and renamed into place; on error dir is
// left empty.
func Import(ctx context.Context, src string, dir string, opts ...Option) (_ *Imported, err error) {
	var o options
	for _, opt := range opts {
		opt(&o)
	}
	if err := checkEmpty(dir); err != nil {
		return nil, err
	}
	abs, err := filepath.Abs(dir)
	if err != nil {
		return nil, fmt.Errorf("importing into %s: %w", dir, err)
	}
	staging, err := os.MkdirTemp(abs, ".import-")
	if err != nil {
		return nil, fmt.Errorf("creating staging directory: %w", err)
	}
	var placed []string
	defer func() {
		if err == nil {
			err = os.RemoveAll(staging)
			return
		}
		errs := []error{err, os.RemoveAll(staging)}
		for _, p := range placed {
			errs = append(errs, os.RemoveAll(p))
		}
		err = errors.Join(errs...)
	}()

	imp, err := importInto(ctx, src, staging, newBudget(o.maxBytes))
	if err != nil {
		return nil, fmt.Errorf("importing %s: %w", src, err)
	}
	rec := record{Config: imp.Config, Digest: imp.Digest}
	for i, l := range imp.Layers {
		name := strconv.Itoa(i)
		dst := filepath.Join(abs, name)
		if err := os.Rename(l, dst); err != nil {
			return nil, fmt.Errorf("placing layer %d: %w", i, err)
		}
		placed = append(placed, dst)
		imp.Layers[i] = dst
		rec.Layers = append(rec.Layers, name)
	}
	b, err := json.MarshalIndent(rec, "", "  ")
	if err != nil {
		return nil, err
	}
	tmp := filepath.Join(staging, metaFile)
	if err := os.WriteFile(tmp, append(b, '\n'), 0o644); err != nil {
		return nil, fmt.Errorf("writing %s: %w", metaFile, err)
	}
	dst := filepath.Join(abs, metaFile)
	if err := os.Rename(tmp, dst); err != nil {
		return nil, fmt.Errorf("writing %s: %w", metaFile, err)
	}
	placed = append(placed, dst)
	return imp, nil
}

// Load returns the image that Import placed in dir.
func Load(dir string) (*Imported, error) {
	abs, err := filepath.Abs(dir)
	if err != nil {
		return nil, fmt.Errorf("loading image from %s: %w", dir, err)
	}
	b, err := os.ReadFile(filepath.Join(abs, metaFile))
	if errors.Is(err, os.ErrNotExist) {
		return nil, fmt.Errorf("loading image from %s: %w", dir, ErrNotImported)
	}
	if err != nil {
		return nil, fmt.Errorf("loading image from %s: %w", dir, err)
	}
	var rec record
	if err := json.Unmarshal(b, &rec); err != nil {
		return nil, fmt.Errorf("loading image from %s: %w: %w", dir, ErrNotImported, err)
	}
	imp := &Imported{Config: rec.Config, Digest: rec.Digest}
	for _, l := range rec.Layers {
		if _, err := cleanEntryName(l); err != nil || filepath.Base(l) != l {
			return nil, fmt.Errorf("loading image from %s: layer name %q: %w", dir, l, ErrNotImported)
		}
		imp.Layers = append(imp.Layers, filepath.Join(abs, l))
	}
	return imp, nil
}

func checkEmpty(dir string) error {
	f, err := os.Open(dir)
	if err != nil {
		return fmt.Errorf("opening import directory: %w", err)
	}
	defer f.Close()
	st, err := f.Stat()
	if err != nil {
		return fmt.Errorf("opening import directory: %w", err)
	}
	if !st.IsDir() {
		return fmt.Errorf("%s is not a directory: %w", dir, ErrDirNotEmpty)
	}
	names, err := f.Readdirnames(1)
	if len(names) > 0 {
		return fmt.Errorf("%s: %w", dir, ErrDirNotEmpty)
	}
	if err != nil && !errors.Is(err, io.EOF) {
		return fmt.Errorf("reading import directory: %w", err)
	}
	return nil
}

// importInto recognises the source and builds its layers in staging.
func importInto(ctx context.Context, src, staging string, b *budget) (*Imported, error) {
	st, err := os.Stat(src)
	if err != nil {
		return nil, err
	}
	switch {
	case st.IsDir():
		ds, err := openDirSource(src)
		if err != nil {
			return nil, err
		}
		defer ds.Close()
		switch {
		case ds.has(layoutFile) && ds.has(indexFile):
			return importOCI(ctx, ds, staging, b)
		case ds.has(dockerManifestFile):
			return importDocker(ctx, ds, staging, b)
		default:
			return importRootfs(ctx, src, staging, b)
		}
	case st.Mode().IsRegular():
		f, err := openArchive(src, staging, b)
		if err != nil {
			return nil, err
		}
		defer f.Close()
		ts, err := openTarSource(f)
		if err != nil {
			return nil, err
		}
		switch {
		case ts.has(layoutFile) && ts.has(indexFile):
			return importOCI(ctx, ts, staging, b)
		case ts.has(dockerManifestFile):
			return importDocker(ctx, ts, staging, b)
		default:
			return nil, fmt.Errorf("tarball has neither index.json nor manifest.json: %w", ErrUnknownFormat)
		}
	default:
		return nil, fmt.Errorf("%s is neither a directory nor a file: %w", src, ErrUnknownFormat)
	}
}
