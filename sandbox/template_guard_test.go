package sandbox_test

import (
	"fmt"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/deltagym/deltagym/sandbox"
)

// victimPy writes its marker, held only in its memory, to /tmp/out at each
// line read from the FIFO /tmp/ctl.
const victimPy = `
import os
marker = bytearray(b"ORIGINAL-") + bytearray(b"VALUE-1234")
fd = os.open("/tmp/ctl", os.O_RDWR)
f = os.fdopen(fd, "r")
for line in f:
    with open("/tmp/out.new", "wb") as o:
        o.write(bytes(marker))
    os.rename("/tmp/out.new", "/tmp/out")
`

// tamperPy overwrites the marker in the memory of every victim process it
// can open, through /proc/PID/mem, and says for each whether it could.
const tamperPy = `
import os, re
me = os.getpid()
for pid in sorted(int(p) for p in os.listdir("/proc") if p.isdigit()):
    try:
        if b"victim.py" not in open(f"/proc/{pid}/cmdline", "rb").read() or pid == me:
            continue
    except OSError:
        continue
    try:
        mem = open(f"/proc/{pid}/mem", "r+b", buffering=0)
    except OSError as e:
        print(pid, "denied", e.errno)
        continue
    n = 0
    for line in open(f"/proc/{pid}/maps"):
        m = re.match(r"([0-9a-f]+)-([0-9a-f]+) rw", line)
        if not m:
            continue
        lo, hi = int(m.group(1), 16), int(m.group(2), 16)
        try:
            mem.seek(lo)
            data = mem.read(hi - lo)
        except OSError:
            continue
        at = data.find(b"ORIGINAL-VALUE-1234")
        while at >= 0:
            mem.seek(lo + at)
            mem.write(b"HACKED!!")
            n += 1
            at = data.find(b"ORIGINAL-VALUE-1234", at + 1)
    print(pid, "patched", n)
`

// A command of the sandbox cannot change a checkpoint's processes: their
// templates are not open to it (ptrace, /proc/PID/mem), so a restore and a
// fork bring back the memory the checkpoint saw, while the restored copy is
// the agent's own process again, open to it as the original was.
func TestTemplateGuard(t *testing.T) {
	b := setup(t)
	s := b.create(t, sandbox.Spec{Image: defaultImage(t, b)})
	ctx := t.Context()
	sh(t, s, "mkfifo /tmp/ctl")
	for name, src := range map[string]string{"/tmp/victim.py": victimPy, "/tmp/tamper.py": tamperPy} {
		if err := s.WriteFile(ctx, name, []byte(src), 0o644, false); err != nil {
			t.Fatal(err)
		}
	}
	if _, err := s.Exec(ctx, sandbox.ExecRequest{Argv: []string{"python3", "/tmp/victim.py"}, Background: true}); err != nil {
		t.Fatal(err)
	}
	poke := func(s *sandbox.Sandbox, want string) {
		t.Helper()
		sh(t, s, "rm -f /tmp/out; echo go > /tmp/ctl")
		waitFor(t, s, "[ -e /tmp/out ]")
		if got := sh(t, s, "cat /tmp/out"); got != want {
			t.Fatalf("the victim wrote %q, want %q", got, want)
		}
	}
	poke(s, "ORIGINAL-VALUE-1234")
	ck, err := s.Checkpoint(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if len(ck.Processes) != 1 || ck.Processes[0].Method != sandbox.CaptureTemplate {
		t.Fatalf("captured %+v", ck.Processes)
	}
	// The live process and its template: the agent may change its own
	// process, never the template.
	out := sh(t, s, "python3 /tmp/tamper.py")
	if !tampered(out, 1) || strings.Count(out, "denied") != 1 {
		t.Fatalf("tampering with the live process and its template:\n%s", out)
	}
	poke(s, "HACKED!!-VALUE-1234")
	kids, err := b.rt.Fork(ctx, ck.ID, 1, sandbox.Spec{})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = kids[0].Destroy(t.Context()) })
	for round := range 2 {
		if err := s.Restore(ctx, ck.ID); err != nil {
			t.Fatal(err)
		}
		poke(s, "ORIGINAL-VALUE-1234")
		// The restored copy is the agent's again (dumpable, as the
		// original was); its template still is not.
		out := sh(t, s, "python3 /tmp/tamper.py")
		if !tampered(out, 1) || strings.Count(out, "denied") < 1 {
			t.Fatalf("round %d: tampering after the restore:\n%s", round, out)
		}
	}
	poke(kids[0], "ORIGINAL-VALUE-1234")
}

