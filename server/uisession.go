package server

import (
	"crypto/hmac"
	"crypto/rand"
	"crypto/sha256"
	"crypto/subtle"
	"encoding/base64"
	"encoding/binary"
	"encoding/json"
	"errors"
	"mime"
	"net/http"
	"path"
	"strings"
	"sync"
	"time"

	"connectrpc.com/connect"

	"github.com/deltagym/deltagym/clients/go/gen/deltagym/v1/deltagymv1connect"
	"github.com/deltagym/deltagym/server/webui"
)

// The web view's sessions. The page (package webui, at /ui/) signs in at uiSessionPath with
// the server's token and gets a session cookie and a CSRF token; the gate then admits the
// page's calls by the cookie, and only those:
//
//   - the cookie is accepted on the Connect unary JSON calls the page makes (uiCalls), and on
//     nothing else: not gRPC, not Connect's binary or streaming protocols, not SWE-ReX or
//     OpenEnv, not /metrics;
//   - such a call must carry the session's CSRF token in the X-CSRF-Token header, or it is
//     refused with PermissionDenied (403): a page of another site can make the browser send
//     the cookie (were it not SameSite=Strict) but cannot read the token;
//   - the cookie's value holds no token: it is an expiry and a random nonce with an HMAC
//     keyed by a key derived from the token, so the server keeps no state of live sessions,
//     and a new token (a restart with another) ends every session. The CSRF token is another
//     HMAC of the same value;
//   - sign-out ends the session on the server, not only in the browser: the session's nonce is
//     refused until the session's expiry (uiSessions.revoked), so a copy of the cookie and its
//     CSRF token stops working too. The set is bounded: expired entries are dropped, and at
//     uiMaxRevoked a sign-out ends every session signed in until then (uiSessions.minExpiry),
//     the set's entries with them. Revocations live in the server's memory: a restart with the
//     same token forgets them, as it keeps the sessions (a restart with a new one ends all).
//
// A bearer token is still accepted everywhere, cookie or not.

// uiSessionPath is where the page signs in (POST), asks for its session (GET) and signs out
// (DELETE).
const uiSessionPath = webui.Prefix + "session"

// uiSessionCookie names the session cookie.
const uiSessionCookie = "deltagym_session"

// uiCSRFHeader carries the session's CSRF token on the page's calls.
const uiCSRFHeader = "X-CSRF-Token"

// uiSessionTTL is how long a session lasts.
const uiSessionTTL = 12 * time.Hour

// uiCalls are the procedures the page calls, the only ones a session cookie opens.
var uiCalls = map[string]bool{
	deltagymv1connect.EnvServiceListEnvsProcedure:              true,
	deltagymv1connect.EnvServiceListSandboxesProcedure:         true,
	deltagymv1connect.EnvServiceDiffCheckpointsProcedure:       true,
	deltagymv1connect.EnvServiceForkProcedure:                  true,
	deltagymv1connect.LedgerServiceListEpisodesProcedure:       true,
	deltagymv1connect.LedgerServiceGetTrajectoryProcedure:      true,
	deltagymv1connect.LedgerServiceGetCheckpointTreeProcedure:  true,
	deltagymv1connect.LedgerServiceGetGroupAdvantagesProcedure: true,
}

// uiSessionBytes is the length of a session's value before its MAC: a version byte, the
// expiry (Unix seconds, big-endian) and a 16-byte nonce.
const uiSessionBytes = 1 + 8 + 16

// uiMaxRevoked bounds the sessions signed out before their expiry that the server remembers.
const uiMaxRevoked = 4096

// uiNonce is a session's nonce, the key of its revocation.
type uiNonce [uiSessionBytes - 9]byte

// uiSessions issues and checks the web view's sessions under one server token.
type uiSessions struct {
	key [sha256.Size]byte // HMAC key, derived from the token
	now func() time.Time

	mu sync.Mutex
	// revoked holds the nonces of sessions signed out, each until its session's expiry.
	// +checklocks:mu
	revoked map[uiNonce]time.Time
	// minExpiry refuses every session that expires at or before it: those signed in before the
	// sign-out that found revoked full.
	// +checklocks:mu
	minExpiry time.Time
}

