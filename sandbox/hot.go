package sandbox

import (
	"container/list"
	"sync"

	"golang.org/x/sys/unix"
)

// Hot and cold sandboxes. What a sandbox keeps open to be fast — the
// idmapped clones of its layers and of its upper, the next upper prepared
// ahead, the control files of its command groups and of its template group,
// its CPU boost — would,
// for every sandbox alive, run the server out of descriptors long before
// memory or pids (RLIMIT_NOFILE's hard limit is often 20,000 or less, which
// an unprivileged server cannot raise). So only the sandboxes used last
// keep them: a runtime-wide LRU of at most Config.HotSandboxes sandboxes
// (hotSet), each charged fdsPerHotSandbox by admission, and the least
// recently used beyond it gives them up (Sandbox.cool), which a background
// loop does. A cold sandbox holds one descriptor of the server, its init's
// control socket (and a root not swapped in yet, if its last state change
// left one), and opens what it needs again when next used: its
// namespaces through its init's pidfd (launch.Init.NS), its layer clones
// and control files by their paths, which are the server's own.
//
// A sandbox joins the set when it is made (a fork fan-out leaves its
// children's clones to the cooler) and when an operation begins in it
// (beginOp, beginExec). It cools only with op write-held, taken by TryLock: nothing
// runs in it then (a sandbox in use is skipped and stays in the set), and
// the background jobs that use its descriptors outside op are waited for
// (the spare upper's, the command group's made ahead) or see that it is
// cold (retireWork).

// fdsPerHotSandbox is what admission charges for each sandbox of the hot
// set: the descriptors a sandbox in use keeps beside its control socket
// (TestAdmissionCharges measures it), the few it opens for a moment (a
// pidfd and a namespace) and a command's pipes.
const fdsPerHotSandbox = 16

// Bounds of the derived hot set (hotSandboxes).
const (
	minHotSandboxes = 16
	maxHotSandboxes = 4096
	// noCapHotSandboxes is the hot set without a descriptor cap.
	noCapHotSandboxes = 1024
)

// hotSandboxes is the size of the hot set for configured size n (0:
// derived; negative: no bound, returned as 0) and descriptor cap fds (0:
// none): a quarter of the cap, fdsPerHotSandbox each.
func hotSandboxes(n, fds int) int {
	switch {
	case n < 0:
		return 0
	case n > 0:
		return n
	case fds <= 0:
		return noCapHotSandboxes
	}
	return min(max(fds/4/fdsPerHotSandbox, minHotSandboxes), maxHotSandboxes)
}

// hotSet is the LRU of the sandboxes that keep their descriptors. Its mu is
// taken alone or under any sandbox lock, and takes no other lock.
type hotSet struct {
	max  int // 0: no bound
	mu   sync.Mutex
	kick chan struct{}
	// lru holds *Sandbox, most recently used first; at finds its element.
	// +checklocks:mu
	lru list.List
	// +checklocks:mu
	at map[*Sandbox]*list.Element
}

func newHotSet(max int) *hotSet {
	return &hotSet{max: max, kick: make(chan struct{}, 1), at: map[*Sandbox]*list.Element{}}
}

// touch makes s the most recently used sandbox, and wakes the cooler if the
// set is over its bound.
func (h *hotSet) touch(s *Sandbox) {
	if h.max <= 0 || !s.live.Load() {
		return
	}
	h.mu.Lock()
	if e, ok := h.at[s]; ok {
		h.lru.MoveToFront(e)
	} else {
		h.at[s] = h.lru.PushFront(s)
	}
	over := h.lru.Len() > h.max
	h.mu.Unlock()
	s.cold.Store(false)
	if over {
		select {
		case h.kick <- struct{}{}:
		default:
		}
	}
}

// forget takes s out of the set (a sandbox torn down).
func (h *hotSet) forget(s *Sandbox) {
	h.mu.Lock()
	if e, ok := h.at[s]; ok {
		h.lru.Remove(e)
		delete(h.at, s)
	}
	h.mu.Unlock()
}

// coldest takes the least recently used sandbox out of the set if the set
// is over its bound; nil if not.
func (h *hotSet) coldest() *Sandbox {
	h.mu.Lock()
	defer h.mu.Unlock()
	if h.lru.Len() <= h.max {
		return nil
	}
	e := h.lru.Back()
	h.lru.Remove(e)
	s := e.Value.(*Sandbox)
	delete(h.at, s)
	return s
}

