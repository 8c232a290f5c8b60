package sandbox

import (
	"errors"
	"sync"
	"time"

	"golang.org/x/sys/unix"

	"github.com/deltagym/deltagym/sandbox/cgroup"
	"github.com/deltagym/deltagym/sandbox/launch"
)

// Warm inits. Starting a sandbox's init — a clone into new user, mount,
// pid, ipc, uts and cgroup namespaces, its id maps, its cgroups — is most
// of what creating a sandbox costs (BenchmarkFork64 times fan-outs with
// inits ready and without), and none of it depends on the checkpoint the
// sandbox starts from. The runtime keeps ready inits, each with its sandbox
// id, uid range, net namespace and cgroups, so that a fork fan-out only
// builds and swaps in roots. The pool's target is the largest fan-out asked
// for (Fork of n, at most Config.InitPool): a trainer forks groups of one
// size again and again, and the pool is refilled in the background between
// them. The target halves, down to warmFloor, for every warmDecay in which
// no fan-out asked for it, freeing what it held; the pool grows only in the
// room the admission caps leave (warmRoom), and a request the caps would
// refuse frees it first (admitSandboxes). Close empties it. Inits with a
// host name other than the default are started on demand.

// warmInit is a sandbox-to-be, waiting for a root. It holds one of the
// server's descriptors, its init's control socket: its namespaces are
// reached through the init (launch.Init.NS) when needed.
type warmInit struct {
	id     string
	hostID int
	cg     *cgroup.Cgroup
	work   *cgroup.Cgroup
	init   *launch.Init
}

const defaultHostname = "sandbox"

// startInit starts an init for sandbox id with the default host name
// unless hostname is set. On error nothing is left.
func (r *Runtime) startInit(id, hostname string) (_ *warmInit, err error) {
	w := &warmInit{id: id}
	netns := -1
	defer func() {
		if err != nil {
			w.free(r)
			if netns >= 0 {
				unix.Close(netns) // it may hold what a failed init left
			}
		}
	}()
	if w.hostID, err = r.takeRange(); err != nil {
		w.hostID = 0
		return nil, err
	}
	if netns, err = r.net.Get(); err != nil {
		netns = -1
		return nil, errors.Join(errors.New("creating net namespace"), err)
	}
	if w.cg, err = r.cg.Create(id, cgroup.Limits{CPUWeight: r.cfg.CPUWeight}); err != nil {
		w.cg = nil
		return nil, err
	}
	if w.work, err = w.cg.Sub("w"); err != nil {
		return nil, err
	}
	if hostname == "" {
		hostname = defaultHostname
	}
	if w.init, err = r.spawn.Start(launch.Config{HostID: w.hostID, NetNS: netns, Hostname: hostname}); err != nil {
		w.init = nil
		return nil, err
	}
	unix.Close(netns) // the init holds it now
	netns = -1
	if err = w.cg.Add(w.init.Pid); err != nil {
		return nil, err
	}
	return w, nil
}

// free ends the init and gives back what it holds: its net namespace goes
// back to the pool (r.stopInit).
func (w *warmInit) free(r *Runtime) {
	if w.init != nil {
		_ = r.stopInit(w.init)
	}
	if w.cg != nil {
		_ = w.cg.Delete()
	}
	if w.hostID != 0 {
		r.putRange(w.hostID)
	}
}

// stopInit ends an init and gives its net namespace back to the pool for
// reuse (launch.NetPool.Put), taken from the init before it ends; an init
// already gone leaves it to the kernel.
func (r *Runtime) stopInit(in *launch.Init) error {
	netns, nerr := in.NS(unix.PIDFD_GET_NET_NAMESPACE)
	err := in.Stop()
	if nerr == nil {
		r.net.Put(netns) // the init is gone: nothing is left in it
	}
	return err
}

// takeInit returns a warm init for a sandbox with the given host name, or
// starts one.
func (r *Runtime) takeInit(hostname string) (*warmInit, error) {
	for hostname == "" || hostname == defaultHostname {
		var w *warmInit
		select {
		case w = <-r.warm.ready:
		default:
		}
		if w == nil {
			break
		}
		r.kickWarm()
		select {
		case <-w.init.Done():
			w.free(r) // died while waiting: take another
		default:
			return w, nil
		}
	}
	r.kickWarm()
	return r.startInit(r.newID("sb"), hostname)
}

// maxFork is the largest fan-out of one Fork.
const maxFork = 1024

// The pool's decay: a target above warmFloor halves after warmDecay
// without a fan-out that asked for it.
const (
	warmDecay = 2 * time.Minute
	warmFloor = 64
)

