package sandbox

import (
	"strings"
	"testing"
	"time"
)

// The caps derived from a host are bounded by its scarcest resource, and
// the warnings name the setting that holds caps set by hand.
func TestHostCaps(t *testing.T) {
	const gib = int64(1) << 30
	small := Host{NoFile: 20000, PidMax: 32768, MountMax: 100000, Mounts: 100, MemoryBytes: 24 * gib}
	d := HostCaps(small)
	// 20,000 descriptors leave room for 10,000 idle sandboxes beside the
	// hot set: memory bounds them.
	if d.Descriptors != 20000-descriptorReserve || d.HotSandboxes != d.Descriptors/4/fdsPerHotSandbox ||
		d.Sandboxes != int(21*gib/memPerSandbox) || d.Why != "memory" || d.Sandboxes < 10000 {
		t.Fatalf("caps of a host with 20,000 descriptors: %+v", d)
	}
	few := small
	few.NoFile = 4096
	if d := HostCaps(few); d.Descriptors != 3072 || d.HotSandboxes != 48 ||
		d.Sandboxes != (3072-48*fdsPerHotSandbox)/fdsPerSandbox || d.Why != "descriptors" {
		t.Fatalf("caps of a host with 4,096 descriptors: %+v", d)
	}
	if n := hotSandboxes(0, 1000); n != minHotSandboxes {
		t.Fatalf("hot set under a cap of 1,000 descriptors: %d", n)
	}
	if n := hotSandboxes(-1, 1000); n != 0 {
		t.Fatalf("hot set configured unbounded: %d", n)
	}
	if d.Mounts != 100000-100-mountReserve || d.Checkpoints != d.Mounts/2 {
		t.Fatalf("mount and checkpoint caps: %+v", d)
	}
	if d.CheckpointBytes != 12*gib || d.MemoryBytes != 21*gib {
		t.Fatalf("checkpoint bytes %d, memory %d", d.CheckpointBytes, d.MemoryBytes)
	}
	big := small
	big.NoFile = 1 << 20
	if d := HostCaps(big); d.Sandboxes != int(21*gib/memPerSandbox) || d.Why != "memory" || d.Sandboxes < 10000 {
		t.Fatalf("caps of a host with a million descriptors: %+v", d)
	}
	if w := HostWarnings(small, Caps{Sandboxes: 20000}); len(w) != 2 ||
		!strings.Contains(w[0], "kernel.pid_max") || !strings.Contains(w[1], "RLIMIT_NOFILE") {
		t.Fatalf("warnings for 20,000 sandboxes on a small host: %q", w)
	}
	if w := HostWarnings(small, Caps{Mounts: 200000}); len(w) != 1 || !strings.Contains(w[0], "fs.mount-max") {
		t.Fatalf("warnings for 200,000 mounts: %q", w)
	}
	if w := HostWarnings(small, d.Caps); len(w) != 0 {
		t.Fatalf("derived caps warn: %q", w)
	}
	c := Caps{Sandboxes: -1, Checkpoints: 5}.withHost(d)
	if c.Sandboxes != 0 || c.Checkpoints != 5 || c.Descriptors != d.Descriptors || c.Mounts != d.Mounts {
		t.Fatalf("caps -1 (none), 5 and derived: %+v", c)
	}
}

// The pool's target is the largest fan-out asked for, and halves, down to
// warmFloor, for every warmDecay in which no fan-out asked for it.
func TestWarmTargetDecays(t *testing.T) {
	r := &Runtime{cfg: Config{InitPool: maxFork}}
	r.wantWarm(1000)
	r.wantWarm(10) // a smaller fan-out neither lowers the target nor restarts its decay
	t0 := r.warm.asked
	for _, c := range []struct {
		after time.Duration
		want  int
	}{
		{0, 1000},
		{warmDecay - time.Second, 1000},
		{warmDecay, 500},
		{3 * warmDecay, 125},
		{10 * warmDecay, warmFloor},
	} {
		if got := r.warmWanted(t0.Add(c.after)); got != c.want {
			t.Fatalf("%v after a Fork of 1000: target %d, want %d", c.after, got, c.want)
		}
	}
	r.wantWarm(2000) // beyond Config.InitPool
	if got := r.warmWanted(time.Now()); got != maxFork {
		t.Fatalf("a Fork beyond InitPool sets the target to %d, want %d", got, maxFork)
	}
}
