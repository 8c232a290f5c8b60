package securitytest

import (
	"os"
	"strconv"
	"strings"
	"testing"

	"github.com/deltagym/deltagym/clients/go/deltagym"
	deltagymv1 "github.com/deltagym/deltagym/clients/go/gen/deltagym/v1"
)

// ptrace: the init and the frozen templates of a process checkpoint are out of reach of the
// sandbox's commands (ptrace, /proc/PID/mem, process_vm_*). A command may trace its own
// processes, as a debugger does: that reaches nothing the agent does not own already.
func TestAttackPtrace(t *testing.T) {
	s := begin(t)
	sb := s.sandbox(t)
	own := s.exec(t, sb, "sleep 1000", deltagym.InBackground())
	ownPID := strconv.Itoa(own.PID)
	s.syscalls(t, sb, []syscallCase{
		{"PTRACE_ATTACH the init", []string{"101", "16", "1", "0", "0"}, []string{"EPERM"}},
		{"PTRACE_SEIZE the init", []string{"101", "0x4206", "1", "0", "0"}, []string{"EPERM"}},
		// process_vm_readv(pid, local iov, 1, remote iov, 1, 0) of one byte: refused before any
		// copy (EPERM); allowed, it would fault on the addresses (EFAULT). A zero-length one
		// returns 0 before the kernel checks anything.
		{"process_vm_readv the init", []string{"310", "1", "q:0,1", "1", "q:0x1000,1", "1", "0"}, []string{"EPERM"}},
		{"process_vm_writev the init", []string{"311", "1", "q:0,1", "1", "q:0x1000,1", "1", "0"}, []string{"EPERM"}},
		{"kcmp the init", []string{"312", "1", ownPID, "0", "0", "0"}, []string{"EPERM"}},
		{"PTRACE_ATTACH an own process", []string{"101", "16", ownPID, "0", "0"}, []string{"ok 0"}},
	})
	for _, f := range []string{"mem", "environ", "maps", "fd/0", "root/etc/hostname"} {
		cmd := "cat /proc/1/" + f + " > /dev/null"
		if res := s.exec(t, sb, cmd); res.OK() {
			t.Errorf("%s: succeeded", cmd)
		}
	}

	// A process checkpoint: its template copy of the sleep is frozen, non-dumpable.
	if _, err := sb.Checkpoint(t.Context()); err != nil {
		t.Fatal(err)
	}
	tmpl := strings.Fields(s.sh(t, sb, "for p in /proc/[0-9]*; do n=${p#/proc/}; [ $n != "+ownPID+" ] && [ \"$(tr '\\0' ' ' < $p/cmdline 2>/dev/null)\" = 'sleep 1000 ' ] && echo $n; done; true"))
	if len(tmpl) != 1 {
		t.Fatalf("templates of the sleep: %q, want one", tmpl)
	}
	s.syscalls(t, sb, []syscallCase{
		{"PTRACE_ATTACH a template", []string{"101", "16", tmpl[0], "0", "0"}, []string{"EPERM"}},
		{"PTRACE_SEIZE a template", []string{"101", "0x4206", tmpl[0], "0", "0"}, []string{"EPERM"}},
		{"process_vm_writev a template", []string{"311", tmpl[0], "q:0,1", "1", "q:0x1000,1", "1", "0"}, []string{"EPERM"}},
		{"process_vm_readv a template", []string{"310", tmpl[0], "q:0,1", "1", "q:0x1000,1", "1", "0"}, []string{"EPERM"}},
	})
	for _, cmd := range []string{"cat /proc/" + tmpl[0] + "/mem > /dev/null", "echo x > /proc/" + tmpl[0] + "/mem",
		"readlink /proc/" + tmpl[0] + "/fd/0", "cat /proc/" + tmpl[0] + "/environ", "cat /proc/" + tmpl[0] + "/maps"} {
		if res := s.exec(t, sb, cmd); res.OK() {
			t.Errorf("%s: succeeded", cmd)
		}
	}
}

