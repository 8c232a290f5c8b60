package securitytest

import (
	"strings"
	"testing"
	"time"

	"github.com/deltagym/deltagym/clients/go/deltagym"
)

// leftovers lists the processes of sb besides its init and the shell that lists them.
func (s *suite) leftovers(t *testing.T, sb *deltagym.Sandbox) string {
	t.Helper()
	// Shell builtins only: the loop starts no process of its own.
	return s.sh(t, sb, "for p in /proc/[0-9]*; do n=${p#/proc/}; [ $n = 1 ] || [ $n = $$ ] || echo $n $(tr '\\0' ' ' < $p/cmdline); done")
}

// reset ends whatever runs in sb: a restore of its episode's first checkpoint kills its work
// group.
func (s *suite) reset(t *testing.T, sb *deltagym.Sandbox) {
	t.Helper()
	if _, err := sb.Restore(t.Context(), sb.StartCheckpointID()); err != nil {
		t.Fatalf("restoring %s: %v", sb.ID(), err)
	}
	if left := s.leftovers(t, sb); left != "" {
		t.Errorf("processes left after a restore:\n%s", left)
	}
}

// Fork bombs: the pids limit (128 in env sec) stops them; the canary answers while one runs,
// and a timeout or a restore ends it all.
func TestAttackForkBomb(t *testing.T) {
	s := begin(t)
	sb := s.sandbox(t)
	s.exec(t, sb, "b() { b | b & }; b", deltagym.InBackground())
	s.checkCanary(t) // while the bomb runs
	// Stopped, the bomb's processes neither fork nor exit while /proc is listed, so the count is
	// of processes alive at once (a listing of a running bomb also counts those that replaced
	// others meanwhile). The init and this shell are not the bomb's.
	res, err := sb.Exec(t.Context(), "kill -STOP -1; n=0; for p in /proc/[0-9]*; do case ${p#/proc/} in 1|$$) ;; *) n=$((n+1));; esac; done; echo $n")
	if err == nil && res.OK() {
		t.Logf("bomb processes alive at once: %s", strings.TrimSpace(string(res.Stdout)))
		if n := strings.TrimSpace(string(res.Stdout)); len(n) > 3 || (len(n) == 3 && n > "128") {
			t.Errorf("%s processes under a pids limit of 128", n)
		}
	}
	s.reset(t, sb)

	// In the foreground, with a timeout: the timeout ends every process the bomb made.
	res = s.exec(t, sb, "b() { b | b & }; b; sleep 1000", deltagym.WithTimeout(2*time.Second))
	if res.OK() {
		t.Errorf("the fork bomb exited 0 within its timeout")
	}
	if left := s.leftovers(t, sb); left != "" {
		t.Errorf("processes left after the bomb's timeout:\n%.500s", left)
	}
	// Python's fork loop, which does not stop at a failed fork.
	res = s.exec(t, sb, "python3 -c 'import os\nwhile True:\n    try: os.fork()\n    except OSError: pass'", deltagym.WithTimeout(2*time.Second))
	if !res.TimedOut {
		t.Errorf("python's fork loop: exit %d signal %d, want a timeout", res.ExitCode, res.Signal)
	}
	if left := s.leftovers(t, sb); left != "" {
		t.Errorf("processes left after python's fork loop:\n%.500s", left)
	}
}

// Memory bombs: the memory limit (256 MiB) kills the allocator (or its allocation fails); the
// canary answers while one grows.
func TestAttackMemoryBomb(t *testing.T) {
	s := begin(t)
	sb := s.sandbox(t)
	s.exec(t, sb, "python3 -c 'x = []\nwhile True: x.append(bytearray(1 << 20))'", deltagym.InBackground())
	s.checkCanary(t) // while it grows
	s.reset(t, sb)
	for _, cmd := range []string{
		"python3 -c 'x = bytearray(512 << 20); print(len(x))'",
		"python3 -c 'x = []\nwhile True: x.append(bytearray(1 << 20))'",
		"head -c 400000000 /dev/zero > /dev/shm/fill",
		"x=$(head -c 400000000 /dev/zero | tr '\\0' a); echo ${#x}",
	} {
		res := s.exec(t, sb, cmd, deltagym.WithTimeout(20*time.Second))
		if res.OK() {
			t.Errorf("%s: succeeded under a 256 MiB limit: %.100s", cmd, res.Stdout)
		}
	}
	s.sh(t, sb, "rm -f /dev/shm/fill")
	if left := s.leftovers(t, sb); left != "" {
		t.Errorf("processes left:\n%s", left)
	}
}

