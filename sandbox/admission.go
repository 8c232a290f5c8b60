package sandbox

import (
	"bytes"
	"fmt"
	"os"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"golang.org/x/sys/unix"
)

// Admission control.
//
// The runtime holds sandboxes and checkpoints for many callers on one
// machine, and each of them takes shared, finite resources of the server
// process and the host: descriptors (RLIMIT_NOFILE), mounts in the server's
// mount namespace (fs.mount-max), pids (kernel.pid_max), memory. A request
// that would take more than the machine has would fail half way, as an
// infrastructure error of whatever call next needed a descriptor or a
// mount, in any sandbox. So the runtime has caps (Caps), derived from the
// machine at start (HostCaps) unless configured, and refuses a request
// beyond one before it creates anything, with ErrCap naming the cap, its
// value and the setting that raises it. A Fork of n children is admitted
// whole or not at all: its n children are reserved at once.

// Cap names one of the runtime's caps.
type Cap string

// The caps (Caps' fields).
const (
	CapSandboxes       Cap = "sandboxes"
	CapCheckpoints     Cap = "checkpoints"
	CapCheckpointBytes Cap = "checkpoint-bytes"
	CapDescriptors     Cap = "descriptors"
	CapMounts          Cap = "mounts"
)

// Caps bound what the runtime holds at once. Zero means the value HostCaps
// derives from the machine; negative, no cap.
type Caps struct {
	// Sandboxes caps the live sandboxes (warm inits kept for forks not
	// included).
	Sandboxes int
	// Checkpoints caps the checkpoints held.
	Checkpoints int
	// Descriptors caps the descriptors of the server process: a new
	// sandbox is admitted while those open (counted at most every
	// fdRecount), fdsPerSandbox for each sandbox made since the count or
	// admitted but not made yet, and the hot set's descriptors
	// (fdsPerHotSandbox for each sandbox it may hold, hot.go) stay within
	// it.
	Descriptors int
	// Mounts caps the layer mounts in the server's mount namespace (one
	// tmpfs per writable or sealed layer): a sandbox is charged
	// mountsPerSandbox, a checkpoint one.
	Mounts int
}

// What one sandbox takes, for admission. fdsPerSandbox is the server's
// descriptors of an idle sandbox: its init's control socket (a root not
// swapped in yet adds one, which the descriptors counted at the next
// admission include); what a sandbox in use keeps beyond it is bounded by
// the hot set (hot.go), charged as a whole, fdsPerHotSandbox a sandbox
// (TestAdmissionCharges measures both); a persistent session adds its
// pipes, which the next count includes. mountsPerSandbox is its upper and the next upper prepared ahead.
// pidsPerSandbox is its init and one command; memPerSandbox is the memory
// an idle sandbox takes beside its own group's charge (kernel objects of its
// namespaces, the server's bookkeeping, and most of all the kernel's
// shrinker table of its memory group, a KiB for each 64 superblocks on the
// machine, which grows with the sandboxes: 1.35 MiB a sandbox of 10,000,
// docs/PERFORMANCE.md).
const (
	fdsPerSandbox    = 1
	fdsPerWarm       = 1 // a warm init's: its control socket
	mountsPerSandbox = 2
	pidsPerSandbox   = 2
	memPerSandbox    = 2 << 20
)

// Reserves left to the rest of the server when caps are derived: the
// descriptors of its listeners, connections, ledger spool and Postgres
// clients, and the mounts of everything but the layers.
const (
	descriptorReserve = 1024
	mountReserve      = 1000
	// maxDerivedCheckpoints bounds the derived checkpoint count: each is a
	// record in the metadata tmpfs and at least one layer mount.
	maxDerivedCheckpoints = 1 << 16
)

// Host is what HostCaps derives the caps from, read from the machine.
type Host struct {
	// NoFile is the server's RLIMIT_NOFILE soft limit.
	NoFile int
	// PidMax is kernel.pid_max.
	PidMax int
	// MountMax is fs.mount-max: the mounts one mount namespace may hold.
	MountMax int
	// Mounts are those of the server's mount namespace now.
	Mounts int
	// MemoryBytes is the machine's memory (MemTotal).
	MemoryBytes int64
}

