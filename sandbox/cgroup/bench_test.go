package cgroup

import (
	"fmt"
	"os/exec"
	"testing"
	"time"

	"github.com/deltagym/deltagym/internal/benchq"
)

// latencies records per-operation times and reports their p50, p99 and maximum.
type latencies []time.Duration

func (l latencies) report(b *testing.B) {
	if len(l) == 0 {
		return
	}
	benchq.Report(b, l, "")
}

func benchLimits(m *Manager) Limits {
	if !m.hasLimits() {
		return Limits{}
	}
	return Limits{MemoryBytes: 256 << 20, Pids: 100, CPUQuota: 1}
}

// BenchmarkCreateDelete measures a sandbox group's life with limits set.
func BenchmarkCreateDelete(b *testing.B) {
	for _, mode := range layouts(b) {
		b.Run(mode.String(), func(b *testing.B) {
			m := newManager(b, mode)
			lim := benchLimits(m)
			lat := make(latencies, 0, b.N)
			for i := 0; b.Loop(); i++ {
				t0 := time.Now()
				c, err := m.Create(fmt.Sprintf("b%d", i), lim)
				if err != nil {
					b.Fatal(err)
				}
				if err := c.Delete(); err != nil {
					b.Fatal(err)
				}
				lat = append(lat, time.Since(t0))
			}
			lat.report(b)
		})
	}
}

// BenchmarkSubCreateDelete measures the per-exec sub-group's life.
func BenchmarkSubCreateDelete(b *testing.B) {
	for _, mode := range layouts(b) {
		b.Run(mode.String(), func(b *testing.B) {
			m := newManager(b, mode)
			c := create(b, m, "top", benchLimits(m))
			lat := make(latencies, 0, b.N)
			for i := 0; b.Loop(); i++ {
				t0 := time.Now()
				s, err := c.Sub(fmt.Sprintf("e%d", i))
				if err != nil {
					b.Fatal(err)
				}
				if err := s.Delete(); err != nil {
					b.Fatal(err)
				}
				lat = append(lat, time.Since(t0))
			}
			lat.report(b)
		})
	}
}

// startSleepers starts n sleeping processes in c and returns them.
func startSleepers(b *testing.B, c *Cgroup, n int) []*exec.Cmd {
	var out []*exec.Cmd
	for range n {
		cmd := exec.Command("sleep", "1000")
		if err := cmd.Start(); err != nil {
			b.Fatal(err)
		}
		out = append(out, cmd)
		if err := c.Add(cmd.Process.Pid); err != nil {
			_ = cmd.Process.Kill()
			_ = cmd.Wait()
			b.Fatal(err)
		}
	}
	return out
}

// BenchmarkFreezeThaw measures Freeze then Thaw of a group of 2 processes.
func BenchmarkFreezeThaw(b *testing.B) {
	for _, mode := range layouts(b) {
		b.Run(mode.String(), func(b *testing.B) {
			m := newManager(b, mode)
			c := create(b, m, "ft", Limits{})
			cmds := startSleepers(b, c, 2)
			b.Cleanup(func() {
				_ = c.Kill()
				for _, cmd := range cmds {
					_ = cmd.Wait()
				}
			})
			lat := make(latencies, 0, b.N)
			for b.Loop() {
				t0 := time.Now()
				if err := c.Freeze(); err != nil {
					b.Fatal(err)
				}
				if err := c.Thaw(); err != nil {
					b.Fatal(err)
				}
				lat = append(lat, time.Since(t0))
			}
			lat.report(b)
		})
	}
}

// BenchmarkKill2 measures Kill of a group of 2 processes, until the group
// is empty (the processes are reaped outside the timing).
func BenchmarkKill2(b *testing.B) {
	for _, mode := range layouts(b) {
		b.Run(mode.String(), func(b *testing.B) {
			m := newManager(b, mode)
			c := create(b, m, "kill", Limits{})
			lat := make(latencies, 0, b.N)
			for b.Loop() {
				b.StopTimer()
				cmds := startSleepers(b, c, 2)
				b.StartTimer()
				t0 := time.Now()
				if err := c.Kill(); err != nil {
					b.Fatal(err)
				}
				lat = append(lat, time.Since(t0))
				b.StopTimer()
				for _, cmd := range cmds {
					_ = cmd.Wait()
				}
				b.StartTimer()
			}
			lat.report(b)
		})
	}
}

// BenchmarkPids lists a group with one sub-group holding a process: Pids
// (opens every file) against a kept-open PidList.
func BenchmarkPids(b *testing.B) {
	for _, mode := range layouts(b) {
		b.Run(mode.String(), func(b *testing.B) {
			m := newManager(b, mode)
			c, err := m.Create("pids", Limits{})
			if err != nil {
				b.Fatal(err)
			}
			b.Cleanup(func() { _ = c.Delete() })
			_, h := sleeperIn(b, c, "s")
			b.Cleanup(func() { _ = h.cmd.Process.Kill(); _, _ = h.cmd.Process.Wait() })
			l, err := c.OpenPids()
			if err != nil {
				b.Fatal(err)
			}
			b.Cleanup(l.Close)
			for _, v := range []struct {
				name string
				list func() ([]int, error)
			}{{"Pids", c.Pids}, {"PidList", l.Pids}} {
				b.Run(v.name, func(b *testing.B) {
					for b.Loop() {
						if p, err := v.list(); err != nil || len(p) != 1 {
							b.Fatal(p, err)
						}
					}
				})
			}
		})
	}
}

// BenchmarkControl compares a write to cgroup.freeze through SetFrozen,
// which opens the file each time, with one through a Control kept open.
func BenchmarkControl(b *testing.B) {
	for _, mode := range layouts(b) {
		b.Run(mode.String(), func(b *testing.B) {
			m := newManager(b, mode)
			c := create(b, m, "control", Limits{})
			if !c.trackV2 {
				b.Skip("cgroup v1 tracking: no Control")
			}
			k, err := c.OpenControl("cgroup.freeze")
			if err != nil {
				b.Fatal(err)
			}
			defer k.Close()
			for _, way := range []struct {
				name  string
				write func() error
			}{
				{"SetFrozen", func() error { return c.SetFrozen(false) }},
				{"Control", func() error { return k.Write("0") }},
			} {
				b.Run(way.name, func(b *testing.B) {
					lat := make(latencies, 0, b.N)
					for b.Loop() {
						t0 := time.Now()
						if err := way.write(); err != nil {
							b.Fatal(err)
						}
						lat = append(lat, time.Since(t0))
					}
					lat.report(b)
				})
			}
		})
	}
}
