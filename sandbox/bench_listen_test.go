package sandbox_test

import (
	"context"
	"testing"
	"time"

	"github.com/deltagym/deltagym/sandbox"
)

// listenBenchPy holds about 8 MB and, with "listen", listens on a TCP
// port and on a unix socket's path, as a service does.
const listenBenchPy = `
import os, socket, sys, time
ballast = bytearray(8 << 20)
for i in range(0, len(ballast), 4096):
    ballast[i] = 1
if sys.argv[1] == "listen":
    t = socket.create_server(("127.0.0.1", 8000))
    u = socket.socket(socket.AF_UNIX)
    u.bind("/tmp/bench.sock")
    u.listen()
open("/tmp/ready", "w").close()
while True:
    time.sleep(1)
`

// BenchmarkRollbackListener is what a process's listening sockets add to
// its rollback: two sandboxes, each running one python3 process of about
// 8 MB, one of them listening on a TCP port and on a unix socket's path,
// each restored in place in alternating blocks of vsBlock, with an agent's
// step between restores (untimed: a command, then 5 ms), so that each
// restore takes the copies forked ahead. It reports each side's p50 and p99
// (listen-, plain-) and the server's CPU per rollback (-cpu-us/op: this
// process's and its reaped children's, over a side's rounds, the step's
// exec included).
func BenchmarkRollbackListener(b *testing.B) {
	bb := setup(b)
	img := defaultImage(b, bb)
	ctx := context.Background()
	type side struct {
		name   string
		s      *sandbox.Sandbox
		ck     string
		l      lat
		cpu    time.Duration
		rounds int
	}
	var sides []*side
	for _, name := range []string{"listen", "plain"} {
		s := bb.create(b, sandbox.Spec{Image: img})
		must(b, s.WriteFile(ctx, "/tmp/bench.py", []byte(listenBenchPy), 0o644, false))
		_, err := s.Exec(ctx, sandbox.ExecRequest{Argv: []string{"python3", "/tmp/bench.py", name}, Background: true})
		must(b, err)
		waitFor(b, s, "[ -e /tmp/ready ]")
		ck, err := s.Checkpoint(ctx)
		must(b, err)
		// Its digest is computed in the background: not in a side's CPU.
		_, err = bb.rt.StateDigest(ctx, ck.ID)
		must(b, err)
		// The first restore hands the template to the huge-page worker.
		must(b, s.Restore(ctx, ck.ID))
		sides = append(sides, &side{name: name, s: s, ck: ck.ID})
	}
	waitFolded(b, bb)
	step := func(s *sandbox.Sandbox) {
		res, err := s.Exec(ctx, sandbox.ExecRequest{Argv: []string{"true"}})
		must(b, err)
		if res.ExitCode != 0 {
			b.Fatalf("step: %+v", res)
		}
		time.Sleep(5 * time.Millisecond)
	}
	b.ResetTimer()
	for done := 0; done < b.N; done += vsBlock {
		for _, sd := range sides {
			n := min(vsBlock, b.N-done)
			cpu0 := serverCPU()
			for range n {
				b.StopTimer()
				step(sd.s)
				b.StartTimer()
				var err error
				sd.l.time(func() { err = sd.s.Restore(ctx, sd.ck) })
				must(b, err)
			}
			sd.cpu += serverCPU() - cpu0
			sd.rounds += n
		}
	}
	b.StopTimer()
	for _, sd := range sides {
		sd.l.report(b, sd.name+"-")
		b.ReportMetric(float64(sd.cpu.Microseconds())/float64(sd.rounds), sd.name+"-cpu-us/op")
	}
}
