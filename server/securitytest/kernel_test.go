package securitytest

import (
	"testing"
)

// Kernel interfaces a sandbox has no use for, and where exploits often land: the seccomp filter
// refuses each whole call (EPERM), whatever its arguments. Rows are grouped by family; each
// call's arguments are valid enough that a kernel without the filter would act on them (or fail
// with another errno than EPERM).
var kernelCalls = map[string][]syscallCase{
	"keyctl": {
		{"keyctl KEYCTL_GET_KEYRING_ID", []string{"250", "0", "-3", "0"}, []string{"EPERM"}},
		{"add_key user", []string{"248", "s:user", "s:dgsec", "s:secret", "6", "-3"}, []string{"EPERM"}},
		{"request_key", []string{"249", "s:user", "s:dgsec", "0", "-3"}, []string{"EPERM"}},
	},
	"bpf": {
		// BPF_MAP_CREATE with a zeroed attr; BPF_PROG_LOAD likewise.
		{"bpf BPF_MAP_CREATE", []string{"321", "0", "b:128", "128"}, []string{"EPERM"}},
		{"bpf BPF_PROG_LOAD", []string{"321", "5", "b:128", "128"}, []string{"EPERM"}},
	},
	"perf_event_open": {
		// A zeroed perf_event_attr (PERF_TYPE_HARDWARE, cycles) of size 128, this process, any CPU.
		{"perf_event_open", []string{"298", "q:0x8000000000,0,0,0,0,0,0,0,0,0,0,0,0,0,0,0", "0", "-1", "-1", "0"}, []string{"EPERM"}},
	},
	"userfaultfd": {
		{"userfaultfd", []string{"323", "0"}, []string{"EPERM"}},
		{"userfaultfd user mode only", []string{"323", "1"}, []string{"EPERM"}},
	},
	"io_uring": {
		{"io_uring_setup", []string{"425", "8", "b:120"}, []string{"EPERM"}},
		{"io_uring_enter", []string{"426", "0", "0", "0", "0", "0", "0"}, []string{"EPERM"}},
		{"io_uring_register", []string{"427", "0", "0", "0", "0"}, []string{"EPERM"}},
	},
	"modules": {
		{"init_module", []string{"175", "b:64", "64", "s:"}, []string{"EPERM"}},
		{"finit_module", []string{"313", "0", "s:", "0"}, []string{"EPERM"}},
		{"delete_module", []string{"176", "s:loop", "0x800"}, []string{"EPERM"}},
		{"kexec_load", []string{"246", "0", "0", "0", "0"}, []string{"EPERM"}},
		{"kexec_file_load", []string{"320", "-1", "-1", "0", "s:", "4"}, []string{"EPERM"}},
	},
	"clock": {
		// The time is the host's: none of these may set it, nor read it through adjtimex.
		{"clock_settime CLOCK_REALTIME", []string{"227", "0", "q:1,0"}, []string{"EPERM"}},
		{"settimeofday", []string{"164", "q:1,0", "0"}, []string{"EPERM"}},
		{"adjtimex (read only)", []string{"159", "b:208"}, []string{"EPERM"}},
		{"clock_adjtime (read only)", []string{"305", "0", "b:208"}, []string{"EPERM"}},
	},
	"kernel administration": {
		// LINUX_REBOOT_CMD_CAD_OFF: harmless where it would pass.
		{"reboot CAD_OFF", []string{"169", "0xfee1dead", "672274793", "0", "0"}, []string{"EPERM"}},
		{"swapon", []string{"167", "s:/tmp/swap", "0"}, []string{"EPERM"}},
		{"iopl 3", []string{"172", "3"}, []string{"EPERM"}},
		{"ioperm 0x80", []string{"173", "0x80", "1", "1"}, []string{"EPERM"}},
		{"syslog READ_ALL", []string{"103", "3", "b:64", "64"}, []string{"EPERM"}},
		{"acct", []string{"163", "s:/tmp/acct"}, []string{"EPERM"}},
		{"quotactl", []string{"179", "0x800002", "s:/", "0", "0"}, []string{"EPERM"}},
		{"open_by_handle_at", []string{"304", "-100", "b:64", "0"}, []string{"EPERM"}},
		{"name_to_handle_at", []string{"303", "-100", "s:/", "b:64", "b:4", "0"}, []string{"EPERM"}},
		{"modify_ldt", []string{"154", "0", "b:16", "16"}, []string{"EPERM"}},
		{"personality READ_IMPLIES_EXEC", []string{"135", "0x0400000"}, []string{"EPERM"}},
		{"vhangup", []string{"153"}, []string{"EPERM"}},
	},
}

