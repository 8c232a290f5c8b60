package sandbox_test

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/deltagym/deltagym/internal/locate"
	"github.com/deltagym/deltagym/internal/testenv"
	"github.com/deltagym/deltagym/sandbox"
	"github.com/deltagym/deltagym/sandbox/image/imagetest"
)

var testSeq atomic.Int64

// criuBinary is the CRIU wrapper the tests' runtimes use: locate.CRIU's,
// which is where the wrapper is expected when it is not installed (tests
// that need it skip then: needCRIU).
func criuBinary() string {
	p, _ := locate.CRIU()
	return p
}

type bundle struct {
	rt   *sandbox.Runtime
	dir  string
	cfg  sandbox.Config
	root string // busybox rootfs
}

func setup(t testing.TB, mod ...func(*sandbox.Config)) *bundle {
	t.Helper()
	testenv.Privileged(t, "sandboxes use namespaces, mounts and cgroups (CI runs as root)")
	dir := t.TempDir()
	cfg := sandbox.Config{DataDir: filepath.Join(dir, "data"), InitBinary: testenv.Init(t), CRIU: criuBinary(), CgroupRoot: fmt.Sprintf("dgtest-%d-%d", os.Getpid(), testSeq.Add(1))}
	for _, m := range mod {
		m(&cfg)
	}
	rt, err := sandbox.New(t.Context(), cfg)
	if err != nil {
		t.Fatal(err)
	}
	b := &bundle{rt: rt, dir: dir, cfg: cfg, root: imagetest.Busybox(t)}
	t.Cleanup(func() {
		if b.rt != nil {
			if err := b.rt.Close(context.Background()); err != nil {
				t.Errorf("closing runtime: %v", err)
			}
		}
		if err := sandbox.Purge(cfg.DataDir); err != nil {
			t.Errorf("purging data dir: %v", err)
		}
		_ = os.Remove("/sys/fs/cgroup/unified/" + cfg.CgroupRoot)
		for _, c := range []string{"memory", "pids", "cpu", "freezer"} {
			_ = os.Remove("/sys/fs/cgroup/" + c + "/" + cfg.CgroupRoot)
		}
	})
	if _, err := rt.ImportImage(t.Context(), "busybox", b.root); err != nil {
		t.Fatal(err)
	}
	return b
}

// restart closes the bundle's runtime and starts a new one on its data
// directory.
func (b *bundle) restart(t testing.TB) {
	t.Helper()
	if err := b.rt.Close(t.Context()); err != nil {
		t.Fatal(err)
	}
	b.rt = nil
	rt, err := sandbox.New(t.Context(), b.cfg)
	if err != nil {
		t.Fatal(err)
	}
	b.rt = rt
}

func (b *bundle) create(t testing.TB, spec sandbox.Spec) *sandbox.Sandbox {
	t.Helper()
	if spec.Image == "" && spec.Checkpoint == "" {
		spec.Image = "busybox"
	}
	s, err := b.rt.Create(t.Context(), spec)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = s.Destroy(context.Background()) })
	return s
}

func sh(t testing.TB, s *sandbox.Sandbox, cmd string) string {
	t.Helper()
	res, err := s.Exec(t.Context(), sandbox.ExecRequest{Command: cmd})
	if err != nil {
		t.Fatalf("exec %q: %v", cmd, err)
	}
	if res.ExitCode != 0 {
		t.Fatalf("exec %q: exit %d signal %q\nstdout: %s\nstderr: %s", cmd, res.ExitCode, res.Signal, res.Stdout, res.Stderr)
	}
	return string(res.Stdout)
}

