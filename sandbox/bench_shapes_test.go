package sandbox_test

import (
	"context"
	"slices"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/deltagym/deltagym/sandbox"
)

// shapePrograms are process shapes of BenchmarkRollbackShapes and
// BenchmarkCheckpointShapes, each a command that touches /tmp/ready once
// it runs whole:
//   - threads4: one python3 process of four threads (three sleeping in a
//     loop, as worker threads wait for work);
//   - tree: a shell running a python3 child, as `sh -c 'python3 app.py'`
//     does, each process with about 8 MB of its own;
//   - shelltree: the same tree with a shell that holds little of its own,
//     as a command line's shell does, and a python3 of about 8 MB.
var shapePrograms = []struct{ name, cmd string }{
	{"threads4", `exec python3 -c '
import threading, time
def work():
    while True:
        time.sleep(0.05)
for _ in range(3):
    threading.Thread(target=work, daemon=True).start()
open("/tmp/ready", "w").close()
while True:
    time.sleep(0.05)
'`},
	{"tree", `x=$(head -c 8000000 /dev/zero | tr '\0' x); python3 -c '
import time
b = bytearray(8 << 20)
for i in range(0, len(b), 4096):
    b[i] = 1
open("/tmp/ready", "w").close()
while True:
    time.sleep(0.05)
'; echo ${#x}`},
	{"shelltree", `python3 -c '
import time
b = bytearray(8 << 20)
for i in range(0, len(b), 4096):
    b[i] = 1
open("/tmp/ready", "w").close()
while True:
    time.sleep(0.05)
'; echo done`},
}

// shapeSandbox starts shape in a new sandbox of the default image and
// waits until it runs whole.
func shapeSandbox(b testing.TB, bb *bundle, cmd string) *sandbox.Sandbox {
	s := bb.create(b, sandbox.Spec{Image: defaultImage(b, bb)})
	_, err := s.Exec(context.Background(), sandbox.ExecRequest{Argv: []string{"sh", "-c", cmd}, Background: true})
	must(b, err)
	waitFor(b, s, "[ -e /tmp/ready ]")
	return s
}

// cpuTime is the CPU time of the test process (the runtime: tracer,
// mounts, criu's parent side) and its reaped children (criu), user and
// system.
func cpuTime() time.Duration {
	var self, kids unix.Rusage
	_ = unix.Getrusage(unix.RUSAGE_SELF, &self)
	_ = unix.Getrusage(unix.RUSAGE_CHILDREN, &kids)
	d := func(t unix.Timeval) time.Duration { return time.Duration(t.Nano()) }
	return d(self.Utime) + d(self.Stime) + d(kids.Utime) + d(kids.Stime)
}

// BenchmarkRollbackShapes restores process shapes in place, back to back,
// each checkpointed by the template path and by CRIU (process mode criu)
// in two sandboxes, alternating blocks of vsBlock restores as
// BenchmarkRollbackVsCRIU does. Each path reports p50/p99 and the server's
// CPU per rollback (cpu-ms/op: the runtime's and criu's, over the path's
// blocks), which counts what the copies forked ahead cost too. A shape the
// template path cannot copy (a tree) is reported by the path that took it.
func BenchmarkRollbackShapes(b *testing.B) {
	for _, shape := range shapePrograms {
		b.Run("shape="+shape.name, func(b *testing.B) {
			needCRIU(b)
			bb := setup(b)
			ctx := context.Background()
			type side struct {
				name string
				s    *sandbox.Sandbox
				ck   string
				l    lat
				cpu  time.Duration
			}
			var sides []*side
			for _, path := range processPaths {
				s := shapeSandbox(b, bb, shape.cmd)
				ck, err := s.CheckpointWith(ctx, sandbox.CheckpointOptions{Processes: path.mode})
				must(b, err)
				name := path.name
				for _, p := range ck.Processes {
					if p.Method.String() != path.name {
						name = p.Method.String() + "-for-" + path.name
					}
				}
				must(b, s.Restore(ctx, ck.ID))
				sides = append(sides, &side{name: name, s: s, ck: ck.ID})
			}
			waitFolded(b, bb)
			b.ResetTimer()
			for done := 0; done < b.N; done += vsBlock {
				for _, sd := range sides {
					start := cpuTime()
					for range min(vsBlock, b.N-done) {
						var err error
						sd.l.time(func() { err = sd.s.Restore(ctx, sd.ck) })
						must(b, err)
					}
					sd.cpu += cpuTime() - start
				}
			}
			b.StopTimer()
			p50 := make([]float64, len(sides))
			for i, sd := range sides {
				sd.l.report(b, sd.name+"-")
				b.ReportMetric(float64(sd.cpu.Microseconds())/1000/float64(len(sd.l)), sd.name+"-cpu-ms/op")
				d := slices.Clone(sd.l)
				slices.Sort(d)
				p50[i] = float64(d[len(d)/2])
			}
			b.ReportMetric(p50[1]/p50[0], "criu/template-p50")
		})
	}
}

// BenchmarkCheckpointShapes checkpoints the shapes of
// BenchmarkRollbackShapes by the template path, each checkpoint released
// untimed.
func BenchmarkCheckpointShapes(b *testing.B) {
	for _, shape := range shapePrograms {
		b.Run("shape="+shape.name, func(b *testing.B) {
			bb := setup(b)
			s := shapeSandbox(b, bb, shape.cmd)
			ctx := context.Background()
			first, err := s.Checkpoint(ctx)
			must(b, err)
			must(b, bb.rt.ReleaseCheckpoint(first.ID))
			waitFolded(b, bb)
			var l lat
			b.ResetTimer()
			for range b.N {
				var ck sandbox.CheckpointInfo
				l.time(func() { ck, err = s.Checkpoint(ctx) })
				must(b, err)
				b.StopTimer()
				must(b, bb.rt.ReleaseCheckpoint(ck.ID))
				b.StartTimer()
			}
			b.Logf("captured %s", methods(first.Processes))
			l.report(b, "")
		})
	}
}
