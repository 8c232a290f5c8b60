package server_test

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"connectrpc.com/connect"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/status"

	deltagymv1 "github.com/deltagym/deltagym/clients/go/gen/deltagym/v1"
	"github.com/deltagym/deltagym/clients/go/gen/deltagym/v1/deltagymv1connect"
	"github.com/deltagym/deltagym/internal/locate"
	"github.com/deltagym/deltagym/internal/testenv"
	"github.com/deltagym/deltagym/sandbox"
	"github.com/deltagym/deltagym/sandbox/image/imagetest"
	"github.com/deltagym/deltagym/server"
	"github.com/deltagym/deltagym/server/ledger/pgtest"
)

func TestMain(m *testing.M) {
	if os.Getenv(crashChildEnv) != "" {
		crashChild() // a server for TestCrashEndsEpisodes to kill
		return
	}
	if os.Getenv(localUserEnv) != "" {
		localUser() // an unprivileged local user for TestImportAsLocalUser
		return
	}
	os.Exit(pgtest.Run(m))
}

// testEnvs are the catalog of the test servers, on the busybox image imported as "default".
var testEnvs = map[string]string{
	"task.json": `{"name": "task", "image": "default", "task": "write 42 to /tmp/answer",
		"setup": ["echo base > /tmp/base"],
		"reset_hook": "echo seed=$DELTAGYM_SEED q=$Q; echo $DELTAGYM_SEED > /tmp/seed",
		"verifier": "if [ \"$(cat /tmp/answer 2>/dev/null)\" = 42 ]; then echo '{\"reward\": 1, \"components\": {\"correct\": 1}}'; else echo 0; fi",
		"budgets": {"max_steps": 50}, "pool_size": 2}`,
	"plain.json": `{"name": "plain", "image": "default", "setup": ["echo plain > /tmp/plain"],
		"verifier": "cat /tmp/answer 2>/dev/null || echo 0", "pool_size": 4}`,
	"short.json": `{"name": "short", "image": "default", "budgets": {"max_steps": 2}, "pool_size": 1}`,
}

var serverCount atomic.Int64

type bundle struct {
	srv     *server.Server
	addr    string
	dbURL   string
	cgroup  string
	connect deltagymv1connect.EnvServiceClient
	ledger  deltagymv1connect.LedgerServiceClient
	grpc    deltagymv1.EnvServiceClient
	gledger deltagymv1.LedgerServiceClient
	conn    *grpc.ClientConn
	token   string
	busybox string
	data    string
}

// initBinary returns the sandbox init (locate.Init), or skips t.
func initBinary(t testing.TB) string {
	t.Helper()
	p, err := locate.Init()
	if err != nil {
		t.Skip(err)
	}
	return p
}

// criuBinary returns the CRIU wrapper (locate.CRIU): where it is expected when it is not
// installed, so that the processes that need it fail as in a server without it.
func criuBinary() string {
	p, _ := locate.CRIU()
	return p
}

