package sandbox_test

import (
	"bufio"
	"context"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
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

// A server killed with SIGKILL leaves nothing running, and the next one
// reconciles: live sandboxes are reported ended, their cgroups and layers
// are gone, and checkpoints are still restorable.
func TestCrashRestart(t *testing.T) {
	b := setup(t)
	if err := b.rt.Close(t.Context()); err != nil {
		t.Fatal(err)
	}
	b.rt = nil
	cmd := exec.Command(os.Args[0], "-test.run=^$")
	cmd.Env = append(os.Environ(), "DG_CRASH_CHILD=1", "DG_DATA="+b.cfg.DataDir, "DG_INIT="+b.cfg.InitBinary,
		"DG_CGROUP="+b.cfg.CgroupRoot, "DG_ROOTFS="+b.root)
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
	var ck, sb string
	var initPid int
	fmt.Sscan(strings.TrimPrefix(line, "READY "), &ck, &sb, &initPid)
	if err := cmd.Process.Signal(syscall.SIGKILL); err != nil {
		t.Fatal(err)
	}
	cmd.Wait()
	// The init notices its server is gone and takes the sandbox with it.
	deadline := time.Now().Add(10 * time.Second)
	for {
		if _, err := os.Stat(fmt.Sprintf("/proc/%d", initPid)); os.IsNotExist(err) {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("init %d outlived its server", initPid)
		}
		time.Sleep(10 * time.Millisecond)
	}
	rt, err := sandbox.New(t.Context(), b.cfg)
	if err != nil {
		t.Fatal(err)
	}
	b.rt = rt
	if ended := rt.Ended(); len(ended) != 1 || ended[0] != sb {
		t.Fatalf("ended %v, want [%s]", ended, sb)
	}
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
