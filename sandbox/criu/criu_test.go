package criu

import (
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/deltagym/deltagym/internal/benchq"
	"github.com/deltagym/deltagym/internal/locate"
	"github.com/deltagym/deltagym/internal/testenv"
)

// counterPort is where the test tree listens, on 127.0.0.1 inside its own net namespace.
const counterPort = 7000

// counterPy counts connections: each client gets the new count. It signals readiness on fd 3.
const counterPy = `
import os, socket
s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind(("127.0.0.1", 7000))
s.listen(16)
os.write(3, b"ready")
os.close(3)
n = 0
while True:
    c, _ = s.accept()
    n += 1
    c.sendall(b"%d" % n)
    c.close()
`

// sandboxInit runs as pid 1 of fresh pid+mount+net namespaces: it roots the tree in a bind mount
// of / with its own /proc and a tmpfs /dev holding null, brings lo up, becomes a session leader
// closes inherited fds and execs python. Nothing outside the namespaces stays reachable from the tree.
const sandboxInit = `set -e
R=$1
mount --make-rprivate /
mount --bind / "$R"
mount -t proc proc "$R/proc"
mount -t tmpfs -o size=64k,mode=755 tmpfs "$R/dev"
mknod -m 666 "$R/dev/null" c 1 3
ip link set lo up
cd "$R"
pivot_root . .
umount -l .
cd /
# Close fds inherited from outside (above 3): CRIU cannot dump files on mounts the tree cannot see.
for fd in $(ls /proc/self/fd); do if [ "$fd" -gt 3 ]; then eval "exec $fd>&-"; fi; done
exec setsid python3 -c "$2" </dev/null >/dev/null 2>&1
`

// backend is what the tests and benchmarks drive: Service, Swrk or the plain CLI.
type backend interface {
	Dump(ctx context.Context, o DumpOpts) error
	Restore(ctx context.Context, o RestoreOpts) (int, error)
}

// cli runs one `criu` process per request with the same flags the RPC paths use.
type cli struct {
	bin   string
	netns *os.File // restore into this external net namespace (dumped as net[ino]:sbxnet)
}

func (c cli) Dump(ctx context.Context, o DumpOpts) error {
	args := []string{"dump", "-t", strconv.Itoa(o.Pid), "-D", o.ImagesDir, "--network-lock", "skip", "-o", "dump.log"}
	if o.LeaveRunning {
		args = append(args, "--leave-running")
	}
	for _, e := range o.External {
		args = append(args, "--external", e)
	}
	if out, err := exec.CommandContext(ctx, c.bin, args...).CombinedOutput(); err != nil {
		return fmt.Errorf("criu dump: %w: %s", err, out)
	}
	return nil
}

func (c cli) Restore(ctx context.Context, o RestoreOpts) (int, error) {
	pidfile := filepath.Join(o.ImagesDir, "restore.pid")
	_ = os.Remove(pidfile)
	args := []string{"restore", "-d", "-D", o.ImagesDir, "--root", o.Root, "--pidfile", pidfile, "-o", "restore.log"}
	cmd := exec.CommandContext(ctx, c.bin, args...)
	if c.netns != nil {
		// The external net namespace is handed over as fd 3 under the key used at dump.
		cmd.ExtraFiles = []*os.File{c.netns}
		cmd.Args = append(cmd.Args, "--inherit-fd", "fd[3]:sbxnet")
	}
	if out, err := cmd.CombinedOutput(); err != nil {
		return 0, fmt.Errorf("criu restore: %w: %s", err, out)
	}
	b, err := os.ReadFile(pidfile)
	if err != nil {
		return 0, err
	}
	return strconv.Atoi(strings.TrimSpace(string(b)))
}

// privileged skips unless the test runs as root with CRIU installed, and returns the wrapper.
func privileged(t testing.TB) string {
	t.Helper()
	testenv.Privileged(t, "CRIU dumps and restores namespaces")
	bin, err := locate.CRIU()
	if err != nil {
		t.Skip(err)
	}
	for _, tool := range []string{"python3", "ip", "mount", "pivot_root", "mknod", "bash"} {
		if _, err := exec.LookPath(tool); err != nil {
			t.Skipf("%s is not installed: the test tree needs it", tool)
		}
	}
	subreaperOnce.Do(func() {
		// Restored trees are reparented here (service and CLI restore detach), so they can be reaped.
		subreaperErr = unix.Prctl(unix.PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)
	})
	if subreaperErr != nil {
		t.Fatalf("becoming a child subreaper: %v", subreaperErr)
	}
	return bin
}

