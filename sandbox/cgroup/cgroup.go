package cgroup

import (
	"bytes"
	"errors"
	"fmt"
	"math"
	"os"
	"path/filepath"
	"slices"
	"sort"
	"strconv"
	"strings"
	"sync"
	"time"

	"golang.org/x/sys/unix"
)

// DefaultRoot is the path segment under which a Manager keeps its groups.
const DefaultRoot = "deltagym"

// DefaultWaitTimeout bounds how long Freeze, Thaw and Kill wait for the
// kernel to finish.
const DefaultWaitTimeout = 10 * time.Second

// cpuPeriod is the CFS period used for CPU quotas, in microseconds.
const cpuPeriod = 100000

// Config configures a Manager.
type Config struct {
	// Root is the path segment, directly below each hierarchy's root, that
	// holds the manager's groups. Default DefaultRoot.
	Root string
	// WaitTimeout bounds Freeze, Thaw, Kill and Delete. Default
	// DefaultWaitTimeout.
	WaitTimeout time.Duration

	// force restricts the detected layout (tests only).
	force Mode
}

// Validate reports whether the configuration is usable.
func (c Config) Validate() error {
	if c.Root != "" {
		if err := validName(c.Root); err != nil {
			return fmt.Errorf("root %q: %w: %w", c.Root, ErrInvalidConfig, err)
		}
	}
	if c.WaitTimeout < 0 {
		return fmt.Errorf("wait timeout %v is negative: %w", c.WaitTimeout, ErrInvalidConfig)
	}
	return nil
}

func (c Config) withDefaults() Config {
	if c.Root == "" {
		c.Root = DefaultRoot
	}
	if c.WaitTimeout == 0 {
		c.WaitTimeout = DefaultWaitTimeout
	}
	return c
}

// reserved are names that v1 groups already use for control files.
var reserved = map[string]bool{"tasks": true, "notify_on_release": true, "release_agent": true}

// validName accepts a single path segment of letters, digits, '-' and '_'
// (no '.', so that no name can collide with a controller's file).
func validName(name string) error {
	if name == "" || len(name) > 128 || reserved[name] {
		return fmt.Errorf("%q: %w", name, ErrInvalidName)
	}
	for _, r := range name {
		ok := r >= 'a' && r <= 'z' || r >= 'A' && r <= 'Z' || r >= '0' && r <= '9' || r == '-' || r == '_'
		if !ok {
			return fmt.Errorf("%q: %w", name, ErrInvalidName)
		}
	}
	return nil
}

// Limits are the resource limits of a sandbox's group. Zero means unlimited.
type Limits struct {
	// MemoryBytes caps memory use (and forbids swap when set).
	MemoryBytes int64
	// Pids caps the number of tasks (processes and threads).
	Pids int64
	// CPUQuota caps CPU time, in cores (0.5 is half of one core).
	CPUQuota float64
	// CPUWeight is the group's share of a busy CPU against its siblings,
	// on cgroup v2's scale (1 to 10000, the kernel's default 100; v1's
	// cpu.shares get the same factor over their default of 1024). 0
	// leaves the group's weight as it is; a host without a cpu controller
	// ignores it.
	CPUWeight int
}

// Validate reports whether the limits are usable.
func (l Limits) Validate() error {
	if l.MemoryBytes < 0 || l.Pids < 0 || l.CPUQuota < 0 || math.IsNaN(l.CPUQuota) || math.IsInf(l.CPUQuota, 0) ||
		l.CPUWeight < 0 || l.CPUWeight > maxCPUWeight {
		return fmt.Errorf("%+v: %w", l, ErrInvalidLimits)
	}
	return nil
}

// Stats are a group's counters.
type Stats struct {
	// MemoryBytes is the current memory use.
	MemoryBytes int64
	// MemoryPeakBytes is the highest memory use seen (0 where the kernel
	// does not track it).
	MemoryPeakBytes int64
	// OOMKills counts processes killed by the OOM killer for this group.
	OOMKills int64
	// Pids is the current number of tasks.
	Pids int64
	// PidsLimitHits counts forks refused because of the pids limit.
	PidsLimitHits int64
	// CPUUsec is the CPU time used, in microseconds (0 where unavailable).
	CPUUsec int64
}

// Manager creates, lists and removes the groups of one Root.
type Manager struct {
	cfg Config
	l   *layout
}

// New detects the host's cgroup layout and makes sure /<Root> exists in every
// hierarchy it uses.
func New(cfg Config) (*Manager, error) {
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	cfg = cfg.withDefaults()
	l, err := detect(cfg.Root, cfg.force)
	if err != nil {
		return nil, err
	}
	m := &Manager{cfg: cfg, l: l}
	if err := m.ensureBase(); err != nil {
		return nil, err
	}
	if err := m.ensureHeld(); err != nil {
		return nil, err
	}
	return m, nil
}

// Mode returns the layout the manager works with.
func (m *Manager) Mode() Mode { return m.l.mode }

// CloneIntoComplete reports whether a process started with clone3
// CLONE_INTO_CGROUP into [Cgroup.Dir] is thereby in every hierarchy of the
// group (pure cgroup v2). Elsewhere the v1 groups still need Add.
func (m *Manager) CloneIntoComplete() bool {
	return m.l.mode == ModeUnified
}

