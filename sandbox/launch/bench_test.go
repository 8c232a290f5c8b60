package launch_test

import (
	"sync"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/deltagym/deltagym/internal/benchq"
	"github.com/deltagym/deltagym/sandbox/launch"
)

// BenchmarkStartInit times the start of a sandbox init through the zygote
// (its clone into new namespaces, id maps, mounts, seccomp filter, hello),
// net namespaces made beforehand: one at a time (start-) and, for the
// throughput of a fork fan-out, four callers at once (par4-each-: the wall
// time of a round of four starts over four).
func BenchmarkStartInit(b *testing.B) {
	bin := initBinary(b)
	ns, err := launch.NewSpawnNS(bin)
	if err != nil {
		b.Fatal(err)
	}
	defer ns.Close()
	const par = 4
	nets := make([]int, par)
	for i := range nets {
		if nets[i], err = launch.NewNetNS(); err != nil {
			b.Fatal(err)
		}
		defer unix.Close(nets[i])
	}
	// Distinct id ranges, far above those of running servers' sandboxes.
	host := func(i int) int { return 3_000_000_000 + i*launch.IDRange }
	start := func(i int) *launch.Init {
		in, err := ns.Start(launch.Config{HostID: host(i), NetNS: nets[i], Hostname: "bench"})
		if err != nil {
			b.Error(err)
		}
		return in
	}
	var one, round []time.Duration
	b.ResetTimer()
	for range b.N {
		t := time.Now()
		in := start(0)
		one = append(one, time.Since(t))
		b.StopTimer()
		stop(b, in)
		b.StartTimer()
		ins := make([]*launch.Init, par)
		var wg sync.WaitGroup
		t = time.Now()
		for i := range par {
			wg.Go(func() { ins[i] = start(i) })
		}
		wg.Wait()
		round = append(round, time.Since(t)/par)
		b.StopTimer()
		for _, in := range ins {
			stop(b, in)
		}
		b.StartTimer()
	}
	benchq.Report(b, one, "start-")
	benchq.Report(b, round, "par4-each-")
}

func stop(b *testing.B, in *launch.Init) {
	if in == nil {
		return
	}
	if err := in.Stop(); err != nil {
		b.Error(err)
	}
}
