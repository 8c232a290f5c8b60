package sandbox_test

import (
	"fmt"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/deltagym/deltagym/sandbox"
)

// leftoverPy writes to stdout and stderr and touches /tmp/beat-<name>
// every 5 ms, from a second thread when its second argument is "thread".
const leftoverPy = `
import sys, threading, time
def beat():
    while True:
        print("out", flush=True)
        print("err", file=sys.stderr, flush=True)
        open("/tmp/beat-" + sys.argv[1], "w").close()
        time.sleep(0.005)
if sys.argv[2] == "thread":
    threading.Thread(target=beat).start()
else:
    beat()
`

// An exec returns when its own process exits, as a terminal would: what
// it left running runs on, writing where background output goes (the null
// device), and a checkpoint, template or CRIU, takes it as any background
// command; the timeout still ends everything the command started.
func TestExecLeavesLeftovers(t *testing.T) {
	b := setup(t)
	s := b.create(t, sandbox.Spec{Image: defaultImage(t, b)})
	ctx := t.Context()
	if err := s.WriteFile(ctx, "/tmp/left.py", []byte(leftoverPy), 0o644, false); err != nil {
		t.Fatal(err)
	}
	for _, c := range []struct{ name, cmd string }{
		{"plain", "python3 /tmp/left.py plain single & echo started"},
		{"threaded", "python3 /tmp/left.py threaded thread & echo started"},
		{"nohup", "nohup python3 /tmp/left.py nohup single > /dev/null 2>&1 & echo started"},
		{"daemon", "(setsid python3 /tmp/left.py daemon single &) ; echo started"},
		{"stdin", "cat > /dev/null & python3 /tmp/left.py stdin single <&0 & echo started"},
		// A shell forking all the time: a tree, which CRIU saves.
		{"loop", "sh -c 'while :; do touch /tmp/beat-loop; sleep 0.01; done' & echo started"},
	} {
		req := sandbox.ExecRequest{Command: c.cmd, Timeout: 20 * time.Second}
		if c.name == "stdin" {
			req.Stdin = []byte("some input\n")
		}
		res, err := s.Exec(ctx, req)
		if err != nil || res.ExitCode != 0 || res.TimedOut {
			t.Fatalf("%s: %v %+v", c.name, err, res)
		}
		// The output is the command's and what the leftover wrote before
		// the exec returned, in whole lines: none cut off.
		if strings.Count(string(res.Stdout), "started\n") != 1 || strings.Count(string(res.Stdout), "out\n")*4+8 != len(res.Stdout) ||
			strings.Count(string(res.Stderr), "err\n")*4 != len(res.Stderr) {
			t.Fatalf("%s: stdout %q, stderr %q", c.name, res.Stdout, res.Stderr)
		}
		// It runs on, writing: its beat comes again after being removed.
		waitFor(t, s, "[ -e /tmp/beat-"+c.name+" ]")
		sh(t, s, "rm /tmp/beat-"+c.name)
		waitFor(t, s, "[ -e /tmp/beat-"+c.name+" ]")
	}
	// None holds a pipe of the server's: the descriptors that were the
	// exec's are the null device.
	out := sh(t, s, `for p in $(pgrep -x python3) $(pgrep -x cat) $(pgrep -f '[t]ouch /tmp/beat-loop'); do for f in 0 1 2; do readlink /proc/$p/fd/$f; done; done | sort | uniq -c`)
	if strings.Contains(out, "pipe:") || !strings.Contains(out, "/dev/null") {
		t.Fatalf("the leftovers' stdio: %q", out)
	}
	// A checkpoint takes them as background commands, with CRIU too.
	for _, mode := range []sandbox.ProcessMode{sandbox.ProcessesTemplate, sandbox.ProcessesCRIU} {
		if mode == sandbox.ProcessesCRIU && criuBinary() == "" {
			continue
		}
		ck, err := s.CheckpointWith(ctx, sandbox.CheckpointOptions{Processes: mode})
		if err != nil {
			t.Fatalf("checkpoint (mode %d) of the leftovers: %v", mode, err)
		}
		if len(ck.Processes) < 5 {
			t.Fatalf("checkpoint (mode %d) captured %+v", mode, ck.Processes)
		}
		sh(t, s, "pkill -x python3; pkill -x cat; pkill -f '[b]eat-loop'; true")
		if err := s.Restore(ctx, ck.ID); err != nil {
			t.Fatal(err)
		}
		sh(t, s, "rm -f /tmp/beat-*")
		waitFor(t, s, "[ -e /tmp/beat-plain ] && [ -e /tmp/beat-threaded ] && [ -e /tmp/beat-nohup ] && [ -e /tmp/beat-daemon ] && [ -e /tmp/beat-stdin ] && [ -e /tmp/beat-loop ]")
	}
	// The timeout ends the command and what it started.
	res, err := s.Exec(ctx, sandbox.ExecRequest{Command: "sleep 1001 & sleep 1002", Timeout: time.Second})
	if err != nil || !res.TimedOut {
		t.Fatalf("timed-out command: %v %+v", err, res)
	}
	if out := sh(t, s, "pgrep -f 'sleep 100[12]' || true"); out != "" {
		t.Fatalf("left after the timeout: %q", out)
	}
}

