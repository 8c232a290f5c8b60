package server

import (
	"bytes"
	"crypto/rand"
	"crypto/sha256"
	"crypto/subtle"
	"encoding/base64"
	"errors"
	"fmt"
	"io/fs"
	"net"
	"net/http"
	"os"
	"os/user"
	"path"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"

	"connectrpc.com/connect"

	"github.com/deltagym/deltagym/server/swerex"
)

// TokenFile is the name of the file in the data directory that holds the server's bearer token
// when none is given (Config.AuthToken).
const TokenFile = "token"

// tokenPathPrefix starts the path of a request that carries the token in its URL, for clients
// that cannot set headers: /t/<token>/deltagym.v1.EnvService/Reset.
const tokenPathPrefix = "/t/"

// publicPaths are served without a token when Config.PublicHealth is set: health, reflection
// and metrics, which tell nothing of the sandboxes (and OpenEnv's /openenv/{env}/health, isPublic).
var publicPaths = []string{
	"/grpc.health.v1.Health/",
	"/grpc.reflection.v1.ServerReflection/",
	"/grpc.reflection.v1alpha.ServerReflection/",
	"/metrics",
}

// gate admits a request when it carries the server's token, in an "Authorization: Bearer"
// header, in an X-API-Key header for SWE-ReX's paths (swerex.Prefix), or as the URL prefix
// /t/<token>/, which it strips (with auth off too, so that a client configured with a token
// keeps working); or, for the web view's calls alone, the web view's session cookie and its
// CSRF token (uisession.go). The web view's page and session endpoint (isUIPath) need no
// token: the page holds no data, and the endpoint checks the token itself. It runs before any handler, so a
// refused request's body is never read or decoded. Tokens are compared by their SHA-256 sums
// in constant time, so that neither their contents nor their lengths leak through timing.
type gate struct {
	want   [sha256.Size]byte // sum of the token; zero when auth is off
	on     bool
	public bool // publicPaths need no token
	errw   *connect.ErrorWriter
	refuse func(reason string)
	ui     *uiSessions // the web view's sessions; nil when auth is off
	next   http.Handler
}

func (g *gate) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	if rest, ok := strings.CutPrefix(r.URL.Path, tokenPathPrefix); ok {
		tok, rest, _ := strings.Cut(rest, "/")
		if g.on && !g.match(tok) {
			// The path holds a token: it is neither logged nor echoed.
			g.deny(w, r, "wrong token in the URL")
			return
		}
		stripURLToken(r, "/"+rest)
		g.next.ServeHTTP(w, r)
		return
	}
	if !g.on || g.public && isPublic(r.URL.Path) || isUIPath(r.URL.Path) {
		g.next.ServeHTTP(w, r)
		return
	}
	if key := r.Header.Get("X-API-Key"); key != "" && swerex.Owns(r.URL.Path) {
		// SWE-ReX's client sends its auth_token there.
		if !g.match(key) {
			g.deny(w, r, "wrong token")
			return
		}
		g.next.ServeHTTP(w, r)
		return
	}
	authz := r.Header.Get("Authorization")
	if authz == "" && g.ui != nil && hasCookie(r, uiSessionCookie) {
		g.serveCookie(w, r)
		return
	}
	scheme, got, ok := strings.Cut(authz, " ")
	switch {
	case !ok || !strings.EqualFold(scheme, "Bearer"): // the scheme's case does not matter (RFC 9110)
		g.deny(w, r, "no token")
	case !g.match(strings.TrimLeft(got, " ")):
		g.deny(w, r, "wrong token")
	default:
		g.next.ServeHTTP(w, r)
	}
}

func (g *gate) match(tok string) bool {
	sum := sha256.Sum256([]byte(tok))
	return subtle.ConstantTimeCompare(sum[:], g.want[:]) == 1
}

// stripURLToken rewrites r to path, leaving no trace of the token in the request that
// handlers, interceptors and logs see.
func stripURLToken(r *http.Request, p string) {
	r.URL.Path, r.URL.RawPath = p, ""
	r.RequestURI = r.URL.RequestURI()
}

