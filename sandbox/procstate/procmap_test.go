package procstate

import (
	"bufio"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	"golang.org/x/sys/unix"
)

// sharedWritableMap finds a file mapped shared and writable, through the
// kernel's query and through the maps file alike, and nothing in a process
// that maps its files privately or read-only.
func TestSharedWritableMap(t *testing.T) {
	py, err := exec.LookPath("python3")
	if err != nil {
		t.Skip("python3 not on the host")
	}
	data := filepath.Join(t.TempDir(), "data.bin")
	if err := os.WriteFile(data, make([]byte, 1<<16), 0o644); err != nil {
		t.Fatal(err)
	}
	start := func(mode string) int {
		t.Helper()
		// mode: "shared-rw", "shared-ro" or "private-rw".
		cmd := exec.Command(py, "-c", `
import mmap, sys
f = open(sys.argv[1], "r+b")
mode = sys.argv[2]
if mode == "shared-rw":
    m = mmap.mmap(f.fileno(), 0, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
elif mode == "shared-ro":
    m = mmap.mmap(f.fileno(), 0, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ)
else:
    m = mmap.mmap(f.fileno(), 0, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ | mmap.PROT_WRITE)
print("mapped", flush=True)
sys.stdin.read()
`, data, mode)
		out, err := cmd.StdoutPipe()
		if err != nil {
			t.Fatal(err)
		}
		stdin, err := cmd.StdinPipe()
		if err != nil {
			t.Fatal(err)
		}
		if err := cmd.Start(); err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { stdin.Close(); _ = cmd.Wait() })
		if line, err := bufio.NewReader(out).ReadString('\n'); err != nil || line != "mapped\n" {
			t.Fatalf("%s: the helper did not map its file: %q %v", mode, line, err)
		}
		return cmd.Process.Pid
	}
	for _, c := range []struct {
		mode string
		want string
	}{
		{"shared-rw", "it maps " + data + " shared and writable"},
		{"shared-ro", ""},
		{"private-rw", ""},
	} {
		dir := "/proc/" + strconv.Itoa(start(c.mode))
		got, _, err := sharedWritableMap(dir)
		if err != nil || got != c.want {
			t.Errorf("%s: sharedWritableMap = %q, %v; want %q", c.mode, got, err, c.want)
		}
		f, err := os.Open(dir + "/maps")
		if err != nil {
			t.Fatal(err)
		}
		scanned, _, err := sharedWritableScan(f)
		f.Close()
		if err != nil || scanned != c.want {
			t.Errorf("%s: from the maps file: %q, %v; want %q", c.mode, scanned, err, c.want)
		}
		f, _ = os.Open(dir + "/maps")
		queried, _, err := sharedWritableQuery(f)
		f.Close()
		if err != nil && !strings.Contains(err.Error(), "inappropriate ioctl") {
			t.Errorf("%s: PROCMAP_QUERY: %v", c.mode, err)
		} else if err == nil && queried != c.want {
			t.Errorf("%s: from PROCMAP_QUERY: %q; want %q", c.mode, queried, c.want)
		}
	}
}

// pidHolder finds a pid still held after its process is gone: a session
// and group leader is killed and reaped while a member lives on, and the
// leader's pid is reported as the member's (group or session) until the
// member is gone too.
func TestPidHolderSession(t *testing.T) {
	// setsid makes sh a session leader; its child stays in the session.
	cmd := exec.Command("setsid", "sh", "-c", "sleep 1000 & echo $!; exec sleep 1000")
	out, err := cmd.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	if err := cmd.Start(); err != nil {
		t.Skipf("setsid: %v", err)
	}
	line, err := bufio.NewReader(out).ReadString('\n')
	if err != nil {
		t.Fatal(err)
	}
	member, err := strconv.Atoi(strings.TrimSpace(line))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = unix.Kill(member, unix.SIGKILL) })
	// sh prints the member's pid once it has forked it, maybe before the
	// child has exec'd sleep (its name would still be sh).
	for deadline := time.Now().Add(5 * time.Second); ; time.Sleep(time.Millisecond) {
		if comm, err := os.ReadFile("/proc/" + strconv.Itoa(member) + "/comm"); err == nil && string(comm) == "sleep\n" {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("pid %d never became sleep", member)
		}
	}
	leader := cmd.Process.Pid
	want := map[int]bool{leader: true}
	if got, err := pidHolder("/proc", want); err != nil || !strings.Contains(got, "pid "+strconv.Itoa(leader)+" is still taken (") {
		t.Fatalf("leader alive: %q, %v", got, err)
	}
	_ = cmd.Process.Kill()
	_ = cmd.Wait()
	got, err := pidHolder("/proc", want)
	if err != nil || !strings.HasPrefix(got, "pid "+strconv.Itoa(leader)+" is still taken as the ") ||
		!strings.HasSuffix(got, " of pid "+strconv.Itoa(member)+" (sleep)") {
		t.Fatalf("leader reaped, member alive: %q, %v", got, err)
	}
	if err := unix.Kill(member, unix.SIGKILL); err != nil {
		t.Fatal(err)
	}
	// The member is the init's child now (or a subreaper's): wait until
	// it is reaped.
	for deadline := time.Now().Add(5 * time.Second); ; time.Sleep(5 * time.Millisecond) {
		if got, err = pidHolder("/proc", want); err == nil && got == "" {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("member killed: %q, %v", got, err)
		}
	}
}
