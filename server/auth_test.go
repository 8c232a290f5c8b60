package server_test

import (
	"bytes"
	"context"
	"errors"
	"io"
	"log/slog"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"regexp"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"connectrpc.com/connect"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/health/grpc_health_v1"
	"google.golang.org/grpc/status"

	deltagymv1 "github.com/deltagym/deltagym/clients/go/gen/deltagym/v1"
	"github.com/deltagym/deltagym/clients/go/gen/deltagym/v1/deltagymv1connect"
	"github.com/deltagym/deltagym/internal/testenv"
	"github.com/deltagym/deltagym/server"
)

// syncBuffer is a log sink tests read while the server writes to it.
type syncBuffer struct {
	mu sync.Mutex
	// +checklocks:mu
	b bytes.Buffer
}

func (s *syncBuffer) Write(p []byte) (int, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.Write(p)
}

func (s *syncBuffer) String() string {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.String()
}

// post sends a Connect JSON request to procedure with the given Authorization header ("" for
// none) and returns the status and body.
func post(t *testing.T, url, auth, body string) (int, string) {
	t.Helper()
	req, err := http.NewRequestWithContext(t.Context(), "POST", url, strings.NewReader(body))
	must(t, err)
	req.Header.Set("Content-Type", "application/json")
	if auth != "" {
		req.Header.Set("Authorization", auth)
	}
	resp, err := http.DefaultClient.Do(req)
	must(t, err)
	defer resp.Body.Close()
	out, _ := io.ReadAll(resp.Body)
	return resp.StatusCode, string(out)
}