// FavorDynMods turns on the option favordynmods of the host's cgroup2
// hierarchy, if it has one and the option is off, and says whether it did.
//
// Moving a process into a group (writing cgroup.procs) write-locks the
// kernel's global cgroup_threadgroup_rwsem, which forks and exits
// read-lock. By default it is a per-CPU rwsem, cheap for readers, whose
// writer waits for an RCU grace period unless another writer left it a
// moment before: on a VM with few CPUs such a move takes far longer than
// the rest of a checkpoint, and a tight loop of checkpoints (each moves one
// process) meets it now and then. With favordynmods (Linux 6.0; made for Android,
// which moves processes between groups all the time) the rwsem stays in its
// slow mode: no move waits for a grace period, and forks and exits pay an
// atomic operation instead. The rwsem is global, so the option on the
// cgroup2 hierarchy serves moves in v1 hierarchies too (where a remount
// cannot change it; the kernel's boot option cgroup_favordynmods=true can).
//
// The hierarchy is reconfigured through fspick(2) with every super option
// it had (a reconfiguration clears those it is not given), which leaves
// the mount's own flags alone.
func (m *Manager) FavorDynMods() (bool, error) {
	if m.l.v2 == "" {
		return false, nil
	}
	opts, err := superOptions(m.l.v2, "cgroup2")
	if err != nil {
		return false, err
	}
	if slices.Contains(opts, "favordynmods") {
		return false, nil
	}
	fd, err := unix.Fspick(unix.AT_FDCWD, m.l.v2, unix.FSPICK_CLOEXEC)
	if err != nil {
		return false, fmt.Errorf("fspick %s: %w", m.l.v2, err)
	}
	defer unix.Close(fd)
	for _, o := range append(opts, "favordynmods") {
		if o == "rw" || o == "ro" {
			continue // the superblock's, left as they are
		}
		if err := unix.FsconfigSetFlag(fd, o); err != nil {
			return false, fmt.Errorf("reconfiguring %s with option %s: %w", m.l.v2, o, err)
		}
	}
	if err := unix.FsconfigReconfigure(fd); err != nil {
		return false, fmt.Errorf("reconfiguring %s with favordynmods: %w", m.l.v2, err)
	}
	return true, nil
}

// RemoveBase removes /<Root> from each hierarchy once no group is left
// in it (a runtime that closed); one still holding groups stays.
func (m *Manager) RemoveBase() error {
	for _, r := range m.l.roots() {
		base := filepath.Join(r, m.cfg.Root)
		if err := unix.Rmdir(base); err != nil && err != unix.ENOENT && err != unix.EBUSY && err != unix.ENOTEMPTY {
			return fmt.Errorf("removing cgroup base %s: %w", base, &os.PathError{Op: "rmdir", Path: base, Err: err})
		}
	}
	return m.removeHeld()
}

// ensureBase creates /<Root> in each hierarchy and, for controllers used in
// cgroup v2, enables them in the hierarchy root and in /<Root>, so that the
// sandbox groups below get the controllers' files.
func (m *Manager) ensureBase() error {
	var v2ctrls string
	for _, c := range limitControllers {
		if m.l.ctrlV2[c] {
			v2ctrls += " +" + c
		}
	}
	for _, r := range m.l.roots() {
		base := filepath.Join(r, m.cfg.Root)
		if r == m.l.v2 && v2ctrls != "" {
			if err := writeFile(filepath.Join(r, "cgroup.subtree_control"), v2ctrls[1:]); err != nil {
				return fmt.Errorf("enabling controllers%s in %s: %w", v2ctrls, r, err)
			}
		}
		if err := os.Mkdir(base, 0o755); err != nil && !errors.Is(err, os.ErrExist) {
			return fmt.Errorf("creating cgroup base %s: %w", base, err)
		}
		if r == m.l.v2 && v2ctrls != "" {
			if err := writeFile(filepath.Join(base, "cgroup.subtree_control"), v2ctrls[1:]); err != nil {
				return fmt.Errorf("enabling controllers%s in %s: %w", v2ctrls, base, err)
			}
		}
	}
	return nil
}

// group builds the handle of top-level group name without touching the
// file system.
func (m *Manager) group(name string) *Cgroup {
	c := &Cgroup{
		m:       m,
		name:    name,
		path:    "/" + m.cfg.Root + "/" + name,
		trackV2: m.l.v2 != "",
		limit:   map[string]string{},
	}
	for _, r := range m.l.roots() {
		c.dirs = append(c.dirs, filepath.Join(r, m.cfg.Root, name))
	}
	c.track = c.dirs[0]
	c.own = c.dirs
	for _, ctrl := range limitControllers {
		if r, ok := m.l.ctrl[ctrl]; ok {
			c.limit[ctrl] = filepath.Join(r, m.cfg.Root, name)
		}
	}
	c.top = c
	return c
}

// Create makes the group name with the given limits in every hierarchy. A
// name still in use gives ErrExist: reconcile with List and Remove first.
func (m *Manager) Create(name string, lim Limits) (*Cgroup, error) {
	if err := validName(name); err != nil {
		return nil, fmt.Errorf("creating cgroup: %w", err)
	}
	if err := lim.Validate(); err != nil {
		return nil, fmt.Errorf("creating cgroup %s: %w", name, err)
	}
	c := m.group(name)
	if err := c.checkControllers(lim); err != nil {
		return nil, fmt.Errorf("creating cgroup %s: %w", name, err)
	}
	var made []string
	undo := func(err error) error {
		errs := []error{err}
		for i := len(made) - 1; i >= 0; i-- {
			if e := unix.Rmdir(made[i]); e != nil && e != unix.ENOENT {
				errs = append(errs, &os.PathError{Op: "rmdir", Path: made[i], Err: e})
			}
		}
		return errors.Join(errs...)
	}
	for _, d := range c.own {
		err := unix.Mkdir(d, 0o755)
		if err == unix.ENOENT {
			// The base was removed behind our back: make it again.
			if err = m.ensureBase(); err == nil {
				err = unix.Mkdir(d, 0o755)
			}
		}
		if err == unix.EEXIST {
			return nil, undo(fmt.Errorf("creating cgroup %s: %w", c.path, ErrExist))
		}
		if err != nil {
			return nil, undo(fmt.Errorf("creating cgroup %s: %w", c.path, &os.PathError{Op: "mkdir", Path: d, Err: err}))
		}
		made = append(made, d)
	}
	if err := c.setLimits(lim, false); err != nil {
		return nil, undo(fmt.Errorf("creating cgroup %s: %w", c.path, err))
	}
	return c, nil
}

// List returns the names of the groups below /<Root> in any hierarchy, such
// as those a crashed server left behind.
func (m *Manager) List() ([]string, error) {
	seen := map[string]bool{}
	for _, r := range m.l.roots() {
		kids, err := childDirs(filepath.Join(r, m.cfg.Root))
		if err != nil && !errors.Is(err, os.ErrNotExist) {
			return nil, fmt.Errorf("listing cgroups: %w", err)
		}
		for _, k := range kids {
			seen[k] = true
		}
	}
	out := make([]string, 0, len(seen))
	for k := range seen {
		out = append(out, k)
	}
	sort.Strings(out)
	return out, nil
}