// tampered reports whether tamperPy's output says it patched the marker in
// exactly n processes.
func tampered(out string, n int) bool {
	got := 0
	for _, line := range strings.Split(out, "\n") {
		if f := strings.Fields(line); len(f) == 3 && f[1] == "patched" && f[2] != "0" {
			got++
		}
	}
	return got == n
}

// attackPy tries, on every counter.py process but itself, what a command
// could do to a process it sees: scheduling and limits changed, ptrace, a
// stop, pidfd_open, a pidfd of its /proc directory signalled, kill. One
// line per process: its pid, then name=errno (0 for success) per attempt.
const attackPy = `
import ctypes, os, resource, signal
libc = ctypes.CDLL(None, use_errno=True)
def errno_of(f):
    try:
        f()
        return 0
    except OSError as e:
        return e.errno
def ptrace(pid):
    if libc.ptrace(16, pid, None, None) != 0:  # PTRACE_ATTACH
        raise OSError(ctypes.get_errno(), "ptrace")
    libc.ptrace(17, pid, None, None)  # PTRACE_DETACH
for pid in sorted(int(p) for p in os.listdir("/proc") if p.isdigit()):
    try:
        if b"counter.py" not in open(f"/proc/{pid}/cmdline", "rb").read():
            continue
    except OSError:
        continue
    r = []
    r.append(("nice", errno_of(lambda: os.setpriority(os.PRIO_PROCESS, pid, 19))))
    r.append(("prlimit", errno_of(lambda: resource.prlimit(pid, resource.RLIMIT_NOFILE, (16, 16)))))
    r.append(("affinity", errno_of(lambda: os.sched_setaffinity(pid, {0}))))
    r.append(("ptrace", errno_of(lambda: ptrace(pid))))
    r.append(("pidfd_open", errno_of(lambda: os.close(os.pidfd_open(pid)))))
    def procfd():
        fd = os.open(f"/proc/{pid}", os.O_RDONLY | os.O_DIRECTORY)
        try:
            signal.pidfd_send_signal(fd, signal.SIGSTOP)
        finally:
            os.close(fd)
    r.append(("procfd", errno_of(procfd)))
    r.append(("tgkill", errno_of(lambda: _tgkill(pid))))
    r.append(("kill", errno_of(lambda: os.kill(pid, signal.SIGKILL))))
    print(pid, " ".join(f"{n}={e}" for n, e in r))
`

// tgkillPy defines _tgkill, tgkill(pid, pid, SIGCONT) through libc.
const tgkillPy = `
def _tgkill(pid):
    if libc.syscall(234, pid, pid, 18) != 0:
        raise OSError(ctypes.get_errno(), "tgkill")
`

