package launch_test

import (
	"bytes"
	"errors"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/deltagym/deltagym/internal/testenv"
	"github.com/deltagym/deltagym/sandbox/initproc"
	"github.com/deltagym/deltagym/sandbox/launch"
	"github.com/deltagym/deltagym/sandbox/overlay"
)

func initBinary(t testing.TB) string {
	t.Helper()
	testenv.Privileged(t, "creates namespaces and mounts (CI runs as root)")
	return testenv.Init(t)
}

func busybox(t *testing.T) string {
	dir := t.TempDir()
	for _, d := range []string{"bin", "proc", "dev", "tmp", "etc"} {
		os.MkdirAll(filepath.Join(dir, d), 0o755)
	}
	os.Chmod(filepath.Join(dir, "tmp"), 0o1777)
	bb, err := os.ReadFile("/bin/busybox")
	if err != nil {
		t.Skip("needs /bin/busybox (busybox-static): ", err)
	}
	os.WriteFile(filepath.Join(dir, "bin", "busybox"), bb, 0o755)
	for _, a := range []string{"sh", "id", "ls", "cat", "echo", "grep", "mount", "stat"} {
		os.Symlink("busybox", filepath.Join(dir, "bin", a))
	}
	return dir
}

func TestStartSwapSpawn(t *testing.T) {
	home := threadFS(t, "thread-self")
	bin := initBinary(t)
	spawnDirs := func() map[string]bool {
		m, _ := filepath.Glob(filepath.Join(os.TempDir(), "dg-spawn-*"))
		out := map[string]bool{}
		for _, d := range m {
			out[d] = true
		}
		return out
	}
	before := spawnDirs()
	ns, err := launch.NewSpawnNS(bin)
	if err != nil {
		t.Fatal(err)
	}
	defer ns.Close()
	// The spawn root's mount point is gone from the host's temporary
	// directory (other tests' runtimes may hold theirs for a moment).
	for d := range spawnDirs() {
		if !before[d] {
			time.Sleep(time.Second)
			if _, err := os.Stat(d); err == nil {
				t.Errorf("the spawn namespace left %s behind", d)
			}
		}
	}
	netfd, err := launch.NewNetNS()
	if err != nil {
		t.Fatal(err)
	}
	defer unix.Close(netfd)
	in, err := ns.Start(launch.Config{HostID: 1 << 20, NetNS: netfd, Hostname: "probe"})
	if err != nil {
		t.Fatal(err)
	}
	defer in.Stop()
	pid, err := in.Conn.Ping()
	if err != nil || pid != 1 {
		t.Fatalf("ping: pid %d err %v", pid, err)
	}
	userns, err := in.NS(unix.PIDFD_GET_USER_NAMESPACE)
	if err != nil {
		t.Fatal(err)
	}
	defer unix.Close(userns)

	lower := busybox(t)
	upperBase := t.TempDir()
	if err := unix.Mount("tmpfs", upperBase, "tmpfs", 0, "size=16m"); err != nil {
		t.Fatal(err)
	}
	defer unix.Unmount(upperBase, unix.MNT_DETACH)
	os.Mkdir(filepath.Join(upperBase, "fs"), 0o755)
	os.Mkdir(filepath.Join(upperBase, "work"), 0o755)
	lfd, err := overlay.IDMapped(lower, userns, true)
	if err != nil {
		t.Fatal(err)
	}
	defer unix.Close(lfd)
	ufd, err := overlay.IDMapped(upperBase, userns, false)
	if err != nil {
		t.Fatal(err)
	}
	defer unix.Close(ufd)
	mfd, err := overlay.Mount(overlay.Spec{Lowers: []int{lfd}, UpperFD: ufd, UpperDir: "fs", WorkDir: "work", MounterID: 1 << 20})
	if err != nil {
		t.Fatal(err)
	}
	if err := in.Swap(mfd); err != nil {
		t.Fatal(err)
	}
	unix.Close(mfd)
	// Once settled, the old root no longer sits on top of the new one.
	in.Settled()
	info, err := os.ReadFile(fmt.Sprintf("/proc/%d/mountinfo", in.Pid))
	if err != nil {
		t.Fatal(err)
	}
	roots := 0
	for line := range strings.Lines(string(info)) {
		if f := strings.Fields(line); len(f) > 4 && f[4] == "/" {
			roots++
		}
	}
	if roots != 1 {
		t.Fatalf("%d mounts on / after the swap settled:\n%s", roots, info)
	}
	checkThreadsHome(t, home)

	// The init sets the pid the next process of the sandbox gets.
	if err := in.Conn.SetNextPid(4242); err != nil {
		t.Fatal(err)
	}
	r, w, _ := os.Pipe()
	devnull, _ := os.Open(os.DevNull)
	_, exitc, err := in.Conn.Spawn(initproc.SpawnRequest{
		Argv:   []string{"/bin/sh", "-c", "echo pid=$$; id; ls -ln /bin/busybox; echo hi > /tmp/x; ls -ln /tmp/x; grep Cap /proc/self/status; grep NoNewPrivs /proc/self/status; grep Seccomp: /proc/self/status; cat /proc/1/cmdline"},
		Env:    []string{"PATH=/bin"},
		Cwd:    "/",
		Stdin:  devnull,
		Stdout: w,
		Stderr: w,
	})
	w.Close()
	if err != nil {
		t.Fatal(err)
	}
	var out bytes.Buffer
	io.Copy(&out, r)
	ev := <-exitc
	t.Logf("exit %v\n%s", ev.Status.ExitStatus(), out.String())
	if !strings.HasPrefix(out.String(), "pid=4242\n") {
		t.Errorf("the command's pid is not the one set: %q", strings.SplitN(out.String(), "\n", 2)[0])
	}
	st, err := os.Stat(filepath.Join(upperBase, "fs", "tmp", "x"))
	if err != nil {
		t.Fatal(err)
	}
	t.Logf("upper file owner: %d", st.Sys().(*syscall.Stat_t).Uid)
}