// unauthenticatedHint is what a refused client is told: where the token is, not what it is.
var unauthenticatedHint = fmt.Sprintf("missing or wrong bearer token: send \"Authorization: Bearer <token>\"; without --token the server keeps its token in the file %q of its data directory (--data), readable by the user that runs it",
	TokenFile)

func (g *gate) deny(w http.ResponseWriter, r *http.Request, reason string) {
	g.denyWith(w, r, reason, connect.CodeUnauthenticated, errors.New(unauthenticatedHint))
}

// hasCookie reports whether r carries a cookie of that name.
func hasCookie(r *http.Request, name string) bool {
	_, err := r.Cookie(name)
	return err == nil
}

// denyWith refuses r with code and err (Unauthenticated: HTTP 401, PermissionDenied: 403).
func (g *gate) denyWith(w http.ResponseWriter, r *http.Request, reason string, code connect.Code, err error) {
	// The connection is closed after the answer (HTTP/1: Connection: close; HTTP/2: the server
	// sends GOAWAY for it), so that a client without the token cannot keep descriptors of the
	// server's open.
	w.Header().Set("Connection", "close")
	if g.refuse != nil {
		g.refuse(reason)
	}
	p := r.URL.Path
	if rest, ok := strings.CutPrefix(p, tokenPathPrefix); ok {
		_, rest, _ = strings.Cut(rest, "/")
		p = "/" + rest
	}
	if swerex.Owns(p) {
		// In SWE-ReX's error form, which its client raises as PermissionError.
		swerex.WriteException(w, swerex.Unauthenticated, swerexHint, map[string]any{"code": "unauthenticated"})
		return
	}
	if g.errw.IsSupported(r) {
		_ = g.errw.Write(w, r, connect.NewError(code, err))
		return
	}
	status := http.StatusUnauthorized
	if code == connect.CodePermissionDenied {
		status = http.StatusForbidden
	} else {
		w.Header().Set("WWW-Authenticate", "Bearer")
	}
	http.Error(w, code.String()+": "+err.Error(), status)
}

// swerexHint is what a refused SWE-ReX client is told.
var swerexHint = fmt.Sprintf("missing or wrong token: give RemoteRuntime the server's token as auth_token (sent as X-API-Key), or put it "+
	"in the host's path (http://HOST:PORT/t/<token>/swerex/<sandbox_id>); without --token the server keeps its token in the file %q of its "+
	"data directory (--data), readable by the user that runs it", TokenFile)

func isPublic(p string) bool {
	if path.Clean(p) != p {
		return false // the mux would redirect it elsewhere
	}
	for _, pub := range publicPaths {
		if strings.HasPrefix(p, pub) || p == strings.TrimSuffix(pub, "/") {
			return true
		}
	}
	// An OpenEnv env's health, which AutoEnv probes without headers: /openenv/{env}/health.
	env, ok := strings.CutPrefix(p, "/openenv/")
	return ok && strings.Count(env, "/") == 1 && strings.HasSuffix(env, "/health") && !strings.HasPrefix(env, "/")
}

// isLoopback reports whether addr (host:port) listens on loopback only.
func isLoopback(addr string) bool {
	host, _, err := net.SplitHostPort(addr)
	if err != nil {
		return false
	}
	if host == "localhost" {
		return true
	}
	ip := net.ParseIP(host)
	return ip != nil && ip.IsLoopback()
}

// listensOnLoopback reports whether ln accepts connections from this machine only: a TCP
// listener on a loopback address, or a unix socket.
func listensOnLoopback(ln net.Listener) bool {
	switch a := ln.Addr().(type) {
	case *net.TCPAddr:
		return a.IP.IsLoopback()
	case *net.UnixAddr:
		return true
	}
	return false
}

// tokenBytes is the entropy of a generated token.
const tokenBytes = 32