func newUISessions(token string) *uiSessions {
	m := hmac.New(sha256.New, []byte(token))
	m.Write([]byte("deltagym web view sessions v1"))
	u := &uiSessions{now: time.Now, revoked: map[uiNonce]time.Time{}}
	copy(u.key[:], m.Sum(nil))
	return u
}

// revoke ends session v, which expires at exp, before its expiry. At uiMaxRevoked sessions
// signed out and not yet expired, it ends every session issued until now instead, and forgets
// them all.
func (u *uiSessions) revoke(v []byte, exp time.Time) {
	var n uiNonce
	copy(n[:], v[9:])
	now := u.now()
	u.mu.Lock()
	defer u.mu.Unlock()
	if len(u.revoked) >= uiMaxRevoked {
		for k, e := range u.revoked {
			if !now.Before(e) {
				delete(u.revoked, k)
			}
		}
	}
	if len(u.revoked) < uiMaxRevoked {
		u.revoked[n] = exp
		return
	}
	// Every session issued so far expires by the expiry one issued now would have; issue gives
	// later ones a later expiry.
	u.minExpiry = latest(u.minExpiry, now.Add(uiSessionTTL).Truncate(time.Second), exp)
	clear(u.revoked)
}

// ended reports whether session v, which expires at exp, was signed out.
func (u *uiSessions) ended(v []byte, exp time.Time) bool {
	var n uiNonce
	copy(n[:], v[9:])
	u.mu.Lock()
	defer u.mu.Unlock()
	_, revoked := u.revoked[n]
	return revoked || !exp.After(u.minExpiry)
}

// latest is the latest of ts.
func latest(ts ...time.Time) time.Time {
	var m time.Time
	for _, t := range ts {
		if t.After(m) {
			m = t
		}
	}
	return m
}

func (u *uiSessions) mac(label string, value []byte) []byte {
	m := hmac.New(sha256.New, u.key[:])
	m.Write([]byte(label))
	m.Write(value)
	return m.Sum(nil)
}

// issue makes a new session: the cookie's value, its CSRF token and its expiry.
func (u *uiSessions) issue() (cookie, csrf string, expires time.Time) {
	expires = u.now().Add(uiSessionTTL).Truncate(time.Second)
	u.mu.Lock()
	if !expires.After(u.minExpiry) { // signed in within the second of a sign-out that ended all
		expires = u.minExpiry.Add(time.Second)
	}
	u.mu.Unlock()
	v := make([]byte, uiSessionBytes)
	v[0] = 1
	binary.BigEndian.PutUint64(v[1:9], uint64(expires.Unix()))
	_, _ = rand.Read(v[9:]) // crypto/rand.Read does not fail
	enc := base64.RawURLEncoding
	return enc.EncodeToString(v) + "." + enc.EncodeToString(u.mac("session\x00", v)), u.csrf(v), expires
}

func (u *uiSessions) csrf(v []byte) string {
	return base64.RawURLEncoding.EncodeToString(u.mac("csrf\x00", v))
}

// check returns the session value of a cookie that this server issued, that has not expired
// and that was not signed out.
func (u *uiSessions) check(cookie string) ([]byte, time.Time, bool) {
	a, b, ok := strings.Cut(cookie, ".")
	if !ok {
		return nil, time.Time{}, false
	}
	v, err := base64.RawURLEncoding.DecodeString(a)
	if err != nil || len(v) != uiSessionBytes || v[0] != 1 {
		return nil, time.Time{}, false
	}
	sig, err := base64.RawURLEncoding.DecodeString(b)
	if err != nil || !hmac.Equal(sig, u.mac("session\x00", v)) {
		return nil, time.Time{}, false
	}
	exp := time.Unix(int64(binary.BigEndian.Uint64(v[1:9])), 0)
	if !u.now().Before(exp) || u.ended(v, exp) {
		return nil, time.Time{}, false
	}
	return v, exp, true
}