var (
	subreaperOnce sync.Once
	subreaperErr  error
)

// startCounter starts the counting python tree in its own pid+mount+net namespaces and returns
// the host pid of its root. The tree is killed and reaped at cleanup.
func startCounter(t testing.TB) int {
	t.Helper()
	root := filepath.Join(t.TempDir(), "root")
	if err := os.Mkdir(root, 0o755); err != nil {
		t.Fatal(err)
	}
	ready, readyW, err := os.Pipe()
	if err != nil {
		t.Fatal(err)
	}
	defer ready.Close()
	cmd := exec.Command("bash", "-c", sandboxInit, "init", root, counterPy)
	cmd.ExtraFiles = []*os.File{readyW}
	cmd.SysProcAttr = &syscall.SysProcAttr{
		Cloneflags: syscall.CLONE_NEWPID | syscall.CLONE_NEWNS | syscall.CLONE_NEWNET,
	}
	var stderr strings.Builder
	cmd.Stderr = &stderr
	if err := cmd.Start(); err != nil {
		t.Fatalf("starting the counter tree: %v", err)
	}
	readyW.Close()
	t.Cleanup(func() { _ = cmd.Process.Kill(); _ = cmd.Wait() })
	b, _ := io.ReadAll(ready)
	if string(b) != "ready" {
		_ = cmd.Process.Kill()
		_ = cmd.Wait()
		t.Fatalf("counter tree did not start: %q %s", b, stderr.String())
	}
	return cmd.Process.Pid
}

// next connects to the counter inside pid's net namespace and returns the count it answers.
func next(pid int) (int, error) {
	runtime.LockOSThread()
	self, err := os.Open("/proc/thread-self/ns/net")
	if err != nil {
		runtime.UnlockOSThread()
		return 0, err
	}
	defer self.Close()
	target, err := os.Open(fmt.Sprintf("/proc/%d/ns/net", pid))
	if err != nil {
		runtime.UnlockOSThread()
		return 0, err
	}
	defer target.Close()
	if err := unix.Setns(int(target.Fd()), unix.CLONE_NEWNET); err != nil {
		runtime.UnlockOSThread()
		return 0, fmt.Errorf("entering net ns of %d: %w", pid, err)
	}
	fd, sockErr := unix.Socket(unix.AF_INET, unix.SOCK_STREAM|unix.SOCK_CLOEXEC, 0)
	if err := unix.Setns(int(self.Fd()), unix.CLONE_NEWNET); err != nil {
		// Leave the thread locked: it dies with the goroutine instead of serving others.
		return 0, fmt.Errorf("returning to own net ns: %w", err)
	}
	runtime.UnlockOSThread()
	if sockErr != nil {
		return 0, sockErr
	}
	defer unix.Close(fd)
	tv := unix.Timeval{Sec: 5}
	if err := unix.SetsockoptTimeval(fd, unix.SOL_SOCKET, unix.SO_RCVTIMEO, &tv); err != nil {
		return 0, err
	}
	if err := unix.Connect(fd, &unix.SockaddrInet4{Port: counterPort, Addr: [4]byte{127, 0, 0, 1}}); err != nil {
		return 0, fmt.Errorf("connecting to the counter of %d: %w", pid, err)
	}
	buf := make([]byte, 32)
	n, err := unix.Read(fd, buf)
	if err != nil {
		return 0, fmt.Errorf("reading the counter of %d: %w", pid, err)
	}
	return strconv.Atoi(string(buf[:n]))
}

func mustNext(t testing.TB, pid, want int) {
	t.Helper()
	got, err := next(pid)
	if err != nil {
		t.Fatal(err)
	}
	if got != want {
		t.Fatalf("counter of %d = %d, want %d", pid, got, want)
	}
}

// imagesDir returns a temporary images directory whose CRIU logs are shown if the test fails.
func imagesDir(t testing.TB) string {
	t.Helper()
	dir := t.TempDir()
	t.Cleanup(func() {
		if !t.Failed() {
			return
		}
		for _, log := range []string{"dump.log", "restore.log"} {
			b, err := os.ReadFile(filepath.Join(dir, log))
			if err != nil {
				continue
			}
			for _, l := range strings.Split(string(b), "\n") {
				if strings.Contains(l, "Error") && !strings.Contains(l, "tables") {
					t.Logf("%s: %s", log, l)
				}
			}
		}
	})
	return dir
}

