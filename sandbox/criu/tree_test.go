package criu_test

import (
	"context"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/deltagym/deltagym/internal/benchq"
	"github.com/deltagym/deltagym/internal/locate"
	"github.com/deltagym/deltagym/internal/testenv"
	"github.com/deltagym/deltagym/sandbox"
	"github.com/deltagym/deltagym/sandbox/criu"
	"github.com/deltagym/deltagym/sandbox/image/imagetest"
)

// counterCmd is the tree dumped in these tests: a busybox shell (the root,
// its own session) with a `sleep` child. Each line written to /tmp/in bumps
// a count kept only in the shell's memory, which it answers on /tmp/out.
// Its stdio is the sandbox's own /dev/null: a tree must hold no file from
// outside the sandbox's mount namespace (the background exec hands it the
// host's).
const counterCmd = `exec </dev/null >/dev/null 2>&1; sleep 1000 & i=0; while :; do read x < /tmp/in; i=$((i+1)); echo $i > /tmp/out; done`

// treeBundle is a runtime with the busybox image and a CRIU worker.
type treeBundle struct {
	rt   *sandbox.Runtime
	swrk *criu.Swrk
	// bin is criu's wrapper; features the swrk's feature cache (CacheFeatures).
	bin, features string
}

// setupTree skips unless root with CRIU and dg-init available.
func setupTree(t testing.TB) *treeBundle {
	t.Helper()
	testenv.Privileged(t, "sandboxes use namespaces and cgroups, CRIU ptraces and setns")
	bin, err := locate.CRIU()
	if err != nil {
		t.Skip(err)
	}
	dir := t.TempDir()
	cfg := sandbox.Config{
		DataDir: filepath.Join(dir, "data"), InitBinary: testenv.Init(t), CRIU: bin,
		CgroupRoot: fmt.Sprintf("dgcriutree-%d-%d", os.Getpid(), time.Now().UnixNano()%1e6),
	}
	rt, err := sandbox.New(t.Context(), cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		if err := rt.Close(context.Background()); err != nil {
			t.Errorf("closing runtime: %v", err)
		}
		if err := sandbox.Purge(cfg.DataDir); err != nil {
			t.Errorf("purging data dir: %v", err)
		}
		// The runtime leaves its (empty) root groups behind.
		for _, h := range []string{"unified", "memory", "pids", "cpu", "freezer"} {
			_ = os.Remove(filepath.Join("/sys/fs/cgroup", h, cfg.CgroupRoot))
		}
	})
	if _, err := rt.ImportImage(t.Context(), "busybox", imagetest.Busybox(t)); err != nil {
		t.Fatal(err)
	}
	swrk, err := criu.NewSwrk(bin)
	if err != nil {
		t.Fatal(err)
	}
	// The runtime's meta directory is a tmpfs of its own, as criu's cache needs.
	features := filepath.Join(cfg.DataDir, "store", "meta", "criu-test")
	if err := os.Mkdir(features, 0o700); err != nil {
		t.Fatal(err)
	}
	if err := swrk.CacheFeatures(features, nil); err != nil {
		t.Fatal(err)
	}
	return &treeBundle{rt: rt, swrk: swrk, bin: bin, features: features}
}

func (b *treeBundle) create(t testing.TB) *sandbox.Sandbox {
	t.Helper()
	s, err := b.rt.Create(t.Context(), sandbox.Spec{Image: "busybox"})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = s.Destroy(context.Background()) })
	mustSh(t, s, "mkfifo /tmp/in /tmp/out")
	return s
}

func mustSh(t testing.TB, s *sandbox.Sandbox, cmd string) string {
	t.Helper()
	res, err := s.Exec(t.Context(), sandbox.ExecRequest{Command: cmd, Timeout: 10 * time.Second})
	if err != nil {
		t.Fatalf("exec %q: %v", cmd, err)
	}
	if res.ExitCode != 0 {
		t.Fatalf("exec %q: exit %d %s\n%s%s", cmd, res.ExitCode, res.Signal, res.Stdout, res.Stderr)
	}
	return string(res.Stdout)
}