func TestExecBasics(t *testing.T) {
	b := setup(t)
	s := b.create(t, sandbox.Spec{})
	cases := []struct {
		name     string
		req      sandbox.ExecRequest
		stdout   string
		stderr   string
		exit     int
		signal   string
		timedOut bool
	}{
		{name: "shell string", req: sandbox.ExecRequest{Command: "echo hello; echo oops >&2; exit 3"}, stdout: "hello\n", stderr: "oops\n", exit: 3},
		{name: "argv", req: sandbox.ExecRequest{Argv: []string{"echo", "a b", "c"}}, stdout: "a b c\n"},
		{name: "stdin", req: sandbox.ExecRequest{Argv: []string{"cat"}, Stdin: []byte("piped")}, stdout: "piped"},
		{name: "env and cwd", req: sandbox.ExecRequest{Command: "echo $FOO; pwd", Env: []string{"FOO=bar"}, Cwd: "/tmp"}, stdout: "bar\n/tmp\n"},
		{name: "signal", req: sandbox.ExecRequest{Command: "kill -9 $$"}, exit: -1, signal: "SIGKILL"},
		{name: "timeout", req: sandbox.ExecRequest{Command: "sleep 30", Timeout: 200 * time.Millisecond}, exit: -1, signal: "SIGKILL", timedOut: true},
		{name: "uid 0 in a user namespace", req: sandbox.ExecRequest{Command: "id -u; cat /proc/self/uid_map"}, stdout: "0\n         0    "},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			res, err := s.Exec(t.Context(), tc.req)
			if err != nil {
				t.Fatal(err)
			}
			if !strings.HasPrefix(string(res.Stdout), tc.stdout) || (tc.stdout == "" && len(res.Stdout) > 0) {
				t.Errorf("stdout %q, want %q", res.Stdout, tc.stdout)
			}
			if string(res.Stderr) != tc.stderr {
				t.Errorf("stderr %q, want %q", res.Stderr, tc.stderr)
			}
			if res.ExitCode != tc.exit || res.Signal != tc.signal || res.TimedOut != tc.timedOut {
				t.Errorf("exit %d signal %q timed out %v, want %d %q %v", res.ExitCode, res.Signal, res.TimedOut, tc.exit, tc.signal, tc.timedOut)
			}
		})
	}
}

func TestExecOutputCap(t *testing.T) {
	b := setup(t)
	s := b.create(t, sandbox.Spec{})
	res, err := s.Exec(t.Context(), sandbox.ExecRequest{Command: "yes | head -c 100000; yes e | head -c 10 >&2", MaxOutput: 1000})
	if err != nil {
		t.Fatal(err)
	}
	if len(res.Stdout) != 1000 || !res.StdoutTruncated || res.StderrTruncated || len(res.Stderr) != 10 {
		t.Fatalf("stdout %d bytes truncated %v, stderr %d truncated %v", len(res.Stdout), res.StdoutTruncated, len(res.Stderr), res.StderrTruncated)
	}
	// A command printing forever is stopped by its timeout, output capped.
	res, err = s.Exec(t.Context(), sandbox.ExecRequest{Command: "yes", Timeout: 300 * time.Millisecond, MaxOutput: 4096})
	if err != nil {
		t.Fatal(err)
	}
	if !res.TimedOut || len(res.Stdout) != 4096 || !res.StdoutTruncated {
		t.Fatalf("timed out %v, %d bytes, truncated %v", res.TimedOut, len(res.Stdout), res.StdoutTruncated)
	}
}

// A child that calls setsid and daemonises is still ended by the timeout:
// every command runs in a cgroup of its own.
func TestExecTimeoutKillsSetsidChild(t *testing.T) {
	b := setup(t)
	s := b.create(t, sandbox.Spec{})
	res, err := s.Exec(t.Context(), sandbox.ExecRequest{
		Command: "setsid sh -c 'echo $$ > /tmp/child.pid; while true; do echo tick >> /tmp/ticks; sleep 0.05; done' & sleep 30",
		Timeout: 300 * time.Millisecond,
	})
	if err != nil {
		t.Fatal(err)
	}
	if !res.TimedOut {
		t.Fatalf("not timed out: %+v", res)
	}
	pid := strings.TrimSpace(sh(t, s, "cat /tmp/child.pid"))
	out := sh(t, s, "if kill -0 "+pid+" 2>/dev/null; then echo alive; else echo gone; fi; ps -o pid,args | grep -c 'while true' || true")
	if !strings.HasPrefix(out, "gone") {
		t.Fatalf("setsid child survived the timeout: %q", out)
	}
	n1 := sh(t, s, "wc -l < /tmp/ticks")
	n2 := sh(t, s, "sleep 0.2; wc -l < /tmp/ticks")
	if n1 != n2 {
		t.Fatalf("the child still writes: %s then %s", n1, n2)
	}
}