// ReadHost reads the host's limits. A value it cannot read is 0.
func ReadHost() Host {
	var h Host
	var rl unix.Rlimit
	if unix.Getrlimit(unix.RLIMIT_NOFILE, &rl) == nil {
		h.NoFile = int(min(rl.Cur, 1<<30))
	}
	h.PidMax = readSysctl("/proc/sys/kernel/pid_max")
	h.MountMax = readSysctl("/proc/sys/fs/mount-max")
	if b, err := os.ReadFile("/proc/self/mountinfo"); err == nil {
		h.Mounts = bytes.Count(b, []byte{'\n'})
	}
	var si unix.Sysinfo_t
	if unix.Sysinfo(&si) == nil {
		h.MemoryBytes = int64(si.Totalram) * int64(si.Unit)
	}
	return h
}

func readSysctl(path string) int {
	b, err := os.ReadFile(path)
	if err != nil {
		return 0
	}
	n, _ := strconv.Atoi(strings.TrimSpace(string(b)))
	return n
}

// RaiseNoFile raises the process's RLIMIT_NOFILE soft limit to its hard
// limit and returns the limit in force. (Go's runtime does so at start
// too, and gives the programs it starts the limit it found; this makes
// the server's limit explicit whatever starts it.)
func RaiseNoFile() (int, error) {
	var rl unix.Rlimit
	if err := unix.Getrlimit(unix.RLIMIT_NOFILE, &rl); err != nil {
		return 0, fmt.Errorf("reading RLIMIT_NOFILE: %w", err)
	}
	if rl.Cur < rl.Max {
		rl.Cur = rl.Max
		if err := unix.Setrlimit(unix.RLIMIT_NOFILE, &rl); err != nil {
			return 0, fmt.Errorf("raising RLIMIT_NOFILE to %d: %w", rl.Max, err)
		}
	}
	return int(min(rl.Cur, 1<<30)), nil
}

// Derived are the caps HostCaps derives, with the budget of checkpoint
// bytes and the memory cap of the runtime's control group.
type Derived struct {
	Caps
	// CheckpointBytes: half the machine's memory (layers are tmpfs).
	CheckpointBytes int64
	// MemoryBytes caps the runtime's control group (every sandbox and
	// what removed sandboxes left charged to it: sealed layers' pages).
	MemoryBytes int64
	// Why names what bounds the sandbox cap ("descriptors", "pid_max",
	// "memory", "mounts" or "uid ranges").
	Why string
	// HotSandboxes is the size of the hot set the descriptor cap leaves
	// room for (hot.go), with Config.HotSandboxes 0.
	HotSandboxes int
}

// HostCaps derives caps from the host's limits: descriptors and mounts
// leave a reserve to the rest of the server, and live sandboxes are the
// fewest that any of descriptors (those the hot set leaves), pids, mounts,
// memory and uid ranges allow.
func HostCaps(h Host) Derived {
	var d Derived
	d.Descriptors = max(h.NoFile-descriptorReserve, h.NoFile/2)
	d.HotSandboxes = hotSandboxes(0, d.Descriptors)
	d.Mounts = max(h.MountMax-h.Mounts-mountReserve, 0)
	d.MemoryBytes = h.MemoryBytes - max(1<<30, h.MemoryBytes/8)
	d.CheckpointBytes = h.MemoryBytes / 2
	d.Sandboxes, d.Why = maxRanges, "uid ranges"
	for _, b := range []struct {
		n   int
		why string
	}{
		{(d.Descriptors - d.HotSandboxes*fdsPerHotSandbox) / fdsPerSandbox, "descriptors"},
		{h.PidMax * 3 / 4 / pidsPerSandbox, "pid_max"},
		{d.Mounts / 2 / mountsPerSandbox, "mounts"},
		{int(max(d.MemoryBytes, 0) / memPerSandbox), "memory"},
	} {
		if b.n < d.Sandboxes {
			d.Sandboxes, d.Why = max(b.n, 1), b.why
		}
	}
	d.Checkpoints = max(min(d.Mounts/2, maxDerivedCheckpoints), 1)
	return d
}

