// Package imagetest builds test images: a busybox root filesystem, and OCI image layouts and
// docker save tarballs made from in-memory layers. It is for tests of deltagym's packages.
package imagetest

import (
	"archive/tar"
	"bytes"
	"compress/gzip"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"maps"
	"os"
	"path"
	"path/filepath"
	"slices"
	"testing"
	"time"
)

// Entry is one tar entry of a test layer. Type is a tar type flag (tar.TypeReg when zero).
type Entry struct {
	Name     string
	Type     byte
	Mode     int64
	UID, GID int
	Data     []byte
	Linkname string
	// Major and Minor are device numbers of character and block devices.
	Major, Minor int64
	// Xattrs are written as PAX SCHILY.xattr records.
	Xattrs  map[string]string
	ModTime time.Time
}

// File returns a regular file entry owned by root.
func File(name, data string, mode int64) Entry {
	return Entry{Name: name, Type: tar.TypeReg, Mode: mode, Data: []byte(data)}
}

// Dir returns a directory entry owned by root.
func Dir(name string, mode int64) Entry {
	return Entry{Name: name, Type: tar.TypeDir, Mode: mode}
}

// Symlink returns a symlink entry name -> target.
func Symlink(name, target string) Entry {
	return Entry{Name: name, Type: tar.TypeSymlink, Mode: 0o777, Linkname: target}
}

// Hardlink returns a hardlink entry: name becomes another name of target (a path in the layer).
func Hardlink(name, target string) Entry {
	return Entry{Name: name, Type: tar.TypeLink, Linkname: target}
}

// CharDev returns a character device entry.
func CharDev(name string, major, minor int64) Entry {
	return Entry{Name: name, Type: tar.TypeChar, Mode: 0o666, Major: major, Minor: minor}
}

// Fifo returns a named pipe entry.
func Fifo(name string) Entry {
	return Entry{Name: name, Type: tar.TypeFifo, Mode: 0o644}
}

// Whiteout returns the OCI whiteout entry that deletes p from the layers below.
func Whiteout(p string) Entry {
	return Entry{Name: path.Join(path.Dir(p), ".wh."+path.Base(p)), Type: tar.TypeReg, Mode: 0o644}
}

// Opaque returns the OCI entry that hides everything below dir in the layers below.
func Opaque(dir string) Entry {
	return Entry{Name: path.Join(dir, ".wh..wh..opq"), Type: tar.TypeReg, Mode: 0o644}
}

// Compression says how a layer blob is stored.
type Compression int

const (
	// Uncompressed stores the layer tar as it is.
	Uncompressed Compression = iota
	// Gzip stores the layer tar gzip-compressed.
	Gzip
)

// Layer is one image layer: its entries, in tar order.
type Layer struct {
	Entries     []Entry
	Compression Compression
	// Raw, when set, is stored as the layer blob instead of a tar of Entries (for tests of
	// malformed or unsupported blobs); its digest is also used as the diff_id.
	Raw []byte
}

// Config is the run configuration written into a test image's config blob.
type Config struct {
	Env        []string `json:"Env,omitempty"`
	WorkingDir string   `json:"WorkingDir,omitempty"`
	User       string   `json:"User,omitempty"`
	Entrypoint []string `json:"Entrypoint,omitempty"`
	Cmd        []string `json:"Cmd,omitempty"`
}

// Image describes a written test image.
type Image struct {
	// ConfigDigest is the digest of the config blob, the image ID.
	ConfigDigest string
	// ManifestDigest is the digest of the image manifest.
	ManifestDigest string
	// LayerDigests are the digests of the stored layer blobs, bottom first.
	LayerDigests []string
	// DiffIDs are the digests of the uncompressed layer tars, bottom first.
	DiffIDs []string
}

