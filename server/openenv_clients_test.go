package server_test

import (
	"bytes"
	"context"
	"encoding/json"
	"os"
	"os/exec"
	"path/filepath"
	"testing"
	"time"

	"github.com/deltagym/deltagym/server"
)

// clientPython returns the python of a pinned client venv (mk/openenv.mk exports its path in
// variable), or skips t outside make; under make (MAKELEVEL set) a missing venv fails t: the
// suite must not pass without the clients it is to be tested with.
func clientPython(t *testing.T, variable string) string {
	t.Helper()
	py := os.Getenv(variable)
	if py == "" {
		if os.Getenv("MAKELEVEL") != "" {
			t.Fatalf("$%s is not set: run the tests through make (mk/openenv.mk builds the venvs and sets it)", variable)
		}
		t.Skipf("$%s is not set: `make openenv-venvs` builds the pinned client venvs; make test sets it", variable)
	}
	if _, err := os.Stat(py); err != nil {
		t.Fatalf("$%s: %v (make openenv-venvs builds it)", variable, err)
	}
	return py
}

// runClient runs a client program of server/openenv/testdata/clients against b's env env and
// checks its result line; every sandbox it saw must be closed once it has exited.
func runClient(t *testing.T, b *bundle, py, program, env, token string) {
	t.Helper()
	ctx, cancel := context.WithTimeout(t.Context(), 5*time.Minute)
	defer cancel()
	args := []string{filepath.Join("openenv", "testdata", "clients", program), "http://" + b.addr + "/openenv/" + env}
	if token != "" {
		args = append(args, token)
	}
	cmd := exec.CommandContext(ctx, py, args...)
	var stdout, stderr bytes.Buffer
	cmd.Stdout, cmd.Stderr = &stdout, &stderr
	err := cmd.Run()
	lines := bytes.Split(bytes.TrimSpace(stdout.Bytes()), []byte("\n"))
	var res struct {
		OK         bool     `json:"ok"`
		Checks     []string `json:"checks"`
		SandboxIDs []string `json:"sandbox_ids"`
		Error      string   `json:"error"`
	}
	if jerr := json.Unmarshal(lines[len(lines)-1], &res); jerr != nil || err != nil || !res.OK {
		t.Fatalf("%s: %v; result %s\nstderr:\n%s", program, err, stdout.Bytes(), stderr.Bytes())
	}
	t.Logf("%s: %d checks passed: %v", program, len(res.Checks), res.Checks)
	if len(res.SandboxIDs) == 0 {
		t.Fatalf("%s saw no sandbox", program)
	}
	for _, id := range res.SandboxIDs {
		waitUnleased(t, b, id)
	}
}

// TestOpenEnvClients drives the server with OpenEnv's own clients, from PyPI, unchanged:
// openenv 0.10.0 with auth on and off, openenv-core 0.3.0 through the URL token, and
// verifiers 0.4.0's openenv taskset running its rollout loop.
func TestOpenEnvClients(t *testing.T) {
	if raceEnabled {
		// make test runs them in the plain tier; the race tier's own tests drive the same code.
		t.Skip("the OpenEnv client programs run in the tier without the race detector")
	}
	py010 := clientPython(t, "DELTAGYM_OPENENV010_PYTHON")
	py030 := clientPython(t, "DELTAGYM_OPENENV030_PYTHON")
	pyVerifiers := clientPython(t, "DELTAGYM_VERIFIERS040_PYTHON")
	b := setup(t, nil)
	t.Run("openenv010", func(t *testing.T) { runClient(t, b, py010, "openenv010.py", "plain", b.token) })
	t.Run("openenv030", func(t *testing.T) { runClient(t, b, py030, "openenv030.py", "plain", b.token) })
	t.Run("verifiers040", func(t *testing.T) { runClient(t, b, pyVerifiers, "verifiers040.py", "plain", b.token) })
	t.Run("openenv010/no-auth", func(t *testing.T) {
		open := setup(t, func(c *server.Config) { c.NoAuth = true })
		runClient(t, open, py010, "openenv010.py", "plain", "")
	})
}
