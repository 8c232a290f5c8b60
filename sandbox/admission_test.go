package sandbox_test

import (
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"runtime"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/deltagym/deltagym/internal/errdefs"
	"github.com/deltagym/deltagym/sandbox"
)

// counts is what a refused request must leave as it was.
type counts struct {
	sandboxes, checkpoints, layerMounts, mounts, groups int
}

func countNow(t *testing.T, b *bundle) counts {
	t.Helper()
	mi, err := os.ReadFile("/proc/self/mountinfo")
	if err != nil {
		t.Fatal(err)
	}
	groups, err := os.ReadDir(filepath.Join("/sys/fs/cgroup/memory", b.cfg.CgroupRoot))
	if err != nil {
		t.Fatal(err)
	}
	return counts{b.rt.Sandboxes(), b.rt.Checkpoints(), b.rt.LayerMounts(), strings.Count(string(mi), b.dir), len(groups)}
}

// refused checks that err is the refusal of cap c of value limit, with its
// flag, and that nothing was made.
func refused(t *testing.T, b *bundle, err error, c sandbox.Cap, limit int64, before counts) {
	t.Helper()
	if !errors.Is(err, sandbox.ErrCap) || !errors.Is(err, errdefs.ErrResourceExhausted) {
		t.Fatalf("want a refusal by cap %s, got %v", c, err)
	}
	for _, want := range []string{fmt.Sprintf("cap %q of %d", c, limit), "--max-" + string(c) + " raises it"} {
		if !strings.Contains(err.Error(), want) {
			t.Fatalf("refusal %q does not say %q", err, want)
		}
	}
	if after := countNow(t, b); after != before {
		t.Fatalf("a refused request changed the counts: %+v, then %+v", before, after)
	}
}

// capsBundle is a runtime with the given caps, no warm inits (so that
// nothing is made in the background between two counts), and the flags the
// server names in refusals.
func capsBundle(t *testing.T, caps sandbox.Caps, mod ...func(*sandbox.Config)) *bundle {
	flags := map[sandbox.Cap]string{}
	for _, c := range []sandbox.Cap{sandbox.CapSandboxes, sandbox.CapCheckpoints, sandbox.CapCheckpointBytes, sandbox.CapDescriptors, sandbox.CapMounts} {
		flags[c] = "--max-" + string(c)
	}
	return setup(t, append([]func(*sandbox.Config){func(c *sandbox.Config) {
		c.Caps, c.CapFlags, c.InitPool = caps, flags, -1
	}}, mod...)...)
}

