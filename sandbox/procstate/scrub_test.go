package procstate

import (
	"errors"
	"fmt"
	"testing"

	"golang.org/x/sys/unix"
)

// An error of ptfork's names host pids; scrubbed, it names none and still
// unwraps to its cause.
func TestScrubPids(t *testing.T) {
	err := scrubPids{fmt.Errorf("copying thread 4021 of pid 4020: seizing pid 4022: %w", unix.EPERM)}
	if got, want := err.Error(), "copying thread of the sandbox of pid of the sandbox: seizing pid of the sandbox: operation not permitted"; got != want {
		t.Fatalf("scrubbed %q, want %q", got, want)
	}
	if !errors.Is(err, unix.EPERM) {
		t.Fatal("the scrubbed error does not unwrap to its cause")
	}
}
