package deltagym

import (
	"context"
	"errors"
	"io/fs"
	"net"
	"net/http/httptest"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"connectrpc.com/connect"

	deltagymv1 "github.com/deltagym/deltagym/clients/go/gen/deltagym/v1"
	"github.com/deltagym/deltagym/clients/go/gen/deltagym/v1/deltagymv1connect"
)

func TestBaseURL(t *testing.T) {
	tests := []struct {
		name, addr, env, want string
		wantErr               bool
	}{
		{name: "default", want: "http://127.0.0.1:8080"},
		{name: "from env", env: "10.0.0.1:9000", want: "http://10.0.0.1:9000"},
		{name: "host port", addr: "localhost:1234", env: "ignored:1", want: "http://localhost:1234"},
		{name: "ipv6", addr: "[::1]:8080", want: "http://[::1]:8080"},
		{name: "http url", addr: "http://example.test:80/", want: "http://example.test:80"},
		{name: "https url with path", addr: "https://example.test/api", want: "https://example.test/api"},
		{name: "no port", addr: "localhost", wantErr: true},
		{name: "bad scheme", addr: "ftp://x:1", wantErr: true},
		{name: "no host", addr: "http://", wantErr: true},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			t.Setenv(EnvAddr, tt.env)
			got, err := BaseURL(tt.addr)
			if tt.wantErr {
				if !errors.Is(err, ErrBadAddress) {
					t.Fatalf("BaseURL(%q) = %q, %v; want ErrBadAddress", tt.addr, got, err)
				}
				return
			}
			if err != nil || got != tt.want {
				t.Fatalf("BaseURL(%q) = %q, %v; want %q", tt.addr, got, err, tt.want)
			}
		})
	}
}

func TestRetrySafe(t *testing.T) {
	tests := []struct {
		procedure string
		msg       any
		want      bool
	}{
		{deltagymv1connect.EnvServiceListEnvsProcedure, &deltagymv1.ListEnvsRequest{}, true},
		{deltagymv1connect.EnvServiceHeartbeatProcedure, &deltagymv1.HeartbeatRequest{}, true},
		{deltagymv1connect.EnvServiceGetSandboxProcedure, &deltagymv1.GetSandboxRequest{}, true},
		{deltagymv1connect.EnvServiceCloseProcedure, &deltagymv1.CloseRequest{}, true},
		{deltagymv1connect.LedgerServiceGetTrajectoryProcedure, &deltagymv1.GetTrajectoryRequest{}, true},
		{deltagymv1connect.LedgerServiceReportRewardProcedure, &deltagymv1.ReportRewardRequest{}, true},
		{deltagymv1connect.EnvServiceResetProcedure, &deltagymv1.ResetRequest{IdempotencyKey: "k"}, true},
		{deltagymv1connect.EnvServiceResetProcedure, &deltagymv1.ResetRequest{}, false},
		{deltagymv1connect.EnvServiceForkProcedure, &deltagymv1.ForkRequest{IdempotencyKey: "k"}, true},
		{deltagymv1connect.EnvServiceForkProcedure, &deltagymv1.ForkRequest{}, false},
		{deltagymv1connect.EnvServiceStepProcedure, &deltagymv1.StepRequest{}, false},
		{deltagymv1connect.EnvServiceRestoreProcedure, &deltagymv1.RestoreRequest{}, false},
		{deltagymv1connect.EnvServiceCheckpointProcedure, &deltagymv1.CheckpointRequest{}, false},
		{deltagymv1connect.EnvServiceEvaluateProcedure, &deltagymv1.EvaluateRequest{}, false},
		{deltagymv1connect.EnvServiceRegisterEnvProcedure, &deltagymv1.RegisterEnvRequest{}, false},
		{deltagymv1connect.EnvServiceImportImageProcedure, &deltagymv1.ImportImageRequest{}, false},
		{deltagymv1connect.EnvServiceReleaseCheckpointProcedure, &deltagymv1.ReleaseCheckpointRequest{}, false},
	}
	for _, tt := range tests {
		t.Run(tt.procedure, func(t *testing.T) {
			if got := retrySafe(tt.procedure, tt.msg); got != tt.want {
				t.Fatalf("retrySafe(%s, %v) = %v, want %v", tt.procedure, tt.msg, got, tt.want)
			}
		})
	}
}

// attemptLog is an inner interceptor that records every attempt the retry
// interceptor makes, with its request.
type attemptLog struct {
	mu sync.Mutex
	// +checklocks:mu
	attempts map[string][]any
}

