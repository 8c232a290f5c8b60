package initproc

import "golang.org/x/sys/unix"

// The guard filter: the part of the init's own filter (csrc/init.c,
// guard_block) that hands the calls reaching another process by pid to a
// listener, for a process that carries the init's filter without its
// listener — one restored by criu, which restores filters but not
// listeners (sandbox/procstate, guard.go). Stacked on such a process with
// SECCOMP_FILTER_FLAG_NEW_LISTENER, it gives a listener that the init
// serves (Conn.Guard); the kernel takes the strictest answer of a
// process's filters, and SECCOMP_RET_USER_NOTIF is stricter than the
// SECCOMP_RET_ALLOW the restored filter gives those calls. It lets
// everything else through: the filter beneath answers the rest. The call
// lists match guard_block's; TestGuardFilter checks the answers.

// Call lists of guard_block in csrc/init.c.
var (
	guardSignalCalls = []uint32{unix.SYS_KILL, unix.SYS_TKILL, unix.SYS_TGKILL, unix.SYS_RT_SIGQUEUEINFO,
		unix.SYS_RT_TGSIGQUEUEINFO, unix.SYS_PIDFD_OPEN, unix.SYS_PIDFD_SEND_SIGNAL}
	// A pid in argument 0, 0 for the caller.
	guardPid0Calls = []uint32{unix.SYS_SCHED_SETAFFINITY, unix.SYS_SCHED_SETSCHEDULER, unix.SYS_SCHED_SETPARAM,
		unix.SYS_SCHED_SETATTR}
	// A pid (or a group or user) in argument 1, 0 for the caller.
	guardPid1Calls = []uint32{unix.SYS_SETPRIORITY, unix.SYS_IOPRIO_SET}
)

// Offsets in struct seccomp_data.
const (
	sdNr   = 0
	sdArch = 4
	sdArg0 = 16 // args[i] at 16 + 8*i; the low half first (little-endian)
)

const (
	retAllow  = unix.SECCOMP_RET_ALLOW
	retNotify = unix.SECCOMP_RET_USER_NOTIF
	auditArch = unix.AUDIT_ARCH_X86_64
)

func bpfStmt(code uint16, k uint32) unix.SockFilter { return unix.SockFilter{Code: code, K: k} }

func bpfJump(code uint16, k uint32, jt, jf uint8) unix.SockFilter {
	return unix.SockFilter{Code: code, Jt: jt, Jf: jf, K: k}
}

func ld(off uint32) unix.SockFilter { return bpfStmt(unix.BPF_LD|unix.BPF_W|unix.BPF_ABS, off) }
func ret(v uint32) unix.SockFilter  { return bpfStmt(unix.BPF_RET|unix.BPF_K, v) }
func jeq(k uint32, jt, jf uint8) unix.SockFilter {
	return bpfJump(unix.BPF_JMP|unix.BPF_JEQ|unix.BPF_K, k, jt, jf)
}

// GuardFilter returns the guard filter's program. Another architecture's
// calls pass it (the init's filter kills their caller), and so do x32's (it
// refuses them).
func GuardFilter() []unix.SockFilter {
	f := []unix.SockFilter{
		ld(sdArch),
		jeq(auditArch, 1, 0),
		ret(retAllow),
		ld(sdNr),
	}
	// Signals: each handed over.
	for _, nr := range guardSignalCalls {
		f = append(f, jeq(nr, 0, 1), ret(retNotify))
	}
	// A pid in argument i: handed over unless 0 (the caller).
	byArg := func(calls []uint32, i uint32) {
		n := len(calls)
		for j, nr := range calls {
			f = append(f, jeq(nr, uint8(n-j), 0))
		}
		f = append(f,
			bpfStmt(unix.BPF_JMP|unix.BPF_JA, 4),
			ld(sdArg0+8*i),
			jeq(0, 0, 1),
			ret(retAllow),
			ret(retNotify))
	}
	byArg(guardPid0Calls, 0)
	byArg(guardPid1Calls, 1)
	// prlimit64: another process's limits set (reading them is harmless).
	f = append(f,
		jeq(unix.SYS_PRLIMIT64, 0, 8),
		ld(sdArg0),
		jeq(0, 5, 0),
		ld(sdArg0+16),
		jeq(0, 0, 2),
		ld(sdArg0+16+4),
		jeq(0, 1, 0),
		ret(retNotify),
		ret(retAllow),
		ret(retAllow))
	return f
}
