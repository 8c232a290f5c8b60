package envpool

import (
	"errors"
	"fmt"
	"strings"
	"testing"

	"github.com/deltagym/deltagym/internal/errdefs"
	"github.com/deltagym/deltagym/sandbox"
)

// An env not ready is FailedPrecondition whatever its cause's class, and keeps the cause.
func TestNotReadyClass(t *testing.T) {
	cause := fmt.Errorf("image %q: %w", "img", sandbox.ErrNotFound)
	err := fmt.Errorf("reset: %w", notReady("env e: creating setup sandbox", cause))
	if c := errdefs.Class(err); c != errdefs.ErrFailedPrecondition {
		t.Fatalf("class %v, want failed precondition", c)
	}
	if !errors.Is(err, ErrNotReady) || !errors.Is(err, sandbox.ErrNotFound) {
		t.Fatal("the error lost ErrNotReady or its cause")
	}
	if msg := err.Error(); !strings.Contains(msg, "creating setup sandbox") || !strings.Contains(msg, `image "img"`) || !strings.HasSuffix(msg, "env not ready: failed precondition") {
		t.Fatalf("message %q", msg)
	}
}

func TestDescribeExit(t *testing.T) {
	for _, tc := range []struct {
		res  sandbox.ExecResult
		want string
	}{
		{sandbox.ExecResult{ExitCode: 1}, "exited 1"},
		{sandbox.ExecResult{ExitCode: 2, Stderr: []byte("no such file\n")}, "exited 2, stderr: no such file"},
		{sandbox.ExecResult{TimedOut: true}, "timed out"},
		{sandbox.ExecResult{Signal: "KILL"}, "killed by signal KILL"},
	} {
		if got := describeExit(tc.res); got != tc.want {
			t.Errorf("describeExit(%+v) = %q, want %q", tc.res, got, tc.want)
		}
	}
}
