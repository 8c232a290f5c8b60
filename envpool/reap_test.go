package envpool_test

import (
	"context"
	"testing"
	"time"

	"github.com/deltagym/deltagym/envpool"
	"github.com/deltagym/deltagym/internal/locate"
	"github.com/deltagym/deltagym/sandbox"
)

// Leases are reaped within 2 s of their expiry, on the system clock, while other sandboxes run
// commands back to back and while the sandboxes reaped hold process checkpoints (whose
// templates are saved as CRIU images as the sandboxes are torn down, a second or so each).
func TestLeasesReapedOnTime(t *testing.T) {
	h := openRuntime(t)(t)
	if _, err := locate.CRIU(); err != nil {
		t.Skipf("criu is not installed (make criu): %v", err)
	}
	const (
		ttl      = time.Second
		late     = 2 * time.Second
		expiring = 3
		busy     = 2
		ckpts    = 3 // process checkpoints per expiring sandbox
	)
	type reaped struct {
		id     string
		reason string
		at     time.Time
	}
	ends := make(chan reaped, expiring+busy)
	s := spec("e", h.image)
	s.PoolSize = expiring + busy
	cfg := envpool.Config{LeaseTTL: ttl, OnEnd: func(l *envpool.Lease, reason string) {
		ends <- reaped{l.ID(), reason, time.Now()}
	}}
	h.config(&cfg)
	m, err := envpool.New(cfg, nil)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), watchdog)
		defer cancel()
		if err := m.Close(ctx); err != nil {
			t.Errorf("closing the manager: %v", err)
		}
	})
	if _, err := m.Register(s, false); err != nil {
		t.Fatal(err)
	}
	env, err := m.Env("e")
	if err != nil {
		t.Fatal(err)
	}
	acquire := func() *envpool.Lease {
		ctx, cancel := context.WithTimeout(t.Context(), watchdog)
		defer cancel()
		l, err := m.Acquire(ctx, env)
		if err != nil {
			t.Fatal(err)
		}
		return l
	}
	// Busy sandboxes: commands back to back until the test ends, which keeps their leases.
	stop := make(chan struct{})
	busyDone := make(chan error, busy)
	for range busy {
		l := acquire()
		go func() {
			for {
				select {
				case <-stop:
					busyDone <- nil
					return
				default:
				}
				ctx, end, err := l.Begin(context.Background())
				if err != nil {
					busyDone <- err
					return
				}
				_, err = l.Box().Exec(ctx, sandbox.ExecRequest{Command: "i=0; while [ $i -lt 20000 ]; do i=$((i+1)); done"})
				end()
				if err != nil {
					busyDone <- err
					return
				}
			}
		}()
	}
	defer func() {
		close(stop)
		for range busy {
			if err := <-busyDone; err != nil {
				t.Errorf("busy sandbox: %v", err)
			}
		}
	}()
	// Sandboxes left to expire, each with a process and checkpoints of it.
	want := map[string]time.Time{}
	for range expiring {
		l := acquire()
		ctx, end, err := l.Begin(t.Context())
		if err != nil {
			t.Fatal(err)
		}
		if _, err := l.Box().Exec(ctx, sandbox.ExecRequest{Command: "sleep 1000", Background: true}); err != nil {
			t.Fatal(err)
		}
		for range ckpts {
			ck, err := l.Box().CheckpointWith(ctx, sandbox.CheckpointOptions{})
			if err != nil {
				t.Fatal(err)
			}
			if len(ck.Processes) != 1 {
				t.Fatalf("checkpoint holds %+v", ck.Processes)
			}
		}
		end() // renews the lease: it expires one TTL from now
		want[l.ID()] = l.Expires()
	}
	watchdogT := time.NewTimer(watchdog)
	defer watchdogT.Stop()
	for len(want) > 0 {
		select {
		case e := <-ends:
			exp, ok := want[e.id]
			if !ok {
				t.Fatalf("lease %s ended (%s): not one left to expire", e.id, e.reason)
			}
			delete(want, e.id)
			if e.reason != envpool.EndExpired {
				t.Errorf("lease %s ended: %s", e.id, e.reason)
			}
			d := e.at.Sub(exp)
			if d > late {
				t.Errorf("lease %s reaped %v after it expired (at most %v)", e.id, d, late)
			}
			t.Logf("lease %s reaped %v after it expired", e.id, d.Round(time.Millisecond))
		case <-watchdogT.C:
			t.Fatalf("leases not reaped: %v", want)
		}
	}
}
