package sandbox_test

import (
	"context"
	"fmt"
	"strings"
	"testing"

	"github.com/deltagym/deltagym/sandbox"
)

// treeChildPid is a shell word: the pid of the live tree's python3 child
// (its template, which ps lists too, leads a session of its own).
const treeChildPid = `$(for p in $(pgrep -x python3); do [ "$(ps -o sid= -p $p | tr -d ' ')" != $p ] && echo $p; done)`

// treeProgram is a shell running a python3 child, then a command of its
// own once the child ends. The child keeps a counter in memory, adds one
// at each SIGUSR1, and writes it to /tmp/counter at each SIGUSR2; the
// shell writes the child's exit status to /tmp/done.
const treeProgram = `python3 -c '
import os, signal
n = [0]
def add(*_): n[0] += 1
def tell(*_):
    with open("/tmp/counter.tmp", "w") as f: f.write("%d %d %d" % (n[0], os.getpid(), os.getppid()))
    os.rename("/tmp/counter.tmp", "/tmp/counter")
signal.signal(signal.SIGUSR1, add)
signal.signal(signal.SIGUSR2, tell)
open("/tmp/ready", "w").close()
while True: signal.pause()
'; echo "status $?" > /tmp/done`

// TestTreeCopy restores a shell and its child in place by copies of their
// templates, three times over and again from a checkpoint of a copy:
// each restore has the checkpoint's pids, parent links, session and
// memory, the shell waits for its child as before (it runs its next
// command when the child ends), and the templates are unchanged by what
// the copies did. Once with the root's memory stashed in the child's
// template, once (no room for the stash) copied at each restore.
func TestTreeCopy(t *testing.T) {
	t.Run("stashed", func(t *testing.T) { testTreeCopy(t, true) })
	t.Run("copied", func(t *testing.T) { testTreeCopy(t, false) })
}

func testTreeCopy(t *testing.T, stashed bool) {
	needCRIU(t)
	b := setup(t)
	if !stashed {
		b.rt.NoMemoryRoom()
	}
	ctx := context.Background()
	s := b.create(t, sandbox.Spec{Image: defaultImage(t, b)})
	_, err := s.Exec(ctx, sandbox.ExecRequest{Argv: []string{"sh", "-c", treeProgram}, Background: true})
	must(t, err)
	waitFor(t, s, "[ -e /tmp/ready ]")
	// The live child: the templates, which ps lists too, lead sessions of
	// their own.
	ids := func() string {
		return sh(t, s, "c="+treeChildPid+"; ps -o pid=,ppid=,pgid=,sid=,comm= -p $c,$(ps -o ppid= -p $c | tr -d ' ')")
	}
	signal := func(sig string) { sh(t, s, "kill -"+sig+" "+treeChildPid) }
	// counter asks the child for its counter; it returns "n pid ppid".
	counter := func() string {
		return sh(t, s, "rm -f /tmp/counter; kill -USR2 "+treeChildPid+"; while [ ! -e /tmp/counter ]; do sleep 0.01; done; cat /tmp/counter")
	}
	signal("USR1")
	want, wantIDs := counter(), ids()
	if !strings.HasPrefix(want, "1 ") {
		t.Fatalf("the child's counter before the checkpoint: %q", want)
	}
	ck, err := s.Checkpoint(ctx)
	must(t, err)
	if got := s.TreeStashes(); got != map[bool]int64{true: 1}[stashed] {
		t.Fatalf("%d tree templates with a stash, stashed %v", got, stashed)
	}
	for i := range 3 {
		// Changed: the counter, and, the second time, the child gone
		// and the shell run to its end.
		signal("USR1")
		signal("USR1")
		if i == 1 {
			signal("TERM")
			sh(t, s, "while [ ! -e /tmp/done ]; do sleep 0.01; done")
		}
		copies := s.TreeCopies()
		must(t, s.Restore(ctx, ck.ID))
		if s.TreeCopies() != copies+1 {
			t.Fatalf("restore %d: the tree was not copied from its templates", i)
		}
		if got := ids(); got != wantIDs {
			t.Fatalf("restore %d: the processes are\n%s\nnot, as at the checkpoint,\n%s", i, got, wantIDs)
		}
		if got := counter(); got != want {
			t.Fatalf("restore %d: the child's counter, pid and parent %q, want %q", i, got, want)
		}
	}
	// The shell waits for the copy of its child, which it forked as far
	// as it knows: it runs on when the child ends.
	signal("TERM")
	sh(t, s, "while [ ! -e /tmp/done ]; do sleep 0.01; done")
	if got := strings.TrimSpace(sh(t, s, "cat /tmp/done")); got != fmt.Sprintf("status %d", 128+15) {
		t.Fatalf("the shell saw its child end with %q", got)
	}
	// A checkpoint of a copied tree is copied in turn.
	must(t, s.Restore(ctx, ck.ID))
	signal("USR1")
	want2 := counter()
	ck2, err := s.Checkpoint(ctx)
	must(t, err)
	signal("USR1")
	copies := s.TreeCopies()
	must(t, s.Restore(ctx, ck2.ID))
	if s.TreeCopies() != copies+1 {
		t.Fatal("a checkpoint of a copied tree was not copied from its templates")
	}
	if got := counter(); got != want2 {
		t.Fatalf("the copy of the copy: counter %q, want %q", got, want2)
	}
}