// An acknowledged checkpoint's processes stay restorable whatever a command
// does to the templates it sees: signals of every kind (kill by pid, by
// pidfd, by process group, kill -9 -1), ptrace, scheduling and limits
// changes are refused for the templates, while they reach the agent's own
// processes as before; a restore in place and a fork then bring the
// process back at the checkpoint's state.
func TestTemplatesSurviveTheAgent(t *testing.T) {
	b := setup(t)
	s, ck := counterCheckpoint(t, b)
	ctx := t.Context()
	src := strings.Replace(attackPy, "for pid in sorted", strings.TrimSpace(tgkillPy)+"\nfor pid in sorted", 1)
	if err := s.WriteFile(ctx, "/tmp/attack.py", []byte(src), 0o644, false); err != nil {
		t.Fatal(err)
	}
	if _, err := s.Exec(ctx, sandbox.ExecRequest{Command: "sleep 1000", Background: true}); err != nil {
		t.Fatal(err)
	}
	out := sh(t, s, "python3 /tmp/attack.py")
	var live, tpl int
	for _, line := range strings.Split(strings.TrimSpace(out), "\n") {
		f := strings.Fields(line)
		if len(f) != 9 {
			t.Fatalf("attack output %q", out)
		}
		switch strings.Join(f[1:], " ") {
		case "nice=1 prlimit=1 affinity=1 ptrace=1 pidfd_open=1 procfd=1 tgkill=1 kill=1":
			tpl++ // EPERM for each
		case "nice=0 prlimit=0 affinity=0 ptrace=0 pidfd_open=0 procfd=0 tgkill=0 kill=0":
			live++ // the agent's own process: all allowed
		default:
			t.Fatalf("attacks on pid %s: %s", f[0], strings.Join(f[1:], " "))
		}
	}
	if live != 1 || tpl != 1 {
		t.Fatalf("attacks on the live process and its template:\n%s", out)
	}
	// The template's process group, then everything.
	sh(t, s, `me=$(cut -d' ' -f5 /proc/$$/stat); for p in /proc/[0-9]*; do g=$(cut -d' ' -f5 $p/stat 2>/dev/null) && [ "$g" -gt 1 ] && [ "$g" != "$me" ] && kill -9 -- -$g 2>/dev/null; done; true`)
	if got := sh(t, s, "kill -9 -1; echo $?"); got != "0\n" {
		t.Fatalf("kill -9 -1: %q", got)
	}
	if got := sh(t, s, "cat /proc/[0-9]*/comm 2>/dev/null | grep -cx sleep || true"); got != "0\n" {
		t.Fatalf("kill -9 -1 left the agent's own processes: %q", got)
	}
	if err := s.Restore(ctx, ck.ID); err != nil {
		t.Fatalf("restore after the attacks: %v", err)
	}
	inc(t, s, 2)
	if got := sh(t, s, countCounters); got != "2\n" { // the copy and its template
		t.Fatalf("%q counters after the restore", got)
	}
	kids, err := b.rt.Fork(ctx, ck.ID, 1, sandbox.Spec{})
	if err != nil {
		t.Fatalf("fork after the attacks: %v", err)
	}
	t.Cleanup(func() { _ = kids[0].Destroy(t.Context()) })
	inc(t, kids[0], 2)
}

// attackerPy runs, for each line read from the FIFO /tmp/actl, one attack
// on every counter.py process but itself and appends a line to /tmp/ares:
// the pids it aimed at and the errno of each attempt (0 for success).
// "kill" signals by pid, "pidfd" by pidfd_send_signal on pidfd_open's
// descriptor, "all" is kill(-1, SIGKILL), which spares the caller. It
// attacks from a second thread: a filter stacked on the process must
// reach every thread of it.
const attackerPy = `
import os, signal, subprocess, threading
subprocess.Popen(["sleep", "1000000"])  # a tree: CRIU takes it
fd = os.open("/tmp/actl", os.O_RDWR)
f = os.fdopen(fd, "r")
def counters():
    out = []
    for p in sorted(int(p) for p in os.listdir("/proc") if p.isdigit()):
        try:
            if b"counter.py" in open(f"/proc/{p}/cmdline", "rb").read():
                out.append(p)
        except OSError:
            pass
    return out
def errno_of(fn):
    try:
        fn()
        return 0
    except OSError as e:
        return e.errno
def pidfd_kill(p):
    pfd = os.pidfd_open(p)
    try:
        signal.pidfd_send_signal(pfd, signal.SIGKILL)
    finally:
        os.close(pfd)
def serve():
    for line in f:
        what = line.strip()
        pids = counters()
        if what == "kill":
            r = [errno_of(lambda: os.kill(p, signal.SIGKILL)) for p in pids]
        elif what == "pidfd":
            r = [errno_of(lambda: pidfd_kill(p)) for p in pids]
        else:
            r = [errno_of(lambda: os.kill(-1, signal.SIGKILL))]
        with open("/tmp/ares", "a") as o:
            o.write(what + " " + " ".join(map(str, sorted(r))) + "\n")
t = threading.Thread(target=serve)
t.start()
t.join()
`

