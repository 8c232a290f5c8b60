package webui_test

import (
	"net/http"
	"net/http/httptest"
	"regexp"
	"strings"
	"testing"

	"github.com/deltagym/deltagym/server/webui"
)

// served is what get returns of an answer.
type served struct {
	StatusCode int
	Header     http.Header
}

func get(t *testing.T, h http.Handler, method, path string, hdr ...string) (served, string) {
	t.Helper()
	r := httptest.NewRequestWithContext(t.Context(), method, path, nil)
	for i := 0; i+1 < len(hdr); i += 2 {
		r.Header.Set(hdr[i], hdr[i+1])
	}
	w := httptest.NewRecorder()
	h.ServeHTTP(w, r)
	return served{StatusCode: w.Code, Header: w.Header()}, w.Body.String()
}

// TestServe checks what the page and its assets are served with: their types, the
// Content-Security-Policy, and caching (the page revalidated, hashed assets kept for good).
func TestServe(t *testing.T) {
	t.Parallel()
	h := webui.Handler()
	resp, page := get(t, h, "GET", "/ui/")
	if resp.StatusCode != http.StatusOK || resp.Header.Get("Content-Type") != "text/html; charset=utf-8" {
		t.Fatalf("/ui/: %d %q", resp.StatusCode, resp.Header.Get("Content-Type"))
	}
	if cc := resp.Header.Get("Cache-Control"); cc != "no-cache" {
		t.Errorf("/ui/ Cache-Control %q, want no-cache", cc)
	}
	csp := resp.Header.Get("Content-Security-Policy")
	for _, want := range []string{"default-src 'none'", "script-src 'self'", "style-src 'self'", "connect-src 'self'", "frame-ancestors 'none'"} {
		if !strings.Contains(csp, want) {
			t.Errorf("CSP %q lacks %q", csp, want)
		}
	}
	if strings.Contains(csp, "unsafe-inline") || strings.Contains(csp, "http") {
		t.Errorf("CSP %q allows inline code or another origin", csp)
	}
	if strings.Contains(page, "<script>") || strings.Contains(page, "http://") || strings.Contains(page, "https://") || strings.Contains(page, "style=") {
		t.Errorf("the page has inline code or external references:\n%s", page)
	}
	assets := regexp.MustCompile(`(?:src|href)="(assets/[^"]+)"`).FindAllStringSubmatch(page, -1)
	if len(assets) != 2 {
		t.Fatalf("the page names %d assets, want a script and a style sheet:\n%s", len(assets), page)
	}
	types := map[string]string{".js": "text/javascript; charset=utf-8", ".css": "text/css; charset=utf-8"}
	for _, a := range assets {
		resp, body := get(t, h, "GET", "/ui/"+a[1])
		ext := a[1][strings.LastIndex(a[1], "."):]
		if resp.StatusCode != http.StatusOK || resp.Header.Get("Content-Type") != types[ext] || body == "" {
			t.Errorf("%s: %d %q", a[1], resp.StatusCode, resp.Header.Get("Content-Type"))
		}
		if cc := resp.Header.Get("Cache-Control"); !strings.Contains(cc, "immutable") || !strings.Contains(cc, "max-age=31536000") {
			t.Errorf("%s Cache-Control %q, want a year, immutable", a[1], cc)
		}
		if strings.Contains(body, "https://") && ext == ".css" {
			t.Errorf("%s reaches another origin", a[1])
		}
		resp2, _ := get(t, h, "GET", "/ui/"+a[1], "If-None-Match", resp.Header.Get("ETag"))
		if resp2.StatusCode != http.StatusNotModified {
			t.Errorf("%s revalidated with its ETag: %d, want 304", a[1], resp2.StatusCode)
		}
	}
	for _, p := range []string{"/ui/nothing", "/ui/assets/", "/ui/assets/../index.html", "/ui/session"} {
		if resp, _ := get(t, h, "GET", p); resp.StatusCode != http.StatusNotFound {
			t.Errorf("%s: %d, want 404", p, resp.StatusCode)
		}
	}
	if resp, _ := get(t, h, "POST", "/ui/"); resp.StatusCode != http.StatusMethodNotAllowed {
		t.Errorf("POST /ui/: %d, want 405", resp.StatusCode)
	}
}
