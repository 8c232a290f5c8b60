// Package cgroup gives every sandbox its own control group: resource limits
// (memory, pids, cpu), a freezer to hold its processes still while the
// sandbox is checkpointed, and a way to kill every process it started,
// including those that called setsid or double-forked.
//
// A [Manager] detects the host's cgroup layout once (with
// github.com/containerd/cgroups/v3's Mode) and keeps all of its groups at
// /<Root>/<name> at the root of each hierarchy it uses (never below the
// server's own cgroup). Three layouts are supported:
//
//   - Unified (pure cgroup v2, /sys/fs/cgroup is cgroup2): one directory per
//     sandbox with memory.max, memory.swap.max, pids.max and cpu.max; the
//     controllers are enabled in cgroup.subtree_control of the hierarchy root
//     and of /<Root>, never in a sandbox's own group, so that a sandbox group
//     can hold processes and sub-groups at once. Freeze is cgroup.freeze,
//     kill is cgroup.kill, and both wait for the change on cgroup.events with
//     poll(2) POLLPRI instead of sleeping.
//   - Hybrid (v1 controllers under /sys/fs/cgroup/<controller>, a cgroup2
//     hierarchy without controllers at /sys/fs/cgroup/unified): limits go in
//     v1 groups of the memory, pids and cpu hierarchies; a v2 group in the
//     unified hierarchy tracks membership and gives the fast cgroup.freeze
//     and cgroup.kill. A controller that the unified hierarchy does offer is
//     used there instead of v1.
//   - Legacy (no cgroup2 anywhere, or a kernel without cgroup.kill): v1
//     groups only; freeze uses the v1 freezer (freezer.state) and kill is a
//     freeze, SIGKILL everything, thaw loop.
//
// The hierarchy that tracks membership (v2 when usable, else the v1 freezer)
// is the only one where [Cgroup.Sub] creates child groups: a sub-group lets
// one exec be killed without touching the sandbox's other processes, and
// inherits the sandbox's limits because its processes stay in the
// sandbox's limit groups.
//
// Beside /<Root>, where memory is a v1 controller, /<Root>.held is a memory
// group for the processes no sandbox's OOM kill may take, a checkpoint's
// templates ([Cgroup.HoldMemory], [Cgroup.JoinMemory]; held.go says why
// their memory still counts against their sandbox's limit).
//
// Processes enter a group with [Cgroup.Add], with the fds from
// [Cgroup.OpenProcs] (a process, even one inside a user and cgroup namespace
// whose root is unmapped, may write "0" to an fd that host root opened, to
// move itself), or, for the v2 hierarchy, with clone3 CLONE_INTO_CGROUP and
// [Cgroup.Dir].
package cgroup