func (l *attemptLog) interceptor() connect.Interceptor {
	return connect.UnaryInterceptorFunc(func(next connect.UnaryFunc) connect.UnaryFunc {
		return func(ctx context.Context, req connect.AnyRequest) (connect.AnyResponse, error) {
			l.mu.Lock()
			l.attempts[req.Spec().Procedure] = append(l.attempts[req.Spec().Procedure], req.Any())
			l.mu.Unlock()
			return next(ctx, req)
		}
	})
}

// closedAddr returns a loopback address nothing listens on: connecting to it
// is refused, which Connect reports as Unavailable.
func closedAddr(t *testing.T) string {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	addr := ln.Addr().String()
	if err := ln.Close(); err != nil {
		t.Fatal(err)
	}
	return addr
}

// TestRetryPolicy checks, against a refused connection (a real Unavailable),
// which calls are attempted again and that Reset and Fork keep their
// idempotency key across attempts.
func TestRetryPolicy(t *testing.T) {
	for _, grpc := range []bool{false, true} {
		name := "connect"
		if grpc {
			name = "grpc"
		}
		t.Run(name, func(t *testing.T) {
			log := &attemptLog{attempts: map[string][]any{}}
			opts := []Option{WithRetry(3, time.Millisecond), WithConnectOptions(connect.WithInterceptors(log.interceptor()))}
			if grpc {
				opts = append(opts, WithGRPC())
			}
			c, err := Dial(closedAddr(t), opts...)
			if err != nil {
				t.Fatal(err)
			}
			defer c.Close()
			ctx := t.Context()
			sb := c.Sandbox("sb-1")
			calls := []struct {
				procedure string
				call      func() error
				attempts  int
			}{
				{deltagymv1connect.EnvServiceListEnvsProcedure, func() error { _, err := c.ListEnvs(ctx); return err }, 3},
				{deltagymv1connect.EnvServiceResetProcedure, func() error { _, err := c.Reset(ctx, "shell"); return err }, 3},
				{deltagymv1connect.EnvServiceForkProcedure, func() error { _, err := c.Fork(ctx, "ck-1", 2); return err }, 3},
				{deltagymv1connect.EnvServiceHeartbeatProcedure, func() error { _, err := sb.Heartbeat(ctx); return err }, 3},
				{deltagymv1connect.EnvServiceStepProcedure, func() error { _, err := sb.Exec(ctx, "true"); return err }, 1},
				{deltagymv1connect.EnvServiceRestoreProcedure, func() error { _, err := sb.Restore(ctx, "ck-1"); return err }, 1},
				{deltagymv1connect.EnvServiceCheckpointProcedure, func() error { _, err := sb.Checkpoint(ctx); return err }, 1},
				{deltagymv1connect.EnvServiceCloseProcedure, func() error { return sb.Close(ctx) }, 3},
			}
			for _, call := range calls {
				err := call.call()
				if connect.CodeOf(err) != connect.CodeUnavailable {
					t.Fatalf("%s: got %v (code %v), want Unavailable", call.procedure, err, connect.CodeOf(err))
				}
				if got := len(log.attempts[call.procedure]); got != call.attempts {
					t.Errorf("%s: %d attempts, want %d", call.procedure, got, call.attempts)
				}
			}
			keys := map[string]bool{}
			for _, m := range log.attempts[deltagymv1connect.EnvServiceResetProcedure] {
				keys[m.(*deltagymv1.ResetRequest).GetIdempotencyKey()] = true
			}
			if len(keys) != 1 || keys[""] {
				t.Errorf("Reset attempts carried keys %v, want one non-empty key", keys)
			}
			keys = map[string]bool{}
			for _, m := range log.attempts[deltagymv1connect.EnvServiceForkProcedure] {
				keys[m.(*deltagymv1.ForkRequest).GetIdempotencyKey()] = true
			}
			if len(keys) != 1 || keys[""] {
				t.Errorf("Fork attempts carried keys %v, want one non-empty key", keys)
			}
		})
	}
}

