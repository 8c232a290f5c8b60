package procstate

import (
	"slices"
	"testing"

	"golang.org/x/sys/unix"

	"github.com/deltagym/deltagym/sandbox/ptfork"
)

// kernelWrites leaves out each thread's rseq CPU and node fields and the
// time left a relative sleep or a select-family call wrote, knows a
// restarted wait by an earlier one at the same place, and nothing else.
func TestKernelWrites(t *testing.T) {
	sleep := ptfork.Rest{Tid: 10, Nr: unix.SYS_CLOCK_NANOSLEEP, Args: [6]uint64{0, 0, 0x7000, 0x7010}, Rip: 0x400, Rsp: 0x7ff0, Rseq: 0x9000, RseqSize: 32}
	spans, waits := kernelWrites([]ptfork.Rest{sleep}, nil)
	want := []Span{{0x7010, 16}, {0x9000, 8}, {0x9014, 8}}
	if !slices.Equal(spans, want) || len(waits) != 1 {
		t.Fatalf("sleep: %x %v, want %x", spans, waits, want)
	}
	restarted := sleep
	restarted.Nr = unix.SYS_RESTART_SYSCALL
	if got, _ := kernelWrites([]ptfork.Rest{restarted}, nil); !slices.Equal(got, want[1:]) {
		t.Fatalf("restarted, unknown: %x", got)
	}
	if got, _ := kernelWrites([]ptfork.Rest{restarted}, waits); !slices.Equal(got, want) {
		t.Fatalf("restarted, known: %x", got)
	}
	moved := restarted
	moved.Rsp += 8
	if got, _ := kernelWrites([]ptfork.Rest{moved}, waits); !slices.Equal(got, want[1:]) {
		t.Fatalf("restarted elsewhere: %x", got)
	}
	for _, r := range []ptfork.Rest{
		{Nr: unix.SYS_CLOCK_NANOSLEEP, Args: [6]uint64{1, unix.TIMER_ABSTIME, 0x7000, 0x7010}}, // absolute: no time left written
		{Nr: unix.SYS_READ, Args: [6]uint64{0, 0x7000, 1}},
		{Nr: -1},
	} {
		if got, w := kernelWrites([]ptfork.Rest{r}, nil); len(got) != 0 || len(w) != 0 {
			t.Fatalf("%+v: %x %v", r, got, w)
		}
	}
	for nr, arg := range map[int64]int{unix.SYS_NANOSLEEP: 1, unix.SYS_SELECT: 4, unix.SYS_PSELECT6: 4, unix.SYS_PPOLL: 2} {
		r := ptfork.Rest{Nr: nr}
		r.Args[arg] = 0x5000
		if got, _ := kernelWrites([]ptfork.Rest{r}, nil); !slices.Equal(got, []Span{{0x5000, 16}}) {
			t.Fatalf("call %d: %x", nr, got)
		}
	}
}
