package sandbox

import (
	"bufio"
	"os/exec"
	"testing"
	"time"

	"github.com/deltagym/deltagym/internal/benchq"
	"github.com/deltagym/deltagym/sandbox/procstate"
)

// BenchmarkTemplateMemory hashes the private writable memory of a process holding 8 MiB of
// data, as the processes digest does for a template, with the ranges a capture records masked.
func BenchmarkTemplateMemory(b *testing.B) {
	py, err := exec.LookPath("python3")
	if err != nil {
		b.Skip("python3 is not installed")
	}
	cmd := exec.Command(py, "-c", "import sys,time\nx=bytearray(b'a'*(8<<20))\nprint('ready',flush=True)\ntime.sleep(600)")
	out, err := cmd.StdoutPipe()
	if err != nil {
		b.Fatal(err)
	}
	if err := cmd.Start(); err != nil {
		b.Fatal(err)
	}
	defer func() { _ = cmd.Process.Kill(); _ = cmd.Wait() }()
	if line, err := bufio.NewReader(out).ReadString('\n'); err != nil || line != "ready\n" {
		b.Fatalf("python3: %q %v", line, err)
	}
	start, err := procstate.StartTime(cmd.Process.Pid)
	if err != nil {
		b.Fatal(err)
	}
	// A template's masks as a capture records them: two threads' rseq fields, a sleep's time left.
	masks := []procstate.Span{{Addr: 0x1060, Len: 8}, {Addr: 0x1074, Len: 8}, {Addr: 0x2060, Len: 8}, {Addr: 0x2074, Len: 8}, {Addr: 0x3000, Len: 16}}
	var lat []time.Duration
	for b.Loop() {
		t := time.Now()
		if _, _, ok, err := templateMemory(cmd.Process.Pid, start, masks, newProcBudget(0), func() error { return nil }); !ok || err != nil {
			b.Fatalf("memory not read: %v", err)
		}
		lat = append(lat, time.Since(t))
	}
	benchq.Report(b, lat, "")
}