// loadOrCreateToken returns the token kept in path, and why it made a new one ("" when it kept
// the file's). The file is kept when it is a regular file of this user, readable by nobody else
// or by group gid only (mode 0640 when gid >= 0, else 0600): a file only the owner could read is
// opened to the group (chown, chmod) with its token unchanged. Anything else (missing,
// malformed, a symlink, another owner, readable by others, or by a group that is no longer the
// one asked for) is replaced by a new random token: a token that others could have read is not
// a secret any more. A new file is written under a temporary name and renamed into place.
func loadOrCreateToken(path string, gid int) (tok, why string, err error) {
	tok, why = readOwnToken(path, gid)
	if why == "" {
		return tok, "", nil
	}
	raw := make([]byte, tokenBytes)
	if _, err := rand.Read(raw); err != nil {
		return "", "", fmt.Errorf("generating a token: %w", err)
	}
	tok = base64.RawURLEncoding.EncodeToString(raw)
	if err := writeToken(path, tok, gid); err != nil {
		return "", "", err
	}
	return tok, why, nil
}

func writeToken(path, tok string, gid int) error {
	mode := fs.FileMode(0o600)
	if gid >= 0 {
		mode = 0o640
	}
	tmp, err := os.CreateTemp(filepath.Dir(path), ".token-*")
	if err != nil {
		return fmt.Errorf("writing the token file: %w", err)
	}
	defer os.Remove(tmp.Name())
	err = tmp.Chmod(mode)
	if err == nil && gid >= 0 {
		err = tmp.Chown(-1, gid)
	}
	if err == nil {
		_, err = tmp.WriteString(tok + "\n")
	}
	if err == nil {
		err = tmp.Sync()
	}
	if cerr := tmp.Close(); err == nil {
		err = cerr
	}
	if err == nil {
		err = os.Rename(tmp.Name(), path)
	}
	if err != nil {
		return fmt.Errorf("writing the token file: %w", err)
	}
	return nil
}

// readOwnToken returns the token of the file at path if it may be kept (see
// loadOrCreateToken), else why not.
func readOwnToken(path string, gid int) (string, string) {
	f, err := os.OpenFile(path, os.O_RDONLY|syscall.O_NOFOLLOW|syscall.O_NONBLOCK, 0)
	switch {
	case errors.Is(err, fs.ErrNotExist):
		return "", "there was none"
	case err != nil:
		return "", "the old one could not be opened as a file (" + err.Error() + ")"
	}
	defer f.Close()
	st, err := f.Stat()
	if err != nil || !st.Mode().IsRegular() {
		return "", "the old one is not a regular file"
	}
	sys, ok := st.Sys().(*syscall.Stat_t)
	if !ok {
		return "", "the old one belongs to another user"
	}
	if why := tokenFileRefused(st.Mode().Perm(), sys, gid); why != "" {
		return "", why
	}
	b := make([]byte, 256)
	n, _ := f.Read(b)
	tok := string(bytes.TrimSpace(b[:n]))
	if len(tok) < 16 || strings.ContainsAny(tok, " \t\r\n/") {
		return "", "the old one does not hold a token"
	}
	if why := restrictTokenFile(f, st.Mode().Perm(), int(sys.Gid), gid); why != "" {
		return "", why
	}
	return tok, ""
}

// tokenFileRefused says why a token file of mode perm and owner sys may not be kept for token
// group gid (-1: none), "" if it may.
func tokenFileRefused(perm fs.FileMode, sys *syscall.Stat_t, gid int) string {
	switch {
	case int(sys.Uid) != os.Geteuid():
		return "the old one belongs to another user"
	case perm&0o037 != 0 || perm&0o400 == 0:
		return fmt.Sprintf("the old one had mode %04o: others may have read it", perm)
	case perm&0o040 != 0 && (gid < 0 || int(sys.Gid) != gid):
		return fmt.Sprintf("the old one was readable by group %d, which is no longer the token group", sys.Gid)
	}
	return ""
}

