// Package sandbox runs isolated Linux sandboxes whose whole filesystem state
// can be checkpointed, rolled back and forked without copying a file
// (docs/PERFORMANCE.md has what each costs).
//
// A sandbox is a resident init (sandbox/initproc, pid 1) in its own user,
// mount, pid, ipc, uts, cgroup and net namespaces, with a cgroup of its own
// (sandbox/cgroup) and a root that is an overlay (sandbox/overlay) of
// read-only layers — the image's (sandbox/image), then delta layers sealed by
// earlier checkpoints — under one writable upper (sandbox/layers).
//
// The life of a checkpoint:
//
//   - Checkpoint, fast path (no process but the init): the upper is sealed
//     (its tmpfs remounted read-only), becomes the top lower of a new overlay
//     with a fresh upper, and the new overlay is swapped in as the root
//     (pivot_root, done from outside; sandbox/launch). The checkpoint is the
//     list of delta layers, which no one can change any more.
//   - Checkpoint with live processes (background commands, sessions): they
//     may hold fds or a cwd in the current upper, which pivot_root would not
//     re-point, so the upper is not sealed in place: the processes are
//     stopped (the command group frozen, or each process seized with ptrace
//     when the processes are captured too; sandbox/procstate), a copy of the
//     upper is sealed as the checkpoint's top layer, and the sandbox goes on
//     with the upper it had.
//   - /dev/shm, a tmpfs of each sandbox's own outside the overlay, is copied
//     into a sealed layer of the checkpoint's own when it is not empty, at
//     the instant of the upper (shm.go); restores and forks write it back.
//   - Restore: every process but the init is killed, then an overlay of the
//     checkpoint's layers with a fresh upper is swapped in. Any sandbox of the
//     same image can restore any checkpoint, whichever sandbox made it.
//   - Fork: new sandboxes start directly on the checkpoint's layers.
//   - Checkpoints and their layers are reference counted and persisted under
//     the data directory; they outlive their sandbox and a restart of the
//     server, until released or expired.
//
// # Structure
//
// A Runtime holds the images, the checkpoints (their records, layers and
// CRIU images) and the live sandboxes. A Sandbox's state is in three parts,
// each owning its fields and its lock:
//
//   - the root filesystem (rootFS, rootfs.go): the delta layers under the
//     upper, the upper, the next upper prepared ahead, a root not yet
//     swapped into the init's mount namespace and its covers; the root
//     switch of a checkpoint or restore, and the swap of a pending root
//     before a command runs (materialize);
//   - the command groups (cmdGroups, cmdgroups.go): the cgroup every
//     command, session and background process runs in, the groups a restore
//     killed whose processes may still be exiting (waited for, or settled,
//     before copies run or the next command starts), groups made ahead or
//     kept to serve again, their control files kept open, the CPU boost;
//   - the process state (sandbox/procstate): the templates of the
//     sandbox's checkpoints, the CRIU trees, the copies forked ahead for
//     the next restore, the CRIU images made from templates, and what the
//     huge-page worker was handed. It reaches its sandbox through
//     procstate.Host, which procHost (prochost.go) implements; the runtime
//     decides which sandbox makes a checkpoint's images (procs_image.go)
//     and runs the huge-page worker (procstate.Folder).
//
// The Sandbox itself keeps what belongs to no part: its identity, its init
// and cgroup, its sessions (session.go), the checkpoint it descends from.
//
// # Locks
//
// Locks are taken in this order (a lock is never taken while one below it
// is held):
//
//  1. Sandbox.op: held for writing by a state change (Checkpoint, Restore,
//     Destroy, Freeze, Thaw), for reading by commands and file actions.
//  2. rootFS.mu: held for writing across a root switch (under op, written)
//     and the swap of a pending root (under op, read); for reading across a
//     file action. rootFS.coverMu is taken under it (read).
//  3. procstate.State.run: one ptrace tracer of the templates at a time (a
//     restore's copies, a job forking copies ahead, copies saved as CRIU
//     images).
//  4. procstate.State.forkMu: held while a copy is cloned from a template,
//     and while the root is swapped (a task cloned during a swap keeps the
//     old root; State.WithoutForks); taken under rootFS.mu or State.run, it
//     takes nothing.
//  5. cmdGroups.mu: the command groups; under rootFS.mu when a restore
//     looks whether the killed processes are quiet (keepRoot), under
//     State.run when copies are moved in (procstate.Host.MoveCopy).
//  6. Runtime.mu: the runtime's images, checkpoints and sandboxes.
//  7. admission.mu: reservations, descriptor counts, checkpoint heads and
//     uid ranges (admission.go); taken under Runtime.mu or alone, it takes
//     nothing.
//  8. procstate.State.mu: templates, copies forked ahead, processes seen
//     live.
//     8a. stateDigests.mu: checkpoints' state digests and indexes (digest_jobs.go); taken under
//     Runtime.mu or alone, it takes nothing.
//  9. Sandbox.mu and session.mu: sessions, the abort context, group names;
//     they take nothing.
//
// A copy between sandboxes (CopyFrom) holds the op and then the rootFS.mu of
// both, each read, its source's before its destination's; its destination is
// a sandbox no other copy reads from meanwhile (a pristine verifier's), so no
// two copies wait for each other.
//
// Fields are annotated with the lock that guards them (+checklocks), and
// functions with the locks they need held; `go vet -vettool=checklocks`
// checks both.
package sandbox