// Disk bombs: the writable layer's size (32 MiB) stops a writer with ENOSPC, and so does a file
// action; freeing space makes room again.
func TestAttackDiskBomb(t *testing.T) {
	s := begin(t)
	sb := s.sandbox(t)
	res := s.exec(t, sb, "dd if=/dev/zero of=/work/fill bs=1M count=256", deltagym.WithTimeout(20*time.Second))
	if res.OK() || !strings.Contains(string(res.Stderr), "No space left on device") {
		t.Errorf("a 256 MiB file on a 32 MiB layer: exit %d\n%s", res.ExitCode, res.Stderr)
	}
	for _, p := range []string{"/tmp/more", "/root/more", "/work/more"} {
		if _, err := sb.WriteFile(t.Context(), p, make([]byte, 4<<20)); err == nil {
			t.Errorf("WriteFile %s of 4 MiB on a full layer: succeeded", p)
		}
	}
	s.checkCanary(t) // with the layer full
	s.sh(t, sb, "rm /work/fill")
	if _, err := sb.WriteFile(t.Context(), "/work/more", make([]byte, 4<<20)); err != nil {
		t.Errorf("WriteFile after freeing space: %v", err)
	}
}

// Inode bombs: empty files cost no bytes of the layer's size, but an inode and a dentry each of
// kernel memory; the layer's tmpfs must run out of inodes long before the machine does.
func TestAttackInodeBomb(t *testing.T) {
	s := begin(t)
	sb := s.sandbox(t)
	res := s.exec(t, sb, "python3 -c 'import os\ni = 0\nwhile True:\n    open(\"/work/i%d\" % i, \"w\").close()\n    i += 1'",
		deltagym.WithTimeout(20*time.Second))
	if res.TimedOut || !strings.Contains(string(res.Stderr), "No space left on device") {
		t.Errorf("an inode bomb: exit %d, timed out %v, %s", res.ExitCode, res.TimedOut, res.Stderr)
	}
	s.checkCanary(t)
}

// Output bombs: output is cut at the env's cap (64 KiB) and flagged, and the timeout ends the
// writer.
func TestAttackOutputBomb(t *testing.T) {
	s := begin(t)
	sb := s.sandbox(t)
	const limit = 64 << 10
	for _, cmd := range []string{"yes", "cat /dev/zero", "yes err >&2", "head -c 100000000 /dev/urandom", "while :; do echo x; done"} {
		res := s.exec(t, sb, cmd, deltagym.WithTimeout(time.Second))
		out, trunc := res.Stdout, res.StdoutTruncated
		if strings.HasSuffix(cmd, ">&2") {
			out, trunc = res.Stderr, res.StderrTruncated
		}
		if len(out) > limit {
			t.Errorf("%s: %d bytes of output, over the cap %d", cmd, len(out), limit)
		}
		if len(out) == limit && !trunc {
			t.Errorf("%s: output at the cap, not flagged truncated", cmd)
		}
		if !strings.HasPrefix(cmd, "while") && (len(out) != limit || !trunc) {
			t.Errorf("%s: %d bytes, truncated %v: want the cap, truncated", cmd, len(out), trunc)
		}
		if res.Duration > 10*time.Second {
			t.Errorf("%s: took %v with a 1 s timeout", cmd, res.Duration)
		}
	}
	if left := s.leftovers(t, sb); left != "" {
		t.Errorf("processes left:\n%s", left)
	}
}

// Timeout escapes: a command's timeout kills every process it started, in a new session or
// reparented by a double fork, not only its own process group.
func TestAttackTimeoutEscape(t *testing.T) {
	s := begin(t)
	sb := s.sandbox(t)
	for _, cmd := range []string{
		"setsid sleep 1000 & sleep 1000",
		"setsid -f sleep 1000; sleep 1000",
		"(setsid sh -c 'sleep 1000 &' &); sleep 1000",
		"sh -c '(sleep 1000 &) &'; sleep 1000",
		"nohup sleep 1000 > /dev/null 2>&1 & sleep 1000",
		"python3 -c 'import os, time\nif os.fork() == 0:\n    os.setsid()\n    if os.fork() == 0:\n        time.sleep(1000)\n    os._exit(0)\ntime.sleep(1000)'",
	} {
		res := s.exec(t, sb, cmd, deltagym.WithTimeout(time.Second))
		if !res.TimedOut {
			t.Errorf("%s: not timed out (exit %d)", cmd, res.ExitCode)
		}
		if left := s.leftovers(t, sb); left != "" {
			t.Errorf("%s: left running after its timeout:\n%s", cmd, left)
		}
	}
}
