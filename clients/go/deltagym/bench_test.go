package deltagym_test

import (
	"slices"
	"testing"
	"time"

	deltagym "github.com/deltagym/deltagym/clients/go/deltagym"
)

// reportLatency reports the p50 and p99 of the samples.
func reportLatency(b *testing.B, samples []time.Duration) {
	if len(samples) == 0 {
		return
	}
	slices.Sort(samples)
	q := func(p float64) float64 {
		return float64(samples[min(len(samples)-1, int(p*float64(len(samples))))].Microseconds()) / 1e3
	}
	b.ReportMetric(q(0.50), "p50-ms")
	b.ReportMetric(q(0.99), "p99-ms")
}

// BenchmarkExecTrue times Exec("true") through the client, over loopback, per
// protocol: client-observed latency of one step.
func BenchmarkExecTrue(b *testing.B) {
	if testAddr == "" {
		b.Skipf("needs the test server: %s", skipReason)
	}
	for _, p := range protocols {
		b.Run(p.name, func(b *testing.B) {
			c, err := deltagym.Dial(testAddr, p.opts...)
			if err != nil {
				b.Fatal(err)
			}
			defer c.Close()
			sb, err := c.Reset(b.Context(), "shell")
			if err != nil {
				b.Fatal(err)
			}
			defer sb.Close(b.Context())
			if err := sb.KeepAlive(0); err != nil {
				b.Fatal(err)
			}
			start := sb.StartCheckpointID()
			samples := make([]time.Duration, 0, b.N)
			for b.Loop() {
				t0 := time.Now()
				res, err := sb.Exec(b.Context(), "true")
				if err != nil {
					b.Fatal(err)
				}
				samples = append(samples, time.Since(t0))
				if res.Truncated { // the env's step budget: start a new episode (not timed)
					if _, err := sb.Restore(b.Context(), start); err != nil {
						b.Fatal(err)
					}
				}
			}
			reportLatency(b, samples)
		})
	}
}

// BenchmarkRestore times Restore of a sandbox to a checkpoint through the
// client.
func BenchmarkRestore(b *testing.B) {
	if testAddr == "" {
		b.Skipf("needs the test server: %s", skipReason)
	}
	c, err := deltagym.Dial(testAddr)
	if err != nil {
		b.Fatal(err)
	}
	defer c.Close()
	sb, err := c.Reset(b.Context(), "shell")
	if err != nil {
		b.Fatal(err)
	}
	defer sb.Close(b.Context())
	if err := sb.KeepAlive(0); err != nil {
		b.Fatal(err)
	}
	ck, err := sb.Checkpoint(b.Context())
	if err != nil {
		b.Fatal(err)
	}
	samples := make([]time.Duration, 0, b.N)
	for b.Loop() {
		t0 := time.Now()
		if _, err := sb.Restore(b.Context(), ck.ID); err != nil {
			b.Fatal(err)
		}
		samples = append(samples, time.Since(t0))
	}
	reportLatency(b, samples)
}

// BenchmarkRoutedCall times a call on a sandbox through a Cluster, which finds the node its ID
// names and watches the call, against the same call through a plain Client of the same server:
// what routing adds to a call. Each iteration makes one call each way, so that both see the
// same machine; the p50 and p99 of each are reported in microseconds.
func BenchmarkRoutedCall(b *testing.B) {
	if testAddr == "" {
		b.Skipf("needs the test server: %s", skipReason)
	}
	c, err := deltagym.Dial(testAddr)
	if err != nil {
		b.Fatal(err)
	}
	defer c.Close()
	cl, err := deltagym.DialCluster(b.Context(), testAddr)
	if err != nil {
		b.Fatal(err)
	}
	defer cl.Close()
	sb, err := cl.Reset(b.Context(), "shell")
	if err != nil {
		b.Fatal(err)
	}
	defer sb.Close(b.Context())
	if err := sb.KeepAlive(0); err != nil {
		b.Fatal(err)
	}
	id, start := sb.ID(), sb.StartCheckpointID()
	for _, call := range []struct {
		name string
		do   func(*deltagym.Sandbox) error
	}{
		{"GetSandbox", func(s *deltagym.Sandbox) error {
			_, err := s.Info(b.Context())
			return err
		}},
		{"Exec-true", func(s *deltagym.Sandbox) error {
			res, err := s.Exec(b.Context(), "true")
			if err == nil && res.Truncated { // the env's step budget: a new episode
				_, err = s.Restore(b.Context(), start)
			}
			return err
		}},
	} {
		b.Run(call.name, func(b *testing.B) {
			direct := make([]time.Duration, 0, b.N)
			routed := make([]time.Duration, 0, b.N)
			for b.Loop() {
				t0 := time.Now()
				if err := call.do(c.Sandbox(id)); err != nil {
					b.Fatal(err)
				}
				t1 := time.Now()
				h, err := cl.Sandbox(id)
				if err == nil {
					err = call.do(h)
				}
				if err != nil {
					b.Fatal(err)
				}
				direct, routed = append(direct, t1.Sub(t0)), append(routed, time.Since(t1))
			}
			for _, s := range []struct {
				name    string
				samples []time.Duration
			}{{"direct", direct}, {"routed", routed}} {
				slices.Sort(s.samples)
				q := func(p float64) float64 {
					return float64(s.samples[min(len(s.samples)-1, int(p*float64(len(s.samples))))].Nanoseconds()) / 1e3
				}
				b.ReportMetric(q(0.50), s.name+"-p50-us")
				b.ReportMetric(q(0.99), s.name+"-p99-us")
			}
		})
	}
}
