package main

import (
	"bufio"
	"compress/gzip"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"os"
	"path"
	"path/filepath"
	"strconv"
	"strings"
	"time"
)

// Media types of the OCI image spec (image-spec v1.1).
const (
	mediaTypeLayoutIndex = "application/vnd.oci.image.index.v1+json"
	mediaTypeManifest    = "application/vnd.oci.image.manifest.v1+json"
	mediaTypeConfig      = "application/vnd.oci.image.config.v1+json"
	mediaTypeLayerGzip   = "application/vnd.oci.image.layer.v1.tar+gzip"
	mediaTypeLayerTar    = "application/vnd.oci.image.layer.v1.tar"
)

// layerDesc describes a layer blob that layer wrote, for image.
type layerDesc struct {
	MediaType string `json:"mediaType"`
	Digest    string `json:"digest"`
	Size      int64  `json:"size"`
	// DiffID is the digest of the uncompressed tar, which the config lists.
	DiffID string `json:"diffID"`
}

// blobsDir is where a layout keeps its blobs, by sha256 digest.
func blobsDir(layout string) string { return filepath.Join(layout, "blobs", "sha256") }

// writeLayer writes the tar of trees, gzip-compressed, into the layout's blobs.
func writeLayer(layout string, trees []mapping, opts treeOptions) (_ layerDesc, err error) {
	dir := blobsDir(layout)
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return layerDesc{}, err
	}
	tmp, err := os.CreateTemp(dir, ".layer-")
	if err != nil {
		return layerDesc{}, err
	}
	defer func() {
		if err != nil {
			err = errors.Join(err, os.Remove(tmp.Name()))
		}
	}()
	defer tmp.Close()
	blobHash, diffHash := sha256.New(), sha256.New()
	counted := &countWriter{w: io.MultiWriter(tmp, blobHash)}
	bw := bufio.NewWriterSize(counted, 1<<20)
	// The gzip header carries no name and no time; compress/gzip's output depends only on the
	// input and the level (and, across Go releases, on its deflate: one toolchain, one result).
	gz, err := gzip.NewWriterLevel(bw, gzip.DefaultCompression)
	if err != nil {
		return layerDesc{}, err
	}
	if err := writeTree(io.MultiWriter(gz, diffHash), trees, opts); err != nil {
		return layerDesc{}, err
	}
	if err := gz.Close(); err != nil {
		return layerDesc{}, err
	}
	if err := bw.Flush(); err != nil {
		return layerDesc{}, err
	}
	if err := tmp.Chmod(0o644); err != nil {
		return layerDesc{}, err
	}
	if err := tmp.Close(); err != nil {
		return layerDesc{}, err
	}
	d := layerDesc{MediaType: mediaTypeLayerGzip, Digest: sumDigest(blobHash.Sum(nil)), Size: counted.n, DiffID: sumDigest(diffHash.Sum(nil))}
	if err := os.Rename(tmp.Name(), filepath.Join(dir, strings.TrimPrefix(d.Digest, "sha256:"))); err != nil {
		return layerDesc{}, err
	}
	return d, nil
}

func sumDigest(sum []byte) string { return "sha256:" + hex.EncodeToString(sum) }

type countWriter struct {
	w io.Writer
	n int64
}

func (c *countWriter) Write(p []byte) (int, error) {
	n, err := c.w.Write(p)
	c.n += int64(n)
	return n, err
}

// stringList is a repeatable string flag.
type stringList []string

func (l *stringList) String() string     { return strings.Join(*l, " ") }
func (l *stringList) Set(v string) error { *l = append(*l, v); return nil }

// epochFlag resolves -epoch: the flag, else $SOURCE_DATE_EPOCH, else 0.
func epochFlag(v string) (time.Time, error) {
	if v == "" {
		v = os.Getenv("SOURCE_DATE_EPOCH")
	}
	if v == "" {
		return time.Unix(0, 0), nil
	}
	n, err := strconv.ParseInt(v, 10, 64)
	if err != nil || n < 0 {
		return time.Time{}, fmt.Errorf("epoch %q: want seconds since 1970 (as SOURCE_DATE_EPOCH holds them)", v)
	}
	return time.Unix(n, 0), nil
}

