// Package procstate keeps the processes of a sandbox's checkpoints: the
// templates of the fast path, the CRIU trees of the general path, the
// copies forked ahead for the next restore, the CRIU images made from
// templates, and the folding of processes into huge pages. It works for
// one sandbox, its Host, through the few things it needs of it.
//
// Process checkpoints, fast path (template fork; see docs/ARCHITECTURE.md).
//
// At a checkpoint with live processes (Capture), every process of the
// sandbox's command group, each of its threads, is seized with ptrace and
// interrupted, not frozen, and the group is listed again until no new
// process appears (a stopped process cannot fork). A child of vfork that
// has not called exec yet, and its parent, which the kernel holds until that
// exec where no ptrace stop reaches it, are left to run to the exec; the
// wait for the group to stop is bounded (stopWait), so a process that never
// stops fails the checkpoint rather than holding it. The trees of the general
// path are dumped by criu, which leaves them stopped. While they are all
// stopped the upper is copied and sealed (the live processes keep the upper
// they have), so files and processes are of one instant. Then each seized
// process is made to clone itself (sandbox/ptfork): the copy — the template
// — is moved into a frozen cgroup of the checkpoint's own ("t<n>", a
// sub-group of the sandbox's group beside the command group, so it counts
// against the sandbox's memory and pids limits) before it is detached, so
// it never runs; the live process is detached and goes on. A template's
// root is the sandbox's root, and every root swap (pivot_root) re-points
// the roots of all tasks whose root is the old root, so a template's root
// follows the sandbox's live root.
//
// At an in-place restore, after the root swap, each template is seized, its
// group thawed (it is in ptrace-stop, so it cannot run), and made to clone
// itself again; the group is frozen again before the template is detached.
// The new copy is fixed up by system calls injected into it, so they run
// with its own credentials and meet its seccomp filter: chdir to its cwd's
// path in the restored root; every regular file it had open in the
// sandbox's root is reopened by path with the same flags and offset (so it
// reaches the restored state, not the discarded upper); a session's shell
// gets fresh pipes for stdin, stdout and stderr (the server takes its ends
// with pidfd_getfd); the descriptions that are the process's alone (a pipe
// to itself, an eventfd, a timerfd, an epoll instance) are made anew in the
// state the capture recorded, a connected TCP socket is reset, a listening
// socket the template let go of listens anew where it did (private.go).
// Other descriptions (the host's /dev/null, pipes between processes, a
// listening socket several processes share) stay shared with the
// template, which is frozen.
//
// A template is a copy of one process, every thread of it (sandbox/ptfork):
// process trees (a command with children), processes of more than
// ptfork.MaxThreads threads, processes with a writable shared file mapping
// or with a root of their own take the general path (criu.go); an
// open deleted file is refused with ErrProcesses naming the process.
// Templates live in the sandbox's pid namespace, so only the sandbox that
// made them copies them; other sandboxes and forks get CRIU images made from
// them (image.go).

package procstate