// startCounter starts the counter tree in s and returns the host pid of its root.
func startCounter(t testing.TB, s *sandbox.Sandbox) int {
	t.Helper()
	res, err := s.Exec(t.Context(), sandbox.ExecRequest{Command: counterCmd, Background: true})
	if err != nil {
		t.Fatal(err)
	}
	return hostPid(t, s.InitPid(), res.Pid)
}

// bump asks the counter in s for its next value. Only call it while a
// counter runs in s: the fifo would block otherwise.
func bump(t testing.TB, s *sandbox.Sandbox, want int) {
	t.Helper()
	got := strings.TrimSpace(mustSh(t, s, "echo > /tmp/in; cat /tmp/out"))
	if got != strconv.Itoa(want) {
		t.Fatalf("counter = %q, want %d", got, want)
	}
}

// hostPid maps a pid inside the pid namespace of init to the host's.
func hostPid(t testing.TB, init, nsPid int) int {
	t.Helper()
	want := nsIno(t, init, "pid")
	ents, err := os.ReadDir("/proc")
	if err != nil {
		t.Fatal(err)
	}
	for _, e := range ents {
		p, err := strconv.Atoi(e.Name())
		if err != nil {
			continue
		}
		var st unix.Stat_t
		if unix.Stat(fmt.Sprintf("/proc/%d/ns/pid", p), &st) != nil || st.Ino != want {
			continue
		}
		if innerPid(t, p) == nsPid {
			return p
		}
	}
	t.Fatalf("no host pid for pid %d of %d's namespace", nsPid, init)
	return 0
}

// innerPid returns the pid of host pid p in its own pid namespace.
func innerPid(t testing.TB, p int) int {
	t.Helper()
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/status", p))
	if err != nil {
		return 0
	}
	for _, l := range strings.Split(string(b), "\n") {
		if f := strings.Fields(l); len(f) > 1 && f[0] == "NSpid:" {
			n, _ := strconv.Atoi(f[len(f)-1])
			return n
		}
	}
	return 0
}

func nsIno(t testing.TB, pid int, ns string) uint64 {
	t.Helper()
	var st unix.Stat_t
	if err := unix.Stat(fmt.Sprintf("/proc/%d/ns/%s", pid, ns), &st); err != nil {
		t.Fatal(err)
	}
	return st.Ino
}

// children returns the host pids of pid's children.
func children(t testing.TB, pid int) []int {
	t.Helper()
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/task/%d/children", pid, pid))
	if err != nil {
		t.Fatal(err)
	}
	var out []int
	for _, f := range strings.Fields(string(b)) {
		n, _ := strconv.Atoi(f)
		out = append(out, n)
	}
	return out
}

// killTree SIGKILLs pid and its children and waits until each is reaped,
// reaping those that are the test's children (a restored root is).
func killTree(t testing.TB, pid int) {
	t.Helper()
	pids := append(children(t, pid), pid)
	fds, reaped := pidfds(t, pids)
	// All first: one waited for alone might be a zombie its killed parent
	// was never going to reap.
	for i, fd := range fds {
		if err := unix.PidfdSendSignal(fd, unix.SIGKILL, nil, 0); err != nil {
			t.Fatalf("killing %d: %v", pids[i], err)
		}
	}
	reaped()
}

