package envpool_test

import (
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"sync"
	"testing"
	"time"

	"github.com/deltagym/deltagym/envpool"
	deltagymv1 "github.com/deltagym/deltagym/clients/go/gen/deltagym/v1"
	"github.com/deltagym/deltagym/sandbox"
	"github.com/deltagym/deltagym/sandbox/image/imagetest"
)

func newRuntime(t *testing.T) *sandbox.Runtime {
	t.Helper()
	if os.Geteuid() != 0 {
		t.Skip("needs root: sandboxes use namespaces, mounts and cgroups")
	}
	init := os.Getenv("DELTAGYM_INIT")
	if init == "" {
		init, _ = filepath.Abs("../bin/dg-init")
	}
	if _, err := os.Stat(init); err != nil {
		t.Skip("needs bin/dg-init (make init) or DELTAGYM_INIT")
	}
	data, err := os.MkdirTemp("", "dgpool")
	if err != nil {
		t.Fatal(err)
	}
	cg := "dgpooltest" + filepath.Base(data)
	rt, err := sandbox.New(t.Context(), sandbox.Config{DataDir: data, InitBinary: init, CgroupRoot: cg})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		if err := rt.Close(context.Background()); err != nil {
			t.Errorf("closing runtime: %v", err)
		}
		if err := sandbox.Purge(data); err != nil { // unmounts its layers
			t.Errorf("purging runtime data: %v", err)
		}
		a, _ := filepath.Glob("/sys/fs/cgroup/*/" + cg)
		for _, p := range a {
			_ = os.Remove(p) // the runtime's empty cgroup parent
		}
	})
	if _, err := rt.ImportImage(t.Context(), "bb", imagetest.Busybox(t)); err != nil {
		t.Fatal(err)
	}
	return rt
}

// TestManager: setup runs once, the pool fills to its size, a burst past it waits for refills,
// leases expire, and Close (twice) frees everything.
func TestManager(t *testing.T) {
	rt := newRuntime(t)
	var (
		kindsMu sync.Mutex // OnCheckpoint runs on a pool goroutine
		kinds   []envpool.CheckpointKind
	)
	ended := make(chan string, 16)
	var m *envpool.Manager
	m, err := envpool.New(envpool.Config{Runtime: rt, LeaseTTL: 200 * time.Millisecond, AcquireTimeout: 20 * time.Second,
		OnCheckpoint: func(env string, kind envpool.CheckpointKind, info sandbox.CheckpointInfo) {
			kindsMu.Lock()
			kinds = append(kinds, kind)
			kindsMu.Unlock()
		},
		OnEnd: func(l *envpool.Lease, reason string) {
			// A reaped lease is still listed while OnEnd runs (a client sees it until its
			// end is recorded), and no call starts on it.
			if reason != envpool.EndShutdown {
				if _, err := m.Lease(l.ID()); err != nil {
					reason += fmt.Sprintf(" (during OnEnd, not listed: %v)", err)
				}
				if _, end, err := l.Begin(context.Background()); !errors.Is(err, envpool.ErrLeaseEnded) {
					reason += fmt.Sprintf(" (during OnEnd, Begin: %v)", err)
					if end != nil {
						end()
					}
				}
			}
			ended <- reason
		},
	}, []*deltagymv1.EnvSpec{{Name: "e", Image: "bb", Setup: []string{"echo once >> /tmp/setup"}, PoolSize: 2}})
	if err != nil {
		t.Fatal(err)
	}
	env, err := m.Env("e")
	if err != nil {
		t.Fatal(err)
	}
	acquire := func() *envpool.Lease {
		t.Helper()
		l, err := m.Acquire(t.Context(), env)
		if err != nil {
			t.Fatal(err)
		}
		return l
	}
	// Use the first lease at once: its TTL runs from Acquire, and the burst below forks its
	// sandboxes one at a time, which on a loaded machine can outlast the TTL. Between Acquire
	// and Begin (which renews the lease) there is no I/O, so 200ms is ample.
	leases := []*envpool.Lease{acquire()}
	ctx, end, err := leases[0].Begin(t.Context())
	if err != nil {
		t.Fatal(err)
	}
	res, err := leases[0].Sandbox().Exec(ctx, sandbox.ExecRequest{Command: "cat /tmp/setup"})
	end()
	if err != nil || string(res.Stdout) != "once\n" {
		t.Fatalf("setup state %q %v", res.Stdout, err)
	}
	for range 4 { // five in all, more than the pool holds
		leases = append(leases, acquire())
	}
	kindsMu.Lock()
	got := slices.Clone(kinds)
	kindsMu.Unlock()
	if len(got) != 1 || got[0] != envpool.KindPool {
		t.Fatalf("checkpoints taken: %v, want one pool checkpoint", got)
	}
	// No call renews them: all five are reaped.
	for range 5 {
		select {
		case r := <-ended:
			if r != "lease expired" {
				t.Fatalf("ended: %s", r)
			}
		case <-time.After(10 * time.Second):
			t.Fatal("leases not reaped")
		}
	}
	if _, err := m.Lease(leases[0].ID()); !errors.Is(err, envpool.ErrUnknownSandbox) {
		t.Fatalf("reaped lease lookup: %v", err)
	}
	if _, err := leases[0].Sandbox().Exec(t.Context(), sandbox.ExecRequest{Command: "true"}); err == nil {
		t.Fatal("reaped sandbox still runs commands")
	}
	must := func(err error) {
		t.Helper()
		if err != nil {
			t.Fatal(err)
		}
	}
	_, err = m.Acquire(t.Context(), env)
	must(err)
	must(m.Close(t.Context()))
	must(m.Close(t.Context()))
	if n := rt.Sandboxes(); n != 0 {
		t.Fatalf("%d sandboxes left after Close", n)
	}
	if _, err := m.Acquire(t.Context(), env); err == nil {
		t.Fatal("acquire after Close succeeded")
	}
}