// fromRequest returns the session of r's cookie, if it holds a live one.
func (u *uiSessions) fromRequest(r *http.Request) ([]byte, time.Time, bool) {
	c, err := r.Cookie(uiSessionCookie)
	if err != nil {
		return nil, time.Time{}, false
	}
	return u.check(c.Value)
}

// isUIPath reports whether p is the web view's: its page, its assets and its session
// endpoint, which the gate lets through (the page holds no data; the session endpoint checks
// the token itself).
func isUIPath(p string) bool {
	if path.Clean(p) != p && p != webui.Prefix {
		return false // the mux would redirect it elsewhere
	}
	return p == strings.TrimSuffix(webui.Prefix, "/") || strings.HasPrefix(p, webui.Prefix)
}

// isConnectJSONUnary reports whether r is a Connect unary call with a JSON body: the only
// protocol the page speaks, and the only one a session cookie is accepted on.
func isConnectJSONUnary(r *http.Request) bool {
	if r.Method != http.MethodPost {
		return false
	}
	mt, _, err := mime.ParseMediaType(r.Header.Get("Content-Type"))
	return err == nil && mt == "application/json"
}

// errCookieElsewhere is what a cookie-authenticated request to anything but the page's calls
// is told.
var errCookieElsewhere = errors.New("the web view's session cookie is accepted only on the web view's Connect JSON calls; " +
	"other clients send \"Authorization: Bearer <token>\"")

// errStaleSession is what a call with a session cookie that is no longer good is told.
var errStaleSession = errors.New("the web view's session has ended (it expired, it was signed out, or the server's token changed): sign in again")

// errNoCSRF is what a cookie-authenticated call without the session's CSRF token is told.
var errNoCSRF = errors.New("a call authenticated by the web view's session cookie must carry the session's CSRF token in the " +
	uiCSRFHeader + " header (the web view gets it at sign-in); other clients send \"Authorization: Bearer <token>\"")

// serveCookie admits a request that carries a session cookie and no other credential, if it
// is one of the page's calls with the session's CSRF token.
func (g *gate) serveCookie(w http.ResponseWriter, r *http.Request) {
	v, _, ok := g.ui.fromRequest(r)
	page := uiCalls[r.URL.Path] && isConnectJSONUnary(r)
	switch {
	case !ok && page:
		g.denyWith(w, r, "stale session", connect.CodeUnauthenticated, errStaleSession)
	case !ok:
		g.deny(w, r, "no token")
	case !page:
		g.denyWith(w, r, "cookie elsewhere", connect.CodeUnauthenticated, errCookieElsewhere)
	case subtle.ConstantTimeCompare([]byte(r.Header.Get(uiCSRFHeader)), []byte(g.ui.csrf(v))) != 1:
		g.denyWith(w, r, "no csrf token", connect.CodePermissionDenied, errNoCSRF)
	default:
		g.next.ServeHTTP(w, r)
	}
}

// uiSessionResponse is the session endpoint's answer.
type uiSessionResponse struct {
	// Auth is false when the server runs without a token: the page needs no sign-in.
	Auth bool `json:"auth"`
	// CSRF is the session's CSRF token, sent back in the X-CSRF-Token header.
	CSRF string `json:"csrf,omitempty"`
	// Expires is when the session ends.
	Expires *time.Time `json:"expires,omitempty"`
	// Error says why the endpoint refused.
	Error string `json:"error,omitempty"`
}

// uiSignInMaxBytes caps a sign-in's body.
const uiSignInMaxBytes = 4 << 10

// uiSessionHandler serves uiSessionPath: POST {"token": "..."} signs in (a cookie and the
// CSRF token), GET says whether the cookie holds a live session (and its CSRF token), DELETE
// signs out (ends the cookie's session on the server and clears the cookie). With auth off,
// every method answers {"auth": false}.
type uiSessionHandler struct {
	g *gate
}

