package loadtest

import (
	"context"
	"flag"
	"fmt"
	"os"
	"path/filepath"
	"testing"
	"time"

	"github.com/deltagym/deltagym/internal/locate"
	"github.com/deltagym/deltagym/internal/testenv"
)

// testServer is the real server the privileged tests share; nil (with skipReason) when it
// cannot run here.
var (
	testServer *Server
	skipReason string
)

// firstFile returns the first of paths that exists, or "".
func firstFile(paths ...string) string {
	for _, p := range paths {
		if p == "" {
			continue
		}
		if _, err := os.Stat(p); err == nil {
			abs, _ := filepath.Abs(p)
			return abs
		}
	}
	return ""
}

func TestMain(m *testing.M) {
	flag.Parse() // for testing.Short
	code := func() int {
		bin := firstFile(os.Getenv("DELTAGYM_BIN"), "../bin/deltagym")
		init, initErr := locate.Init()
		img := firstFile(os.Getenv("DELTAGYM_IMAGE_DIR"), "../.data/images/default")
		privileged := testenv.PrivilegedReason("the server mounts overlays and creates cgroups")
		switch {
		case privileged != "":
			skipReason = privileged
		case bin == "":
			skipReason = "needs bin/deltagym (make build, or DELTAGYM_BIN)"
		case initErr != nil:
			skipReason = initErr.Error()
		case img == "":
			skipReason = "needs the default image (make image, or DELTAGYM_IMAGE_DIR)"
		}
		if skipReason != "" {
			return m.Run()
		}
		data, err := os.MkdirTemp("", "loadtest-server-")
		if err != nil {
			fmt.Fprintln(os.Stderr, err)
			return 1
		}
		defer os.RemoveAll(data)
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
		defer cancel()
		log, _ := os.Create(filepath.Join(data, "server.log"))
		testServer, err = StartServer(ctx, ServerConfig{Binary: bin, Init: init, DataDir: filepath.Join(data, "data"),
			EnvsDir: firstFile("../envs"), ImageDir: img, IsolateCgroups: true, Log: log})
		if err != nil {
			fmt.Fprintln(os.Stderr, "starting the test server:", err)
			return 1
		}
		code := m.Run()
		if err := testServer.Close(); err != nil {
			fmt.Fprintln(os.Stderr, "stopping the test server:", err)
			code = 1
		}
		if err := testServer.Close(); err != nil { // Close is idempotent
			fmt.Fprintln(os.Stderr, "second Close:", err)
			code = 1
		}
		if code != 0 {
			b, _ := os.ReadFile(filepath.Join(data, "server.log"))
			fmt.Fprintf(os.Stderr, "server log:\n%s\n", b)
		}
		return code
	}()
	os.Exit(code)
}

// needServer skips t unless the shared real server runs.
func needServer(t *testing.T) *Server {
	t.Helper()
	if testServer == nil {
		t.Skip(skipReason)
	}
	return testServer
}
