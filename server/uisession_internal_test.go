package server

import (
	"crypto/sha256"
	"encoding/json"
	"io"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"
	"time"

	"connectrpc.com/connect"

	"github.com/deltagym/deltagym/clients/go/gen/deltagym/v1/deltagymv1connect"
	"github.com/deltagym/deltagym/server/webui"
)

const uiTestToken = "0123456789abcdefghijklmnopqrstuvwxyzABCDEFG"

// uiGate is a gate for token tok in front of the web view's handlers and a handler that
// answers every other path with 200 "reached".
func uiGate(tok string, on bool) *gate {
	mux := http.NewServeMux()
	mux.HandleFunc("/", func(w http.ResponseWriter, r *http.Request) { _, _ = io.WriteString(w, "reached") })
	g := &gate{on: on, errw: connect.NewErrorWriter(), next: mux}
	if on {
		g.want = sha256.Sum256([]byte(tok))
		g.ui = newUISessions(tok)
	}
	mux.Handle(webui.Prefix, webui.Handler())
	mux.Handle(uiSessionPath, &uiSessionHandler{g: g})
	return g
}

type uiClient struct {
	t   *testing.T
	url string
	hc  *http.Client
}

// answer is what do returns of a response, read whole.
type answer struct {
	StatusCode int
	Header     http.Header
	Trailer    http.Header
	cookies    []*http.Cookie
}

func (a answer) Cookies() []*http.Cookie { return a.cookies }

