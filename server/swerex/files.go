package swerex

import (
	"bufio"
	"encoding/json"
	"net/http"
	"path"
	"strconv"
	"strings"
	"unicode/utf8"

	"github.com/deltagym/deltagym/sandbox"
	"github.com/deltagym/deltagym/server/episode"
)

// execute runs a Command as subprocess.run would, in the sandbox, as one exec step: a list is
// argv; a string is a shell command with shell=True, else the program's name. env is added to
// the sandbox's environment.
func (h *Handler) execute(c *call) (any, error) {
	var cmd command
	if err := h.decode(c.r, "execute", &cmd); err != nil {
		return nil, err
	}
	x, err := commandExec(&cmd)
	if err != nil {
		return nil, err
	}
	res, err := h.step(c, x)
	if err != nil {
		return nil, err
	}
	r, err := execOf(res, x)
	if err != nil {
		return nil, err
	}
	if r.TimedOut {
		return nil, raise(excTimeout, "Timeout (%ss) exceeded while running command", strconv.FormatFloat(x.Timeout.Seconds(), 'g', -1, 64))
	}
	out := commandResponse{Stdout: text(r.Stdout), Stderr: text(r.Stderr)}
	if cmd.MergeOutputStreams {
		out.Stdout, out.Stderr = out.Stdout+out.Stderr, ""
	}
	code := r.ExitCode
	if r.Signal != "" {
		code = -signalNumber(r.Signal) // subprocess's returncode for a signal
	}
	out.ExitCode = &code
	if cmd.Check && code != 0 {
		msg := "Command " + commandRepr(x) + " failed with exit code " + strconv.Itoa(code) + ". Stdout:\n" + pyRepr(out.Stdout) +
			"\nStderr:\n" + pyRepr(out.Stderr)
		if cmd.ErrorMsg != "" {
			msg = cmd.ErrorMsg + ": " + msg
		}
		return nil, &exception{class: excNonZero, msg: msg}
	}
	return out, nil
}

// commandRepr is the repr of a Command's command, as the client's runtime names it.
func commandRepr(x episode.Exec) string {
	if len(x.Argv) == 0 {
		return pyRepr(x.Command)
	}
	words := make([]string, len(x.Argv))
	for i, a := range x.Argv {
		words[i] = pyRepr(a)
	}
	return "[" + strings.Join(words, ", ") + "]"
}

// commandExec is the exec action of a Command.
func commandExec(cmd *command) (episode.Exec, error) {
	var x episode.Exec
	var s string
	var argv []string
	switch {
	case len(cmd.Command) == 0 || string(cmd.Command) == "null":
		return x, invalid("execute needs a command: a list of arguments, or a string with shell=True")
	case json.Unmarshal(cmd.Command, &s) == nil:
		if s == "" {
			return x, invalid("execute's command is empty")
		}
		if cmd.Shell {
			x.Command = s
		} else {
			x.Argv = []string{s} // as subprocess.run takes a string without a shell: the program
		}
	case json.Unmarshal(cmd.Command, &argv) == nil && len(argv) > 0:
		x.Argv = argv
		if cmd.Shell {
			x.Argv = append([]string{"/bin/sh", "-c"}, argv...)
		}
	default:
		return x, invalid("execute's command is neither a string nor a list of strings (got %s)", truncate(string(cmd.Command), 64))
	}
	var err error
	if x.Timeout, err = seconds("timeout", cmd.Timeout); err != nil {
		return x, err
	}
	x.Env = cmd.Env
	if cmd.Cwd != nil {
		if err := absolute("cwd", *cmd.Cwd); err != nil {
			return x, err
		}
		x.Cwd = *cmd.Cwd
	}
	return x, nil
}

// maxPath is the longest path the sandbox's kernel takes (PATH_MAX less the NUL).
const maxPath = 4095

// absolute refuses a path that is not absolute (the sandbox's working directory is not the
// client's, nor that of SWE-ReX's server), or that no path can be: one with a NUL byte, or
// longer than the kernel takes.
func absolute(field, p string) error {
	switch {
	case !strings.HasPrefix(p, "/"):
		return invalid("%s %s is not an absolute path: give it from / (the sandbox's working directory is not the client's)", field, pyRepr(truncate(p, 256)))
	case strings.IndexByte(p, 0) >= 0:
		return invalid("%s %s holds a NUL byte, which no path can", field, pyRepr(truncate(p, 256)))
	case len(p) > maxPath:
		return invalid("%s %s is %d bytes long, longer than a path can be (%d bytes, PATH_MAX less its NUL)", field, pyRepr(truncate(p, 64)), len(p), maxPath)
	}
	return nil
}

