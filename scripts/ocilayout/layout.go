package main

import (
	"crypto/sha256"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"runtime"
	"strings"
	"time"
)

// annotationRefName names a manifest of an index: skopeo's and containerd's oci:DIR:TAG.
const annotationRefName = "org.opencontainers.image.ref.name"

// descriptor points at a blob (image-spec descriptor.md).
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
}

type index struct {
	SchemaVersion int          `json:"schemaVersion"`
	MediaType     string       `json:"mediaType"`
	Manifests     []descriptor `json:"manifests"`
}

type manifest struct {
	SchemaVersion int          `json:"schemaVersion"`
	MediaType     string       `json:"mediaType"`
	Config        descriptor   `json:"config"`
	Layers        []descriptor `json:"layers"`
}

// runConfig is how to run the image (image-spec config.md, "config").
type runConfig struct {
	Env          []string            `json:"Env,omitempty"`
	Entrypoint   []string            `json:"Entrypoint,omitempty"`
	Cmd          []string            `json:"Cmd,omitempty"`
	WorkingDir   string              `json:"WorkingDir,omitempty"`
	ExposedPorts map[string]struct{} `json:"ExposedPorts,omitempty"`
	Labels       map[string]string   `json:"Labels,omitempty"`
}

type rootFS struct {
	Type    string   `json:"type"`
	DiffIDs []string `json:"diff_ids"`
}

type imageConfig struct {
	Created      string    `json:"created,omitempty"`
	Architecture string    `json:"architecture"`
	OS           string    `json:"os"`
	Config       runConfig `json:"config"`
	RootFS       rootFS    `json:"rootfs"`
}

type layoutFile struct {
	ImageLayoutVersion string `json:"imageLayoutVersion"`
}

// imageSpec is what image writes.
type imageSpec struct {
	tag     string
	created time.Time
	layers  []layerDesc // bottom first
	config  runConfig
}

// writeImage writes the config and manifest of spec into the layout's blobs, index.json naming
// the manifest spec.tag, and oci-layout; then deletes the blobs the image does not reference
// (layers of earlier builds). It returns the manifest's descriptor.
func writeImage(layout string, spec imageSpec) (descriptor, error) {
	cfg := imageConfig{
		Created:      spec.created.UTC().Format(time.RFC3339),
		Architecture: runtime.GOARCH,
		OS:           "linux",
		Config:       spec.config,
		RootFS:       rootFS{Type: "layers"},
	}
	m := manifest{SchemaVersion: 2, MediaType: mediaTypeManifest}
	keep := map[string]bool{}
	for _, l := range spec.layers {
		if l.MediaType != mediaTypeLayerGzip && l.MediaType != mediaTypeLayerTar {
			return descriptor{}, fmt.Errorf("layer %s has media type %q, not a layer's", l.Digest, l.MediaType)
		}
		name, err := blobPath(layout, l.Digest)
		if err != nil {
			return descriptor{}, err
		}
		if fi, err := os.Stat(name); err != nil || fi.Size() != l.Size {
			return descriptor{}, fmt.Errorf("layer %s is missing from %s or has changed (write it again with ocilayout layer)", l.Digest, layout)
		}
		cfg.RootFS.DiffIDs = append(cfg.RootFS.DiffIDs, l.DiffID)
		m.Layers = append(m.Layers, descriptor{MediaType: l.MediaType, Digest: l.Digest, Size: l.Size})
		keep[l.Digest] = true
	}
	var err error
	if m.Config, err = writeJSONBlob(layout, mediaTypeConfig, cfg); err != nil {
		return descriptor{}, err
	}
	md, err := writeJSONBlob(layout, mediaTypeManifest, m)
	if err != nil {
		return descriptor{}, err
	}
	keep[m.Config.Digest], keep[md.Digest] = true, true
	md.Platform = &platform{Architecture: cfg.Architecture, OS: cfg.OS}
	md.Annotations = map[string]string{annotationRefName: spec.tag}
	if err := writeJSONFile(filepath.Join(layout, "index.json"), index{SchemaVersion: 2, MediaType: mediaTypeLayoutIndex, Manifests: []descriptor{md}}); err != nil {
		return descriptor{}, err
	}
	if err := writeJSONFile(filepath.Join(layout, "oci-layout"), layoutFile{ImageLayoutVersion: "1.0.0"}); err != nil {
		return descriptor{}, err
	}
	return md, removeUnreferenced(layout, keep)
}

