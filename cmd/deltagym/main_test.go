package main

import (
	"context"
	"flag"
	"fmt"
	"os"
	"testing"

	"github.com/deltagym/deltagym/server"
	"github.com/deltagym/deltagym/server/servertest"
)

// testToken is the bearer token the test server requires.
const testToken = "cli-test-token"

// The in-process server of the integration tests; nil when it cannot run
// here (skipReason says why).
var (
	testServer  *server.Server
	testAddr    string
	testDataDir string
	testInit    string
	testImage   string
	skipReason  string
)

// TestMain starts one real in-process server (with the shipped env catalog,
// a private Postgres and auth on) for the CLI's integration tests.
func TestMain(m *testing.M) {
	flag.Parse()
	stop, err := startTestServer(context.Background())
	if err != nil {
		fmt.Fprintf(os.Stderr, "starting the test server: %v\n", err)
		os.Exit(1)
	}
	if skipReason != "" {
		fmt.Fprintf(os.Stderr, "deltagym CLI: integration tests skipped: %s\n", skipReason)
	}
	code := m.Run()
	if err := stop(); err != nil {
		fmt.Fprintf(os.Stderr, "stopping the test server: %v\n", err)
		if code == 0 {
			code = 1
		}
	}
	os.Exit(code)
}

// startTestServer starts testServer, or sets skipReason.
func startTestServer(ctx context.Context) (stop func() error, err error) {
	srv, reason, err := servertest.Start(ctx, servertest.Options{AuthToken: testToken})
	if err != nil || srv == nil {
		skipReason = reason
		return func() error { return nil }, err
	}
	testServer, testAddr, testDataDir, testInit, testImage = srv.Server, srv.Addr, srv.DataDir, srv.InitBinary, srv.ImageDir
	return srv.Close, nil
}

func needServer(t *testing.T) {
	t.Helper()
	if testServer == nil {
		t.Skipf("needs the in-process server: %s", skipReason)
	}
}
