package procstate

import (
	"errors"
	"fmt"
	"log/slog"
	"os"
	"slices"
	"sync"
	"sync/atomic"
	"time"

	"golang.org/x/sys/unix"

	"github.com/deltagym/deltagym/sandbox/cgroup"
	"github.com/deltagym/deltagym/sandbox/criu"
	"github.com/deltagym/deltagym/sandbox/initproc"
)

// Host is what the process state needs of its sandbox.
type Host interface {
	// ID names the sandbox, in logs and errors.
	ID() string
	// InitPid is the host pid of the sandbox's init: its pid namespace
	// and /proc are those of the sandbox's processes.
	InitPid() int
	// Settled returns once the init's last root swap is complete, so that
	// criu, joining its mount namespace, finds the root in place.
	Settled()
	// Watch returns the exit of the sandbox's process nsPid, a child of
	// the init, which reaps it.
	Watch(nsPid int) <-chan initproc.ExitEvent
	// NextPid has the next process made in the sandbox get pid nsPid, if
	// it is free then.
	NextPid(nsPid int) error
	// OpenRoot opens the sandbox's root (O_PATH); the caller closes it.
	OpenRoot() (int, error)
	// Owner is the host uid and gid of the sandbox's user.
	Owner() (uid, gid int)

	// Cgroup is the sandbox's group: template groups are made under it,
	// and its pids and memory are those the sandbox's limits count.
	Cgroup() *cgroup.Cgroup
	// PidsLimit is the sandbox's pids limit, 0 if none.
	PidsLimit() int64
	// GroupName returns a group name not used before in the sandbox.
	GroupName(prefix string) string
	// WorkGroup is the group of the sandbox's commands, WorkPids its
	// processes; Subgroup makes a group under it, and MoveCopy moves a
	// process into it or one of its groups.
	WorkGroup() *cgroup.Cgroup
	WorkPids() ([]int, error)
	Subgroup(prefix string) (*cgroup.Cgroup, error)
	MoveCopy(g *cgroup.Cgroup, pid int) error
	// SettleKilled returns once the processes a restore killed can no
	// longer get in the way of copies of tpls about to run.
	SettleKilled(tpls []Template)

	// SessionShells maps the host pid of each session's shell to the
	// session's name and state; AdoptSession makes a shell brought back
	// the shell of session name, in state att (nil: idle) (stdio: the
	// server's ends of its pipes).
	SessionShells() map[int]SessionShell
	AdoptSession(name string, att *Attached, cg *cgroup.Cgroup, pid int, stdio [3]*os.File, exit <-chan initproc.ExitEvent)

	// Guard hands the init a seccomp listener of a process restored by
	// criu (initproc.Conn.Guard).
	Guard(listener *os.File) error
	// CRIU returns the runtime's criu runner.
	CRIU() (*criu.Swrk, error)
	// QueueFold hands process pid to the huge-page worker (Folder).
	QueueFold(pid int, what string)
	// MemoryRoom is how many more bytes the sandbox's processes and
	// templates may take: short of three quarters of its memory limit,
	// and of what the machine has available.
	MemoryRoom() int64
	Log() *slog.Logger
}

// Config is what the process state needs of the runtime's configuration.
type Config struct {
	// CRIUDir is where checkpoint id keeps its CRIU images; RunDir is
	// where criu keeps the scratch files of a restore.
	CRIUDir func(id string) string
	RunDir  string
	// ForkAtRestore forks copies at each restore, never ahead.
	ForkAtRestore bool
	// SmallPages leaves processes in small pages (no huge-page folding).
	SmallPages bool
	// AheadAlways forks copies ahead even after restores that come back
	// to back (tests: their steps' length must not decide); nil for never.
	AheadAlways func() bool
	// StopWait bounds how long a capture waits for the command group to
	// stop; 0 means stopWait.
	StopWait func() time.Duration
}

// New returns the process state of the sandbox h, with no templates.
func New(h Host, cfg Config) *State {
	if cfg.AheadAlways == nil {
		cfg.AheadAlways = func() bool { return false }
	}
	return &State{h: h, cfg: cfg, tpls: map[string]*cgroup.Cgroup{}, listenHeld: map[string][]string{}, trees: map[string][]*treeTemplate{}}
}

