package sandbox

import (
	"sync"
	"time"

	"golang.org/x/sys/unix"
)

// RootCovered reports whether the sandbox's root is pending (not swapped in)
// and has its covers (overlay.Covers).
func (s *Sandbox) RootCovered() (pending, covered bool) {
	s.fs.mu.RLock()
	defer s.fs.mu.RUnlock()
	return s.fs.root >= 0, s.fs.covered.Load()
}

// AheadPids waits for the job forking copies ahead, if one runs, and
// returns the host pids of the copies forked ahead for checkpoint ck, if
// the sandbox keeps copies for it.
func (s *Sandbox) AheadPids(ck string) []int {
	return s.procs.AheadPids(ck)
}

// SetAheadTook sets how long the last job forking copies ahead took, which
// the next restore compares the agent's step with (forkAhead). Call it with
// no job running (AheadPids waits for one).
func (s *Sandbox) SetAheadTook(d time.Duration) { s.procs.SetAheadTook(d) }

// TreeCopies is the number of process trees the sandbox restored by
// copies of their templates.
func (s *Sandbox) TreeCopies() int64 { return s.procs.TreeCopies() }

// TreeStashes is the number of tree templates the sandbox made with the
// root's memory stashed in the child's template.
func (s *Sandbox) TreeStashes() int64 { return s.procs.TreeStashes() }

// NoMemoryRoom makes checkpoints find no room for memory of the
// sandboxes' own: a tree's root is not stashed.
func (r *Runtime) NoMemoryRoom() { r.hooks.noRoom = true }

// ForkAheadAlways makes the runtime fork copies ahead even after restores
// that come back to back, so that tests do not depend on how long their
// steps take against the job.
func (r *Runtime) ForkAheadAlways() { r.hooks.aheadAlways = true }

// OnCPUBoost makes every checkpoint, restore or fork that raises its
// sandbox's CPU weight call f right after it did.
func (r *Runtime) OnCPUBoost(f func()) { r.hooks.onBoost = f }

// OnSettleKilled makes every restore that killed processes call f with how
// it went on: "gone" (they were), "slow" (not freeing memory fast enough to
// be worth going on without them: it waited for them to be gone),
// "exiting" (it went on, each thread of theirs in its exit), "waited" (the
// limits had no room), "sockets" (they held a socket of their own) or
// "timeout".
func (r *Runtime) OnSettleKilled(f func(how string)) { r.hooks.onSettle = f }

// SetKilledGrace sets how long a restore waits for the processes it killed
// to be gone before it looks at how fast they free memory (killedGrace).
func (r *Runtime) SetKilledGrace(d time.Duration) { r.hooks.killedGrace = d }

// SetStopWait bounds how long a checkpoint waits for the sandbox's
// processes to stop.
func (r *Runtime) SetStopWait(d time.Duration) { r.hooks.stopWait = d }

// OnLimitsRoom makes every restore that judges the room its sandbox's
// memory limit leaves beside the processes it killed call f with the limit
// and the use it read.
func (r *Runtime) OnLimitsRoom(f func(limit, current int64)) { r.hooks.onRoom = f }

// ThreadExiting reports whether thread tid is exiting, a zombie or gone.
var ThreadExiting = threadExiting

// CommandGroup returns the directory of the sandbox's command group in the
// tracking hierarchy.
func (s *Sandbox) CommandGroup() string {
	return s.workGroup().Dirs()[0]
}

// ReuseReady reports whether a killed command group waits to serve again.
func (s *Sandbox) ReuseReady() bool { return len(s.cmds.reuseW) > 0 }

// KilledGroups returns the directories of the killed command groups a
// restore would wait for.
func (s *Sandbox) KilledGroups() []string {
	s.op.RLock()
	defer s.op.RUnlock()
	s.cmds.mu.Lock()
	defer s.cmds.mu.Unlock()
	var out []string
	for _, g := range s.cmds.killed {
		out = append(out, g.Dirs()[0])
	}
	return out
}

// FDsPerSandbox is what admission charges an idle sandbox in descriptors,
// and FDsPerHotSandbox each sandbox the hot set may hold.
const (
	FDsPerSandbox    = fdsPerSandbox
	FDsPerHotSandbox = fdsPerHotSandbox
)

// Settle waits until the root the sandbox's last swap replaced is
// detached.
func (s *Sandbox) Settle() { s.init.Settled() }

// Cool makes the sandbox give up its kept descriptors now (hot.go), and
// reports whether it could (not while an operation runs in it).
func (s *Sandbox) Cool() bool { return s.cool() }