// Each cap refuses the request that would pass it before anything is made,
// and a Fork of n children takes all n or none.
func TestCapsRefuseBeforeCreating(t *testing.T) {
	t.Run("sandboxes", func(t *testing.T) {
		b := capsBundle(t, sandbox.Caps{Sandboxes: 3})
		s := b.create(t, sandbox.Spec{})
		ck, err := s.Checkpoint(t.Context())
		must(t, err)
		before := countNow(t, b)
		_, err = b.rt.Fork(t.Context(), ck.ID, 3, sandbox.Spec{})
		refused(t, b, err, sandbox.CapSandboxes, 3, before)
		kids, err := b.rt.Fork(t.Context(), ck.ID, 2, sandbox.Spec{})
		must(t, err)
		before = countNow(t, b)
		_, err = b.rt.Create(t.Context(), sandbox.Spec{Image: "busybox"})
		refused(t, b, err, sandbox.CapSandboxes, 3, before)
		must(t, kids[0].Destroy(t.Context()))
		b.create(t, sandbox.Spec{}) // a closed sandbox's place is free again
		must(t, kids[1].Destroy(t.Context()))
	})
	t.Run("descriptors", func(t *testing.T) {
		b := capsBundle(t, sandbox.Caps{Descriptors: -1})
		s := b.create(t, sandbox.Spec{})
		ck, err := s.Checkpoint(t.Context())
		must(t, err)
		// Room for the hot set and two sandboxes: the count stands until
		// fdRecount.
		limit := b.rt.CountFDs() + b.rt.HotFDs() + 2*sandbox.FDsPerSandbox
		b.rt.SetCaps(sandbox.Caps{Descriptors: limit})
		before := countNow(t, b)
		_, err = b.rt.Fork(t.Context(), ck.ID, 3, sandbox.Spec{})
		refused(t, b, err, sandbox.CapDescriptors, int64(limit), before)
		kids, err := b.rt.Fork(t.Context(), ck.ID, 2, sandbox.Spec{})
		must(t, err)
		for _, k := range kids {
			must(t, k.Destroy(t.Context()))
		}
	})
	t.Run("mounts", func(t *testing.T) {
		b := capsBundle(t, sandbox.Caps{Mounts: -1})
		s := b.create(t, sandbox.Spec{})
		ck, err := s.Checkpoint(t.Context())
		must(t, err)
		limit := b.rt.LayerMounts() + 2*2 // two sandboxes' uppers and next uppers
		b.rt.SetCaps(sandbox.Caps{Mounts: limit})
		before := countNow(t, b)
		_, err = b.rt.Fork(t.Context(), ck.ID, 3, sandbox.Spec{})
		refused(t, b, err, sandbox.CapMounts, int64(limit), before)
		kids, err := b.rt.Fork(t.Context(), ck.ID, 2, sandbox.Spec{})
		must(t, err)
		// A checkpoint takes one more mount (its sealed layer).
		limit = b.rt.LayerMounts()
		b.rt.SetCaps(sandbox.Caps{Mounts: limit})
		before = countNow(t, b)
		_, err = s.Checkpoint(t.Context())
		refused(t, b, err, sandbox.CapMounts, int64(limit), before)
		for _, k := range kids {
			must(t, k.Destroy(t.Context()))
		}
	})
	t.Run("checkpoints", func(t *testing.T) {
		b := capsBundle(t, sandbox.Caps{Checkpoints: 2})
		s := b.create(t, sandbox.Spec{})
		sh(t, s, "echo 1 > /f")
		_, err := s.Checkpoint(t.Context())
		must(t, err)
		sh(t, s, "echo 2 > /f")
		ck2, err := s.Checkpoint(t.Context())
		must(t, err)
		sh(t, s, "echo 3 > /f")
		before := countNow(t, b)
		_, err = s.Checkpoint(t.Context())
		refused(t, b, err, sandbox.CapCheckpoints, 2, before)
		if s.Head() != ck2.ID || sh(t, s, "cat /f") != "3\n" {
			t.Fatalf("a refused checkpoint changed the sandbox: head %s, /f %q", s.Head(), sh(t, s, "cat /f"))
		}
		must(t, b.rt.ReleaseCheckpoint(ck2.ID))
		if _, err := s.Checkpoint(t.Context()); err != nil {
			t.Fatalf("a checkpoint within the cap once another was released: %v", err)
		}
	})
	t.Run("checkpoint-bytes", func(t *testing.T) {
		b := capsBundle(t, sandbox.Caps{}, func(c *sandbox.Config) { c.CheckpointBudgetBytes = 2 << 20 })
		s := b.create(t, sandbox.Spec{})
		sh(t, s, "dd if=/dev/zero of=/big bs=1M count=3 2>/dev/null")
		before := countNow(t, b)
		_, err := s.Checkpoint(t.Context())
		refused(t, b, err, sandbox.CapCheckpointBytes, 2<<20, before)
	})
}