// parseChown reads UID:GID.
func parseChown(v string) (*[2]int, error) {
	u, g, ok := strings.Cut(v, ":")
	uid, err1 := strconv.Atoi(u)
	gid, err2 := strconv.Atoi(g)
	if !ok || err1 != nil || err2 != nil || uid < 0 || gid < 0 {
		return nil, fmt.Errorf("-chown %q: want numeric UID:GID", v)
	}
	return &[2]int{uid, gid}, nil
}

// runLayer is the subcommand layer.
func runLayer(args []string, log io.Writer) error {
	fs := flag.NewFlagSet("ocilayout layer", flag.ContinueOnError)
	layout := fs.String("layout", "", "the layout `directory` whose blobs receive the layer")
	out := fs.String("o", "", "`file` to write the layer's descriptor to (JSON), for ocilayout image")
	epoch := fs.String("epoch", "", "latest modification `time` written, in seconds since 1970 (default $SOURCE_DATE_EPOCH, else 0)")
	chown := fs.String("chown", "", "own every entry by `UID:GID` instead of its file's owner")
	var excludes stringList
	fs.Var(&excludes, "exclude", "leave out this image `path` and what is below it (repeatable)")
	if err := fs.Parse(args); err != nil {
		return err
	}
	if *layout == "" || *out == "" || fs.NArg() == 0 {
		return errors.New("layer needs -layout, -o and at least one DEST=SRC")
	}
	var opts treeOptions
	var err error
	if opts.epoch, err = epochFlag(*epoch); err != nil {
		return err
	}
	if *chown != "" {
		if opts.chown, err = parseChown(*chown); err != nil {
			return err
		}
	}
	opts.exclude = map[string]bool{}
	for _, e := range excludes {
		if !path.IsAbs(e) {
			return fmt.Errorf("-exclude %q: want an absolute path in the image", e)
		}
		opts.exclude[path.Clean(e)] = true
	}
	var trees []mapping
	for _, a := range fs.Args() {
		m, err := parseMapping(a)
		if err != nil {
			return err
		}
		trees = append(trees, m)
	}
	start := time.Now()
	d, err := writeLayer(*layout, trees, opts)
	if err != nil {
		return fmt.Errorf("writing the layer of %s: %w", strings.Join(fs.Args(), " "), err)
	}
	if err := writeJSONFile(*out, d); err != nil {
		return err
	}
	fmt.Fprintf(log, "ocilayout: layer %s, %d bytes (%s), in %.1f s\n", d.Digest, d.Size, strings.Join(fs.Args(), " "), time.Since(start).Seconds())
	return nil
}

// writeJSONFile writes v as indented JSON to name, through a temporary file renamed into
// place.
func writeJSONFile(name string, v any) error {
	b, err := json.MarshalIndent(v, "", "  ")
	if err != nil {
		return err
	}
	return writeFileAtomic(name, append(b, '\n'))
}

// writeFileAtomic writes b to name through a temporary file beside it renamed into place.
func writeFileAtomic(name string, b []byte) (err error) {
	tmp, err := os.CreateTemp(filepath.Dir(name), "."+filepath.Base(name)+"-")
	if err != nil {
		return err
	}
	defer func() {
		if err != nil {
			err = errors.Join(err, os.Remove(tmp.Name()))
		}
	}()
	if _, err := tmp.Write(b); err != nil {
		_ = tmp.Close()
		return err
	}
	if err := tmp.Chmod(0o644); err != nil {
		_ = tmp.Close()
		return err
	}
	if err := tmp.Close(); err != nil {
		return err
	}
	return os.Rename(tmp.Name(), name)
}
