package sandbox_test

import (
	"os"
	"path/filepath"
	"regexp"
	"strings"
	"testing"

	"github.com/deltagym/deltagym/sandbox"
)

// A durable checkpoint answers once its processes are saved, and says
// which could not be and why: a process holding a pidfd of the sandbox's
// init, which CRIU cannot save, is kept by template only (the checkpoint
// stands and restores in place), its reason naming CRIU's cause and a log
// that is there to read; a plain one beside it is saved.
func TestDurableTellsUnsaved(t *testing.T) {
	needCRIU(t)
	b := setup(t)
	s := b.create(t, sandbox.Spec{Image: defaultImage(t, b)})
	ctx := t.Context()
	for _, prog := range []string{
		beatPy("plain", ""),
		beatPy("pidfd", "fd = os.pidfd_open(1)"),
	} {
		if _, err := s.Exec(ctx, sandbox.ExecRequest{Argv: []string{"python3", "-c", prog}, Background: true}); err != nil {
			t.Fatal(err)
		}
	}
	waitFor(t, s, "[ -e /tmp/beat-plain ] && [ -e /tmp/beat-pidfd ]")
	ck, err := s.CheckpointWith(ctx, sandbox.CheckpointOptions{Durable: true})
	if err != nil {
		t.Fatal(err)
	}
	t.Logf("processes: %+v", ck.Processes)
	if len(ck.Processes) != 2 {
		t.Fatalf("captured %+v", ck.Processes)
	}
	logRE := regexp.MustCompile(`^CRIU could not save it: pidfd: .*\(CRIU's log: ([^ )]+)\)$`)
	var refused, with int
	for _, p := range ck.Processes {
		if p.Saved {
			t.Errorf("pid %d saved, though a checkpoint's processes are saved together and one cannot be: %+v", p.Pid, p)
			continue
		}
		if m := logRE.FindStringSubmatch(p.Unsaved); m != nil {
			refused++
			if _, err := os.Stat(m[1]); err != nil {
				t.Errorf("the log the reason names: %v", err)
			}
			continue
		}
		if !strings.HasPrefix(p.Unsaved, "not saved: a checkpoint's processes are saved together, and pid ") {
			t.Errorf("pid %d unsaved for %q", p.Pid, p.Unsaved)
		}
		with++
	}
	if refused != 1 || with != 1 {
		t.Fatalf("reasons %+v: want CRIU's cause and log for the process with the pidfd, and the other saved with it", ck.Processes)
	}
	// The checkpoint stands: a restore in place brings both back.
	sh(t, s, "pkill python3")
	if err := s.Restore(ctx, ck.ID); err != nil {
		t.Fatal(err)
	}
	sh(t, s, "rm /tmp/beat-plain /tmp/beat-pidfd")
	waitFor(t, s, "[ -e /tmp/beat-plain ] && [ -e /tmp/beat-pidfd ]")
	// Without the pidfd, the durable checkpoint saves them all.
	sh(t, s, "pkill -f beat-pidfd")
	ck2, err := s.CheckpointWith(ctx, sandbox.CheckpointOptions{Durable: true})
	if err != nil {
		t.Fatal(err)
	}
	if len(ck2.Processes) != 1 || !ck2.Processes[0].Saved || ck2.Processes[0].Unsaved != "" {
		t.Fatalf("durable checkpoint of a plain process: %+v", ck2.Processes)
	}
	// CRIU's refusal stands: the sandbox's teardown does not ask again
	// (one log of a failed request, the durable checkpoint's).
	if err := s.Destroy(ctx); err != nil {
		t.Fatal(err)
	}
	<-s.Done()
	logs, err := filepath.Glob(filepath.Join(b.cfg.DataDir, "store", "criu-logs", "*.log"))
	if err != nil || len(logs) != 1 {
		t.Fatalf("logs of failed CRIU requests: %v %v, want the durable checkpoint's alone", logs, err)
	}
}

// beatPy is a program that runs setup, then writes /tmp/beat-<name> every
// 10 ms.
func beatPy(name, setup string) string {
	return "import os, time\n" + setup + "\nwhile True:\n    open('/tmp/beat-" + name + "', 'w').close()\n    time.sleep(0.01)\n"
}

// A process with a file of the sandbox's /dev/shm mapped (POSIX shared
// memory) is saved by a durable checkpoint, and by a CRIU one: the
// checkpoint carries /dev/shm, so its image restores in any sandbox
// (TestShmMappedByProcess restores it).
func TestDurableShmSaved(t *testing.T) {
	needCRIU(t)
	b := setup(t)
	s := b.create(t, sandbox.Spec{Image: defaultImage(t, b)})
	ctx := t.Context()
	prog := beatPy("shm", "import mmap\nf = open('/dev/shm/seg', 'w+b')\nf.truncate(4096)\nm = mmap.mmap(f.fileno(), 4096)")
	if _, err := s.Exec(ctx, sandbox.ExecRequest{Argv: []string{"python3", "-c", prog}, Background: true}); err != nil {
		t.Fatal(err)
	}
	waitFor(t, s, "[ -e /tmp/beat-shm ]")
	for _, o := range []sandbox.CheckpointOptions{{Durable: true}, {Processes: sandbox.ProcessesCRIU}} {
		ck, err := s.CheckpointWith(ctx, o)
		if err != nil {
			t.Fatal(err)
		}
		if len(ck.Processes) != 1 || !ck.Processes[0].Saved || ck.Processes[0].Unsaved != "" {
			t.Fatalf("checkpoint %+v: %+v, want saved", o, ck.Processes)
		}
	}
}
