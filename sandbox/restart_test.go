package sandbox_test

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/deltagym/deltagym/sandbox"
)

// TestMain doubles as a crash-test server: with DG_CRASH_CHILD set, the test
// binary starts a runtime, makes a checkpoint and a live sandbox with a
// background process, prints their IDs, and waits to be killed.
func TestMain(m *testing.M) {
	if os.Getenv("DG_CRASH_CHILD") != "" {
		crashChild()
		return
	}
	os.Exit(m.Run())
}

func crashChild() {
	var cfg sandbox.Config
	cfg.DataDir = os.Getenv("DG_DATA")
	cfg.InitBinary = os.Getenv("DG_INIT")
	cfg.CRIU = os.Getenv("DG_CRIU")
	cfg.CgroupRoot = os.Getenv("DG_CGROUP")
	fail := func(err error) {
		fmt.Println("ERROR", err)
		os.Exit(1)
	}
	ctx := context.Background()
	rt, err := sandbox.New(ctx, cfg)
	if err != nil {
		fail(err)
	}
	if os.Getenv("DG_CRASH_CHILD") == "templates" {
		rt.ForkAheadAlways()
		crashWithTemplates(rt, fail)
	}
	if _, err := rt.ImportImage(ctx, "busybox", os.Getenv("DG_ROOTFS")); err != nil {
		fail(err)
	}
	s, err := rt.Create(ctx, sandbox.Spec{Image: "busybox"})
	if err != nil {
		fail(err)
	}
	if err := s.WriteFile(ctx, "/root/f", []byte("before crash"), 0, false); err != nil {
		fail(err)
	}
	ck, err := s.Checkpoint(ctx)
	if err != nil {
		fail(err)
	}
	if err := s.WriteFile(ctx, "/root/f", []byte("after checkpoint"), 0, false); err != nil {
		fail(err)
	}
	if _, err := s.Exec(ctx, sandbox.ExecRequest{Command: "while true; do sleep 1; done", Background: true}); err != nil {
		fail(err)
	}
	fmt.Println("READY", ck.ID, s.ID(), s.InitPid())
	select {}
}

// crashWithTemplates runs the counter of procs_test.go in the default
// image and a session, and takes two checkpoints that keep both as
// templates, at counts 3 and 5; it counts on to 6, checkpoints a shell
// running a python3 child in another sandbox, and waits to be killed.
// The session runs a command right before each checkpoint and before the
// end: the init's exit events then often sit unread in the server's socket
// when it dies, and the init sees ECONNRESET, not EOF.
func crashWithTemplates(rt *sandbox.Runtime, fail func(error)) {
	ctx := context.Background()
	if _, err := rt.ImportImage(ctx, "default", os.Getenv("DG_ROOTFS")); err != nil {
		fail(err)
	}
	s, err := rt.Create(ctx, sandbox.Spec{Image: "default"})
	if err != nil {
		fail(err)
	}
	runIn := func(s *sandbox.Sandbox, cmd string) {
		res, err := s.Exec(ctx, sandbox.ExecRequest{Command: cmd, Timeout: 15 * time.Second})
		if err != nil || res.ExitCode != 0 {
			fail(fmt.Errorf("%s: %v %+v", cmd, err, res))
		}
	}
	run := func(cmd string) { runIn(s, cmd) }
	run("mkfifo /tmp/ctl")
	if err := s.WriteFile(ctx, "/tmp/counter.py", []byte(counterPy), 0o644, false); err != nil {
		fail(err)
	}
	if _, err := s.Exec(ctx, sandbox.ExecRequest{Argv: []string{"python3", "/tmp/counter.py"}, Background: true}); err != nil {
		fail(err)
	}
	session := func() {
		if res, err := s.Exec(ctx, sandbox.ExecRequest{Session: "main", Command: "cd /tmp; X=kept"}); err != nil || res.ExitCode != 0 {
			fail(fmt.Errorf("session: %v %+v", err, res))
		}
	}
	incIn := func(s *sandbox.Sandbox, n int) {
		runIn(s, fmt.Sprintf(`echo inc > /tmp/ctl; for i in $(seq 1000); do [ "$(cat /tmp/count 2>/dev/null)" = %d ] && exit 0; sleep 0.01; done; exit 1`, n))
	}
	inc := func(n int) { incIn(s, n) }
	var ids []string
	for n := 1; n <= 6; n++ {
		inc(n)
		if n == 3 || n == 5 {
			session()
			ck, err := s.Checkpoint(ctx)
			if err != nil {
				fail(err)
			}
			ids = append(ids, ck.ID)
		}
	}
	session()
	// Copies forked ahead (ahead.go), frozen outside the template groups:
	// the orphaned init must end them. The last checkpoint restored twice
	// in a row, with a step between.
	for range 2 {
		if err := s.Restore(ctx, ids[1]); err != nil {
			fail(err)
		}
		inc(6)
	}
	if n := len(s.AheadPids(ids[1])); n != 2 {
		fail(fmt.Errorf("%d copies forked ahead, want 2", n))
	}
	// A fork of the first checkpoint: its counter comes from a CRIU image,
	// a child of the server, and so is the template its checkpoint keeps.
	kids, err := rt.Fork(ctx, ids[0], 1, sandbox.Spec{})
	if err != nil {
		fail(err)
	}
	incIn(kids[0], 4)
	ck, err := kids[0].Checkpoint(ctx)
	if err != nil {
		fail(err)
	}
	incIn(kids[0], 5)
	// In a sandbox of its own (a checkpoint with images forks no copies
	// ahead), a shell and its child: images, and templates no record
	// names, used by a restore.
	t, err := rt.Create(ctx, sandbox.Spec{Image: "default"})
	if err != nil {
		fail(err)
	}
	if _, err := t.Exec(ctx, sandbox.ExecRequest{Argv: []string{"sh", "-c", "python3 -c 'import time; open(\"/tmp/tree\", \"w\").close(); time.sleep(1e9)'; echo done"}, Background: true}); err != nil {
		fail(err)
	}
	runIn(t, "for i in $(seq 1000); do [ -e /tmp/tree ] && exit 0; sleep 0.01; done; exit 1")
	tck, err := t.Checkpoint(ctx)
	if err != nil {
		fail(err)
	}
	if err := t.Restore(ctx, tck.ID); err != nil {
		fail(err)
	}
	fmt.Println("READY", ids[0], ids[1], s.ID(), s.InitPid(), ck.ID, kids[0].InitPid(), tck.ID, t.InitPid())
	select {}
}

