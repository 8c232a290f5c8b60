package sandbox_test

import (
	"context"
	"fmt"
	"slices"
	"syscall"
	"testing"
	"time"

	"github.com/deltagym/deltagym/sandbox"
)

// BenchmarkRollbackPostgres: the Postgres server of TestServiceShapes (the
// cluster Debian's package made, default configuration, three psql clients
// connected), rolled back in place after a write transaction, its state
// read back by a query each round; checkpointed in the runtime's default
// process mode and in process mode criu, in one run (rollbackService).
func BenchmarkRollbackPostgres(b *testing.B) { rollbackService(b, postgresService) }

// BenchmarkRollbackRedis: the same with the Redis server of
// TestServiceShapes, rolled back after a SET, read back by a GET.
func BenchmarkRollbackRedis(b *testing.B) { rollbackService(b, redisService) }

// BenchmarkRollbackNode: the same with the Node HTTP server of
// TestServiceShapes, rolled back after a POST, read back by a GET.
func BenchmarkRollbackNode(b *testing.B) { rollbackService(b, nodeService) }

// serviceModes are the process modes rollbackService sets against each
// other: the runtime's default (templates wherever they can copy a
// process) and criu (CRIU for every process).
var serviceModes = []struct {
	name string
	mode sandbox.ProcessMode
}{
	{"default", sandbox.ProcessesDefault},
	{"criu", sandbox.ProcessesCRIU},
}

// rollbackService runs svc in one sandbox per process mode, checkpoints
// it, and then, in alternating blocks of vsBlock rounds so that both modes
// meet the machine at the same moments: changes its state (untimed),
// restores in place (timed: <mode>-p50-ms, -p99-ms, -max-ms) and reads the
// state back by a query (timed apart: <mode>-query-p50-ms …), which must be
// the checkpoint's. <mode>-cpu-us/op is the test process's CPU (getrusage,
// itself and its reaped children: each criu swrk) over a mode's rounds,
// divided by its rounds: what the server spends per rollback, the work it
// does after a restore returns (copies forked ahead) included, with the
// server's side of the change and the query. A checkpoint refused skips
// the benchmark, saying why.
func rollbackService(b *testing.B, svc service) {
	needCRIU(b)
	bb := setup(b)
	img := servicesImage(b, bb)
	ctx := context.Background()
	type side struct {
		s      *sandbox.Sandbox
		ck     string
		l, q   lat
		cpu    time.Duration
		rounds int
	}
	sides := make([]*side, len(serviceModes))
	for i, m := range serviceModes {
		s := bb.create(b, sandbox.Spec{Image: img})
		svc.start(b, s)
		ck, err := s.CheckpointWith(ctx, sandbox.CheckpointOptions{Processes: m.mode})
		if err != nil {
			b.Skipf("%s: the checkpoint in process mode %s is refused: %v", svc.name, m.name, err)
		}
		b.Logf("%s, mode %s: captured %v", svc.name, m.name, capturedBy(ck))
		// The first restore hands templates to the huge-page worker.
		must(b, s.Restore(ctx, ck.ID))
		sides[i] = &side{s: s, ck: ck.ID}
	}
	waitFolded(b, bb)
	b.ResetTimer()
	for done := 0; done < b.N; done += vsBlock {
		for _, sd := range sides {
			n := min(vsBlock, b.N-done)
			cpu0 := serverCPU()
			for range n {
				b.StopTimer()
				svc.change(b, sd.s)
				b.StartTimer()
				var err error
				sd.l.time(func() { err = sd.s.Restore(ctx, sd.ck) })
				must(b, err)
				var got string
				sd.q.time(func() { got = svc.state(b, sd.s) })
				if got != svc.want {
					b.Fatalf("%s: state %q after the restore, want %q", svc.name, got, svc.want)
				}
			}
			sd.cpu += serverCPU() - cpu0
			sd.rounds += n
		}
	}
	b.StopTimer()
	p50 := make([]float64, len(sides))
	for i, sd := range sides {
		name := serviceModes[i].name
		sd.l.report(b, name+"-")
		sd.q.report(b, name+"-query-")
		b.ReportMetric(float64(sd.cpu.Microseconds())/float64(sd.rounds), name+"-cpu-us/op")
		d := slices.Clone(sd.l)
		slices.Sort(d)
		p50[i] = float64(d[len(d)/2])
	}
	b.ReportMetric(p50[1]/p50[0], fmt.Sprintf("%s/%s-p50", serviceModes[1].name, serviceModes[0].name))
}

// serverCPU returns the user and system CPU time of this process and of
// its children that have been waited for.
func serverCPU() time.Duration {
	var self, kids syscall.Rusage
	_ = syscall.Getrusage(syscall.RUSAGE_SELF, &self)
	_ = syscall.Getrusage(syscall.RUSAGE_CHILDREN, &kids)
	return time.Duration(self.Utime.Nano() + self.Stime.Nano() + kids.Utime.Nano() + kids.Stime.Nano())
}