// setup starts an in-process server on a loopback listener, with real sandboxes and a real
// Postgres ledger, and clients of both kinds.
func setup(t testing.TB, mod func(*server.Config)) *bundle {
	t.Helper()
	testenv.Privileged(t, "sandboxes use namespaces, mounts and cgroups")
	init := initBinary(t)
	envs := t.TempDir()
	for name, body := range testEnvs {
		if err := os.WriteFile(filepath.Join(envs, name), []byte(body), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	data, err := os.MkdirTemp("", "dgsrv")
	if err != nil {
		t.Fatal(err)
	}
	cg := fmt.Sprintf("dgsrvtest%d_%d", os.Getpid(), serverCount.Add(1))
	busybox := imagetest.Busybox(t)
	cfg := server.Config{DataDir: data, EnvsDir: envs, InitBinary: init, CRIU: criuBinary(), CgroupRoot: cg, DefaultImageDir: busybox,
		Lease: server.LeaseSettings{TTL: time.Minute}, Logger: slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: slog.LevelWarn})),
		Import: server.ImportSettings{Root: filepath.Dir(busybox)}} // the test's own directory: the busybox rootfs is importable
	if mod != nil {
		mod(&cfg)
	}
	if !cfg.NoLedger && cfg.DatabaseURL == "" {
		cfg.DatabaseURL = pgtest.Start(t)
	}
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	srv, err := server.New(ctx, cfg)
	if err != nil {
		t.Fatalf("starting server: %v", err)
	}
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	served := make(chan error, 1)
	go func() { served <- srv.Serve(ln) }()
	b := &bundle{srv: srv, addr: ln.Addr().String(), dbURL: cfg.DatabaseURL, cgroup: cg, token: srv.Token(), busybox: busybox, data: data}
	var opts []connect.ClientOption
	if b.token != "" {
		opts = append(opts, connect.WithInterceptors(bearer(b.token)))
	}
	base := "http://" + b.addr
	var protos http.Protocols
	protos.SetUnencryptedHTTP2(true) // h2c with prior knowledge: bidi streams need HTTP/2
	h2c := &http.Client{Transport: &http.Transport{Protocols: &protos}}
	b.connect = deltagymv1connect.NewEnvServiceClient(h2c, base, opts...)
	b.ledger = deltagymv1connect.NewLedgerServiceClient(h2c, base, opts...)
	gopts := []grpc.DialOption{grpc.WithTransportCredentials(insecure.NewCredentials())}
	if b.token != "" {
		gopts = append(gopts, grpc.WithPerRPCCredentials(grpcBearer(b.token)))
	}
	if b.conn, err = grpc.NewClient(b.addr, gopts...); err != nil {
		t.Fatal(err)
	}
	b.grpc = deltagymv1.NewEnvServiceClient(b.conn)
	b.gledger = deltagymv1.NewLedgerServiceClient(b.conn)
	t.Cleanup(func() {
		b.conn.Close()
		ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
		defer cancel()
		if err := srv.Close(ctx); err != nil {
			t.Errorf("closing server: %v", err)
		}
		if err := srv.Close(ctx); err != nil { // idempotent
			t.Errorf("closing server twice: %v", err)
		}
		if err := <-served; !errors.Is(err, http.ErrServerClosed) {
			t.Errorf("serve returned %v", err)
		}
		if err := sandbox.Purge(filepath.Join(data, "sandbox")); err != nil { // unmounts its layers
			t.Errorf("purging sandbox data: %v", err)
		}
		os.RemoveAll(data)
		removeCgroupRoot(cg)
	})
	return b
}

// removeCgroupRoot removes the (empty) cgroup parent a test runtime used, in every hierarchy.
func removeCgroupRoot(name string) {
	a, _ := filepath.Glob("/sys/fs/cgroup/*/" + name)
	b, _ := filepath.Glob("/sys/fs/cgroup/" + name)
	for _, p := range append(a, b...) {
		_ = os.Remove(p)
	}
}

type bearer string

func (b bearer) WrapUnary(next connect.UnaryFunc) connect.UnaryFunc {
	return func(ctx context.Context, req connect.AnyRequest) (connect.AnyResponse, error) {
		req.Header().Set("Authorization", "Bearer "+string(b))
		return next(ctx, req)
	}
}
func (b bearer) WrapStreamingClient(next connect.StreamingClientFunc) connect.StreamingClientFunc {
	return func(ctx context.Context, spec connect.Spec) connect.StreamingClientConn {
		c := next(ctx, spec)
		c.RequestHeader().Set("Authorization", "Bearer "+string(b))
		return c
	}
}
func (b bearer) WrapStreamingHandler(next connect.StreamingHandlerFunc) connect.StreamingHandlerFunc {
	return next
}

type grpcBearer string

func (g grpcBearer) GetRequestMetadata(ctx context.Context, uri ...string) (map[string]string, error) {
	return map[string]string{"authorization": "Bearer " + string(g)}, nil
}
func (g grpcBearer) RequireTransportSecurity() bool { return false }

// codeOf returns the status code of an error from either client.
func codeOf(err error) connect.Code {
	if err == nil {
		return 0
	}
	var ce *connect.Error
	if errors.As(err, &ce) {
		return ce.Code()
	}
	return connect.Code(status.Code(err))
}

// repeatsCode reports whether err's message says its code's words again, anywhere between its
// ": " separators ("not_found: checkpoint x: not found").
func repeatsCode(err error) bool {
	if err == nil {
		return false
	}
	msg := status.Convert(err).Message()
	var ce *connect.Error
	if errors.As(err, &ce) {
		msg = ce.Message()
	}
	words := strings.ReplaceAll(codeOf(err).String(), "_", " ")
	return slices.Contains(strings.Split(msg, ": "), words)
}

func must(t testing.TB, err error) {
	t.Helper()
	if err != nil {
		t.Fatal(err)
	}
}