// crash runs the test binary as a crash-test server (mode: "1" or
// "templates", rootfs: the image it imports), SIGKILLs it once it is ready
// and returns the fields of its READY line.
func crash(t *testing.T, b *bundle, mode, rootfs string) []string {
	t.Helper()
	if err := b.rt.Close(t.Context()); err != nil {
		t.Fatal(err)
	}
	b.rt = nil
	cmd := exec.Command(os.Args[0], "-test.run=^$")
	cmd.Env = append(os.Environ(), "DG_CRASH_CHILD="+mode, "DG_DATA="+b.cfg.DataDir, "DG_INIT="+b.cfg.InitBinary,
		"DG_CRIU="+b.cfg.CRIU, "DG_CGROUP="+b.cfg.CgroupRoot, "DG_ROOTFS="+rootfs)
	cmd.Stderr = os.Stderr
	out, err := cmd.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	line, err := bufio.NewReader(out).ReadString('\n')
	if err != nil || !strings.HasPrefix(line, "READY ") {
		cmd.Process.Kill()
		cmd.Wait()
		t.Fatalf("child: %q %v", line, err)
	}
	if err := cmd.Process.Signal(syscall.SIGKILL); err != nil {
		t.Fatal(err)
	}
	cmd.Wait()
	return strings.Fields(strings.TrimPrefix(line, "READY "))
}

// waitGone waits up to 10 s for pid to exit.
func waitGone(t *testing.T, pid int, what string) {
	t.Helper()
	deadline := time.Now().Add(10 * time.Second)
	for {
		if _, err := os.Stat(fmt.Sprintf("/proc/%d", pid)); os.IsNotExist(err) {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("%s (pid %d) did not exit", what, pid)
		}
		time.Sleep(10 * time.Millisecond)
	}
}

// checkNoCgroups fails for every group left under the runtime's root.
func checkNoCgroups(t *testing.T, b *bundle) {
	t.Helper()
	for _, h := range []string{"unified", "memory", "pids"} {
		entries, _ := os.ReadDir(filepath.Join("/sys/fs/cgroup", h, b.cfg.CgroupRoot))
		for _, e := range entries {
			if e.IsDir() {
				procs, _ := os.ReadFile(filepath.Join("/sys/fs/cgroup", h, b.cfg.CgroupRoot, e.Name(), "cgroup.procs"))
				sub, _ := os.ReadDir(filepath.Join("/sys/fs/cgroup", h, b.cfg.CgroupRoot, e.Name()))
				var subs []string
				for _, x := range sub {
					if x.IsDir() {
						subs = append(subs, x.Name())
					}
				}
				t.Errorf("leftover cgroup %s/%s procs %q subdirs %v", h, e.Name(), procs, subs)
			}
		}
	}
}

