// dg-init: the resident init (pid 1) of a deltagym sandbox.
//
// It is cloned by the zygote (the same binary run as `dg-init --zygote`, see
// below) into fresh user, mount, pid, ipc, uts and cgroup namespaces, in a
// net namespace the server hands over, with the control socket as fd 3
// (SOCK_SEQPACKET). It stays tiny (static, no heap churn) because one runs
// per sandbox and its private memory counts against the density target.
//
// Protocol: every message is a header {u32 type, u32 id, u32 len} followed by
// len payload bytes, possibly with file descriptors (SCM_RIGHTS). At start
// the init sends a hello, a REPLY with id 0. Requests:
//
//   PING                      reply {i32 err=0, i32 pid}
//   SPAWN fds:[in,out,err,cg...] payload: spawn_hdr, then NUL-terminated
//                             cwd, argv..., "", env..., "". Starts a command
//                             (vfork-style clone), reply {i32 err, i32 pid}
//   GUARD fds:[listener]      a seccomp listener to serve as the init's own
//                             (see guard_add), reply {i32 err, i32 0}
//
// Events sent without a request: EXIT {i32 pid, i32 wait status}, for every
// child the init reaps (orphans re-parented to it included).
//
// Beside its socket the init answers the calls its seccomp filter hands it:
// those of every command that reach another process by pid, refused when
// they aim at a checkpoint's template (see guard_notify); and the same calls
// of the processes CRIU restored, whose filters' listeners the server hands
// it (GUARD).
//
// The init mounts its /proc and /dev and sets the host name (the zygote's
// request's, or argv[1] when run directly) at start, then confines itself
// as it confines commands (see confine): the root swap is done by the
// server from outside (see setup_mounts), so the init keeps no privilege
// that a command lacks but CAP_CHECKPOINT_RESTORE over the sandbox's user
// namespace, out of its bounding set (no command it starts has it), with
// which it sets the pid the sandbox's next process gets (MSG_NEXTPID: a
// restore that gives processes their pids back).
// When the control socket closes (the server went away), the init kills
// every process of the sandbox but the frozen templates of process
// checkpoints (see orphaned), and exits once none of those is left: the
// kernel then ends the pid namespace. A restarted server finds the
// templates and saves them as CRIU images (sandbox/readopt.go).
#define _GNU_SOURCE
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <grp.h>
#include <linux/audit.h>
#include <linux/capability.h>
#include <linux/filter.h>
#include <linux/netlink.h>
#include <linux/seccomp.h>
#include <netinet/in.h>
#include <poll.h>
#include <sched.h>
#include <signal.h>
#include <stddef.h>
#include <stdlib.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>
#include <sys/mount.h>
#include <sys/prctl.h>
#include <sys/resource.h>
#include <sys/signalfd.h>
#include <sys/socket.h>
#include <sys/ioctl.h>
#include <sys/random.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/types.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

enum {
	MSG_PING = 1,
	MSG_SPAWN = 3,
	MSG_GUARD = 4,
	MSG_NEXTPID = 5,
	MSG_REPLY = 100,
	MSG_EXIT = 101,
};

enum {
	SPAWN_SETSID = 1u << 0,
};

struct hdr {
	uint32_t type, id, len;
};

struct spawn_hdr {
	uint32_t flags;
	uint32_t uid, gid;
	uint32_t ncg; // cgroup.procs fds after the 3 stdio fds
};

#define CTL 3
#define MAXMSG (256 * 1024)
#define MAXFDS 16
#define MAXARGS 4096

static char buf[MAXMSG];
static int fds[MAXFDS];
static int nfds;

static int send_msg(uint32_t type, uint32_t id, const void *p, uint32_t len) {
	struct hdr h = {type, id, len};
	struct iovec iov[2] = {{&h, sizeof h}, {(void *)p, len}};
	struct msghdr m = {.msg_iov = iov, .msg_iovlen = 2};
	for (;;) {
		ssize_t n = sendmsg(CTL, &m, MSG_NOSIGNAL);
		if (n >= 0) return 0;
		if (errno != EINTR) return -1;
	}
}

static void reply(uint32_t id, int32_t err, int32_t val) {
	int32_t r[2] = {err, val};
	send_msg(MSG_REPLY, id, r, sizeof r);
}

static ssize_t recv_msg(struct hdr *h) {
	char cbuf[CMSG_SPACE(sizeof(int) * MAXFDS)];
	struct iovec iov[2] = {{h, sizeof *h}, {buf, sizeof buf}};
	struct msghdr m = {.msg_iov = iov, .msg_iovlen = 2, .msg_control = cbuf, .msg_controllen = sizeof cbuf};
	ssize_t n;
	do n = recvmsg(CTL, &m, MSG_CMSG_CLOEXEC);
	while (n < 0 && errno == EINTR);
	nfds = 0;
	if (n <= 0) return n;
	for (struct cmsghdr *c = CMSG_FIRSTHDR(&m); c; c = CMSG_NXTHDR(&m, c)) {
		if (c->cmsg_level == SOL_SOCKET && c->cmsg_type == SCM_RIGHTS) {
			int k = (c->cmsg_len - CMSG_LEN(0)) / sizeof(int);
			for (int i = 0; i < k && nfds < MAXFDS; i++) memcpy(&fds[nfds++], CMSG_DATA(c) + i * sizeof(int), sizeof(int));
		}
	}
	if ((size_t)n < sizeof *h || h->len != (size_t)n - sizeof *h) return -2;
	return n;
}

static void close_fds(void) {
	for (int i = 0; i < nfds; i++) close(fds[i]);
	nfds = 0;
}

// ---- root swap -------------------------------------------------------------

static void warn(const char *what) {
	char m[160] = "dg-init: ";
	strncat(m, what, 100);
	strcat(m, ": ");
	strncat(m, strerror(errno), 40);
	strcat(m, "\n");
	(void)!write(2, m, strlen(m));
}

#define TRY(x, what)                        \
	do {                                \
		if ((x) < 0) {              \
			int e_ = errno;     \
			warn(what);         \
			errno = e_;         \
			return -1;          \
		}                           \
	} while (0)

// setup_mounts mounts the sandbox's own /proc and a minimal /dev on the
// lastpid_fd is the sandbox's ns_last_pid, which the init writes for
// MSG_NEXTPID with CAP_CHECKPOINT_RESTORE, a capability of its own alone
// (confine).
static int lastpid_fd = -1;

