package sandbox

import (
	"bufio"
	"crypto/sha256"
	"errors"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/deltagym/deltagym/sandbox/procstate"
)

// memProcPy maps 64 GiB of anonymous memory (MAP_NORESERVE) and 64 KiB of a file, private and
// writable, prints their addresses, then does to a page of either what each line of its input
// says, answering "ok".
const memProcPy = `
import ctypes, mmap, sys  # 0x4000: MAP_NORESERVE
m = mmap.mmap(-1, 64 << 30, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | 0x4000, prot=mmap.PROT_READ | mmap.PROT_WRITE)
f = open(sys.argv[1], "r+b")
fm = mmap.mmap(f.fileno(), 64 << 10, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ | mmap.PROT_WRITE)
print("%x %x" % (ctypes.addressof(ctypes.c_char.from_buffer(m)), ctypes.addressof(ctypes.c_char.from_buffer(fm))), flush=True)
sink = 0
for line in sys.stdin:
    op, i = line.split()
    i = int(i) * 4096
    if op == "read":
        sink += m[i]
    elif op == "zero":
        m[i] = 0
    elif op == "one":
        m[i] = 1
    elif op == "fread":
        sink += fm[i]
    elif op == "fone":
        fm[i] = 1
    print("ok", flush=True)
`

// memProc is a running memProcPy.
type memProc struct {
	t         *testing.T
	pid       int
	anon, fil string // their address, as /proc/PID/maps starts their lines
	in        io.Writer
	out       *bufio.Reader
}

func startMemProc(t *testing.T) *memProc {
	t.Helper()
	py, err := exec.LookPath("python3")
	if err != nil {
		t.Skip("python3 is not installed")
	}
	data := filepath.Join(t.TempDir(), "data")
	content := make([]byte, 64<<10)
	for i := range content {
		content[i] = byte(i%251) + 1
	}
	if err := os.WriteFile(data, content, 0o600); err != nil {
		t.Fatal(err)
	}
	cmd := exec.Command(py, "-c", memProcPy, data)
	in, err := cmd.StdinPipe()
	if err != nil {
		t.Fatal(err)
	}
	out, err := cmd.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = cmd.Process.Kill(); _ = cmd.Wait() })
	p := &memProc{t: t, pid: cmd.Process.Pid, in: in, out: bufio.NewReader(out)}
	line, err := p.out.ReadString('\n')
	if err != nil {
		t.Fatalf("python3: %q %v", line, err)
	}
	p.anon, p.fil, _ = strings.Cut(strings.TrimSpace(line), " ")
	return p
}

// do makes the process do op to page i and waits for its answer.
func (p *memProc) do(op string, i int) {
	p.t.Helper()
	if _, err := io.WriteString(p.in, op+" "+strconv.Itoa(i)+"\n"); err != nil {
		p.t.Fatal(err)
	}
	if line, err := p.out.ReadString('\n'); err != nil || line != "ok\n" {
		p.t.Fatalf("%s %d: %q %v", op, i, line, err)
	}
}

// hash hashes the mapping at addr as a processes digest does, by PAGEMAP_SCAN or (noScan) by
// pagemap's entries.
func (p *memProc) hash(addr string, noScan bool, b *procBudget) ([32]byte, error) {
	p.t.Helper()
	maps, err := os.ReadFile("/proc/" + strconv.Itoa(p.pid) + "/maps")
	if err != nil {
		p.t.Fatal(err)
	}
	var line string
	for l := range strings.SplitSeq(string(maps), "\n") {
		if strings.HasPrefix(l, addr+"-") {
			line = l
		}
	}
	if line == "" {
		p.t.Fatalf("no mapping at %s in\n%s", addr, maps)
	}
	mem, err := os.Open("/proc/" + strconv.Itoa(p.pid) + "/mem")
	if err != nil {
		p.t.Fatal(err)
	}
	defer mem.Close()
	pm, err := os.Open("/proc/" + strconv.Itoa(p.pid) + "/pagemap")
	if err != nil {
		p.t.Fatal(err)
	}
	defer pm.Close()
	h := sha256.New()
	w := newMemWalk(h, mem, pm, nil, b, func() error { return nil })
	w.noScan = noScan
	err = w.mapping(line)
	var sum [32]byte
	h.Sum(sum[:0])
	return sum, err
}

