// Package cpupin keeps threads that hand work to each other on one CPU.
//
// On this VM a thread woken on another CPU waits for that idle vCPU to wake
// first: tens of microseconds per hand-over (a ptrace round trip, a channel
// send to a locked worker goroutine). Putting both sides on the CPU the
// caller runs on makes each hand-over a plain context switch.
package cpupin

import (
	"unsafe"

	"golang.org/x/sys/unix"
)

// Current returns the CPU the calling thread runs on (it may move at any
// time: a hint).
func Current() (int, error) {
	var cpu uint32
	if _, _, e := unix.RawSyscall(unix.SYS_GETCPU, uintptr(unsafe.Pointer(&cpu)), 0, 0); e != 0 {
		return 0, e
	}
	return int(cpu), nil
}

// Set returns the CPU set holding cpu alone.
func Set(cpu int) unix.CPUSet {
	var s unix.CPUSet
	s.Set(cpu)
	return s
}
