package deltagym_test

import (
	"context"
	"flag"
	"fmt"
	"os"
	"path/filepath"
	"testing"
	"time"

	"github.com/deltagym/deltagym/server"
	"github.com/deltagym/deltagym/server/servertest"
)

// testLeaseTTL is the lease TTL of the test server: short, so that the
// keep-alive test can outlive it.
const testLeaseTTL = 3 * time.Second

// testServer is the in-process server the integration tests and examples
// use; nil when it cannot run here (skipReason says why).
var (
	testServer *server.Server
	testAddr   string
	skipReason string
)

// TestMain starts one real in-process server (sandbox runtime, warm pools,
// private Postgres) for the package's integration tests and examples, and
// points $DELTAGYM_ADDR at it so that examples Dial("") as a user would.
// Where it cannot run (not root, init or image not built), integration tests
// skip with the reason and the examples are left out of the run.
func TestMain(m *testing.M) {
	flag.Parse()
	ctx := context.Background()
	stop, err := startTestServer(ctx)
	if err != nil {
		fmt.Fprintf(os.Stderr, "starting the test server: %v\n", err)
		os.Exit(1)
	}
	if skipReason != "" {
		fmt.Fprintf(os.Stderr, "deltagym client: integration tests and examples skipped: %s\n", skipReason)
		if f := flag.Lookup("test.run"); f != nil && f.Value.String() == "" {
			_ = f.Value.Set("^Test") // examples need the server: leave them out
		}
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
	srv, reason, err := servertest.Start(ctx, servertest.Options{EnvsDir: filepath.Join("testdata", "envs"), LeaseTTL: testLeaseTTL})
	if err != nil || srv == nil {
		skipReason = reason
		return func() error { return nil }, err
	}
	testServer, testAddr = srv.Server, srv.Addr
	os.Setenv("DELTAGYM_ADDR", testAddr)
	// Clients find the server's generated token in its data directory, as a user's find
	// .data/token of `make run`.
	os.Setenv("DELTAGYM_DATA", srv.DataDir)
	return srv.Close, nil
}

// needServer skips t when the in-process server cannot run here.
func needServer(t *testing.T) {
	t.Helper()
	if testServer == nil {
		t.Skipf("needs the in-process server: %s", skipReason)
	}
}