func TestBackgroundAndSession(t *testing.T) {
	b := setup(t)
	s := b.create(t, sandbox.Spec{Image: "busybox"})
	res, err := s.Exec(t.Context(), sandbox.ExecRequest{Command: "sleep 0.3; echo done > /tmp/bg", Background: true})
	if err != nil {
		t.Fatal(err)
	}
	if res.Pid <= 1 || res.ExitCode != -1 {
		t.Fatalf("background result %+v", res)
	}
	if out := sh(t, s, "while [ ! -f /tmp/bg ]; do sleep 0.05; done; cat /tmp/bg"); out != "done\n" {
		t.Fatalf("background command did not finish: %q", out)
	}

	// busybox has no bash; sessions start one, so stand ash in for it.
	if err := s.WriteFile(t.Context(), "/bin/bash", []byte("#!/bin/sh\nexec /bin/busybox ash\n"), 0o755, false); err != nil {
		t.Fatal(err)
	}
	run := func(cmd string) sandbox.ExecResult {
		t.Helper()
		res, err := s.Exec(t.Context(), sandbox.ExecRequest{Session: "main", Command: cmd, Timeout: 2 * time.Second})
		if err != nil {
			t.Fatalf("session %q: %v", cmd, err)
		}
		return res
	}
	if res := run("cd /tmp && export GREETING=hi && greet() { echo \"$GREETING from $(pwd)\"; }"); res.ExitCode != 0 {
		t.Fatalf("defining state: %+v", res)
	}
	if res := run("greet"); string(res.Stdout) != "hi from /tmp\n" || res.ExitCode != 0 {
		t.Fatalf("session state lost: %q exit %d", res.Stdout, res.ExitCode)
	}
	if res := run("echo err >&2; false"); string(res.Stderr) != "err\n" || res.ExitCode != 1 {
		t.Fatalf("stderr %q exit %d", res.Stderr, res.ExitCode)
	}
	if res := run("printf 'no newline'"); string(res.Stdout) != "no newline" {
		t.Fatalf("stdout %q", res.Stdout)
	}
	if res := run("echo '__DG_fake_RC=0'; echo \"quote ' and $'x'\""); !strings.Contains(string(res.Stdout), "__DG_fake_RC=0\nquote ' and") {
		t.Fatalf("output that looks like a sentinel was mangled: %q", res.Stdout)
	}
	res, err = s.Exec(t.Context(), sandbox.ExecRequest{Session: "main", Command: "sleep 10", Timeout: 200 * time.Millisecond})
	if err != nil || !res.TimedOut {
		t.Fatalf("timeout: %+v %v", res, err)
	}
	if res := run("pwd; echo $GREETING"); string(res.Stdout) != "/tmp\nhi\n" {
		t.Fatalf("session did not survive the timeout of its command: %q", res.Stdout)
	}
	other, err := s.Exec(t.Context(), sandbox.ExecRequest{Session: "other", Command: "pwd; echo ${GREETING:-unset}"})
	if err != nil || string(other.Stdout) != "/\nunset\n" {
		t.Fatalf("sessions are not separate: %q %v", other.Stdout, err)
	}
}