// TestAttackKernelCalls makes each refused call of kernelCalls from a command.
func TestAttackKernelCalls(t *testing.T) {
	s := begin(t)
	sb := s.sandbox(t)
	for family, cases := range kernelCalls {
		t.Run(family, func(t *testing.T) { s.syscalls(t, sb, cases) })
	}
	// The shell tools say the same.
	for _, cmd := range []string{"date -s @1", "dmesg"} {
		if res := s.exec(t, sb, cmd); res.OK() {
			t.Errorf("%s: succeeded", cmd)
		}
	}
}

// Sockets: raw, packet and the other families are refused; so are every IP protocol but TCP,
// UDP and ICMP, and every netlink protocol but routing. The errnos are those of a kernel built
// without them (sandbox/initproc/csrc/SECCOMP.md, Sockets).
func TestAttackSockets(t *testing.T) {
	s := begin(t)
	sb := s.sandbox(t)
	const (
		afUnix, afInet, afInet6, afNetlink, afPacket, afAlg, afVsock = "1", "2", "10", "16", "17", "38", "40"
		stream, dgram, raw, packet                                   = "1", "2", "3", "10"
	)
	sock := func(name, family, typ, proto string, want ...string) syscallCase {
		return syscallCase{name, []string{"41", family, typ, proto}, want}
	}
	s.syscalls(t, sb, []syscallCase{
		sock("AF_PACKET raw", afPacket, raw, "0x300", "EAFNOSUPPORT"),
		sock("AF_PACKET dgram", afPacket, dgram, "0x300", "EAFNOSUPPORT"),
		sock("AF_INET SOCK_PACKET", afInet, packet, "0x300", "EAFNOSUPPORT"),
		sock("AF_INET raw IPPROTO_RAW", afInet, raw, "255", "EPROTONOSUPPORT"),
		sock("AF_INET raw ICMP", afInet, raw, "1", "EPERM"),
		sock("AF_INET raw TCP", afInet, raw, "6", "EPERM"),
		sock("AF_INET6 raw ICMPV6", afInet6, raw, "58", "EPERM"),
		sock("AF_INET6 raw IPPROTO_RAW", afInet6, raw, "255", "EPROTONOSUPPORT"),
		sock("AF_INET SCTP", afInet, stream, "132", "EPROTONOSUPPORT"),
		sock("AF_INET MPTCP", afInet, stream, "262", "EPROTONOSUPPORT"),
		sock("AF_INET DCCP", afInet, "6", "33", "EPROTONOSUPPORT"),
		sock("AF_NETLINK netfilter", afNetlink, raw, "12", "EPROTONOSUPPORT"),
		sock("AF_NETLINK audit", afNetlink, raw, "9", "EPROTONOSUPPORT"),
		sock("AF_NETLINK kobject_uevent", afNetlink, dgram, "15", "EPROTONOSUPPORT"),
		sock("AF_NETLINK generic", afNetlink, raw, "16", "EPROTONOSUPPORT"),
		sock("AF_ALG", afAlg, "5", "0", "EAFNOSUPPORT"),
		sock("AF_VSOCK", afVsock, stream, "0", "EAFNOSUPPORT"),
		sock("AF_BLUETOOTH", "31", raw, "0", "EAFNOSUPPORT"),
		{"socketpair AF_INET", []string{"53", afInet, stream, "0", "b:8"}, []string{"EAFNOSUPPORT"}},
	})
	// What a sandbox needs still works: the controls that show the refusals are the filter's.
	s.syscalls(t, sb, []syscallCase{
		sock("AF_UNIX stream", afUnix, stream, "0", okFD...),
		sock("AF_INET TCP", afInet, stream, "0", okFD...),
		sock("AF_NETLINK route", afNetlink, raw, "0", okFD...),
	})
}

// okFD are the answers of a call that returned a new descriptor in sysHelper's process, whose
// first free descriptor is 3 (or a few above, for what Python opened itself).
var okFD = []string{"ok 3", "ok 4", "ok 5", "ok 6"}