// both hashes the mapping at addr both ways, checks they agree, and returns the hash.
func (p *memProc) both(addr string) [32]byte {
	p.t.Helper()
	a, err := p.hash(addr, false, newProcBudget(0))
	if err != nil {
		p.t.Fatal(err)
	}
	b, err := p.hash(addr, true, newProcBudget(0))
	if err != nil {
		p.t.Fatal(err)
	}
	if a != b {
		p.t.Fatalf("by PAGEMAP_SCAN %x, by pagemap's entries %x", a, b)
	}
	return a
}

// vmPTE returns the process's page tables' size (VmPTE), in KiB.
func (p *memProc) vmPTE() int {
	p.t.Helper()
	st, err := os.ReadFile("/proc/" + strconv.Itoa(p.pid) + "/status")
	if err != nil {
		p.t.Fatal(err)
	}
	for l := range strings.SplitSeq(string(st), "\n") {
		if v, ok := strings.CutPrefix(l, "VmPTE:"); ok {
			n, err := strconv.Atoi(strings.TrimSpace(strings.TrimSuffix(strings.TrimSpace(v), "kB")))
			if err != nil {
				p.t.Fatal(err)
			}
			return n
		}
	}
	p.t.Fatal("no VmPTE")
	return 0
}

// A page of an anonymous mapping hashes alike absent, mapped to the zero page, or written
// with zeros; one written otherwise does not. A page of a private file mapping hashes alike
// absent or mapped from the file's cache; one written does not. Hashing a 64 GiB mapping maps
// nothing into the process.
func TestTemplateMemoryPresentPages(t *testing.T) {
	p := startMemProc(t)
	pte := p.vmPTE()
	t0 := time.Now()
	untouched := p.both(p.anon)
	t.Logf("64 GiB mapping hashed both ways in %v", time.Since(t0))
	if grown := p.vmPTE() - pte; grown > 64 {
		t.Fatalf("hashing grew the page tables by %d KiB", grown)
	}
	p.do("read", 2)
	p.do("zero", 3)
	p.do("read", 1<<20)
	if got := p.both(p.anon); got != untouched {
		t.Fatal("pages read or written with zeros changed the hash")
	}
	p.do("one", 5)
	one := p.both(p.anon)
	if one == untouched {
		t.Fatal("a page written changed nothing")
	}
	p.do("one", 6)
	if p.both(p.anon) == one {
		t.Fatal("a second page written changed nothing")
	}

	file := p.both(p.fil)
	p.do("fread", 1)
	if p.both(p.fil) != file {
		t.Fatal("a page read from the file changed the hash")
	}
	p.do("fone", 2)
	if p.both(p.fil) == file {
		t.Fatal("a page of the file written changed nothing")
	}

	if _, err := p.hash(p.anon, false, &procBudget{bytes: 4096, deadline: time.Now().Add(time.Minute)}); !errors.Is(err, errOverBudget) {
		t.Fatalf("two pages on a one-page budget: %v", err)
	}
	if _, err := p.hash(p.anon, false, &procBudget{bytes: 1 << 30, deadline: time.Now()}); !errors.Is(err, errOverBudget) {
		t.Fatalf("past the deadline: %v", err)
	}
}

// Past its budget, a processes digest equals no other, nor do its processes' memory sums.
func TestProcessDigestOverBudget(t *testing.T) {
	p := startMemProc(t)
	p.do("one", 1)
	start, err := procstate.StartTime(p.pid)
	if err != nil {
		t.Fatal(err)
	}
	in := []procInput{{pid: 1, comm: "python3", hostPid: p.pid, start: start, unit: -1}}
	never := func() error { return nil }
	if _, _, err := processDigest(in, newProcBudget(0), never); err != nil {
		t.Fatalf("within the budget: %v", err)
	}
	var over []string
	var mems [][32]byte
	for range 2 {
		sums, d, err := processDigest(in, &procBudget{bytes: 4096, deadline: time.Now().Add(time.Minute)}, never)
		if !errors.Is(err, errOverBudget) || !strings.HasPrefix(d, "sha256:") || len(d) != 71 || len(sums) != 1 {
			t.Fatalf("over the budget: %q %v %v", d, sums, err)
		}
		over, mems = append(over, d), append(mems, sums[0].mem)
	}
	if over[0] == over[1] || mems[0] == mems[1] {
		t.Fatalf("over the budget twice: %v, memory sums %x", over, mems)
	}
}
