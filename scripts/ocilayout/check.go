package main

import (
	"archive/tar"
	"bufio"
	"bytes"
	"compress/gzip"
	"crypto/sha256"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"os"
	"path/filepath"
)

// maxJSONBlob bounds what check reads of a JSON blob.
const maxJSONBlob = 16 << 20

// checkedImage is one image of a layout that checkLayout verified.
type checkedImage struct {
	Tag      string // its org.opencontainers.image.ref.name, or ""
	Manifest descriptor
	Config   imageConfig
	Layers   []descriptor
}

// checkLayout verifies the OCI image layout dir: oci-layout says 1.0.0; index.json lists
// manifests; each manifest, its config and its layers have the media types the image spec
// gives them and the digests and sizes their descriptors say; every layer is a tar (gzip or
// not) whose uncompressed digest is the config's diff_id.
func checkLayout(dir string) ([]checkedImage, error) {
	var lf layoutFile
	if err := readJSON(filepath.Join(dir, "oci-layout"), &lf); err != nil {
		return nil, err
	}
	if lf.ImageLayoutVersion != "1.0.0" {
		return nil, fmt.Errorf("oci-layout says version %q, want 1.0.0", lf.ImageLayoutVersion)
	}
	var idx index
	if err := readJSON(filepath.Join(dir, "index.json"), &idx); err != nil {
		return nil, err
	}
	if idx.SchemaVersion != 2 || (idx.MediaType != "" && idx.MediaType != mediaTypeLayoutIndex) || len(idx.Manifests) == 0 {
		return nil, fmt.Errorf("index.json: schemaVersion %d, mediaType %q, %d manifests; want 2, %s and at least one",
			idx.SchemaVersion, idx.MediaType, len(idx.Manifests), mediaTypeLayoutIndex)
	}
	var out []checkedImage
	for _, md := range idx.Manifests {
		img, err := checkManifest(dir, md)
		if err != nil {
			return nil, fmt.Errorf("manifest %s: %w", md.Digest, err)
		}
		out = append(out, img)
	}
	return out, nil
}

// checkManifest verifies one manifest of the index and what it references.
func checkManifest(dir string, md descriptor) (checkedImage, error) {
	img := checkedImage{Tag: md.Annotations[annotationRefName], Manifest: md}
	if md.MediaType != mediaTypeManifest {
		return img, fmt.Errorf("media type %q, want %s", md.MediaType, mediaTypeManifest)
	}
	var m manifest
	if err := readJSONBlob(dir, md, &m); err != nil {
		return img, err
	}
	if m.SchemaVersion != 2 || m.MediaType != mediaTypeManifest {
		return img, fmt.Errorf("schemaVersion %d, mediaType %q; want 2, %s", m.SchemaVersion, m.MediaType, mediaTypeManifest)
	}
	if m.Config.MediaType != mediaTypeConfig {
		return img, fmt.Errorf("config media type %q, want %s", m.Config.MediaType, mediaTypeConfig)
	}
	if err := readJSONBlob(dir, m.Config, &img.Config); err != nil {
		return img, fmt.Errorf("config: %w", err)
	}
	c := img.Config
	if c.OS == "" || c.Architecture == "" || c.RootFS.Type != "layers" || len(c.RootFS.DiffIDs) != len(m.Layers) {
		return img, fmt.Errorf("config: os %q, architecture %q, rootfs type %q with %d diff_ids for %d layers",
			c.OS, c.Architecture, c.RootFS.Type, len(c.RootFS.DiffIDs), len(m.Layers))
	}
	for i, l := range m.Layers {
		if err := checkLayer(dir, l, c.RootFS.DiffIDs[i]); err != nil {
			return img, fmt.Errorf("layer %d (%s): %w", i, l.Digest, err)
		}
	}
	img.Layers = m.Layers
	return img, nil
}

