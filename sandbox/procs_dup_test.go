package sandbox_test

import (
	"context"
	"testing"

	"github.com/deltagym/deltagym/sandbox"
)

// A process whose stdout and stderr are one open file (`> log 2>&1`) is
// copied with one open file at both, one offset: what it writes to each
// after a restore follows what it wrote before, nothing written over.
func TestTemplateDupStdio(t *testing.T) {
	b := setup(t)
	ctx := context.Background()
	s := b.create(t, sandbox.Spec{Image: defaultImage(t, b)})
	const prog = `python3 -c '
import os, signal, sys
def say(*_):
    sys.stdout.write("out\n"); sys.stdout.flush()
    sys.stderr.write("err\n"); sys.stderr.flush()
signal.signal(signal.SIGUSR1, say)
print("start", flush=True)
open("/tmp/ready", "w").close()
while True: signal.pause()
' > /tmp/o.log 2>&1`
	_, err := s.Exec(ctx, sandbox.ExecRequest{Command: prog, Background: true})
	must(t, err)
	waitFor(t, s, "[ -e /tmp/ready ]")
	ck, err := s.Checkpoint(ctx)
	must(t, err)
	if len(ck.Processes) != 1 || ck.Processes[0].Method.String() != "template" {
		t.Fatalf("captured %+v, want one template", ck.Processes)
	}
	must(t, s.Restore(ctx, ck.ID))
	// The live copy takes the signal; the checkpoint's template refuses it.
	sh(t, s, "pkill -USR1 -x python3 2>/dev/null; while [ \"$(wc -l < /tmp/o.log)\" -lt 3 ]; do sleep 0.01; done")
	if got, want := sh(t, s, "cat /tmp/o.log"), "start\nout\nerr\n"; got != want {
		t.Fatalf("the log reads %q, want %q", got, want)
	}
}