// A server started without a token makes one, keeps it in <data>/token (0600), logs where it
// is but never what it is, and refuses every call without it: Connect, gRPC, health,
// reflection and /metrics alike.
func TestAuthGeneratedToken(t *testing.T) {
	var log syncBuffer
	b := setup(t, func(c *server.Config) {
		c.NoLedger = true
		c.Logger = slog.New(slog.NewTextHandler(&log, nil))
	})
	tok := b.srv.Token()
	path := b.srv.TokenPath()
	if tok == "" || path == "" {
		t.Fatalf("token %q in %q: want a generated token in the data directory", tok, path)
	}
	st, err := os.Stat(path)
	must(t, err)
	if st.Mode().Perm() != 0o600 || st.Sys().(*syscall.Stat_t).Uid != uint32(os.Geteuid()) {
		t.Fatalf("token file %s, uid %d; want 0600, ours", st.Mode(), st.Sys().(*syscall.Stat_t).Uid)
	}
	if got, _ := os.ReadFile(path); strings.TrimSpace(string(got)) != tok {
		t.Fatalf("token file holds %q, the server wants %q", got, tok)
	}
	if len(tok) < 40 {
		t.Fatalf("token %q: want 32 random bytes, encoded", tok)
	}

	api := "http://" + b.addr + "/deltagym.v1.EnvService/ListEnvs"
	for _, auth := range []string{"", "Bearer", "Bearer ", "Bearer wrong", "Basic " + tok, "Bearer" + tok, "Bearer " + tok + "x", "Bearer " + tok[:len(tok)-1]} {
		code, body := post(t, api, auth, "{}")
		if code != http.StatusUnauthorized || !strings.Contains(body, `"code":"unauthenticated"`) || !strings.Contains(body, "token") {
			t.Errorf("Authorization %q: %d %s, want 401 unauthenticated saying where the token is", auth, code, body)
		}
		if strings.Contains(body, tok) || strings.Contains(body, b.srv.TokenPath()) {
			t.Errorf("the refusal shows the token or a host path: %s", body)
		}
	}
	for _, auth := range []string{"Bearer " + tok, "bearer " + tok, "BEARER  " + tok} {
		if code, body := post(t, api, auth, "{}"); code != 200 || !strings.Contains(body, `"plain"`) {
			t.Fatalf("with the token (%.8s…): %d %s", auth, code, body)
		}
	}

	// gRPC without a token: health and reflection too.
	conn, err := grpc.NewClient(b.addr, grpc.WithTransportCredentials(insecure.NewCredentials()))
	must(t, err)
	defer conn.Close()
	_, err = deltagymv1.NewEnvServiceClient(conn).ListEnvs(t.Context(), &deltagymv1.ListEnvsRequest{})
	if status.Code(err) != codes.Unauthenticated {
		t.Errorf("gRPC ListEnvs without a token: %v", err)
	}
	_, err = grpc_health_v1.NewHealthClient(conn).Check(t.Context(), &grpc_health_v1.HealthCheckRequest{})
	if status.Code(err) != codes.Unauthenticated {
		t.Errorf("gRPC health without a token: %v", err)
	}
	// With it (the bundle's connection carries it).
	h, err := grpc_health_v1.NewHealthClient(b.conn).Check(t.Context(), &grpc_health_v1.HealthCheckRequest{})
	if err != nil || h.GetStatus() != grpc_health_v1.HealthCheckResponse_SERVING {
		t.Errorf("gRPC health with the token: %v %v", h, err)
	}
	// gRPC-Web.
	web := deltagymv1connect.NewEnvServiceClient(http.DefaultClient, "http://"+b.addr, connect.WithGRPCWeb())
	if _, err := web.ListEnvs(t.Context(), connect.NewRequest(&deltagymv1.ListEnvsRequest{})); connect.CodeOf(err) != connect.CodeUnauthenticated {
		t.Errorf("gRPC-Web without a token: %v", err)
	}

	// /metrics: 401 without the token, served with it, counting the refusals.
	get := func(auth string) (int, string) {
		req, _ := http.NewRequestWithContext(t.Context(), "GET", "http://"+b.addr+"/metrics", nil)
		if auth != "" {
			req.Header.Set("Authorization", auth)
		}
		resp, err := http.DefaultClient.Do(req)
		must(t, err)
		defer resp.Body.Close()
		out, _ := io.ReadAll(resp.Body)
		return resp.StatusCode, string(out)
	}
	if code, _ := get(""); code != http.StatusUnauthorized {
		t.Errorf("/metrics without a token: %d", code)
	}
	code, metrics := get("Bearer " + tok)
	if code != 200 {
		t.Fatalf("/metrics with the token: %d", code)
	}
	for _, re := range []string{
		`deltagym_auth_refused_total\{[^}]*reason="no token"[^}]*\} [1-9]`,
		`deltagym_auth_refused_total\{[^}]*reason="wrong token"[^}]*\} [1-9]`,
		`deltagym_rpc_duration_seconds_count\{code="ok",[^}]*rpc="/deltagym.v1.EnvService/ListEnvs"[^}]*\} 3\n`,
	} {
		if !regexp.MustCompile(re).MatchString(metrics) {
			t.Errorf("metrics lack %s", re)
		}
	}
	if strings.Contains(metrics, `code="unauthenticated"`) {
		t.Errorf("a refused call reached the RPC layer:\n%s", metrics)
	}

	logs := log.String()
	if strings.Contains(logs, tok) {
		t.Fatalf("the log shows the token:\n%s", logs)
	}
	if !strings.Contains(logs, path) {
		t.Fatalf("the log does not say where the token is:\n%s", logs)
	}
}