// Wait waits for the background jobs that make groups under the
// sandbox's group or end copies forked ahead: the sandbox's group can be
// removed once they are done.
func (ps *State) Wait() { ps.bg.Wait() }

// State is the state of one sandbox's checkpointed processes: the
// templates of its checkpoints (capture.go, copies.go), the copies forked
// ahead for the next restore (ahead.go), and what the huge-page worker was
// handed (fold.go). Its methods are safe for concurrent use; those that
// change the sandbox's processes are called under the sandbox's own
// serialisation of state changes, as their comments say.
//
// Locks, outermost first: run, then forkMu or mu (the host's command
// groups come between run and mu: see sandbox/doc.go).
type State struct {
	h   Host
	cfg Config
	// bg counts the background jobs that make groups under the sandbox's
	// group or end copies forked ahead (Wait).
	bg sync.WaitGroup
	// dropping counts the template groups of released checkpoints waiting
	// for run to be ended (Drop).
	dropping sync.WaitGroup

	// mu guards the templates and the copies forked ahead.
	mu sync.Mutex
	// tpls holds the process templates of this sandbox's checkpoints, one
	// frozen cgroup per checkpoint.
	// +checklocks:mu
	tpls map[string]*cgroup.Cgroup
	// folded holds the checkpoints whose templates were handed to the
	// huge-page worker, on their first restore.
	// +checklocks:mu
	folded map[string]bool
	// listenHeld holds, by checkpoint, the keys ("socket:[inode]") of the
	// listening sockets its templates hold: those several processes
	// shared (Private kind "listen"). Every other listening socket of a
	// template is an unbound one in its place (freeListeners).
	// +checklocks:mu
	listenHeld map[string][]string
	// trees holds the tree templates of this sandbox's checkpoints
	// (tree.go), each pair in a frozen group of its own.
	// +checklocks:mu
	trees map[string][]*treeTemplate
	// treeCopies counts the trees restored by copies (TreeCopies).
	treeCopies atomic.Int64
	// treeStashes counts the tree templates made with the root stashed
	// (TreeStashes).
	treeStashes atomic.Int64
	// adopted: templates re-adopted after a crash, whose listening
	// sockets are not known (TemplatesListen says yes to every one).
	// +checklocks:mu
	adopted bool
	// ahead holds the copies forked ahead for the next restore of the
	// checkpoint restored last.
	// +checklocks:mu
	ahead *aheadCopies
	// aheadEnding holds copies forked ahead being ended in the background
	// after a checkpoint's release (endAhead).
	// +checklocks:mu
	aheadEnding []*aheadCopies
	// spareTG is the next template group, made ahead.
	// +checklocks:mu
	spareTG chan spareGroup
	// liveSeen holds the live processes checkpointed since the last
	// restore, and the copies it made: host pid -> start time (0 for a
	// copy, whose start time is not read). A process not in it is folded
	// into huge pages at its first checkpoint.
	// +checklocks:mu
	liveSeen map[int]uint64
	// waits are the waits with a time left that the live processes'
	// threads were last seen in: at their last capture, or as the
	// templates' their copies are (kernelwrites.go).
	// +checklocks:mu
	waits []Wait
	// restoredAt is when the last restore that brought back template
	// copies returned.
	// +checklocks:mu
	restoredAt time.Time
	// aheadTook is how long the last job forking copies ahead took.
	aheadTook atomic.Int64

	// run is held while templates are copied (one ptrace tracer at a
	// time).
	run sync.Mutex
	// aheadFree is an empty, frozen group for the next copies forked ahead:
	// the group the last ones were taken from.
	// +checklocks:run
	aheadFree *cgroup.Cgroup
	// tplFreeze is the cgroup.freeze of the template group written last,
	// kept open (setTplFrozen).
	// +checklocks:run
	tplFreeze struct {
		of *cgroup.Cgroup
		k  *cgroup.Control
	}

	// forkMu is held while a copy is forked ahead, and while the root is
	// swapped: a task being cloned during a swap would keep the old root.
	forkMu sync.Mutex
}