// HostWarnings says which host settings hold the caps below what they
// could be, or are too low for caps set by hand, with the setting to change.
func HostWarnings(h Host, c Caps) []string {
	var out []string
	if c.Sandboxes > 0 && h.PidMax > 0 && c.Sandboxes*pidsPerSandbox > h.PidMax*3/4 {
		out = append(out, fmt.Sprintf("kernel.pid_max is %d: too few pids for %d sandboxes (%d each); raise it (sysctl kernel.pid_max=%d)",
			h.PidMax, c.Sandboxes, pidsPerSandbox, c.Sandboxes*pidsPerSandbox*4/3+1))
	}
	if hot := hotSandboxes(0, c.Descriptors) * fdsPerHotSandbox; c.Sandboxes > 0 && h.NoFile > 0 && c.Sandboxes*fdsPerSandbox+hot > h.NoFile {
		out = append(out, fmt.Sprintf("RLIMIT_NOFILE is %d: too few descriptors for %d sandboxes (%d each, and %d for the sandboxes in use); raise the hard limit (ulimit -Hn, or LimitNOFILE= of the service)",
			h.NoFile, c.Sandboxes, fdsPerSandbox, hot))
	}
	if c.Mounts > 0 && h.MountMax > 0 && c.Mounts+h.Mounts > h.MountMax {
		out = append(out, fmt.Sprintf("fs.mount-max is %d with %d mounts in use: too few for a cap of %d layer mounts; raise it (sysctl fs.mount-max)",
			h.MountMax, h.Mounts, c.Mounts))
	}
	return out
}

// withCaps fills in the caps left 0 from the host and turns negative ones
// into 0 (no cap).
func (c Caps) withHost(d Derived) Caps {
	pick := func(v, derived int) int {
		switch {
		case v < 0:
			return 0
		case v == 0:
			return derived
		}
		return v
	}
	return Caps{Sandboxes: pick(c.Sandboxes, d.Sandboxes), Checkpoints: pick(c.Checkpoints, d.Checkpoints),
		Descriptors: pick(c.Descriptors, d.Descriptors), Mounts: pick(c.Mounts, d.Mounts)}
}

// capError is a refusal by cap c of value limit: used in use, asked more.
func (r *Runtime) capError(c Cap, limit, used, asked int64, what string) error {
	hint := ""
	if f := r.cfg.CapFlags[c]; f != "" {
		hint = "; " + f + " raises it"
	}
	if n := r.Retiring(); n > 0 && c != CapCheckpoints && c != CapCheckpointBytes {
		// Closed sandboxes count with what they hold until torn down (retire.go).
		hint += fmt.Sprintf("; %d closed sandboxes, not yet torn down, count among those in use", n)
	}
	return fmt.Errorf("%w: the server's cap %q of %d %s would be exceeded (%d in use, %d asked)%s",
		ErrCap, c, limit, what, used, asked, hint)
}

// openFDs counts the process's open descriptors.
func openFDs() (int, error) {
	f, err := os.Open("/proc/self/fd")
	if err != nil {
		return 0, err
	}
	defer f.Close()
	n := -1 // the directory's own
	for {
		names, err := f.Readdirnames(4096)
		n += len(names)
		if err != nil || len(names) == 0 {
			return n, nil
		}
	}
}

// admission is the runtime's caps and what counts against them besides the
// runtime's own maps. Its mu is taken with Runtime.mu held or alone, and
// takes no other lock.
type admission struct {
	caps Caps // in force, set at start
	mu   sync.Mutex
	// reserved counts sandboxes admitted and not made yet.
	// +checklocks:mu
	reserved int
	// fds is the server's descriptors as last counted, at fdsAt (Unix
	// nanoseconds); fdsMade, the sandboxes made since.
	// +checklocks:mu
	fds int
	// +checklocks:mu
	fdsMade int
	fdsAt   atomic.Int64
	// heads counts, per checkpoint, the live sandboxes whose state
	// descends from it (their head): it does not expire meanwhile.
	// +checklocks:mu
	heads map[string]int
	// ranges holds the free host id ranges.
	// +checklocks:mu
	ranges []int
	// rangesTotal counts the host id ranges, free or not (hostRanges).
	rangesTotal int
}