// wantWarm raises the pool's target to n inits (at most Config.InitPool)
// and restarts its decay if n reaches the target.
func (r *Runtime) wantWarm(n int) {
	n = min(n, r.cfg.InitPool)
	w := &r.warm
	w.mu.Lock()
	if n >= w.target {
		w.target, w.asked = n, time.Now()
	}
	w.mu.Unlock()
	r.kickWarm()
}

// warmWanted returns the pool's target, halving it first for every
// warmDecay since a fan-out last asked for it.
func (r *Runtime) warmWanted(now time.Time) int {
	w := &r.warm
	w.mu.Lock()
	defer w.mu.Unlock()
	for w.target > warmFloor && now.Sub(w.asked) >= warmDecay {
		w.target = max(w.target/2, warmFloor)
		w.asked = w.asked.Add(warmDecay)
	}
	return w.target
}

// warmRoom reports whether the caps leave room for one more warm init
// beside the live sandboxes, those admitted and not made yet, and the
// pool: it takes a sandbox's descriptors, and a sandbox's place since it
// becomes one.
func (r *Runtime) warmRoom() bool {
	a := &r.adm
	if a.caps.Descriptors > 0 && r.countFDs() != nil {
		return false
	}
	r.mu.Lock()
	defer r.mu.Unlock()
	a.mu.Lock()
	defer a.mu.Unlock()
	if c := a.caps.Sandboxes; c > 0 && len(r.sandboxes)+a.reserved+len(r.warm.ready)+1 > c {
		return false
	}
	c := a.caps.Descriptors
	return c <= 0 || r.descriptorsUsedLocked()+fdsPerSandbox <= c
}

// fdsMadeWarm charges a warm init to the descriptors made since the last
// count, as register charges a sandbox.
func (r *Runtime) fdsMadeWarm() {
	r.adm.mu.Lock()
	r.adm.fdsMade++
	r.adm.mu.Unlock()
}

// shedWarm frees up to n of the pool's inits and returns how many it freed.
func (r *Runtime) shedWarm(n int) int {
	freed := 0
	for ; freed < n; freed++ {
		select {
		case w := <-r.warm.ready:
			w.free(r)
		default:
			return freed
		}
	}
	return freed
}

func (r *Runtime) kickWarm() {
	select {
	case r.warm.kick <- struct{}{}:
	default:
	}
}

// warmLoop keeps the pool at its target: it refills the pool when kicked
// and, every quarter of warmDecay, frees what a decayed target no longer
// holds.
func (r *Runtime) warmLoop() {
	defer r.wg.Done()
	tick := time.NewTicker(warmDecay / 4)
	defer tick.Stop()
	for {
		select {
		case <-r.done:
			return
		case <-r.warm.kick:
		case <-tick.C:
		}
		if extra := len(r.warm.ready) - r.warmWanted(time.Now()); extra > 0 {
			r.shedWarm(extra)
		}
		if !r.refillWarm() {
			return
		}
		if f := r.hooks.onWarm.Load(); f != nil {
			(*f)(len(r.warm.ready))
		}
	}
}

// refillWarm starts inits until the pool holds its target or the caps
// leave no room; it returns false when the runtime is closing.
func (r *Runtime) refillWarm() bool {
	for len(r.warm.ready) < r.warmWanted(time.Now()) && r.warmRoom() {
		w, err := r.startInit(r.newID("sb"), "")
		if err != nil {
			r.log.Warn("starting a warm sandbox init", "err", err)
			select {
			case <-r.done:
				return false
			case <-time.After(time.Second): // back off; demand starts inits itself meanwhile
			}
			continue
		}
		r.fdsMadeWarm()
		select {
		case r.warm.ready <- w:
		case <-r.done:
			w.free(r)
			return false
		default:
			w.free(r)
		}
	}
	return true
}

// drainWarm frees the pool's inits. The warm loop has stopped.
func (r *Runtime) drainWarm() {
	for {
		select {
		case w := <-r.warm.ready:
			w.free(r)
		default:
			return
		}
	}
}

// WarmInits reports how many ready inits the runtime holds.
func (r *Runtime) WarmInits() int { return len(r.warm.ready) }

// forkParallel is how many children of a Fork are made at once. Making one
// is mostly waiting (mount-table locks, RCU grace periods, the root swap's
// round trips), not CPU, so more than the cores run at once.
var forkParallel = 4

// warmInits is the pool of ready inits: ready holds them, a send on kick asks the filler to top
// it up.
type warmInits struct {
	ready chan *warmInit
	kick  chan struct{}
	mu    sync.Mutex
	// target is how many inits the pool keeps; asked, when a fan-out last
	// asked for that many (or the decay last halved it).
	// +checklocks:mu
	target int
	// +checklocks:mu
	asked time.Time
}
