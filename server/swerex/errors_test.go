package swerex_test

import (
	"archive/zip"
	"bytes"
	"encoding/json"
	"mime/multipart"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"

	"github.com/deltagym/deltagym/server/swerex"
)

// zipOf is a zip of the named contents, each of the given size of zeros when content is nil.
func zipOf(t *testing.T, entries map[string]int) []byte {
	t.Helper()
	var b bytes.Buffer
	zw := zip.NewWriter(&b)
	for name, size := range entries {
		w, err := zw.Create(name)
		if err != nil {
			t.Fatal(err)
		}
		if _, err := w.Write(make([]byte, size)); err != nil {
			t.Fatal(err)
		}
	}
	if err := zw.Close(); err != nil {
		t.Fatal(err)
	}
	return b.Bytes()
}

// uploadForm is the client's multipart form of an upload.
func uploadForm(t *testing.T, file []byte, target, unzip string) (string, *bytes.Buffer) {
	t.Helper()
	var b bytes.Buffer
	mw := multipart.NewWriter(&b)
	fw, err := mw.CreateFormFile("file", "zipped_transfer.zip")
	if err != nil {
		t.Fatal(err)
	}
	if _, err := fw.Write(file); err != nil {
		t.Fatal(err)
	}
	for k, v := range map[string]string{"target_path": target, "unzip": unzip} {
		if err := mw.WriteField(k, v); err != nil {
			t.Fatal(err)
		}
	}
	if err := mw.Close(); err != nil {
		t.Fatal(err)
	}
	return mw.FormDataContentType(), &b
}

// Requests that are wrong answer in SWE-ReX's error form (511, swerexception) with a message
// that says what to do, and change nothing: no step is counted, no file written.
func TestBadInput(t *testing.T) {
	needServer(t)
	id, _ := lease(t)
	base := "/swerex/" + id
	jsonPost := func(endpoint, body string) (int, []byte) {
		return post(t, http.MethodPost, base+"/"+endpoint, "application/json", strings.NewReader(body), key)
	}
	if code, body := jsonPost("create_session", `{}`); code != http.StatusOK {
		t.Fatalf("create_session: %d %s", code, body)
	}
	before := nextStep(t, id)

	code, body := post(t, http.MethodPost, "/swerex/sb-nosuch/execute", "application/json", strings.NewReader(`{"command":["true"]}`), key)
	wantException(t, code, body, "swerex.exceptions.SwerexException", "sb-nosuch")
	code, body = post(t, http.MethodGet, "/swerex/bad%21id/is_alive", "", nil, key)
	wantException(t, code, body, "builtins.ValueError", "/swerex/{sandbox_id}/{endpoint}")
	code, body = post(t, http.MethodGet, base+"/nope", "", nil, key)
	wantException(t, code, body, "builtins.ValueError", "no endpoint /nope")
	code, body = post(t, http.MethodGet, base+"/execute", "", nil, key)
	wantException(t, code, body, "builtins.ValueError", "takes POST")

	for _, tc := range []struct{ endpoint, body, class, words string }{
		{"execute", `{"command": ["true"]`, "builtins.ValueError", "not the JSON object /execute takes"},
		{"execute", `{"command": 5}`, "builtins.ValueError", "neither a string nor a list"},
		{"execute", `{"command": ["true"], "timeout": -1}`, "builtins.ValueError", "timeout -1 is not a number of seconds"},
		{"execute", `{"command": ["true"], "cwd": "tmp"}`, "builtins.ValueError", "cwd 'tmp' is not an absolute path"},
		{"run_in_session", `{"action_type": "bash"}`, "builtins.ValueError", "needs a command"},
		{"run_in_session", `{"command": "true", "session": "other"}`, "swerex.exceptions.SessionDoesNotExistError", "session 'other' does not exist"},
		{"run_in_session", `{"command": "cat", "expect": ["("], "is_interactive_command": true}`, "builtins.ValueError", "not a regular expression"},
		{"run_in_session", `{"command": "true", "check": "maybe"}`, "builtins.ValueError", "check \"maybe\""},
		{"create_session", `{}`, "swerex.exceptions.SessionExistsError", "session default already exists"},
		{"create_session", `{"session": "a b"}`, "builtins.ValueError", "session name \"a b\""},
		{"read_file", `{}`, "builtins.ValueError", "read_file needs a path"},
		{"read_file", `{"path": "work/a.txt"}`, "builtins.ValueError", "not an absolute path"},
		{"read_file", `{"path": "/etc/hostname", "encoding": "utf-16"}`, "builtins.ValueError", "encoding \"utf-16\""},
		{"write_file", `{"path": "/work/a.txt"}`, "builtins.ValueError", "write_file needs a content"},
		{"write_file", `{"path": "../a.txt", "content": "x"}`, "builtins.ValueError", "not an absolute path"},
	} {
		code, body := jsonPost(tc.endpoint, tc.body)
		wantException(t, code, body, tc.class, tc.words)
	}

	ct, form := uploadForm(t, zipOf(t, map[string]int{"ok.txt": 3, "../evil.txt": 3}), "/work/up", "true")
	code, body = post(t, http.MethodPost, base+"/upload", ct, form, key)
	wantException(t, code, body, "builtins.ValueError", "leaves its directory")
	ct, form = uploadForm(t, zipOf(t, map[string]int{"ok.txt": 3, "zeros": 65 << 20}), "/work/up", "true")
	code, body = post(t, http.MethodPost, base+"/upload", ct, form, key)
	wantException(t, code, body, "builtins.ValueError", "over the sandbox's file cap")
	ct, form = uploadForm(t, []byte("not a zip"), "/work/up", "true")
	code, body = post(t, http.MethodPost, base+"/upload", ct, form, key)
	wantException(t, code, body, "builtins.ValueError", "not a zip")
	ct, form = uploadForm(t, []byte("x"), "up", "false")
	code, body = post(t, http.MethodPost, base+"/upload", ct, form, key)
	wantException(t, code, body, "builtins.ValueError", "target_path 'up' is not an absolute path")
	code, body = post(t, http.MethodPost, base+"/upload", "application/json", strings.NewReader("{}"), key)
	wantException(t, code, body, "builtins.ValueError", "multipart/form-data")

	if after := nextStep(t, id); after != before {
		t.Fatalf("refused requests counted %d steps", after-before)
	}
	code, body = jsonPost("read_file", `{"path": "/work/up/ok.txt"}`)
	wantException(t, code, body, "builtins.FileNotFoundError", "No such file or directory: '/work/up/ok.txt'")
}