// writeJSONBlob writes v as a JSON blob of the given media type and returns its descriptor.
func writeJSONBlob(layout, mediaType string, v any) (descriptor, error) {
	b, err := json.Marshal(v)
	if err != nil {
		return descriptor{}, err
	}
	sum := sha256.Sum256(b)
	d := descriptor{MediaType: mediaType, Digest: sumDigest(sum[:]), Size: int64(len(b))}
	name, err := blobPath(layout, d.Digest)
	if err != nil {
		return descriptor{}, err
	}
	if err := os.MkdirAll(filepath.Dir(name), 0o755); err != nil {
		return descriptor{}, err
	}
	return d, writeFileAtomic(name, b)
}

// blobPath returns where the layout keeps the blob of digest.
func blobPath(layout, digest string) (string, error) {
	hex, ok := strings.CutPrefix(digest, "sha256:")
	if !ok || len(hex) != 64 || strings.Trim(hex, "0123456789abcdef") != "" {
		return "", fmt.Errorf("digest %q is not a sha256 digest", digest)
	}
	return filepath.Join(blobsDir(layout), hex), nil
}

// removeUnreferenced deletes every file in the layout's blobs but those of keep (digests).
func removeUnreferenced(layout string, keep map[string]bool) error {
	entries, err := os.ReadDir(blobsDir(layout))
	if err != nil {
		return err
	}
	var errs []error
	for _, e := range entries {
		if !keep["sha256:"+e.Name()] {
			errs = append(errs, os.RemoveAll(filepath.Join(blobsDir(layout), e.Name())))
		}
	}
	return errors.Join(errs...)
}

// runImage is the subcommand image.
func runImage(args []string, log io.Writer) error {
	fs := flag.NewFlagSet("ocilayout image", flag.ContinueOnError)
	layout := fs.String("layout", "", "the layout `directory`")
	tag := fs.String("tag", "", "the image's `tag` in index.json (org.opencontainers.image.ref.name)")
	epoch := fs.String("epoch", "", "the image's creation `time`, in seconds since 1970 (default $SOURCE_DATE_EPOCH, else 0)")
	workdir := fs.String("workdir", "", "the working `directory` of the image's process")
	var layers, entrypoint, cmd, env, ports, labels stringList
	fs.Var(&layers, "layer", "a layer's descriptor `file`, as ocilayout layer wrote it (repeatable, bottom layer first)")
	fs.Var(&entrypoint, "entrypoint", "one `argument` of the entrypoint (repeatable, in order)")
	fs.Var(&cmd, "cmd", "one `argument` of the default command (repeatable, in order)")
	fs.Var(&env, "env", "a `K=V` of the process's environment (repeatable)")
	fs.Var(&ports, "port", "an exposed `port/protocol` such as 8080/tcp (repeatable)")
	fs.Var(&labels, "label", "a `K=V` label of the image (repeatable)")
	if err := fs.Parse(args); err != nil {
		return err
	}
	if *layout == "" || *tag == "" || len(layers) == 0 || fs.NArg() > 0 {
		return errors.New("image needs -layout, -tag and at least one -layer, and no arguments")
	}
	spec := imageSpec{tag: *tag, config: runConfig{Entrypoint: entrypoint, Cmd: cmd, Env: env, WorkingDir: *workdir}}
	var err error
	if spec.created, err = epochFlag(*epoch); err != nil {
		return err
	}
	for _, p := range ports {
		if spec.config.ExposedPorts == nil {
			spec.config.ExposedPorts = map[string]struct{}{}
		}
		spec.config.ExposedPorts[p] = struct{}{}
	}
	for _, l := range labels {
		k, v, ok := strings.Cut(l, "=")
		if !ok || k == "" {
			return fmt.Errorf("-label %q: want K=V", l)
		}
		if spec.config.Labels == nil {
			spec.config.Labels = map[string]string{}
		}
		spec.config.Labels[k] = v
	}
	for _, name := range layers {
		var d layerDesc
		b, err := os.ReadFile(name)
		if err != nil {
			return err
		}
		if err := json.Unmarshal(b, &d); err != nil {
			return fmt.Errorf("reading the layer descriptor %s: %w", name, err)
		}
		spec.layers = append(spec.layers, d)
	}
	md, err := writeImage(*layout, spec)
	if err != nil {
		return fmt.Errorf("writing the image into %s: %w", *layout, err)
	}
	fmt.Fprintf(log, "ocilayout: %s:%s, manifest %s, %d layers\n", *layout, *tag, md.Digest, len(spec.layers))
	return nil
}