// The token is checked before a request's body is read or decoded: a refused request with a
// malformed, an oversized or a valid body gets unauthenticated, and does nothing.
func TestAuthBeforeBody(t *testing.T) {
	b := setup(t, func(c *server.Config) { c.NoLedger = true; c.MaxRequestBytes = 1 << 10 })
	base := "http://" + b.addr + "/deltagym.v1.EnvService/"
	for name, body := range map[string]string{
		"malformed":  `{"env":`,
		"oversized":  `{"env":"` + strings.Repeat("x", 4<<10) + `"}`,
		"wrong type": `{"env": 7}`,
		"valid":      `{"env":"plain"}`,
	} {
		code, out := post(t, base+"Reset", "", body)
		if code != http.StatusUnauthorized || !strings.Contains(out, `"code":"unauthenticated"`) {
			t.Errorf("%s body without a token: %d %s, want unauthenticated", name, code, out)
		}
	}
	// The valid Reset leased nothing.
	r, err := b.connect.ListSandboxes(t.Context(), connect.NewRequest(&deltagymv1.ListSandboxesRequest{}))
	must(t, err)
	if n := len(r.Msg.GetSandboxes()); n != 0 {
		t.Fatalf("%d sandboxes leased by refused calls", n)
	}
	// The same bodies with the token are decoded, and refused for what they are.
	for _, tc := range []struct{ body, code string }{
		{`{"env":`, "invalid_argument"},
		{`{"env":"` + strings.Repeat("x", 4<<10) + `"}`, "resource_exhausted"},
	} {
		if code, out := post(t, base+"Reset", "Bearer "+b.token, tc.body); !strings.Contains(out, `"code":"`+tc.code+`"`) {
			t.Errorf("%.20s… with the token: %d %s, want %s", tc.body, code, out, tc.code)
		}
	}
}

// Clients that cannot set headers put the token in the URL: /t/<token>/<procedure>. The token
// never reaches a log line; a wrong one is refused like a wrong header.
func TestAuthURLToken(t *testing.T) {
	var log syncBuffer
	b := setup(t, func(c *server.Config) {
		c.NoLedger = true
		c.Logger = slog.New(slog.NewTextHandler(&log, &slog.HandlerOptions{Level: slog.LevelDebug}))
	})
	tok := b.srv.Token()
	root := "http://" + b.addr
	if code, body := post(t, root+"/t/"+tok+"/deltagym.v1.EnvService/ListEnvs", "", "{}"); code != 200 || !strings.Contains(body, `"plain"`) {
		t.Fatalf("token in the URL: %d %s", code, body)
	}
	// A failing call logs its procedure: still without the token.
	if code, body := post(t, root+"/t/"+tok+"/deltagym.v1.EnvService/GetSandbox", "", `{"sandboxId":"sb-none"}`); code != 404 {
		t.Fatalf("GetSandbox of nothing: %d %s", code, body)
	}
	for _, p := range []string{"/t/wrong/deltagym.v1.EnvService/ListEnvs", "/t/" + tok + "x/deltagym.v1.EnvService/ListEnvs", "/t/", "/t//deltagym.v1.EnvService/ListEnvs"} {
		if code, body := post(t, root+p, "", "{}"); code != http.StatusUnauthorized || strings.Contains(body, tok) {
			t.Errorf("%s: %d %s, want 401 without the token in it", p, code, body)
		}
	}
	// gRPC over the URL form, for a client that can only set its target's path.
	c := deltagymv1connect.NewEnvServiceClient(http.DefaultClient, root+"/t/"+tok)
	if _, err := c.ListEnvs(t.Context(), connect.NewRequest(&deltagymv1.ListEnvsRequest{})); err != nil {
		t.Fatalf("Connect client on the URL form: %v", err)
	}
	if strings.Contains(log.String(), tok) {
		t.Fatalf("the log shows the token:\n%s", log.String())
	}
	if !strings.Contains(log.String(), "GetSandbox") {
		t.Fatalf("the failing call was not logged (the check above proves nothing):\n%s", log.String())
	}
}