// Adopt makes tg, found frozen after a crash, the group of the templates of
// checkpoint id.
func (ps *State) Adopt(id string, tg *cgroup.Cgroup) {
	ps.mu.Lock()
	defer ps.mu.Unlock()
	ps.tpls[id] = tg
	ps.adopted = true
}

// TemplatesListen reports whether a template of the sandbox (or a copy
// forked ahead, which holds what its template does) holds listening socket
// key ("socket:[inode]"). A listening socket no template holds is a live
// process's alone.
func (ps *State) TemplatesListen(key string) bool {
	ps.mu.Lock()
	defer ps.mu.Unlock()
	if ps.adopted {
		return true
	}
	for _, keys := range ps.listenHeld {
		if slices.Contains(keys, key) {
			return true
		}
	}
	return false
}

// IDs lists the checkpoints whose templates the sandbox holds.
func (ps *State) IDs() []string {
	ps.mu.Lock()
	defer ps.mu.Unlock()
	ids := make([]string, 0, len(ps.tpls))
	for id := range ps.tpls {
		ids = append(ids, id)
	}
	return ids
}

// DeleteTemplates ends every template (their groups), as the sandbox ends:
// one killed while frozen stays half-exited until thawed, and the init's
// exit waits for every task of its pid namespace.
func (ps *State) DeleteTemplates() error {
	ps.dropping.Wait()
	ps.mu.Lock()
	defer ps.mu.Unlock()
	var errs []error
	for id, tg := range ps.tpls {
		errs = append(errs, tg.Delete())
		delete(ps.tpls, id)
		delete(ps.listenHeld, id)
	}
	for id, tts := range ps.trees {
		errs = append(errs, endTrees(tts))
		delete(ps.trees, id)
	}
	return errors.Join(errs...)
}

// DropAhead drops the copies forked ahead, whatever checkpoint they are
// for. Called with the sandbox's state changes serialised.
func (ps *State) DropAhead() { ps.dropAhead("", true) }

// WithoutForks calls fn while no copy is being cloned from a template: the
// root swap, which a task being cloned would miss (it would keep the old
// root).
func (ps *State) WithoutForks(fn func() error) error {
	ps.forkMu.Lock()
	defer ps.forkMu.Unlock()
	return fn()
}

// Close closes the files the state keeps open.
func (ps *State) Close() {
	ps.run.Lock()
	defer ps.run.Unlock()
	closeControls(ps.tplFreeze.k)
	ps.tplFreeze.of, ps.tplFreeze.k = nil, nil
}

// AheadPids waits for the job forking copies ahead, if one runs, and
// returns the host pids of the copies forked ahead for checkpoint ck, if
// there are any (tests).
func (ps *State) AheadPids(ck string) []int {
	ps.mu.Lock()
	a := ps.ahead
	ps.mu.Unlock()
	if a == nil || a.ck != ck {
		return nil
	}
	<-a.done
	if a.err != nil {
		return nil
	}
	pids := make([]int, len(a.procs))
	for i, p := range a.procs {
		pids[i] = p.pid
	}
	return pids
}

// SetAheadTook sets how long the last job forking copies ahead took, which
// the next restore compares the agent's step with (forkAhead); tests call
// it with no job running.
func (ps *State) SetAheadTook(d time.Duration) { ps.aheadTook.Store(int64(d)) }

// PidsError is the error of a fork that failed with EAGAIN in a sandbox
// with pids limit lim and group cg: ErrBudget naming the limit and what
// holds its pids, if the limit is the cause.
func PidsError(err error, lim int64, cg *cgroup.Cgroup) error {
	if lim <= 0 || !errors.Is(err, unix.EAGAIN) {
		return err
	}
	// EAGAIN has other causes (a process limit of the uid): only one near
	// the limit is the limit's.
	cur, cerr := cg.PidsCurrent()
	if cerr != nil || cur+2 < lim {
		return err
	}
	return fmt.Errorf("%w: the sandbox's pids limit (%d) is reached (%d in use; each process a checkpoint keeps as a frozen copy counts): %w; release checkpoints no longer needed, or end processes",
		ErrBudget, lim, cur, err)
}