// pidfds opens pidfds of pids and returns them with a func that waits until
// all are reaped, reaping those that are the test's children. Exit (POLLIN)
// is not enough: a zombie keeps its pid, and as its group and session the
// root's, until the sandbox's init gets round to reaping it, and a restore
// that needs them back fails with EEXIST until then.
func pidfds(t testing.TB, pids []int) ([]int, func()) {
	t.Helper()
	var fds []int
	for _, p := range pids {
		fd, err := unix.PidfdOpen(p, 0)
		if err != nil {
			t.Fatalf("opening pidfd of %d: %v", p, err)
		}
		fds = append(fds, fd)
	}
	return fds, func() {
		t.Helper()
		deadline := time.Now().Add(10 * time.Second)
		for i, fd := range fds {
			pfd := []unix.PollFd{{Fd: int32(fd), Events: unix.POLLIN}}
			for {
				if _, err := unix.Poll(pfd, 10_000); !errors.Is(err, unix.EINTR) {
					break
				}
			}
			if pfd[0].Revents&unix.POLLIN == 0 {
				t.Fatalf("%d did not exit within 10 s", pids[i])
			}
			var info unix.Siginfo
			_ = unix.Waitid(unix.P_PIDFD, fd, &info, unix.WEXITED|unix.WNOHANG, nil)
			// A zombie still takes signal 0; only a reaped process is gone.
			for !errors.Is(unix.PidfdSendSignal(fd, 0, nil, 0), unix.ESRCH) {
				if time.Now().After(deadline) {
					t.Fatalf("%d exited but was not reaped within 10 s", pids[i])
				}
				time.Sleep(time.Millisecond)
			}
			unix.Close(fd)
		}
	}
}

// showLogs logs the error lines of CRIU's logs in dir if the test failed.
func showLogs(t testing.TB, dir string) {
	t.Cleanup(func() {
		if !t.Failed() {
			return
		}
		for _, log := range []string{"dump.log", "restore.log"} {
			b, _ := os.ReadFile(filepath.Join(dir, log))
			for _, l := range strings.Split(string(b), "\n") {
				if strings.Contains(l, "Error") {
					t.Logf("%s: %s", log, l)
				}
			}
		}
	})
}

// privileges returns the lines of /proc/pid/status that say what the
// process may do: capabilities, no_new_privs, seccomp, and (in the
// sandbox's terms) its ids.
func privileges(t testing.TB, s *sandbox.Sandbox, pid int) string {
	t.Helper()
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/status", pid))
	if err != nil {
		t.Fatal(err)
	}
	var out []string
	for _, l := range strings.Split(string(b), "\n") {
		if strings.HasPrefix(l, "Cap") || strings.HasPrefix(l, "NoNewPrivs") || strings.HasPrefix(l, "Seccomp:") {
			out = append(out, l)
		}
	}
	ids := mustSh(t, s, fmt.Sprintf("grep -E '^(Uid|Gid|Groups)' /proc/%d/status", innerPid(t, pid)))
	return strings.Join(out, "\n") + "\n" + ids
}

// checkInside asserts that the restored root rpid runs in every namespace
// and the cgroups of the sandbox s, with its dumped pid wantNS and the
// privileges it was dumped with.
func checkInside(t testing.TB, s *sandbox.Sandbox, rpid, wantNS int, wantPriv string) {
	t.Helper()
	if !strings.Contains(wantPriv, "Seccomp:\t2") || !strings.Contains(wantPriv, "NoNewPrivs:\t1") {
		t.Fatalf("the dumped tree was not confined as sandbox commands are:\n%s", wantPriv)
	}
	if got := privileges(t, s, rpid); got != wantPriv {
		t.Errorf("restored tree has privileges\n%s\nwant the dumped\n%s", got, wantPriv)
	}
	for _, ns := range []string{"pid", "user", "mnt", "net", "ipc", "uts", "cgroup", "time"} {
		if got, want := nsIno(t, rpid, ns), nsIno(t, s.InitPid(), ns); got != want {
			t.Errorf("restored tree is in %s namespace %d, want the sandbox's %d", ns, got, want)
		}
	}
	if got := innerPid(t, rpid); got != wantNS {
		t.Errorf("restored root is pid %d in the sandbox, want the dumped %d", got, wantNS)
	}
	got, err := criu.CgroupDirs(rpid)
	if err != nil {
		t.Fatal(err)
	}
	want, err := criu.CgroupDirs(s.InitPid())
	if err != nil {
		t.Fatal(err)
	}
	if !slices.Equal(got, want) {
		t.Errorf("restored tree is in cgroups %v, want the sandbox's %v", got, want)
	}
	// The sandbox sees the tree among its own processes.
	if ps := mustSh(t, s, "ps -o pid,args"); !strings.Contains(ps, "sleep 1000") || !strings.Contains(ps, fmt.Sprintf("%d /bin/sh -c exec", wantNS)) {
		t.Errorf("the sandbox does not see the restored tree:\n%s", ps)
	}
}

