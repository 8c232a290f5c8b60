package envpool_test

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"sync/atomic"
	"testing"

	"golang.org/x/sys/unix"

	"github.com/deltagym/deltagym/envpool"
	"github.com/deltagym/deltagym/envpool/envpooltest"
	"github.com/deltagym/deltagym/internal/locate"
	"github.com/deltagym/deltagym/internal/testenv"
	"github.com/deltagym/deltagym/sandbox"
	"github.com/deltagym/deltagym/sandbox/image/imagetest"
)

// backend is a sandbox runtime the suite runs on: the fake of envpooltest (unit tier) and the
// real one (privileged tier).
type backend struct {
	name string
	// open prepares the backend for the suite, or skips t, and returns a harness per case.
	open func(t *testing.T) func(t *testing.T) *harness
}

var backends = []backend{{"fake", openFake}, {"runtime", openRuntime}}

// harness is what a case needs of its backend beyond envpool.Backend.
type harness struct {
	image string
	// config points a Manager's Config at the backend.
	config func(*envpool.Config)
	// live returns the number of sandboxes alive.
	live func() int
	// release releases a checkpoint behind the Manager's back.
	release func(id string) error
	// kill makes a sandbox die on its own, as when its init is killed.
	kill func(t *testing.T, b envpool.Box)
	// addImage makes an image of the name.
	addImage func(t *testing.T, name string)
	// fake is the fake backend; nil on the real one.
	fake *envpooltest.Backend
}

// needFake skips cases that need what only the fake gives (failures on demand, a census of its
// sandboxes, thousands of resets in milliseconds).
func (h *harness) needFake(t *testing.T, why string) {
	t.Helper()
	if h.fake == nil {
		t.Skipf("runs on the fake only: %s", why)
	}
}

func openFake(*testing.T) func(t *testing.T) *harness {
	return func(t *testing.T) *harness {
		fb := envpooltest.NewBackend()
		fb.AddImage("bb", nil)
		for _, c := range commands {
			fb.Script(c.text, c.fake)
		}
		return &harness{
			image:    "bb",
			config:   func(c *envpool.Config) { c.Backend = fb },
			live:     fb.Live,
			release:  fb.ReleaseCheckpoint,
			kill:     func(_ *testing.T, b envpool.Box) { b.(*envpooltest.Box).Kill() },
			addImage: func(_ *testing.T, name string) { fb.AddImage(name, nil) },
			fake:     fb,
		}
	}
}

var runtimeCount atomic.Int64

func openRuntime(t *testing.T) func(t *testing.T) *harness {
	return openRuntimeCapped(t, sandbox.Caps{})
}

// openRuntimeCapped is openRuntime with the runtime's admission caps.
func openRuntimeCapped(t *testing.T, caps sandbox.Caps) func(t *testing.T) *harness {
	testenv.Privileged(t, "sandboxes use namespaces, mounts and cgroups")
	init, err := locate.Init()
	if err != nil {
		t.Skip(err)
	}
	criu, _ := locate.CRIU() // where it is expected if not installed: forks that need it fail

	data, err := os.MkdirTemp("", "dgpool")
	if err != nil {
		t.Fatal(err)
	}
	cg := fmt.Sprintf("dgpooltest%d_%d", os.Getpid(), runtimeCount.Add(1))
	rt, err := sandbox.New(t.Context(), sandbox.Config{DataDir: data, InitBinary: init, CRIU: criu, CgroupRoot: cg, Caps: caps})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		if err := rt.Close(context.Background()); err != nil {
			t.Errorf("closing runtime: %v", err)
		}
		if err := sandbox.Purge(data); err != nil { // unmounts its layers
			t.Errorf("purging runtime data: %v", err)
		}
		os.RemoveAll(data)
		paths, _ := filepath.Glob("/sys/fs/cgroup/*/" + cg)
		for _, p := range paths {
			_ = os.Remove(p) // the runtime's empty cgroup parent
		}
	})
	rootfs := imagetest.Busybox(t)
	if _, err := rt.ImportImage(t.Context(), "bb", rootfs); err != nil {
		t.Fatal(err)
	}
	return func(*testing.T) *harness {
		return &harness{
			image:   "bb",
			config:  func(c *envpool.Config) { c.Runtime = rt },
			live:    rt.Sandboxes,
			release: rt.ReleaseCheckpoint,
			kill: func(t *testing.T, b envpool.Box) {
				if err := unix.Kill(b.(*sandbox.Sandbox).InitPid(), unix.SIGKILL); err != nil {
					t.Fatalf("killing the sandbox's init: %v", err)
				}
			},
			addImage: func(t *testing.T, name string) {
				if _, err := rt.ImportImage(t.Context(), name, rootfs); err != nil {
					t.Fatal(err)
				}
			},
		}
	}
}

// command is a shell command the cases run, with the fake's script of it: what busybox's sh
// does with the text, to the fake's files.
type command struct {
	text string
	fake envpooltest.Script
}

