package clustertest

import (
	"context"
	"maps"
	"math"
	"testing"
	"time"

	deltagym "github.com/deltagym/deltagym/clients/go/deltagym"
	"github.com/deltagym/deltagym/internal/benchq"
)

// BenchmarkClusterRoutedCall makes each call once through a plain Client of node-2 and once
// through the Cluster (Cluster.Sandbox: the node the ID names, then its Client), on one sandbox
// of node-2, across the bridge: p50/p99 of each.
func BenchmarkClusterRoutedCall(b *testing.B) {
	c := startCluster(b, 3)
	ctx := b.Context()
	n2 := c.nodes[1]
	sb := resetOn(b, c.cl, n2.name)
	if err := sb.KeepAlive(0); err != nil {
		b.Fatal(err)
	}
	direct := c.direct(b, n2)
	id, start := sb.ID(), sb.StartCheckpointID()
	for _, call := range []struct {
		name string
		do   func(*deltagym.Sandbox) error
	}{
		{"GetSandbox", func(s *deltagym.Sandbox) error {
			_, err := s.Info(ctx)
			return err
		}},
		{"Exec-true", func(s *deltagym.Sandbox) error {
			res, err := s.Exec(ctx, "true")
			if err == nil && res.Truncated { // the env's step budget: a new episode
				_, err = s.Restore(ctx, start)
			}
			return err
		}},
	} {
		b.Run(call.name, func(b *testing.B) {
			var d, r []time.Duration
			for b.Loop() {
				t0 := time.Now()
				if err := call.do(direct.Sandbox(id)); err != nil {
					b.Fatal(err)
				}
				t1 := time.Now()
				h, err := c.cl.Sandbox(id)
				if err == nil {
					err = call.do(h)
				}
				if err != nil {
					b.Fatal(err)
				}
				d, r = append(d, t1.Sub(t0)), append(r, time.Since(t1))
			}
			benchq.Report(b, d, "direct-")
			benchq.Report(b, r, "routed-")
		})
	}
}

// BenchmarkClusterRefresh times Cluster.Refresh over three nodes: the DNS lookup of the target,
// then every node's GetNode, in parallel.
func BenchmarkClusterRefresh(b *testing.B) {
	c := startCluster(b, 3)
	var d []time.Duration
	for b.Loop() {
		t0 := time.Now()
		if err := c.cl.Refresh(b.Context()); err != nil {
			b.Fatal(err)
		}
		d = append(d, time.Since(t0))
	}
	benchq.Report(b, d, "")
	for _, st := range c.cl.Nodes() {
		if st.Err != nil {
			b.Fatalf("%s after the refreshes: %v", st.Name, st.Err)
		}
	}
}

// BenchmarkClusterPlacement forks 64 children of one checkpoint of node-2 through the Cluster,
// which spreads them over the nodes by load: "equal", the three nodes holding only their warm
// pools, where each must get 64/3 ± 10%; "preloaded", node-1 holding 30 more sandboxes, each
// running a process. It reports where the children landed (the last round's) and the fork's
// p50/p99. Each round's children are closed, and the next waits until every node reports its
// count from before.
func BenchmarkClusterPlacement(b *testing.B) {
	c := startCluster(b, 3)
	ctx := b.Context()
	src := resetOn(b, c.cl, c.nodes[1].name)
	execOut(b, src, "seq 1 1000 > /work/seq")
	ck, err := src.Checkpoint(ctx)
	if err != nil {
		b.Fatal(err)
	}
	const n = 64
	for _, preload := range []int{0, 30} {
		name := "equal"
		if preload > 0 {
			name = "preloaded"
		}
		b.Run(name, func(b *testing.B) {
			for range preload {
				sb := resetOn(b, c.cl, c.nodes[0].name)
				if _, err := sb.Exec(ctx, "sleep 3600", deltagym.InBackground()); err != nil {
					b.Fatal(err)
				}
			}
			base := settled(b, c, nil)
			var d []time.Duration
			var landed map[string]int
			for b.Loop() {
				if err := c.cl.Refresh(ctx); err != nil {
					b.Fatal(err)
				}
				t0 := time.Now()
				fr, err := c.cl.Fork(ctx, ck.ID, n)
				d = append(d, time.Since(t0))
				if err != nil {
					b.Fatal(err)
				}
				landed = map[string]int{}
				for _, kid := range fr.Sandboxes {
					landed[deltagym.NodeOf(kid.ID())]++
				}
				closeAll(ctx, fr.Sandboxes)
				settled(b, c, base)
			}
			benchq.Report(b, d, "fork64-")
			for _, nd := range c.nodes {
				b.ReportMetric(float64(landed[nd.name]), nd.name+"-children")
			}
			if preload == 0 {
				for _, nd := range c.nodes {
					if got := float64(landed[nd.name]); math.Abs(got-n/3.0) > 0.1*n/3.0 {
						b.Fatalf("a fork of %d over three equal nodes: %v, want %.1f ± 10%% each", n, landed, n/3.0)
					}
				}
			} else if landed[c.nodes[0].name] >= landed[c.nodes[1].name] || landed[c.nodes[0].name] >= landed[c.nodes[2].name] {
				b.Fatalf("a fork of %d with %s holding %d more: %v, want the fewest there", n, c.nodes[0].name, preload, landed)
			}
		})
	}
}

// closeAll closes sandboxes in parallel.
func closeAll(ctx context.Context, sbs []*deltagym.Sandbox) {
	done := make(chan struct{}, len(sbs))
	for _, sb := range sbs {
		go func() {
			_ = sb.Close(ctx)
			done <- struct{}{}
		}()
	}
	for range sbs {
		<-done
	}
}

// settled refreshes the cluster until every node reports the sandbox count it has in base, and
// returns the counts; with base nil, until two refreshes running report the same counts. It
// fails b after a minute.
func settled(b *testing.B, c *cluster, base map[string]int32) map[string]int32 {
	b.Helper()
	tick := time.NewTicker(100 * time.Millisecond)
	defer tick.Stop()
	deadline := time.NewTimer(time.Minute)
	defer deadline.Stop()
	var last map[string]int32
	for {
		if err := c.cl.Refresh(b.Context()); err != nil {
			b.Fatal(err)
		}
		now := map[string]int32{}
		for _, st := range c.cl.Nodes() {
			now[st.Name] = st.Report.GetSandboxes()
		}
		want := base
		if want == nil {
			want = last
		}
		if want != nil && maps.Equal(now, want) {
			return now
		}
		last = now
		select {
		case <-tick.C:
		case <-deadline.C:
			b.Fatalf("the nodes' sandbox counts did not settle in a minute: %v, want %v", now, want)
		}
	}
}
