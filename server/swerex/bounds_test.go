package swerex_test

import (
	"archive/zip"
	"bytes"
	"encoding/json"
	"fmt"
	"hash/crc32"
	"net/http"
	"strings"
	"testing"
)

// jsonCall posts body to the sandbox's endpoint and returns the status and body.
func jsonCall(t *testing.T, id, endpoint, body string) (int, []byte) {
	t.Helper()
	return post(t, http.MethodPost, "/swerex/"+id+"/"+endpoint, "application/json", strings.NewReader(body), key)
}

// expectJSON is a JSON list of the given expect strings.
func expectJSON(t *testing.T, expect []string) string {
	t.Helper()
	b, err := json.Marshal(expect)
	if err != nil {
		t.Fatal(err)
	}
	return string(b)
}

// Expect strings are checked after the sandbox and the session, and within bounds of their
// count, their lengths and their compiled size, refused past them with a ValueError that names
// the bound; nothing runs.
func TestExpectBounds(t *testing.T) {
	needServer(t)
	id, _ := lease(t)
	if code, body := jsonCall(t, id, "create_session", `{}`); code != http.StatusOK {
		t.Fatalf("create_session: %d %s", code, body)
	}
	before := nextStep(t, id)
	many := make([]string, 17)
	for i := range many {
		many[i] = fmt.Sprintf("prompt%d> ", i)
	}
	// A pattern that would take gigabytes to compile: refused by its length, unread.
	huge := strings.Repeat("(?:a{1000}|b{1000}|c{1000})", 8000)
	costly := []string{`(?:.{100}){10}q`, `(?:.{100}){10}r`}
	for _, tc := range []struct{ id, session, expect, class, words string }{
		{"sb-nosuch", "default", expectJSON(t, []string{huge}), "swerex.exceptions.SwerexException", "sb-nosuch"},
		{id, "other", expectJSON(t, []string{huge}), "swerex.exceptions.SessionDoesNotExistError", "session 'other' does not exist"},
		{id, "default", expectJSON(t, many), "builtins.ValueError", "17 expect strings, more than the 16 this server takes"},
		{id, "default", expectJSON(t, []string{huge}), "builtins.ValueError", "216000 bytes long, more than the 1024 this server takes"},
		{id, "default", expectJSON(t, costly), "builtins.ValueError", "more than 2000 instructions in all"},
		{id, "default", `["("]`, "builtins.ValueError", "not a regular expression"},
	} {
		body := fmt.Sprintf(`{"command": "cat", "session": %q, "is_interactive_command": true, "expect": %s}`, tc.session, tc.expect)
		code, answer := jsonCall(t, tc.id, "run_in_session", body)
		wantException(t, code, answer, tc.class, tc.words)
	}
	if after := nextStep(t, id); after != before {
		t.Fatalf("refused requests counted %d steps", after-before)
	}
}

// Timeouts, paths and commands that are wrong are refused saying what is wrong, in SWE-ReX's
// terms; a timeout under a nanosecond is one, not the env's whole step timeout; the Enter key
// alone with nothing attached is answered; paths under /swerex that are not clean, and
// /swerex itself, answer in SWE-ReX's form.
func TestRequestEdges(t *testing.T) {
	needServer(t)
	id, _ := lease(t)
	if code, body := jsonCall(t, id, "create_session", `{}`); code != http.StatusOK {
		t.Fatalf("create_session: %d %s", code, body)
	}
	before := nextStep(t, id)
	long := "/" + strings.Repeat("d", 5000)
	for _, tc := range []struct{ endpoint, body, class, words string }{
		{"run_in_session", `{"action_type": "bash_interrupt", "timeout": -5}`, "builtins.ValueError", "timeout -5 is not a number of seconds"},
		{"run_in_session", `{"command": ""}`, "builtins.ValueError", "the bash action's command is empty"},
		{"read_file", `{"path": "/etc/host\u0000name"}`, "builtins.ValueError", "holds a NUL byte"},
		{"read_file", `{"path": "` + long + `"}`, "builtins.ValueError", "5001 bytes long, longer than a path can be"},
		{"write_file", `{"path": "` + long + `", "content": "x"}`, "builtins.ValueError", "longer than a path can be"},
		{"execute", `{"command": ["true"], "cwd": "/tmp\u0000"}`, "builtins.ValueError", "cwd '/tmp\\x00' holds a NUL byte"},
	} {
		code, body := jsonCall(t, id, tc.endpoint, tc.body)
		wantException(t, code, body, tc.class, tc.words)
	}
	for _, p := range []string{"/swerex/./x", "/swerex/..", "/swerex/" + id + "/./is_alive", "/swerex", "/swerex/"} {
		code, body := post(t, http.MethodGet, p, "", nil, key)
		wantException(t, code, body, "builtins.ValueError", "")
	}
	code, body := post(t, http.MethodGet, "/swerex", "", nil, nil)
	wantException(t, code, body, "builtins.PermissionError", "missing or wrong token")
	if after := nextStep(t, id); after != before {
		t.Fatalf("refused requests counted %d steps", after-before)
	}

	code, body = jsonCall(t, id, "execute", `{"command": ["sleep", "5"], "timeout": 1e-10}`)
	wantException(t, code, body, "swerex.exceptions.CommandTimeoutError", "Timeout")
	code, body = jsonCall(t, id, "run_in_session", `{"command": "", "is_interactive_quit": true}`)
	var obs struct {
		Output       string `json:"output"`
		ExpectString string `json:"expect_string"`
	}
	if code != http.StatusOK || json.Unmarshal(body, &obs) != nil || obs.Output != "" || obs.ExpectString != "SHELLPS1PREFIX" {
		t.Fatalf("the Enter key with nothing attached: %d %s", code, body)
	}
}

