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
// the zip's empty directories mkdir steps (mkdirBatches). Every entry of the zip is checked
// (unzipPlan) before anything is written.
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
	for _, batch := range mkdirBatches(dirs) {
		x := episode.Exec{Argv: append([]string{"mkdir", "-p", "--"}, batch...)}
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

// verify reads the file's content through, which checks it against its size and checksum.
func (z zipFile) verify() error {
	rc, err := z.f.Open()
	if err == nil {
		_, err = io.Copy(io.Discard, rc)
		rc.Close()
	}
	if err != nil {
		return invalid("the upload's zip entry %s: %v: nothing was written", pyRepr(z.f.Name), err)
	}
	return nil
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

// Bounds of one mkdir step of an upload's directories, well within what a command takes
// (initproc.MaxEntries, MaxPayload), the sandbox's environment included.
const (
	mkdirBatchDirs  = 1000
	mkdirBatchBytes = 64 << 10
)

// mkdirBatches splits dirs into the argv lists of mkdir steps.
func mkdirBatches(dirs []string) [][]string {
	var out [][]string
	var cur []string
	size := 0
	for _, d := range dirs {
		if len(cur) > 0 && (len(cur) == mkdirBatchDirs || size+len(d)+1 > mkdirBatchBytes) {
			out, cur, size = append(out, cur), nil, 0
		}
		cur = append(cur, d)
		size += len(d) + 1
	}
	if len(cur) > 0 {
		out = append(out, cur)
	}
	return out
}

// unzipPlan checks a zip's entries before anything is written (their paths, sizes and
// checksums, read through, and that no path is both a file and a directory), and returns its
// files and the directories that hold none (which extraction makes) under target.
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
		if err := absolute("the upload's zip entry "+pyRepr(truncate(f.Name, 64))+" makes the path", p); err != nil {
			return nil, nil, err
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
	if err := checkEntries(files, dirs); err != nil {
		return nil, nil, err
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

// checkEntries refuses a zip whose files' contents do not read back as their headers say (the
// reader checks the size and the CRC-32 at each entry's end), or that makes a path both a file
// and a directory (an entry's directory, or one of its parents, is another's file).
func checkEntries(files []zipFile, dirs map[string]bool) error {
	isDir := make(map[string]bool, len(dirs)+len(files))
	for d := range dirs {
		isDir[d] = true
	}
	for _, f := range files {
		for d := parent(f.path); d != "/" && !isDir[d]; d = parent(d) {
			isDir[d] = true
		}
	}
	for _, f := range files {
		if isDir[f.path] {
			return invalid("the upload's zip makes %s both a file (entry %s) and a directory: nothing was written", pyRepr(f.path), pyRepr(f.f.Name))
		}
	}
	for _, f := range files {
		if err := f.verify(); err != nil {
			return err
		}
	}
	return nil
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