// spawn root the init starts on. The server later stacks the sandbox's
// overlay on top and moves both into it (the root swap is done from
// outside: the kernel refuses to attach a mount made by host root into a
// mount namespace owned by the sandbox's user namespace). A user namespace
// may mount proc only while a fully visible proc is mounted already: the
// spawn root's host proc, which the sandbox's proc then covers.
static int setup_mounts(void) {
	// Mounts are private already: the spawn namespace made them so.
	TRY(mount("proc", "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC, NULL), "mounting proc");
	// Opened before /proc/sys is made read-only (below): MSG_NEXTPID
	// writes it, in the init's own pid namespace, the sandbox's.
	lastpid_fd = open("/proc/sys/kernel/ns_last_pid", O_WRONLY | O_CLOEXEC);
	// Masked and read-only /proc paths.
	static const char *masked[] = {"/proc/kcore", "/proc/keys", "/proc/timer_list", "/proc/sched_debug", "/proc/sysrq-trigger", 0};
	for (int i = 0; masked[i]; i++) mount("/.devsrc/null", masked[i], NULL, MS_BIND, NULL);
	static const char *ro[] = {"/proc/sys", "/proc/bus", "/proc/fs", "/proc/irq", 0};
	for (int i = 0; ro[i]; i++) {
		if (mount(ro[i], ro[i], NULL, MS_BIND | MS_REC, NULL) == 0)
			mount(NULL, ro[i], NULL, MS_BIND | MS_REMOUNT | MS_RDONLY | MS_NOSUID | MS_NODEV | MS_NOEXEC, NULL);
	}
	// /dev is the spawn root's tree, shared by every sandbox (the launcher
	// builds it: launch.buildDevTree says why it is not a tmpfs of each
	// sandbox's); only /dev/shm, which the sandbox writes, is its own. Its
	// bytes and inodes bound what a checkpoint copies of it (sandbox/shm.go
	// has the same figures).
	TRY(mount("/.devsrc", "/dev", NULL, MS_BIND | MS_REC, NULL), "mounting /dev");
	TRY(mount("shm", "/dev/shm", "tmpfs", MS_NOSUID | MS_NODEV, "mode=1777,size=64m,nr_inodes=16384"), "mounting /dev/shm");
	TRY(mount(NULL, "/dev", NULL, MS_REMOUNT | MS_BIND | MS_RDONLY | MS_NOSUID | MS_NOEXEC, NULL), "sealing /dev");
	return 0;
}

// ---- spawning commands ------------------------------------------------------

#ifndef SYS_open_tree_attr
#define SYS_open_tree_attr 467 // x86_64, Linux 6.15
#endif

// The seccomp filter of every command, x86_64 only (SECCOMP.md says why):
// another architecture is killed; x32 calls fail with EPERM, and so do:
// - clone with a namespace flag: a new user namespace gives its first
//   process every capability over the namespaces made with it. The kernel
//   reads the low 32 bits of clone's flags, and so does the filter;
//   CLONE_NEWTIME is a bit of clone's exit signal (clone3 and unshare
//   take it).
// - the calls in denied: they administer the kernel or the mount tree, or
//   are rarely needed and often used in exploits (unshare and setns: the
//   namespaces again).
// clone3 fails with ENOSYS: its flags are in memory, out of the filter's
// reach, and libc and Go fall back on clone for ENOSYS (kernels before 5.3).
// socket takes AF_UNIX, AF_INET, AF_INET6, and AF_NETLINK with NETLINK_ROUTE
// only; AF_INET and AF_INET6 take protocol 0, IPPROTO_TCP, IPPROTO_UDP and
// their own ICMP (ping sockets) only, and AF_INET no SOCK_PACKET (the kernel
// makes that an AF_PACKET socket). As on a kernel built without the rest,
// other families and SOCK_PACKET fail with EAFNOSUPPORT, other protocols
// with EPROTONOSUPPORT (MPTCP, SCTP, UDPLITE, DCCP, L2TP, SMC, raw IP: code
// a sandbox has no use for, some in modules the kernel loads on demand).
// Family, type and protocol are ints: the filter reads their low 32 bits,
// as the kernel does. socketpair takes AF_UNIX only (EAFNOSUPPORT).
// Everything else is allowed (listmount, statmount, file_getattr and
// file_setattr too: SECCOMP.md says why), among it what the runtime runs in
// processes that carry the filter: the init's
// clone(CLONE_VM|CLONE_VFORK|SIGCHLD), and ptfork's injected
// clone(CLONE_PARENT|SIGCHLD), setsid, mmap, munmap, chdir, openat, dup3,
// close, lseek and pipe2. Only clone, socket and socketpair load an
// argument: the answer to every other call depends on its number alone, so
// the kernel's action cache answers the allowed ones without running the
// filter.
static const int denied[] = {
    SYS_mount, SYS_umount2, SYS_pivot_root, SYS_chroot, SYS_move_mount, SYS_open_tree,
    SYS_open_tree_attr, SYS_fsopen, SYS_fsconfig, SYS_fsmount, SYS_fspick, SYS_mount_setattr,
    SYS_unshare, SYS_setns, SYS_init_module, SYS_finit_module, SYS_delete_module, SYS_kexec_load,
    SYS_kexec_file_load, SYS_reboot, SYS_swapon, SYS_swapoff, SYS_acct, SYS_syslog, SYS_bpf,
    SYS_perf_event_open, SYS_userfaultfd, SYS_keyctl, SYS_add_key, SYS_request_key,
    SYS_open_by_handle_at, SYS_name_to_handle_at, SYS_quotactl, SYS_quotactl_fd, SYS_iopl,
    SYS_ioperm, SYS_modify_ldt, SYS_settimeofday, SYS_clock_settime, SYS_clock_adjtime,
    SYS_adjtimex, SYS_vhangup, SYS_io_uring_setup, SYS_io_uring_enter, SYS_io_uring_register,
    SYS_lookup_dcookie, SYS_kcmp, SYS_process_vm_writev, SYS_personality,
};
#define NDENIED (sizeof denied / sizeof denied[0])

#define CLONE_NS_FLAGS \
	(CLONE_NEWNS | CLONE_NEWCGROUP | CLONE_NEWUTS | CLONE_NEWIPC | CLONE_NEWUSER | CLONE_NEWPID | CLONE_NEWNET)

#define LD(off) BPF_STMT(BPF_LD | BPF_W | BPF_ABS, (off))
// The low 32 bits of argument i (x86_64 is little-endian).
#define ARG(i) offsetof(struct seccomp_data, args[i])
#define JEQ(k, jt, jf) BPF_JUMP(BPF_JMP | BPF_JEQ | BPF_K, (k), (jt), (jf))
#define RET(v) BPF_STMT(BPF_RET | BPF_K, (v))
#define ERR(e) RET(SECCOMP_RET_ERRNO | (e))

// The head of the filter: the architecture, then the calls whose arguments
// are checked. A jump skips jt or jf instructions. Each block returns, so
// the accumulator still holds the call's number after a block it skipped.
static const struct sock_filter head[] = {
	LD(offsetof(struct seccomp_data, arch)),
	JEQ(AUDIT_ARCH_X86_64, 1, 0),
	RET(SECCOMP_RET_KILL_PROCESS),
	LD(offsetof(struct seccomp_data, nr)),
	BPF_JUMP(BPF_JMP | BPF_JGE | BPF_K, 0x40000000, 0, 1), // x32
	ERR(EPERM),

	// clone: no namespace flag.
	JEQ(SYS_clone, 0, 4),
	LD(ARG(0)),
	BPF_JUMP(BPF_JMP | BPF_JSET | BPF_K, CLONE_NS_FLAGS, 0, 1),
	ERR(EPERM),
	RET(SECCOMP_RET_ALLOW),

	// clone3: ENOSYS, whatever its flags.
	JEQ(SYS_clone3, 0, 1),
	ERR(ENOSYS),

	// socket: the family, then AF_INET's type, then the protocol of
	// AF_INET, AF_INET6 and AF_NETLINK sockets.
	JEQ(SYS_socket, 0, 20),
	LD(ARG(0)),
	JEQ(AF_UNIX, 16, 0),
	JEQ(AF_INET, 0, 5),
	LD(ARG(1)),
	BPF_STMT(BPF_ALU | BPF_AND | BPF_K, 0xf), // SOCK_TYPE_MASK: the flags aside
	JEQ(SOCK_PACKET, 13, 0),
	LD(ARG(2)),
	JEQ(IPPROTO_ICMP, 10, 6),
	JEQ(AF_INET6, 0, 2),
	LD(ARG(2)),
	JEQ(IPPROTO_ICMPV6, 7, 3),
	JEQ(AF_NETLINK, 0, 7),
	LD(ARG(2)),
	JEQ(NETLINK_ROUTE, 4, 3),
	// AF_INET and AF_INET6, the protocol in the accumulator.
	JEQ(IPPROTO_IP, 3, 0),
	JEQ(IPPROTO_TCP, 2, 0),
	JEQ(IPPROTO_UDP, 1, 0),
	ERR(EPROTONOSUPPORT),
	RET(SECCOMP_RET_ALLOW),
	ERR(EAFNOSUPPORT),

	// socketpair: AF_UNIX.
	JEQ(SYS_socketpair, 0, 4),
	LD(ARG(0)),
	JEQ(AF_UNIX, 0, 1),
	RET(SECCOMP_RET_ALLOW),
	ERR(EAFNOSUPPORT),
};
#define NHEAD (sizeof head / sizeof head[0])
// The head's first instructions, up to the x32 check: the dispatch and the
// guard block follow them (the head's jumps are relative, and none crosses
// that point).
#define NPRELUDE 6

// The calls that reach another process and could end or change a template
// (see guard_notify): the filter hands them to the init, which answers them
// (SECCOMP_RET_USER_NOTIF), unless they name no other process. The signals
// the init sends itself carry the secret as their sixth argument (skill),
// which no command can read (the init is not dumpable, and a filter cannot
// be read back without CAP_SYS_ADMIN over the initial user namespace): a
// call of the init's own waits for no one.
static const int signal_calls[] = {
    SYS_kill, SYS_tkill, SYS_tgkill, SYS_rt_sigqueueinfo, SYS_rt_tgsigqueueinfo,
    SYS_pidfd_open, SYS_pidfd_send_signal,
};
#define NSIGCALLS (sizeof signal_calls / sizeof signal_calls[0])
// Calls whose first argument is a pid, 0 for the caller.
static const int pid0_calls[] = {SYS_sched_setaffinity, SYS_sched_setscheduler, SYS_sched_setparam, SYS_sched_setattr};
#define NPID0 (sizeof pid0_calls / sizeof pid0_calls[0])
// Calls whose second argument is a pid (or a group or user), 0 for the caller.
static const int pid1_calls[] = {SYS_setpriority, SYS_ioprio_set};
#define NPID1 (sizeof pid1_calls / sizeof pid1_calls[0])
#define NGUARD (NSIGCALLS + 7 + NPID0 + 5 + NPID1 + 5 + 9)

#define HI(off) ((off) + 4)
#define JA(k) BPF_STMT(BPF_JMP | BPF_JA, (k))

static uint64_t secret;
static struct sock_filter filter[NPRELUDE + 3 * (NSIGCALLS + NPID0 + NPID1 + 5 + NDENIED) + NHEAD + NGUARD + 2 * NDENIED + 1];
static struct sock_fprog fprog;

// guard_block appends the part of the filter that hands calls reaching other
// processes to the init, at k, and returns the next index. It comes after
// the x32 check, with the call's number in the accumulator; each block
// returns or leaves the accumulator as it was.
static int guard_block(int k) {
	// Signals: the init's own (the secret in the sixth argument) pass.
	for (size_t i = 0; i < NSIGCALLS; i++) filter[k++] = (struct sock_filter)JEQ(signal_calls[i], NSIGCALLS - i, 0);
	filter[k++] = (struct sock_filter)JA(6);
	filter[k++] = (struct sock_filter)LD(ARG(5));
	filter[k++] = (struct sock_filter)JEQ((uint32_t)secret, 0, 3);
	filter[k++] = (struct sock_filter)LD(HI(ARG(5)));
	filter[k++] = (struct sock_filter)JEQ((uint32_t)(secret >> 32), 0, 1);
	filter[k++] = (struct sock_filter)RET(SECCOMP_RET_ALLOW);
	filter[k++] = (struct sock_filter)RET(SECCOMP_RET_USER_NOTIF);
	// Scheduling of another process: pid in argument 0.
	for (size_t i = 0; i < NPID0; i++) filter[k++] = (struct sock_filter)JEQ(pid0_calls[i], NPID0 - i, 0);
	filter[k++] = (struct sock_filter)JA(4);
	filter[k++] = (struct sock_filter)LD(ARG(0));
	filter[k++] = (struct sock_filter)JEQ(0, 0, 1);
	filter[k++] = (struct sock_filter)RET(SECCOMP_RET_ALLOW);
	filter[k++] = (struct sock_filter)RET(SECCOMP_RET_USER_NOTIF);
	// Priorities of another process: who in argument 1.
	for (size_t i = 0; i < NPID1; i++) filter[k++] = (struct sock_filter)JEQ(pid1_calls[i], NPID1 - i, 0);
	filter[k++] = (struct sock_filter)JA(4);
	filter[k++] = (struct sock_filter)LD(ARG(1));
	filter[k++] = (struct sock_filter)JEQ(0, 0, 1);
	filter[k++] = (struct sock_filter)RET(SECCOMP_RET_ALLOW);
	filter[k++] = (struct sock_filter)RET(SECCOMP_RET_USER_NOTIF);
	// prlimit64: another process's limits set (reading them is harmless).
	filter[k++] = (struct sock_filter)JEQ(SYS_prlimit64, 0, 8);
	filter[k++] = (struct sock_filter)LD(ARG(0));
	filter[k++] = (struct sock_filter)JEQ(0, 5, 0);
	filter[k++] = (struct sock_filter)LD(ARG(2));
	filter[k++] = (struct sock_filter)JEQ(0, 0, 2);
	filter[k++] = (struct sock_filter)LD(HI(ARG(2)));
	filter[k++] = (struct sock_filter)JEQ(0, 1, 0);
	filter[k++] = (struct sock_filter)RET(SECCOMP_RET_USER_NOTIF);
	filter[k++] = (struct sock_filter)RET(SECCOMP_RET_ALLOW);
	return k;
}

// The calls the rest of the filter names (the guard block, the head's
// checked calls and the denied list), sorted. Every other call is allowed
// by a binary search over them (dispatch) in about ten instructions, where
// the lists themselves take about ninety: the kernel runs the filter once
// for every call number when it installs it (its action cache), which made
// the install a tenth of a millisecond of every sandbox's start.
#define NSPECIAL (NSIGCALLS + NPID0 + NPID1 + 5 + NDENIED)
static int special[NSPECIAL];
static int nspecial;
// A dispatch leaf compares at most this many numbers one by one.
#define LEAF 4
// The dispatch's size: at most LEAF + 2 instructions a leaf, leaves of two
// or more numbers, and fewer branches than leaves.
#define NDISPATCH (3 * NSPECIAL)
static int chain_jumps[NSPECIAL];
static int nchain;

static int cmp_int(const void *a, const void *b) {
	int x = *(const int *)a, y = *(const int *)b;
	return (x > y) - (x < y);
}

static void add_special(const int *calls, size_t n) {
	for (size_t i = 0; i < n; i++) special[nspecial++] = calls[i];
}

static void collect_special(void) {
	static const int head_calls[] = {SYS_prlimit64, SYS_clone, SYS_clone3, SYS_socket, SYS_socketpair};
	nspecial = 0;
	add_special(signal_calls, NSIGCALLS);
	add_special(pid0_calls, NPID0);
	add_special(pid1_calls, NPID1);
	add_special(head_calls, sizeof head_calls / sizeof head_calls[0]);
	add_special(denied, NDENIED);
	qsort(special, nspecial, sizeof special[0], cmp_int);
	int n = 0;
	for (int i = 0; i < nspecial; i++)
		if (n == 0 || special[i] != special[n - 1]) special[n++] = special[i];
	nspecial = n;
}

// dispatch appends, at k, a search of special[lo, hi) for the call's number
// (in the accumulator, which it does not change), and returns the next
// index: a number not there is allowed; one there jumps to the rest of the
// filter (a JA that build_filter points there, listed in chain_jumps).
// Conditional jumps reach 255 instructions: a branch's left side is far
// smaller for the lists above, and build_filter checks it.
static int dispatch(int k, int lo, int hi) {
	if (hi - lo <= LEAF) {
		int n = hi - lo;
		for (int i = 0; i < n; i++) filter[k++] = (struct sock_filter)JEQ(special[lo + i], n - i, 0);
		filter[k++] = (struct sock_filter)RET(SECCOMP_RET_ALLOW);
		chain_jumps[nchain++] = k;
		filter[k++] = (struct sock_filter)JA(0);
		return k;
	}
	int mid = lo + (hi - lo) / 2;
	int at = k;
	int right = dispatch(k + 1, lo, mid);
	if (right - at - 1 > 255) return -1;
	filter[at] = (struct sock_filter)BPF_JUMP(BPF_JMP | BPF_JGE | BPF_K, special[mid], right - at - 1, 0);
	return dispatch(right, mid, hi);
}

static int build_filter(void) {
	memcpy(filter, head, NPRELUDE * sizeof head[0]);
	collect_special();
	nchain = 0;
	int k = dispatch(NPRELUDE, 0, nspecial);
	if (k < 0 || k > (int)(NPRELUDE + NDISPATCH)) return -1;
	for (int i = 0; i < nchain; i++) filter[chain_jumps[i]].k = k - chain_jumps[i] - 1;
	k = guard_block(k);
	memcpy(filter + k, head + NPRELUDE, (NHEAD - NPRELUDE) * sizeof head[0]);
	k += NHEAD - NPRELUDE;
	for (size_t i = 0; i < NDENIED; i++) {
		filter[k++] = (struct sock_filter)JEQ(denied[i], 0, 1);
		filter[k++] = (struct sock_filter)ERR(EPERM);
	}
	filter[k++] = (struct sock_filter)RET(SECCOMP_RET_ALLOW);
	fprog.len = k;
	fprog.filter = filter;
	return 0;
}

// Capabilities a command keeps (as root of the user namespace): those a
// package manager and ordinary root tooling need, none that administers the
// kernel, the mount tree or the network.
static const int kept_caps[] = {
    CAP_CHOWN, CAP_DAC_OVERRIDE, CAP_FOWNER, CAP_FSETID, CAP_KILL, CAP_SETGID, CAP_SETUID,
    CAP_SETPCAP, CAP_NET_BIND_SERVICE, CAP_SYS_CHROOT, CAP_AUDIT_WRITE, CAP_SETFCAP,
};

static int keep_cap(int c) {
	for (size_t i = 0; i < sizeof kept_caps / sizeof kept_caps[0]; i++)
		if (kept_caps[i] == c) return 1;
	return 0;
}

struct spawn_args {
	struct spawn_hdr sh;
	char *cwd;
	char **argv, **envp;
	int cg[MAXFDS];
	int ncg;
	int in, out, err;
	int errpipe;
};

static char *argvbuf[MAXARGS];
static char child_stack[64 * 1024] __attribute__((aligned(16)));

static void child_fail(struct spawn_args *a, int step) {
	int32_t e[2] = {errno, step};
	(void)!write(a->errpipe, e, sizeof e);
	_exit(127);
}

static int child_main(void *p) {
	struct spawn_args *a = p;
	sigset_t all;
	sigemptyset(&all);
	sigprocmask(SIG_SETMASK, &all, NULL);
	for (int i = 0; i < a->ncg; i++)
		if (write(a->cg[i], "0", 1) < 0) child_fail(a, 1);
	if (a->sh.flags & SPAWN_SETSID) setsid();
	if (dup2(a->in, 0) < 0 || dup2(a->out, 1) < 0 || dup2(a->err, 2) < 0) child_fail(a, 2);
	if (a->sh.gid != 0 || a->sh.uid != 0) {
		if (setgroups(0, NULL) < 0) child_fail(a, 4);
		if (setresgid(a->sh.gid, a->sh.gid, a->sh.gid) < 0) child_fail(a, 4);
		if (setresuid(a->sh.uid, a->sh.uid, a->sh.uid) < 0) child_fail(a, 4);
	}
	if (a->cwd[0] && chdir(a->cwd) < 0) child_fail(a, 6);
	if (strchr(a->argv[0], '/'))
		execve(a->argv[0], a->argv, a->envp);
	else
		execvpe(a->argv[0], a->argv, a->envp);
	child_fail(a, 9);
	return 0;
}

static int do_spawn(uint32_t len, int32_t *pid_out) {
	static struct spawn_args a;
	memset(&a, 0, sizeof a);
	if (len < sizeof a.sh || nfds < 3) return EINVAL;
	memcpy(&a.sh, buf, sizeof a.sh);
	if (a.sh.ncg != (uint32_t)nfds - 3) return EINVAL;
	a.in = fds[0];
	a.out = fds[1];
	a.err = fds[2];
	a.ncg = a.sh.ncg;
	for (int i = 0; i < a.ncg; i++) a.cg[i] = fds[3 + i];
	// Strings: cwd, argv..., "", env..., "".
	char *p = buf + sizeof a.sh, *end = buf + len;
	if (end[-1] != 0) return EINVAL;
	int k = 0;
	a.cwd = p;
	p += strlen(p) + 1;
	a.argv = argvbuf;
	while (p < end && *p && k < MAXARGS - 2) {
		argvbuf[k++] = p;
		p += strlen(p) + 1;
	}
	// A request past the table is refused, never cut (the server checks the
	// same limit before it sends: initproc.MaxEntries).
	if (k == 0 || p >= end) return EINVAL;
	if (*p) return E2BIG;
	argvbuf[k++] = NULL;
	p++;
	a.envp = argvbuf + k;
	while (p < end && *p && k < MAXARGS - 1) {
		argvbuf[k++] = p;
		p += strlen(p) + 1;
	}
	if (p < end && *p) return E2BIG;
	argvbuf[k] = NULL;

	int ep[2];
	if (pipe2(ep, O_CLOEXEC) < 0) return errno;
	a.errpipe = ep[1];
	pid_t pid = clone(child_main, child_stack + sizeof child_stack, CLONE_VM | CLONE_VFORK | SIGCHLD, &a);
	int saved = errno;
	close(ep[1]);
	if (pid < 0) {
		close(ep[0]);
		return saved;
	}
	int32_t e[2];
	ssize_t n = read(ep[0], e, sizeof e);
	close(ep[0]);
	if (n == sizeof e) {
		// The child failed before exec; it has exited, the reaper reports it.
		// The step that failed goes in the high bits (see conn.go).
		*pid_out = pid;
		return (e[0] ? e[0] : EINVAL) | (e[1] << 16);
	}
	*pid_out = pid;
	return 0;
}

// ---- orphaned ---------------------------------------------------------------
//
// The server is gone (a crash, a SIGKILL). What the sandbox ran is ended; the
// templates of its process checkpoints are kept, frozen, for the next server
// on the same data directory to re-adopt (it saves them as CRIU images, then
// ends the sandbox). A template is a process whose cgroup (in the sandbox's
// cgroup namespace) is a template group, named t<n>; the copies the next
// server makes of them to save them are in groups named i<n>, kept too.
// Processes inside cannot create or join groups. The init reaps its
// children until no template is left in its pid namespace, then exits.

// is_template reports whether pid is in a template group (or an image
// copy's).
static int is_template(long pid) {
	char path[64], b[1024];
	snprintf(path, sizeof path, "/proc/%ld/cgroup", pid);
	int fd = open(path, O_RDONLY | O_CLOEXEC);
	if (fd < 0) return 0;
	ssize_t n = read(fd, b, sizeof b - 1);
	close(fd);
	if (n <= 0) return 0;
	b[n] = 0;
	for (char *line = b, *end; *line; line = end + 1) {
		end = strchr(line, '\n');
		if (!end) end = line + strlen(line);
		char *base = end;
		while (base > line && base[-1] != '/') base--;
		if (base > line && (*base == 't' || *base == 'i') && base + 1 < end) {
			char *d = base + 1;
			while (d < end && *d >= '0' && *d <= '9') d++;
			if (d == end) return 1;
		}
		if (!*end) break;
	}
	return 0;
}

// skill is kill(2) by the init itself: the secret lets it past the filter
// (guard_block), so it never waits for its own answer.
static long skill(long pid, int sig) { return syscall(SYS_kill, pid, sig, 0, 0, 0, secret); }

// kill_others SIGKILLs every process but the init and the templates and
// returns how many it found alive (zombies aside).
static int kill_others(int *kept) {
	DIR *d = opendir("/proc");
	if (!d) return 0;
	int left = 0;
	*kept = 0;
	struct dirent *e;
	while ((e = readdir(d))) {
		char *end;
		long pid = strtol(e->d_name, &end, 10);
		if (*end || pid <= 1) continue;
		if (is_template(pid)) {
			(*kept)++;
			continue;
		}
		char path[64], st[256];
		snprintf(path, sizeof path, "/proc/%ld/stat", pid);
		int fd = open(path, O_RDONLY | O_CLOEXEC);
		if (fd < 0) continue;
		ssize_t n = read(fd, st, sizeof st - 1);
		close(fd);
		if (n <= 0) continue;
		st[n] = 0;
		char *p = strrchr(st, ')');
		if (p && p[1] == ' ' && (p[2] == 'Z' || p[2] == 'X')) continue;
		skill(pid, SIGKILL);
		left++;
	}
	closedir(d);
	return left;
}

static int orphaned(void) {
	if (getpid() != 1) return 0; // only ever the init of a sandbox's pid namespace
	int kept = 0;
	for (;;) {
		int left = kill_others(&kept);
		while (waitpid(-1, NULL, WNOHANG) > 0) {
		}
		if (!left) break;
		struct timespec ts = {0, 1000000};
		nanosleep(&ts, NULL);
	}
	if (!kept) return 0;
	for (;;) {
		if (waitpid(-1, NULL, 0) >= 0 || errno != ECHILD) continue;
		// No child of ours, but a template whose parent is the server
		// (a copy of a process criu restored) becomes ours only once
		// the server has finished exiting, after its socket closed.
		kill_others(&kept);
		if (!kept) return 0;
		struct timespec ts = {0, 10000000};
		nanosleep(&ts, NULL);
	}
}

// ---- templates out of the commands' reach -------------------------------------
//
// Templates are processes of the sandbox's pid namespace with the
// credentials of the processes they copy: a command holding CAP_KILL (root
// in the sandbox) could signal them, and so end or stop an acknowledged
// checkpoint's processes, or change their limits and scheduling, which the
// copies would inherit. So every call that reaches another process by pid
// is handed to the init (guard_block, SECCOMP_RET_USER_NOTIF), which
// refuses it with EPERM when it targets a template, and otherwise lets the
// kernel run it as the caller's (SECCOMP_USER_NOTIF_FLAG_CONTINUE), with the
// caller's own permission checks. Two cannot be let through:
// - kill(-1, sig) and kill(-pgrp, sig) (kill(0, sig)) when a template is in
//   reach: the init signals each process they would reach but the
//   templates, with the kernel's rule for who may signal whom
//   (kill_ok_by_cred) applied to the caller's credentials, and answers as
//   the kernel would;
// - pidfd_send_signal, whose target is a descriptor the caller could swap
//   between the init's look and the kernel's: the init resolves it once and
//   signals the process it found itself.
// Reading memory (ptrace, /proc/PID/mem, process_vm_readv) is kept out by
// the templates' non-dumpable flag.

static int notify_fd = -1;

struct pcred {
	long tgid;
	unsigned uid[4]; // real, effective, saved, filesystem
	unsigned long long capeff;
};

static int read_cred(long pid, struct pcred *c) {
	char path[64], b[4096];
	snprintf(path, sizeof path, "/proc/%ld/status", pid);
	int fd = open(path, O_RDONLY | O_CLOEXEC);
	if (fd < 0) return -1;
	ssize_t n = read(fd, b, sizeof b - 1);
	close(fd);
	if (n <= 0) return -1;
	b[n] = 0;
	char *p = strstr(b, "\nTgid:");
	if (!p) return -1;
	c->tgid = strtol(p + 6, NULL, 10);
	p = strstr(b, "\nUid:");
	if (!p || sscanf(p + 5, "%u %u %u %u", &c->uid[0], &c->uid[1], &c->uid[2], &c->uid[3]) != 4) return -1;
	p = strstr(b, "\nCapEff:");
	if (!p) return -1;
	c->capeff = strtoull(p + 8, NULL, 16);
	return 0;
}

// stat_ids reads the process group and session of pid.
static int stat_ids(long pid, long *pgrp, long *sid) {
	char path[64], st[512];
	snprintf(path, sizeof path, "/proc/%ld/stat", pid);
	int fd = open(path, O_RDONLY | O_CLOEXEC);
	if (fd < 0) return -1;
	ssize_t n = read(fd, st, sizeof st - 1);
	close(fd);
	if (n <= 0) return -1;
	st[n] = 0;
	char *p = strrchr(st, ')');
	long ppid;
	char state;
	if (!p || sscanf(p + 1, " %c %ld %ld %ld", &state, &ppid, pgrp, sid) != 4) return -1;
	return 0;
}

// may_signal is the kernel's kill_ok_by_cred for caller c and process t:
// CAP_KILL (every process of the sandbox is in its user namespace), or the
// caller's real or effective uid is the target's real or saved one; and
// SIGCONT within a session.
static int may_signal(const struct pcred *c, long t, int sig) {
	if (c->capeff & (1ULL << CAP_KILL)) return 1;
	struct pcred tc;
	if (read_cred(t, &tc) < 0) return 0;
	unsigned cu = c->uid[0], ce = c->uid[1], tu = tc.uid[0], ts = tc.uid[2];
	if (ce == ts || ce == tu || cu == ts || cu == tu) return 1;
	long g, s1, s2;
	return sig == SIGCONT && stat_ids(t, &g, &s1) == 0 && stat_ids(c->tgid, &g, &s2) == 0 && s1 == s2;
}

// group_has_template reports whether process group pgrp (every process if
// 0) holds a template.
static int group_has_template(long pgrp) {
	DIR *d = opendir("/proc");
	if (!d) return 1;
	struct dirent *e;
	int found = 0;
	while (!found && (e = readdir(d))) {
		char *end;
		long pid = strtol(e->d_name, &end, 10);
		long g, sid;
		if (*end || pid <= 1) continue;
		if (pgrp && (stat_ids(pid, &g, &sid) < 0 || g != pgrp)) continue;
		found = is_template(pid);
	}
	closedir(d);
	return found;
}

// signal_as sends sig, as caller c would with kill(2), to every process but
// the init and the templates: of process group pgrp, or, for pgrp 0, every
// one but the caller's own (kill(-1)). It returns the errno kill(2) would.
static int signal_as(const struct pcred *c, long pgrp, int sig) {
	DIR *d = opendir("/proc");
	if (!d) return EAGAIN;
	struct dirent *e;
	int found = 0, sent = 0, last = 0;
	while ((e = readdir(d))) {
		char *end;
		long pid = strtol(e->d_name, &end, 10);
		long g, sid;
		if (*end || pid <= 1 || is_template(pid)) continue;
		if (pgrp ? (stat_ids(pid, &g, &sid) < 0 || g != pgrp) : pid == c->tgid) continue;
		found++;
		int err = 0;
		if (!may_signal(c, pid, sig)) err = EPERM;
		else if (skill(pid, sig) < 0) err = errno;
		if (!err) sent++;
		// kill(-1) answers the last error other than EPERM; a group, its
		// last error unless one was sent.
		if (pgrp ? err != 0 : err != EPERM) last = err;
	}
	closedir(d);
	if (!found) return ESRCH;
	return pgrp && sent ? 0 : last;
}

// fd_target resolves descriptor fd of caller to the process it names (a
// pidfd, or a /proc/PID directory): the pid, -1 if it names none, -2 if the
// init may not look (the caller is another user).
static long fd_target(long caller, int fd) {
	char path[64], b[1024];
	snprintf(path, sizeof path, "/proc/%ld/fdinfo/%d", caller, fd);
	int f = open(path, O_RDONLY | O_CLOEXEC);
	if (f < 0) return errno == EACCES || errno == EPERM ? -2 : -1;
	ssize_t n = read(f, b, sizeof b - 1);
	close(f);
	if (n <= 0) return -1;
	b[n] = 0;
	char *p = strstr(b, "\nPid:");
	if (p) return strtol(p + 5, NULL, 10);
	snprintf(path, sizeof path, "/proc/%ld/fd/%d", caller, fd);
	n = readlink(path, b, sizeof b - 1);
	if (n <= 6) return -1;
	b[n] = 0;
	char *end;
	long pid = strncmp(b, "/proc/", 6) == 0 ? strtol(b + 6, &end, 10) : 0;
	return pid > 0 && !*end ? pid : -1;
}

#define CONT (-1)

// judge answers one call handed over by the filter: CONT to let it run,
// else the errno it returns (0: done by the init, success).
static int judge(int nfd, const struct seccomp_notif *r) {
	const __u64 *a = r->data.args;
	long target = 0;
	switch (r->data.nr) {
	case SYS_kill: {
		long pid = (int)a[0];
		if (pid > 0) {
			target = pid;
			break;
		}
		struct pcred c;
		long pgrp = -pid, sid;
		if (read_cred(r->pid, &c) < 0 || ioctl(nfd, SECCOMP_IOCTL_NOTIF_ID_VALID, &r->id) < 0) return ESRCH;
		if (pid == 0 && stat_ids(c.tgid, &pgrp, &sid) < 0) return ESRCH;
		if (pid == -1) pgrp = 0;
		if (!group_has_template(pgrp)) return CONT;
		return signal_as(&c, pgrp, (int)a[1]);
	}
	case SYS_tkill:
	case SYS_rt_sigqueueinfo:
	case SYS_pidfd_open:
	case SYS_prlimit64:
	case SYS_sched_setaffinity:
	case SYS_sched_setscheduler:
	case SYS_sched_setparam:
	case SYS_sched_setattr:
		target = (int)a[0];
		break;
	case SYS_tgkill:
	case SYS_rt_tgsigqueueinfo:
		target = (int)a[1];
		break;
	case SYS_setpriority: // PRIO_PROCESS; a group's or a user's: as asked
		target = (int)a[0] == PRIO_PROCESS ? (int)a[1] : 0;
		break;
	case SYS_ioprio_set: // IOPRIO_WHO_PROCESS
		target = (int)a[0] == 1 ? (int)a[1] : 0;
		break;
	case SYS_pidfd_send_signal: {
		long t = fd_target(r->pid, (int)a[0]);
		if (t == -2) return CONT; // the kernel's own checks, as the caller's
		if (t <= 0) return t == 0 ? ESRCH : EBADF;
		if (is_template(t)) return EPERM;
		struct pcred c;
		if (read_cred(r->pid, &c) < 0 || ioctl(nfd, SECCOMP_IOCTL_NOTIF_ID_VALID, &r->id) < 0) return ESRCH;
		if (!may_signal(&c, t, (int)a[1])) return EPERM;
		return skill(t, (int)a[1]) < 0 ? errno : 0;
	}
	}
	return target > 0 && is_template(target) ? EPERM : CONT;
}

// guard_notify answers one call a filter handed to the init through
// listener nfd.
static void guard_notify(int nfd) {
	struct seccomp_notif req;
	struct seccomp_notif_resp resp;
	memset(&req, 0, sizeof req);
	if (ioctl(nfd, SECCOMP_IOCTL_NOTIF_RECV, &req) < 0) return; // the caller went away
	memset(&resp, 0, sizeof resp);
	resp.id = req.id;
	int e = judge(nfd, &req);
	if (e == CONT) resp.flags = SECCOMP_USER_NOTIF_FLAG_CONTINUE;
	else resp.error = -e;
	ioctl(nfd, SECCOMP_IOCTL_NOTIF_SEND, &resp);
}

// ---- listeners of restored processes ------------------------------------------
//
// criu restores a process's filters without their listener, so the server
// stacks a filter of its own on each process CRIU restored, before it runs
// (sandbox/procstate, guard.go): it hands the same calls to a listener
// created with it, which the server passes here (GUARD) and the init serves
// as its own. Filters are inherited by fork, and a listener lives as long as
// one process holds its filter: the kernel then reports POLLHUP, and the
// init closes it. The poll set: the socket, the signalfd, the init's own
// listener, then these.

#define NFIXED 3
#define MAXGUARDS 1024

static struct pollfd pf[NFIXED + MAXGUARDS];
static int npf = NFIXED;

// guard_add serves listener fd from now on; it takes the descriptor.
static int guard_add(int fd) {
	if (npf == NFIXED + MAXGUARDS) {
		close(fd);
		return ENOSPC;
	}
	pf[npf++] = (struct pollfd){fd, POLLIN, 0};
	return 0;
}

// guard_poll answers the calls waiting on the listeners of restored
// processes, and drops those no process holds any longer.
static void guard_poll(void) {
	for (int i = NFIXED; i < npf;) {
		if (pf[i].revents & POLLIN) guard_notify(pf[i].fd);
		if (pf[i].revents & (POLLHUP | POLLERR | POLLNVAL)) {
			close(pf[i].fd);
			pf[i] = pf[--npf];
			continue;
		}
		i++;
	}
}

// ---- main loop --------------------------------------------------------------

static void reap(void) {
	for (;;) {
		int st;
		pid_t p = waitpid(-1, &st, WNOHANG);
		if (p <= 0) return;
		int32_t ev[2] = {p, st};
		send_msg(MSG_EXIT, 0, ev, sizeof ev);
	}
}

// confine drops what neither the init nor any command needs, once, for
// everything the init will start: the capabilities outside kept_caps (from
// the bounding, effective and permitted sets), then no_new_privs and the
// seccomp filter. Commands inherit all three.
static int confine(void) {
	for (int c = 0; c <= CAP_LAST_CAP; c++)
		if (!keep_cap(c) && prctl(PR_CAPBSET_DROP, c, 0, 0, 0) < 0 && errno != EINVAL) return -1;
	struct __user_cap_header_struct h = {_LINUX_CAPABILITY_VERSION_3, 0};
	struct __user_cap_data_struct d[2] = {{0}};
	for (size_t i = 0; i < sizeof kept_caps / sizeof kept_caps[0]; i++) {
		int c = kept_caps[i];
		d[c / 32].effective |= 1u << (c % 32);
		d[c / 32].permitted |= 1u << (c % 32);
	}
	// The init keeps CAP_CHECKPOINT_RESTORE for MSG_NEXTPID; out of the
	// bounding set, it is gone from every command at its exec.
	d[CAP_CHECKPOINT_RESTORE / 32].effective |= 1u << (CAP_CHECKPOINT_RESTORE % 32);
	d[CAP_CHECKPOINT_RESTORE / 32].permitted |= 1u << (CAP_CHECKPOINT_RESTORE % 32);
	TRY(syscall(SYS_capset, &h, d), "dropping capabilities");
	TRY(prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), "setting no_new_privs");
	// Not dumpable: no command may read the secret in its memory.
	TRY(prctl(PR_SET_DUMPABLE, 0, 0, 0, 0), "making the init non-dumpable");
	TRY(getrandom(&secret, sizeof secret, 0), "drawing the filter's secret");
	if (build_filter() < 0) {
		errno = E2BIG;
		TRY(-1, "building the seccomp filter");
	}
	notify_fd = syscall(SYS_seccomp, SECCOMP_SET_MODE_FILTER, SECCOMP_FILTER_FLAG_NEW_LISTENER, &fprog);
	TRY(notify_fd, "installing the seccomp filter");
	return 0;
}

// serve sends the hello, then answers requests with handle and reports the
// exits of reaped children, until the server closes the socket; then it
// returns what gone returns. Signals that would end the process are
// blocked: it ends when its socket closes.
static int serve(void (*handle)(struct hdr *h), int (*gone)(void)) {
	sigset_t mask;
	sigemptyset(&mask);
	sigaddset(&mask, SIGCHLD);
	sigaddset(&mask, SIGTERM);
	sigaddset(&mask, SIGINT);
	sigaddset(&mask, SIGHUP);
	sigaddset(&mask, SIGPIPE);
	sigprocmask(SIG_BLOCK, &mask, NULL);
	sigset_t chld;
	sigemptyset(&chld);
	sigaddset(&chld, SIGCHLD);
	int sfd = signalfd(-1, &chld, SFD_CLOEXEC | SFD_NONBLOCK);
	if (sfd < 0) return 1;
	fcntl(CTL, F_SETFD, FD_CLOEXEC);
	send_msg(MSG_REPLY, 0, "\0\0\0\0\0\0\0\0", 8); // hello
	// notify_fd is -1 in the zygote, which poll skips.
	pf[0] = (struct pollfd){CTL, POLLIN, 0};
	pf[1] = (struct pollfd){sfd, POLLIN, 0};
	pf[2] = (struct pollfd){notify_fd, POLLIN, 0};
	for (;;) {
		if (poll(pf, npf, -1) < 0) {
			if (errno == EINTR) continue;
			return 1;
		}
		if (pf[2].revents & POLLIN) guard_notify(notify_fd);
		guard_poll();
		if (pf[1].revents) {
			struct signalfd_siginfo si;
			while (read(sfd, &si, sizeof si) > 0) {
			}
			reap();
		}
		if (!pf[0].revents) continue;
		struct hdr h;
		ssize_t n = recv_msg(&h);
		if (n == 0) return gone(); // the server is gone
		if (n < 0) {
			close_fds();
			if (n == -1 && (errno == EAGAIN || errno == EINTR)) continue;
			// ECONNRESET: the server died with messages of ours
			// unread. Gone all the same.
			if (n == -1) return gone();
			reply(h.id, EPROTO, 0);
			continue;
		}
		handle(&h);
		close_fds();
	}
}

static void init_handle(struct hdr *h) {
	switch (h->type) {
	case MSG_PING:
		reply(h->id, 0, getpid());
		break;
	case MSG_SPAWN: {
		int32_t pid = 0;
		int e = do_spawn(h->len, &pid);
		reply(h->id, e, pid);
		break;
	}
	case MSG_NEXTPID: {
		int32_t want;
		if (h->len != 4 || (memcpy(&want, buf, 4), want < 2)) {
			reply(h->id, EINVAL, 0);
			break;
		}
		char num[16];
		int n = snprintf(num, sizeof num, "%d", want - 1);
		int e = lastpid_fd < 0 ? EBADF : pwrite(lastpid_fd, num, n, 0) == n ? 0 : errno ? errno : EIO;
		reply(h->id, e, 0);
		break;
	}
	case MSG_GUARD:
		if (nfds != 1 || h->len != 0) {
			reply(h->id, EINVAL, 0);
			break;
		}
		nfds = 0; // guard_add takes it
		reply(h->id, guard_add(fds[0]), 0);
		break;
	default:
		reply(h->id, ENOSYS, 0);
	}
}

static int init_main(const char *hostname) {
	if (setup_mounts() < 0) return 1;
	if (hostname && hostname[0] && sethostname(hostname, strlen(hostname)) < 0) return 1;
	if (confine() < 0) return 1;
	return serve(init_handle, orphaned);
}

// ---- zygote -------------------------------------------------------------------
//
// `dg-init --zygote` is started once by the server in its spawn mount
// namespace, with its control socket as fd 3, and clones new inits on
// request: a C clone() into fresh namespaces costs a fraction of a Go
// os/exec with a user namespace, and the new init needs no exec: it is a
// copy of the zygote that runs init_main.
//
//   ZSPAWN payload {u32 host_id, hostname} fds:[netns, init socket]
//          reply {i32 err, i32 pid (host pid namespace)}
//   events: EXIT {pid, status} when an init it cloned exits.

#define ZSPAWN 10

struct zargs {
	int syncr, syncw, ctl;
	char hostname[65];
};

static char zstack[256 * 1024] __attribute__((aligned(16)));

static int zchild(void *p) {
	struct zargs *z = p;
	char c;
	close(z->syncw);
	if (read(z->syncr, &c, 1) != 1) _exit(1); // the zygote failed to map ids
	close(z->syncr);
	// uid and gid 0 of the new user namespace: the range's first host id.
	if (setresgid(0, 0, 0) < 0 || setresuid(0, 0, 0) < 0 || setgroups(0, NULL) < 0) _exit(1);
	if (dup2(z->ctl, CTL) < 0) _exit(1);
	syscall(SYS_close_range, CTL + 1, ~0U, 0);
	sigset_t none;
	sigemptyset(&none);
	sigprocmask(SIG_SETMASK, &none, NULL);
	_exit(init_main(z->hostname));
}

static int write_file(const char *path, const char *data) {
	int fd = open(path, O_WRONLY | O_CLOEXEC);
	if (fd < 0) return -1;
	ssize_t n = write(fd, data, strlen(data));
	int e = errno;
	close(fd);
	errno = e;
	return n == (ssize_t)strlen(data) ? 0 : -1;
}

static int zspawn(uint32_t len, int32_t *pid_out) {
	if (len < 4 || len > 4 + 64 || nfds != 2) return EINVAL;
	uint32_t host;
	memcpy(&host, buf, 4);
	static struct zargs z;
	memset(&z, 0, sizeof z);
	memcpy(z.hostname, buf + 4, len - 4);
	z.ctl = fds[1];
	if (setns(fds[0], CLONE_NEWNET) < 0) return errno;
	int sp[2];
	if (pipe2(sp, O_CLOEXEC) < 0) return errno;
	z.syncr = sp[0];
	z.syncw = sp[1];
	pid_t pid = clone(zchild, zstack + sizeof zstack,
	                  CLONE_NEWUSER | CLONE_NEWNS | CLONE_NEWPID | CLONE_NEWIPC | CLONE_NEWUTS | CLONE_NEWCGROUP | SIGCHLD, &z);
	int e = errno;
	close(sp[0]);
	if (pid < 0) {
		close(sp[1]);
		return e;
	}
	char path[64], map[64];
	snprintf(map, sizeof map, "0 %u %u\n", host, 65536u);
	int err = 0;
	snprintf(path, sizeof path, "/proc/%d/uid_map", pid);
	if (write_file(path, map) < 0) err = errno;
	snprintf(path, sizeof path, "/proc/%d/gid_map", pid);
	if (!err && write_file(path, map) < 0) err = errno;
	if (!err && write(sp[1], "x", 1) != 1) err = errno;
	close(sp[1]); // a child that got no byte exits, and is reaped below
	*pid_out = pid;
	return err;
}

// The zygote has nothing to keep: its inits see their own sockets close.
static int zygote_gone(void) { return 0; }

static void zygote_handle(struct hdr *h) {
	if (h->type != ZSPAWN) {
		reply(h->id, ENOSYS, 0);
		return;
	}
	int32_t pid = 0;
	int e = zspawn(h->len, &pid);
	reply(h->id, e, e ? 0 : pid);
}

int main(int argc, char **argv) {
	if (argc > 1 && strcmp(argv[1], "--zygote") == 0) return serve(zygote_handle, zygote_gone);
	return init_main(argc > 1 ? argv[1] : NULL);
}