// kill: signals to the init and kill -1 end the agent's own processes at most; the init (pid 1
// of the sandbox's pid namespace) ignores them, and the sandbox goes on answering.
func TestAttackKill(t *testing.T) {
	s := begin(t)
	sb := s.sandbox(t)
	start := s.sh(t, sb, "cut -d' ' -f22 /proc/1/stat")
	for _, cmd := range []string{"kill -9 1", "kill -STOP 1", "kill -TERM 1", "kill -SEGV 1", "kill -9 -1", "kill -STOP -1; kill -CONT -1"} {
		res := s.exec(t, sb, cmd)
		t.Logf("%s: exit %d signal %d", cmd, res.ExitCode, res.Signal)
		if again := s.sh(t, sb, "cut -d' ' -f22 /proc/1/stat"); again != start {
			t.Fatalf("after %s the init started at %s, before at %s", cmd, again, start)
		}
	}
	// The sandbox still runs background processes and file actions.
	if _, err := sb.WriteFile(t.Context(), "/tmp/after", []byte("ok")); err != nil {
		t.Fatal(err)
	}
	if out := s.sh(t, sb, "cat /tmp/after"); out != "ok" {
		t.Fatalf("after the kills: %q", out)
	}
}

// kill -1 with a process checkpoint: the checkpoint must stay restorable whatever the agent does
// after it was acknowledged.
func TestAttackKillTemplates(t *testing.T) {
	s := begin(t)
	sb := s.sandbox(t)
	s.exec(t, sb, "sleep 1000", deltagym.InBackground())
	ck, err := sb.Checkpoint(t.Context())
	if err != nil {
		t.Fatal(err)
	}
	s.exec(t, sb, "kill -9 -1")
	if _, err := sb.Restore(t.Context(), ck.ID); err != nil {
		t.Fatalf("restoring the checkpoint after kill -9 -1: %v", err)
	}
	// The checkpoint's templates are processes of the sandbox too (frozen, in groups t<n> or
	// i<n>), and so are the copies parked for the next restore (p<n>): count the sleeps that
	// run outside them.
	live := `for p in $(pgrep -x sleep); do grep -Eq '/[tip][0-9]+$' /proc/$p/cgroup || echo $p; done | wc -l`
	if out := s.sh(t, sb, live); strings.TrimSpace(out) != "1" {
		t.Fatalf("running sleeps after the restore: %q (all: %q)", out, s.sh(t, sb, "for p in $(pgrep -x sleep); do echo $p $(cat /proc/$p/cgroup); done"))
	}
}

// kill from a process CRIU restored: a shell saved with CRIU and restored from its image runs
// `kill -9 -1` (its own builtin) once a later checkpoint holds templates; the checkpoint restores
// all the same, and its process is back.
func TestAttackKillTemplatesFromCRIU(t *testing.T) {
	s := begin(t)
	sb := s.sandbox(t)
	s.exec(t, sb, "sleep 1000", deltagym.InBackground())
	s.sh(t, sb, "mkfifo /tmp/actl")
	s.exec(t, sb, `bash -c 'exec 3<>/tmp/actl; while read -r c <&3; do kill -9 -1; echo $? > /tmp/ares; done'`,
		deltagym.InBackground())
	saved, err := sb.Checkpoint(t.Context(), deltagym.WithProcessMode(deltagymv1.ProcessMode_PROCESS_MODE_CRIU))
	if err != nil {
		t.Fatal(err)
	}
	if _, err := sb.Restore(t.Context(), saved.ID); err != nil {
		t.Fatal(err)
	}
	ck, err := sb.Checkpoint(t.Context())
	if err != nil {
		t.Fatal(err)
	}
	// kill -9 -1 ends this command too, once it has written.
	s.exec(t, sb, "echo go > /tmp/actl")
	for {
		res := s.exec(t, sb, "for i in $(seq 1000); do [ -s /tmp/ares ] && exec cat /tmp/ares; sleep 0.01; done; exit 1")
		if res.OK() {
			if got := strings.TrimSpace(string(res.Stdout)); got != "0" {
				t.Fatalf("kill -9 -1 from the restored shell: %q", got)
			}
			break
		}
		if res.Signal != 9 {
			t.Fatalf("waiting for the attack: exit %d signal %d", res.ExitCode, res.Signal)
		}
	}
	if _, err := sb.Restore(t.Context(), ck.ID); err != nil {
		t.Fatalf("restoring the checkpoint after kill -9 -1 from a restored process: %v", err)
	}
	live := `for p in $(pgrep -x sleep); do grep -Eq '/[tip][0-9]+$' /proc/$p/cgroup || echo $p; done | wc -l`
	if out := s.sh(t, sb, live); strings.TrimSpace(out) != "1" {
		t.Fatalf("running sleeps after the restore: %q", out)
	}
}