// checkLayer verifies a layer blob: its media type, digest and size, and that it is a tar
// whose digest is diffID.
func checkLayer(dir string, d descriptor, diffID string) error {
	if d.MediaType != mediaTypeLayerGzip && d.MediaType != mediaTypeLayerTar {
		return fmt.Errorf("media type %q, want %s or %s", d.MediaType, mediaTypeLayerGzip, mediaTypeLayerTar)
	}
	name, err := blobPath(dir, d.Digest)
	if err != nil {
		return err
	}
	f, err := os.Open(name)
	if err != nil {
		return err
	}
	defer f.Close()
	blobHash, diffHash := sha256.New(), sha256.New()
	counted := &countWriter{w: blobHash}
	blob := io.TeeReader(f, counted)
	var r io.Reader = bufio.NewReaderSize(blob, 1<<20)
	var gz *gzip.Reader
	if d.MediaType == mediaTypeLayerGzip {
		if gz, err = gzip.NewReader(r); err != nil {
			return err
		}
		gz.Multistream(false)
		r = gz
	}
	r = io.TeeReader(r, diffHash)
	tr := tar.NewReader(r)
	for {
		if _, err := tr.Next(); errors.Is(err, io.EOF) {
			break
		} else if err != nil {
			return fmt.Errorf("reading the tar: %w", err)
		}
	}
	// What follows the end-of-archive blocks is part of the diff too, and what follows the
	// compressed stream part of the blob.
	if _, err := io.Copy(io.Discard, r); err != nil {
		return err
	}
	if _, err := io.Copy(io.Discard, blob); err != nil {
		return err
	}
	return checkSums(d, counted.n, sumDigest(blobHash.Sum(nil)), sumDigest(diffHash.Sum(nil)), diffID)
}

// checkSums compares a layer's size and digests with what its descriptor and config say.
func checkSums(d descriptor, size int64, digest, diff, diffID string) error {
	switch {
	case size != d.Size:
		return fmt.Errorf("blob has %d bytes, its descriptor says %d", size, d.Size)
	case digest != d.Digest:
		return fmt.Errorf("blob hashes to %s", digest)
	case diff != diffID:
		return fmt.Errorf("uncompressed layer hashes to %s, the config's diff_id is %s", diff, diffID)
	}
	return nil
}

// readJSON decodes the JSON file name into v.
func readJSON(name string, v any) error {
	b, err := os.ReadFile(name)
	if err != nil {
		return err
	}
	if err := json.Unmarshal(b, v); err != nil {
		return fmt.Errorf("decoding %s: %w", name, err)
	}
	return nil
}

// readJSONBlob reads the blob d points at, checks its digest and size, and decodes it into v.
func readJSONBlob(dir string, d descriptor, v any) error {
	name, err := blobPath(dir, d.Digest)
	if err != nil {
		return err
	}
	f, err := os.Open(name)
	if err != nil {
		return err
	}
	defer f.Close()
	b, err := io.ReadAll(io.LimitReader(f, maxJSONBlob+1))
	if err != nil {
		return err
	}
	sum := sha256.Sum256(b)
	switch {
	case len(b) > maxJSONBlob:
		return fmt.Errorf("blob %s is larger than %d bytes", d.Digest, maxJSONBlob)
	case int64(len(b)) != d.Size:
		return fmt.Errorf("blob %s has %d bytes, its descriptor says %d", d.Digest, len(b), d.Size)
	case sumDigest(sum[:]) != d.Digest:
		return fmt.Errorf("blob %s hashes to %s", d.Digest, sumDigest(sum[:]))
	}
	dec := json.NewDecoder(bytes.NewReader(b))
	if err := dec.Decode(v); err != nil {
		return fmt.Errorf("decoding blob %s: %w", d.Digest, err)
	}
	return nil
}

// runCheck is the subcommand check.
func runCheck(args []string, log io.Writer) error {
	if len(args) != 1 {
		return errors.New("usage: ocilayout check DIR")
	}
	imgs, err := checkLayout(args[0])
	if err != nil {
		return fmt.Errorf("%s: %w", args[0], err)
	}
	for _, img := range imgs {
		var size int64
		for _, l := range img.Layers {
			size += l.Size
		}
		fmt.Fprintf(log, "%s:%s manifest %s, %d layers, %d bytes: valid\n", args[0], img.Tag, img.Manifest.Digest, len(img.Layers), size)
	}
	return nil
}
