//go:build linux && amd64

package ptfork

import (
	"encoding/binary"
	"fmt"

	"golang.org/x/sys/unix"
)

// Call is one system call of a Batch.
type Call struct {
	Nr   uintptr
	Args [6]uintptr
}

// batchCode runs the calls of a table, rbx its address, each entry eight
// words: the call's number (-1 ends the table), its six arguments, and the
// word its result is written to. It stops at the first call that fails,
// and traps (int3) at the end.
var batchCode = []byte{
	0x48, 0x8b, 0x03, // 0: mov rax, [rbx]
	0x48, 0x83, 0xf8, 0xff, // 3: cmp rax, -1
	0x74, 0x2c, // 7: je done (53)
	0x48, 0x8b, 0x7b, 0x08, // 9: mov rdi, [rbx+8]
	0x48, 0x8b, 0x73, 0x10, // 13: mov rsi, [rbx+16]
	0x48, 0x8b, 0x53, 0x18, // 17: mov rdx, [rbx+24]
	0x4c, 0x8b, 0x53, 0x20, // 21: mov r10, [rbx+32]
	0x4c, 0x8b, 0x43, 0x28, // 25: mov r8, [rbx+40]
	0x4c, 0x8b, 0x4b, 0x30, // 29: mov r9, [rbx+48]
	0x0f, 0x05, // 33: syscall
	0x48, 0x89, 0x43, 0x38, // 35: mov [rbx+56], rax
	0x48, 0x3d, 0x01, 0xf0, 0xff, 0xff, // 39: cmp rax, -4095
	0x73, 0x06, // 45: jae done (53)
	0x48, 0x83, 0xc3, 0x40, // 47: add rbx, 64
	0xeb, 0xcb, // 51: jmp 0
	0xcc, // 53: done: int3
}

const (
	batchTable = 64 // the table's offset in the page
	batchEntry = 64
	// BatchMax is the most calls one run of the routine makes; Batch runs
	// it again for more.
	BatchMax = (scratchSize-batchTable)/batchEntry - 1
	notRun   = 1 << 63
)

// Batch runs calls in a row in stopped process p, by a routine written at
// code, a page of p's memory mapped readable, writable and executable that
// Batch may overwrite: one stop for up to BatchMax calls, where Syscall
// takes two for each. It stops at the first call that fails and returns
// the results of those before it and the failure, naming the call's
// index. A signal that arrives meanwhile is kept for Detach, as by
// Syscall.
func (p *Proc) Batch(code uintptr, calls []Call) ([]uintptr, error) {
	if err := p.Write(code, batchCode); err != nil {
		return nil, err
	}
	out := make([]uintptr, 0, len(calls))
	for len(calls) > 0 {
		n := min(len(calls), BatchMax)
		res, err := p.runBatch(code, calls[:n], len(out))
		out = append(out, res...)
		if err != nil {
			return out, err
		}
		calls = calls[n:]
	}
	return out, nil
}

func (p *Proc) runBatch(code uintptr, calls []Call, first int) ([]uintptr, error) {
	table := make([]byte, (len(calls)+1)*batchEntry)
	for i, c := range calls {
		e := table[i*batchEntry:]
		binary.NativeEndian.PutUint64(e, uint64(c.Nr))
		for j, a := range c.Args {
			binary.NativeEndian.PutUint64(e[8+8*j:], uint64(a))
		}
		binary.NativeEndian.PutUint64(e[56:], notRun)
	}
	binary.NativeEndian.PutUint64(table[len(calls)*batchEntry:], ^uint64(0))
	if err := p.Write(code+batchTable, table); err != nil {
		return nil, err
	}
	regs := p.Regs
	regs.Rip = uint64(code)
	regs.Rbx = uint64(code + batchTable)
	regs.Orig_rax = ^uint64(0)
	if err := unix.PtraceSetRegs(p.Pid, &regs); err != nil {
		return nil, fmt.Errorf("setting registers of pid %d: %w", p.Pid, err)
	}
	if err := p.runToTrap(uint64(code) + uint64(len(batchCode))); err != nil {
		return nil, err
	}
	if err := p.Read(code+batchTable, table); err != nil {
		return nil, err
	}
	out := make([]uintptr, 0, len(calls))
	for i, c := range calls {
		r := binary.NativeEndian.Uint64(table[i*batchEntry+56:])
		if r == notRun {
			return out, fmt.Errorf("%w: call %d (%d) of a batch in pid %d did not run", ErrStop, first+i, c.Nr, p.Pid)
		}
		if e := int64(r); e < 0 && e > -4096 {
			return out, &BatchError{Index: first + i, Nr: c.Nr, Errno: unix.Errno(-e)}
		}
		out = append(out, uintptr(r))
	}
	return out, nil
}

// runToTrap lets p run until it traps with its instruction pointer at end.
func (p *Proc) runToTrap(end uint64) error {
	for {
		if err := ptrace(unix.PTRACE_CONT, p.Pid, 0, 0); err != nil {
			return fmt.Errorf("resuming pid %d: %w", p.Pid, err)
		}
		ws, err := wait(p.Pid)
		if err != nil {
			return err
		}
		if ws.Exited() || ws.Signaled() {
			p.attached = false
			delete(p.s.procs, p.Pid)
			return fmt.Errorf("%w: pid %d ended during injected system calls", ErrGone, p.Pid)
		}
		if !ws.Stopped() || ws.TrapCause() > 0 {
			continue
		}
		s := ws.StopSignal()
		if s == unix.SIGTRAP {
			var r unix.PtraceRegs
			if err := unix.PtraceGetRegs(p.Pid, &r); err != nil {
				return fmt.Errorf("reading registers of pid %d: %w", p.Pid, err)
			}
			if r.Rip == end {
				return nil
			}
		}
		if s == unix.SIGSEGV || s == unix.SIGBUS || s == unix.SIGILL {
			return fmt.Errorf("%w: pid %d faulted (%s) in injected system calls", ErrStop, p.Pid, unix.SignalName(s))
		}
		// Another's signal: kept for Detach, not delivered now.
		p.Signal = s
	}
}

// BatchError is the failure of one call of a Batch.
type BatchError struct {
	Index int
	Nr    uintptr
	Errno unix.Errno
}

func (e *BatchError) Error() string {
	return fmt.Sprintf("system call %d (call %d of a batch): %v", e.Nr, e.Index, e.Errno)
}

func (e *BatchError) Unwrap() error { return e.Errno }