// TestSessionShellWrapperForks starts sessions whose `bash` is a wrapper that starts another
// process before it execs the shell: the session tells its shell by pid, so commands run and a
// timeout ends the command, not the shell.
func TestSessionShellWrapperForks(t *testing.T) {
	b := setup(t)
	s := b.create(t, sandbox.Spec{Image: "busybox"})
	ctx := t.Context()
	// The wrapper waits until its child runs, so that both are in the group when it execs.
	wrapper := "#!/bin/sh\nsleep 1000 </dev/null >/dev/null 2>&1 &\n" +
		"while ! grep -q '^Name:.*sleep' /proc/$!/status 2>/dev/null; do :; done\nexec /bin/busybox ash\n"
	if err := s.WriteFile(ctx, "/bin/bash", []byte(wrapper), 0o755, false); err != nil {
		t.Fatal(err)
	}
	for _, name := range []string{"a", "b", "c"} {
		res, err := s.Exec(ctx, sandbox.ExecRequest{Session: name, Command: "X=" + name + "; echo $X"})
		if err != nil || string(res.Stdout) != name+"\n" {
			t.Fatalf("session %s: %q %v", name, res.Stdout, err)
		}
		res, err = s.Exec(ctx, sandbox.ExecRequest{Session: name, Command: "sleep 10", Timeout: 200 * time.Millisecond})
		if err != nil || !res.TimedOut {
			t.Fatalf("session %s, a command past its timeout: %+v %v", name, res, err)
		}
		res, err = s.Exec(ctx, sandbox.ExecRequest{Session: name, Command: "echo $X"})
		if err != nil || string(res.Stdout) != name+"\n" {
			t.Fatalf("session %s after a timeout: %q %v", name, res.Stdout, err)
		}
	}
	// With a job of its own running beside the wrapper's leftover, the group holds three
	// processes: the shell is still told apart, by its pid.
	res, err := s.Exec(ctx, sandbox.ExecRequest{Session: "a", Command: "sleep 1000 & echo $$"})
	if err != nil {
		t.Fatal(err)
	}
	nsPid, err := strconv.Atoi(strings.TrimSpace(string(res.Stdout)))
	if err != nil {
		t.Fatalf("the shell's pid: %q", res.Stdout)
	}
	kept, found, err := s.SessionShell("a", nsPid)
	if err != nil || kept != found {
		t.Fatalf("the session keeps host pid %d for its shell; its pid %d is host pid %d (%v)", kept, nsPid, found, err)
	}
	st, err := os.ReadFile(fmt.Sprintf("/proc/%d/status", kept))
	if err != nil {
		t.Fatal(err)
	}
	var ids []string
	for line := range strings.Lines(string(st)) {
		if v, ok := strings.CutPrefix(line, "NSpid:"); ok {
			ids = strings.Fields(v)
		}
	}
	if len(ids) == 0 || ids[len(ids)-1] != strconv.Itoa(nsPid) {
		t.Fatalf("host pid %d (NSpid %v) is not the shell, pid %d of the sandbox", kept, ids, nsPid)
	}
	if _, _, err := s.SessionShell("a", 99999); !errors.Is(err, sandbox.ErrSessionEnded) {
		t.Fatalf("a pid not in the group: %v", err)
	}
}

