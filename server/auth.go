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
)

// TokenFile is the name of the file in the data directory that holds the server's bearer token
// when none is given (Config.AuthToken).
const TokenFile = "token"

// tokenPathPrefix starts the path of a request that carries the token in its URL, for clients
// that cannot set headers: /t/<token>/deltagym.v1.EnvService/Reset.
const tokenPathPrefix = "/t/"

// publicPaths are served without a token when Config.PublicHealth is set: health, reflection
// and metrics, which tell nothing of the sandboxes.
var publicPaths = []string{
	"/grpc.health.v1.Health/",
	"/grpc.reflection.v1.ServerReflection/",
	"/grpc.reflection.v1alpha.ServerReflection/",
	"/metrics",
}

// gate admits a request when it carries the server's token, in an "Authorization: Bearer"
// header or as the URL prefix /t/<token>/, which it strips (with auth off too, so that a client
// configured with a token keeps working). It runs before any handler, so a
// refused request's body is never read or decoded. Tokens are compared by their SHA-256 sums
// in constant time, so that neither their contents nor their lengths leak through timing.
type gate struct {
	want   [sha256.Size]byte // sum of the token; zero when auth is off
	on     bool
	public bool // publicPaths need no token
	errw   *connect.ErrorWriter
	refuse func(reason string)
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
	if !g.on || g.public && isPublic(r.URL.Path) {
		g.next.ServeHTTP(w, r)
		return
	}
	got, ok := strings.CutPrefix(r.Header.Get("Authorization"), "Bearer ")
	switch {
	case !ok:
		g.deny(w, r, "no token")
	case !g.match(got):
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

// errUnauthenticatedHint is what a refused client is told: where the token is, not what it is.
var errUnauthenticatedHint = fmt.Errorf("%w: send \"Authorization: Bearer <token>\"; without --token the server keeps its token in the file %q of its data directory (--data), readable by the user that runs it",
	ErrUnauthenticated, TokenFile)

func (g *gate) deny(w http.ResponseWriter, r *http.Request, reason string) {
	if g.refuse != nil {
		g.refuse(reason)
	}
	if g.errw.IsSupported(r) {
		_ = g.errw.Write(w, r, connect.NewError(connect.CodeUnauthenticated, errUnauthenticatedHint))
		return
	}
	w.Header().Set("WWW-Authenticate", "Bearer")
	http.Error(w, "unauthenticated: "+errUnauthenticatedHint.Error(), http.StatusUnauthorized)
}

func isPublic(p string) bool {
	if path.Clean(p) != p {
		return false // the mux would redirect it elsewhere
	}
	for _, pub := range publicPaths {
		if strings.HasPrefix(p, pub) || p == strings.TrimSuffix(pub, "/") {
			return true
		}
	}
	return false
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

// tokenBytes is the entropy of a generated token.
const tokenBytes = 32

// loadOrCreateToken returns the token kept in path, and whether it made a new one. A file that
// is missing, malformed, not a regular file, not owned by this user, or readable by more than
// the owner (and gid, when gid >= 0) is replaced by a new random token: a token that others
// could have read is not a secret any more. The file is written to a temporary name and renamed
// into place, mode 0600 (0640 with group gid).
func loadOrCreateToken(path string, gid int) (string, bool, error) {
	mode := fs.FileMode(0o600)
	if gid >= 0 {
		mode = 0o640
	}
	if tok, ok := readOwnToken(path, mode, gid); ok {
		return tok, false, nil
	}
	raw := make([]byte, tokenBytes)
	if _, err := rand.Read(raw); err != nil {
		return "", false, fmt.Errorf("generating a token: %w", err)
	}
	tok := base64.RawURLEncoding.EncodeToString(raw)
	tmp, err := os.CreateTemp(filepath.Dir(path), ".token-*")
	if err != nil {
		return "", false, fmt.Errorf("writing the token file: %w", err)
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
		return "", false, fmt.Errorf("writing the token file: %w", err)
	}
	return tok, true, nil
}

func readOwnToken(path string, mode fs.FileMode, gid int) (string, bool) {
	f, err := os.OpenFile(path, os.O_RDONLY|syscall.O_NOFOLLOW, 0)
	if err != nil {
		return "", false
	}
	defer f.Close()
	st, err := f.Stat()
	if err != nil || !st.Mode().IsRegular() || st.Mode().Perm() != mode {
		return "", false
	}
	sys, ok := st.Sys().(*syscall.Stat_t)
	if !ok || int(sys.Uid) != os.Geteuid() || gid >= 0 && int(sys.Gid) != gid {
		return "", false
	}
	b := make([]byte, 256)
	n, _ := f.Read(b)
	tok := string(bytes.TrimSpace(b[:n]))
	if len(tok) < 16 || strings.ContainsAny(tok, " \t\r\n/") {
		return "", false
	}
	return tok, true
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
	if err := os.MkdirAll(s.cfg.DataDir, 0o755); err != nil {
		return fmt.Errorf("creating the data directory: %w", err)
	}
	path := filepath.Join(s.cfg.DataDir, TokenFile)
	tok, made, err := loadOrCreateToken(path, gid)
	if err != nil {
		return err
	}
	s.token = tok
	if made {
		s.log.Info("auth: a new bearer token is in the token file; clients read it from there", "file", path)
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
