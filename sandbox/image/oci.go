package image

import (
	"bufio"
	"bytes"
	"compress/gzip"
	"context"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"fmt"
	"hash"
	"io"
	"os"
	"path/filepath"
	"regexp"
	"runtime"
	"strconv"
	"strings"
)

const (
	mediaTypeOCIIndex    = "application/vnd.oci.image.index.v1+json"
	mediaTypeDockerList  = "application/vnd.docker.distribution.manifest.list.v2+json"
	maxJSONSize          = 16 << 20
	layoutFile           = "oci-layout"
	indexFile            = "index.json"
	dockerManifestFile   = "manifest.json"
	maxIndexNestingDepth = 4
)

var sha256Digest = regexp.MustCompile(`^sha256:[a-f0-9]{64}$`)

type descriptor struct {
	MediaType   string            `json:"mediaType"`
	Digest      string            `json:"digest"`
	Size        int64             `json:"size"`
	Platform    *platform         `json:"platform,omitempty"`
	Annotations map[string]string `json:"annotations,omitempty"`
}

type platform struct {
	Architecture string `json:"architecture"`
	OS           string `json:"os"`
	Variant      string `json:"variant,omitempty"`
}

type index struct {
	MediaType string       `json:"mediaType"`
	Manifests []descriptor `json:"manifests"`
}

type manifest struct {
	MediaType string       `json:"mediaType"`
	Config    descriptor   `json:"config"`
	Layers    []descriptor `json:"layers"`
}

type imageConfig struct {
	Config *Config `json:"config"`
	RootFS struct {
		DiffIDs []string `json:"diff_ids"`
	} `json:"rootfs"`
}

type dockerManifest struct {
	Config string   `json:"Config"`
	Layers []string `json:"Layers"`
}

func blobName(digest string) (string, error) {
	if !sha256Digest.MatchString(digest) {
		return "", fmt.Errorf("digest %q is not a sha256 digest: %w", digest, ErrInvalidImage)
	}
	return "blobs/sha256/" + strings.TrimPrefix(digest, "sha256:"), nil
}

// readBlob reads a small blob (index, manifest, config) and checks its digest and size.
func readBlob(src source, d descriptor) ([]byte, error) {
	name, err := blobName(d.Digest)
	if err != nil {
		return nil, err
	}
	r, err := src.open(name)
	if err != nil {
		return nil, err
	}
	defer r.Close()
	b, err := io.ReadAll(io.LimitReader(r, maxJSONSize+1))
	if err != nil {
		return nil, fmt.Errorf("reading blob %s: %w", d.Digest, err)
	}
	if len(b) > maxJSONSize {
		return nil, fmt.Errorf("blob %s is larger than %d bytes: %w", d.Digest, maxJSONSize, ErrInvalidImage)
	}
	if got := digestOf(b); got != d.Digest {
		return nil, fmt.Errorf("blob %s hashes to %s: %w", d.Digest, got, ErrDigestMismatch)
	}
	if d.Size != 0 && int64(len(b)) != d.Size {
		return nil, fmt.Errorf("blob %s has %d bytes, descriptor says %d: %w", d.Digest, len(b), d.Size, ErrDigestMismatch)
	}
	return b, nil
}

func readFile(src source, name string) ([]byte, error) {
	r, err := src.open(name)
	if err != nil {
		return nil, err
	}
	defer r.Close()
	b, err := io.ReadAll(io.LimitReader(r, maxJSONSize+1))
	if err != nil {
		return nil, fmt.Errorf("reading %s: %w", name, err)
	}
	if len(b) > maxJSONSize {
		return nil, fmt.Errorf("%s is larger than %d bytes: %w", name, maxJSONSize, ErrInvalidImage)
	}
	return b, nil
}

func decodeJSON(b []byte, what string, v any) error {
	if err := json.Unmarshal(b, v); err != nil {
		return fmt.Errorf("decoding %s: %w: %w", what, ErrInvalidImage, err)
	}
	return nil
}

func digestOf(b []byte) string {
	sum := sha256.Sum256(b)
	return "sha256:" + hex.EncodeToString(sum[:])
}