// --public-health serves health, reflection and /metrics without a token, and nothing else.
func TestAuthPublicHealth(t *testing.T) {
	b := setup(t, func(c *server.Config) { c.NoLedger = true; c.PublicHealth = true })
	conn, err := grpc.NewClient(b.addr, grpc.WithTransportCredentials(insecure.NewCredentials()))
	must(t, err)
	defer conn.Close()
	if h, err := grpc_health_v1.NewHealthClient(conn).Check(t.Context(), &grpc_health_v1.HealthCheckRequest{}); err != nil || h.GetStatus() != grpc_health_v1.HealthCheckResponse_SERVING {
		t.Fatalf("public health: %v %v", h, err)
	}
	resp, err := http.Get("http://" + b.addr + "/metrics")
	must(t, err)
	resp.Body.Close()
	if resp.StatusCode != 200 {
		t.Fatalf("public /metrics: %d", resp.StatusCode)
	}
	if _, err := deltagymv1.NewEnvServiceClient(conn).ListEnvs(t.Context(), &deltagymv1.ListEnvsRequest{}); status.Code(err) != codes.Unauthenticated {
		t.Fatalf("ListEnvs without a token on a public-health server: %v", err)
	}
	// Prefix tricks do not widen the public set.
	for _, p := range []string{"/metricsx", "/grpc.health.v1.Health/../deltagym.v1.EnvService/ListEnvs", "/metrics/../deltagym.v1.EnvService/ListEnvs"} {
		if code, body := post(t, "http://"+b.addr+p, "", "{}"); code == 200 {
			t.Errorf("%s without a token: %d %s", p, code, body)
		}
	}
}

// The token a server made is kept across restarts (clients keep working); a token file that
// others could read, or that is not a regular file of ours, is replaced; --token-group opens it
// to one group (0640).
func TestAuthTokenFile(t *testing.T) {
	cfg := restartConfig(t)
	cfg.NoLedger, cfg.DatabaseURL = true, ""
	start := func(c server.Config) *server.Server {
		t.Helper()
		ctx, cancel := context.WithTimeout(t.Context(), 2*time.Minute)
		defer cancel()
		srv, err := server.New(ctx, c)
		must(t, err)
		return srv
	}
	stop := func(srv *server.Server) {
		t.Helper()
		must(t, srv.Close(context.Background()))
	}
	srv := start(cfg)
	first, path := srv.Token(), srv.TokenPath()
	stop(srv)
	srv = start(cfg)
	if srv.Token() != first {
		t.Fatalf("token after a restart: %q, want %q", srv.Token(), first)
	}
	stop(srv)

	must(t, os.Chmod(path, 0o644)) // readable by others: no longer a secret
	srv = start(cfg)
	if srv.Token() == first {
		t.Fatal("a world-readable token file was kept")
	}
	second := srv.Token()
	stop(srv)
	if st, err := os.Stat(path); err != nil || st.Mode().Perm() != 0o600 {
		t.Fatalf("replaced token file: %v %v", st.Mode(), err)
	}

	// A symlink planted at the token's name is replaced, not followed.
	target := filepath.Join(t.TempDir(), "target")
	must(t, os.WriteFile(target, []byte(strings.Repeat("a", 43)+"\n"), 0o600))
	must(t, os.Remove(path))
	must(t, os.Symlink(target, path))
	srv = start(cfg)
	if srv.Token() == strings.Repeat("a", 43) || srv.Token() == second {
		t.Fatalf("token through a symlink: %q", srv.Token())
	}
	stop(srv)
	if st, err := os.Lstat(path); err != nil || !st.Mode().IsRegular() {
		t.Fatalf("token path after a symlink was planted: %v %v", st.Mode(), err)
	}
	if got, _ := os.ReadFile(target); string(got) != strings.Repeat("a", 43)+"\n" {
		t.Fatalf("the symlink's target was written: %q", got)
	}

	// --token-group opens the owner-only file to that group (0640), token unchanged; dropping
	// the group again replaces the token, which the group may have read.
	third := srv.Token()
	cfg.TokenGroup = "65534"
	srv = start(cfg)
	if srv.Token() != third {
		t.Fatalf("--token-group replaced the token %q with %q", third, srv.Token())
	}
	stop(srv)
	st, err := os.Stat(path)
	must(t, err)
	if st.Mode().Perm() != 0o640 || st.Sys().(*syscall.Stat_t).Gid != 65534 {
		t.Fatalf("token file with --token-group: %v gid %d", st.Mode(), st.Sys().(*syscall.Stat_t).Gid)
	}
	cfg.TokenGroup = ""
	srv = start(cfg)
	if srv.Token() == third {
		t.Fatal("the token stayed when its group lost access")
	}
	stop(srv)
	if st, err := os.Stat(path); err != nil || st.Mode().Perm() != 0o600 {
		t.Fatalf("token file without a group: %v %v", st.Mode(), err)
	}
	cfg.TokenGroup = "no-such-group-here"
	if _, err := server.New(t.Context(), cfg); err == nil || !strings.Contains(err.Error(), "no-such-group-here") {
		t.Fatalf("an unknown --token-group: %v", err)
	}
}