// OOM: a command raises the OOM score of every process it sees (a template's /proc files
// belong to the sandbox's root) and fills the sandbox's memory: the OOM killer takes the
// command, or the live process, never the template, and the checkpoint restores.
func TestAttackOOMTemplates(t *testing.T) {
	s := begin(t)
	sb := s.sandbox(t)
	// 64 MiB of its own: raised, its score beats the filler's.
	s.exec(t, sb, `python3 -c "import time; b = bytearray(b'x' * (64 << 20)); time.sleep(1000)"`, deltagym.InBackground())
	ck, err := sb.Checkpoint(t.Context())
	if err != nil {
		t.Fatal(err)
	}
	s.sh(t, sb, `for p in $(pgrep python3); do echo 1000 > /proc/$p/oom_score_adj; done`)
	res := s.exec(t, sb, `python3 -c "a = []
while True: a.append(bytearray(b'y' * (1 << 20)))"`)
	if res.OK() {
		t.Fatal("the memory filler ended well")
	}
	// The first restore may take a copy forked ahead; the second forks from the template.
	for round := range 2 {
		if _, err := sb.Restore(t.Context(), ck.ID); err != nil {
			t.Fatalf("restore %d after the OOM: %v", round, err)
		}
		// Templates (t), copies saved as images (i) and copies parked for the next restore (p)
		// are not the live process.
		live := `for p in $(pgrep python3); do grep -Eq '/[tip][0-9]+$' /proc/$p/cgroup || echo $p; done | wc -l`
		if out := s.sh(t, sb, live); strings.TrimSpace(out) != "1" {
			t.Fatalf("restore %d: %q python3 processes running", round, out)
		}
	}
}

// /proc and /sys: the kernel's knobs are read-only or absent. Each write is of the host's own
// value where there is one, so that even a write that went through would change nothing; the
// host's value is checked after.
func TestAttackProcSys(t *testing.T) {
	s := begin(t)
	sb := s.sandbox(t)
	knobs := []string{
		"/proc/sys/kernel/core_pattern", "/proc/sys/kernel/modprobe", "/proc/sys/kernel/panic",
		"/proc/sys/vm/overcommit_memory", "/proc/sys/kernel/randomize_va_space",
		"/proc/sys/net/ipv4/ip_forward", "/proc/sys/fs/file-max",
		"/sys/kernel/mm/transparent_hugepage/enabled", "/sys/kernel/uevent_helper",
		"/sys/kernel/profiling", "/sys/power/state",
	}
	host := map[string]string{}
	for _, k := range knobs {
		data, err := os.ReadFile(k)
		if err == nil {
			host[k] = string(data)
		}
		v := strings.TrimSpace(string(data))
		if i := strings.IndexByte(v, '['); i >= 0 { // "always [madvise] never"
			v = v[i+1 : strings.IndexByte(v, ']')]
		}
		cmd := "printf '%s\\n' '" + strings.ReplaceAll(v, "'", "") + "' > " + k
		if res := s.exec(t, sb, cmd); res.OK() {
			t.Errorf("%s: succeeded", cmd)
		}
	}
	for _, cmd := range []string{
		"echo h > /proc/sysrq-trigger", "echo 3 > /proc/sys/vm/drop_caches", "echo 1 > /proc/sys/kernel/sysrq",
		"echo c > /proc/sysrq-trigger 2>/dev/null && echo wrote",
		"mount | grep -q ' /sys ' && echo 1 > /sys/fs/cgroup/cgroup.procs",
	} {
		if res := s.exec(t, sb, cmd); res.OK() {
			t.Errorf("%s: succeeded", cmd)
		}
	}
	// No sysfs: /sys is an empty directory of the image, or absent.
	if out := s.sh(t, sb, "ls -A /sys 2>/dev/null; true"); out != "" {
		t.Errorf("the sandbox has a /sys: %q", out)
	}
	for k, v := range host {
		if data, _ := os.ReadFile(k); string(data) != v {
			t.Errorf("the host's %s changed: %q, was %q", k, data, v)
		}
	}
}