// A process restored by CRIU is as unable to reach a checkpoint's
// templates as a command the init started: a counter and an attacker are
// saved with CRIU and restored from the image, then checkpointed again
// (the counter by template); the restored attacker's kill by pid,
// pidfd_send_signal and kill -9 -1 end the live counter but never its
// template, so the second checkpoint restores at its exact state.
func TestCRIURestoredCannotReachTemplates(t *testing.T) {
	needCRIU(t)
	b := setup(t)
	for _, attack := range []string{"kill", "pidfd", "all"} {
		t.Run(attack, func(t *testing.T) {
			s := b.create(t, sandbox.Spec{Image: defaultImage(t, b)})
			ctx := t.Context()
			startCounter(t, s)
			inc(t, s, 1)
			sh(t, s, "mkfifo /tmp/actl")
			if err := s.WriteFile(ctx, "/tmp/attacker.py", []byte(attackerPy), 0o644, false); err != nil {
				t.Fatal(err)
			}
			if _, err := s.Exec(ctx, sandbox.ExecRequest{Argv: []string{"python3", "/tmp/attacker.py"}, Background: true}); err != nil {
				t.Fatal(err)
			}
			waitFor(t, s, "cat /proc/[0-9]*/comm 2>/dev/null | grep -qx sleep")
			saved, err := s.CheckpointWith(ctx, sandbox.CheckpointOptions{Processes: sandbox.ProcessesCRIU})
			if err != nil {
				t.Fatal(err)
			}
			if got := methods(saved.Processes); got != "python3:criu python3:criu sleep:criu" {
				t.Fatalf("captured %q", got)
			}
			if err := s.Restore(ctx, saved.ID); err != nil {
				t.Fatal(err)
			}
			inc(t, s, 2)
			ck, err := s.Checkpoint(ctx)
			if err != nil {
				t.Fatal(err)
			}
			// The counter by template; the attacker, with its child, by CRIU.
			if got := methods(ck.Processes); got != "python3:template python3:criu sleep:criu" {
				t.Fatalf("captured %q", got)
			}
			// The attacker of the second round is restored from the
			// second checkpoint's image, filters of the first restore
			// and all.
			for round := range 2 {
				inc(t, s, 3)
				// kill -9 -1 may end this command too, once it has written.
				res, err := s.Exec(ctx, sandbox.ExecRequest{Command: "echo " + attack + " > /tmp/actl"})
				if err != nil || res.ExitCode != 0 && res.Signal != "SIGKILL" {
					t.Fatalf("round %d: sending the attack: %v %+v", round, err, res)
				}
				out := strings.TrimSpace(attackResult(t, s))
				want := map[string]string{"kill": "kill 0 1", "pidfd": "pidfd 0 1", "all": "all 0"}[attack]
				if out != want {
					t.Fatalf("round %d: the restored attacker reports %q, want %q (the live counter killed, its template refused)",
						round, out, want)
				}
				// The live counter was killed (the attacker says so), but on
				// a busy machine it may not have exited yet: wait for it.
				if got := counterCountSettles(t, s, 1); got != 1 { // the template
					t.Fatalf("round %d: %d counters after the attack", round, got)
				}
				if err := s.Restore(ctx, ck.ID); err != nil {
					t.Fatalf("round %d: restore after the attack: %v", round, err)
				}
			}
			inc(t, s, 3)
		})
	}
}