// Tar returns the entries as an uncompressed tar stream. Names are written as given, so
// hostile tars (absolute names, ".." components) can be made.
func Tar(t testing.TB, entries []Entry) []byte {
	t.Helper()
	var buf bytes.Buffer
	tw := tar.NewWriter(&buf)
	for _, e := range entries {
		typ := e.Type
		if typ == 0 {
			typ = tar.TypeReg
		}
		mtime := e.ModTime
		if mtime.IsZero() {
			mtime = time.Unix(1700000000, 0)
		}
		hdr := &tar.Header{
			Name:     e.Name,
			Typeflag: typ,
			Mode:     e.Mode,
			Uid:      e.UID,
			Gid:      e.GID,
			Linkname: e.Linkname,
			Devmajor: e.Major,
			Devminor: e.Minor,
			ModTime:  mtime,
			Format:   tar.FormatPAX,
		}
		if typ == tar.TypeReg {
			hdr.Size = int64(len(e.Data))
		}
		if len(e.Xattrs) > 0 {
			hdr.PAXRecords = map[string]string{}
			for k, v := range e.Xattrs {
				hdr.PAXRecords["SCHILY.xattr."+k] = v
			}
		}
		if err := tw.WriteHeader(hdr); err != nil {
			t.Fatalf("writing tar header %s: %v", e.Name, err)
		}
		if typ == tar.TypeReg {
			if _, err := tw.Write(e.Data); err != nil {
				t.Fatalf("writing tar entry %s: %v", e.Name, err)
			}
		}
	}
	if err := tw.Close(); err != nil {
		t.Fatalf("closing tar: %v", err)
	}
	return buf.Bytes()
}

type blob struct {
	digest string
	data   []byte
}

func newBlob(b []byte) blob {
	sum := sha256.Sum256(b)
	return blob{digest: "sha256:" + hex.EncodeToString(sum[:]), data: b}
}

func (b blob) hex() string { return b.digest[len("sha256:"):] }

// built holds the blobs of a test image.
type built struct {
	img      Image
	layers   []blob
	config   blob
	manifest blob
}

func build(t testing.TB, cfg Config, layers []Layer) built {
	t.Helper()
	var out built
	for _, l := range layers {
		if l.Raw != nil {
			b := newBlob(l.Raw)
			out.img.DiffIDs = append(out.img.DiffIDs, b.digest)
			out.layers = append(out.layers, b)
			out.img.LayerDigests = append(out.img.LayerDigests, b.digest)
			continue
		}
		raw := Tar(t, l.Entries)
		out.img.DiffIDs = append(out.img.DiffIDs, newBlob(raw).digest)
		stored := raw
		if l.Compression == Gzip {
			var buf bytes.Buffer
			zw := gzip.NewWriter(&buf)
			if _, err := zw.Write(raw); err != nil {
				t.Fatal(err)
			}
			if err := zw.Close(); err != nil {
				t.Fatal(err)
			}
			stored = buf.Bytes()
		}
		b := newBlob(stored)
		out.layers = append(out.layers, b)
		out.img.LayerDigests = append(out.img.LayerDigests, b.digest)
	}
	config := map[string]any{
		"architecture": "amd64",
		"os":           "linux",
		"config":       cfg,
		"rootfs":       map[string]any{"type": "layers", "diff_ids": out.img.DiffIDs},
	}
	out.config = newBlob(mustJSON(t, config))
	out.img.ConfigDigest = out.config.digest
	type desc struct {
		MediaType string `json:"mediaType"`
		Digest    string `json:"digest"`
		Size      int    `json:"size"`
	}
	var layerDescs []desc
	for i, b := range out.layers {
		mt := "application/vnd.oci.image.layer.v1.tar"
		if layers[i].Compression == Gzip {
			mt += "+gzip"
		}
		layerDescs = append(layerDescs, desc{mt, b.digest, len(b.data)})
	}
	manifest := map[string]any{
		"schemaVersion": 2,
		"mediaType":     "application/vnd.oci.image.manifest.v1+json",
		"config":        desc{"application/vnd.oci.image.config.v1+json", out.config.digest, len(out.config.data)},
		"layers":        layerDescs,
	}
	out.manifest = newBlob(mustJSON(t, manifest))
	out.img.ManifestDigest = out.manifest.digest
	return out
}

