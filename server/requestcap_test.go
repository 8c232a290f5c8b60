package server_test

import (
	"bytes"
	"crypto/md5"
	"fmt"
	"net/http"
	"strings"
	"testing"

	"connectrpc.com/connect"

	deltagymv1 "github.com/deltagym/deltagym/clients/go/gen/deltagym/v1"
	"github.com/deltagym/deltagym/clients/go/gen/deltagym/v1/deltagymv1connect"
	"github.com/deltagym/deltagym/sandbox"
	"github.com/deltagym/deltagym/server"
)

// jsonClient is a Connect client of b's EnvService that speaks JSON.
func (b *bundle) jsonClient() deltagymv1connect.EnvServiceClient {
	var protos http.Protocols
	protos.SetUnencryptedHTTP2(true)
	return deltagymv1connect.NewEnvServiceClient(&http.Client{Transport: &http.Transport{Protocols: &protos}}, "http://"+b.addr,
		connect.WithProtoJSON(), connect.WithInterceptors(bearer(b.token)))
}

// The default request cap carries a write_file of a large file in every encoding: 60 MiB goes
// through over Connect JSON (base64, a third larger), Connect proto and gRPC. A file past the
// file cap is refused, naming the cap that refused it and what to do: over JSON by the request
// cap, which names the file cap too; over proto by the file cap itself.
func TestLargeWriteFile(t *testing.T) {
	b := setup(t, func(c *server.Config) { c.NoLedger = true })
	jsonClient := b.jsonClient()
	clients := []struct {
		name string
		c    api
	}{{"connect-json", connectAPI{e: jsonClient, l: b.ledger}}, {"connect-proto", connectAPI{e: b.connect, l: b.ledger}}, {"grpc", grpcAPI{b.grpc, b.gledger}}}
	content := bytes.Repeat([]byte("0123456789abcdef"), (60<<20)/16)
	for _, cl := range clients {
		t.Run(cl.name, func(t *testing.T) {
			rr, err := cl.c.Reset(t.Context(), &deltagymv1.ResetRequest{Env: "plain"})
			must(t, err)
			sb := rr.GetSandboxId()
			defer cl.c.Close(t.Context(), &deltagymv1.CloseRequest{SandboxId: sb})
			st, err := cl.c.Step(t.Context(), &deltagymv1.StepRequest{SandboxId: sb, Action: writeFileAction("/tmp/big", content)})
			must(t, err)
			if got := st.GetObservation().GetWriteFile().GetSize(); got != int64(len(content)) {
				t.Fatalf("write_file of %d bytes: observation %v", len(content), st.GetObservation())
			}
			st, err = cl.c.Step(t.Context(), &deltagymv1.StepRequest{SandboxId: sb, Action: execAction("md5sum < /tmp/big")})
			must(t, err)
			if want := md5hex(content); !strings.HasPrefix(stdout(t, st), want) {
				t.Fatalf("the file in the sandbox: md5 %q, want %s", stdout(t, st), want)
			}
		})
	}
	t.Run("past the file cap", func(t *testing.T) {
		// Past the file cap by 1 MiB: over JSON, past the request cap too.
		over := make([]byte, sandbox.MaxFileBytes+1<<20)
		rr, err := b.grpc.Reset(t.Context(), &deltagymv1.ResetRequest{Env: "plain"})
		must(t, err)
		sb := rr.GetSandboxId()
		defer b.grpc.Close(t.Context(), &deltagymv1.CloseRequest{SandboxId: sb})
		_, err = jsonClient.Step(t.Context(), connect.NewRequest(&deltagymv1.StepRequest{SandboxId: sb, Action: writeFileAction("/tmp/over", over)}))
		if codeOf(err) != connect.CodeResourceExhausted || !strings.Contains(err.Error(), "--max-request-bytes") ||
			!strings.Contains(err.Error(), "67108864") || !strings.Contains(err.Error(), "append") {
			t.Fatalf("over Connect JSON: %v, want ResourceExhausted naming the request and file caps", err)
		}
		for _, cl := range clients[1:] {
			_, err = cl.c.Step(t.Context(), &deltagymv1.StepRequest{SandboxId: sb, Action: writeFileAction("/tmp/over", over)})
			if codeOf(err) != connect.CodeInvalidArgument || !strings.Contains(err.Error(), "file cap of 67108864") || !strings.Contains(err.Error(), "append") {
				t.Fatalf("over %s: %v, want InvalidArgument naming the file cap", cl.name, err)
			}
		}
	})
}

func md5hex(b []byte) string { return fmt.Sprintf("%x", md5.Sum(b)) }

// A request past a configured cap is refused in every protocol (a Connect unary body counted
// as it arrives, a gRPC message by its envelope's size) with ResourceExhausted, naming the
// request cap and the file cap and what to do; nothing runs.
func TestRequestCapError(t *testing.T) {
	b := setup(t, func(c *server.Config) { c.NoLedger = true; c.MaxRequestBytes = 1 << 20 })
	rr, err := b.grpc.Reset(t.Context(), &deltagymv1.ResetRequest{Env: "plain"})
	must(t, err)
	sb := rr.GetSandboxId()
	big := writeFileAction("/tmp/big", make([]byte, 2<<20))
	for _, cl := range []struct {
		name string
		c    api
	}{{"connect-json", connectAPI{e: b.jsonClient(), l: b.ledger}}, {"connect-proto", connectAPI{e: b.connect, l: b.ledger}}, {"grpc", grpcAPI{b.grpc, b.gledger}}} {
		_, err := cl.c.Step(t.Context(), &deltagymv1.StepRequest{SandboxId: sb, Action: big})
		if codeOf(err) != connect.CodeResourceExhausted || !strings.Contains(err.Error(), "request cap of 1048576 bytes (--max-request-bytes)") ||
			!strings.Contains(err.Error(), "67108864") || !strings.Contains(err.Error(), "append") {
			t.Errorf("%s: %v, want ResourceExhausted naming the request and file caps", cl.name, err)
		}
	}
	g, err := b.grpc.GetSandbox(t.Context(), &deltagymv1.GetSandboxRequest{SandboxId: sb})
	must(t, err)
	if n := g.GetSandbox().GetNextStepIndex(); n != 0 {
		t.Fatalf("%d steps counted", n)
	}
}
