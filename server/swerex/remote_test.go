package swerex_test

import (
	"context"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"connectrpc.com/connect"

	deltagymv1 "github.com/deltagym/deltagym/clients/go/gen/deltagym/v1"
)

// pythonEnv names the python of the venv with swe-rex's client (mk/swerex.mk sets it).
const pythonEnv = "DELTAGYM_SWEREX_PYTHON"

// swerexPython returns the python that has swe-rex's client. Under make, as root, a missing one
// fails the test (make test builds it); elsewhere the test skips, saying how to get it.
func swerexPython(t *testing.T) string {
	t.Helper()
	py := os.Getenv(pythonEnv)
	if py == "" {
		if os.Geteuid() == 0 && os.Getenv("MAKELEVEL") != "" {
			t.Fatalf("%s is not set: make test sets it to the python of .cache/swerex-venv (mk/swerex.mk)", pythonEnv)
		}
		t.Skipf("%s is not set: `make swerex-venv` builds swe-rex's client and mk/swerex.mk names its python", pythonEnv)
	}
	if _, err := os.Stat(py); err != nil {
		t.Fatalf("%s=%s: %v (make swerex-venv builds it)", pythonEnv, py, err)
	}
	return py
}

// swe-rex 1.4.0's own RemoteRuntime, unchanged, drives a sandbox over a real socket: sessions
// (cd and exports persist, exit codes, check, a timeout, an interactive python with expect,
// input, an interrupt and a quit, close), files (write, read, errors, a directory and a file
// uploaded), execute, and close, which ends the sandbox; a wrong token raises PermissionError.
// Every command and file action is a step of the sandbox's episode in the ledger, with its
// output.
func TestRemoteRuntime(t *testing.T) {
	needServer(t)
	py := swerexPython(t)
	id, ep := lease(t)
	ctx, cancel := context.WithTimeout(t.Context(), 3*time.Minute)
	defer cancel()
	cmd := exec.CommandContext(ctx, py, filepath.Join("testdata", "remote_runtime.py"), "http://"+srv.Addr+"/swerex/"+id, testToken, t.TempDir())
	out, err := cmd.CombinedOutput()
	if err != nil || !strings.HasSuffix(string(out), "ok\n") {
		t.Fatalf("remote_runtime.py: %v\n%s", err, out)
	}

	_, ledger := clients()
	tr, err := ledger.GetTrajectory(t.Context(), connect.NewRequest(&deltagymv1.GetTrajectoryRequest{EpisodeId: ep}))
	if err != nil {
		t.Fatal(err)
	}
	if st := tr.Msg.GetEpisode().GetStatus(); st != deltagymv1.EpisodeStatus_EPISODE_STATUS_TRUNCATED {
		t.Errorf("episode status after /close: %v, want truncated", st)
	}
	var saw struct{ session, interactive, write, read, upload, execute bool }
	for _, s := range tr.Msg.GetSteps() {
		a, o := s.GetAction(), s.GetObservation()
		x, r := a.GetExec(), o.GetExec()
		switch {
		case x.GetSession() == "swerex.default" && x.GetCommand() == "pwd; echo $FOO":
			saw.session = string(r.GetStdout()) == "/tmp\nbar\n"
		case x.GetSession() == "swerex.default" && x.GetCommand() == "print(x)":
			// Answered at the prompt: the ledger says so, and that python still runs.
			saw.interactive = strings.HasPrefix(string(r.GetStdout()), "42\n") && r.GetMatched() != "" && r.GetRunning()
		case a.GetWriteFile().GetPath() == "/work/notes/a.txt":
			saw.write = string(a.GetWriteFile().GetContent()) == "hello\nwörld\n"
		case a.GetReadFile().GetPath() == "/work/notes/a.txt":
			saw.read = string(o.GetReadFile().GetContent()) == "hello\nwörld\n"
		case a.GetWriteFile().GetPath() == "/work/up/sub/b.sh":
			saw.upload = a.GetWriteFile().GetMode() == 0o755
		case strings.Join(x.GetArgv(), " ") == "echo hi":
			saw.execute = string(r.GetStdout()) == "hi\n"
		}
	}
	if !saw.session || !saw.interactive || !saw.write || !saw.read || !saw.upload || !saw.execute {
		t.Fatalf("the ledger's steps lack some of the client's actions with their outputs (%+v): %d steps", saw, len(tr.Msg.GetSteps()))
	}
}
