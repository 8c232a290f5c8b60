package securitytest

import (
	"context"
	"flag"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/deltagym/deltagym/clients/go/deltagym"
	"github.com/deltagym/deltagym/server/servertest"
)

// env is the catalog of the suite's server: one env on the default image (python3 runs the
// system calls of sysHelper), with limits small enough that every bomb reaches them quickly.
const env = `{"name": "sec", "image": "default", "setup": ["mkdir -p /work"],
	"env": {"HOME": "/root", "PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin", "LANG": "C.UTF-8"},
	"workdir": "/work",
	"limits": {"memory_bytes": 268435456, "pids": 128, "disk_bytes": 33554432, "output_bytes": 65536,
		"step_timeout_seconds": 30},
	"pool_size": 2}`

// sysHelper runs one system call and prints its outcome: "ok <return value>", or the name of
// the errno it failed with. Arguments: a number (0x… allowed), s:<text> for a string, b:<n> for
// n zero bytes, q:<w>,<w>,… for 64-bit words in memory (a clone_args, say).
const sysHelper = `import ctypes, errno, struct, sys
libc = ctypes.CDLL(None, use_errno=True)
libc.syscall.restype = ctypes.c_long
keep = []
def arg(a):
    if a.startswith("s:"):
        return ctypes.c_char_p(a[2:].encode())
    if a.startswith("b:") or a.startswith("q:"):
        if a[0] == "b":
            buf = ctypes.create_string_buffer(int(a[2:], 0))
        else:
            words = [int(w, 0) for w in a[2:].split(",")]
            buf = ctypes.create_string_buffer(struct.pack("<%dQ" % len(words), *words))
        keep.append(buf)
        return ctypes.cast(buf, ctypes.c_void_p)
    return ctypes.c_long(int(a, 0))
r = libc.syscall(ctypes.c_long(int(sys.argv[1], 0)), *[arg(a) for a in sys.argv[2:]])
if r == -1:
    e = ctypes.get_errno()
    print(errno.errorcode.get(e, str(e)))
else:
    print("ok", r)
`

// helperPath is where every sandbox of the suite gets sysHelper.
const helperPath = "/run/dgsec.py"

var (
	srv      *servertest.Server
	skipWhy  string // why srv could not start here (not root, -short, no image)
	startErr error
	token    string // srv's bearer token
)

func TestMain(m *testing.M) {
	os.Exit(run(m))
}

func run(m *testing.M) int {
	flag.Parse() // testing.Short, which servertest.Start asks, needs the flags
	envs, err := os.MkdirTemp("", "dgsec-envs")
	if err != nil {
		startErr = err
		return m.Run()
	}
	defer os.RemoveAll(envs)
	if err := os.WriteFile(filepath.Join(envs, "sec.json"), []byte(env), 0o644); err != nil {
		startErr = err
		return m.Run()
	}
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
	srv, skipWhy, startErr = servertest.Start(ctx, servertest.Options{EnvsDir: envs})
	cancel()
	if srv != nil {
		token = srv.Token()
		defer func() {
			if err := srv.Close(); err != nil {
				fmt.Fprintln(os.Stderr, "closing the suite's server:", err)
			}
		}()
	}
	return m.Run()
}

// suite is one family's view of the server: its clients, and the canary whose Step latency
// the family must not disturb.
type suite struct {
	c        *deltagym.Client // Connect
	grpc     *deltagym.Client // the same server over gRPC, for the families of API input
	canary   *deltagym.Sandbox
	baseline time.Duration // the slowest of the canary's Steps before the attack
}

// canarySteps is how many Steps measure the canary's baseline; canaryFactor and canaryFloor
// make the limit its Steps must keep to after the attack: a generous multiple of the slowest,
// with a floor for a machine that other work shares.
const (
	canarySteps  = 5
	canaryFactor = 20
	canaryFloor  = time.Second
)