// Remove kills every process of group name and removes it, with its
// sub-groups, from every hierarchy. Removing a group that does not exist is
// not an error.
func (m *Manager) Remove(name string) error {
	if err := validName(name); err != nil {
		return fmt.Errorf("removing cgroup: %w", err)
	}
	return m.group(name).Delete()
}

// Cgroup is one group: a sandbox's (from Manager.Create) or a sub-group of it
// (from Sub). Its methods are safe for concurrent use.
type Cgroup struct {
	m    *Manager
	top  *Cgroup // the top-level group whose limits apply; itself if top-level
	name string
	path string // relative to each hierarchy's root
	// track is the directory in the hierarchy that tracks membership,
	// freezes and kills.
	track   string
	trackV2 bool
	// dirs are the directories whose cgroup.procs a member is written to,
	// track first.
	dirs []string
	// own are the directories Delete removes.
	own []string
	// limit maps each available limit controller to the directory of its
	// files (the top-level group's).
	limit map[string]string

	mu sync.Mutex
}

// Name returns the name the group was created with (its last path segment).
func (c *Cgroup) Name() string { return c.name }

// Path returns the group's path relative to a hierarchy's root, as shown in
// /proc/<pid>/cgroup, e.g. "/deltagym/sb-1" or "/deltagym/sb-1/exec-3".
func (c *Cgroup) Path() string { return c.path }

// Dirs returns the group's directories, the tracking hierarchy's first.
func (c *Cgroup) Dirs() []string { return append([]string(nil), c.dirs...) }

func (c *Cgroup) deadline() time.Time { return time.Now().Add(c.m.cfg.WaitTimeout) }

// wrap adds what was being done and ErrNotExist for a vanished group.
func (c *Cgroup) wrap(op string, err error) error {
	if err == nil {
		return nil
	}
	if errors.Is(err, os.ErrNotExist) && !errors.Is(err, ErrNotExist) {
		return fmt.Errorf("%s cgroup %s: %w: %w", op, c.path, ErrNotExist, err)
	}
	return fmt.Errorf("%s cgroup %s: %w", op, c.path, err)
}

// Open returns the existing top-level group name, such as one a crashed
// server left behind; ErrNotExist if it is not there.
func (m *Manager) Open(name string) (*Cgroup, error) {
	if err := validName(name); err != nil {
		return nil, fmt.Errorf("opening cgroup: %w", err)
	}
	c := m.group(name)
	if _, err := os.Stat(c.track); err != nil {
		return nil, c.wrap("opening", err)
	}
	return c, nil
}

// child builds the handle of sub-group name without touching the file
// system.
func (c *Cgroup) child(name string) *Cgroup {
	child := &Cgroup{
		m:       c.m,
		top:     c.top,
		name:    name,
		path:    c.path + "/" + name,
		track:   filepath.Join(c.track, name),
		trackV2: c.trackV2,
		limit:   c.limit,
	}
	child.dirs = append([]string{child.track}, c.dirs[1:]...)
	child.own = []string{child.track}
	return child
}

// OpenSub returns the existing sub-group name (made by Sub, perhaps by an
// earlier server); ErrNotExist if it is not there.
func (c *Cgroup) OpenSub(name string) (*Cgroup, error) {
	if err := validName(name); err != nil {
		return nil, fmt.Errorf("opening sub-group of %s: %w", c.path, err)
	}
	child := c.child(name)
	if _, err := os.Stat(child.track); err != nil {
		return nil, child.wrap("opening", err)
	}
	return child, nil
}

// SelfFrozen reports whether the group itself was asked to freeze (not
// merely an ancestor) and the kernel reports it frozen.
func (c *Cgroup) SelfFrozen() (bool, error) {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.trackV2 {
		own, err := readInt(filepath.Join(c.track, "cgroup.freeze"))
		if err != nil || own != 1 {
			return false, c.wrap("reading freezer state of", err)
		}
		frozen, err := readKey(filepath.Join(c.track, "cgroup.events"), "frozen")
		return frozen == 1, c.wrap("reading freezer state of", err)
	}
	self, err := readInt(filepath.Join(c.track, "freezer.self_freezing"))
	if err != nil || self != 1 {
		return false, c.wrap("reading freezer state of", err)
	}
	st, err := readFile(filepath.Join(c.track, "freezer.state"))
	return strings.TrimSpace(string(st)) == "FROZEN", c.wrap("reading freezer state of", err)
}

// Sub creates a child group. It exists only in the tracking hierarchy: its
// processes stay in this group's limit groups, so they share its limits, and
// Kill of the child kills them without touching this group's other
// processes (even those that called setsid).
func (c *Cgroup) Sub(name string) (*Cgroup, error) {
	if err := validName(name); err != nil {
		return nil, fmt.Errorf("creating sub-group of %s: %w", c.path, err)
	}
	child := c.child(name)
	if err := unix.Mkdir(child.track, 0o755); err != nil {
		if err == unix.EEXIST {
			return nil, fmt.Errorf("creating cgroup %s: %w", child.path, ErrExist)
		}
		return nil, child.wrap("creating", &os.PathError{Op: "mkdir", Path: child.track, Err: err})
	}
	return child, nil
}

// Add moves process pid (its whole thread group) into the group in every
// hierarchy, the tracking one first.
func (c *Cgroup) Add(pid int) error {
	s := strconv.Itoa(pid)
	for _, d := range c.dirs {
		if err := writeFile(filepath.Join(d, "cgroup.procs"), s); err != nil {
			return c.wrap("adding pid "+s+" to", err)
		}
	}
	return nil
}

// Move moves process pid into the group in the tracking hierarchy only: for
// a process already in the group's limit groups, such as a copy of one of
// the group's own processes or a process of one of its sub-groups.
func (c *Cgroup) Move(pid int) error {
	s := strconv.Itoa(pid)
	return c.wrap("moving pid "+s+" to", writeFile(filepath.Join(c.track, "cgroup.procs"), s))
}