func (b built) ociFiles(t testing.TB) map[string][]byte {
	index := map[string]any{
		"schemaVersion": 2,
		"mediaType":     "application/vnd.oci.image.index.v1+json",
		"manifests": []any{map[string]any{
			"mediaType":   "application/vnd.oci.image.manifest.v1+json",
			"digest":      b.manifest.digest,
			"size":        len(b.manifest.data),
			"platform":    map[string]string{"architecture": "amd64", "os": "linux"},
			"annotations": map[string]string{"org.opencontainers.image.ref.name": "latest"},
		}},
	}
	files := map[string][]byte{
		"oci-layout": []byte(`{"imageLayoutVersion":"1.0.0"}`),
		"index.json": mustJSON(t, index),
	}
	for _, bl := range append([]blob{b.config, b.manifest}, b.layers...) {
		files["blobs/sha256/"+bl.hex()] = bl.data
	}
	return files
}

// WriteOCILayout writes an OCI image layout of the layers (bottom first) into dir.
func WriteOCILayout(t testing.TB, dir string, cfg Config, layers ...Layer) Image {
	t.Helper()
	b := build(t, cfg, layers)
	for name, data := range b.ociFiles(t) {
		p := filepath.Join(dir, filepath.FromSlash(name))
		if err := os.MkdirAll(filepath.Dir(p), 0o755); err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(p, data, 0o644); err != nil {
			t.Fatal(err)
		}
	}
	return b.img
}

// WriteDockerSave writes a classic `docker save` tarball (manifest.json, <id>/layer.tar,
// <config-hex>.json) of the layers (bottom first) to file p.
func WriteDockerSave(t testing.TB, p string, cfg Config, layers ...Layer) Image {
	t.Helper()
	b := build(t, cfg, layers)
	var entries []Entry
	var layerPaths []string
	for i, l := range b.layers {
		id := newBlob([]byte(b.img.DiffIDs[i] + "/" + string(rune('a'+i)))).hex()
		entries = append(entries,
			Dir(id, 0o755),
			File(id+"/VERSION", "1.0", 0o644),
			File(id+"/json", `{"id":"`+id+`"}`, 0o644),
			Entry{Name: id + "/layer.tar", Type: tar.TypeReg, Mode: 0o644, Data: l.data})
		layerPaths = append(layerPaths, id+"/layer.tar")
	}
	cfgName := b.config.hex() + ".json"
	manifest := []any{map[string]any{"Config": cfgName, "RepoTags": []string{"test:latest"}, "Layers": layerPaths}}
	entries = append(entries,
		Entry{Name: cfgName, Type: tar.TypeReg, Mode: 0o644, Data: b.config.data},
		Entry{Name: "manifest.json", Type: tar.TypeReg, Mode: 0o644, Data: mustJSON(t, manifest)},
		File("repositories", `{"test":{"latest":"`+layerPaths[len(layerPaths)-1][:64]+`"}}`, 0o644))
	writeFile(t, p, Tar(t, entries))
	return b.img
}

// WriteDockerSaveOCI writes a `docker save` tarball in the form docker 25+ writes: an OCI image
// layout plus manifest.json whose paths point into blobs/sha256.
func WriteDockerSaveOCI(t testing.TB, p string, cfg Config, layers ...Layer) Image {
	t.Helper()
	b := build(t, cfg, layers)
	files := b.ociFiles(t)
	var layerPaths []string
	for _, l := range b.layers {
		layerPaths = append(layerPaths, "blobs/sha256/"+l.hex())
	}
	files["manifest.json"] = mustJSON(t, []any{map[string]any{
		"Config": "blobs/sha256/" + b.config.hex(), "RepoTags": []string{"test:latest"}, "Layers": layerPaths,
	}})
	entries := []Entry{Dir("blobs", 0o755), Dir("blobs/sha256", 0o755)}
	for _, name := range sortedKeys(files) {
		entries = append(entries, Entry{Name: name, Type: tar.TypeReg, Mode: 0o644, Data: files[name]})
	}
	writeFile(t, p, Tar(t, entries))
	return b.img
}

func writeFile(t testing.TB, p string, data []byte) {
	t.Helper()
	if err := os.WriteFile(p, data, 0o644); err != nil {
		t.Fatal(err)
	}
}

func mustJSON(t testing.TB, v any) []byte {
	t.Helper()
	b, err := json.Marshal(v)
	if err != nil {
		t.Fatal(err)
	}
	return b
}

func sortedKeys(m map[string][]byte) []string {
	return slices.Sorted(maps.Keys(m))
}
