package sandbox_test

import (
	"bufio"
	"encoding/json"
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/deltagym/deltagym/sandbox"
)

// bigCounterPy is counterPy with 32 MiB of memory it changes as it counts:
// after each "inc" it writes the count and a checksum of that memory, which
// depends on the count only.
const bigCounterPy = `
import os, zlib
heap = bytearray(32 << 20)
for k in range(32):
    heap[k << 20:(k + 1) << 20] = os.urandom(1 << 20)
fd = os.open("/tmp/ctl", os.O_RDWR)
f = os.fdopen(fd, "r")
i = 0
for line in f:
    i += 1
    heap[(i * 1234567) % len(heap)] ^= 0xff
    with open("/tmp/count.tmp", "w") as out:
        out.write("%d %d" % (i, zlib.crc32(heap)))
    os.rename("/tmp/count.tmp", "/tmp/count")
`

// bigInc counts once and returns the memory's checksum at that count.
func bigInc(t testing.TB, s *sandbox.Sandbox, want int) string {
	t.Helper()
	sh(t, s, "echo inc > /tmp/ctl")
	waitFor(t, s, fmt.Sprintf(`[ "$(cut -d' ' -f1 /tmp/count 2>/dev/null)" = %d ]`, want))
	return strings.Fields(sh(t, s, "cat /tmp/count"))[1]
}

// hugeBytes reads how much of a process's memory is in transparent huge pages.
func hugeBytes(t testing.TB, pid int) int64 {
	t.Helper()
	f, err := os.Open(fmt.Sprintf("/proc/%d/smaps_rollup", pid))
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		if v, ok := strings.CutPrefix(sc.Text(), "AnonHugePages:"); ok {
			kb, err := strconv.ParseInt(strings.TrimSpace(strings.TrimSuffix(strings.TrimSpace(v), "kB")), 10, 64)
			if err != nil {
				t.Fatal(err)
			}
			return kb << 10
		}
	}
	t.Fatalf("no AnonHugePages in /proc/%d/smaps_rollup", pid)
	return 0
}

// templatePid is the host pid of the one template of checkpoint ck of
// sandbox sb.
func templatePid(t *testing.T, b *bundle, sb, ck string) int {
	t.Helper()
	raw, err := os.ReadFile(templateGroupFile(t, b, sb, ck, "cgroup.procs"))
	if err != nil {
		t.Fatal(err)
	}
	f := strings.Fields(string(raw))
	if len(f) != 1 {
		t.Fatalf("template group holds %q", raw)
	}
	pid, err := strconv.Atoi(f[0])
	if err != nil {
		t.Fatal(err)
	}
	return pid
}

func needTHP(t *testing.T) {
	t.Helper()
	raw, err := os.ReadFile("/sys/kernel/mm/transparent_hugepage/enabled")
	if err != nil {
		t.Skipf("no transparent huge pages on this kernel: %v", err)
	}
	if strings.Contains(string(raw), "[never]") {
		t.Skip("transparent huge pages are off on this machine (enabled: never)")
	}
}

// waitFolded waits until the runtime's huge-page worker is idle.
func waitFolded(t testing.TB, b *bundle) {
	t.Helper()
	deadline := time.Now().Add(30 * time.Second)
	for b.rt.Folding() > 0 {
		if time.Now().After(deadline) {
			t.Fatalf("templates still being folded into huge pages after 30 s: %d", b.rt.Folding())
		}
		time.Sleep(5 * time.Millisecond)
	}
}