func truncate(s string, n int) string {
	if len(s) <= n {
		return s
	}
	return s[:n] + "…"
}

// readFile reads a file in steps of at most the env's output cap each, and decodes it.
func (h *Handler) readFile(c *call) (any, error) {
	var req readFileRequest
	if err := h.decode(c.r, "read_file", &req); err != nil {
		return nil, err
	}
	if req.Path == nil {
		return nil, invalid("read_file needs a path")
	}
	if err := absolute("path", *req.Path); err != nil {
		return nil, err
	}
	dec, err := decoder(req.Encoding, req.Errors)
	if err != nil {
		return nil, err
	}
	var data []byte
	for {
		res, err := h.step(c, episode.ReadFile{Path: *req.Path, Offset: int64(len(data))})
		if err != nil {
			return nil, err
		}
		o := res.Observation
		switch {
		case o.Error != nil:
			return nil, osError(o.Error, *req.Path)
		case o.ReadFile == nil:
			return nil, raise(excSwerex, "the step was not performed: %s", skipped(res))
		}
		if data == nil {
			// The file's size as the first step saw it (bounded by the cap below): the
			// content is read into one buffer.
			data = make([]byte, 0, min(max(o.ReadFile.Size, int64(len(o.ReadFile.Content))), sandbox.MaxFileBytes+1))
		}
		data = append(data, o.ReadFile.Content...)
		if !o.ReadFile.Truncated || len(o.ReadFile.Content) == 0 {
			break
		}
		if len(data) >= sandbox.MaxFileBytes {
			return nil, invalid("%s is over %d bytes, more than read_file returns; read parts of it with execute (head, tail, sed -n)",
				pyRepr(*req.Path), sandbox.MaxFileBytes)
		}
	}
	content, err := dec(data)
	if err != nil {
		return nil, err
	}
	return fileContent(content), nil
}

// fileContent is read_file's answer, ReadFileResponse, written as it is encoded: the answer
// takes the memory of its content, not that of its JSON encoding too (up to six bytes a byte).
type fileContent string

func (f fileContent) writeJSON(w http.ResponseWriter) {
	w.Header().Set("Content-Type", "application/json")
	bw := bufio.NewWriterSize(w, 64<<10)
	_, _ = bw.WriteString(`{"content":`)
	writeJSONString(bw, string(f))
	_ = bw.WriteByte('}')
	_ = bw.Flush()
}

// writeJSONString writes s as a JSON string: ", \ and control characters escaped, a byte
// that is not UTF-8 as U+FFFD (as encoding/json writes it).
func writeJSONString(w *bufio.Writer, s string) {
	const hex = "0123456789abcdef"
	_ = w.WriteByte('"')
	start := 0
	for i := 0; i < len(s); {
		c := s[i]
		if c >= 0x20 && c != '"' && c != '\\' && c < utf8.RuneSelf {
			i++
			continue
		}
		if c >= utf8.RuneSelf {
			r, n := utf8.DecodeRuneInString(s[i:])
			if r != utf8.RuneError || n != 1 {
				i += n
				continue
			}
		}
		_, _ = w.WriteString(s[start:i])
		switch c {
		case '"', '\\':
			_ = w.WriteByte('\\')
			_ = w.WriteByte(c)
		case '\n':
			_, _ = w.WriteString(`\n`)
		case '\r':
			_, _ = w.WriteString(`\r`)
		case '\t':
			_, _ = w.WriteString(`\t`)
		default:
			if c >= utf8.RuneSelf {
				_, _ = w.WriteString(`\ufffd`)
			} else {
				// WriteString and WriteByte: a slice given to Write would escape, one a byte.
				_, _ = w.WriteString(`\u00`)
				_ = w.WriteByte(hex[c>>4])
				_ = w.WriteByte(hex[c&0xf])
			}
		}
		i++
		start = i
	}
	_, _ = w.WriteString(s[start:])
	_ = w.WriteByte('"')
}