// TestRetryStopsWithContext checks that a retry loop ends when the call's
// context does, with the last Unavailable error, instead of waiting out its
// backoff.
func TestRetryStopsWithContext(t *testing.T) {
	ctx, cancel := context.WithCancel(t.Context())
	defer cancel()
	// Cancel the call's context once its first attempt has failed; the retry
	// loop is then waiting an hour for the next one.
	cancelAfterAttempt := connect.UnaryInterceptorFunc(func(next connect.UnaryFunc) connect.UnaryFunc {
		return func(ctx context.Context, req connect.AnyRequest) (connect.AnyResponse, error) {
			res, err := next(ctx, req)
			cancel()
			return res, err
		}
	})
	c, err := Dial(closedAddr(t), WithRetry(1000, time.Hour), WithConnectOptions(connect.WithInterceptors(cancelAfterAttempt)))
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	if _, err := c.ListEnvs(ctx); connect.CodeOf(err) != connect.CodeUnavailable {
		t.Fatalf("ListEnvs = %v, want Unavailable after the context ended", err)
	}
}

func TestClientClose(t *testing.T) {
	c, err := Dial(closedAddr(t))
	if err != nil {
		t.Fatal(err)
	}
	for i := range 2 {
		if err := c.Close(); err != nil {
			t.Fatalf("Close #%d: %v", i+1, err)
		}
	}
	if _, err := c.ListEnvs(t.Context()); !errors.Is(err, ErrClientClosed) {
		t.Fatalf("ListEnvs after Close = %v, want ErrClientClosed", err)
	}
	if _, err := c.Reset(t.Context(), "shell"); !errors.Is(err, ErrClientClosed) {
		t.Fatalf("Reset after Close = %v, want ErrClientClosed", err)
	}
}

func TestSandboxCloseIdempotentOffline(t *testing.T) {
	c, err := Dial(closedAddr(t), WithRetry(1, 0))
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	sb := c.Sandbox("sb-1")
	if err := sb.Close(t.Context()); connect.CodeOf(err) != connect.CodeUnavailable {
		t.Fatalf("first Close = %v, want Unavailable", err)
	}
	if err := sb.Close(t.Context()); err != nil {
		t.Fatalf("second Close = %v, want nil", err)
	}
	if _, err := sb.Exec(t.Context(), "true"); !errors.Is(err, ErrSandboxClosed) {
		t.Fatalf("Exec after Close = %v, want ErrSandboxClosed", err)
	}
}

func TestStepOptions(t *testing.T) {
	a := ExecAction("ls", WithStdin([]byte("in")), WithEnv("A", "1"), WithEnv("B", "2"), WithCwd("/tmp"),
		WithTimeout(1500*time.Millisecond), WithSession("s"), InBackground())
	e := a.GetExec()
	if e.GetCommand() != "ls" || string(e.GetStdin()) != "in" || e.GetEnv()["A"] != "1" || e.GetEnv()["B"] != "2" ||
		e.GetCwd() != "/tmp" || e.GetTimeoutSeconds() != 1.5 || e.GetSession() != "s" || !e.GetBackground() {
		t.Fatalf("ExecAction built %v", e)
	}
}

func TestExecResultOf(t *testing.T) {
	r := ExecResultOf(&deltagymv1.StepResponse{
		EpisodeId: "ep", StepIndex: 3, Reward: 0.5, Truncated: true, CheckpointId: "ck",
		Observation: &deltagymv1.Observation{Kind: &deltagymv1.Observation_Exec{Exec: &deltagymv1.ExecResult{
			Stdout: []byte("out"), Stderr: []byte("err"), ExitCode: 2, DurationSeconds: 0.25, StdoutTruncated: true,
		}}},
	})
	if r.EpisodeID != "ep" || r.StepIndex != 3 || r.Reward != 0.5 || !r.Done() || r.CheckpointID != "ck" ||
		string(r.Stdout) != "out" || string(r.Stderr) != "err" || r.ExitCode != 2 || r.OK() ||
		r.Duration != 250*time.Millisecond || !r.StdoutTruncated {
		t.Fatalf("ExecResultOf = %+v", r)
	}
}