// Devices: no command makes a device node, and the kernel's memory and ports are not there.
func TestAttackDevices(t *testing.T) {
	s := begin(t)
	sb := s.sandbox(t)
	for _, cmd := range []string{
		"mknod /tmp/mem c 1 1", "mknod /tmp/sda b 8 0", "mknod /tmp/kmsg c 1 11",
		"head -c1 /dev/mem", "head -c1 /dev/kmem", "head -c1 /dev/port", "head -c1 /dev/kmsg",
		"head -c1 /dev/sda", "head -c1 /dev/vda", "test -e /dev/mem", "test -e /dev/kmem",
		"test -e /dev/port", "test -e /dev/kmsg",
	} {
		if res := s.exec(t, sb, cmd); res.OK() {
			t.Errorf("%s: succeeded", cmd)
		}
	}
	// mknodat(AT_FDCWD, path, S_IFCHR|0600, makedev(1, 1)).
	s.syscalls(t, sb, []syscallCase{
		{"mknodat /dev/mem's device", []string{"259", "-100", "s:/tmp/m", "0x2180", "0x101"}, []string{"EPERM"}},
		{"mknodat a block device", []string{"259", "-100", "s:/tmp/b", "0x6180", "0x800"}, []string{"EPERM"}},
	})
	if out := s.sh(t, sb, "find / -xdev \\( -type b -o -type c \\) 2>/dev/null | grep -v '^/dev/' || true"); out != "" {
		t.Errorf("device nodes outside /dev: %q", out)
	}
}

// setrlimit: no hard limit goes up.
func TestAttackRlimit(t *testing.T) {
	s := begin(t)
	sb := s.sandbox(t)
	script := `import resource
for name in ("RLIMIT_NOFILE", "RLIMIT_NPROC", "RLIMIT_CORE", "RLIMIT_MEMLOCK", "RLIMIT_STACK", "RLIMIT_RTPRIO"):
    r = getattr(resource, name)
    soft, hard = resource.getrlimit(r)
    if hard == resource.RLIM_INFINITY:
        print(name, "unlimited")
        continue
    try:
        resource.setrlimit(r, (hard + 1, hard + 1))
        print(name, "raised", resource.getrlimit(r))
    except (ValueError, OSError) as e:
        print(name, "refused")
`
	out, err := sb.Run(t.Context(), []string{"python3", "-c", script})
	if err != nil {
		t.Fatal(err)
	}
	for _, line := range strings.Split(strings.TrimSpace(string(out.Stdout)), "\n") {
		if !strings.HasSuffix(line, " refused") && !strings.HasSuffix(line, " unlimited") {
			t.Errorf("setrlimit above the hard limit: %s", line)
		}
	}
	if res := s.exec(t, sb, "ulimit -Hn $(( $(ulimit -Hn) + 1 ))"); res.OK() {
		t.Errorf("ulimit -Hn above the hard limit: succeeded")
	}
}

// Descriptors: a command, a session's shell and a background process hold standard input,
// output and error only: none of the server's descriptors leaks into the sandbox.
func TestAttackFDLeak(t *testing.T) {
	s := begin(t)
	sb := s.sandbox(t)
	// The descriptors that are open once listing them is done (listdir's own is closed then).
	list := `import os
fds = os.listdir("/proc/self/fd")
live = []
for f in fds:
    try:
        os.fstat(int(f))
        live.append(int(f))
    except OSError:
        pass
print(" ".join(map(str, sorted(live))))
`
	res, err := sb.Run(t.Context(), []string{"python3", "-c", list})
	if err != nil {
		t.Fatal(err)
	}
	if got := strings.TrimSpace(string(res.Stdout)); got != "0 1 2" {
		t.Errorf("a command's descriptors: %q, want 0 1 2\n%s", got, res.Stderr)
	}
	if got := s.sh(t, sb, "ls /proc/$$/fd"); got != "0\n1\n2\n" {
		t.Errorf("a shell command's descriptors: %q, want 0 1 2", got)
	}
	bg := s.exec(t, sb, "sleep 1000", deltagym.InBackground())
	if got := s.sh(t, sb, "ls /proc/"+strconv.Itoa(bg.PID)+"/fd"); got != "0\n1\n2\n" {
		t.Errorf("a background process's descriptors: %q, want 0 1 2", got)
	}
	// A session's bash, between two of its commands, holds its input and outputs only.
	out, err := sb.Exec(t.Context(), "echo $$", deltagym.WithSession("s"))
	if err != nil {
		t.Fatal(err)
	}
	if got := s.sh(t, sb, "ls /proc/"+strings.TrimSpace(string(out.Stdout))+"/fd"); got != "0\n1\n2\n" {
		t.Errorf("a session's descriptors: %q, want 0 1 2", got)
	}
}