// putBack returns sandboxes found in use to the cold end of the set,
// without waking the cooler: the next touch tries them again.
func (h *hotSet) putBack(busy []*Sandbox) {
	h.mu.Lock()
	defer h.mu.Unlock()
	for _, s := range busy {
		if _, ok := h.at[s]; !ok {
			h.at[s] = h.lru.PushBack(s)
		}
	}
}

// Len reports how many sandboxes the set holds.
func (h *hotSet) Len() int {
	h.mu.Lock()
	defer h.mu.Unlock()
	return h.lru.Len()
}

// coolLoop cools the least recently used sandboxes while the hot set is
// over its bound.
func (r *Runtime) coolLoop() {
	defer r.wg.Done()
	for {
		select {
		case <-r.done:
			return
		case <-r.hot.kick:
		}
		var busy []*Sandbox
		for s := r.hot.coldest(); s != nil; s = r.hot.coldest() {
			if !s.cool() {
				busy = append(busy, s)
			}
		}
		r.hot.putBack(busy)
	}
}

// cool gives up the descriptors the sandbox keeps to be fast, and reports
// whether it could: not while an operation holds op.
// +checklocksignore: op is taken with TryLock, which checklocks does not follow.
func (s *Sandbox) cool() bool {
	if !s.op.TryLock() {
		return false
	}
	defer s.op.Unlock()
	s.mu.Lock()
	closed := s.closed
	s.mu.Unlock()
	if closed {
		return true // its teardown closes everything
	}
	closeClones(s.coolHeld())
	// The template group's cgroup.freeze, under procstate's run lock: a
	// job forking copies ahead may hold it for a moment.
	s.procs.Close()
	return true
}

// coolHeld is cool for a caller that holds op. It returns the idmapped
// clones it took, for the caller to close (closeClones).
func (s *Sandbox) coolHeld() []int {
	s.fs.mu.Lock()
	fds := s.coolFS()
	s.fs.mu.Unlock()
	s.cmds.mu.Lock()
	s.coolCmds()
	s.cmds.mu.Unlock()
	return fds
}

// coolFS takes the idmapped clones of the layers and of the upper, which
// the caller closes, and drops the next upper prepared ahead (waiting for
// its job, which may use the clones); a root not swapped in yet stays: it
// is the sandbox's state.
// +checklocks:s.fs.mu
func (s *Sandbox) coolFS() []int {
	s.dropSpare()
	fds := make([]int, 0, len(s.fs.idmapped)+2)
	for k, fd := range s.fs.idmapped {
		fds = append(fds, fd)
		delete(s.fs.idmapped, k)
	}
	if s.fs.upperFD >= 0 {
		fds = append(fds, s.fs.upperFD)
		s.fs.upperFD = -1
	}
	if s.fs.nsUpper.id != "" && s.fs.nsUpper.fd >= 0 {
		fds = append(fds, s.fs.nsUpper.fd)
		s.fs.nsUpper.fd = -1
	}
	return fds
}

// closeClones closes idmapped clones. Each close of a detached mount's last
// descriptor unmounts it and waits for an RCU grace period, which the
// cooler pays, off the sandboxes' paths.
func closeClones(fds []int) {
	for _, fd := range fds {
		unix.Close(fd)
	}
}

// coolCmds closes the kept control files of the command groups (the
// current one, the one made ahead, one retired to serve again, the idle
// exec groups) and the CPU boost; the groups stay, and open their files
// again when used. Jobs that retire a group after this see cold
// (retireWork).
// +checklocks:s.cmds.mu
func (s *Sandbox) coolCmds() {
	s.cold.Store(true)
	s.closeWorkFiles()
	closeExecFiles(s.cmds.idle)
	if ch := s.cmds.spareW; ch != nil {
		g := <-ch
		g.closeFiles()
		ch <- g
	}
	select {
	case g := <-s.cmds.reuseW:
		g.closeFiles()
		s.cmds.reuseW <- g
	default:
	}
	if s.cmds.boost != nil {
		s.cmds.boost.Close()
		s.cmds.boost = nil
	}
	s.cmds.boostTried = false
}

// closeFiles closes the files a command group keeps; the group stays.
func (g *workGroup) closeFiles() {
	g.wf.close()
	g.wf = workFiles{of: g.cg}
	closeExecFiles(g.idle)
}

// closeExecFiles closes the cgroup.procs files of idle exec groups, which
// execGroup opens again.
func closeExecFiles(egs []*execGroup) {
	for _, eg := range egs {
		closeAll(eg.procs)
		eg.procs = nil
	}
}
