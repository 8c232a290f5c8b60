package sandbox_test

import (
	"bytes"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/deltagym/deltagym/sandbox"
)

// Hostile input: each attack is contained by its limit with a clear error,
// the attacked sandbox is still usable afterwards, and a bystander sandbox
// of the same runtime keeps running commands with its files intact.
func TestHostile(t *testing.T) {
	b := setup(t, filesOnly) // background attackers are process trees
	ctx := t.Context()
	bystander := b.create(t, sandbox.Spec{})
	sh(t, bystander, "echo intact > /root/keep")
	checkBystander := func(t *testing.T) {
		t.Helper()
		start := time.Now()
		if out := sh(t, bystander, "cat /root/keep"); out != "intact\n" {
			t.Fatalf("bystander's file: %q", out)
		}
		if d := time.Since(start); d > 2*time.Second {
			t.Errorf("bystander took %v to run a command", d)
		}
	}
	// usable checks that the attacked sandbox runs commands and that
	// nothing of the attack is left running in it.
	usable := func(t *testing.T, s *sandbox.Sandbox) {
		t.Helper()
		// The loop is shell builtins: only the init and this shell remain.
		out := sh(t, s, "echo ok; for p in /proc/[0-9]*; do n=${p#/proc/}; [ $n = 1 ] || [ $n = $$ ] || echo $n $(cat $p/cmdline | tr '\\0' ' '); done")
		if !strings.HasPrefix(out, "ok\n") {
			t.Fatalf("after the attack: %q", out)
		}
		if left := strings.TrimPrefix(out, "ok\n"); left != "" {
			t.Errorf("processes left in the sandbox after the attack:\n%s", left)
		}
	}

	t.Run("path escapes", func(t *testing.T) {
		s := b.create(t, sandbox.Spec{})
		secret := filepath.Join(b.dir, "host-secret")
		if err := os.WriteFile(secret, []byte("host-only"), 0o600); err != nil {
			t.Fatal(err)
		}
		landing := filepath.Join(b.dir, "landing") // a host directory writes must not reach
		if err := os.Mkdir(landing, 0o755); err != nil {
			t.Fatal(err)
		}
		sh(t, s, "mkdir -p /esc/d; ln -s / /esc/root; ln -s /proc/1/root /esc/magic; ln -s ../../../../../../../../.. /esc/up")
		for _, p := range []string{
			"../../../../../../.." + secret, "/../../.." + secret, secret,
			"/esc/root" + secret, "/esc/up" + secret, "/esc/magic" + secret, "/esc/magic/etc/hostname",
			"/proc/self/root" + secret, "/proc/1/environ", "/sys/kernel/hostname", "/dev/zero",
		} {
			data, _, err := s.ReadFile(ctx, p, 0, 0)
			if bytes.Contains(data, []byte("host-only")) {
				t.Errorf("ReadFile %s reached the host: %q", p, data)
			}
			if err != nil && !refusedPath(err) {
				t.Errorf("ReadFile %s: %v, want ErrInvalid, ErrNotFound or a file of the sandbox", p, err)
			}
			err = s.WriteFile(ctx, p, []byte("escaped"), 0, false)
			if err != nil && !refusedPath(err) {
				t.Errorf("WriteFile %s: %v, want ErrInvalid, ErrNotFound or a write inside", p, err)
			}
		}
		if got, _ := os.ReadFile(secret); string(got) != "host-only" {
			t.Fatalf("the host file changed: %q", got)
		}

		// A symlink flipped while WriteFile and ReadFile resolve through
		// it: at a directory of the sandbox, at the host path of landing
		// (made inside the sandbox too), at the root (absolute and
		// relative) and at a magic link (/proc/self/root: mv cannot stat
		// /proc/1/root and would stop flipping). Writes go to /race/l/f<n>: if
		// the runtime followed the link on the host, they would land in the
		// host's landing directory. /race/race/dir and /race/<landing> are
		// there for WriteFile's parent walk, which resolves an absolute
		// symlink below the root from the link's directory
		// (TestFileParentThroughAbsoluteSymlink).
		sh(t, s, "mkdir -p /race/dir /race/race/dir "+landing+" /race"+landing+"; ln -s /race/dir /race/l")
		// Each flip is a rename over the link (mv -T), so /race/l always
		// exists: WriteFile never finds it missing and makes a directory.
		flip := "while :; do for t in /race/dir " + landing + " / /proc/self/root ../../../../..; do ln -sfn $t /race/n && mv -fT /race/n /race/l; done; done"
		if _, err := s.Exec(ctx, sandbox.ExecRequest{Command: flip, Background: true}); err != nil {
			t.Fatal(err)
		}
		var wrote, refused, eagain int
		kinds := map[string]int{}
		// Go on for at least a second (many flips: each is two
		// processes) and until some writes went through, at most 5 s.
		start := time.Now()
		for i := 0; (time.Since(start) < time.Second || wrote < 20) && time.Since(start) < 5*time.Second; i++ {
			time.Sleep(100 * time.Microsecond) // pacing: leave the flipper CPU time (two cores)
			name := fmt.Sprintf("/race/l/f%d", i%8)
			err := s.WriteFile(ctx, name, []byte("race"), 0o644, false)
			switch {
			case errors.Is(err, syscall.EAGAIN):
				eagain++ // see below
			case err == nil:
				wrote++
			case refusedPath(err):
				kinds[err.Error()[strings.LastIndex(err.Error(), ": ")+2:]]++
				refused++
			default:
				t.Fatalf("WriteFile %s: %v", name, err)
			}
			data, _, err := s.ReadFile(ctx, "/race/l"+secret, 0, 0)
			if bytes.Contains(data, []byte("host-only")) {
				t.Fatalf("ReadFile through the flipping link reached the host")
			}
			if errors.Is(err, syscall.EAGAIN) {
				eagain++
			} else if err != nil && !refusedPath(err) {
				t.Fatalf("ReadFile through the flipping link: %v", err)
			}
		}
		if entries, err := os.ReadDir(landing); err != nil || len(entries) > 0 {
			t.Fatalf("writes landed on the host: %v %v", entries, err)
		}
		if wrote == 0 {
			t.Errorf("no write went through the flipping link (%d refused): the race was not exercised", refused)
		}
		// The writes that went through landed inside the sandbox.
		if out := sh(t, s, "ls /race/dir "+landing+" / | grep -c '^f[0-7]$' || true"); strings.TrimSpace(out) == "0" {
			t.Errorf("%d writes succeeded but none is inside the sandbox", wrote)
		}
		t.Logf("%d writes through the flipping link landed inside, %d were refused (%v), %d reads and writes failed with EAGAIN", wrote, refused, kinds, eagain)
		// openat2 with RESOLVE_IN_ROOT fails with EAGAIN when a rename
		// races the lookup; the runtime retries, then says so clearly.
		if eagain > 0 {
			t.Errorf("%d file actions returned a raw EAGAIN from openat2", eagain)
		}
		if err := s.Restore(ctx, mustCheckpoint(t, s)); err != nil { // ends the flipper
			t.Fatal(err)
		}
		usable(t, s)
		checkBystander(t)
	})

	t.Run("oversized and malformed input", func(t *testing.T) {
		s := b.create(t, sandbox.Spec{})
		for _, tc := range []struct {
			name string
			err  error
		}{
			{"write over MaxFileBytes", s.WriteFile(ctx, "/big", make([]byte, sandbox.MaxFileBytes+1), 0, false)},
			{"path over 4096 bytes", s.WriteFile(ctx, "/"+strings.Repeat("a/", 2100), []byte("x"), 0, false)},
			{"component over NAME_MAX", s.WriteFile(ctx, "/"+strings.Repeat("n", 300), []byte("x"), 0, false)},
			{"NUL in path", s.WriteFile(ctx, "/a\x00b", []byte("x"), 0, false)},
			{"mode with type bits", s.WriteFile(ctx, "/m", []byte("x"), os.ModeDir|0o755, false)},
			{"negative read offset", func() error { _, _, err := s.ReadFile(ctx, "/etc/passwd", -1, 0); return err }()},
			{"read of a directory", func() error { _, _, err := s.ReadFile(ctx, "/etc", 0, 0); return err }()},
			{"stdin over MaxStdin", func() error {
				_, err := s.Exec(ctx, sandbox.ExecRequest{Argv: []string{"cat"}, Stdin: make([]byte, sandbox.MaxStdin+1)})
				return err
			}()},
		} {
			if !errors.Is(tc.err, sandbox.ErrInvalid) {
				t.Errorf("%s: %v, want ErrInvalid", tc.name, tc.err)
			}
		}
		if out := sh(t, s, "ls /big /m 2>&1 || true"); !strings.Contains(out, "No such file") {
			t.Errorf("a refused write left a file: %q", out)
		}
		usable(t, s)
		checkBystander(t)
	})

	t.Run("unknown IDs", func(t *testing.T) {
		s := b.create(t, sandbox.Spec{})
		gone := b.create(t, sandbox.Spec{})
		if err := gone.Destroy(ctx); err != nil {
			t.Fatal(err)
		}
		ck := mustCheckpoint(t, s)
		if err := b.rt.ReleaseCheckpoint(ck); err != nil {
			t.Fatal(err)
		}
		for _, tc := range []struct {
			name string
			err  error
		}{
			{"Get unknown", func() error { _, err := b.rt.Get("sb-0000000000000000"); return err }()},
			{"Get destroyed", func() error { _, err := b.rt.Get(gone.ID()); return err }()},
			{"Get empty", func() error { _, err := b.rt.Get(""); return err }()},
			{"Checkpoint lookup", func() error { _, err := b.rt.Checkpoint("ck-nope"); return err }()},
			{"Restore unknown", s.Restore(ctx, "ck-0000000000000000")},
			{"Restore released", s.Restore(ctx, ck)},
			{"Restore path-like", s.Restore(ctx, "../../etc/passwd")},
			{"Fork unknown", func() error { _, err := b.rt.Fork(ctx, "ck-nope", 2, sandbox.Spec{}); return err }()},
			{"Fork released", func() error { _, err := b.rt.Fork(ctx, ck, 1, sandbox.Spec{}); return err }()},
			{"Create from unknown checkpoint", func() error { _, err := b.rt.Create(ctx, sandbox.Spec{Checkpoint: "ck-nope"}); return err }()},
			{"Create from unknown image", func() error { _, err := b.rt.Create(ctx, sandbox.Spec{Image: "no-such-image"}); return err }()},
			{"Release unknown", b.rt.ReleaseCheckpoint("ck-nope")},
			{"Release twice", b.rt.ReleaseCheckpoint(ck)},
			{"Image unknown", func() error { _, err := b.rt.Image("nope"); return err }()},
		} {
			if !errors.Is(tc.err, sandbox.ErrNotFound) {
				t.Errorf("%s: %v, want ErrNotFound", tc.name, tc.err)
			}
		}
		if _, err := gone.Exec(ctx, sandbox.ExecRequest{Command: "true"}); !errors.Is(err, sandbox.ErrClosed) {
			t.Errorf("exec in a destroyed sandbox: %v, want ErrClosed", err)
		}
		if err := gone.WriteFile(ctx, "/x", []byte("x"), 0, false); !errors.Is(err, sandbox.ErrClosed) {
			t.Errorf("WriteFile in a destroyed sandbox: %v, want ErrClosed", err)
		}
		usable(t, s)
		checkBystander(t)
	})

	t.Run("fork bomb", func(t *testing.T) {
		const pids = 64
		s := b.create(t, sandbox.Spec{Limits: sandbox.Limits{Pids: pids}})
		start := time.Now()
		res, err := s.Exec(ctx, sandbox.ExecRequest{Command: "b() { b | b & }; b; sleep 1000", Timeout: 2 * time.Second})
		if err != nil {
			t.Fatal(err)
		}
		// Either the timeout ends it, or the shell itself cannot fork its
		// `sleep` once the limit is reached and exits with an error: both
		// are the bomb contained. Succeeding is not.
		if !res.TimedOut && (res.ExitCode == 0 || !strings.Contains(string(res.Stderr), "can't fork")) {
			t.Fatalf("the fork bomb was neither timed out nor refused: exit %d, stderr %.200q", res.ExitCode, res.Stderr)
		}
		if d := time.Since(start); d > 10*time.Second {
			t.Errorf("ending the fork bomb took %v", d)
		}
		events, max := pidsFile(t, b, s, "pids.events"), pidsFile(t, b, s, "pids.max")
		if max != strconv.Itoa(pids) {
			t.Errorf("pids.max %q, want %d", max, pids)
		}
		if n, _ := strconv.Atoi(strings.TrimPrefix(events, "max ")); n == 0 {
			t.Errorf("the pids limit was never hit (pids.events %q): the bomb did not run", events)
		}
		usable(t, s)
		checkBystander(t)
	})

	t.Run("memory eater", func(t *testing.T) {
		s := b.create(t, sandbox.Spec{Limits: sandbox.Limits{MemoryBytes: 64 << 20}})
		// busybox dd allocates its whole block and fills it from /dev/zero.
		res, err := s.Exec(ctx, sandbox.ExecRequest{Command: "dd if=/dev/zero of=/dev/null bs=256M count=1", Timeout: 20 * time.Second})
		if err != nil {
			t.Fatal(err)
		}
		if res.Signal != "SIGKILL" && res.ExitCode != 137 {
			t.Fatalf("a 256 MiB allocation under a 64 MiB limit: exit %d signal %q timed out %v\n%s", res.ExitCode, res.Signal, res.TimedOut, res.Stderr)
		}
		// A shell that grows a variable: killed as well, not the init.
		res, err = s.Exec(ctx, sandbox.ExecRequest{Command: "x=$(head -c 200000000 /dev/zero | tr '\\0' a); echo ${#x}", Timeout: 20 * time.Second})
		if err != nil {
			t.Fatal(err)
		}
		if res.ExitCode == 0 && strings.TrimSpace(string(res.Stdout)) == "200000000" {
			t.Fatalf("200 MB held in a shell variable under a 64 MiB limit")
		}
		usable(t, s)
		checkBystander(t)
	})

	t.Run("disk filler", func(t *testing.T) {
		s := b.create(t, sandbox.Spec{Limits: sandbox.Limits{DiskBytes: 8 << 20}})
		res, err := s.Exec(ctx, sandbox.ExecRequest{Command: "dd if=/dev/zero of=/fill bs=1M count=64", Timeout: 20 * time.Second})
		if err != nil {
			t.Fatal(err)
		}
		if res.ExitCode == 0 || !strings.Contains(string(res.Stderr), "No space left on device") {
			t.Fatalf("filling an 8 MiB disk: exit %d\n%s", res.ExitCode, res.Stderr)
		}
		// Many small files run out too.
		res, err = s.Exec(ctx, sandbox.ExecRequest{Command: "i=0; while echo $i > /tmp/n$i; do i=$((i+1)); done; echo $i", Timeout: 20 * time.Second})
		if err != nil || res.TimedOut || res.ExitCode != 0 {
			t.Fatalf("small files: %v %+v", err, res)
		}
		if err := s.WriteFile(ctx, "/more", make([]byte, 1<<20), 0, false); !errors.Is(err, sandbox.ErrBudget) {
			t.Fatalf("WriteFile on a full disk: %v, want ErrBudget", err)
		}
		sh(t, s, "rm -f /fill /tmp/n*")
		if err := s.WriteFile(ctx, "/more", make([]byte, 1<<20), 0, false); err != nil {
			t.Fatalf("WriteFile after freeing space: %v", err)
		}
		usable(t, s)
		checkBystander(t)
	})

	t.Run("printing forever", func(t *testing.T) {
		s := b.create(t, sandbox.Spec{})
		for _, cmd := range []string{"yes", "cat /dev/zero", "yes err >&2", "while :; do echo x; done"} {
			// A shell loop writes 2 bytes a system call: keep its cap small
			// enough to be reached on a loaded machine.
			limit := 64 << 10
			if strings.HasPrefix(cmd, "while") {
				limit = 2 << 10
			}
			res, err := s.Exec(ctx, sandbox.ExecRequest{Command: cmd, Timeout: 500 * time.Millisecond, MaxOutput: limit})
			if err != nil {
				t.Fatalf("%s: %v", cmd, err)
			}
			out, trunc := res.Stdout, res.StdoutTruncated
			if strings.HasSuffix(cmd, ">&2") {
				out, trunc = res.Stderr, res.StderrTruncated
			}
			if !res.TimedOut || len(out) != limit || !trunc {
				t.Errorf("%s: timed out %v, %d bytes, truncated %v", cmd, res.TimedOut, len(out), trunc)
			}
			if res.Duration > 5*time.Second {
				t.Errorf("%s: took %v with a 500ms timeout", cmd, res.Duration)
			}
		}
		usable(t, s)
		checkBystander(t)
	})

	t.Run("bad argv, env and cwd", func(t *testing.T) {
		s := b.create(t, sandbox.Spec{})
		for _, tc := range []struct {
			name string
			req  sandbox.ExecRequest
		}{
			{"nothing to run", sandbox.ExecRequest{}},
			{"argv and command", sandbox.ExecRequest{Argv: []string{"true"}, Command: "true"}},
			{"empty argv entry", sandbox.ExecRequest{Argv: []string{""}}},
			{"NUL in argv", sandbox.ExecRequest{Argv: []string{"echo", "a\x00b"}}},
			{"NUL in command", sandbox.ExecRequest{Command: "echo a\x00b"}},
			{"NUL in cwd", sandbox.ExecRequest{Command: "true", Cwd: "/tmp\x00"}},
			{"env without =", sandbox.ExecRequest{Command: "true", Env: []string{"NOVALUE"}}},
			{"env with empty key", sandbox.ExecRequest{Command: "true", Env: []string{"=x"}}},
			{"negative timeout", sandbox.ExecRequest{Command: "true", Timeout: -time.Second}},
			{"negative output cap", sandbox.ExecRequest{Command: "true", MaxOutput: -1}},
			{"missing program", sandbox.ExecRequest{Argv: []string{"/no/such/program"}}},
			{"program is a directory", sandbox.ExecRequest{Argv: []string{"/etc"}}},
			{"program not executable", sandbox.ExecRequest{Argv: []string{"/etc/passwd"}}},
			{"background session", sandbox.ExecRequest{Command: "true", Session: "s", Background: true}},
		} {
			res, err := s.Exec(ctx, tc.req)
			if !errors.Is(err, sandbox.ErrInvalid) {
				t.Errorf("%s: %v (%+v), want ErrInvalid", tc.name, err, res)
			}
		}
		// A missing cwd: refused, or the command fails to start there.
		res, err := s.Exec(ctx, sandbox.ExecRequest{Command: "echo ran", Cwd: "/no/such/dir"})
		if err == nil && (res.ExitCode == 0 || strings.Contains(string(res.Stdout), "ran")) {
			t.Errorf("a command ran in a missing cwd: %+v", res)
		} else if err != nil && !errors.Is(err, sandbox.ErrInvalid) {
			t.Errorf("missing cwd: %v, want ErrInvalid or a failed start", err)
		}
		// Shell-level failures are exit codes, not errors.
		res, err = s.Exec(ctx, sandbox.ExecRequest{Command: "no-such-command"})
		if err != nil || res.ExitCode != 127 {
			t.Errorf("unknown command in a shell: exit %d, %v, want 127", res.ExitCode, err)
		}
		// A huge environment and argv are the kernel's to refuse (E2BIG).
		res, err = s.Exec(ctx, sandbox.ExecRequest{Argv: []string{"echo", strings.Repeat("a", 200_000)}})
		if err == nil && res.ExitCode == 0 {
			t.Errorf("a 200 kB argument ran: %d bytes out", len(res.Stdout))
		}
		if err != nil && !errors.Is(err, sandbox.ErrInvalid) {
			t.Errorf("a 200 kB argument: %v, want ErrInvalid", err)
		}
		usable(t, s)
		checkBystander(t)
	})
}