// --no-auth is refused unless the address is loopback.
func TestNoAuthLoopbackOnly(t *testing.T) {
	for _, tc := range []struct {
		addr string
		ok   bool
	}{
		{"127.0.0.1:8080", true}, {"[::1]:8080", true}, {"localhost:8080", true}, {"127.3.4.5:1", true},
		{":8080", false}, {"0.0.0.0:8080", false}, {"[::]:8080", false}, {"10.0.0.1:8080", false}, {"example.com:80", false},
	} {
		cfg := server.Config{Addr: tc.addr, NoAuth: true, DataDir: t.TempDir()}
		err := cfg.Validate()
		if (err == nil) != tc.ok {
			t.Errorf("--no-auth on %s: %v, want ok=%v", tc.addr, err, tc.ok)
		}
	}
	cfg := server.Config{NoAuth: true, AuthToken: "x", DataDir: t.TempDir()}
	if err := cfg.Validate(); err == nil {
		t.Error("--no-auth with --token was accepted")
	}
}

// Without auth (on loopback) calls need no token, and the server warns.
func TestNoAuth(t *testing.T) {
	var log syncBuffer
	b := setup(t, func(c *server.Config) {
		c.NoLedger, c.NoAuth = true, true
		c.Logger = slog.New(slog.NewTextHandler(&log, nil))
	})
	if code, body := post(t, "http://"+b.addr+"/deltagym.v1.EnvService/ListEnvs", "", "{}"); code != 200 {
		t.Fatalf("no auth: %d %s", code, body)
	}
	if code, body := post(t, "http://"+b.addr+"/t/any/deltagym.v1.EnvService/ListEnvs", "", "{}"); code != 200 {
		t.Fatalf("no auth, a client with a URL token: %d %s", code, body)
	}
	if !strings.Contains(log.String(), "auth is off") || b.srv.TokenPath() != "" {
		t.Fatalf("no warning, or a token file: %q\n%s", b.srv.TokenPath(), log.String())
	}
	if _, err := os.Stat(filepath.Join(b.data, server.TokenFile)); !errors.Is(err, os.ErrNotExist) {
		t.Fatalf("a token file was written with auth off: %v", err)
	}
}

// fakeListener reports a non-loopback address and accepts nothing.
type fakeListener struct {
	addr   net.Addr
	closed chan struct{}
}

func (f *fakeListener) Accept() (net.Conn, error) { <-f.closed; return nil, net.ErrClosed }
func (f *fakeListener) Close() error {
	select {
	case <-f.closed:
	default:
		close(f.closed)
	}
	return nil
}
func (f *fakeListener) Addr() net.Addr { return f.addr }

// Without auth, Serve refuses a listener that is not on loopback, whatever name gave it.
func TestNoAuthServeChecksListener(t *testing.T) {
	b := setup(t, func(c *server.Config) { c.NoLedger, c.NoAuth = true, true })
	ln := &fakeListener{addr: &net.TCPAddr{IP: net.ParseIP("10.0.0.1"), Port: 8080}, closed: make(chan struct{})}
	err := b.srv.Serve(ln)
	if err == nil || !strings.Contains(err.Error(), "loopback") {
		t.Fatalf("Serve on 10.0.0.1 without auth: %v", err)
	}
	select {
	case <-ln.closed:
	default:
		t.Fatal("the refused listener was left open")
	}
}