// kill SIGKILLs a restored tree, waits until its root is gone and reaps it if it is our child
// (Swrk restores, and CLI restores reparented to this subreaper); a Service restore is a child of
// the criu service, which reaps it.
func kill(t testing.TB, pid int) {
	t.Helper()
	pfd, err := unix.PidfdOpen(pid, 0)
	if err != nil {
		t.Fatalf("opening pidfd of %d: %v", pid, err)
	}
	defer unix.Close(pfd)
	if err := unix.PidfdSendSignal(pfd, unix.SIGKILL, nil, 0); err != nil {
		t.Fatalf("killing %d: %v", pid, err)
	}
	fds := []unix.PollFd{{Fd: int32(pfd), Events: unix.POLLIN}}
	for {
		if _, err := unix.Poll(fds, 10_000); err == nil {
			break
		} else if !errors.Is(err, unix.EINTR) {
			t.Fatalf("waiting for %d to exit: %v", pid, err)
		}
	}
	if fds[0].Revents&unix.POLLIN == 0 {
		t.Fatalf("%d did not exit within 10 s of SIGKILL", pid)
	}
	var info unix.Siginfo
	if err := unix.Waitid(unix.P_PIDFD, pfd, &info, unix.WEXITED|unix.WNOHANG, nil); err != nil && !errors.Is(err, unix.ECHILD) {
		t.Fatalf("reaping %d: %v", pid, err)
	}
}

// nsPid returns the innermost pid of a host pid (the last NSpid field).
func nsPid(t testing.TB, pid int) int {
	t.Helper()
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/status", pid))
	if err != nil {
		t.Fatal(err)
	}
	for _, l := range strings.Split(string(b), "\n") {
		if f := strings.Fields(l); len(f) > 1 && f[0] == "NSpid:" {
			n, _ := strconv.Atoi(f[len(f)-1])
			return n
		}
	}
	t.Fatalf("no NSpid for %d", pid)
	return 0
}

func backends(t testing.TB, bin string) map[string]backend {
	t.Helper()
	svc, err := Start(context.Background(), Config{Binary: bin, WorkDir: t.TempDir()})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		if err := svc.Close(); err != nil {
			t.Error(err)
		}
	})
	swrk, err := NewSwrk(bin)
	if err != nil {
		t.Fatal(err)
	}
	return map[string]backend{"cli": cli{bin: bin}, "swrk": swrk, "service": svc}
}

// TestDumpRestoreContinues proves a namespaced python tree with a listening INET socket survives
// dump (leave-running) and restore, and continues from the dumped count.
func TestDumpRestoreContinues(t *testing.T) {
	bin := privileged(t)
	for _, name := range []string{"service", "swrk", "cli"} {
		t.Run(name, func(t *testing.T) {
			b := backends(t, bin)[name]
			ctx := t.Context()
			pid := startCounter(t)
			mustNext(t, pid, 1)
			mustNext(t, pid, 2)
			img := imagesDir(t)
			if err := b.Dump(ctx, DumpOpts{Pid: pid, ImagesDir: img, LeaveRunning: true}); err != nil {
				t.Fatal(err)
			}
			mustNext(t, pid, 3) // the original keeps running and counting
			if err := unix.Kill(pid, unix.SIGKILL); err != nil {
				t.Fatal(err)
			}
			rpid, err := b.Restore(ctx, RestoreOpts{ImagesDir: img, Root: "/"})
			if err != nil {
				t.Fatal(err)
			}
			if rpid <= 0 || rpid == pid {
				t.Fatalf("restored pid %d (original %d)", rpid, pid)
			}
			defer kill(t, rpid)
			if got := nsPid(t, rpid); got != 1 {
				t.Errorf("restored tree's root is pid %d in its namespace, want 1", got)
			}
			mustNext(t, rpid, 3) // continues from the dumped count 2
			mustNext(t, rpid, 4)
			// A second restore of the same images runs alongside in its own namespaces.
			rpid2, err := b.Restore(ctx, RestoreOpts{ImagesDir: img, Root: "/"})
			if err != nil {
				t.Fatal(err)
			}
			defer kill(t, rpid2)
			mustNext(t, rpid2, 3)
		})
	}
}