func mustCheckpoint(t *testing.T, s *sandbox.Sandbox) string {
	t.Helper()
	ck, err := s.Checkpoint(t.Context())
	if err != nil {
		t.Fatal(err)
	}
	return ck.ID
}

// pidsFile reads a file of the sandbox's pids cgroup (cgroup v1 here, v2
// elsewhere).
func pidsFile(t *testing.T, b *bundle, s *sandbox.Sandbox, name string) string {
	t.Helper()
	for _, root := range []string{"/sys/fs/cgroup/pids", "/sys/fs/cgroup/unified", "/sys/fs/cgroup"} {
		data, err := os.ReadFile(filepath.Join(root, b.cfg.CgroupRoot, s.ID(), name))
		if err == nil {
			return strings.TrimSpace(string(data))
		}
	}
	t.Fatalf("no %s for sandbox %s under cgroup root %s", name, s.ID(), b.cfg.CgroupRoot)
	return ""
}

// WriteFile creates missing parents resolving each prefix from the sandbox's
// root, so an absolute symlink among them resolves as the sandbox would:
// /a/link -> /a/real is /a/real, not /a/a/real.
func TestFileParentThroughAbsoluteSymlink(t *testing.T) {
	b := setup(t)
	s := b.create(t, sandbox.Spec{})
	ctx := t.Context()
	sh(t, s, "mkdir -p /a/real; ln -s /a/real /a/link; ln -s / /a/root")
	for _, tc := range []struct{ path, want string }{
		{"/a/link/f", "/a/real/f"},
		{"/a/link/new/f", "/a/real/new/f"},
		{"/a/root/a/real/g", "/a/real/g"},
	} {
		if err := s.WriteFile(ctx, tc.path, []byte("x"), 0, false); err != nil {
			t.Errorf("WriteFile %s: %v", tc.path, err)
			continue
		}
		if out := sh(t, s, "cat "+tc.want+" 2>&1; true"); out != "x" {
			t.Errorf("WriteFile %s: %s holds %q", tc.path, tc.want, out)
		}
	}
	if out := sh(t, s, "ls /a"); out != "link\nreal\nroot\n" {
		t.Errorf("parents made in the wrong place: /a holds %q", out)
	}
}

// refusedPath tells a file action's error for a path that leaves the sandbox or
// is not there: the path is refused, or found missing inside the root.
func refusedPath(err error) bool {
	return errors.Is(err, sandbox.ErrInvalid) || errors.Is(err, sandbox.ErrNotFound)
}