func TestFiles(t *testing.T) {
	b := setup(t)
	s := b.create(t, sandbox.Spec{})
	ctx := t.Context()
	if err := s.WriteFile(ctx, "/work/dir/a.txt", []byte("hello"), 0o600, false); err != nil {
		t.Fatal(err)
	}
	if err := s.WriteFile(ctx, "work/dir/a.txt", []byte(" world"), 0, true); err != nil {
		t.Fatal(err)
	}
	data, size, err := s.ReadFile(ctx, "/work/dir/a.txt", 0, 0)
	if err != nil || string(data) != "hello world" || size != 11 {
		t.Fatalf("read %q size %d err %v", data, size, err)
	}
	if out := sh(t, s, "stat -c '%a %u' /work/dir/a.txt; cat /work/dir/a.txt"); out != "600 0\nhello world" {
		t.Fatalf("inside the sandbox: %q", out)
	}
	data, _, err = s.ReadFile(ctx, "/work/dir/a.txt", 6, 3)
	if err != nil || string(data) != "wor" {
		t.Fatalf("ranged read %q %v", data, err)
	}
	// Hostile paths: each stays inside the sandbox or is refused.
	secret := filepath.Join(b.dir, "host-secret")
	if err := os.WriteFile(secret, []byte("host"), 0o600); err != nil {
		t.Fatal(err)
	}
	sh(t, s, "ln -s "+secret+" /tmp/abs; ln -s ../../../../../../.."+secret+" /tmp/rel; ln -s /proc/1/root /tmp/magic")
	for _, p := range []string{"../../../../" + secret, secret, "/tmp/abs", "/tmp/rel", "/tmp/magic/etc/passwd", "/proc/self/environ", "/dev/null"} {
		if data, _, err := s.ReadFile(ctx, p, 0, 0); err == nil && bytes.Contains(data, []byte("host")) {
			t.Errorf("read %s reached the host: %q", p, data)
		} else if err != nil && !errors.Is(err, sandbox.ErrInvalid) && !errors.Is(err, sandbox.ErrNotFound) {
			t.Errorf("read %s: %v, want ErrInvalid, ErrNotFound (resolved inside, missing) or a file of the sandbox", p, err)
		}
	}
	sh(t, s, "mkdir -p "+filepath.Dir(secret))
	if err := s.WriteFile(ctx, "/tmp/abs", []byte("pwned"), 0, false); err != nil {
		t.Fatalf("writing through an absolute symlink should land inside: %v", err)
	}
	if got, _ := os.ReadFile(secret); string(got) != "host" {
		t.Fatalf("host file changed: %q", got)
	}
	if out := sh(t, s, "cat "+secret); out != "pwned" {
		t.Fatalf("write did not land inside the sandbox: %q", out)
	}
	for _, tc := range []struct {
		path string
		data []byte
		want error
	}{
		{"/", nil, sandbox.ErrInvalid},
		{"", nil, sandbox.ErrInvalid},
		{"/tmp", []byte("x"), sandbox.ErrInvalid},
		{"/big", make([]byte, sandbox.MaxFileBytes+1), sandbox.ErrInvalid},
	} {
		if err := s.WriteFile(ctx, tc.path, tc.data, 0, false); !errors.Is(err, tc.want) {
			t.Errorf("write %q: %v, want %v", tc.path, err, tc.want)
		}
	}
	if _, _, err := s.ReadFile(ctx, "/nonexistent", 0, 0); !errors.Is(err, sandbox.ErrNotFound) {
		t.Errorf("read of a missing file: %v", err)
	}
}

func TestUserAndConfinement(t *testing.T) {
	b := setup(t)
	s := b.create(t, sandbox.Spec{UID: 1000, GID: 1000})
	out := sh(t, s, "id -u; id -g; grep -E 'CapEff|NoNewPrivs|Seccomp:' /proc/self/status")
	want := "1000\n1000\nCapEff:\t0000000000000000\nNoNewPrivs:\t1\nSeccomp:\t2\n"
	if out != want {
		t.Fatalf("got %q, want %q", out, want)
	}
	if err := s.WriteFile(t.Context(), "/etc/owned-by-root", []byte("x"), 0, false); !errors.Is(err, sandbox.ErrInvalid) {
		t.Fatalf("user 1000 wrote into /etc: %v", err)
	}
	if err := s.WriteFile(t.Context(), "/tmp/mine", []byte("x"), 0, false); err != nil {
		t.Fatal(err)
	}
	if out := sh(t, s, "stat -c %u /tmp/mine"); out != "1000\n" {
		t.Fatalf("owner %q", out)
	}
	root := b.create(t, sandbox.Spec{})
	out = sh(t, root, "grep -E 'CapEff|CapBnd' /proc/self/status; mount -t tmpfs x /mnt 2>&1; echo rc=$?; hostname; cat /proc/net/dev | grep -c :")
	if !strings.Contains(out, "CapEff:\t00000000a00405fb") || !strings.Contains(out, "rc=1") || !strings.Contains(out, "sandbox\n") || !strings.HasSuffix(out, "1\n") {
		t.Fatalf("root confinement: %q", out)
	}
}