// Admission charges an idle sandbox what it holds of the server's
// descriptors (its init's control socket), and the hot set what the
// sandboxes used last keep: sandboxes that ran commands, background
// processes, checkpoints and restores, more than the hot set holds, keep
// no more than that between them, and a cold one works as before.
func TestAdmissionCharges(t *testing.T) {
	const hot = 2
	b := capsBundle(t, sandbox.Caps{}, func(c *sandbox.Config) { c.HotSandboxes = hot })
	s := b.create(t, sandbox.Spec{})
	ck, err := s.Checkpoint(t.Context())
	must(t, err)
	const n = 8
	before := serverFDs(t)
	kids, err := b.rt.Fork(t.Context(), ck.ID, n, sandbox.Spec{})
	must(t, err)
	// New sandboxes join the hot set; the cooler closes what the least
	// recently used keep, and those it leaves hot are cooled here.
	waitHot(t, b, hot)
	for _, k := range kids {
		k.Settle() // the detach of the root each swapped out holds its namespace meanwhile
		k.Cool()
	}
	if idle := float64(serverFDs(t)-before) / n; idle > sandbox.FDsPerSandbox {
		t.Fatalf("an idle sandbox holds %.1f descriptors of the server; admission charges %d", idle, sandbox.FDsPerSandbox)
	}
	for _, k := range kids {
		sh(t, k, "echo hi > /tmp/x; cat /tmp/x")
		if _, err := k.Exec(t.Context(), sandbox.ExecRequest{Command: "sleep 100", Background: true}); err != nil {
			t.Fatal(err)
		}
		kc, err := k.Checkpoint(t.Context())
		must(t, err)
		sh(t, k, "echo bye > /tmp/x")
		must(t, k.Restore(t.Context(), kc.ID))
		sh(t, k, "true")
	}
	waitHot(t, b, hot)
	extra := serverFDs(t) - before - n*sandbox.FDsPerSandbox
	if extra > hot*sandbox.FDsPerHotSandbox {
		t.Fatalf("%d sandboxes used, %d of them hot, hold %d descriptors beyond their idle ones; admission charges %d a hot sandbox",
			n, hot, extra, sandbox.FDsPerHotSandbox)
	}
	t.Logf("%d descriptors beyond the idle ones for %d hot sandboxes (charged %d each)", extra, hot, sandbox.FDsPerHotSandbox)
	// The least recently used is cold: it opens what it needs again.
	k := kids[0]
	if got := sh(t, k, "cat /tmp/x"); got != "hi\n" {
		t.Fatalf("a cold sandbox reads %q", got)
	}
	kc, err := k.Checkpoint(t.Context())
	must(t, err)
	sh(t, k, "echo again > /tmp/x")
	must(t, k.Restore(t.Context(), kc.ID))
	if got := sh(t, k, "cat /tmp/x"); got != "hi\n" {
		t.Fatalf("a sandbox restored cold reads %q", got)
	}
	for _, k := range kids {
		must(t, k.Destroy(t.Context()))
	}
}

// waitHot waits until the cooler, in the background, has brought the hot
// set down to its bound (the deadline is a watchdog: it runs at once).
func waitHot(t *testing.T, b *bundle, hot int) {
	t.Helper()
	for deadline := time.Now().Add(10 * time.Second); b.rt.HotSandboxes() > hot; {
		if time.Now().After(deadline) {
			t.Fatalf("the hot set holds %d sandboxes, over its %d", b.rt.HotSandboxes(), hot)
		}
		runtime.Gosched()
	}
}

// serverFDs counts the process's descriptors but the ready net namespaces
// of the runtime's pool (Config.NetPool), which it refills in the
// background.
func serverFDs(t testing.TB) int {
	t.Helper()
	ents, err := os.ReadDir("/proc/self/fd")
	must(t, err)
	n := 0
	for _, e := range ents {
		if l, err := os.Readlink("/proc/self/fd/" + e.Name()); err == nil && !strings.HasPrefix(l, "net:[") {
			n++
		}
	}
	return n
}

// A checkpoint no live sandbox descends from, not pinned and not used for
// the TTL, is released; a pinned one, and the head of a live sandbox, stay.
func TestCheckpointTTLUnreferenced(t *testing.T) {
	const ttl = 300 * time.Millisecond
	expired := make(chan string, 16)
	b := setup(t, func(c *sandbox.Config) {
		c.CheckpointTTL = ttl
		c.OnCheckpointExpired = func(id string) { expired <- id }
	})
	s := b.create(t, sandbox.Spec{})
	loose, err := s.Checkpoint(t.Context())
	must(t, err)
	pinned, err := s.CheckpointWith(t.Context(), sandbox.CheckpointOptions{Pinned: true})
	must(t, err)
	other := b.create(t, sandbox.Spec{})
	head, err := other.Checkpoint(t.Context()) // other's head
	must(t, err)
	sh(t, other, "echo moved on > /f")
	waitReleased(t, b, loose.ID, 20*ttl)
	for _, id := range []string{pinned.ID, head.ID} {
		if _, err := b.rt.Checkpoint(id); err != nil {
			t.Fatalf("checkpoint %s expired while referenced: %v", id, err)
		}
	}
	must(t, other.Destroy(t.Context()))
	waitReleased(t, b, head.ID, 20*ttl)
	if _, err := b.rt.Checkpoint(pinned.ID); err != nil {
		t.Fatalf("a pinned checkpoint expired: %v", err)
	}
	must(t, b.rt.ReleaseCheckpoint(pinned.ID))
	// The hook heard of the two that expired, and of nothing else.
	var got []string
	for len(expired) > 0 {
		got = append(got, <-expired)
	}
	if len(got) != 2 || !slices.Contains(got, loose.ID) || !slices.Contains(got, head.ID) {
		t.Fatalf("expiry hook called for %v, want %s and %s", got, loose.ID, head.ID)
	}
}