// A template's memory is folded into huge pages on its checkpoint's first
// restore, not before; copies forked from it, while it is being folded and
// after, hold the memory of the checkpoint and go on from it.
func TestTemplateHugePages(t *testing.T) {
	needTHP(t)
	b := setup(t)
	ctx := t.Context()
	// A sandbox whose limit leaves no room for huge pages: its template
	// stays in small pages.
	tight := b.create(t, sandbox.Spec{Image: defaultImage(t, b), Limits: sandbox.Limits{MemoryBytes: 48 << 20}})
	startCounterOf(t, tight, bigCounterPy)
	bigInc(t, tight, 1)
	tightCk, err := tight.Checkpoint(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if err := tight.Restore(ctx, tightCk.ID); err != nil {
		t.Fatal(err)
	}

	s := b.create(t, sandbox.Spec{Image: defaultImage(t, b)})
	startCounterOf(t, s, bigCounterPy)
	var sums []string
	for i := 1; i <= 5; i++ {
		sums = append(sums, bigInc(t, s, i))
	}
	ck, err := s.Checkpoint(ctx)
	if err != nil {
		t.Fatal(err)
	}
	tpl := templatePid(t, b, s.ID(), ck.ID)
	for i := 6; i <= 7; i++ {
		sums = append(sums, bigInc(t, s, i))
	}
	waitFolded(t, b)
	if n := hugeBytes(t, tpl); n != 0 {
		t.Fatalf("a template was folded into huge pages (%d bytes) before its checkpoint was restored", n)
	}
	if n := hugeBytes(t, templatePid(t, b, tight.ID(), tightCk.ID)); n != 0 {
		t.Fatalf("a template took %d bytes in huge pages beyond its sandbox's memory limit", n)
	}
	check := func(round string) {
		t.Helper()
		if err := s.Restore(ctx, ck.ID); err != nil {
			t.Fatal(err)
		}
		if got := sh(t, s, "cut -d' ' -f1 /tmp/count"); got != "5\n" {
			t.Fatalf("%s: count file after restore %q", round, got)
		}
		for i := 6; i <= 7; i++ {
			if got := bigInc(t, s, i); got != sums[i-1] {
				t.Fatalf("%s: count %d: memory checksum %s, want %s (the copy's memory is not the checkpoint's)", round, i, got, sums[i-1])
			}
		}
	}
	for r := range 3 {
		check(fmt.Sprintf("restore %d, while folding", r))
	}
	waitFolded(t, b)
	if n := hugeBytes(t, tpl); n < 24<<20 {
		t.Fatalf("the template's memory was not folded into huge pages: %d bytes in huge pages", n)
	}
	for r := range 3 {
		check(fmt.Sprintf("restore %d, folded", r))
	}
	if n := hugeBytes(t, tpl); n < 24<<20 {
		t.Fatalf("the template's huge pages were split by its copies: %d bytes left", n)
	}
}

// templateGroupFile is the path of file in the template group of
// checkpoint ck of sandbox sb (freezer hierarchy on cgroup v1), as found
// through the runtime's records.
func templateGroupFile(t *testing.T, b *bundle, sb, ck, file string) string {
	t.Helper()
	meta := filepath.Join(b.cfg.DataDir, "store", "meta")
	var rec struct {
		Cgroup string `json:"cgroup"`
	}
	var c struct {
		TplGroup string `json:"tpl_group"`
	}
	readJSON(t, filepath.Join(meta, "sandboxes", sb), &rec)
	readJSON(t, filepath.Join(meta, "checkpoints", ck+".json"), &c)
	for _, h := range []string{"unified", "freezer"} {
		d := filepath.Join("/sys/fs/cgroup", h, b.cfg.CgroupRoot, rec.Cgroup, c.TplGroup)
		if _, err := os.Stat(filepath.Join(d, "cgroup.freeze")); err == nil || h == "freezer" {
			if _, err := os.Stat(d); err == nil {
				return filepath.Join(d, file)
			}
		}
	}
	t.Fatalf("no template group %s in sandbox group %s", c.TplGroup, rec.Cgroup)
	return ""
}

func readJSON(t *testing.T, path string, v any) {
	t.Helper()
	raw, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	if err := json.Unmarshal(raw, v); err != nil {
		t.Fatalf("%s: %v", path, err)
	}
}

// A process's first checkpoint folds the live process itself into huge
// pages (its template keeps the small pages they shared): it goes on
// counting right, the templates of its later checkpoints share its huge
// pages, and restores of checkpoints taken before and after the fold bring
// back their memory. A copy a restore made is not folded again.
func TestLiveProcessHugePages(t *testing.T) {
	needTHP(t)
	b := setup(t)
	ctx := t.Context()
	s := b.create(t, sandbox.Spec{Image: defaultImage(t, b)})
	startCounterOf(t, s, bigCounterPy)
	sums := []string{bigInc(t, s, 1), bigInc(t, s, 2)}
	ck1, err := s.Checkpoint(ctx)
	if err != nil {
		t.Fatal(err)
	}
	waitFolded(t, b)
	if n := hugeBytes(t, livePid(t, b, s.ID())); n < 24<<20 {
		t.Fatalf("the live process was not folded into huge pages at its first checkpoint: %d bytes in huge pages", n)
	}
	if n := hugeBytes(t, templatePid(t, b, s.ID(), ck1.ID)); n != 0 {
		t.Fatalf("the first checkpoint's template was folded (%d bytes in huge pages) before a restore", n)
	}
	sums = append(sums, bigInc(t, s, 3), bigInc(t, s, 4))
	ck2, err := s.Checkpoint(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if n := hugeBytes(t, templatePid(t, b, s.ID(), ck2.ID)); n < 24<<20 {
		t.Fatalf("a checkpoint of the folded process has a template in small pages: %d bytes in huge pages", n)
	}
	sums = append(sums, bigInc(t, s, 5))
	restore := func(ck sandbox.CheckpointInfo, at int) {
		t.Helper()
		if err := s.Restore(ctx, ck.ID); err != nil {
			t.Fatal(err)
		}
		if got := sh(t, s, "cut -d' ' -f1 /tmp/count"); got != strconv.Itoa(at)+"\n" {
			t.Fatalf("count file after restoring the checkpoint taken at %d: %q", at, got)
		}
	}
	// The first checkpoint's copies count on as the folded process did.
	restore(ck1, 2)
	for i := 3; i <= 4; i++ {
		if got := bigInc(t, s, i); got != sums[i-1] {
			t.Fatalf("count %d after restoring the first checkpoint: memory checksum %s, want %s", i, got, sums[i-1])
		}
	}
	restore(ck2, 4)
	if got := bigInc(t, s, 5); got != sums[4] {
		t.Fatalf("count 5 after restoring the second checkpoint: memory checksum %s, want %s", got, sums[4])
	}
	// A copy of a folded template maps its huge pages; a byte it writes
	// splits one 2 MiB mapping, and its checkpoint does not fold it again.
	// The first checkpoint's template was queued for folding at its first
	// restore; the worker runs at nice 19, so on a busy machine it may
	// still be at it (copies forked meanwhile map what is folded so far).
	waitFolded(t, b)
	if n := hugeBytes(t, templatePid(t, b, s.ID(), ck1.ID)); n < 24<<20 {
		t.Fatalf("the first checkpoint's template was not folded at its first restore: %d bytes in huge pages", n)
	}
	restore(ck1, 2)
	waitFolded(t, b)
	copyPid := livePid(t, b, s.ID())
	before := hugeBytes(t, copyPid)
	if before < 24<<20 {
		t.Fatalf("a copy of a folded template has %d bytes in huge pages", before)
	}
	bigInc(t, s, 3)
	written := hugeBytes(t, copyPid)
	if written >= before {
		t.Fatalf("a copy's write left its huge pages as they were (%d bytes, then %d)", before, written)
	}
	if _, err := s.Checkpoint(ctx); err != nil {
		t.Fatal(err)
	}
	waitFolded(t, b)
	if n := hugeBytes(t, copyPid); n != written {
		t.Fatalf("a restored copy was folded again at its checkpoint: %d bytes in huge pages, %d before", n, written)
	}
}

// livePid is the host pid of the one python3 process of sandbox sb's
// command groups (not a template).
func livePid(t *testing.T, b *bundle, sb string) int {
	t.Helper()
	var rec struct {
		Cgroup string `json:"cgroup"`
	}
	readJSON(t, filepath.Join(b.cfg.DataDir, "store", "meta", "sandboxes", sb), &rec)
	group := "/" + strings.Trim(filepath.Join(b.cfg.CgroupRoot, rec.Cgroup), "/") + "/w"
	ents, err := os.ReadDir("/proc")
	if err != nil {
		t.Fatal(err)
	}
	var pids []int
	for _, e := range ents {
		pid, err := strconv.Atoi(e.Name())
		if err != nil {
			continue
		}
		comm, _ := os.ReadFile(fmt.Sprintf("/proc/%d/comm", pid))
		cg, _ := os.ReadFile(fmt.Sprintf("/proc/%d/cgroup", pid))
		// A copy a restore killed may still be exiting (the restore
		// does not wait for it to be gone), or a zombie its parent has
		// not reaped yet.
		if string(comm) != "python3\n" || sandbox.ThreadExiting(pid) {
			continue
		}
		for line := range strings.Lines(string(cg)) {
			_, path, _ := strings.Cut(line, "::")
			if _, p, ok := strings.Cut(line, ":freezer:"); ok {
				path = p
			}
			if strings.HasPrefix(path, group) {
				pids = append(pids, pid)
				break
			}
		}
	}
	if len(pids) != 1 {
		t.Fatalf("sandbox %s runs python3 as pids %v, want one", sb, pids)
	}
	return pids[0]
}
