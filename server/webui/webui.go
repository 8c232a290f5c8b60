// Package webui serves the web view of a deltagym server at /ui/: the page and its assets,
// built from the repository's ui/ sources into dist/ (make ui) and embedded in the binary.
//
// The page holds no data and no secret: it is a client of the server's API, which it calls
// with the Connect protocol's JSON under the session the server's auth gate keeps (package
// server). Its assets are named by the hash of their contents, so they are cached for good;
// the page itself is revalidated on every load. Every answer carries a Content-Security-Policy
// that lets the page run only its own script and style sheet and reach only its own origin.
package webui

import (
	"bytes"
	"crypto/sha256"
	"embed"
	"encoding/hex"
	"io/fs"
	"net/http"
	"path"
	"strconv"
	"strings"
	"time"
)

// Prefix is the path the web view is served under.
const Prefix = "/ui/"

// ContentSecurityPolicy is sent with every answer of the web view: the page's own script and
// style sheet, calls to its own origin, nothing inline, nothing from elsewhere, no framing.
const ContentSecurityPolicy = "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; " +
	"connect-src 'self'; base-uri 'none'; form-action 'self'; frame-ancestors 'none'"

//go:embed dist
var dist embed.FS

// contentTypes are the types of the files dist holds, by extension; no other file is served.
var contentTypes = map[string]string{
	".html": "text/html; charset=utf-8",
	".js":   "text/javascript; charset=utf-8",
	".css":  "text/css; charset=utf-8",
}

// Handler serves the web view under Prefix: index.html at Prefix itself, the assets under
// Prefix+"assets/". It answers GET and HEAD only.
func Handler() http.Handler {
	h := &handler{files: map[string]file{}}
	err := fs.WalkDir(dist, "dist", func(p string, d fs.DirEntry, err error) error {
		if err != nil || d.IsDir() {
			return err
		}
		ctype, ok := contentTypes[path.Ext(p)]
		if !ok {
			return nil
		}
		b, err := dist.ReadFile(p)
		if err != nil {
			return err
		}
		sum := sha256.Sum256(b)
		h.files[strings.TrimPrefix(p, "dist/")] = file{body: b, ctype: ctype, etag: `"` + hex.EncodeToString(sum[:16]) + `"`}
		return nil
	})
	if err != nil {
		panic(err) // dist is embedded at build time: it reads
	}
	return h
}

// file is one embedded file, with its type and entity tag.
type file struct {
	body  []byte
	ctype string
	etag  string
}

type handler struct{ files map[string]file }

// assetsMaxAge is how long a browser keeps an asset: its name changes with its contents.
const assetsMaxAge = 365 * 24 * time.Hour

func (h *handler) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	hdr := w.Header()
	hdr.Set("Content-Security-Policy", ContentSecurityPolicy)
	hdr.Set("X-Content-Type-Options", "nosniff")
	hdr.Set("Referrer-Policy", "no-referrer")
	hdr.Set("X-Frame-Options", "DENY")
	if r.Method != http.MethodGet && r.Method != http.MethodHead {
		hdr.Set("Allow", "GET, HEAD")
		http.Error(w, "the web view answers GET and HEAD only", http.StatusMethodNotAllowed)
		return
	}
	name, _ := strings.CutPrefix(r.URL.Path, Prefix)
	if name == "" {
		name = "index.html"
	}
	f, ok := h.files[name]
	if !ok {
		http.NotFound(w, r)
		return
	}
	if strings.HasPrefix(name, "assets/") {
		hdr.Set("Cache-Control", "public, max-age="+strconv.Itoa(int(assetsMaxAge/time.Second))+", immutable")
	} else {
		hdr.Set("Cache-Control", "no-cache")
	}
	hdr.Set("Content-Type", f.ctype)
	hdr.Set("ETag", f.etag)
	// ServeContent answers conditional and Range requests.
	http.ServeContent(w, r, name, time.Time{}, bytes.NewReader(f.body))
}