func TestDumpFailsForMissingPid(t *testing.T) {
	bin := privileged(t)
	for name, b := range backends(t, bin) {
		t.Run(name, func(t *testing.T) {
			err := b.Dump(t.Context(), DumpOpts{Pid: 1 << 22, ImagesDir: t.TempDir(), LeaveRunning: true})
			if err == nil {
				t.Fatal("dump of a pid that does not exist succeeded")
			}
			if name != "cli" && !errors.Is(err, ErrRequest) {
				t.Errorf("error %v is not ErrRequest", err)
			}
		})
	}
}

func TestServiceCloseTwice(t *testing.T) {
	bin := privileged(t)
	svc, err := Start(t.Context(), Config{Binary: bin, WorkDir: t.TempDir()})
	if err != nil {
		t.Fatal(err)
	}
	v, err := svc.Version(t.Context())
	if err != nil {
		t.Fatal(err)
	}
	if v < 40201 {
		t.Errorf("criu version %d, want >= 4.2.1", v)
	}
	if err := svc.Close(); err != nil {
		t.Fatal(err)
	}
	if err := svc.Close(); err != nil {
		t.Fatalf("second Close: %v", err)
	}
	if _, err := svc.Version(t.Context()); !errors.Is(err, ErrClosed) {
		t.Fatalf("Version after Close: %v, want ErrClosed", err)
	}
}

// NewSwrk and Start take only an executable file: an empty path means no CRIU.
func TestNotInstalled(t *testing.T) {
	dir := t.TempDir()
	exe := filepath.Join(dir, "criu")
	if err := os.WriteFile(exe, []byte("#!/bin/sh\n"), 0o755); err != nil {
		t.Fatal(err)
	}
	plain := filepath.Join(dir, "plain")
	if err := os.WriteFile(plain, nil, 0o644); err != nil {
		t.Fatal(err)
	}
	for _, tc := range []struct {
		name, bin string
		wantErr   error
	}{
		{"executable", exe, nil},
		{"empty", "", ErrNotInstalled},
		{"missing", filepath.Join(dir, "nope"), ErrNotInstalled},
		{"directory", dir, ErrNotInstalled},
		{"not executable", plain, ErrNotInstalled},
	} {
		t.Run(tc.name, func(t *testing.T) {
			if _, err := NewSwrk(tc.bin); !errors.Is(err, tc.wantErr) {
				t.Fatalf("NewSwrk(%q): %v, want %v", tc.bin, err, tc.wantErr)
			}
			if tc.wantErr == nil {
				return
			}
			if _, err := Start(t.Context(), Config{Binary: tc.bin, WorkDir: dir}); !errors.Is(err, tc.wantErr) {
				t.Fatalf("Start with %q: %v, want %v", tc.bin, err, tc.wantErr)
			}
		})
	}
}

func TestValidate(t *testing.T) {
	for _, tc := range []struct {
		name string
		err  error
	}{
		{"config relative", Config{WorkDir: "rel"}.Validate()},
		{"config too long", Config{WorkDir: "/" + strings.Repeat("x", 120)}.Validate()},
		{"dump no pid", DumpOpts{ImagesDir: "/tmp"}.Validate()},
		{"dump relative", DumpOpts{Pid: 1, ImagesDir: "img"}.Validate()},
		{"restore relative root", RestoreOpts{ImagesDir: "/tmp", Root: "r"}.Validate()},
	} {
		t.Run(tc.name, func(t *testing.T) {
			if !errors.Is(tc.err, ErrInvalidConfig) {
				t.Fatalf("got %v, want ErrInvalidConfig", tc.err)
			}
		})
	}
	if err := (DumpOpts{Pid: 1, ImagesDir: "/tmp"}).Validate(); err != nil {
		t.Fatalf("valid dump opts: %v", err)
	}
}

// percentiles reports p50, p99 and the maximum of durations in milliseconds.
func percentiles(b *testing.B, d []time.Duration) {
	benchq.Report(b, d, "")
	b.ReportMetric(0, "ns/op")
}