// OpenProcs opens cgroup.procs of every hierarchy of the group for writing,
// the tracking hierarchy first. A process that inherits these files can move
// itself into the group by writing "0" to each, even from inside a user and
// cgroup namespace: the kernel checks the credentials and cgroup namespace
// of the opener. The caller closes the files.
func (c *Cgroup) OpenProcs() ([]*os.File, error) {
	var out []*os.File
	for _, d := range c.dirs {
		f, err := os.OpenFile(filepath.Join(d, "cgroup.procs"), os.O_WRONLY, 0)
		if err != nil {
			for _, o := range out {
				o.Close()
			}
			return nil, c.wrap("opening cgroup.procs of", err)
		}
		out = append(out, f)
	}
	return out, nil
}

// Dir opens the group's cgroup v2 directory, for clone3 CLONE_INTO_CGROUP
// (os/exec: SysProcAttr.UseCgroupFD and CgroupFD). It returns ErrNoV2 on a
// legacy host. See Manager.CloneIntoComplete. The caller closes the file.
func (c *Cgroup) Dir() (*os.File, error) {
	if !c.trackV2 {
		return nil, c.wrap("opening directory of", ErrNoV2)
	}
	f, err := os.OpenFile(c.track, os.O_RDONLY|unix.O_DIRECTORY, 0)
	if err != nil {
		return nil, c.wrap("opening directory of", err)
	}
	return f, nil
}

// Pids lists the processes of the group and of its sub-groups.
func (c *Cgroup) Pids() ([]int, error) {
	p, err := walkPids(c.track, nil)
	return p, c.wrap("listing processes of", err)
}

// Threads lists the threads (task ids) of the group and of its sub-groups:
// cgroup.threads where cgroup v2 tracks membership, tasks on v1.
func (c *Cgroup) Threads() ([]int, error) {
	file := "tasks"
	if c.trackV2 {
		file = "cgroup.threads"
	}
	t, err := walkIDs(c.track, file, nil)
	return t, c.wrap("listing threads of", err)
}

// SubGroups lists the names of the group's child groups in the tracking
// hierarchy.
func (c *Cgroup) SubGroups() ([]string, error) {
	kids, err := childDirs(c.track)
	return kids, c.wrap("listing sub-groups of", err)
}

// Freeze stops every process of the group (and its sub-groups) and returns
// once the kernel reports the group frozen.
func (c *Cgroup) Freeze() error {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.wrap("freezing", c.freeze(true, c.deadline()))
}

// Thaw resumes the group's processes and returns once the kernel reports the
// group thawed.
func (c *Cgroup) Thaw() error {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.wrap("thawing", c.freeze(false, c.deadline()))
}

// SetFrozen asks the kernel to freeze or thaw the group and, on cgroup v2,
// returns without waiting for the processes to get there: the write marks
// every process at once, and each stops (or goes on) at its next return to
// user space. A process in ptrace-stop counts as frozen, and one detached
// from ptrace in a group marked frozen freezes before it runs. On a legacy
// (v1) host it waits, like Freeze and Thaw.
func (c *Cgroup) SetFrozen(on bool) error {
	c.mu.Lock()
	defer c.mu.Unlock()
	if !c.trackV2 {
		return c.wrap("freezing", c.freeze(on, c.deadline()))
	}
	v := "0"
	if on {
		v = "1"
	}
	return c.wrap("freezing", writeFile(filepath.Join(c.track, "cgroup.freeze"), v))
}

func (c *Cgroup) freeze(on bool, deadline time.Time) error {
	if c.trackV2 {
		v, want := "0", int64(0)
		if on {
			v, want = "1", 1
		}
		if err := writeFile(filepath.Join(c.track, "cgroup.freeze"), v); err != nil {
			return err
		}
		return waitEvent(c.track, "frozen", want, deadline)
	}
	state := "THAWED"
	if on {
		state = "FROZEN"
	}
	path := filepath.Join(c.track, "freezer.state")
	if err := writeFile(path, state); err != nil {
		return err
	}
	b := backoff{deadline: deadline}
	for {
		// Reading freezer.state is what advances FREEZING to FROZEN.
		got, err := readFile(path)
		if err != nil {
			return err
		}
		if string(got) == state+"\n" {
			return nil
		}
		if !b.wait() {
			return fmt.Errorf("waiting for %s in %s: %w", state, path, ErrTimeout)
		}
	}
}

// Kill SIGKILLs every process of the group and its sub-groups and returns
// once none is left (they may still be zombies for their parents to reap).
// It does not change whether the group is frozen.
func (c *Cgroup) Kill() error {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.wrap("killing", c.kill(c.deadline()))
}

// SignalKill sends SIGKILL to every process of the group and its
// sub-groups. On cgroup v2 it returns at once, the processes dying in the
// background (a process with SIGKILL pending runs no code of its own
// again); Delete, later, waits for them. On a legacy (v1) host it waits,
// like Kill.
func (c *Cgroup) SignalKill() error {
	c.mu.Lock()
	defer c.mu.Unlock()
	if !c.trackV2 {
		return c.wrap("killing", c.kill(c.deadline()))
	}
	return c.wrap("killing", writeFile(filepath.Join(c.track, "cgroup.kill"), "1"))
}