// attackResult waits for attackerPy's line in /tmp/ares and returns it. A
// wait that the attack itself ends (kill -9 -1 reaches the commands of the
// sandbox too) is started again.
func attackResult(t *testing.T, s *sandbox.Sandbox) string {
	t.Helper()
	for range 10 {
		res, err := s.Exec(t.Context(), sandbox.ExecRequest{Command: "for i in $(seq 1000); do [ -s /tmp/ares ] && exec cat /tmp/ares; sleep 0.01; done; exit 1", Timeout: 15 * time.Second})
		if err != nil {
			t.Fatal(err)
		}
		if res.ExitCode == 0 {
			return string(res.Stdout)
		}
		if res.Signal != "SIGKILL" {
			t.Fatalf("waiting for the attack's result: %+v", res)
		}
	}
	t.Fatal("the attack's result never came")
	return ""
}

// The OOM killer never picks a template: a command raises the
// oom_score_adj of every counter.py process it sees (the template's /proc
// files belong to the sandbox's root: it may), then fills the sandbox's
// memory. The filler is killed, the live counter may be, the template is
// not: the checkpoint restores at its exact state. The template's memory
// still counts against the sandbox's limit.
func TestOOMSparesTemplates(t *testing.T) {
	b := setup(t)
	s := b.create(t, sandbox.Spec{Image: defaultImage(t, b), Limits: sandbox.Limits{MemoryBytes: 128 << 20}})
	ctx := t.Context()
	// 32 MiB of its own: the OOM killer's score for it, raised, beats a
	// filler's, which cannot take what the counter's pages hold.
	startCounterOf(t, s, "blob = bytearray(b'x' * (32 << 20))\n"+counterPy)
	inc(t, s, 1)
	ck, err := s.Checkpoint(ctx)
	if err != nil {
		t.Fatal(err)
	}
	inc(t, s, 2)
	raised := sh(t, s, `n=0; for p in $(grep -l '[c]ounter.py' /proc/[0-9]*/cmdline | cut -d/ -f3); do echo 1000 > /proc/$p/oom_score_adj && n=$((n+1)); done; echo $n`)
	if raised != "2\n" { // the live counter and its template
		t.Fatalf("raised the OOM score of %q counters, want 2", raised)
	}
	filler := "import os\na = []\nwhile True:\n    a.append(bytearray(b'y' * (1 << 20)))\n    os.pwrite(fd, b'%8d' % len(a), 0)\n"
	res, err := s.Exec(ctx, sandbox.ExecRequest{Argv: []string{"python3", "-c", "import os\nfd = os.open('/tmp/mb', os.O_WRONLY | os.O_CREAT)\n" + filler},
		Timeout: 60 * time.Second})
	if err != nil {
		t.Fatal(err)
	}
	if res.Signal != "SIGKILL" && res.ExitCode != 137 {
		t.Fatalf("the memory filler under a 128 MiB limit: %+v", res)
	}
	if got := sh(t, s, countCounters); got == "0\n" {
		t.Fatal("the OOM killer took the template")
	}
	// The template's 32 MiB still count against the sandbox's limit.
	if mb, err := strconv.Atoi(strings.TrimSpace(sh(t, s, "cat /tmp/mb"))); err != nil || mb > 100 {
		t.Fatalf("the filler took %d MiB (%v) beside the template's 32 under a 128 MiB limit", mb, err)
	}
	// The second restore forks from the template (the first may take a
	// copy forked ahead).
	for round := range 2 {
		if err := s.Restore(ctx, ck.ID); err != nil {
			t.Fatalf("restore %d after the OOM: %v", round, err)
		}
		inc(t, s, 2)
	}
}

// counterCountSettles waits up to 10 s for the sandbox to hold want
// counter processes, and returns how many it holds then.
func counterCountSettles(t *testing.T, s *sandbox.Sandbox, want int) int {
	t.Helper()
	out := sh(t, s, fmt.Sprintf("for i in $(seq 1000); do n=$(%s); [ \"$n\" = %d ] && break; sleep 0.01; done; echo $n", countCounters, want))
	n, err := strconv.Atoi(strings.TrimSpace(out))
	if err != nil {
		t.Fatalf("counting counters: %q", out)
	}
	return n
}
