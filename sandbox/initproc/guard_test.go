package initproc

import (
	"encoding/binary"
	"os"
	"regexp"
	"strings"
	"testing"

	"golang.org/x/sys/unix"
)

// runFilter runs a classic BPF seccomp program over data, as the kernel
// does, and returns its answer.
func runFilter(t *testing.T, prog []unix.SockFilter, data []byte) uint32 {
	t.Helper()
	var acc uint32
	for pc := 0; pc < len(prog); pc++ {
		f := prog[pc]
		switch f.Code {
		case unix.BPF_LD | unix.BPF_W | unix.BPF_ABS:
			acc = binary.NativeEndian.Uint32(data[f.K:])
		case unix.BPF_JMP | unix.BPF_JEQ | unix.BPF_K:
			if acc == f.K {
				pc += int(f.Jt)
			} else {
				pc += int(f.Jf)
			}
		case unix.BPF_JMP | unix.BPF_JA:
			pc += int(f.K)
		case unix.BPF_RET | unix.BPF_K:
			return f.K
		default:
			t.Fatalf("instruction %d: code %#x", pc, f.Code)
		}
	}
	t.Fatal("the program ran off its end")
	return 0
}

// seccompData lays out struct seccomp_data.
func seccompData(arch uint32, nr uint32, args ...uint64) []byte {
	b := make([]byte, 64)
	binary.NativeEndian.PutUint32(b[0:], nr)
	binary.NativeEndian.PutUint32(b[4:], arch)
	for i, a := range args {
		binary.NativeEndian.PutUint64(b[16+8*i:], a)
	}
	return b
}

// The guard filter hands over what the init's filter hands over, and lets
// everything else through.
func TestGuardFilter(t *testing.T) {
	prog := GuardFilter()
	if len(prog) > unix.BPF_MAXINSNS {
		t.Fatalf("%d instructions", len(prog))
	}
	x86 := uint32(unix.AUDIT_ARCH_X86_64)
	for _, c := range []struct {
		name string
		data []byte
		want uint32
	}{
		{"getpid", seccompData(x86, unix.SYS_GETPID), retAllow},
		{"kill", seccompData(x86, unix.SYS_KILL, 5, 9), retNotify},
		{"kill -1", seccompData(x86, unix.SYS_KILL, 0xffffffff, 9), retNotify},
		{"tgkill", seccompData(x86, unix.SYS_TGKILL, 5, 5, 9), retNotify},
		{"pidfd_send_signal", seccompData(x86, unix.SYS_PIDFD_SEND_SIGNAL, 3, 9), retNotify},
		{"pidfd_open", seccompData(x86, unix.SYS_PIDFD_OPEN, 5), retNotify},
		{"sched_setaffinity self", seccompData(x86, unix.SYS_SCHED_SETAFFINITY, 0), retAllow},
		{"sched_setaffinity other", seccompData(x86, unix.SYS_SCHED_SETAFFINITY, 5), retNotify},
		{"sched_setattr other", seccompData(x86, unix.SYS_SCHED_SETATTR, 5), retNotify},
		{"setpriority self", seccompData(x86, unix.SYS_SETPRIORITY, unix.PRIO_PROCESS, 0), retAllow},
		{"setpriority other", seccompData(x86, unix.SYS_SETPRIORITY, unix.PRIO_PROCESS, 5), retNotify},
		{"ioprio_set other", seccompData(x86, unix.SYS_IOPRIO_SET, 1, 5), retNotify},
		{"prlimit64 self", seccompData(x86, unix.SYS_PRLIMIT64, 0, 7, 0x7000), retAllow},
		{"prlimit64 read other", seccompData(x86, unix.SYS_PRLIMIT64, 5, 7, 0, 0x7000), retAllow},
		{"prlimit64 set other", seccompData(x86, unix.SYS_PRLIMIT64, 5, 7, 0x7000), retNotify},
		{"prlimit64 set other, high address", seccompData(x86, unix.SYS_PRLIMIT64, 5, 7, 0x7f0000000000), retNotify},
		{"another architecture", seccompData(unix.AUDIT_ARCH_I386, unix.SYS_KILL, 5, 9), retAllow},
	} {
		if got := runFilter(t, prog, c.data); got != c.want {
			t.Errorf("%s: %#x, want %#x", c.name, got, c.want)
		}
	}
}

// The guard filter's call lists are guard_block's in csrc/init.c.
func TestGuardFilterMatchesInit(t *testing.T) {
	src, err := os.ReadFile("csrc/init.c")
	if err != nil {
		t.Fatal(err)
	}
	nums := map[string]uint32{
		"SYS_kill": unix.SYS_KILL, "SYS_tkill": unix.SYS_TKILL, "SYS_tgkill": unix.SYS_TGKILL,
		"SYS_rt_sigqueueinfo": unix.SYS_RT_SIGQUEUEINFO, "SYS_rt_tgsigqueueinfo": unix.SYS_RT_TGSIGQUEUEINFO,
		"SYS_pidfd_open": unix.SYS_PIDFD_OPEN, "SYS_pidfd_send_signal": unix.SYS_PIDFD_SEND_SIGNAL,
		"SYS_sched_setaffinity": unix.SYS_SCHED_SETAFFINITY, "SYS_sched_setscheduler": unix.SYS_SCHED_SETSCHEDULER,
		"SYS_sched_setparam": unix.SYS_SCHED_SETPARAM, "SYS_sched_setattr": unix.SYS_SCHED_SETATTR,
		"SYS_setpriority": unix.SYS_SETPRIORITY, "SYS_ioprio_set": unix.SYS_IOPRIO_SET,
	}
	for name, want := range map[string][]uint32{
		"signal_calls": guardSignalCalls, "pid0_calls": guardPid0Calls, "pid1_calls": guardPid1Calls,
	} {
		m := regexp.MustCompile(`static const int ` + name + `\[\] = \{([^}]*)\}`).FindSubmatch(src)
		if m == nil {
			t.Fatalf("no %s in init.c", name)
		}
		var got []uint32
		for _, f := range strings.Split(string(m[1]), ",") {
			if f = strings.TrimSpace(f); f == "" {
				continue
			}
			n, ok := nums[f]
			if !ok {
				t.Fatalf("%s: %s has no number here", name, f)
			}
			got = append(got, n)
		}
		if len(got) != len(want) {
			t.Fatalf("%s: init.c has %v, the guard filter %v", name, got, want)
		}
		for i := range got {
			if got[i] != want[i] {
				t.Fatalf("%s: init.c has %v, the guard filter %v", name, got, want)
			}
		}
	}
	if !strings.Contains(string(src), "JEQ(SYS_prlimit64") {
		t.Fatal("init.c hands prlimit64 over no longer: the guard filter does")
	}
}