func (c *Cgroup) kill(deadline time.Time) error {
	if c.trackV2 {
		// The common case after a command returns: nothing left to kill.
		if pop, err := c.populated(); err == nil && !pop {
			return nil
		}
		if err := writeFile(filepath.Join(c.track, "cgroup.kill"), "1"); err != nil {
			return err
		}
		soon := time.Now().Add(killEachAfter)
		if soon.Before(deadline) {
			if err := waitEvent(c.track, "populated", 0, soon); !errors.Is(err, ErrTimeout) {
				return err
			}
			c.killEach()
		}
		return waitEvent(c.track, "populated", 0, deadline)
	}
	// v1: processes frozen by the v1 freezer do not act on SIGKILL, and
	// unfrozen ones may fork while we signal: freeze, signal all, thaw,
	// until none is left.
	self, err := readInt(filepath.Join(c.track, "freezer.self_freezing"))
	if err != nil {
		return err
	}
	b := backoff{deadline: deadline}
	signalled := map[int]bool{}
	for {
		pids, err := walkPids(c.track, nil)
		if err != nil {
			return err
		}
		if len(pids) == 0 {
			break
		}
		fresh := false
		for _, p := range pids {
			fresh = fresh || !signalled[p]
		}
		// A process with SIGKILL pending cannot fork: once every
		// listed process is signalled, only their exit is awaited.
		if fresh {
			if err := c.freeze(true, deadline); err != nil {
				return err
			}
			if pids, err = walkPids(c.track, nil); err != nil {
				return err
			}
			for _, p := range pids {
				_ = unix.Kill(p, unix.SIGKILL) // ESRCH: already gone
				signalled[p] = true
			}
			if err := c.freeze(false, deadline); err != nil {
				return err
			}
		}
		if !b.wait() {
			return fmt.Errorf("waiting for %s to empty: %w", c.track, ErrTimeout)
		}
	}
	if self == 1 {
		return c.freeze(true, deadline)
	}
	return nil
}

// killEachAfter is how long a killed group may take to empty before each
// of its processes is signalled too (killEach).
const killEachAfter = 100 * time.Millisecond

// killEach sends SIGKILL to each process of the group by pidfd:
// cgroup.kill misses a process whose leader thread has exited while its
// other threads run (it stays listed), which a signal to its pid reaches.
// A pidfd whose process is not in the group once opened (the pid was
// reused) is left alone.
func (c *Cgroup) killEach() {
	pids, err := walkPids(c.track, nil)
	if err != nil {
		return
	}
	rel := "0::" + strings.TrimPrefix(c.track, c.m.l.v2)
	for _, pid := range pids {
		fd, err := unix.PidfdOpen(pid, 0)
		if err != nil {
			continue
		}
		if raw, err := os.ReadFile("/proc/" + strconv.Itoa(pid) + "/cgroup"); err == nil && inGroup(string(raw), rel) {
			_ = unix.PidfdSendSignal(fd, unix.SIGKILL, nil, 0)
		}
		unix.Close(fd)
	}
}

// inGroup reports whether a /proc/PID/cgroup text puts the process in the
// cgroup v2 group line ("0::/path") or below it.
func inGroup(text, line string) bool {
	for l := range strings.Lines(text) {
		l = strings.TrimSuffix(l, "\n")
		if l == line || strings.HasPrefix(l, line+"/") {
			return true
		}
	}
	return false
}

// Populated reports whether the group or any of its sub-groups has a
// process: one read of cgroup.events where cgroup v2 tracks membership. A
// missing group is not populated. It does not wait for a Freeze, Kill or
// Delete in progress (a Delete of a killed group holds the group until its
// processes are gone).
func (c *Cgroup) Populated() (bool, error) {
	p, err := c.populated()
	return p, c.wrap("reading", err)
}

func (c *Cgroup) populated() (bool, error) {
	if c.trackV2 {
		v, err := readFile(filepath.Join(c.track, "cgroup.events"))
		if errors.Is(err, os.ErrNotExist) {
			return false, nil
		}
		if err != nil {
			return false, err
		}
		n, _ := keyValue(v, "populated")
		return n != 0, nil
	}
	p, err := walkPids(c.track, nil)
	if errors.Is(err, os.ErrNotExist) {
		return false, nil
	}
	return len(p) > 0, err
}

// WaitEmpty waits up to timeout until the group and its sub-groups have no
// process left (a killed group's processes are exiting); ErrTimeout if
// some are still there then. A missing group is empty.
func (c *Cgroup) WaitEmpty(timeout time.Duration) error {
	deadline := time.Now().Add(timeout)
	if c.trackV2 {
		err := waitEvent(c.track, "populated", 0, deadline)
		if errors.Is(err, os.ErrNotExist) {
			return nil
		}
		return c.wrap("waiting for the processes of", err)
	}
	b := backoff{deadline: deadline}
	for {
		pop, err := c.Populated()
		if err != nil || !pop {
			return err
		}
		if !b.wait() {
			return c.wrap("waiting for the processes of", ErrTimeout)
		}
	}
}

// Delete kills the group's processes, if any, and removes it and its
// sub-groups. Deleting a deleted group is not an error.
func (c *Cgroup) Delete() error {
	c.mu.Lock()
	defer c.mu.Unlock()
	deadline := c.deadline()
	pop, err := c.populated()
	if err != nil {
		return c.wrap("deleting", err)
	}
	if pop {
		if err := c.kill(deadline); err != nil && !errors.Is(err, os.ErrNotExist) {
			return c.wrap("deleting", err)
		}
	}
	var errs []error
	for i, d := range c.own {
		// The common case, a group without sub-groups or stray
		// processes, is one rmdir.
		err := unix.Rmdir(d)
		if err == nil || err == unix.ENOENT {
			continue
		}
		if err != unix.EBUSY && err != unix.EINTR {
			errs = append(errs, &os.PathError{Op: "rmdir", Path: d, Err: err})
			continue
		}
		if i == 0 {
			// Sub-groups, or a process added since the kill above.
			if err := c.kill(deadline); err != nil {
				errs = append(errs, err)
				continue
			}
		} else if err := sweep(d, deadline); err != nil {
			// Processes only in a limit group (a server that crashed
			// half-way through Add) escape the kill above.
			errs = append(errs, err)
			continue
		}
		if err := removeTree(d, deadline); err != nil {
			errs = append(errs, err)
		}
	}
	return c.wrap("deleting", errors.Join(errs...))
}

// sweep SIGKILLs the processes of dir and its descendants until none is left.
func sweep(dir string, deadline time.Time) error {
	b := backoff{deadline: deadline}
	for {
		pids, err := walkPids(dir, nil)
		if errors.Is(err, os.ErrNotExist) {
			return nil
		}
		if err != nil {
			return err
		}
		if len(pids) == 0 {
			return nil
		}
		for _, p := range pids {
			_ = unix.Kill(p, unix.SIGKILL)
		}
		if !b.wait() {
			return fmt.Errorf("waiting for %s to empty: %w", dir, ErrTimeout)
		}
	}
}