// HotSandboxes reports how many sandboxes the hot set holds.
func (r *Runtime) HotSandboxes() int { return r.hot.Len() }

// HotFDs is what admission charges for the hot set.
func (r *Runtime) HotFDs() int { return r.hot.max * fdsPerHotSandbox }

// LayerMounts returns the layer mounts the runtime holds.
func (r *Runtime) LayerMounts() int { return r.layers.Mounts() }

// OpenFDs counts the process's open descriptors.
func OpenFDs() (int, error) { return openFDs() }

// SetCaps replaces the caps in force, before the runtime is used
// concurrently.
func (r *Runtime) SetCaps(c Caps) { r.adm.caps = c }

// CountFDs counts the server's descriptors as admission does and returns
// the count, which admission uses for fdRecount.
func (r *Runtime) CountFDs() int {
	r.adm.fdsAt.Store(0)
	_ = r.countFDs()
	r.adm.mu.Lock()
	defer r.adm.mu.Unlock()
	return r.adm.fds
}

// KillTemplates kills the templates of checkpoint ck from outside the
// sandbox (as the OOM killer or the host's root could), and returns how
// many it killed.
func (r *Runtime) KillTemplates(ck string) int {
	c, err := r.lookup(ck)
	if err != nil {
		return 0
	}
	n := 0
	for _, p := range c.Procs {
		if unix.Kill(p.HostPid, unix.SIGKILL) == nil {
			n++
		}
	}
	return n
}

// OnWarm makes the warm pool call f with how many inits it holds after
// each pass that filled it as far as its target and the caps allow.
func (r *Runtime) OnWarm(f func(ready int)) { r.hooks.onWarm.Store(&f) }

// KickWarm asks the warm pool for a pass.
func (r *Runtime) KickWarm() { r.kickWarm() }

// WarmWanted is the warm pool's target.
func (r *Runtime) WarmWanted() int { return r.warmWanted(time.Now()) }

// HoldRetirement takes every teardown slot, so that sandboxes closed from
// now on stay retiring until the returned function (idempotent) gives the
// slots back.
func (r *Runtime) HoldRetirement() (release func()) {
	n := cap(r.ret.slots)
	for range n {
		r.ret.slots <- struct{}{}
	}
	return sync.OnceFunc(func() {
		for range n {
			<-r.ret.slots
		}
	})
}

// CheckpointShm returns the layer holding checkpoint id's copy of /dev/shm
// ("" for none).
func (r *Runtime) CheckpointShm(id string) string {
	r.mu.Lock()
	defer r.mu.Unlock()
	if c := r.ckpts[id]; c != nil {
		return c.Shm
	}
	return ""
}

// ShmEmpty looks at the sandbox's /dev/shm as a restore of template copies
// does once processes ran, and reports whether it is empty.
func (s *Sandbox) ShmEmpty() (bool, error) {
	fd, st, err := s.openShm()
	if err != nil {
		return false, err
	}
	defer unix.Close(fd)
	return s.shmEmpty(fd, &st)
}

// OnDigestWalk makes every files index the runtime builds call f with the
// checkpoint, how many layers it applied over the index it started from and
// how many entries it walked in them. Set it before the runtime is used.
func (r *Runtime) OnDigestWalk(f func(id string, layers, entries int)) { r.hooks.onDigestWalk = f }

// OnFlattened makes every flattening recorded call f with its checkpoint.
// Set it before the runtime is used.
func (r *Runtime) OnFlattened(f func(id string)) { r.hooks.onFlattened = f }

// HoldFlattening keeps the background flattener from starting a merge
// until the returned function (idempotent) lets it go.
func (r *Runtime) HoldFlattening() (release func()) {
	r.jobs.flatSem <- struct{}{}
	var once sync.Once
	return func() { once.Do(func() { <-r.jobs.flatSem }) }
}

// DigestIndexes returns how many checkpoints' state digests and stacks' indexes the runtime
// keeps in memory.
func (r *Runtime) DigestIndexes() (ckpts, stacks int) {
	sd := r.jobs.digests
	sd.mu.Lock()
	defer sd.mu.Unlock()
	return len(sd.ckpts), len(sd.stacks)
}

// SessionShell returns the host pid session name keeps for its shell, and the one hostPidIn
// finds now among the session group's processes for pid nsPid of the sandbox.
func (s *Sandbox) SessionShell(name string, nsPid int) (kept, found int, err error) {
	s.mu.Lock()
	se := s.sessions[name]
	s.mu.Unlock()
	if se == nil {
		return 0, 0, ErrSessionEnded
	}
	found, err = s.hostPidIn(se.cg, nsPid)
	return se.hostPid, found, err
}