// begin starts a family: it skips t where the server cannot run, resets the canary, writes a
// file into it and measures its Step latency. At the end of t (a cleanup, after the attack's
// own checks), the canary must still hold its file and answer within the limit.
func begin(t *testing.T) *suite {
	t.Helper()
	if startErr != nil {
		t.Fatalf("starting the suite's server: %v", startErr)
	}
	if srv == nil {
		t.Skip(skipWhy)
	}
	c, err := deltagym.Dial(srv.Addr, deltagym.WithToken(token), deltagym.WithRetry(1, time.Millisecond))
	if err != nil {
		t.Fatal(err)
	}
	g, err := deltagym.Dial(srv.Addr, deltagym.WithToken(token), deltagym.WithRetry(1, time.Millisecond), deltagym.WithGRPC())
	if err != nil {
		t.Fatal(err)
	}
	s := &suite{c: c, grpc: g}
	t.Cleanup(func() { c.Close(); g.Close() })
	s.canary = s.sandbox(t)
	s.sh(t, s.canary, "echo intact > /root/canary")
	for range canarySteps {
		start := time.Now()
		s.sh(t, s.canary, "cat /root/canary")
		s.baseline = max(s.baseline, time.Since(start))
	}
	t.Cleanup(func() { s.checkCanary(t) })
	return s
}

// limit is the latency the canary's Steps must keep to.
func (s *suite) limit() time.Duration {
	return max(canaryFactor*s.baseline, canaryFloor)
}

// checkCanary checks that the canary still answers a Step with its file intact, within the
// limit. Families whose attack runs in the background call it while the attack runs too.
func (s *suite) checkCanary(t *testing.T) {
	t.Helper()
	// Not t.Context(): a cleanup runs after it is cancelled.
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	start := time.Now()
	res, err := s.canary.Exec(ctx, "cat /root/canary")
	d := time.Since(start)
	switch {
	case err != nil:
		t.Errorf("canary: %v", err)
	case string(res.Stdout) != "intact\n":
		t.Errorf("canary's file: %q (exit %d, %s)", res.Stdout, res.ExitCode, res.Stderr)
	case d > s.limit():
		t.Errorf("canary took %v to answer a Step (baseline %v, limit %v)", d, s.baseline, s.limit())
	}
}

// sandbox resets a sandbox of env sec, gives it sysHelper and closes it at the end of t.
func (s *suite) sandbox(t *testing.T) *deltagym.Sandbox {
	t.Helper()
	sb, err := s.c.Reset(t.Context(), "sec")
	if err != nil {
		t.Fatalf("reset: %v", err)
	}
	t.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
		defer cancel()
		if err := sb.Close(ctx); err != nil {
			t.Errorf("closing %s: %v", sb.ID(), err)
		}
	})
	if _, err := sb.WriteFile(t.Context(), helperPath, []byte(sysHelper)); err != nil {
		t.Fatalf("writing the helper: %v", err)
	}
	// A call the filter allows answers "ok": a refusal below is the kernel's, not the helper's.
	if out := s.sh(t, sb, "python3 "+helperPath+" 39"); !strings.HasPrefix(out, "ok ") {
		t.Fatalf("the helper's getpid: %q", out)
	}
	return sb
}

// exec runs a shell command in sb and returns its result; an error of the API fails t.
func (s *suite) exec(t *testing.T, sb *deltagym.Sandbox, cmd string, opts ...deltagym.StepOption) *deltagym.ExecResult {
	t.Helper()
	res, err := sb.Exec(t.Context(), cmd, opts...)
	if err != nil {
		t.Fatalf("%s: %v", cmd, err)
	}
	return res
}

// sh runs a shell command that must succeed and returns its output.
func (s *suite) sh(t *testing.T, sb *deltagym.Sandbox, cmd string) string {
	t.Helper()
	res := s.exec(t, sb, cmd)
	if !res.OK() {
		t.Fatalf("%s: exit %d signal %d timed out %v\n%s%s", cmd, res.ExitCode, res.Signal, res.TimedOut, res.Stdout, res.Stderr)
	}
	return string(res.Stdout)
}

// syscallCase is one system call an agent makes and the answers that count as refused (errno
// names; "" in a case's want never matches).
type syscallCase struct {
	name string
	args []string // the call's number, then its arguments (sysHelper's syntax)
	want []string
}

// syscalls runs each case in sb through sysHelper and checks the answer.
func (s *suite) syscalls(t *testing.T, sb *deltagym.Sandbox, cases []syscallCase) {
	t.Helper()
	for _, tc := range cases {
		res := s.exec(t, sb, "python3 "+helperPath+" "+strings.Join(tc.args, " "))
		got := strings.TrimSpace(string(res.Stdout))
		if !res.OK() || !slices.Contains(tc.want, got) {
			t.Errorf("%s: %q (exit %d signal %d)%s, want one of %v", tc.name, got, res.ExitCode, res.Signal, res.Stderr, tc.want)
		}
	}
}
