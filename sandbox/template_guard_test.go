package sandbox_test

import (
	"strings"
	"testing"

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