// A file the shell and its child share, one open description with one
// offset (`exec 3>log`, which the child inherits), is shared by their
// copies too: what the child's copy writes after a restore is not written
// over by what the shell writes once the child ends.
func TestTreeCopySharedFile(t *testing.T) {
	needCRIU(t)
	b := setup(t)
	ctx := context.Background()
	s := b.create(t, sandbox.Spec{Image: defaultImage(t, b)})
	const prog = `exec 3>/tmp/log; python3 -c '
import os, signal
def add(*_): os.write(3, b"child\n")
signal.signal(signal.SIGUSR1, add)
os.write(3, b"start\n")
open("/tmp/ready", "w").close()
while True: signal.pause()
'; echo shell >&3; echo ended > /tmp/done`
	_, err := s.Exec(ctx, sandbox.ExecRequest{Argv: []string{"sh", "-c", prog}, Background: true})
	must(t, err)
	waitFor(t, s, "[ -e /tmp/ready ]")
	ck, err := s.Checkpoint(ctx)
	must(t, err)
	sh(t, s, "kill -USR1 "+treeChildPid) // changed after the checkpoint, undone by the restore
	copies := s.TreeCopies()
	must(t, s.Restore(ctx, ck.ID))
	if s.TreeCopies() != copies+1 {
		t.Fatal("the tree was not copied from its templates")
	}
	sh(t, s, "kill -USR1 "+treeChildPid+"; while [ \"$(wc -l < /tmp/log)\" -lt 2 ]; do sleep 0.01; done; kill "+treeChildPid)
	sh(t, s, "while [ ! -e /tmp/done ]; do sleep 0.01; done")
	if got := sh(t, s, "cat /tmp/log"); got != "start\nchild\nshell\n" {
		t.Fatalf("the shared log reads %q, want %q", got, "start\nchild\nshell\n")
	}
}

// The usual service line, `sh -c 'python3 app.py > log 2>&1; echo done'`:
// the shell keeps its own stdout and stderr at other descriptors (dash at
// 10 and 11) while its child's go to the log, so the root has files its
// child has not. The copy of the root opens them again (here /dev/null),
// and the tree is copied from templates all the same.
func TestTreeCopyRedirected(t *testing.T) {
	needCRIU(t)
	b := setup(t)
	ctx := context.Background()
	s := b.create(t, sandbox.Spec{Image: defaultImage(t, b)})
	const prog = `python3 -c '
import os, signal, sys
def say(*_): print("line", flush=True)
signal.signal(signal.SIGUSR1, say)
print("start", flush=True)
open("/tmp/ready", "w").close()
while True: signal.pause()
' > /tmp/app.log 2>&1; echo "status $?" > /tmp/done`
	_, err := s.Exec(ctx, sandbox.ExecRequest{Argv: []string{"sh", "-c", prog}, Background: true})
	must(t, err)
	waitFor(t, s, "[ -e /tmp/ready ]")
	ck, err := s.Checkpoint(ctx)
	must(t, err)
	for _, p := range ck.Processes {
		if !strings.Contains(p.Reason, "copied from templates in a restore in place") {
			t.Fatalf("pid %d: %q", p.Pid, p.Reason)
		}
	}
	sh(t, s, "kill -USR1 "+treeChildPid) // undone by the restore
	copies := s.TreeCopies()
	must(t, s.Restore(ctx, ck.ID))
	if s.TreeCopies() != copies+1 {
		t.Fatal("the tree was not copied from its templates")
	}
	sh(t, s, "kill -USR1 "+treeChildPid+"; while [ \"$(wc -l < /tmp/app.log)\" -lt 2 ]; do sleep 0.01; done; kill "+treeChildPid)
	sh(t, s, "while [ ! -e /tmp/done ]; do sleep 0.01; done")
	// The shell's own "Terminated" goes to its stderr, the log then, after
	// the child's line: one open file, one offset, as `2>&1` made it.
	if got, want := sh(t, s, "cat /tmp/app.log; cat /tmp/done"), "start\nline\nTerminated\nstatus 143\n"; got != want {
		t.Fatalf("the log and the shell's end read %q, want %q", got, want)
	}
}