func TestInitConfinedAndNamespaces(t *testing.T) {
	b := setup(t)
	s := b.create(t, sandbox.Spec{Hostname: "box1"})
	// The init itself keeps no privilege a command lacks but
	// CAP_CHECKPOINT_RESTORE (bit 40), to set the sandbox's next pid, out
	// of its bounding set: no command gets it, root or not.
	st, err := os.ReadFile(fmt.Sprintf("/proc/%d/status", s.InitPid()))
	if err != nil {
		t.Fatal(err)
	}
	for _, want := range []string{"CapEff:\t00000100a00405fb", "CapBnd:\t00000000a00405fb", "NoNewPrivs:\t1", "Seccomp:\t2"} {
		if !strings.Contains(string(st), want) {
			t.Errorf("init status lacks %q", want)
		}
	}
	if out := sh(t, s, "grep -E 'CapPrm|CapEff' /proc/self/status; echo 4000 > /proc/sys/kernel/ns_last_pid 2>/dev/null || echo refused"); out != "CapPrm:\t00000000a00405fb\nCapEff:\t00000000a00405fb\nrefused\n" {
		t.Errorf("a command's capabilities, and its write of ns_last_pid: %q", out)
	}
	// Every namespace differs from the host's.
	for _, ns := range []string{"user", "mnt", "pid", "ipc", "uts", "cgroup", "net"} {
		host, _ := os.Readlink("/proc/self/ns/" + ns)
		box, err := os.Readlink(fmt.Sprintf("/proc/%d/ns/%s", s.InitPid(), ns))
		if err != nil || host == box {
			t.Errorf("namespace %s: host %s sandbox %s (%v)", ns, host, box, err)
		}
	}
	out := sh(t, s, "hostname; cat /proc/1/cmdline; echo; unshare -m true 2>&1 || echo refused; ls /proc/kcore -l | cut -c1")
	if !strings.HasPrefix(out, "box1\ndg-init") || !strings.Contains(out, "refused") {
		t.Fatalf("inside: %q", out)
	}
}

// Every sandbox's /dev is one read-only tree, with no filesystem of its
// own but /dev/shm's, which each sandbox has to itself.
func TestDevShared(t *testing.T) {
	b := setup(t)
	a, c := b.create(t, sandbox.Spec{}), b.create(t, sandbox.Spec{})
	// The device number of /dev, and of /dev/shm, in each.
	const probe = "stat -c '%d' /dev /dev/shm; ls /dev | tr '\\n' ' '; readlink /dev/fd; readlink /dev/stdin; stat -c '%a' /dev/shm; " +
		"touch /dev/new 2>/dev/null || echo dev-ro; echo x > /dev/null && echo null-ok; head -c 4 /dev/zero | wc -c"
	outA, outC := strings.Fields(sh(t, a, probe)), strings.Fields(sh(t, c, probe))
	want := []string{"full", "null", "pts", "random", "shm", "stderr", "stdin", "stdout", "tty", "urandom", "zero", "/proc/self/fd", "/proc/self/fd/0", "1777", "dev-ro", "null-ok", "4"}
	for _, out := range [][]string{outA, outC} {
		if len(out) < 3 || !slices.Contains(out, "fd") || !slices.Equal(slices.DeleteFunc(slices.Clone(out[2:]), func(f string) bool { return f == "fd" }), want) {
			t.Fatalf("/dev: %q, want devices %q", out, want)
		}
	}
	if outA[0] != outC[0] {
		t.Errorf("/dev is device %s in one sandbox and %s in another: a filesystem each", outA[0], outC[0])
	}
	if outA[1] == outA[0] || outA[1] == outC[1] {
		t.Errorf("/dev/shm devices %s and %s (/dev %s): not a filesystem of each sandbox's own", outA[1], outC[1], outA[0])
	}
	sh(t, a, "echo x > /dev/shm/f")
	if out := sh(t, c, "ls /dev/shm"); out != "" {
		t.Errorf("/dev/shm of the second sandbox after the first wrote there: %q", out)
	}
}