// TestTreeSameSandbox dumps a two-process tree that is not the sandbox's
// init, kills it, and restores it into the same sandbox: it comes back with
// the same pids in the sandbox's own namespaces and continues its count.
func TestTreeSameSandbox(t *testing.T) {
	b := setupTree(t)
	ctx := t.Context()
	s := b.create(t)
	root := startCounter(t, s)
	nsRoot := innerPid(t, root)
	priv := privileges(t, s, root)
	bump(t, s, 1)
	bump(t, s, 2)
	img := t.TempDir()
	showLogs(t, img)
	if err := b.swrk.DumpTree(ctx, criu.TreeDumpOpts{Pid: root, NSPid: s.InitPid(), ImagesDir: img, LeaveRunning: true}); err != nil {
		t.Fatal(err)
	}
	bump(t, s, 3) // the original runs on
	killTree(t, root)
	cgs, err := criu.CgroupDirs(s.InitPid())
	if err != nil {
		t.Fatal(err)
	}
	rpid, err := b.swrk.RestoreTree(ctx, criu.TreeRestoreOpts{ImagesDir: img, NSPid: s.InitPid(), Cgroups: cgs})
	if err != nil {
		t.Fatal(err)
	}
	defer func() { killTree(t, rpid) }()
	checkInside(t, s, rpid, nsRoot, priv)
	// The restore kept the kernel's features for the next one (read by the restore below).
	// The dump's (privileged) and the restore's (unprivileged) each have their own.
	for _, name := range []string{"*/criu.kdat", "*/run/criu.kdat"} {
		if kdat, _ := filepath.Glob(filepath.Join(b.features, name)); len(kdat) != 1 {
			t.Errorf("criu's feature cache %s after a dump and a restore: %v", name, kdat)
		} else if fi, err := os.Stat(kdat[0]); err != nil || fi.Mode().Perm() != 0o600 {
			t.Errorf("criu's feature cache %s: %v %v", name, fi, err)
		}
	}
	// criu keeps a cache only on a tmpfs: on a host whose /run is not one, none is there.
	var fs unix.Statfs_t
	if err := unix.Statfs("/run", &fs); err == nil && fs.Type != unix.TMPFS_MAGIC {
		if _, err := os.Stat("/run/criu.kdat"); err == nil {
			t.Error("a dump wrote the host's /run/criu.kdat")
		}
	}
	bump(t, s, 3) // continues from the dumped 2
	bump(t, s, 4)
	// A second dump and restore of the restored tree works the same way.
	img2 := t.TempDir()
	showLogs(t, img2)
	_, reaped := pidfds(t, append(children(t, rpid), rpid))
	if err := b.swrk.DumpTree(ctx, criu.TreeDumpOpts{Pid: rpid, NSPid: s.InitPid(), ImagesDir: img2}); err != nil {
		t.Fatal(err)
	}
	reaped() // the dump killed the tree; its pids must be free again
	rpid2, err := b.swrk.RestoreTree(ctx, criu.TreeRestoreOpts{ImagesDir: img2, NSPid: s.InitPid(), Cgroups: cgs})
	if err != nil {
		t.Fatal(err)
	}
	rpid = rpid2
	bump(t, s, 5)
}