// restrictTokenFile gives a kept token file of mode perm and group fileGid the mode and group
// it should have: 0640 and group gid with a token group, else 0600. It says why it could not,
// "" if it could.
func restrictTokenFile(f *os.File, perm fs.FileMode, fileGid, gid int) string {
	if gid >= 0 && (perm != 0o640 || fileGid != gid) {
		// Owner-only so far: open it to the token group, token unchanged.
		if err := f.Chown(-1, gid); err != nil {
			return "the old one could not be given to the token group (" + err.Error() + ")"
		}
		if err := f.Chmod(0o640); err != nil {
			return "the old one could not be opened to the token group (" + err.Error() + ")"
		}
	}
	if gid < 0 && perm != 0o600 {
		if err := f.Chmod(0o600); err != nil {
			return "the old one could not be made owner-only (" + err.Error() + ")"
		}
	}
	return ""
}

// lookupGroup resolves --token-group: a group name or a numeric gid.
func lookupGroup(name string) (int, error) {
	if gid, err := strconv.Atoi(name); err == nil && gid >= 0 {
		return gid, nil
	}
	g, err := user.LookupGroup(name)
	if err != nil {
		return -1, fmt.Errorf("--token-group %q: %w", name, err)
	}
	gid, err := strconv.Atoi(g.Gid)
	if err != nil {
		return -1, fmt.Errorf("--token-group %q: gid %q: %w", name, g.Gid, err)
	}
	return gid, nil
}

// checkDataDir makes the data directory if it is missing and refuses one that another user
// could change: it holds the token, the import root and the sandboxes' layers, written and
// read by name, so its owner must be the server's user and nobody else may write to it.
func checkDataDir(dir string) error {
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return fmt.Errorf("creating the data directory: %w", err)
	}
	st, err := os.Stat(dir)
	if err != nil {
		return fmt.Errorf("reading the data directory: %w", err)
	}
	sys, _ := st.Sys().(*syscall.Stat_t)
	switch {
	case !st.IsDir():
		return fmt.Errorf("data directory %s is not a directory", dir)
	case sys == nil || int(sys.Uid) != os.Geteuid():
		return fmt.Errorf("data directory %s belongs to uid %d, not to the server's user (uid %d): whoever owns it could plant "+
			"links to host files there; use a directory of the server's user", dir, sys.Uid, os.Geteuid())
	case st.Mode().Perm()&0o022 != 0:
		return fmt.Errorf("data directory %s is writable by others (mode %04o): whoever can write there could plant links to "+
			"host files; chmod go-w it", dir, st.Mode().Perm())
	}
	return nil
}

// setupAuth settles the server's token: the configured one, or the one in the data directory's
// token file (made when missing). It logs where the token is, never the token.
func (s *Server) setupAuth() error {
	switch {
	case s.cfg.NoAuth:
		s.log.Warn("auth is off (--no-auth): every local user can drive this server's sandboxes", "addr", s.cfg.Addr)
		return nil
	case s.cfg.AuthToken != "":
		s.token = s.cfg.AuthToken
		s.log.Info("auth: clients must send the bearer token given to the server")
		return nil
	}
	gid := -1
	if s.cfg.TokenGroup != "" {
		var err error
		if gid, err = lookupGroup(s.cfg.TokenGroup); err != nil {
			return err
		}
	}
	path := filepath.Join(s.cfg.DataDir, TokenFile)
	tok, why, err := loadOrCreateToken(path, gid)
	if err != nil {
		return err
	}
	s.token = tok
	if why != "" {
		s.log.Info("auth: a new bearer token is in the token file; clients read it from there", "file", path, "why", why)
	} else {
		s.log.Info("auth: clients must send the bearer token in the token file", "file", path)
	}
	return nil
}

// Token returns the bearer token clients must send ("" with auth off).
func (s *Server) Token() string { return s.token }

// TokenPath returns the file that holds the server's generated token ("" when the token was
// given or auth is off).
func (s *Server) TokenPath() string {
	if s.cfg.NoAuth || s.cfg.AuthToken != "" {
		return ""
	}
	return filepath.Join(s.cfg.DataDir, TokenFile)
}

// errNoAuthExposed refuses --no-auth on an address others can reach.
var errNoAuthExposed = errors.New("--no-auth is allowed only on a loopback address (127.0.0.1:PORT, [::1]:PORT or localhost:PORT)")
