package deltagym_test

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"syscall"
	"testing"
	"time"

	"github.com/deltagym/deltagym/clients/go/deltagym"
)

// testLeaseTTL is the lease TTL of the test server: short, so that the
// keep-alive test can outlive it.
const testLeaseTTL = 3 * time.Second

// The server the integration tests and examples use: `deltagym serve` of
// the checkout this module lives in, started as a user would start it.
// testAddr is empty when it cannot run here (skipReason says why).
var (
	testAddr   string
	skipReason string
)

// TestMain starts one real server (the checkout's bin/deltagym serve:
// sandbox runtime, warm pools, private Postgres) for the package's
// integration tests and examples, and points $DELTAGYM_ADDR and
// $DELTAGYM_DATA at it so that examples Dial("") as a user would. Where it
// cannot run (not root, server, init or image not built), integration tests
// skip with the reason and the examples are left out of the run.
func TestMain(m *testing.M) {
	flag.Parse()
	stop, err := startTestServer()
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

// checkoutRoot is the repository this module is part of (clients/go/deltagym
// is three levels below it).
func checkoutRoot() (string, error) {
	return filepath.Abs(filepath.Join("..", "..", ".."))
}

// startTestServer starts the server, or sets skipReason.
func startTestServer() (stop func() error, err error) {
	none := func() error { return nil }
	if testing.Short() {
		skipReason = "the server needs root, a built server and Postgres: not in the unit tier (-short)"
		return none, nil
	}
	if os.Geteuid() != 0 {
		skipReason = "the server needs root (namespaces, mounts, cgroups)"
		return none, nil
	}
	root, err := checkoutRoot()
	if err != nil {
		return none, err
	}
	bin := filepath.Join(root, "bin", "deltagym")
	initBin := os.Getenv("DELTAGYM_INIT")
	if initBin == "" {
		initBin = filepath.Join(root, "bin", "dg-init")
	}
	image := filepath.Join(root, ".data", "images", "default")
	if d := os.Getenv("DATA"); d != "" {
		image = filepath.Join(d, "images", "default")
	}
	for _, need := range []struct{ path, hint string }{
		{bin, "the server is not built (make build)"},
		{initBin, "the sandbox init is not built (make init)"},
		{filepath.Join(image, "rootfs"), "the default image is not built (make image)"},
	} {
		if _, err := os.Stat(need.path); err != nil {
			skipReason = need.hint
			return none, nil
		}
	}
	data, err := os.MkdirTemp("", "dgclient-")
	if err != nil {
		return none, err
	}
	purge := func() error {
		out, perr := exec.Command(bin, "purge", "--data", data).CombinedOutput()
		if perr != nil {
			perr = fmt.Errorf("purge: %w: %s", perr, out)
		}
		return errors.Join(perr, os.RemoveAll(data))
	}
	if err := os.MkdirAll(filepath.Join(data, "images"), 0o755); err != nil {
		return none, errors.Join(err, purge())
	}
	if err := os.Symlink(image, filepath.Join(data, "images", "default")); err != nil {
		return none, errors.Join(err, purge())
	}
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return none, errors.Join(err, purge())
	}
	addr := ln.Addr().String()
	ln.Close()
	envs, err := filepath.Abs(filepath.Join("testdata", "envs"))
	if err != nil {
		return none, errors.Join(err, purge())
	}
	log, err := os.Create(filepath.Join(data, "server.log"))
	if err != nil {
		return none, errors.Join(err, purge())
	}
	cmd := exec.Command(bin, "serve", "--addr", addr, "--data", data, "--envs", envs, "--init", initBin,
		"--lease-ttl", testLeaseTTL.String(), "--acquire-timeout", "1m")
	cmd.Env = append(os.Environ(), "DELTAGYM_TOKEN=")
	cmd.Stdout, cmd.Stderr = log, log
	cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true}
	if err := cmd.Start(); err != nil {
		log.Close()
		return none, errors.Join(err, purge())
	}
	exited := make(chan error, 1)
	go func() { exited <- cmd.Wait() }()
	stop = func() error {
		_ = cmd.Process.Signal(syscall.SIGTERM)
		var werr error
		select {
		case werr = <-exited:
		case <-time.After(time.Minute):
			_ = cmd.Process.Kill()
			werr = errors.Join(errors.New("the server did not stop within a minute"), <-exited)
		}
		log.Close()
		if werr != nil {
			if b, err := os.ReadFile(log.Name()); err == nil {
				os.Stderr.Write(b)
			}
		}
		return errors.Join(werr, purge())
	}
	// Clients find the server's token in its data directory, as a user's
	// find .data/token of `make run`.
	os.Setenv("DELTAGYM_ADDR", addr)
	os.Setenv("DELTAGYM_DATA", data)
	if err := waitReady(addr, exited); err != nil {
		return none, errors.Join(err, stop())
	}
	testAddr = addr
	return stop, nil
}

// waitReady waits until the server answers ListEnvs with every env warm.
func waitReady(addr string, exited chan error) error {
	deadline := time.Now().Add(3 * time.Minute)
	tick := time.NewTicker(50 * time.Millisecond)
	defer tick.Stop()
	for {
		// Dialled each time: the server writes its token file as it starts.
		c, err := deltagym.Dial(addr, deltagym.WithRetry(1, 0))
		if err != nil {
			return err
		}
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		envs, err := c.ListEnvs(ctx)
		cancel()
		c.Close()
		ready := err == nil && len(envs) > 0
		for _, e := range envs {
			ready = ready && e.GetWarmCount() > 0
		}
		if ready {
			return nil
		}
		select {
		case werr := <-exited:
			exited <- werr // for the stop that follows
			return fmt.Errorf("the server exited while starting: %v", werr)
		case <-tick.C:
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("the server is not ready after 3 minutes (last: %v)", err)
		}
	}
}

// needServer skips t when the server cannot run here.
func needServer(t *testing.T) {
	t.Helper()
	if testAddr == "" {
		t.Skipf("needs the test server: %s", skipReason)
	}
}