// fdRecount is how old a count of the server's descriptors admission uses
// may be: counting reads /proc/self/fd, some milliseconds with thousands
// open. Between counts, each sandbox made since is charged fdsPerSandbox.
const fdRecount = time.Second

// countFDs counts the server's descriptors again if the last count is
// older than fdRecount.
func (r *Runtime) countFDs() error {
	if time.Since(time.Unix(0, r.adm.fdsAt.Load())) < fdRecount {
		return nil
	}
	n, err := openFDs()
	if err != nil {
		return fmt.Errorf("counting the server's descriptors: %w", err)
	}
	r.adm.mu.Lock()
	r.adm.fds, r.adm.fdsMade = n, 0
	r.adm.mu.Unlock()
	r.adm.fdsAt.Store(time.Now().UnixNano())
	return nil
}

// admitSandboxes reserves n sandboxes, or refuses them with ErrCap: the
// runtime's sandbox, descriptor and mount caps must hold with them and
// every sandbox reserved before. The caller makes them, then calls
// register (which turns a reservation into a live sandbox) or unreserve.
// The warm pool counts: a child that takes a warm init adds only what the
// init does not hold yet (its descriptors were counted with the server's),
// and the pool gives way: a request refused for descriptors while it holds
// inits frees as many as it was short of (a freed init's net namespace may
// stay in the net pool: so again while it is short) and is admitted then.
func (r *Runtime) admitSandboxes(n int) error {
	short, err := r.admitOnce(n)
	for short > 0 && r.shedWarm((short+fdsPerWarm-1)/fdsPerWarm) > 0 {
		r.adm.fdsAt.Store(0)
		short, err = r.admitOnce(n)
	}
	return err
}

// admitOnce is admitSandboxes without the pool giving way: on a refusal
// for descriptors it also returns how many descriptors were short.
func (r *Runtime) admitOnce(n int) (short int, err error) {
	a := &r.adm
	if a.caps.Descriptors > 0 {
		if err := r.countFDs(); err != nil {
			return 0, err
		}
	}
	r.mu.Lock()
	defer r.mu.Unlock()
	a.mu.Lock()
	defer a.mu.Unlock()
	live := len(r.sandboxes) + a.reserved
	if c := a.caps.Sandboxes; c > 0 && live+n > c {
		return 0, r.capError(CapSandboxes, int64(c), int64(live), int64(n), "live sandboxes")
	}
	if c := a.caps.Descriptors; c > 0 {
		// The hot set's descriptors are charged whole: those it holds
		// now are in the count too, which errs on the safe side. A child
		// that takes a warm init adds nothing: the init's socket is
		// counted already.
		hot := r.hot.max * fdsPerHotSandbox
		used := r.descriptorsUsedLocked()
		need := (n - min(n, max(len(r.warm.ready)-a.reserved, 0))) * fdsPerSandbox
		if used+need > c {
			return used + need - c, r.capError(CapDescriptors, int64(c), int64(used), int64(need),
				fmt.Sprintf("descriptors (%d an idle sandbox, %d for the %d sandboxes used last)", fdsPerSandbox, hot, r.hot.max))
		}
	}
	if c := a.caps.Mounts; c > 0 {
		if used := r.layers.Mounts() + a.reserved*mountsPerSandbox; used+n*mountsPerSandbox > c {
			return 0, r.capError(CapMounts, int64(c), int64(used), int64(n*mountsPerSandbox), fmt.Sprintf("layer mounts (%d a sandbox)", mountsPerSandbox))
		}
	}
	a.reserved += n
	return 0, nil
}

// descriptorsUsedLocked is what admission counts of the server's descriptors: those open at
// the last count, fdsPerSandbox for each sandbox made since or reserved, and the hot set's
// charge, whole.
// +checklocks:r.adm.mu
func (r *Runtime) descriptorsUsedLocked() int {
	a := &r.adm
	return a.fds + (a.fdsMade+a.reserved)*fdsPerSandbox + r.hot.max*fdsPerHotSandbox
}

// unreserve gives back n reserved sandboxes that were not made.
func (r *Runtime) unreserve(n int) {
	r.adm.mu.Lock()
	r.adm.reserved -= n
	r.adm.mu.Unlock()
}