// ResolveToken takes the first of $DELTAGYM_TOKEN, the file $DELTAGYM_TOKEN_FILE and the data
// directory's token file; a named file that cannot be read is an error, a data directory
// without one is not.
func TestResolveToken(t *testing.T) {
	dir := t.TempDir()
	data := filepath.Join(dir, "data")
	must := func(err error) {
		t.Helper()
		if err != nil {
			t.Fatal(err)
		}
	}
	must(os.Mkdir(data, 0o755))
	must(os.WriteFile(filepath.Join(data, "token"), []byte("from-data\n"), 0o600))
	named := filepath.Join(dir, "named")
	must(os.WriteFile(named, []byte("  from-file \n"), 0o600))
	cwd := filepath.Join(dir, "cwd")
	must(os.MkdirAll(filepath.Join(cwd, DefaultDataDir), 0o755))
	must(os.WriteFile(filepath.Join(cwd, DefaultDataDir, "token"), []byte("from-cwd\n"), 0o600))
	t.Chdir(cwd)
	for _, tc := range []struct {
		name, token, file, data, want string
		wantErr                       bool
	}{
		{name: "variable first", token: "from-env", file: named, data: data, want: "from-env"},
		{name: "then the named file", file: named, data: data, want: "from-file"},
		{name: "then the data directory", data: data, want: "from-data"},
		{name: "then .data here", want: "from-cwd"},
		{name: "named file missing", file: filepath.Join(dir, "missing"), data: data, wantErr: true},
		{name: "data directory without a token", data: dir, want: ""},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Setenv(EnvToken, tc.token)
			t.Setenv(EnvTokenFile, tc.file)
			t.Setenv(EnvData, tc.data)
			got, err := ResolveToken()
			if (err != nil) != tc.wantErr || got != tc.want {
				t.Fatalf("ResolveToken() = %q, %v; want %q (error: %v)", got, err, tc.want, tc.wantErr)
			}
			if tc.wantErr {
				if _, err := Dial("127.0.0.1:1"); err == nil {
					t.Fatal("Dial with an unreadable $DELTAGYM_TOKEN_FILE succeeded")
				}
			}
		})
	}
}

// refusingEnvService answers every call unauthenticated, as a server does to a missing token.
type refusingEnvService struct {
	deltagymv1connect.UnimplementedEnvServiceHandler
}

func (refusingEnvService) ListEnvs(context.Context, *connect.Request[deltagymv1.ListEnvsRequest]) (*connect.Response[deltagymv1.ListEnvsResponse], error) {
	return nil, connect.NewError(connect.CodeUnauthenticated, errors.New("missing or wrong bearer token"))
}

// A client that found no token says, in its unauthenticated errors, where it looked; one given
// a token does not.
func TestNoTokenHint(t *testing.T) {
	_, h := deltagymv1connect.NewEnvServiceHandler(refusingEnvService{})
	srv := httptest.NewServer(h)
	defer srv.Close()
	t.Setenv(EnvToken, "")
	t.Setenv(EnvTokenFile, "")
	t.Setenv(EnvData, t.TempDir())
	for _, tc := range []struct {
		name     string
		opts     []Option
		wantHint bool
	}{
		{name: "no token found", wantHint: true},
		{name: "token given", opts: []Option{WithToken("wrong")}},
		{name: "empty token given", opts: []Option{WithToken("")}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			c, err := Dial(srv.URL, append(tc.opts, WithHTTPClient(srv.Client()), WithRetry(1, 0))...)
			if err != nil {
				t.Fatal(err)
			}
			defer c.Close()
			_, err = c.EnvService().ListEnvs(context.Background(), connect.NewRequest(&deltagymv1.ListEnvsRequest{}))
			if connect.CodeOf(err) != connect.CodeUnauthenticated {
				t.Fatalf("ListEnvs: %v, want unauthenticated", err)
			}
			if got := strings.Contains(err.Error(), "found no token") && strings.Contains(err.Error(), "$"+EnvData); got != tc.wantHint {
				t.Fatalf("hint in %q: %v, want %v", err, got, tc.wantHint)
			}
			if !strings.Contains(err.Error(), "missing or wrong bearer token") {
				t.Fatalf("the server's message is lost: %q", err)
			}
		})
	}
}

// An observation's error comes back from the helpers as an *ActionError that unwraps to its errno.
func TestActionErrorOf(t *testing.T) {
	res := &deltagymv1.StepResponse{Observation: &deltagymv1.Observation{Error: &deltagymv1.ActionError{Errno: 2, ErrnoName: "ENOENT", Message: "/nope: no such file"}}}
	err := actionError(res)
	var ae *ActionError
	if !errors.As(err, &ae) || ae.Name != "ENOENT" || !errors.Is(err, fs.ErrNotExist) || !strings.Contains(err.Error(), "/nope") {
		t.Fatalf("actionError = %v", err)
	}
	if err := actionError(&deltagymv1.StepResponse{Observation: &deltagymv1.Observation{}}); err != nil {
		t.Fatalf("no error in the observation: %v", err)
	}
}