func (h *uiSessionHandler) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	hdr := w.Header()
	hdr.Set("Cache-Control", "no-store")
	hdr.Set("X-Content-Type-Options", "nosniff")
	if !h.g.on {
		writeJSON(w, http.StatusOK, uiSessionResponse{})
		return
	}
	u := h.g.ui
	switch r.Method {
	case http.MethodGet, http.MethodHead:
		v, exp, ok := u.fromRequest(r)
		if !ok {
			writeJSON(w, http.StatusUnauthorized, uiSessionResponse{Auth: true, Error: "not signed in"})
			return
		}
		writeJSON(w, http.StatusOK, uiSessionResponse{Auth: true, CSRF: u.csrf(v), Expires: &exp})
	case http.MethodPost:
		h.signIn(w, r)
	case http.MethodDelete:
		if v, exp, ok := u.fromRequest(r); ok {
			u.revoke(v, exp)
		}
		http.SetCookie(w, &http.Cookie{Name: uiSessionCookie, Value: "", Path: "/", MaxAge: -1, HttpOnly: true,
			Secure: r.TLS != nil, SameSite: http.SameSiteStrictMode})
		writeJSON(w, http.StatusOK, uiSessionResponse{Auth: true})
	default:
		hdr.Set("Allow", "GET, HEAD, POST, DELETE")
		writeJSON(w, http.StatusMethodNotAllowed, uiSessionResponse{Auth: true, Error: "the session endpoint answers GET, POST and DELETE"})
	}
}

func (h *uiSessionHandler) signIn(w http.ResponseWriter, r *http.Request) {
	// A JSON body cannot be sent across origins without a CORS preflight, which this server
	// never grants: another site cannot sign a browser in.
	if mt, _, err := mime.ParseMediaType(r.Header.Get("Content-Type")); err != nil || mt != "application/json" {
		writeJSON(w, http.StatusUnsupportedMediaType, uiSessionResponse{Auth: true, Error: "sign in with a JSON body: {\"token\": \"...\"}"})
		return
	}
	var req struct {
		Token string `json:"token"`
	}
	if err := json.NewDecoder(http.MaxBytesReader(w, r.Body, uiSignInMaxBytes)).Decode(&req); err != nil {
		writeJSON(w, http.StatusBadRequest, uiSessionResponse{Auth: true, Error: "sign in with a JSON body: {\"token\": \"...\"}"})
		return
	}
	if !h.g.match(req.Token) {
		w.Header().Set("Connection", "close")
		if h.g.refuse != nil {
			h.g.refuse("wrong token at sign-in")
		}
		writeJSON(w, http.StatusUnauthorized, uiSessionResponse{Auth: true, Error: "wrong token: " + unauthenticatedHintShort})
		return
	}
	cookie, csrf, exp := h.g.ui.issue()
	http.SetCookie(w, &http.Cookie{Name: uiSessionCookie, Value: cookie, Path: "/", Expires: exp, MaxAge: int(uiSessionTTL / time.Second),
		HttpOnly: true, Secure: r.TLS != nil, SameSite: http.SameSiteStrictMode})
	writeJSON(w, http.StatusOK, uiSessionResponse{Auth: true, CSRF: csrf, Expires: &exp})
}

// unauthenticatedHintShort tells a person where the token is.
var unauthenticatedHintShort = "the server's token is the one given with --token, or else the one in the file \"" + TokenFile +
	"\" of its data directory (--data)"

func writeJSON(w http.ResponseWriter, status int, v any) {
	b, err := json.Marshal(v)
	if err != nil {
		http.Error(w, err.Error(), http.StatusInternalServerError)
		return
	}
	w.Header().Set("Content-Type", "application/json")
	w.WriteHeader(status)
	_, _ = w.Write(append(b, '\n'))
}