// importOCI imports the one image of an OCI image layout.
func importOCI(ctx context.Context, src source, staging string, limit *budget) (*Imported, error) {
	b, err := readFile(src, indexFile)
	if err != nil {
		return nil, err
	}
	var idx index
	if err := decodeJSON(b, indexFile, &idx); err != nil {
		return nil, err
	}
	d, err := pickManifest(src, idx, 0)
	if err != nil {
		return nil, err
	}
	b, err = readBlob(src, d)
	if err != nil {
		return nil, fmt.Errorf("reading manifest: %w", err)
	}
	var m manifest
	if err := decodeJSON(b, "manifest "+d.Digest, &m); err != nil {
		return nil, err
	}
	cfgBytes, err := readBlob(src, m.Config)
	if err != nil {
		return nil, fmt.Errorf("reading config: %w", err)
	}
	cfg, err := parseConfig(cfgBytes, len(m.Layers))
	if err != nil {
		return nil, err
	}
	out := &Imported{Digest: m.Config.Digest}
	if cfg.Config != nil {
		out.Config = *cfg.Config
	}
	for i, l := range m.Layers {
		name, err := blobName(l.Digest)
		if err != nil {
			return nil, err
		}
		dir, err := importLayer(ctx, src, name, staging, i, layerCheck{blob: l.Digest, size: l.Size, diffID: cfg.RootFS.DiffIDs[i]}, limit)
		if err != nil {
			return nil, err
		}
		out.Layers = append(out.Layers, dir)
	}
	return out, nil
}

// pickManifest chooses the image manifest: the only one, or the one for this machine's
// platform, descending into nested indexes.
func pickManifest(src source, idx index, depth int) (descriptor, error) {
	var cands []descriptor
	for _, d := range idx.Manifests {
		if d.Platform != nil && (d.Platform.OS == "unknown" || d.Platform.Architecture == "unknown") {
			continue // attestation manifests
		}
		cands = append(cands, d)
	}
	if len(cands) > 1 {
		var match []descriptor
		for _, d := range cands {
			if d.Platform != nil && d.Platform.OS == runtime.GOOS && d.Platform.Architecture == runtime.GOARCH {
				match = append(match, d)
			}
		}
		cands = match
	}
	switch len(cands) {
	case 1:
	case 0:
		return descriptor{}, fmt.Errorf("index lists no manifest for %s/%s: %w", runtime.GOOS, runtime.GOARCH, ErrInvalidImage)
	default:
		return descriptor{}, fmt.Errorf("index lists %d images; import one at a time: %w", len(cands), ErrInvalidImage)
	}
	d := cands[0]
	if d.MediaType != mediaTypeOCIIndex && d.MediaType != mediaTypeDockerList {
		return d, nil
	}
	if depth >= maxIndexNestingDepth {
		return descriptor{}, fmt.Errorf("indexes nested too deep: %w", ErrInvalidImage)
	}
	b, err := readBlob(src, d)
	if err != nil {
		return descriptor{}, fmt.Errorf("reading index: %w", err)
	}
	var sub index
	if err := decodeJSON(b, "index "+d.Digest, &sub); err != nil {
		return descriptor{}, err
	}
	return pickManifest(src, sub, depth+1)
}

func parseConfig(b []byte, layers int) (*imageConfig, error) {
	var cfg imageConfig
	if err := decodeJSON(b, "config", &cfg); err != nil {
		return nil, err
	}
	if len(cfg.RootFS.DiffIDs) != layers {
		return nil, fmt.Errorf("config lists %d layers, manifest %d: %w", len(cfg.RootFS.DiffIDs), layers, ErrInvalidImage)
	}
	for _, id := range cfg.RootFS.DiffIDs {
		if !sha256Digest.MatchString(id) {
			return nil, fmt.Errorf("diff_id %q is not a sha256 digest: %w", id, ErrInvalidImage)
		}
	}
	return &cfg, nil
}

// importDocker imports the one image of a docker save archive (manifest.json format).
func importDocker(ctx context.Context, src source, staging string, limit *budget) (*Imported, error) {
	b, err := readFile(src, dockerManifestFile)
	if err != nil {
		return nil, err
	}
	var ms []dockerManifest
	if err := decodeJSON(b, dockerManifestFile, &ms); err != nil {
		return nil, err
	}
	if len(ms) != 1 {
		return nil, fmt.Errorf("%s lists %d images; import one at a time: %w", dockerManifestFile, len(ms), ErrInvalidImage)
	}
	m := ms[0]
	cfgBytes, err := readFile(src, m.Config)
	if err != nil {
		return nil, fmt.Errorf("reading config: %w", err)
	}
	digest := digestOf(cfgBytes)
	// The config is named by its digest: "<hex>.json" (classic) or "blobs/sha256/<hex>".
	if want, ok := digestFromName(m.Config); ok && want != digest {
		return nil, fmt.Errorf("config %s hashes to %s: %w", m.Config, digest, ErrDigestMismatch)
	}
	cfg, err := parseConfig(cfgBytes, len(m.Layers))
	if err != nil {
		return nil, err
	}
	out := &Imported{Digest: digest}
	if cfg.Config != nil {
		out.Config = *cfg.Config
	}
	for i, name := range m.Layers {
		check := layerCheck{diffID: cfg.RootFS.DiffIDs[i]}
		if d, ok := digestFromName(name); ok {
			check.blob = d
		}
		dir, err := importLayer(ctx, src, name, staging, i, check, limit)
		if err != nil {
			return nil, err
		}
		out.Layers = append(out.Layers, dir)
	}
	return out, nil
}

