package sandbox

import (
	"bufio"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
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
		got, err := sharedWritableMap(dir)
		if err != nil || got != c.want {
			t.Errorf("%s: sharedWritableMap = %q, %v; want %q", c.mode, got, err, c.want)
		}
		f, err := os.Open(dir + "/maps")
		if err != nil {
			t.Fatal(err)
		}
		scanned, err := sharedWritableScan(f)
		f.Close()
		if err != nil || scanned != c.want {
			t.Errorf("%s: from the maps file: %q, %v; want %q", c.mode, scanned, err, c.want)
		}
		f, _ = os.Open(dir + "/maps")
		queried, err := sharedWritableQuery(f)
		f.Close()
		if err != nil && !strings.Contains(err.Error(), "inappropriate ioctl") {
			t.Errorf("%s: PROCMAP_QUERY: %v", c.mode, err)
		} else if err == nil && queried != c.want {
			t.Errorf("%s: from PROCMAP_QUERY: %q; want %q", c.mode, queried, c.want)
		}
	}
}