func output(stdout string) sandbox.ExecResult { return sandbox.ExecResult{Stdout: []byte(stdout)} }

func exit(code int, stderr string) sandbox.ExecResult {
	return sandbox.ExecResult{ExitCode: code, Stderr: []byte(stderr)}
}

// cat is `cat p`.
func cat(p string) command {
	return command{"cat " + p, func(_ context.Context, c *envpooltest.Call) sandbox.ExecResult {
		if v, ok := c.Box.ReadFile(p); ok {
			return output(v)
		}
		return exit(1, "cat: can't open '"+p+"': No such file or directory\n")
	}}
}

var (
	cmdSetup = command{"echo once >> /tmp/setup", func(_ context.Context, c *envpooltest.Call) sandbox.ExecResult {
		c.Box.AppendFile("/tmp/setup", "once\n")
		return sandbox.ExecResult{}
	}}
	cmdCatSetup  = cat("/tmp/setup")
	cmdCatSeed   = cat("/tmp/seed")
	cmdCatAnswer = cat("/tmp/answer")
	cmdFail      = command{"echo setup broke >&2; exit 3", func(context.Context, *envpooltest.Call) sandbox.ExecResult {
		return exit(3, "setup broke\n")
	}}
	// cmdHook is a reset hook: it refuses LEVEL=bad, prints the task and keeps the seed.
	cmdHook = command{`if [ "$LEVEL" = bad ]; then echo refused >&2; exit 4; fi; echo "task $DELTAGYM_SEED $LEVEL"; echo "$DELTAGYM_SEED" > /tmp/seed`,
		func(_ context.Context, c *envpooltest.Call) sandbox.ExecResult {
			if c.Getenv("LEVEL") == "bad" {
				return exit(4, "refused\n")
			}
			c.Box.WriteFile("/tmp/seed", c.Getenv("DELTAGYM_SEED")+"\n")
			return output("task " + c.Getenv("DELTAGYM_SEED") + " " + c.Getenv("LEVEL") + "\n")
		}}
	cmdAnswer = command{"echo 42 > /tmp/answer", func(_ context.Context, c *envpooltest.Call) sandbox.ExecResult {
		c.Box.WriteFile("/tmp/answer", "42\n")
		return sandbox.ExecResult{}
	}}
	// cmdVerifier leaves a mark, and gives reward 1 for the answer 42.
	cmdVerifier = command{`touch /tmp/verified; if [ "$(cat /tmp/answer 2>/dev/null)" = 42 ]; then echo '{"reward": 1, "components": {"correct": 1}}'; else echo 0; fi`,
		func(_ context.Context, c *envpooltest.Call) sandbox.ExecResult {
			c.Box.AppendFile("/tmp/verified", "")
			if v, _ := c.Box.ReadFile("/tmp/answer"); strings.TrimRight(v, "\n") == "42" {
				return output(`{"reward": 1, "components": {"correct": 1}}` + "\n")
			}
			return output("0\n")
		}}
	cmdVerified = command{"test -e /tmp/verified && echo yes || echo no", func(_ context.Context, c *envpooltest.Call) sandbox.ExecResult {
		if _, ok := c.Box.ReadFile("/tmp/verified"); ok {
			return output("yes\n")
		}
		return output("no\n")
	}}
	cmdVerifierBroken = command{"echo verifier broke >&2; exit 2", func(context.Context, *envpooltest.Call) sandbox.ExecResult {
		return exit(2, "verifier broke\n")
	}}
	cmdVerifierAnswer = command{`echo "checking $DELTAGYM_ANSWER"; echo "$DELTAGYM_ANSWER"`,
		func(_ context.Context, c *envpooltest.Call) sandbox.ExecResult {
			a := c.Getenv("DELTAGYM_ANSWER")
			return output("checking " + a + "\n" + a + "\n")
		}}
	cmdVerifierLoud = command{"echo 0.5; echo " + strings.Repeat("x", 40) + " >&2", func(context.Context, *envpooltest.Call) sandbox.ExecResult {
		return sandbox.ExecResult{Stdout: []byte("0.5\n"), Stderr: []byte(strings.Repeat("x", 40) + "\n")}
	}}
	cmdTrue = command{"true", func(context.Context, *envpooltest.Call) sandbox.ExecResult { return sandbox.ExecResult{} }}
	// cmdSleep runs until it is cut short.
	cmdSleep = command{"sleep 600", func(ctx context.Context, _ *envpooltest.Call) sandbox.ExecResult {
		<-ctx.Done()
		return sandbox.ExecResult{ExitCode: -1, Signal: "SIGKILL"}
	}}
)

var commands = []command{cmdSetup, cmdCatSetup, cmdCatSeed, cmdCatAnswer, cmdFail, cmdHook, cmdAnswer, cmdVerifier,
	cmdVerified, cmdVerifierBroken, cmdVerifierAnswer, cmdVerifierLoud, cmdTrue, cmdSleep}
