package deltagym_test

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"log/slog"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"sort"
	"strings"
	"testing"
	"time"

	"github.com/deltagym/deltagym/server"
	"github.com/deltagym/deltagym/server/ledger/pgserver"
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

// repoRoot finds the module root from the test's working directory.
func repoRoot() (string, error) {
	dir, err := os.Getwd()
	if err != nil {
		return "", err
	}
	for {
		if _, err := os.Stat(filepath.Join(dir, "go.mod")); err == nil {
			return dir, nil
		}
		parent := filepath.Dir(dir)
		if parent == dir {
			return "", errors.New("go.mod not found")
		}
		dir = parent
	}
}

// startTestServer starts testServer, or sets skipReason.
func startTestServer(ctx context.Context) (stop func() error, err error) {
	noop := func() error { return nil }
	if os.Geteuid() != 0 {
		skipReason = "sandboxes need root"
		return noop, nil
	}
	root, err := repoRoot()
	if err != nil {
		return nil, err
	}
	initBin := os.Getenv("DELTAGYM_INIT")
	if initBin == "" {
		initBin = filepath.Join(root, "bin", "dg-init")
	}
	image := filepath.Join(root, ".data", "images", "default", "rootfs")
	if d := os.Getenv("DATA"); d != "" {
		image = filepath.Join(d, "images", "default", "rootfs")
	}
	for _, need := range []struct{ path, hint string }{
		{initBin, "the sandbox init is not built (make init)"},
		{image, "the default image is not built (make image)"},
		{filepath.Join(pgserver.DefaultBinDir, "postgres"), "postgres is not installed (make deps)"},
	} {
		if _, err := os.Stat(need.path); err != nil {
			skipReason = need.hint
			return noop, nil
		}
	}
	data, err := os.MkdirTemp("", "dgclient-")
	if err != nil {
		return nil, err
	}
	logFile, err := os.Create(filepath.Join(data, "server.log"))
	if err != nil {
		return nil, err
	}
	srv, err := server.New(ctx, server.Config{
		DataDir:         data,
		EnvsDir:         filepath.Join("testdata", "envs"),
		InitBinary:      initBin,
		CgroupRoot:      "deltagym-clienttest",
		DefaultImageDir: image,
		LeaseTTL:        testLeaseTTL,
		AcquireTimeout:  time.Minute,
		Logger:          slog.New(slog.NewTextHandler(logFile, nil)),
	})
	if err != nil {
		return nil, errors.Join(err, os.RemoveAll(data))
	}
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return nil, errors.Join(err, srv.Close(ctx), os.RemoveAll(data))
	}
	served := make(chan error, 1)
	go func() { served <- srv.Serve(ln) }()
	testServer, testAddr = srv, ln.Addr().String()
	os.Setenv("DELTAGYM_ADDR", testAddr)
	return func() error {
		cctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), time.Minute)
		defer cancel()
		err := srv.Close(cctx)
		<-served
		_ = logFile.Close()
		// Close should leave nothing mounted. What it left is unmounted here, so
		// the data directory can go, and reported (the server's own tests
		// fail on leaks; these tests are about the client).
		if lerr := unmountLeftovers(data); lerr != nil {
			fmt.Fprintf(os.Stderr, "warning: %v\n", lerr)
		}
		if err != nil {
			if b, rerr := os.ReadFile(logFile.Name()); rerr == nil {
				_, _ = io.WriteString(os.Stderr, string(b))
			}
		}
		return errors.Join(err, os.RemoveAll(data))
	}, nil
}

// needServer skips t when the in-process server cannot run here.
func needServer(t *testing.T) {
	t.Helper()
	if testServer == nil {
		t.Skipf("needs the in-process server: %s", skipReason)
	}
}

// unmountLeftovers unmounts every mount left below dir, deepest first, and
// returns an error naming them when there were any. The sandbox runtime may
// have moved this process into a mount namespace of its own, so the mounts
// are looked up and removed in the namespace of the parent process (go test).
func unmountLeftovers(dir string) error {
	ns := fmt.Sprintf("/proc/%d/ns/mnt", os.Getppid())
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/mountinfo", os.Getppid()))
	if err != nil {
		return err
	}
	var left []string
	for _, line := range strings.Split(string(b), "\n") {
		f := strings.Fields(line)
		if len(f) > 4 && strings.HasPrefix(f[4], dir+"/") {
			left = append(left, f[4])
		}
	}
	if len(left) == 0 {
		return nil
	}
	sort.Sort(sort.Reverse(sort.StringSlice(left)))
	var errs []error
	for _, m := range left {
		if out, err := exec.Command("nsenter", "--mount="+ns, "umount", "-l", m).CombinedOutput(); err != nil {
			errs = append(errs, fmt.Errorf("unmounting %s: %v: %s", m, err, out))
		}
	}
	return errors.Join(fmt.Errorf("server.Close left %d mounts: %s", len(left), strings.Join(left, " ")), errors.Join(errs...))
}