func (c uiClient) do(method, path string, body string, hdr map[string]string, cookies ...*http.Cookie) (answer, string) {
	c.t.Helper()
	req, err := http.NewRequestWithContext(c.t.Context(), method, c.url+path, strings.NewReader(body))
	if err != nil {
		c.t.Fatal(err)
	}
	for k, v := range hdr {
		req.Header.Set(k, v)
	}
	for _, ck := range cookies {
		req.AddCookie(ck)
	}
	resp, err := c.hc.Do(req)
	if err != nil {
		c.t.Fatal(err)
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	if err != nil {
		c.t.Fatal(err)
	}
	return answer{StatusCode: resp.StatusCode, Header: resp.Header, Trailer: resp.Trailer, cookies: resp.Cookies()}, string(b)
}

var jsonHdr = map[string]string{"Content-Type": "application/json"}

// signIn signs in with tok and returns the session cookie and the CSRF token.
func (c uiClient) signIn(tok string) (*http.Cookie, string) {
	c.t.Helper()
	resp, body := c.do("POST", uiSessionPath, `{"token":"`+tok+`"}`, jsonHdr)
	if resp.StatusCode != http.StatusOK {
		c.t.Fatalf("sign-in: %d %s", resp.StatusCode, body)
	}
	var got uiSessionResponse
	if err := json.Unmarshal([]byte(body), &got); err != nil || got.CSRF == "" || !got.Auth {
		c.t.Fatalf("sign-in answered %s (%v)", body, err)
	}
	for _, ck := range resp.Cookies() {
		if ck.Name == uiSessionCookie {
			return ck, got.CSRF
		}
	}
	c.t.Fatalf("sign-in set no session cookie: %v", resp.Header["Set-Cookie"])
	return nil, ""
}

func startUI(t *testing.T, g *gate, tls bool) uiClient {
	srv := httptest.NewUnstartedServer(g)
	if tls {
		srv.StartTLS()
	} else {
		srv.Start()
	}
	t.Cleanup(srv.Close)
	return uiClient{t: t, url: srv.URL, hc: srv.Client()}
}

func TestUISignIn(t *testing.T) {
	t.Parallel()
	for _, tls := range []bool{false, true} {
		t.Run(map[bool]string{false: "http", true: "tls"}[tls], func(t *testing.T) {
			t.Parallel()
			c := startUI(t, uiGate(uiTestToken, true), tls)
			resp, body := c.do("POST", uiSessionPath, `{"token":"wrong-token-wrong-token"}`, jsonHdr)
			if resp.StatusCode != http.StatusUnauthorized || len(resp.Cookies()) != 0 || !strings.Contains(body, "wrong token") {
				t.Errorf("a wrong token: %d %v %s, want 401, no cookie, an error", resp.StatusCode, resp.Cookies(), body)
			}
			resp, _ = c.do("POST", uiSessionPath, `token=`+uiTestToken, map[string]string{"Content-Type": "application/x-www-form-urlencoded"})
			if resp.StatusCode != http.StatusUnsupportedMediaType || len(resp.Cookies()) != 0 {
				t.Errorf("a form post: %d %v, want 415 and no cookie", resp.StatusCode, resp.Cookies())
			}
			resp, _ = c.do("GET", uiSessionPath, "", nil)
			if resp.StatusCode != http.StatusUnauthorized {
				t.Errorf("the session without a cookie: %d, want 401", resp.StatusCode)
			}
			ck, csrf := c.signIn(uiTestToken)
			if !ck.HttpOnly || ck.SameSite != http.SameSiteStrictMode || ck.Path != "/" || ck.Secure != tls || ck.MaxAge <= 0 {
				t.Errorf("cookie %+v: want HttpOnly, SameSite=Strict, Path=/, Secure=%v, a max age", ck, tls)
			}
			if strings.Contains(ck.Value, uiTestToken) {
				t.Error("the cookie holds the token")
			}
			resp, body = c.do("GET", uiSessionPath, "", nil, ck)
			var got uiSessionResponse
			if resp.StatusCode != http.StatusOK || json.Unmarshal([]byte(body), &got) != nil || got.CSRF != csrf {
				t.Errorf("the session with its cookie: %d %s, want 200 and CSRF %s", resp.StatusCode, body, csrf)
			}
			if cc := resp.Header.Get("Cache-Control"); cc != "no-store" {
				t.Errorf("session Cache-Control %q, want no-store", cc)
			}
			resp, _ = c.do("DELETE", uiSessionPath, "", nil, ck)
			var cleared bool
			for _, k := range resp.Cookies() {
				cleared = cleared || k.Name == uiSessionCookie && k.MaxAge < 0 && k.Value == ""
			}
			if resp.StatusCode != http.StatusOK || !cleared {
				t.Errorf("sign-out: %d %v, want 200 and the cookie cleared", resp.StatusCode, resp.Header["Set-Cookie"])
			}
		})
	}
}

func TestUICookieGate(t *testing.T) {
	t.Parallel()
	c := startUI(t, uiGate(uiTestToken, true), false)
	ck, csrf := c.signIn(uiTestToken)
	other, _ := c.signIn(uiTestToken)
	withCSRF := map[string]string{"Content-Type": "application/json", uiCSRFHeader: csrf}
	for p := range uiCalls {
		resp, body := c.do("POST", p, "{}", jsonHdr)
		if resp.StatusCode != http.StatusUnauthorized || !strings.Contains(body, "unauthenticated") {
			t.Errorf("%s without a cookie: %d %s, want 401", p, resp.StatusCode, body)
		}
		resp, body = c.do("POST", p, "{}", withCSRF, ck)
		if resp.StatusCode != http.StatusOK || body != "reached" {
			t.Errorf("%s with the cookie and its CSRF token: %d %s, want it reached", p, resp.StatusCode, body)
		}
		resp, body = c.do("POST", p, "{}", jsonHdr, ck)
		if resp.StatusCode != http.StatusForbidden || !strings.Contains(body, uiCSRFHeader) {
			t.Errorf("%s with the cookie, no CSRF token: %d %s, want 403 naming the header", p, resp.StatusCode, body)
		}
		resp, body = c.do("POST", p, "{}", withCSRF, other)
		if resp.StatusCode != http.StatusForbidden {
			t.Errorf("%s with another session's CSRF token: %d %s, want 403", p, resp.StatusCode, body)
		}
	}
	for _, tc := range []struct {
		name, method, path, ctype string
		status                    int // the protocol's refusal: gRPC's comes in a 200 (grpc-status 16), SWE-ReX's is a 511
	}{
		{"another call", "POST", deltagymv1connect.EnvServiceResetProcedure, "application/json", 401},
		{"a step", "POST", deltagymv1connect.EnvServiceStepProcedure, "application/json", 401},
		{"gRPC", "POST", deltagymv1connect.EnvServiceListEnvsProcedure, "application/grpc", 200},
		{"Connect binary", "POST", deltagymv1connect.EnvServiceListEnvsProcedure, "application/proto", 401},
		{"Connect GET", "GET", deltagymv1connect.EnvServiceListEnvsProcedure + "?encoding=json&message={}", "", 401},
		{"SWE-ReX", "POST", "/swerex/sb-1/execute", "application/json", 511},
		{"OpenEnv", "POST", "/openenv/task/reset", "application/json", 401},
		{"metrics", "GET", "/metrics", "", 401},
		{"node service", "POST", deltagymv1connect.NodeServiceGetNodeProcedure, "application/json", 401},
	} {
		hdr := map[string]string{uiCSRFHeader: csrf}
		if tc.ctype != "" {
			hdr["Content-Type"] = tc.ctype
		}
		resp, body := c.do(tc.method, tc.path, "{}", hdr, ck)
		grpcRefused := tc.status != 200 || resp.Header.Get("Grpc-Status") == "16" || resp.Trailer.Get("Grpc-Status") == "16"
		if resp.StatusCode != tc.status || body == "reached" || !grpcRefused {
			t.Errorf("the cookie on %s (%s): %d %s, want refused (%d)", tc.name, tc.path, resp.StatusCode, body, tc.status)
		}
	}
	// A bearer token works as before, with or without a cookie; a wrong one is not saved by it.
	list := deltagymv1connect.EnvServiceListEnvsProcedure
	if resp, body := c.do("POST", list, "{}", map[string]string{"Content-Type": "application/json", "Authorization": "Bearer " + uiTestToken}); body != "reached" {
		t.Errorf("bearer: %d %s", resp.StatusCode, body)
	}
	if resp, body := c.do("POST", list, "{}", map[string]string{"Content-Type": "application/json", "Authorization": "Bearer nope", uiCSRFHeader: csrf}, ck); resp.StatusCode != http.StatusUnauthorized {
		t.Errorf("a wrong bearer token beside a good cookie: %d %s, want 401", resp.StatusCode, body)
	}
	// The page and its session endpoint need no token.
	if resp, body := c.do("GET", "/ui/", "", nil); resp.StatusCode != http.StatusOK || !strings.Contains(body, "<div id=\"app\">") {
		t.Errorf("/ui/ without a token: %d %.80s", resp.StatusCode, body)
	}
	if resp, body := c.do("GET", "/ui/../metrics", "", nil); resp.StatusCode == http.StatusOK {
		t.Errorf("/ui/../metrics: %d %.80s, want it refused", resp.StatusCode, body)
	}
}

func TestUISessionEnds(t *testing.T) {
	t.Parallel()
	c := startUI(t, uiGate(uiTestToken, true), false)
	ck, csrf := c.signIn(uiTestToken)
	hdr := map[string]string{"Content-Type": "application/json", uiCSRFHeader: csrf}
	list := deltagymv1connect.LedgerServiceListEpisodesProcedure

	// A new token: the old session is refused.
	rotated := startUI(t, uiGate(uiTestToken+"-rotated", true), false)
	if resp, body := rotated.do("POST", list, "{}", hdr, ck); resp.StatusCode != http.StatusUnauthorized || !strings.Contains(body, "sign in again") {
		t.Errorf("a session under the old token: %d %s, want 401 asking to sign in again", resp.StatusCode, body)
	}
	if resp, _ := rotated.do("GET", uiSessionPath, "", nil, ck); resp.StatusCode != http.StatusUnauthorized {
		t.Errorf("the session endpoint under a new token: %d, want 401", resp.StatusCode)
	}
	// A changed cookie is refused.
	bad := *ck
	bad.Value = "A" + bad.Value[1:]
	if bad.Value == ck.Value {
		bad.Value = "B" + bad.Value[1:]
	}
	if resp, _ := c.do("POST", list, "{}", hdr, &bad); resp.StatusCode != http.StatusUnauthorized {
		t.Errorf("a changed cookie: %d, want 401", resp.StatusCode)
	}
	// Past its expiry, the session is refused: a server of the same token, its clock past it.
	later := uiGate(uiTestToken, true)
	later.ui.now = func() time.Time { return time.Now().Add(uiSessionTTL + time.Minute) }
	if resp, _ := startUI(t, later, false).do("POST", list, "{}", hdr, ck); resp.StatusCode != http.StatusUnauthorized {
		t.Errorf("an expired session: %d, want 401", resp.StatusCode)
	}
	if resp, body := c.do("POST", list, "{}", hdr, ck); resp.StatusCode != http.StatusOK {
		t.Errorf("the session before its expiry: %d %s, want it reached", resp.StatusCode, body)
	}
}

// Sign-out ends the session on the server: a copy of its cookie with its CSRF token is refused
// after it, on the page's calls and at the session endpoint; another session goes on.
func TestUISignOutEndsSession(t *testing.T) {
	t.Parallel()
	c := startUI(t, uiGate(uiTestToken, true), false)
	ck, csrf := c.signIn(uiTestToken)
	other, otherCSRF := c.signIn(uiTestToken)
	list := deltagymv1connect.LedgerServiceListEpisodesProcedure
	hdr := map[string]string{"Content-Type": "application/json", uiCSRFHeader: csrf}
	if resp, body := c.do("POST", list, "{}", hdr, ck); resp.StatusCode != http.StatusOK || body != "reached" {
		t.Fatalf("the session before sign-out: %d %s", resp.StatusCode, body)
	}
	if resp, _ := c.do("DELETE", uiSessionPath, "", nil, ck); resp.StatusCode != http.StatusOK {
		t.Fatalf("sign-out: %d", resp.StatusCode)
	}
	if resp, body := c.do("POST", list, "{}", hdr, ck); resp.StatusCode != http.StatusUnauthorized || !strings.Contains(body, "signed out") {
		t.Errorf("the signed-out cookie with its CSRF token: %d %s, want 401", resp.StatusCode, body)
	}
	if resp, _ := c.do("GET", uiSessionPath, "", nil, ck); resp.StatusCode != http.StatusUnauthorized {
		t.Errorf("the session endpoint with the signed-out cookie: %d, want 401", resp.StatusCode)
	}
	otherHdr := map[string]string{"Content-Type": "application/json", uiCSRFHeader: otherCSRF}
	if resp, body := c.do("POST", list, "{}", otherHdr, other); resp.StatusCode != http.StatusOK || body != "reached" {
		t.Errorf("another session after a sign-out: %d %s, want it reached", resp.StatusCode, body)
	}
	// Signing out again, or without a session, is answered and changes nothing.
	for _, cks := range [][]*http.Cookie{{ck}, nil} {
		if resp, _ := c.do("DELETE", uiSessionPath, "", nil, cks...); resp.StatusCode != http.StatusOK {
			t.Errorf("a second sign-out: %d", resp.StatusCode)
		}
	}
}

// The sessions signed out are remembered until their expiry, at most uiMaxRevoked of them: the
// expired are dropped, and a sign-out that finds the set full of live ones ends every session
// issued until then, while one issued after works.
func TestUIRevokedBounded(t *testing.T) {
	t.Parallel()
	u := newUISessions(uiTestToken)
	now := time.Now()
	u.now = func() time.Time { return now }
	revoke := func(cookie string) {
		t.Helper()
		v, exp, ok := u.check(cookie)
		if !ok {
			t.Fatalf("session %s refused before its sign-out", cookie)
		}
		u.revoke(v, exp)
		if _, _, ok := u.check(cookie); ok {
			t.Fatalf("session %s accepted after its sign-out", cookie)
		}
	}
	for range uiMaxRevoked {
		c, _, _ := u.issue()
		revoke(c)
	}
	// Past their expiry, the next sign-out drops them.
	now = now.Add(uiSessionTTL + time.Second)
	kept, _, _ := u.issue()
	revoke(kept)
	u.mu.Lock()
	n := len(u.revoked)
	u.mu.Unlock()
	if n != 1 {
		t.Fatalf("%d sessions remembered after the expired were dropped, want 1", n)
	}
	// Full of live ones: the sign-out that finds it so ends every session issued until then.
	var live []string
	for range uiMaxRevoked - 1 {
		c, _, _ := u.issue()
		revoke(c)
	}
	for range 3 {
		c, _, _ := u.issue()
		live = append(live, c)
	}
	revoke(live[0])
	u.mu.Lock()
	n = len(u.revoked)
	u.mu.Unlock()
	if n != 0 {
		t.Fatalf("%d sessions remembered past the cap, want none (ended by the expiry bound)", n)
	}
	for _, c := range append(live[1:], kept) {
		if _, _, ok := u.check(c); ok {
			t.Errorf("a session issued before the sign-out at the cap is accepted")
		}
	}
	after, _, _ := u.issue() // within the same second
	if _, _, ok := u.check(after); !ok {
		t.Error("a session issued after the sign-out at the cap is refused")
	}
}

func TestUIAuthOff(t *testing.T) {
	t.Parallel()
	c := startUI(t, uiGate("", false), false)
	resp, body := c.do("GET", uiSessionPath, "", nil)
	var got uiSessionResponse
	if resp.StatusCode != http.StatusOK || json.Unmarshal([]byte(body), &got) != nil || got.Auth {
		t.Errorf("the session with auth off: %d %s, want 200 {auth: false}", resp.StatusCode, body)
	}
	if resp, body := c.do("POST", deltagymv1connect.EnvServiceListEnvsProcedure, "{}", jsonHdr); body != "reached" {
		t.Errorf("a call with auth off: %d %s", resp.StatusCode, body)
	}
}