// decoder returns the decoding of Path.read_text(encoding, errors) for the encodings this
// server reads: UTF-8, Latin-1 and ASCII.
func decoder(encoding, errs *string) (func([]byte) (string, error), error) {
	enc, mode := "utf-8", "strict"
	if encoding != nil {
		enc = strings.ReplaceAll(strings.ToLower(*encoding), "_", "-")
	}
	if errs != nil {
		mode = *errs
	}
	switch mode {
	case "strict", "replace", "ignore", "backslashreplace":
	default:
		return nil, invalid("errors %q is not one this server reads: strict, replace, ignore or backslashreplace", mode)
	}
	switch enc {
	case "utf-8", "utf8":
		return func(b []byte) (string, error) { return decodeUTF8(b, mode) }, nil
	case "latin-1", "latin1", "iso-8859-1", "iso8859-1":
		return func(b []byte) (string, error) {
			r := make([]rune, len(b))
			for i, c := range b {
				r[i] = rune(c)
			}
			return string(r), nil
		}, nil
	case "ascii", "us-ascii":
		return func(b []byte) (string, error) {
			for i, c := range b {
				if c >= 0x80 {
					return decodeBad("ascii", b, i, mode)
				}
			}
			return string(b), nil
		}, nil
	}
	return nil, invalid("encoding %q is not one this server reads: utf-8, latin-1 or ascii", *encoding)
}

// decodeUTF8 decodes b as UTF-8 with Python's error handler mode.
func decodeUTF8(b []byte, mode string) (string, error) {
	if utf8.Valid(b) {
		return string(b), nil
	}
	if mode == "strict" {
		for i := 0; i < len(b); {
			r, n := utf8.DecodeRune(b[i:])
			if r == utf8.RuneError && n == 1 {
				return decodeBad("utf-8", b, i, mode)
			}
			i += n
		}
	}
	var sb strings.Builder
	for len(b) > 0 {
		r, n := utf8.DecodeRune(b)
		switch {
		case r != utf8.RuneError || n > 1:
			sb.Write(b[:n])
		case mode == "replace":
			sb.WriteRune(utf8.RuneError)
		case mode == "backslashreplace":
			sb.WriteString(`\x` + strconv.FormatUint(uint64(b[0])|0x100, 16)[1:])
		}
		b = b[n:]
	}
	return sb.String(), nil
}

// decodeBad is the strict decoding's error at byte i (replace and ignore modes of ASCII drop or
// replace the byte).
func decodeBad(enc string, b []byte, i int, mode string) (string, error) {
	if mode == "strict" {
		return "", invalid("'%s' codec can't decode byte 0x%02x in position %d: invalid start byte", enc, b[i], i)
	}
	var sb strings.Builder
	for _, c := range b {
		switch {
		case c < 0x80:
			sb.WriteByte(c)
		case mode == "replace":
			sb.WriteRune(utf8.RuneError)
		case mode == "backslashreplace":
			sb.WriteString(`\x` + strconv.FormatUint(uint64(c)|0x100, 16)[1:])
		}
	}
	return sb.String(), nil
}

// writeFile writes a file as one step (its directories are made as needed).
func (h *Handler) writeFile(c *call) (any, error) {
	var req writeFileRequest
	if err := h.decode(c.r, "write_file", &req); err != nil {
		return nil, err
	}
	switch {
	case req.Path == nil:
		return nil, invalid("write_file needs a path")
	case req.Content == nil:
		return nil, invalid("write_file needs a content")
	}
	if err := absolute("path", *req.Path); err != nil {
		return nil, err
	}
	if len(*req.Content) > sandbox.MaxFileBytes {
		return nil, invalid("a file of %d bytes is over the sandbox's file cap of %d bytes", len(*req.Content), sandbox.MaxFileBytes)
	}
	if err := h.write(c, *req.Path, []byte(*req.Content), 0); err != nil {
		return nil, err
	}
	return empty{}, nil
}

// write writes one file as a step.
func (h *Handler) write(c *call, p string, data []byte, mode uint32) error {
	res, err := h.step(c, episode.WriteFile{Path: p, Content: data, Mode: fileMode(mode)})
	if err != nil {
		return err
	}
	if e := res.Observation.Error; e != nil {
		return osError(e, p)
	}
	return nil
}

// under joins name, a relative path of a zip's entry, to dir; false when it would leave dir or
// names nothing.
func under(dir, name string) (string, bool) {
	name = strings.TrimSuffix(name, "/")
	if name == "" || strings.HasPrefix(name, "/") || strings.Contains(name, "\\") {
		return "", false
	}
	for _, part := range strings.Split(name, "/") {
		if part == ".." {
			return "", false
		}
	}
	return path.Join(dir, name), true
}