// BenchmarkDump times a leave-running dump of the namespaced python tree (about 10 MB RSS).
func BenchmarkDump(b *testing.B) {
	bin := privileged(b)
	for _, name := range []string{"cli", "swrk", "service"} {
		b.Run(name, func(b *testing.B) {
			be := backends(b, bin)[name]
			pid := startCounter(b)
			img := b.TempDir()
			var lat []time.Duration
			for i := 0; b.Loop(); i++ {
				dir := filepath.Join(img, strconv.Itoa(i))
				if err := os.Mkdir(dir, 0o755); err != nil {
					b.Fatal(err)
				}
				start := time.Now()
				if err := be.Dump(b.Context(), DumpOpts{Pid: pid, ImagesDir: dir, LeaveRunning: true}); err != nil {
					b.Fatal(err)
				}
				lat = append(lat, time.Since(start))
				if err := os.RemoveAll(dir); err != nil {
					b.Fatal(err)
				}
			}
			percentiles(b, lat)
		})
	}
}

// BenchmarkRestore times restoring the namespaced python tree; each copy is killed afterwards.
func BenchmarkRestore(b *testing.B) {
	bin := privileged(b)
	for _, name := range []string{"cli", "swrk", "service"} {
		b.Run(name, func(b *testing.B) {
			be := backends(b, bin)[name]
			pid := startCounter(b)
			img := b.TempDir()
			if err := be.Dump(b.Context(), DumpOpts{Pid: pid, ImagesDir: img, LeaveRunning: true}); err != nil {
				b.Fatal(err)
			}
			var lat []time.Duration
			for b.Loop() {
				start := time.Now()
				rpid, err := be.Restore(b.Context(), RestoreOpts{ImagesDir: img, Root: "/"})
				if err != nil {
					b.Fatal(err)
				}
				lat = append(lat, time.Since(start))
				kill(b, rpid)
			}
			percentiles(b, lat)
		})
	}
}

// TestExternalNetNS dumps a tree with its net namespace marked external and restores it into
// that same namespace (kept alive by an fd), as a pool of pre-made net namespaces would. CRIU
// needs the namespace as an inherited fd under the dump's key (--inherit-fd), which its RPC
// accepts from swrk only, not from the service; join-ns is not enough. This checks the CLI flags.
func TestExternalNetNS(t *testing.T) {
	bin := privileged(t)
	ctx := t.Context()
	pid := startCounter(t)
	ns, err := os.Open(fmt.Sprintf("/proc/%d/ns/net", pid))
	if err != nil {
		t.Fatal(err)
	}
	defer ns.Close()
	var st unix.Stat_t
	if err := unix.Fstat(int(ns.Fd()), &st); err != nil {
		t.Fatal(err)
	}
	b := cli{bin: bin, netns: ns}
	mustNext(t, pid, 1)
	img := imagesDir(t)
	ext := []string{fmt.Sprintf("net[%d]:sbxnet", st.Ino)}
	if err := b.Dump(ctx, DumpOpts{Pid: pid, ImagesDir: img, LeaveRunning: true, External: ext}); err != nil {
		t.Fatal(err)
	}
	if m, _ := filepath.Glob(filepath.Join(img, "netdev-*.img")); len(m) != 0 {
		t.Errorf("the external net namespace was dumped: %v", m)
	}
	// The original's listening socket must be gone before the copy binds the same port.
	pfd, err := unix.PidfdOpen(pid, 0)
	if err != nil {
		t.Fatal(err)
	}
	defer unix.Close(pfd)
	if err := unix.PidfdSendSignal(pfd, unix.SIGKILL, nil, 0); err != nil {
		t.Fatal(err)
	}
	if _, err := unix.Poll([]unix.PollFd{{Fd: int32(pfd), Events: unix.POLLIN}}, 10_000); err != nil {
		t.Fatal(err)
	}
	rpid, err := b.Restore(ctx, RestoreOpts{ImagesDir: img, Root: "/"})
	if err != nil {
		t.Fatal(err)
	}
	defer kill(t, rpid)
	var rst unix.Stat_t
	if err := unix.Stat(fmt.Sprintf("/proc/%d/ns/net", rpid), &rst); err != nil {
		t.Fatal(err)
	}
	if rst.Ino != st.Ino {
		t.Errorf("restored into net ns %d, want the external %d", rst.Ino, st.Ino)
	}
	mustNext(t, rpid, 2)
}