// A web server started as `nohup … &`, by a background command or as a
// plain command's leftover, is in every fork of a checkpoint, serving,
// and a durable checkpoint of it says it is saved.
func TestServerLeftoverForks(t *testing.T) {
	needCRIU(t)
	b := setup(t)
	ctx := t.Context()
	for _, background := range []bool{true, false} {
		s := b.create(t, sandbox.Spec{Image: defaultImage(t, b)})
		sh(t, s, "mkdir -p /srv && echo hello > /srv/index.txt")
		res, err := s.Exec(ctx, sandbox.ExecRequest{Command: "cd /srv && nohup python3 -m http.server 8000 > /dev/null 2>&1 &", Background: background})
		if err != nil || !background && res.ExitCode != 0 {
			t.Fatalf("starting the server (background %v): %v %+v", background, err, res)
		}
		const get = `python3 -c "import urllib.request; print(urllib.request.urlopen('http://127.0.0.1:8000/index.txt').read().decode(), end='')"`
		waitFor(t, s, "python3 -c \"import socket; socket.create_connection(('127.0.0.1', 8000))\" 2>/dev/null")
		ck, err := s.CheckpointWith(ctx, sandbox.CheckpointOptions{Durable: true})
		if err != nil {
			t.Fatal(err)
		}
		for _, p := range ck.Processes {
			if !p.Saved {
				t.Fatalf("background %v: durable checkpoint left %+v unsaved", background, p)
			}
		}
		kids, err := b.rt.Fork(ctx, ck.ID, 3, sandbox.Spec{})
		if err != nil {
			t.Fatal(err)
		}
		for i, k := range kids {
			if got := sh(t, k, get); got != "hello\n" {
				t.Fatalf("background %v: fork %d serves %q", background, i, got)
			}
			_ = k.Destroy(ctx)
		}
		if got := sh(t, s, get); got != "hello\n" {
			t.Fatalf("background %v: the sandbox serves %q", background, got)
		}
	}
}

// hidePy hands its stdout and stderr to a unix socket, in flight (never
// received), puts /dev/null in their place and says so: a reference to
// the exec's pipes that no process's descriptor table shows.
const hidePy = `
import array, os, socket, time
a, b = socket.socketpair()
a.sendmsg([b"x"], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", [1, 2]))])
n = os.open("/dev/null", os.O_RDWR)
os.dup2(n, 1)
os.dup2(n, 2)
open("/tmp/hidden", "w").close()
time.sleep(3600)
`

// zombieLeaderPy ends its main thread alone while another runs on: the
// process's leader is a zombie, its pid still listed in its group.
const zombieLeaderPy = `
import ctypes, threading, time
def run():
    while True:
        time.sleep(0.01)
threading.Thread(target=run).start()
open("/tmp/zl-ready", "w").close()
ctypes.CDLL(None).syscall(60, 0)
`

// Leftovers that hold the exec's output where the handover cannot reach
// it end with the command, and the exec returns; a process whose leader
// thread has exited ends with the timeout.
func TestExecLeftoversThatCannotStay(t *testing.T) {
	b := setup(t)
	s := b.create(t, sandbox.Spec{Image: defaultImage(t, b)})
	ctx := t.Context()
	for name, prog := range map[string]string{"/tmp/hide.py": hidePy, "/tmp/zl.py": zombieLeaderPy} {
		if err := s.WriteFile(ctx, name, []byte(prog), 0o644, false); err != nil {
			t.Fatal(err)
		}
	}
	res, err := s.Exec(ctx, sandbox.ExecRequest{Command: "python3 /tmp/hide.py & until [ -e /tmp/hidden ]; do sleep 0.01; done; echo main done", Timeout: 30 * time.Second})
	if err != nil || res.ExitCode != 0 || res.TimedOut || string(res.Stdout) != "main done\n" {
		t.Fatalf("exec whose leftover hides its pipes: %v %+v", err, res)
	}
	if out := sh(t, s, "pgrep -f '[h]ide.py' || true"); out != "" {
		t.Fatalf("the leftover that hid the exec's pipes runs on: %q", out)
	}
	res, err = s.Exec(ctx, sandbox.ExecRequest{Command: "python3 /tmp/zl.py & until [ -e /tmp/zl-ready ]; do sleep 0.01; done; sleep 1000", Timeout: 2 * time.Second})
	if err != nil || !res.TimedOut {
		t.Fatalf("timed-out exec with a process whose leader has exited: %v %+v", err, res)
	}
	if out := sh(t, s, "pgrep -f '[z]l.py' || true"); out != "" {
		t.Fatalf("left after the timeout: %q", out)
	}
}

// The groups kept for leftovers that have since exited are removed as
// they accumulate: a sandbox whose commands each leave a short-lived
// process does not gather a group per command.
func TestLeftoverGroupsSwept(t *testing.T) {
	b := setup(t)
	s := b.create(t, sandbox.Spec{})
	ctx := t.Context()
	for range 100 {
		res, err := s.Exec(ctx, sandbox.ExecRequest{Command: "sleep 0.01 & true"})
		if err != nil || res.ExitCode != 0 {
			t.Fatalf("%v %+v", err, res)
		}
		// The leftover has exited before the next command (whose group, left empty, is
		// reused, not kept), however slow the machine: every sweep finds its groups empty.
		res, err = s.Exec(ctx, sandbox.ExecRequest{Command: "while pgrep -x sleep >/dev/null; do :; done"})
		if err != nil || res.ExitCode != 0 {
			t.Fatalf("waiting for the leftover: %v %+v", err, res)
		}
	}
	// The exec groups of the sandbox's command group, in the tracking
	// hierarchy (cgroup v2 where mounted, else the v1 freezer's).
	var groups []string
	for _, pattern := range []string{"/sys/fs/cgroup/unified/%s/*/w*/e*", "/sys/fs/cgroup/%s/*/w*/e*", "/sys/fs/cgroup/freezer/%s/*/w*/e*"} {
		groups, _ = filepath.Glob(fmt.Sprintf(pattern, b.cfg.CgroupRoot))
		if len(groups) > 0 {
			break
		}
	}
	if len(groups) == 0 || len(groups) > 16 {
		t.Fatalf("%d exec groups after 100 commands that each left a process that exited soon", len(groups))
	}
}