// A server killed with SIGKILL leaves nothing running, and the next one
// reconciles: live sandboxes are reported ended, their cgroups and layers
// are gone, and checkpoints are still restorable.
func TestCrashRestart(t *testing.T) {
	b := setup(t)
	f := crash(t, b, "1", b.root)
	ck, sb := f[0], f[1]
	initPid, _ := strconv.Atoi(f[2])
	// The init notices its server is gone and, keeping no template, takes
	// the sandbox with it.
	waitGone(t, initPid, "the init of a sandbox without templates, after its server")
	rt, err := sandbox.New(t.Context(), b.cfg)
	if err != nil {
		t.Fatal(err)
	}
	b.rt = rt
	if ended := rt.Ended(); len(ended) != 1 || ended[0] != sb {
		t.Fatalf("ended %v, want [%s]", ended, sb)
	}
	checkNoCgroups(t, b)
	info, err := rt.Checkpoint(ck)
	if err != nil {
		t.Fatal(err)
	}
	// Only the checkpoint's layer is left in the store.
	layersDir := filepath.Join(b.cfg.DataDir, "store", "layers")
	entries, _ := os.ReadDir(layersDir)
	if len(entries) != info.Depth {
		t.Errorf("%d layers in the store, the checkpoint needs %d", len(entries), info.Depth)
	}
	k, err := rt.Fork(t.Context(), ck, 1, sandbox.Spec{})
	if err != nil {
		t.Fatal(err)
	}
	defer k[0].Destroy(context.Background())
	if got := sh(t, k[0], "cat /root/f"); got != "before crash" {
		t.Fatalf("restored %q", got)
	}
}

// After a crash, the init of a sandbox whose checkpoints keep templates ends
// every other process and stays; the next server saves the templates as
// CRIU images and ends the sandbox. A template group found thawed counts as
// lost.
func TestCrashReadoptsTemplates(t *testing.T) {
	needCRIU(t)
	b := setup(t)
	f := crash(t, b, "templates", defaultRootfs(t))
	ck3, ck5, sb, ckFork, ckTree := f[0], f[1], f[2], f[4], f[6]
	initPid, _ := strconv.Atoi(f[3])
	forkInit, _ := strconv.Atoi(f[5])
	treeInit, _ := strconv.Atoi(f[7])
	if _, err := os.Stat(fmt.Sprintf("/proc/%d", forkInit)); err != nil {
		t.Fatalf("the init of a forked sandbox with templates did not outlive its server: %v", err)
	}
	pidns, err := os.Readlink(fmt.Sprintf("/proc/%d/ns/pid", initPid))
	if err != nil {
		t.Fatalf("the init of a sandbox with templates did not outlive its server: %v", err)
	}
	// Left running: the init and the templates of the counter and the
	// session's shell; the live ones end.
	deadline := time.Now().Add(10 * time.Second)
	for {
		var left []string
		procs, _ := filepath.Glob("/proc/[0-9]*/ns/pid")
		for _, p := range procs {
			if ns, err := os.Readlink(p); err == nil && ns == pidns {
				comm, _ := os.ReadFile(filepath.Join(filepath.Dir(filepath.Dir(p)), "comm"))
				left = append(left, strings.TrimSpace(string(comm)))
			}
		}
		slices.Sort(left)
		if slices.Equal(left, []string{"bash", "bash", "dg-init", "python3", "python3"}) {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("left in the orphaned sandbox: %v", left)
		}
		time.Sleep(10 * time.Millisecond)
	}
	// Thaw the second checkpoint's template group: it counts as lost.
	thawTemplateGroup(t, b, sb, ck5)
	rt, err := sandbox.New(t.Context(), b.cfg)
	if err != nil {
		t.Fatal(err)
	}
	b.rt = rt
	if ended := rt.Ended(); len(ended) != 3 || !slices.Contains(ended, sb) {
		t.Fatalf("ended %v, want %s, the fork and the tree's", ended, sb)
	}
	waitGone(t, initPid, "the init of a re-adopted sandbox")
	waitGone(t, forkInit, "the init of a re-adopted fork")
	// Its tree's templates, which no record names, ended with it.
	waitGone(t, treeInit, "the init of a sandbox with tree templates")
	checkNoCgroups(t, b)
	// The tree comes back from its images.
	kt, err := rt.Fork(t.Context(), ckTree, 1, sandbox.Spec{})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = kt[0].Destroy(context.Background()) })
	if got := sh(t, kt[0], "ps -o comm= -p $(ps -o ppid= -p $(pgrep -x python3))"); strings.TrimSpace(got) != "sh" {
		t.Fatalf("the tree in a fork of its checkpoint after the crash: the parent of its python3 is %q", got)
	}
	// The fork's checkpoint: its counter (a copy of a process criu
	// restored, whose parent was the server) comes back at 4.
	kf, err := rt.Fork(t.Context(), ckFork, 1, sandbox.Spec{})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = kf[0].Destroy(context.Background()) })
	if got := sh(t, kf[0], "cat /tmp/count"); got != "4" {
		t.Fatalf("count file in a fork of the fork's checkpoint %q", got)
	}
	inc(t, kf[0], 5)
	// The first checkpoint brings its counter back, at 3, in a fork.
	k, err := rt.Fork(t.Context(), ck3, 1, sandbox.Spec{})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = k[0].Destroy(context.Background()) })
	if got := sh(t, k[0], "cat /tmp/count"); got != "3" {
		t.Fatalf("count file %q", got)
	}

	inc(t, k[0], 4)
	if res, err := k[0].Exec(t.Context(), sandbox.ExecRequest{Session: "main", Command: "echo $X $(pwd)"}); err != nil || string(res.Stdout) != "kept /tmp\n" {
		t.Fatalf("the session's shell after the crash: %v %+v", err, res)
	}
	// The second one lost its process: its files only.
	if _, err := rt.Fork(t.Context(), ck5, 1, sandbox.Spec{}); !errors.Is(err, sandbox.ErrProcesses) || !strings.Contains(err.Error(), "python3") {
		t.Fatalf("fork of a checkpoint whose template was found thawed: %v", err)
	}
	k2, err := rt.Fork(t.Context(), ck5, 1, sandbox.Spec{FilesOnly: true})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = k2[0].Destroy(context.Background()) })
	if got := sh(t, k2[0], "cat /tmp/count"); got != "5" {
		t.Fatalf("count file %q", got)
	}
}