// TestTreeOtherSandbox restores a tree dumped in one sandbox into another of
// the same image (other init, namespaces, uid range and cgroups) while the
// original keeps running: the copy continues from the dumped count there.
func TestTreeOtherSandbox(t *testing.T) {
	b := setupTree(t)
	ctx := t.Context()
	a, c := b.create(t), b.create(t)
	root := startCounter(t, a)
	nsRoot := innerPid(t, root)
	priv := privileges(t, a, root)
	bump(t, a, 1)
	img := t.TempDir()
	showLogs(t, img)
	if err := b.swrk.DumpTree(ctx, criu.TreeDumpOpts{Pid: root, NSPid: a.InitPid(), ImagesDir: img, LeaveRunning: true}); err != nil {
		t.Fatal(err)
	}
	cgs, err := criu.CgroupDirs(c.InitPid())
	if err != nil {
		t.Fatal(err)
	}
	rpid, err := b.swrk.RestoreTree(ctx, criu.TreeRestoreOpts{ImagesDir: img, NSPid: c.InitPid(), Cgroups: cgs})
	if err != nil {
		t.Fatal(err)
	}
	defer killTree(t, rpid)
	checkInside(t, c, rpid, nsRoot, priv)
	bump(t, c, 2) // the copy continues from the dumped 1 …
	bump(t, a, 2) // … and so does the original, independently
	bump(t, c, 3)
}

func TestTreeOptsValidate(t *testing.T) {
	for _, tc := range []struct {
		name string
		err  error
	}{
		{"dump no pid", criu.TreeDumpOpts{NSPid: 1, ImagesDir: "/tmp"}.Validate()},
		{"dump the init itself", criu.TreeDumpOpts{Pid: 7, NSPid: 7, ImagesDir: "/tmp"}.Validate()},
		{"dump relative dir", criu.TreeDumpOpts{Pid: 2, NSPid: 1, ImagesDir: "img"}.Validate()},
		{"restore no ns pid", criu.TreeRestoreOpts{ImagesDir: "/tmp"}.Validate()},
		{"restore relative cgroup", criu.TreeRestoreOpts{ImagesDir: "/tmp", NSPid: 1, Cgroups: []string{"x"}}.Validate()},
	} {
		t.Run(tc.name, func(t *testing.T) {
			if !errors.Is(tc.err, criu.ErrInvalidConfig) {
				t.Fatalf("got %v, want ErrInvalidConfig", tc.err)
			}
		})
	}
	if err := (criu.TreeDumpOpts{Pid: 2, NSPid: 1, ImagesDir: "/tmp"}).Validate(); err != nil {
		t.Fatalf("valid dump opts: %v", err)
	}
}

// TestDumpTreeRefusesOutsider refuses a pid that is not in the sandbox.
func TestDumpTreeRefusesOutsider(t *testing.T) {
	b := setupTree(t)
	s := b.create(t)
	err := b.swrk.DumpTree(t.Context(), criu.TreeDumpOpts{Pid: os.Getpid(), NSPid: s.InitPid(), ImagesDir: t.TempDir()})
	if !errors.Is(err, criu.ErrInvalidConfig) {
		t.Fatalf("dumping a host process as a sandbox tree: %v, want ErrInvalidConfig", err)
	}
}

// percentiles reports p50, p99 and the maximum of durations in milliseconds.
func percentiles(b *testing.B, d []time.Duration) {
	benchq.Report(b, d, "")
	b.ReportMetric(0, "ns/op")
}

// BenchmarkTreeDump times a leave-running DumpTree of the counter tree.
func BenchmarkTreeDump(b *testing.B) {
	tb := setupTree(b)
	s := tb.create(b)
	root := startCounter(b, s)
	dir := b.TempDir()
	var lat []time.Duration
	for i := 0; b.Loop(); i++ {
		img := filepath.Join(dir, strconv.Itoa(i))
		if err := os.Mkdir(img, 0o755); err != nil {
			b.Fatal(err)
		}
		start := time.Now()
		if err := tb.swrk.DumpTree(b.Context(), criu.TreeDumpOpts{Pid: root, NSPid: s.InitPid(), ImagesDir: img, LeaveRunning: true}); err != nil {
			b.Fatal(err)
		}
		lat = append(lat, time.Since(start))
		if err := os.RemoveAll(img); err != nil {
			b.Fatal(err)
		}
	}
	percentiles(b, lat)
}