// A refused request's connection is closed after the answer: a client without the token
// cannot hold the server's descriptors.
func TestAuthClosesRefusedConnections(t *testing.T) {
	b := setup(t, func(c *server.Config) { c.NoLedger = true })
	req, err := http.NewRequestWithContext(t.Context(), "POST", "http://"+b.addr+"/deltagym.v1.EnvService/ListEnvs", strings.NewReader("{}"))
	must(t, err)
	req.Header.Set("Content-Type", "application/json")
	resp, err := http.DefaultClient.Do(req)
	must(t, err)
	io.Copy(io.Discard, resp.Body)
	resp.Body.Close()
	if resp.StatusCode != http.StatusUnauthorized || !resp.Close {
		t.Fatalf("refused HTTP/1.1 request: %d, close %v", resp.StatusCode, resp.Close)
	}
	// HTTP/2: the server sends GOAWAY; the client's next request needs a new connection.
	var protos http.Protocols
	protos.SetUnencryptedHTTP2(true)
	var dials atomic.Int32
	tr := &http.Transport{Protocols: &protos, DialContext: func(ctx context.Context, network, addr string) (net.Conn, error) {
		dials.Add(1)
		return (&net.Dialer{}).DialContext(ctx, network, addr)
	}}
	defer tr.CloseIdleConnections()
	c := deltagymv1connect.NewEnvServiceClient(&http.Client{Transport: tr}, "http://"+b.addr)
	for range 3 {
		if _, err := c.ListEnvs(t.Context(), connect.NewRequest(&deltagymv1.ListEnvsRequest{})); connect.CodeOf(err) != connect.CodeUnauthenticated {
			t.Fatalf("HTTP/2 without a token: %v", err)
		}
	}
	if n := dials.Load(); n != 3 {
		t.Fatalf("3 refused HTTP/2 calls used %d connections, want 3 (each closed)", n)
	}
	ok := deltagymv1connect.NewEnvServiceClient(&http.Client{Transport: tr}, "http://"+b.addr, connect.WithInterceptors(bearer(b.token)))
	dials.Store(0)
	for range 3 {
		_, err := ok.ListEnvs(t.Context(), connect.NewRequest(&deltagymv1.ListEnvsRequest{}))
		must(t, err)
	}
	if n := dials.Load(); n > 1 {
		t.Fatalf("3 served HTTP/2 calls used %d new connections, want at most 1 (kept)", n)
	}
}

// The server refuses a data directory another user owns or may write to.
func TestDataDirOwner(t *testing.T) {
	testenv.Privileged(t, "makes a directory of another user")
	for name, prep := range map[string]func(dir string) error{
		"other owner":    func(dir string) error { return os.Chown(dir, 65534, 65534) },
		"world-writable": func(dir string) error { return os.Chmod(dir, 0o777) },
		"group-writable": func(dir string) error { return os.Chmod(dir, 0o770) },
		"symlink to other": func(dir string) error {
			if err := os.Chown(dir, 65534, 65534); err != nil {
				return err
			}
			return os.Symlink(dir, dir+"-link")
		},
	} {
		t.Run(name, func(t *testing.T) {
			dir := filepath.Join(t.TempDir(), "data")
			must(t, os.Mkdir(dir, 0o755))
			must(t, prep(dir))
			data := dir
			if strings.Contains(name, "symlink") {
				data = dir + "-link"
			}
			_, err := server.New(t.Context(), server.Config{DataDir: data, NoLedger: true, EnvsDir: t.TempDir()})
			if err == nil || !strings.Contains(err.Error(), "data directory") {
				t.Fatalf("a data directory with %s: %v", name, err)
			}
			if _, err := os.Stat(filepath.Join(dir, server.TokenFile)); !errors.Is(err, os.ErrNotExist) {
				t.Fatalf("a token was written into it: %v", err)
			}
		})
	}
}