// thawTemplateGroup thaws the template group of checkpoint ck of sandbox sb,
// as found through the runtime's records.
func thawTemplateGroup(t *testing.T, b *bundle, sb, ck string) {
	t.Helper()
	p := templateGroupFile(t, b, sb, ck, "cgroup.freeze")
	v := "0"
	if _, err := os.Stat(p); err != nil {
		p, v = filepath.Join(filepath.Dir(p), "freezer.state"), "THAWED"
	}
	if err := os.WriteFile(p, []byte(v), 0o644); err != nil {
		t.Fatal(err)
	}
}

// Purging the data directory of a crashed runtime ends the sandboxes it left
// waiting for re-adoption.
func TestPurgeEndsOrphans(t *testing.T) {
	b := setup(t)
	f := crash(t, b, "templates", defaultRootfs(t))
	initPid, _ := strconv.Atoi(f[3])
	if _, err := os.Stat(fmt.Sprintf("/proc/%d", initPid)); err != nil {
		t.Fatalf("the init of a sandbox with templates did not outlive its server: %v", err)
	}
	if err := sandbox.Purge(b.cfg.DataDir); err != nil {
		t.Fatal(err)
	}
	waitGone(t, initPid, "the init of a purged sandbox")
	checkNoCgroups(t, b)
}

// A second runtime on a data directory in use is refused, with whose it is and what to do.
func TestDataDirInUse(t *testing.T) {
	b := setup(t)
	_, err := sandbox.New(t.Context(), b.cfg)
	if !errors.Is(err, sandbox.ErrExists) || !strings.Contains(err.Error(), fmt.Sprintf("(pid %d)", os.Getpid())) || !strings.Contains(err.Error(), "--data") {
		t.Fatalf("a second runtime on the data directory: %v, want ErrExists naming pid %d and --data", err, os.Getpid())
	}
	// The first runtime is unharmed.
	s := b.create(t, sandbox.Spec{Image: "busybox"})
	if got := sh(t, s, "echo ok"); got != "ok\n" {
		t.Fatalf("the first runtime's sandbox: %q", got)
	}
}