// BenchmarkTreeRestore times RestoreTree of the counter tree into a second
// sandbox; each copy is killed afterwards.
func BenchmarkTreeRestore(b *testing.B) {
	tb := setupTree(b)
	a, c := tb.create(b), tb.create(b)
	root := startCounter(b, a)
	img := b.TempDir()
	if err := tb.swrk.DumpTree(b.Context(), criu.TreeDumpOpts{Pid: root, NSPid: a.InitPid(), ImagesDir: img, LeaveRunning: true}); err != nil {
		b.Fatal(err)
	}
	cgs, err := criu.CgroupDirs(c.InitPid())
	if err != nil {
		b.Fatal(err)
	}
	var lat []time.Duration
	for b.Loop() {
		start := time.Now()
		rpid, err := tb.swrk.RestoreTree(b.Context(), criu.TreeRestoreOpts{ImagesDir: img, NSPid: c.InitPid(), Cgroups: cgs})
		if err != nil {
			b.Fatal(err)
		}
		lat = append(lat, time.Since(start))
		killTree(b, rpid)
	}
	percentiles(b, lat)
}

// pyCounter serves a count over TCP on 127.0.0.1:7000 inside the sandbox's
// net namespace; the count lives only in python's memory.
const pyCounter = `import os, socket
fd = os.open("/dev/null", os.O_RDWR)
for i in range(3):
    os.dup2(fd, i)
s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind(("127.0.0.1", 7000))
s.listen(16)
n = 0
while True:
    c, _ = s.accept()
    n += 1
    c.sendall(b"%d" % n)
    c.close()
`

const pyClient = `python3 -c 'import socket,time
for i in range(200):
    try:
        s = socket.create_connection(("127.0.0.1", 7000)); break
    except ConnectionRefusedError:
        time.sleep(0.01)
print(s.recv(16).decode())'`

// TestTreePythonSocket restores a python3 tree with a listening INET socket
// (Debian image from `make image`) into another sandbox of that image.
func TestTreePythonSocket(t *testing.T) {
	b := setupTree(t)
	out, err := exec.Command("go", "env", "GOMOD").Output()
	if err != nil {
		t.Fatal(err)
	}
	rootfs := filepath.Join(filepath.Dir(strings.TrimSpace(string(out))), ".data/images/default/rootfs")
	if _, err := os.Stat(filepath.Join(rootfs, "usr/bin/python3")); err != nil {
		t.Skipf("the default image (python3) is not built at %s: %v", rootfs, err)
	}
	if _, err := b.rt.ImportImage(t.Context(), "default", rootfs); err != nil {
		t.Fatal(err)
	}
	mk := func() *sandbox.Sandbox {
		s, err := b.rt.Create(t.Context(), sandbox.Spec{Image: "default"})
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { _ = s.Destroy(context.Background()) })
		return s
	}
	a, c := mk(), mk()
	res, err := a.Exec(t.Context(), sandbox.ExecRequest{Argv: []string{"python3", "-c", pyCounter}, Background: true})
	if err != nil {
		t.Fatal(err)
	}
	root := hostPid(t, a.InitPid(), res.Pid)
	count := func(s *sandbox.Sandbox, want int) {
		t.Helper()
		if got := strings.TrimSpace(mustSh(t, s, pyClient)); got != strconv.Itoa(want) {
			t.Fatalf("count = %q, want %d", got, want)
		}
	}
	count(a, 1)
	count(a, 2)
	img := t.TempDir()
	showLogs(t, img)
	start := time.Now()
	if err := b.swrk.DumpTree(t.Context(), criu.TreeDumpOpts{Pid: root, NSPid: a.InitPid(), ImagesDir: img, LeaveRunning: true}); err != nil {
		t.Fatal(err)
	}
	dumped := time.Since(start)
	cgs, err := criu.CgroupDirs(c.InitPid())
	if err != nil {
		t.Fatal(err)
	}
	start = time.Now()
	rpid, err := b.swrk.RestoreTree(t.Context(), criu.TreeRestoreOpts{ImagesDir: img, NSPid: c.InitPid(), Cgroups: cgs})
	if err != nil {
		t.Fatal(err)
	}
	t.Logf("python3 tree: dump %v, restore %v", dumped, time.Since(start))
	defer killTree(t, rpid)
	count(c, 3) // the copy continues from 2 with its listening socket
	count(a, 3)
	count(c, 4)
}