// admitCheckpoint refuses a checkpoint beyond the count, mount or bytes
// caps (need: the bytes it would add; mounts: the layers it may make beside
// its top one, a copy of /dev/shm), before anything is captured.
func (r *Runtime) admitCheckpoint(need int64, mounts int) error {
	if b := r.cfg.CheckpointBudgetBytes; b > 0 {
		if used := r.CheckpointBytes(); need > b-used { // not used+need: a peer's need may be near 2^63
			return r.capError(CapCheckpointBytes, b, used, need, "bytes of checkpoints (sealed layers and process images)")
		}
	}
	a := &r.adm
	r.mu.Lock()
	defer r.mu.Unlock()
	a.mu.Lock()
	defer a.mu.Unlock()
	if c := a.caps.Checkpoints; c > 0 && len(r.ckpts) >= c {
		return r.capError(CapCheckpoints, int64(c), int64(len(r.ckpts)), 1, "checkpoints")
	}
	if c := a.caps.Mounts; c > 0 {
		if used := r.layers.Mounts() + a.reserved*mountsPerSandbox; used+1+mounts > c {
			return r.capError(CapMounts, int64(c), int64(used), int64(1+mounts), "layer mounts (one a checkpoint, two with /dev/shm)")
		}
	}
	return nil
}

// CheckCheckpointAdmission returns the refusal (ErrCap) a checkpoint would get now by the count
// and mount caps, and by the bytes cap for what is held already: for a caller that does
// something before it checkpoints (a step with a checkpoint after it).
func (r *Runtime) CheckCheckpointAdmission() error { return r.admitCheckpoint(0, 0) }

// Caps returns the caps in force (0: none).
func (r *Runtime) Caps() Caps { return r.adm.caps }

// admission puts the caps in force: the configured ones, the rest derived
// from the host; the runtime's control group gets its memory cap. It logs
// the caps and the host settings that hold them low.
func (r *Runtime) admission() error {
	h := ReadHost()
	d := HostCaps(h)
	if n := r.adm.rangesTotal; n < d.Sandboxes {
		d.Sandboxes, d.Why = n, "uid ranges" // the host's users hold some
	}
	r.adm.caps = r.cfg.Caps.withHost(d)
	c := r.adm.caps
	r.hot = newHotSet(hotSandboxes(r.cfg.HotSandboxes, c.Descriptors))
	mem := r.cfg.MemoryBytes
	if mem == 0 {
		mem = d.MemoryBytes
	}
	if err := r.cg.SetBaseMemory(mem); err != nil {
		return err
	}
	d.Why = sandboxesBoundedBy(r.cfg.Caps.Sandboxes, r.cfg.CapFlags[CapSandboxes], d.Why)
	r.log.Info("admission caps", "sandboxes", c.Sandboxes, "checkpoints", c.Checkpoints,
		"checkpoint_bytes", r.cfg.CheckpointBudgetBytes, "descriptors", c.Descriptors, "mounts", c.Mounts,
		"memory_bytes", max(mem, 0), "sandboxes_bounded_by", d.Why, "hot_sandboxes", r.hot.max)
	for _, w := range HostWarnings(h, c) {
		r.log.Warn("host setting too low for the admission caps: " + w)
	}
	return nil
}

// sandboxesBoundedBy names what sets the sandbox cap, for the log: the setting that configured
// it (set > 0; its flag's name where flag names one, as CapFlags do), "none" for no cap (set <
// 0), else what of the host bounds the derived cap (why, Derived.Why).
func sandboxesBoundedBy(set int, flag, why string) string {
	switch {
	case set < 0:
		return "none"
	case set == 0:
		return why
	}
	for f := range strings.FieldsSeq(flag) {
		if strings.HasPrefix(f, "--") {
			return f
		}
	}
	return "config"
}

// CheckAdmission returns the refusal (ErrCap) n more sandboxes would get
// now, without reserving them: for a caller that makes something before it
// asks for them (the checkpoint of a sandbox to fork from).
func (r *Runtime) CheckAdmission(n int) error {
	if err := r.admitSandboxes(n); err != nil {
		return err
	}
	r.unreserve(n)
	return nil
}