// threadFS reads the mount namespace, root and working directory of
// /proc/<task>.
func threadFS(t *testing.T, task string) (fs [3]string) {
	t.Helper()
	for i, f := range []string{"ns/mnt", "root", "cwd"} {
		l, err := os.Readlink("/proc/" + task + "/" + f)
		if err != nil {
			t.Fatal(err)
		}
		fs[i] = l
	}
	return fs
}

// checkThreadsHome checks that every thread of the process, the ones a swap
// ran on included, has the mount namespace, root and working directory of
// home. The main thread is left out: a goroutine that ends locked to it
// (NewSpawnNS's) leaves it wedged, never to run Go code again.
func checkThreadsHome(t *testing.T, home [3]string) {
	t.Helper()
	tasks, err := os.ReadDir("/proc/self/task")
	if err != nil {
		t.Fatal(err)
	}
	for _, task := range tasks {
		if task.Name() == strconv.Itoa(os.Getpid()) {
			continue
		}
		for i, f := range []string{"ns/mnt", "root", "cwd"} {
			l, err := os.Readlink("/proc/self/task/" + task.Name() + "/" + f)
			if err != nil {
				continue // ended meanwhile
			}
			if l != home[i] {
				t.Errorf("thread %s: %s is %q, not %q", task.Name(), f, l, home[i])
			}
		}
	}
}

// The init's namespaces are opened through a pidfd on demand, and are its
// own; once the init has exited and been reaped (its pid free for another
// process), none is opened.
func TestInitNamespaces(t *testing.T) {
	bin := initBinary(t)
	ns, err := launch.NewSpawnNS(bin)
	if err != nil {
		t.Fatal(err)
	}
	defer ns.Close()
	netfd, err := launch.NewNetNS()
	if err != nil {
		t.Fatal(err)
	}
	defer unix.Close(netfd)
	in, err := ns.Start(launch.Config{HostID: 1 << 20, NetNS: netfd, Hostname: "probe"})
	if err != nil {
		t.Fatal(err)
	}
	defer in.Stop()
	var want unix.Stat_t
	if err := unix.Fstat(netfd, &want); err != nil {
		t.Fatal(err)
	}
	for _, c := range []struct {
		req  uint
		name string
	}{{unix.PIDFD_GET_MNT_NAMESPACE, "mnt"}, {unix.PIDFD_GET_USER_NAMESPACE, "user"}, {unix.PIDFD_GET_NET_NAMESPACE, "net"}} {
		fd, err := in.NS(c.req)
		if err != nil {
			t.Fatalf("%s namespace: %v", c.name, err)
		}
		var got, proc unix.Stat_t
		err = unix.Fstat(fd, &got)
		unix.Close(fd)
		if err != nil {
			t.Fatal(err)
		}
		if err := unix.Stat(fmt.Sprintf("/proc/%d/ns/%s", in.Pid, c.name), &proc); err != nil {
			t.Fatal(err)
		}
		if got.Ino != proc.Ino || got.Dev != proc.Dev {
			t.Fatalf("%s namespace: inode %d, the init's is %d", c.name, got.Ino, proc.Ino)
		}
		if c.name == "net" && got.Ino != want.Ino {
			t.Fatalf("net namespace: inode %d, the one it was started in is %d", got.Ino, want.Ino)
		}
	}
	if err := unix.Kill(in.Pid, unix.SIGKILL); err != nil {
		t.Fatal(err)
	}
	<-in.Done() // reaped by the zygote
	if fd, err := in.NS(unix.PIDFD_GET_MNT_NAMESPACE); !errors.Is(err, launch.ErrGone) {
		unix.Close(fd)
		t.Fatalf("namespace of an init gone: fd %d, err %v", fd, err)
	}
	if fd, err := in.PidFD(); !errors.Is(err, launch.ErrGone) {
		unix.Close(fd)
		t.Fatalf("pidfd of an init gone: fd %d, err %v", fd, err)
	}
}

// BenchmarkInitNS opens and closes the init's mount namespace through its
// pidfd (launch.Init.NS), as a root swap does.
func BenchmarkInitNS(b *testing.B) {
	testenv.Privileged(b, "creates namespaces and mounts (CI runs as root)")
	ns, err := launch.NewSpawnNS(testenv.Init(b))
	if err != nil {
		b.Fatal(err)
	}
	defer ns.Close()
	netfd, err := launch.NewNetNS()
	if err != nil {
		b.Fatal(err)
	}
	defer unix.Close(netfd)
	in, err := ns.Start(launch.Config{HostID: 1 << 20, NetNS: netfd, Hostname: "probe"})
	if err != nil {
		b.Fatal(err)
	}
	defer in.Stop()
	b.ResetTimer()
	for range b.N {
		fd, err := in.NS(unix.PIDFD_GET_MNT_NAMESPACE)
		if err != nil {
			b.Fatal(err)
		}
		unix.Close(fd)
	}
}