var hexName = regexp.MustCompile(`^(?:blobs/sha256/)?([a-f0-9]{64})(?:\.json)?$`)

func digestFromName(name string) (string, bool) {
	m := hexName.FindStringSubmatch(name)
	if m == nil || (strings.HasPrefix(name, "blobs/") && strings.HasSuffix(name, ".json")) {
		return "", false
	}
	return "sha256:" + m[1], true
}

// layerCheck is what a layer blob must hash to: blob is the digest of the stored (maybe
// compressed) bytes, diffID that of the uncompressed tar. Empty fields are not checked.
type layerCheck struct {
	blob   string
	size   int64
	diffID string
}

// importLayer applies layer blob name into staging/<i> and returns that directory.
func importLayer(ctx context.Context, src source, name, staging string, i int, check layerCheck, b *budget) (string, error) {
	r, err := src.open(name)
	if err != nil {
		return "", fmt.Errorf("opening layer %d: %w", i, err)
	}
	defer r.Close()
	dir := filepath.Join(staging, strconv.Itoa(i))
	if err := os.Mkdir(dir, 0o755); err != nil {
		return "", fmt.Errorf("creating layer %d: %w", i, err)
	}
	if err := os.Chmod(dir, 0o755); err != nil {
		return "", fmt.Errorf("creating layer %d: %w", i, err)
	}
	if err := applyLayerBlob(ctx, r, dir, check, b); err != nil {
		return "", fmt.Errorf("applying layer %d (%s): %w", i, name, err)
	}
	return dir, nil
}

// applyLayerBlob decompresses (gzip or none, by magic bytes) and applies a layer tar into
// dir, hashing the stored and the uncompressed bytes as they stream past.
func applyLayerBlob(ctx context.Context, r io.Reader, dir string, check layerCheck, b *budget) error {
	blobHash := sha256.New()
	counted := &countWriter{w: blobHash}
	br := bufio.NewReaderSize(io.TeeReader(r, counted), 1<<16)
	magic, _ := br.Peek(6)
	var (
		tarStream io.Reader = br
		gz        *gzip.Reader
	)
	switch {
	case bytes.HasPrefix(magic, []byte{0x1f, 0x8b}):
		var err error
		if gz, err = gzip.NewReader(br); err != nil {
			return fmt.Errorf("opening gzip stream: %w", err)
		}
		tarStream = gz
	case bytes.HasPrefix(magic, []byte{0x28, 0xb5, 0x2f, 0xfd}):
		return fmt.Errorf("zstd layers are not supported (use gzip or uncompressed): %w", ErrUnsupportedCompression)
	case bytes.HasPrefix(magic, []byte{0xfd, '7', 'z', 'X', 'Z', 0}):
		return fmt.Errorf("xz layers are not supported (use gzip or uncompressed): %w", ErrUnsupportedCompression)
	case bytes.HasPrefix(magic, []byte("BZh")):
		return fmt.Errorf("bzip2 layers are not supported (use gzip or uncompressed): %w", ErrUnsupportedCompression)
	}
	diffHash := sha256.New()
	tarStream = io.TeeReader(&unpackReader{ctx: ctx, r: tarStream, b: b}, diffHash)

	w, err := openLayerWriter(dir, true, b)
	if err != nil {
		return err
	}
	defer w.Close()
	if err := w.applyTar(tarStream, ctx.Err); err != nil {
		return err
	}
	// Hash what the tar reader left unread (end-of-archive blocks, padding).
	if _, err := io.Copy(io.Discard, tarStream); err != nil {
		return fmt.Errorf("reading layer: %w", err)
	}
	if gz != nil {
		if err := gz.Close(); err != nil {
			return fmt.Errorf("reading gzip stream: %w", err)
		}
		if _, err := io.Copy(io.Discard, br); err != nil {
			return fmt.Errorf("reading layer: %w", err)
		}
	}
	if err := verify(blobHash, check.blob, "layer blob"); err != nil {
		return err
	}
	if check.size != 0 && counted.n != check.size {
		return fmt.Errorf("layer blob has %d bytes, descriptor says %d: %w", counted.n, check.size, ErrDigestMismatch)
	}
	if err := verify(diffHash, check.diffID, "uncompressed layer"); err != nil {
		return err
	}
	return w.Close()
}

func verify(h hash.Hash, want, what string) error {
	if want == "" {
		return nil
	}
	if got := "sha256:" + hex.EncodeToString(h.Sum(nil)); got != want {
		return fmt.Errorf("%s hashes to %s, want %s: %w", what, got, want, ErrDigestMismatch)
	}
	return nil
}

type countWriter struct {
	w io.Writer
	n int64
}

func (c *countWriter) Write(p []byte) (int, error) {
	c.n += int64(len(p))
	return c.w.Write(p)
}