// TestFeatureCacheBounds: criu's feature cache is taken only where it is safe and cheap. A
// dump whose images lie under /run, which the cache's directory covers for criu, and a dump
// while the server's namespace holds more mounts than a copy should cost, run without it; a
// save a killed criu left half done does not block the cache; a directory that is not a
// root-only tmpfs is refused.
func TestFeatureCacheBounds(t *testing.T) {
	b := setupTree(t)
	ctx := t.Context()
	s := b.create(t)
	root := startCounter(t, s)
	defer killTree(t, root)
	dump := func(w *criu.Swrk, img string) {
		t.Helper()
		if err := w.DumpTree(ctx, criu.TreeDumpOpts{Pid: root, NSPid: s.InitPid(), ImagesDir: img, LeaveRunning: true}); err != nil {
			t.Fatal(err)
		}
	}
	fresh := func(hostMounts func() int) (*criu.Swrk, string) {
		t.Helper()
		w, err := criu.NewSwrk(b.bin)
		if err != nil {
			t.Fatal(err)
		}
		dir, err := os.MkdirTemp(filepath.Dir(b.features), "cache-")
		if err != nil {
			t.Fatal(err)
		}
		if err := w.CacheFeatures(dir, hostMounts); err != nil {
			t.Fatal(err)
		}
		return w, dir
	}
	saved := func(dir string) bool {
		m, _ := filepath.Glob(filepath.Join(dir, "*", "run", "criu.kdat"))
		return len(m) == 1
	}

	// Too many mounts to copy: the dump goes without the cache.
	w, dir := fresh(func() int { return 1 << 20 })
	dump(w, t.TempDir())
	if saved(dir) {
		t.Error("a dump copied a mount namespace past its bound of mounts")
	}
	// Images under /run: the dump goes without the cache, and works.
	if _, err := os.Stat("/run"); err == nil {
		run, err := os.MkdirTemp("/run", "dgcriu-")
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { os.RemoveAll(run) })
		w, dir = fresh(nil)
		dump(w, run)
		if saved(dir) {
			t.Error("a dump with its images under /run ran with /run covered")
		}
	}
	// A save left half done is cleared at the next start.
	w, dir = fresh(nil)
	subs, _ := filepath.Glob(filepath.Join(dir, "*", "run"))
	if len(subs) != 1 {
		t.Fatalf("the cache's directories: %v", subs)
	}
	for _, d := range []string{subs[0], filepath.Dir(subs[0])} {
		if err := os.WriteFile(filepath.Join(d, "criu.kdat.tmp"), nil, 0o600); err != nil {
			t.Fatal(err)
		}
	}
	if err := w.CacheFeatures(dir, nil); err != nil {
		t.Fatal(err)
	}
	dump(w, t.TempDir())
	if !saved(dir) {
		t.Error("no cache after a leftover of a half-done save")
	}
	// Not a tmpfs: refused.
	if err := w.CacheFeatures(t.TempDir(), nil); err == nil {
		var fs unix.Statfs_t
		if unix.Statfs(os.TempDir(), &fs) == nil && fs.Type != unix.TMPFS_MAGIC {
			t.Error("a cache directory on a disk was taken")
		}
	}
}
