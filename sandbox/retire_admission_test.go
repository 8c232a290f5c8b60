package sandbox_test

import (
	"strings"
	"testing"
	"time"

	"github.com/deltagym/deltagym/sandbox"
)

// closeRetiring closes n new sandboxes whose teardown cannot start (the
// runtime's teardown slots are held until release) and returns them.
func closeRetiring(t *testing.T, b *bundle, n int) []*sandbox.Sandbox {
	t.Helper()
	var out []*sandbox.Sandbox
	for range n {
		s := b.create(t, sandbox.Spec{})
		sh(t, s, "echo hi > /tmp/x; cat /tmp/x")
		must(t, s.Close(t.Context()))
		out = append(out, s)
	}
	if got := b.rt.Retiring(); got != n {
		t.Fatalf("%d sandboxes retiring, want %d", got, n)
	}
	return out
}

// waitTornDown waits for the teardown of closed sandboxes.
func waitTornDown(t *testing.T, sbs []*sandbox.Sandbox) {
	t.Helper()
	watchdog := time.NewTimer(2 * time.Minute)
	defer watchdog.Stop()
	for _, s := range sbs {
		select {
		case <-s.Done():
		case <-watchdog.C:
			t.Fatal("closed sandboxes not torn down after 2 minutes")
		}
	}
}

// A closed sandbox counts against the caps, with what it holds, until its
// teardown is over: closing sandboxes faster than they are torn down holds
// no more than the caps allow, and the refusal says how many in use are
// retiring.
func TestRetiringCountsAgainstCaps(t *testing.T) {
	t.Run("sandboxes", func(t *testing.T) {
		b := capsBundle(t, sandbox.Caps{Sandboxes: 2})
		release := b.rt.HoldRetirement()
		t.Cleanup(release)
		sbs := closeRetiring(t, b, 2)
		before := countNow(t, b)
		_, err := b.rt.Create(t.Context(), sandbox.Spec{Image: "busybox"})
		refused(t, b, err, sandbox.CapSandboxes, 2, before)
		if !strings.Contains(err.Error(), "; 2 closed sandboxes, not yet torn down, count among those in use") {
			t.Fatalf("refusal %q does not count the retiring sandboxes", err)
		}
		release()
		waitTornDown(t, sbs)
		b.create(t, sandbox.Spec{})
	})
	t.Run("mounts", func(t *testing.T) {
		b := capsBundle(t, sandbox.Caps{Mounts: -1})
		release := b.rt.HoldRetirement()
		t.Cleanup(release)
		sbs := closeRetiring(t, b, 2)
		limit := b.rt.LayerMounts() + 1 // less than a sandbox takes
		b.rt.SetCaps(sandbox.Caps{Mounts: limit})
		before := countNow(t, b)
		_, err := b.rt.Create(t.Context(), sandbox.Spec{Image: "busybox"})
		refused(t, b, err, sandbox.CapMounts, int64(limit), before)
		release()
		waitTornDown(t, sbs)
		b.create(t, sandbox.Spec{}) // the retired sandboxes' mounts are free
	})
	t.Run("descriptors", func(t *testing.T) {
		b := capsBundle(t, sandbox.Caps{Descriptors: -1})
		release := b.rt.HoldRetirement()
		t.Cleanup(release)
		sbs := closeRetiring(t, b, 2)
		limit := b.rt.CountFDs() + 1 // less than a sandbox takes
		b.rt.SetCaps(sandbox.Caps{Descriptors: limit})
		before := countNow(t, b)
		_, err := b.rt.Create(t.Context(), sandbox.Spec{Image: "busybox"})
		refused(t, b, err, sandbox.CapDescriptors, int64(limit), before)
		release()
		waitTornDown(t, sbs)
		if n := b.rt.CountFDs(); n >= limit-1 {
			t.Fatalf("%d descriptors once the closed sandboxes are torn down, %d while they were retiring", n, limit-1)
		}
	})
}