func TestFreezeThaw(t *testing.T) {
	b := setup(t)
	s := b.create(t, sandbox.Spec{})
	ctx := t.Context()
	if _, err := s.Exec(ctx, sandbox.ExecRequest{Command: "while true; do echo x >> /tmp/ticks; sleep 0.01; done", Background: true}); err != nil {
		t.Fatal(err)
	}
	sh(t, s, "while [ ! -s /tmp/ticks ]; do sleep 0.01; done")
	if err := s.Freeze(); err != nil {
		t.Fatal(err)
	}
	n1, _, err := s.ReadFile(ctx, "/tmp/ticks", 0, 0)
	if err != nil {
		t.Fatal(err)
	}
	time.Sleep(100 * time.Millisecond) // a frozen writer must not advance in this window
	n2, _, _ := s.ReadFile(ctx, "/tmp/ticks", 0, 0)
	if len(n1) != len(n2) {
		t.Fatalf("frozen sandbox kept writing: %d then %d bytes", len(n1), len(n2))
	}
	if err := s.Thaw(); err != nil {
		t.Fatal(err)
	}
	sh(t, s, fmt.Sprintf("while [ $(wc -c < /tmp/ticks) -le %d ]; do sleep 0.01; done", len(n2)))
}

func TestCheckpointTTL(t *testing.T) {
	b := setup(t, func(c *sandbox.Config) { c.CheckpointTTL = 200 * time.Millisecond })
	s := b.create(t, sandbox.Spec{})
	ck, err := s.Checkpoint(t.Context())
	if err != nil {
		t.Fatal(err)
	}
	// The sandbox's state descends from ck until it takes another.
	if _, err := s.Checkpoint(t.Context()); err != nil {
		t.Fatal(err)
	}
	deadline := time.Now().Add(5 * time.Second)
	for {
		if _, err := b.rt.Checkpoint(ck.ID); errors.Is(err, sandbox.ErrNotFound) {
			break
		}
		if time.Now().After(deadline) {
			t.Fatal("checkpoint outlived its TTL")
		}
		time.Sleep(20 * time.Millisecond)
	}
	if err := s.Restore(t.Context(), ck.ID); !errors.Is(err, sandbox.ErrNotFound) {
		t.Fatalf("restore of an expired checkpoint: %v", err)
	}
}

// A plain command line runs without a shell, with the result the shell
// would give, not-found and builtins included.
func TestPlainCommandsAsTheShellWould(t *testing.T) {
	b := setup(t)
	s := b.create(t, sandbox.Spec{})
	for _, tc := range []struct {
		cmd, stdout string
		exit        int
		stderrHas   string
	}{
		{"echo a  b", "a b\n", 0, ""},
		{"true", "", 0, ""},
		{"false", "", 1, ""},
		{"no-such-command x", "", 127, "not found"},
		{"cd /tmp", "", 0, ""},
		{"exit 4", "", 4, ""},
		{"echo $HOME", "/root\n", 0, ""},
		{"echo a*b", "a*b\n", 0, ""},
		{"/tmp", "", 126, "denied"},
	} {
		res, err := s.Exec(t.Context(), sandbox.ExecRequest{Command: tc.cmd})
		if err != nil {
			t.Fatalf("%q: %v", tc.cmd, err)
		}
		if string(res.Stdout) != tc.stdout || res.ExitCode != tc.exit || !strings.Contains(string(res.Stderr), tc.stderrHas) {
			t.Errorf("%q: stdout %q exit %d stderr %q", tc.cmd, res.Stdout, res.ExitCode, res.Stderr)
		}
	}
}