// waitReleased waits, up to a watchdog, for checkpoint id to be released.
func waitReleased(t *testing.T, b *bundle, id string, watchdog time.Duration) {
	t.Helper()
	deadline := time.Now().Add(watchdog)
	for {
		if _, err := b.rt.Checkpoint(id); errors.Is(err, sandbox.ErrNotFound) {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("checkpoint %s outlived its TTL by far", id)
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// The writable layer holds at most its inode limit of entries: the next
// file fails with ENOSPC while bytes are left.
func TestLayerInodeLimit(t *testing.T) {
	b := setup(t)
	s := b.create(t, sandbox.Spec{Limits: sandbox.Limits{Inodes: 100}})
	res, err := s.Exec(t.Context(), sandbox.ExecRequest{Command: "mkdir /d && i=0; while touch /d/$i 2>/tmp/err; do i=$((i+1)); [ $i -ge 1000 ] && break; done; echo $i; cat /tmp/err"})
	must(t, err)
	out := strings.SplitN(string(res.Stdout), "\n", 2)
	made, _ := strconv.Atoi(out[0])
	if made < 90 || made >= 100 || !strings.Contains(out[1], "No space left") {
		t.Fatalf("a layer limited to 100 inodes took %d files before: %q", made, out[1])
	}
	// Its checkpoint takes no inode of the sandbox's: it is taken, and holds every file.
	info, err := s.CheckpointWith(t.Context(), sandbox.CheckpointOptions{})
	if err != nil {
		t.Fatalf("checkpointing a sandbox that used all its inodes: %v", err)
	}
	must(t, s.Restore(t.Context(), info.ID))
	res, err = s.Exec(t.Context(), sandbox.ExecRequest{Command: "ls /d | wc -l"})
	must(t, err)
	if got, _ := strconv.Atoi(strings.TrimSpace(string(res.Stdout))); got != made {
		t.Fatalf("the checkpoint of a full layer holds %d files, want %d", got, made)
	}
	// The default: one inode per 8 KiB of the layer's size.
	d := b.create(t, sandbox.Spec{Limits: sandbox.Limits{DiskBytes: 8 << 20}})
	res, err = d.Exec(t.Context(), sandbox.ExecRequest{Command: "mkdir /d && i=0; while touch /d/$i 2>/dev/null; do i=$((i+1)); [ $i -ge 10000 ] && break; done; echo $i"})
	must(t, err)
	if made, _ := strconv.Atoi(strings.TrimSpace(string(res.Stdout))); made < 4000 || made >= 4096 {
		t.Fatalf("an 8 MiB layer took %d files; its default limit is 4096 inodes", made)
	}
}

// Every sandbox's group has the runtime's CPU weight, and the runtime's
// group a memory cap that still holds the pages of the layers a closed
// sandbox wrote.
func TestCPUWeightAndMemoryCap(t *testing.T) {
	b := setup(t, func(c *sandbox.Config) { c.CPUWeight = 50; c.MemoryBytes = 3 << 30 })
	s := b.create(t, sandbox.Spec{})
	shares, err := os.ReadFile(filepath.Join("/sys/fs/cgroup/cpu", b.cfg.CgroupRoot, s.ID(), "cpu.shares"))
	must(t, err)
	if got := strings.TrimSpace(string(shares)); got != "512" {
		t.Fatalf("cpu.shares of a sandbox of CPU weight 50: %s, want 512", got)
	}
	base := filepath.Join("/sys/fs/cgroup/memory", b.cfg.CgroupRoot)
	limit, err := os.ReadFile(filepath.Join(base, "memory.limit_in_bytes"))
	must(t, err)
	if got := strings.TrimSpace(string(limit)); got != strconv.Itoa(3<<30) {
		t.Fatalf("memory cap of the runtime's group: %s, want %d", got, 3<<30)
	}
	usage := func() int64 {
		b, err := os.ReadFile(filepath.Join(base, "memory.usage_in_bytes"))
		must(t, err)
		n, err := strconv.ParseInt(strings.TrimSpace(string(b)), 10, 64)
		must(t, err)
		return n
	}
	before := usage()
	sh(t, s, "dd if=/dev/urandom of=/big bs=1M count=32 2>/dev/null")
	ck, err := s.Checkpoint(t.Context())
	must(t, err)
	must(t, s.Destroy(t.Context()))
	if after := usage(); after-before < 30<<20 {
		t.Fatalf("the runtime's group holds %d bytes more after a closed sandbox left a 32 MiB layer", after-before)
	}
	must(t, b.rt.ReleaseCheckpoint(ck.ID))
}

// warmReports makes the runtime's warm pool report each pass that filled
// it as far as its target and the caps allow.
func warmReports(b *bundle) <-chan int {
	ch := make(chan int, 64)
	b.rt.OnWarm(func(ready int) {
		select {
		case ch <- ready:
		default:
		}
	})
	return ch
}

// waitPool waits until the warm pool reports holding n inits.
func waitPool(t *testing.T, b *bundle, reports <-chan int, n int) {
	t.Helper()
	watchdog := time.After(2 * time.Minute)
	for b.rt.WarmInits() != n {
		select {
		case <-reports:
		case <-watchdog:
			t.Fatalf("the warm pool holds %d inits, not %d", b.rt.WarmInits(), n)
		}
	}
}

// The warm pool grows only in the room the caps leave, and gives its
// descriptors back to a request the caps would otherwise refuse.
func TestWarmPoolWithinCaps(t *testing.T) {
	t.Run("sandboxes", func(t *testing.T) {
		b := setup(t, func(c *sandbox.Config) { c.Caps.Sandboxes = 4 })
		reports := warmReports(b)
		s := b.create(t, sandbox.Spec{})
		ck, err := s.CheckpointWith(t.Context(), sandbox.CheckpointOptions{Processes: sandbox.ProcessesNone})
		must(t, err)
		kids, err := b.rt.Fork(t.Context(), ck.ID, 3, sandbox.Spec{})
		must(t, err)
		if w := b.rt.WarmWanted(); w != 3 {
			t.Fatalf("after a Fork of 3 the pool's target is %d", w)
		}
		for _, k := range kids {
			must(t, k.Destroy(t.Context()))
		}
		waitPool(t, b, reports, 3) // one live sandbox and three inits: the cap
		kid, err := b.rt.Create(t.Context(), sandbox.Spec{Checkpoint: ck.ID})
		must(t, err)
		// Two live sandboxes leave room for two inits: a pass of the pool
		// after the Create leaves it at that.
		for len(reports) > 0 {
			<-reports
		}
		b.rt.KickWarm()
		select {
		case got := <-reports:
			if got != 2 {
				t.Fatalf("the pool holds %d inits beside 2 sandboxes under a cap of 4, want 2", got)
			}
		case <-time.After(2 * time.Minute):
			t.Fatal("the pool made no pass after a kick")
		}
		must(t, kid.Destroy(t.Context()))
	})
	t.Run("descriptors", func(t *testing.T) {
		b := setup(t, func(c *sandbox.Config) { c.Caps.Descriptors = -1 })
		reports := warmReports(b)
		s := b.create(t, sandbox.Spec{})
		ck, err := s.CheckpointWith(t.Context(), sandbox.CheckpointOptions{Processes: sandbox.ProcessesNone})
		must(t, err)
		kids, err := b.rt.Fork(t.Context(), ck.ID, 8, sandbox.Spec{})
		must(t, err)
		for _, k := range kids {
			must(t, k.Destroy(t.Context()))
		}
		waitPool(t, b, reports, 8)
		// Room for the descriptors of two sandboxes made from scratch
		// beside the hot set's charge, less one: a Fork of 3 fits only
		// with the pool's inits counted in, and the pool freeing some.
		b.rt.SetCaps(sandbox.Caps{Descriptors: b.rt.CountFDs() + b.rt.HotFDs() + 2*sandbox.FDsPerSandbox - 1})
		kids, err = b.rt.Fork(t.Context(), ck.ID, 3, sandbox.Spec{})
		if err != nil {
			t.Fatalf("a Fork of 3 the pool could make room for: %v", err)
		}
		for _, k := range kids {
			must(t, k.Destroy(t.Context()))
		}
	})
}