// checkControllers fails with ErrControllerUnavailable when lim needs a
// controller that no hierarchy offers.
func (c *Cgroup) checkControllers(lim Limits) error {
	need := map[string]bool{ctrlMemory: lim.MemoryBytes > 0, ctrlPids: lim.Pids > 0, ctrlCPU: lim.CPUQuota > 0}
	for _, ctrl := range limitControllers {
		if _, ok := c.limit[ctrl]; need[ctrl] && !ok {
			return fmt.Errorf("%s: %w", ctrl, ErrControllerUnavailable)
		}
	}
	return nil
}

// SetLimits changes the limits of a top-level group.
func (c *Cgroup) SetLimits(lim Limits) error {
	if c.top != c {
		return c.wrap("setting limits of", ErrSubGroup)
	}
	if err := lim.Validate(); err != nil {
		return c.wrap("setting limits of", err)
	}
	if err := c.checkControllers(lim); err != nil {
		return c.wrap("setting limits of", err)
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.wrap("setting limits of", c.setLimits(lim, true))
}

// setLimits writes lim; with all false it skips unlimited values, which a
// fresh group already has.
func (c *Cgroup) setLimits(lim Limits, all bool) error {
	v2 := c.m.l.ctrlV2
	if d, ok := c.limit[ctrlMemory]; ok && (all || lim.MemoryBytes > 0) {
		var err error
		if v2[ctrlMemory] {
			err = setMemoryV2(d, lim.MemoryBytes)
		} else {
			err = setMemoryV1(d, lim.MemoryBytes, c.m.l.swapAccounted)
		}
		if err != nil {
			return err
		}
	}
	if d, ok := c.limit[ctrlPids]; ok && (all || lim.Pids > 0) {
		v := "max"
		if lim.Pids > 0 {
			v = strconv.FormatInt(lim.Pids, 10)
		}
		if err := writeFile(filepath.Join(d, "pids.max"), v); err != nil {
			return err
		}
	}
	return c.setCPU(lim, all)
}

// setCPU writes lim's CPU weight and quota; with all false it skips an
// unlimited quota.
func (c *Cgroup) setCPU(lim Limits, all bool) error {
	v2 := c.m.l.ctrlV2
	if d, ok := c.limit[ctrlCPU]; ok && lim.CPUWeight > 0 {
		if err := writeCPUWeight(d, v2[ctrlCPU], lim.CPUWeight); err != nil {
			return err
		}
	}
	if d, ok := c.limit[ctrlCPU]; ok && (all || lim.CPUQuota > 0) {
		q := int64(-1)
		if lim.CPUQuota > 0 {
			q = max(int64(math.Round(lim.CPUQuota*cpuPeriod)), 1000)
		}
		if v2[ctrlCPU] {
			v := "max"
			if q > 0 {
				v = strconv.FormatInt(q, 10)
			}
			if err := writeFile(filepath.Join(d, "cpu.max"), v+" "+strconv.Itoa(cpuPeriod)); err != nil {
				return err
			}
		} else {
			// A new group has the default period; SetLimits resets it.
			if all {
				if err := writeFile(filepath.Join(d, "cpu.cfs_period_us"), strconv.Itoa(cpuPeriod)); err != nil {
					return err
				}
			}
			if err := writeFile(filepath.Join(d, "cpu.cfs_quota_us"), strconv.FormatInt(q, 10)); err != nil {
				return err
			}
		}
	}
	return nil
}

// maxCPUWeight is cgroup v2's highest cpu.weight.
const maxCPUWeight = 10000

// writeCPUWeight sets a group's cpu.weight (v2) or the cpu.shares of the
// same factor over v1's default (v1).
func writeCPUWeight(dir string, v2 bool, w int) error {
	if v2 {
		return writeFile(filepath.Join(dir, "cpu.weight"), strconv.Itoa(w))
	}
	return writeFile(filepath.Join(dir, "cpu.shares"), strconv.Itoa(max(w*1024/100, 2)))
}

// SetBaseMemory caps the memory of the manager's root group, /<Root>, which
// holds every group the manager makes: what its groups use together, and
// what the kernel moves up to it when one of them is removed (the pages of
// tmpfs files written from inside a group stay charged, to the parent once
// the group is gone). limit 0 or less removes the cap. It does nothing on a
// host whose memory controller is in no hierarchy.
func (m *Manager) SetBaseMemory(limit int64) error {
	r, ok := m.l.ctrl[ctrlMemory]
	if !ok {
		return nil
	}
	d := filepath.Join(r, m.cfg.Root)
	var err error
	if m.l.ctrlV2[ctrlMemory] {
		err = setMemoryV2(d, max(limit, 0))
	} else {
		err = setMemoryV1(d, max(limit, 0), m.l.swapAccounted)
	}
	if err != nil {
		return fmt.Errorf("capping the memory of cgroup /%s: %w", m.cfg.Root, err)
	}
	if h := m.heldDir(); h != "" {
		if err := setMemoryV1(h, max(limit, 0), m.l.swapAccounted); err != nil {
			return fmt.Errorf("capping the memory of cgroup /%s%s: %w", m.cfg.Root, heldSuffix, err)
		}
	}
	return nil
}

// BaseMemory returns the memory charged to the manager's root group and its
// cap (0: none, or no memory controller).
func (m *Manager) BaseMemory() (current, limit int64, err error) {
	r, ok := m.l.ctrl[ctrlMemory]
	if !ok {
		return 0, 0, nil
	}
	d := filepath.Join(r, m.cfg.Root)
	cur, lim := "memory.usage_in_bytes", "memory.limit_in_bytes"
	if m.l.ctrlV2[ctrlMemory] {
		cur, lim = "memory.current", "memory.max"
	}
	if current, err = readInt(filepath.Join(d, cur)); err != nil {
		return 0, 0, err
	}
	if limit, err = readInt(filepath.Join(d, lim)); err != nil {
		return 0, 0, err
	}
	if limit < 0 || limit >= math.MaxInt64/2 { // "max", or v1's unlimited
		limit = 0
	}
	return current, limit, nil
}

func setMemoryV2(dir string, limit int64) error {
	v, swap := "max", "max"
	if limit > 0 {
		v, swap = strconv.FormatInt(limit, 10), "0"
	}
	if err := writeFile(filepath.Join(dir, "memory.max"), v); err != nil {
		return err
	}
	// No swap file without swap accounting.
	if err := writeFile(filepath.Join(dir, "memory.swap.max"), swap); err != nil && !errors.Is(err, os.ErrNotExist) {
		return err
	}
	return nil
}

// setMemoryV1 sets memory.limit_in_bytes and, where swap is accounted
// (swapAccounted),
// memory.memsw.limit_in_bytes to the same value (no swap). The kernel wants
// memsw ≥ limit at every moment, so the order depends on the direction.
func setMemoryV1(dir string, limit int64, swapAccounted bool) error {
	v := "-1"
	if limit > 0 {
		v = strconv.FormatInt(limit, 10)
	}
	mem := filepath.Join(dir, "memory.limit_in_bytes")
	memsw := filepath.Join(dir, "memory.memsw.limit_in_bytes")
	if !swapAccounted {
		return writeFile(mem, v)
	}
	err := writeFile(mem, v)
	if errors.Is(err, unix.EINVAL) {
		// Raising: memsw first.
		if err := writeFile(memsw, v); err != nil {
			return err
		}
		return writeFile(mem, v)
	}
	if err != nil {
		return err
	}
	return writeFile(memsw, v)
}

// PidsCurrent reads how many tasks the group's pids controller counts (that
// of the top-level group whose limits a sub-group shares): one file, where
// Stats reads six. ErrNotExist without a pids controller.
func (c *Cgroup) PidsCurrent() (int64, error) {
	d, ok := c.limit[ctrlPids]
	if !ok {
		return 0, c.wrap("reading pids.current of", os.ErrNotExist)
	}
	n, err := readInt(filepath.Join(d, "pids.current"))
	return n, c.wrap("reading pids.current of", err)
}

// MemoryCurrent reads how many bytes the group's memory controller charges
// (that of the top-level group whose limits a sub-group shares): one file,
// where Stats reads six. ErrNotExist without a memory controller.
func (c *Cgroup) MemoryCurrent() (int64, error) {
	d, ok := c.limit[ctrlMemory]
	if !ok {
		return 0, c.wrap("reading memory use of", os.ErrNotExist)
	}
	file := "memory.usage_in_bytes"
	if c.m.l.ctrlV2[ctrlMemory] {
		file = "memory.current"
	}
	n, err := readInt(filepath.Join(d, file))
	return n, c.wrap("reading memory use of", err)
}

// Stats reads the group's counters. For a sub-group, memory and pid figures
// are those of the top-level group whose limits it shares; CPU time is the
// group's own where cgroup v2 tracks membership.
func (c *Cgroup) Stats() (Stats, error) {
	var s Stats
	var err error
	v2 := c.m.l.ctrlV2
	if d, ok := c.limit[ctrlMemory]; ok {
		if v2[ctrlMemory] {
			if s.MemoryBytes, err = readInt(filepath.Join(d, "memory.current")); err != nil {
				return s, c.wrap("reading stats of", err)
			}
			if s.MemoryPeakBytes, err = readInt(filepath.Join(d, "memory.peak")); err != nil && !errors.Is(err, os.ErrNotExist) {
				return s, c.wrap("reading stats of", err)
			}
			s.OOMKills, err = readKey(filepath.Join(d, "memory.events"), "oom_kill")
		} else {
			if s.MemoryBytes, err = readInt(filepath.Join(d, "memory.usage_in_bytes")); err != nil {
				return s, c.wrap("reading stats of", err)
			}
			if s.MemoryPeakBytes, err = readInt(filepath.Join(d, "memory.max_usage_in_bytes")); err != nil {
				return s, c.wrap("reading stats of", err)
			}
			s.OOMKills, err = readKey(filepath.Join(d, "memory.oom_control"), "oom_kill")
		}
		if err != nil {
			return s, c.wrap("reading stats of", err)
		}
	}
	if d, ok := c.limit[ctrlPids]; ok {
		if s.Pids, err = readInt(filepath.Join(d, "pids.current")); err != nil {
			return s, c.wrap("reading stats of", err)
		}
		if s.PidsLimitHits, err = readKey(filepath.Join(d, "pids.events"), "max"); err != nil {
			return s, c.wrap("reading stats of", err)
		}
	}
	if c.trackV2 {
		s.CPUUsec, err = readKey(filepath.Join(c.track, "cpu.stat"), "usage_usec")
	} else if d, ok := c.limit[ctrlCPU]; ok {
		var ns int64
		if ns, err = readInt(filepath.Join(d, "cpuacct.usage")); errors.Is(err, os.ErrNotExist) {
			err = nil
		}
		s.CPUUsec = ns / 1000
	}
	return s, c.wrap("reading stats of", err)
}

// Events is a group's cgroup.events file, kept open so that reading it again
// costs one pread: opening and closing a cgroup control file costs several
// times more (BenchmarkControl), and more again in a busy rollback loop,
// which a rollback without processes would pay at every restore only to
// learn that the group is empty.
type Events struct{ openFile }

// openFile is a control file kept open: its descriptor (-1 once closed)
// and the lock its users hold around it.
type openFile struct {
	mu sync.Mutex
	// +checklocks:mu
	fd int
}

// Close closes the file. It is idempotent.
func (f *openFile) Close() error {
	f.mu.Lock()
	defer f.mu.Unlock()
	if f.fd < 0 {
		return nil
	}
	err := unix.Close(f.fd)
	f.fd = -1
	return err
}

// OpenEvents opens the group's cgroup.events. It returns nil, nil on a
// cgroup v1 hierarchy, which has no such file (use Populated there).
func (c *Cgroup) OpenEvents() (*Events, error) {
	if !c.trackV2 {
		return nil, nil
	}
	fd, err := openRetry(filepath.Join(c.track, "cgroup.events"), unix.O_RDONLY|unix.O_CLOEXEC)
	if err != nil {
		return nil, c.wrap("opening the events of", err)
	}
	return &Events{openFile{fd: fd}}, nil
}

// Populated reports whether the group or one of its sub-groups has a process.
// A group removed since its events were opened has none.
func (e *Events) Populated() (bool, error) {
	e.mu.Lock()
	defer e.mu.Unlock()
	if e.fd < 0 {
		return false, errors.New("reading closed cgroup events")
	}
	var buf [256]byte
	for {
		n, err := unix.Pread(e.fd, buf[:], 0)
		if err == unix.EINTR {
			continue
		}
		if err == unix.ENODEV || err == unix.ENOENT {
			return false, nil
		}
		if err != nil {
			return false, fmt.Errorf("reading cgroup events: %w", err)
		}
		v, _ := keyValue(buf[:n], "populated")
		return v != 0, nil
	}
}

// Control is a control file of the group's tracking hierarchy (cgroup v2),
// kept open for a caller that writes it again and again, or that opens it
// ahead of the moment a write must be quick: a write on an open file is a
// fraction of opening, writing and closing one (BenchmarkControl), and both
// cost more under load (see Events). A restore that forks copies of
// templates writes three such files four times (the template group's
// cgroup.freeze twice, the new command group's cgroup.procs, the old one's
// cgroup.kill).
// Its methods are safe for concurrent use.
type Control struct {
	openFile
	path string
}

// OpenControl opens the group's control file name (cgroup.freeze,
// cgroup.procs, cgroup.kill) for writing. It returns ErrNoV2 on a legacy
// host, where the group's methods serve instead.
func (c *Cgroup) OpenControl(name string) (*Control, error) {
	if !c.trackV2 {
		return nil, c.wrap("opening "+name+" of", ErrNoV2)
	}
	path := filepath.Join(c.track, name)
	fd, err := openRetry(path, unix.O_WRONLY|unix.O_CLOEXEC)
	if err != nil {
		return nil, c.wrap("opening "+name+" of", &os.PathError{Op: "open", Path: path, Err: err})
	}
	return &Control{openFile: openFile{fd: fd}, path: path}, nil
}

// Write writes data with one write(2): "1" or "0" to cgroup.freeze, as
// SetFrozen does; "1" to cgroup.kill, as SignalKill; a pid to
// cgroup.procs, as Move. Once the group is removed it fails with
// ErrNotExist.
func (k *Control) Write(data string) error {
	k.mu.Lock()
	defer k.mu.Unlock()
	if k.fd < 0 {
		return fmt.Errorf("writing %s: %w", k.path, os.ErrClosed)
	}
	for {
		_, err := unix.Write(k.fd, []byte(data))
		switch err {
		case nil:
			return nil
		case unix.EINTR:
			continue
		case unix.ENODEV:
			// kernfs's answer once the group is gone.
			return fmt.Errorf("writing %s: %w: %w", k.path, ErrNotExist, err)
		}
		return &os.PathError{Op: "write", Path: k.path, Err: err}
	}
}

// CPU weights a group is raised to by [CPUBoost.Set]: cgroup v2's cpu.weight
// at its maximum (the default is 100), and cgroup v1's cpu.shares at the
// same factor over its default of 1024.
const (
	boostWeightV2 = 10000
	boostSharesV1 = 102400
)

// CPUBoost is a top-level group's CPU weight file (cpu.weight on cgroup v2,
// cpu.shares on v1), kept open, through which the group's share of a busy
// CPU is raised while the server does work inside it, then set back.
//
// Why: a restore with processes waits for work that runs in the sandbox's
// group (the killed processes' exit, the copies' fix-ups made in their own
// context, a CRIU restore's restorer). On a CPU busy with other sandboxes,
// each of those wake-ups queues behind every other group with runnable
// tasks: with 64 sandboxes busy on 2 CPUs (make loadtest-process), a
// restore would take many times longer. A raised weight gives the group an
// early virtual deadline. The agent's own processes are dying or stopped for
// most of that time. A CPU quota (cpu.max, cpu.cfs_quota_us) still
// applies. Close leaves the weight as last set.
type CPUBoost struct {
	openFile
	normal []byte // the weight found at open, written back by Set(false)
	high   []byte
	on     bool
}

// OpenCPUBoost opens the weight file of the group's cpu controller (the
// top-level group's, for a sub-group). It returns nil, nil when the host
// gives the group no cpu controller.
func (c *Cgroup) OpenCPUBoost() (*CPUBoost, error) {
	d, ok := c.limit[ctrlCPU]
	if !ok {
		return nil, nil
	}
	name, high := "cpu.shares", boostSharesV1
	if c.m.l.ctrlV2[ctrlCPU] {
		name, high = "cpu.weight", boostWeightV2
	}
	p := filepath.Join(d, name)
	fd, err := openRetry(p, unix.O_RDWR|unix.O_CLOEXEC)
	if err != nil {
		return nil, c.wrap("opening the CPU weight of", &os.PathError{Op: "open", Path: p, Err: err})
	}
	var buf [32]byte
	n, err := unix.Pread(fd, buf[:], 0)
	if err != nil {
		unix.Close(fd)
		return nil, c.wrap("reading the CPU weight of", &os.PathError{Op: "read", Path: p, Err: err})
	}
	normal := bytes.TrimSpace(buf[:n])
	if _, err := strconv.Atoi(string(normal)); err != nil {
		unix.Close(fd)
		return nil, c.wrap("reading the CPU weight of", fmt.Errorf("%s holds %q", p, buf[:n]))
	}
	return &CPUBoost{openFile: openFile{fd: fd}, normal: normal, high: []byte(strconv.Itoa(high))}, nil
}

// Set raises the group's weight (on) or puts back the one found at open.
// Setting what is already set writes nothing.
func (b *CPUBoost) Set(on bool) error {
	b.mu.Lock()
	defer b.mu.Unlock()
	if b.fd < 0 {
		return errors.New("setting the CPU weight through a closed file")
	}
	if on == b.on {
		return nil
	}
	v := b.normal
	if on {
		v = b.high
	}
	for {
		_, err := unix.Pwrite(b.fd, v, 0)
		if err == unix.EINTR {
			continue
		}
		if err != nil {
			return fmt.Errorf("setting the CPU weight to %s: %w", v, err)
		}
		b.on = on
		return nil
	}
}