// zipEntry is an entry of a zip built by zipRaw: a file (data) or a directory (name ends in
// "/"); badCRC stores a wrong checksum.
type zipEntry struct {
	name   string
	data   string
	badCRC bool
}

// zipRaw is a zip of entries, in order, stored uncompressed.
func zipRaw(t *testing.T, entries ...zipEntry) []byte {
	t.Helper()
	var b bytes.Buffer
	zw := zip.NewWriter(&b)
	for _, e := range entries {
		sum := crc32.ChecksumIEEE([]byte(e.data))
		if e.badCRC {
			sum++
		}
		w, err := zw.CreateRaw(&zip.FileHeader{Name: e.name, Method: zip.Store, CRC32: sum,
			CompressedSize64: uint64(len(e.data)), UncompressedSize64: uint64(len(e.data))})
		if err != nil {
			t.Fatal(err)
		}
		if _, err := w.Write([]byte(e.data)); err != nil {
			t.Fatal(err)
		}
	}
	if err := zw.Close(); err != nil {
		t.Fatal(err)
	}
	return b.Bytes()
}

// An upload's zip is checked whole before anything is written: a bad checksum in a later entry,
// or a path that is a file and a directory, writes nothing. A zip of more empty directories than
// one command takes arguments is extracted whole.
func TestUploadChecked(t *testing.T) {
	needServer(t)
	id, _ := lease(t)
	upload := func(data []byte, target string) (int, []byte) {
		ct, form := uploadForm(t, data, target, "true")
		return post(t, http.MethodPost, "/swerex/"+id+"/upload", ct, form, key)
	}
	before := nextStep(t, id)
	code, body := upload(zipRaw(t, zipEntry{name: "first.txt", data: "one"}, zipEntry{name: "second.txt", data: "two", badCRC: true}), "/work/crc")
	wantException(t, code, body, "builtins.ValueError", "'second.txt': zip: checksum error")
	code, body = upload(zipRaw(t, zipEntry{name: "first.txt", data: "one"}, zipEntry{name: "a", data: "file"}, zipEntry{name: "a/b", data: "under"}), "/work/clash")
	wantException(t, code, body, "builtins.ValueError", "makes '/work/clash/a' both a file")
	code, body = upload(zipRaw(t, zipEntry{name: "first.txt", data: "one"}, zipEntry{name: "d/", data: ""}, zipEntry{name: "d", data: "file"}), "/work/clash2")
	wantException(t, code, body, "builtins.ValueError", "makes '/work/clash2/d' both a file")
	if after := nextStep(t, id); after != before {
		t.Fatalf("refused uploads counted %d steps (wrote some of their entries)", after-before)
	}

	const n = 5000
	dirs := make([]zipEntry, n)
	for i := range dirs {
		dirs[i] = zipEntry{name: fmt.Sprintf("dir-%04d/", i)}
	}
	if code, body := upload(zipRaw(t, dirs...), "/work/many"); code != http.StatusOK {
		t.Fatalf("a zip of %d empty directories: %d %s", n, code, body)
	}
	code, body = jsonCall(t, id, "execute", `{"command": "find /work/many -mindepth 1 -type d | wc -l", "shell": true}`)
	var out struct {
		Stdout string `json:"stdout"`
	}
	if code != http.StatusOK || json.Unmarshal(body, &out) != nil || strings.TrimSpace(out.Stdout) != fmt.Sprint(n) {
		t.Fatalf("directories made: %d %s, want %d", code, body, n)
	}
}

// read_file's answer is the file's text in JSON however it is made of control characters and
// quotes, written as it is encoded.
func TestReadFileEscapes(t *testing.T) {
	needServer(t)
	id, _ := lease(t)
	content := "nul\x00 bell\x07 \"quoted\" back\\slash\ttab\r\nwörld \u2028 end\x1f" + strings.Repeat("\x00", 200<<10)
	req, _ := json.Marshal(map[string]string{"path": "/work/ctl.txt", "content": content})
	if code, body := jsonCall(t, id, "write_file", string(req)); code != http.StatusOK {
		t.Fatalf("write_file: %d %s", code, body)
	}
	code, body := jsonCall(t, id, "read_file", `{"path": "/work/ctl.txt"}`)
	var got struct {
		Content string `json:"content"`
	}
	if code != http.StatusOK {
		t.Fatalf("read_file: %d %.200s", code, body)
	}
	if err := json.Unmarshal(body, &got); err != nil || got.Content != content {
		t.Fatalf("read_file's content (%v): %d bytes, want %d, the same", err, len(got.Content), len(content))
	}
}
