package swerex_test

import (
	"context"
	"encoding/json"
	"flag"
	"fmt"
	"io"
	"net/http"
	"os"
	"strings"
	"testing"
	"time"

	"connectrpc.com/connect"

	deltagymv1 "github.com/deltagym/deltagym/clients/go/gen/deltagym/v1"
	"github.com/deltagym/deltagym/clients/go/gen/deltagym/v1/deltagymv1connect"
	"github.com/deltagym/deltagym/server/servertest"
)

// testToken is the suite's server's token.
const testToken = "swerex-suite-token-0123456789"

var (
	srv      *servertest.Server
	skipWhy  string // why srv could not start here (not root, -short, no image)
	startErr error
)

func TestMain(m *testing.M) {
	flag.Parse() // testing.Short, which servertest.Start asks, needs the flags
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
	srv, skipWhy, startErr = servertest.Start(ctx, servertest.Options{AuthToken: testToken})
	cancel()
	code := m.Run()
	if srv != nil {
		if err := srv.Close(); err != nil {
			fmt.Fprintln(os.Stderr, "closing the suite's server:", err)
			code = max(code, 1)
		}
	}
	os.Exit(code)
}

// needServer skips t where the suite's server cannot run.
func needServer(t *testing.T) {
	t.Helper()
	if startErr != nil {
		t.Fatalf("starting the suite's server: %v", startErr)
	}
	if srv == nil {
		t.Skip(skipWhy)
	}
}

// bearer adds the suite's token to Connect requests.
type bearer struct{}

func (bearer) WrapUnary(next connect.UnaryFunc) connect.UnaryFunc {
	return func(ctx context.Context, r connect.AnyRequest) (connect.AnyResponse, error) {
		r.Header().Set("Authorization", "Bearer "+testToken)
		return next(ctx, r)
	}
}

func (bearer) WrapStreamingClient(next connect.StreamingClientFunc) connect.StreamingClientFunc {
	return next
}

func (bearer) WrapStreamingHandler(next connect.StreamingHandlerFunc) connect.StreamingHandlerFunc {
	return next
}

// clients are the suite's server's Connect clients.
func clients() (deltagymv1connect.EnvServiceClient, deltagymv1connect.LedgerServiceClient) {
	base := "http://" + srv.Addr
	opt := connect.WithInterceptors(bearer{})
	return deltagymv1connect.NewEnvServiceClient(http.DefaultClient, base, opt), deltagymv1connect.NewLedgerServiceClient(http.DefaultClient, base, opt)
}

// lease resets a sandbox of the shell env, closed at the end of t; it returns its id and
// episode.
func lease(t *testing.T) (sandboxID, episodeID string) {
	t.Helper()
	env, _ := clients()
	r, err := env.Reset(t.Context(), connect.NewRequest(&deltagymv1.ResetRequest{Env: "shell"}))
	if err != nil {
		t.Fatal(err)
	}
	id := r.Msg.GetSandboxId()
	t.Cleanup(func() {
		_, _ = env.Close(context.Background(), connect.NewRequest(&deltagymv1.CloseRequest{SandboxId: id}))
	})
	return id, r.Msg.GetEpisodeId()
}

// nextStep is the index of sandbox id's next step.
func nextStep(t *testing.T, id string) int32 {
	t.Helper()
	env, _ := clients()
	r, err := env.GetSandbox(t.Context(), connect.NewRequest(&deltagymv1.GetSandboxRequest{SandboxId: id}))
	if err != nil {
		t.Fatal(err)
	}
	return r.Msg.GetSandbox().GetNextStepIndex()
}

// swerexError is the body of a SWE-ReX error answer.
type swerexError struct {
	Swerexception struct {
		Message   string         `json:"message"`
		ClassPath string         `json:"class_path"`
		ExtraInfo map[string]any `json:"extra_info"`
	} `json:"swerexception"`
}

// post sends body to path with the given headers and returns the status and body.
func post(t *testing.T, method, path, contentType string, body io.Reader, header map[string]string) (int, []byte) {
	t.Helper()
	req, err := http.NewRequestWithContext(t.Context(), method, "http://"+srv.Addr+path, body)
	if err != nil {
		t.Fatal(err)
	}
	if contentType != "" {
		req.Header.Set("Content-Type", contentType)
	}
	for k, v := range header {
		req.Header.Set(k, v)
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	if err != nil {
		t.Fatal(err)
	}
	return resp.StatusCode, b
}

// wantException checks that an answer is SWE-ReX's error form with class and a message that
// holds words.
func wantException(t *testing.T, status int, body []byte, class, words string) {
	t.Helper()
	var e swerexError
	if status != 511 || json.Unmarshal(body, &e) != nil {
		t.Fatalf("status %d, body %s: want 511 with a swerexception", status, body)
	}
	if e.Swerexception.ClassPath != class || !strings.Contains(e.Swerexception.Message, words) {
		t.Fatalf("exception %s(%q), want %s with %q", e.Swerexception.ClassPath, e.Swerexception.Message, class, words)
	}
}

// key is the header SWE-ReX's client sends its token in.
var key = map[string]string{"X-API-Key": testToken}