// A body over the request cap is refused before anything is done.
func TestBodyCap(t *testing.T) {
	h := swerex.New(swerex.Config{MaxBody: 1024})
	ct, form := uploadForm(t, make([]byte, 4096), "/work/big", "false")
	for _, r := range []*http.Request{
		httptest.NewRequest(http.MethodPost, "/swerex/sb-1/upload", form),
		httptest.NewRequest(http.MethodPost, "/swerex/sb-1/write_file", strings.NewReader(`{"path": "/a", "content": "`+strings.Repeat("x", 4096)+`"}`)),
	} {
		r.Header.Set("Content-Type", ct)
		if strings.HasSuffix(r.URL.Path, "write_file") {
			r.Header.Set("Content-Type", "application/json")
		}
		w := httptest.NewRecorder()
		h.ServeHTTP(w, r)
		wantException(t, w.Code, w.Body.Bytes(), "builtins.ValueError", "over the server's request cap of 1024 bytes")
	}
}

// The token is taken from SWE-ReX's X-API-Key header (on its paths only), a bearer header or
// the URL; without it, or with a wrong one, the answer is SWE-ReX's error form, which its
// client raises as PermissionError.
func TestAuth(t *testing.T) {
	needServer(t)
	id, _ := lease(t)
	alive := "/swerex/" + id + "/is_alive"
	for _, tc := range []struct {
		name   string
		path   string
		header map[string]string
		ok     bool
	}{
		{"no token", alive, nil, false},
		{"wrong X-API-Key", alive, map[string]string{"X-API-Key": "wrong"}, false},
		{"X-API-Key", alive, key, true},
		{"bearer", alive, map[string]string{"Authorization": "Bearer " + testToken}, true},
		{"URL", "/t/" + testToken + alive, nil, true},
		{"wrong URL", "/t/wrong" + alive, nil, false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			code, body := post(t, http.MethodGet, tc.path, "", nil, tc.header)
			if !tc.ok {
				wantException(t, code, body, "builtins.PermissionError", "missing or wrong token")
				return
			}
			var r struct {
				IsAlive bool `json:"is_alive"`
			}
			if code != http.StatusOK || json.Unmarshal(body, &r) != nil || !r.IsAlive {
				t.Fatalf("status %d, body %s", code, body)
			}
		})
	}
	// X-API-Key is SWE-ReX's: the Connect API does not take it.
	code, _ := post(t, http.MethodPost, "/deltagym.v1.EnvService/ListEnvs", "application/json", strings.NewReader("{}"), key)
	if code != http.StatusUnauthorized {
		t.Fatalf("ListEnvs with X-API-Key only: status %d, want 401", code)
	}
}

// A command in a session of a sandbox that is not there says so, not that the session is
// missing; a command whose directory is missing names the directory.
func TestWhatIsMissing(t *testing.T) {
	needServer(t)
	code, body := post(t, http.MethodPost, "/swerex/sb-0000000000000000/run_in_session", "application/json",
		strings.NewReader(`{"command": "true", "session": "default"}`), key)
	wantException(t, code, body, "swerex.exceptions.SwerexException", "sb-0000000000000000")
	id, _ := lease(t)
	code, body = post(t, http.MethodPost, "/swerex/"+id+"/execute", "application/json",
		strings.NewReader(`{"command": "pwd", "shell": true, "cwd": "/nope"}`), key)
	wantException(t, code, body, "builtins.FileNotFoundError", "'/nope'")
}
