package swerex

import (
	"archive/zip"
	"bytes"
	"errors"
	"io"
	"mime"
	"net/http"
	"os"
	"slices"
	"strings"

	"github.com/deltagym/deltagym/sandbox"
	"github.com/deltagym/deltagym/server/episode"
)

// Bounds of an unzipped upload, checked before anything is written.
const (
	maxUploadEntries = 10000
	maxUploadBytes   = 256 << 20
)

// upload takes the client's multipart form (file, target_path, unzip) and writes the file to
// target_path, or, with unzip, the zip's files under target_path: each file a write_file step,
// the zip's empty directories one mkdir step.
func (h *Handler) upload(c *call) (any, error) {
	form, err := h.uploadForm(c.r)
	if err != nil {
		return nil, err
	}
	if !form.unzip {
		if len(form.file) > sandbox.MaxFileBytes {
			return nil, invalid("a file of %d bytes is over the sandbox's file cap of %d bytes", len(form.file), sandbox.MaxFileBytes)
		}
		if err := h.write(c, form.target, form.file, 0); err != nil {
			return nil, err
		}
		return empty{}, nil
	}
	files, dirs, err := unzipPlan(form.file, form.target)
	if err != nil {
		return nil, err
	}
	if len(dirs) > 0 {
		x := episode.Exec{Argv: append([]string{"mkdir", "-p", "--"}, dirs...)}
		res, err := h.step(c, x)
		if err != nil {
			return nil, err
		}
		r, err := execOf(res, x)
		if err != nil {
			return nil, err
		}
		if r.ExitCode != 0 {
			return nil, raise("builtins.OSError", "making the upload's directories under %s: %s", pyRepr(form.target), strings.TrimSpace(text(r.Stderr)))
		}
	}
	for _, f := range files {
		data, err := f.read()
		if err != nil {
			return nil, err
		}
		if err := h.write(c, f.path, data, f.mode); err != nil {
			return nil, err
		}
	}
	return empty{}, nil
}

// uploadForm is an upload's form.
type uploadForm struct {
	file   []byte
	target string
	unzip  bool
}

// uploadForm reads the multipart form of an upload.
func (h *Handler) uploadForm(r *http.Request) (uploadForm, error) {
	var form uploadForm
	mt, _, err := mime.ParseMediaType(r.Header.Get("Content-Type"))
	if err != nil || mt != "multipart/form-data" {
		return form, invalid("upload takes a multipart/form-data body (file, target_path, unzip), not %q", r.Header.Get("Content-Type"))
	}
	r.Body = http.MaxBytesReader(nil, r.Body, h.cfg.MaxBody)
	mr, err := r.MultipartReader()
	if err != nil {
		return form, invalid("reading the upload's form: %v", err)
	}
	var haveFile, haveTarget bool
	unzip := "false"
	for {
		p, err := mr.NextPart()
		if errors.Is(err, io.EOF) {
			break
		}
		if err != nil {
			return form, h.formError(err)
		}
		b, err := io.ReadAll(p)
		if err != nil {
			return form, h.formError(err)
		}
		switch p.FormName() {
		case "file":
			form.file, haveFile = b, true
		case "target_path":
			form.target, haveTarget = string(b), true
		case "unzip":
			unzip = strings.ToLower(string(b))
		}
	}
	switch {
	case !haveFile:
		return form, invalid("upload needs a file field")
	case !haveTarget:
		return form, invalid("upload needs a target_path field")
	}
	if err := absolute("target_path", form.target); err != nil {
		return form, err
	}
	switch unzip {
	case "true", "1", "yes", "on":
		form.unzip = true
	case "false", "0", "no", "off", "":
	default:
		return form, invalid("unzip %q is not a boolean", unzip)
	}
	return form, nil
}

// formError is a failure to read the upload's form.
func (h *Handler) formError(err error) error {
	if tooLarge(err) {
		return h.tooLarge()
	}
	return invalid("reading the upload's form: %v", err)
}

// zipFile is a file of an upload's zip to write.
type zipFile struct {
	f    *zip.File
	path string
	mode uint32
}

// read returns the file's content, checked against its size and checksum.
func (z zipFile) read() ([]byte, error) {
	rc, err := z.f.Open()
	if err != nil {
		return nil, invalid("the upload's zip entry %s: %v", pyRepr(z.f.Name), err)
	}
	defer rc.Close()
	b, err := io.ReadAll(rc)
	if err != nil {
		return nil, invalid("the upload's zip entry %s: %v", pyRepr(z.f.Name), err)
	}
	return b, nil
}

// unzipPlan checks a zip's entries before anything is written, and returns its files and the
// directories that hold none (which extraction makes) under target.
func unzipPlan(data []byte, target string) ([]zipFile, []string, error) {
	zr, err := zip.NewReader(bytes.NewReader(data), int64(len(data)))
	if err != nil {
		return nil, nil, invalid("the upload is not a zip (unzip is set): %v", err)
	}
	if len(zr.File) > maxUploadEntries {
		return nil, nil, invalid("the upload's zip has %d entries, more than %d; upload it in parts", len(zr.File), maxUploadEntries)
	}
	var files []zipFile
	var total uint64
	dirs := map[string]bool{target: true}
	for _, f := range zr.File {
		p, ok := under(target, f.Name)
		if !ok {
			return nil, nil, invalid("the upload's zip entry %s leaves its directory or names none", pyRepr(f.Name))
		}
		if f.FileInfo().IsDir() {
			dirs[p] = true
			continue
		}
		if f.UncompressedSize64 > sandbox.MaxFileBytes {
			return nil, nil, invalid("the upload's zip entry %s is %d bytes, over the sandbox's file cap of %d", pyRepr(f.Name), f.UncompressedSize64, sandbox.MaxFileBytes)
		}
		if total += f.UncompressedSize64; total > maxUploadBytes {
			return nil, nil, invalid("the upload's zip holds more than %d bytes; upload it in parts", maxUploadBytes)
		}
		files = append(files, zipFile{f: f, path: p, mode: uint32(f.Mode().Perm())})
	}
	// A directory that holds a file is made by that file's write.
	for _, f := range files {
		for d := f.path; d != "/" && d != "."; {
			d = parent(d)
			delete(dirs, d)
		}
	}
	list := make([]string, 0, len(dirs))
	for d := range dirs {
		list = append(list, d)
	}
	slices.Sort(list)
	return files, list, nil
}

// parent is p's directory.
func parent(p string) string {
	i := strings.LastIndexByte(p, '/')
	if i <= 0 {
		return "/"
	}
	return p[:i]
}

// fileMode is the mode of a written file: m's permission bits, 0 for the default (0644).
func fileMode(m uint32) os.FileMode { return os.FileMode(m & 0o777) }
