package securitytest

import (
	"fmt"
	"testing"
)

// Namespace flags of clone and unshare (linux/sched.h), and SIGCHLD for clone's exit signal.
const (
	cloneNewTime   = 0x80
	cloneNewNS     = 0x20000
	cloneNewCgroup = 0x02000000
	cloneNewUTS    = 0x04000000
	cloneNewIPC    = 0x08000000
	cloneNewUser   = 0x10000000
	cloneNewPID    = 0x20000000
	cloneNewNet    = 0x40000000
	sigchld        = 17
)

var nsFlags = []struct {
	name string
	flag int
}{
	{"CLONE_NEWNS", cloneNewNS}, {"CLONE_NEWCGROUP", cloneNewCgroup}, {"CLONE_NEWUTS", cloneNewUTS},
	{"CLONE_NEWIPC", cloneNewIPC}, {"CLONE_NEWUSER", cloneNewUser}, {"CLONE_NEWPID", cloneNewPID},
	{"CLONE_NEWNET", cloneNewNet}, {"CLONE_NEWUSER|CLONE_NEWNET", cloneNewUser | cloneNewNet},
}

// Mounts: no command mounts, unmounts, pivots or attaches anything, by the old or the new mount
// API, and the sandbox's mount table is the same afterwards.
func TestAttackMount(t *testing.T) {
	s := begin(t)
	sb := s.sandbox(t)
	before := s.sh(t, sb, "cat /proc/self/mountinfo")
	for _, cmd := range []string{
		"mount -t tmpfs none /mnt", "mount --bind /etc /mnt", "mount -o remount,rw /proc/sys",
		"mount -t proc proc /mnt", "umount -l /proc", "umount /dev",
	} {
		if res := s.exec(t, sb, cmd); res.OK() {
			t.Errorf("%s: succeeded", cmd)
		}
	}
	s.syscalls(t, sb, []syscallCase{
		{"mount tmpfs", []string{"165", "s:none", "s:/mnt", "s:tmpfs", "0", "0"}, []string{"EPERM"}},
		{"umount2 /proc", []string{"166", "s:/proc", "2"}, []string{"EPERM"}},
		{"pivot_root", []string{"155", "s:/tmp", "s:/tmp"}, []string{"EPERM"}},
		{"open_tree clone", []string{"428", "-100", "s:/", "1"}, []string{"EPERM"}},
		{"move_mount", []string{"429", "-100", "s:/tmp", "-100", "s:/mnt", "0"}, []string{"EPERM"}},
		{"fsopen tmpfs", []string{"430", "s:tmpfs", "0"}, []string{"EPERM"}},
		{"fspick /", []string{"433", "-100", "s:/", "0"}, []string{"EPERM"}},
		{"mount_setattr", []string{"442", "-100", "s:/", "0", "b:32", "32"}, []string{"EPERM"}},
	})
	if after := s.sh(t, sb, "cat /proc/self/mountinfo"); after != before {
		t.Errorf("the mount table changed:\n%s\nafter:\n%s", before, after)
	}
}

// Namespaces: unshare, setns, and clone with any namespace flag are refused (EPERM); clone3,
// whose flags a seccomp filter cannot read, is ENOSYS, so that libc falls back on clone.
func TestAttackUnshare(t *testing.T) {
	s := begin(t)
	sb := s.sandbox(t)
	var cases []syscallCase
	for _, f := range append(nsFlags, struct {
		name string
		flag int
	}{"CLONE_NEWTIME", cloneNewTime}) {
		cases = append(cases, syscallCase{"unshare " + f.name, []string{"272", fmt.Sprint(f.flag)}, []string{"EPERM"}})
		if f.flag != cloneNewTime { // in clone's flags, 0x80 is part of the exit signal
			cases = append(cases, syscallCase{"clone " + f.name,
				[]string{"56", fmt.Sprint(f.flag | sigchld), "0", "0", "0", "0"}, []string{"EPERM"}})
		}
		// struct clone_args: flags, pidfd, child_tid, parent_tid, exit_signal, stack,
		// stack_size, tls, set_tid, set_tid_size, cgroup (88 bytes).
		cases = append(cases, syscallCase{"clone3 " + f.name,
			[]string{"435", fmt.Sprintf("q:%d,0,0,0,%d,0,0,0,0,0,0", f.flag, sigchld), "88"}, []string{"ENOSYS"}})
	}
	cases = append(cases, syscallCase{"setns", []string{"308", "0", "0"}, []string{"EPERM"}})
	s.syscalls(t, sb, cases)
	for _, cmd := range []string{"unshare -U true", "unshare -r id", "unshare -n true", "unshare -m true", "unshare -fp true", "nsenter -t 1 -n true"} {
		if res := s.exec(t, sb, cmd); res.OK() {
			t.Errorf("%s: succeeded", cmd)
		}
	}
}

// chroot is refused, by the call and by the program.
func TestAttackChroot(t *testing.T) {
	s := begin(t)
	sb := s.sandbox(t)
	s.sh(t, sb, "mkdir -p /tmp/jail")
	s.syscalls(t, sb, []syscallCase{
		{"chroot /tmp/jail", []string{"161", "s:/tmp/jail"}, []string{"EPERM"}},
		{"chroot /", []string{"161", "s:/"}, []string{"EPERM"}},
	})
	if res := s.exec(t, sb, "chroot / true"); res.OK() {
		t.Errorf("chroot / true: succeeded")
	}
}
