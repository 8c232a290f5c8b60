package sandbox

import (
	"bytes"
	"cmp"
	"context"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"os"
	"path/filepath"
	"regexp"
	"slices"
	"sort"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"golang.org/x/sys/unix"

	"github.com/deltagym/deltagym/internal/nodeid"
	"github.com/deltagym/deltagym/sandbox/cgroup"
	"github.com/deltagym/deltagym/sandbox/criu"
	"github.com/deltagym/deltagym/sandbox/image"
	"github.com/deltagym/deltagym/sandbox/launch"
	"github.com/deltagym/deltagym/sandbox/layers"
	"github.com/deltagym/deltagym/sandbox/overlay"
	"github.com/deltagym/deltagym/sandbox/procstate"
)

// Config configures a Runtime.
type Config struct {
	// DataDir holds images, layers and checkpoints (under DataDir/store).
	DataDir string
	// DigestAhead hashes each checkpoint's new layers in the background, one at a time, as a
	// node of a cluster does: another node that fetches the checkpoint then finds their
	// digests known (CheckpointManifest) instead of waiting for them. Best effort: a layer
	// the queue has no room for is hashed when first asked.
	DigestAhead bool
	// Node is the name of the node the runtime runs on (internal/nodeid.CheckName), carried
	// by every sandbox and checkpoint ID it makes; "": IDs of no node.
	Node string
	// InitBinary is the static dg-init that runs as pid 1 of every
	// sandbox (`make init` builds bin/dg-init; internal/locate.Init finds
	// it). Required.
	InitBinary string
	// CgroupRoot is the cgroup path segment of the runtime's groups.
	CgroupRoot string
	// Caps bound the sandboxes, checkpoints, descriptors and mounts the
	// runtime holds at once (admission.go); a request beyond one fails with
	// ErrCap before anything is made. Zero fields are derived from the
	// machine (HostCaps), negative ones mean no cap.
	Caps Caps
	// CapFlags name, for each cap, the setting that raises it, for the
	// refusals' messages (the server gives its flags).
	CapFlags map[Cap]string
	// CheckpointBudgetBytes caps the bytes of all sealed layers and CRIU
	// images; a checkpoint beyond it fails with ErrCap. 0 means
	// unlimited.
	CheckpointBudgetBytes int64
	// CheckpointTTL releases a checkpoint once it has not been used (taken,
	// restored, forked from) for this long, unless it is pinned
	// (CheckpointOptions.Pinned) or a live sandbox's state descends from
	// it (its head). 0 means checkpoints live until released.
	CheckpointTTL time.Duration
	// OnCheckpointExpired, if set, is called with the id of each checkpoint
	// CheckpointTTL released, once it is gone (on the runtime's own
	// goroutine, with no lock held).
	OnCheckpointExpired func(id string)
	// OnStateDigest, if set, is called once with each checkpoint's state digest when it is
	// computed (StateDigest), on the runtime's own goroutine with no lock held: for the ledger.
	OnStateDigest func(id string, d StateDigest)
	// DefaultDiskBytes is the writable layer's size when Limits has none.
	DefaultDiskBytes int64
	// DefaultInodes is the writable layer's inode limit (its files,
	// directories and links) when Limits has none. 0: one per 8 KiB of the
	// layer's size, at least 4096.
	DefaultInodes int64
	// CPUWeight is every sandbox's share of a busy CPU against the others
	// (cgroup v2's cpu.weight scale, 1 to 10000). Default 100.
	CPUWeight int
	// MemoryBytes caps the memory of the runtime's control group, which
	// holds every sandbox's and is charged, once a sandbox is gone, with
	// the pages of the layers it wrote (sealed checkpoints' tmpfs pages).
	// 0: derived from the machine (HostCaps); negative: no cap.
	MemoryBytes int64
	// NetPool is how many ready net namespaces to keep (default 64); net
	// namespaces of ended sandboxes are reused.
	NetPool int
	// HotSandboxes bounds the sandboxes that keep the descriptors that make
	// them fast (their layers' idmapped clones, their command groups'
	// control files); the least recently used beyond it give them up and
	// open them again when next used (hot.go). 0: a quarter of the
	// descriptor cap, 16 descriptors a sandbox (between 16 and 4,096;
	// 1,024 without a descriptor cap); negative: no bound.
	HotSandboxes int
	// InitPool bounds the ready sandbox inits kept for fork fan-outs
	// (warm.go): the pool grows to the largest Fork asked for, up to this
	// (default 1,024, the largest Fork; negative: none), and shrinks back
	// when no fan-out has asked for it for warmDecay.
	InitPool int
	// FlattenDepth is the stack depth beyond which a checkpoint's layers
	// are merged into one in the background (default 16). Checkpoints
	// keep their contents and IDs; restores and later checkpoints use the
	// merged layer instead of the stack it stands for.
	FlattenDepth int
	// ProcessMode is how checkpoints capture live processes unless told
	// otherwise; ProcessesDefault means ProcessesTemplate.
	ProcessMode ProcessMode
	// SmallPageTemplates leaves process templates, and the live processes
	// checkpointed, in 4 KiB pages, instead of folding their memory into
	// huge pages in the background (hugepages.go).
	SmallPageTemplates bool
	// ForkAtRestore forks each template's copy during the restore that
	// needs it, instead of ahead of it, after the checkpoint's previous
	// restore (ahead.go).
	ForkAtRestore bool
	// KeepCgroupOptions leaves the host's cgroup2 hierarchy as it is,
	// instead of turning on its option favordynmods, which the runtime
	// does by default and leaves on (cgroup.Manager.FavorDynMods): every
	// checkpoint and restore of a process moves one between groups.
	KeepCgroupOptions bool
	// CRIU is the CRIU 4.2.1+ wrapper of the general path, which saves
	// and restores the processes templates cannot (`make criu` installs
	// it; internal/locate.CRIU finds it). It is checked each time it is
	// needed, not at New: a wrapper installed while the runtime runs is
	// used from then on. Empty: none, and the checkpoints, restores and
	// forks that need CRIU fail with ErrProcesses.
	CRIU string
	// Logger receives the runtime's logs; nil means slog.Default().
	Logger *slog.Logger
}

// Validate reports whether the configuration is usable.
func (c Config) Validate() error {
	if c.DataDir == "" {
		return fmt.Errorf("%w: DataDir is empty", ErrInvalid)
	}
	if c.InitBinary == "" {
		return fmt.Errorf("%w: InitBinary is empty: no sandbox init (make init builds bin/dg-init)", ErrInvalid)
	}
	if c.Node != "" {
		if err := nodeid.CheckName(c.Node); err != nil {
			return fmt.Errorf("%w: %v", ErrInvalid, err)
		}
	}
	if c.CheckpointBudgetBytes < 0 || c.CheckpointTTL < 0 || c.DefaultDiskBytes < 0 || c.DefaultInodes < 0 || c.NetPool < 0 || c.FlattenDepth < 0 {
		return fmt.Errorf("%w: negative budget, TTL, disk size, inode count or pool size", ErrInvalid)
	}
	if c.CPUWeight < 0 || c.CPUWeight > 10000 {
		return fmt.Errorf("%w: CPU weight %d: from 1 to 10000", ErrInvalid, c.CPUWeight)
	}
	return nil
}

// Limits are a sandbox's resource limits. Zero means the default (disk) or
// unlimited (the others).
type Limits struct {
	MemoryBytes int64
	Pids        int64
	CPUs        float64
	DiskBytes   int64
	// Inodes caps the files, directories and links of the writable layer.
	Inodes int64
}

// Spec describes a sandbox to create.
type Spec struct {
	// Image names the image to start from, unless Checkpoint is set.
	Image string
	// Checkpoint starts the sandbox at this checkpoint (of its image).
	Checkpoint string
	Limits     Limits
	Hostname   string
	// UID and GID are the user commands run as (0: the namespace's root).
	UID, GID uint32
	// Env is the base environment of commands, KEY=VALUE.
	Env []string
	// Workdir is the default working directory of commands.
	Workdir string
	// FreshEntropy writes a seed of the sandbox's own to SeedPath.
	FreshEntropy bool
	// FilesOnly starts from Checkpoint's files alone, without the
	// processes it captured.
	FilesOnly bool
	// SkipTemplates starts from Checkpoint's files and the process trees it
	// saved with CRIU, without the processes it keeps as templates, which
	// only their own sandbox can bring back. Without it (or FilesOnly) a
	// checkpoint with templates is refused with ErrProcesses.
	SkipTemplates bool
	// Egress, if set, serves the sandbox's outbound network: a listener on
	// 127.0.0.1:egress.ProxyPort inside its net namespace, for its life.
	// Without it the sandbox has loopback alone.
	Egress EgressServer
}

// EgressServer serves the egress listener of a sandbox (sandbox/egress). The
// Closer it returns ends the service and its connections; the sandbox
// closes it before its net namespace serves another.
type EgressServer interface {
	ServeEgress(ln net.Listener, sandboxID string) io.Closer
}

// ImageInfo describes an imported image.
type ImageInfo struct {
	Name   string
	Digest string
	Layers int
	Config image.Config
}

// CheckpointInfo describes a checkpoint.
type CheckpointInfo struct {
	ID        string
	Parent    string
	Image     string
	SandboxID string
	Depth     int
	SizeBytes int64
	Created   time.Time
	// Processes are the live processes the checkpoint captured.
	Processes []ProcessCapture
	// Labels are the caller's (CheckpointOptions.Labels, SetCheckpointLabels), kept in the
	// checkpoint's record: they survive a restart and go with the checkpoint.
	Labels map[string]string
	// Hold is what keeps it from Config.CheckpointTTL (ListCheckpoints fills it in).
	Hold CheckpointHold
}

// CheckpointHold is what keeps a checkpoint from expiring: pinned (CheckpointOptions.Pinned),
// live sandboxes whose state descends from it, and when it was last taken, restored or forked
// from. Expires is when the TTL releases it if nothing changes (zero: never).
type CheckpointHold struct {
	Pinned   bool
	Heads    int
	LastUsed time.Time
	Expires  time.Time
}

type imageRec struct {
	info   ImageInfo
	layers []string // directories, bottom first
	// skel: roots of the image need the skeleton layer under its layers
	// (skeletonCovered).
	skel bool
}

// checkpoint is the persisted record of a checkpoint.
type checkpoint struct {
	// Its id, the sandbox that made it, and its processes.
	procstate.Checkpoint
	Parent string   `json:"parent,omitempty"`
	Image  string   `json:"image"`
	Layers []string `json:"layers"` // delta layers, bottom first
	// Flat, once the background flattener has made it, is an equivalent
	// shorter stack that stands for Layers: one merged layer, or for a hot
	// checkpoint the bottom of Layers and one layer merged from the rest.
	// It holds a reference to each of its layers.
	Flat []string `json:"flat,omitempty"`
	// Shm is the sealed layer holding a copy of the sandbox's /dev/shm,
	// "" when it was empty (shm.go). It holds a reference to it.
	Shm     string    `json:"shm,omitempty"`
	Size    int64     `json:"size"`
	Created time.Time `json:"created"`
	// Pinned checkpoints never expire (CheckpointOptions.Pinned).
	Pinned bool `json:"pinned,omitempty"`
	// Digest is its state digest once computed (digest_jobs.go). Guarded by Runtime.mu.
	Digest *digestRec `json:"digest,omitempty"`
	// Labels are the caller's (CheckpointInfo.Labels). Once the checkpoint is
	// added, guarded by Runtime.mu and replaced, never changed in place.
	Labels map[string]string `json:"labels,omitempty"`
	// hotTried: maybeFlattenHot has looked at the checkpoint (without
	// Runtime.mu: it is on the restore's path).
	hotTried atomic.Bool
	// used is when the checkpoint was last taken, restored or forked from
	// (Unix nanoseconds; 0: not since the runtime started), for
	// CheckpointTTL.
	used atomic.Int64
	// imageErr is why CRIU refused to save its templates (their frozen
	// state does not change, nor will the answer): not asked again, at a
	// teardown or a shutdown. Guarded by procImages.tplLocks (its key).
	imageErr error
}

// unrefFiles drops c's references to its layers, for a checkpoint that
// could not be completed.
func (c *checkpoint) unrefFiles(r *Runtime) {
	unrefAll(r, c.Layers)
	if c.Shm != "" {
		r.layers.Unref(c.Shm)
	}
}

// imageBytes is the size of c's CRIU images. Called with Runtime.mu held
// (TplImages may change).
func (c *checkpoint) imageBytes() int64 {
	var n int64
	for _, u := range slices.Concat(c.Images, c.TplImages) {
		n += u.Bytes
	}
	return n
}

func (c *checkpoint) info() CheckpointInfo {
	ci := CheckpointInfo{ID: c.ID, Parent: c.Parent, Image: c.Image, SandboxID: c.SandboxID,
		Depth: len(c.Layers), SizeBytes: c.Size, Created: c.Created, Labels: cloneLabels(c.Labels)}
	for i, p := range c.Procs {
		pc := ProcessCapture{Pid: p.NSPid, Command: p.Comm, Method: CaptureTemplate, Session: p.Session}
		if p.Shares != "" {
			pc.Reason = "its copies share " + p.Shares + " (removed from /dev/shm while in use) with it: what they write there is not rolled back"
		}
		if i < len(c.TplImages) && len(c.TplImages[i].Procs) > 0 {
			u := c.TplImages[i]
			pc.ImagePid, pc.Unsaved = u.Procs[0].NSPid, shmUnsaved(u, p.NSPid, p.Comm, true)
			pc.Saved = pc.Unsaved == ""
		}
		ci.Processes = append(ci.Processes, pc)
	}
	for _, u := range c.Images {
		for i, p := range u.Procs {
			pc := ProcessCapture{Pid: p.NSPid, Command: p.Comm, Method: CaptureCRIU, Reason: u.Why, Unsaved: shmUnsaved(u, p.NSPid, p.Comm, false)}
			pc.Saved = pc.Unsaved == ""
			if i == 0 {
				pc.Session = u.Session
			}
			ci.Processes = append(ci.Processes, pc)
		}
	}
	return ci
}

// overlays are the overlay helpers every root of the runtime shares.
type overlays struct {
	links  *overlay.Links  // hard-link groups of lowers (sandbox.linkUp)
	covers *overlay.Covers // for roots not swapped in yet (Sandbox.root)
}

// Runtime creates and tracks sandboxes, images and checkpoints.
type Runtime struct {
	cfg     Config
	log     *slog.Logger
	store   string
	layers  *layers.Store
	cg      *cgroup.Manager
	spawn   *launch.SpawnNS
	net     *launch.NetPool
	devnull *os.File
	skel    string
	lock    *os.File
	adm     admission // caps and what counts against them (admission.go)
	hot     *hotSet   // sandboxes keeping their descriptors (hot.go)
	ovl     overlays  // the overlay helpers every root shares

	// pimg is the runtime's CRIU and the images of checkpoints' processes.
	pimg procImages

	mu sync.Mutex
	// +checklocks:mu
	sandboxes map[string]*Sandbox
	// +checklocks:mu
	images map[string]*imageRec
	// +checklocks:mu
	ckpts map[string]*checkpoint
	// flat maps stackKey(Layers) to a checkpoint with Flat.
	// +checklocks:mu
	flat map[string]*checkpoint
	// flatBusy holds the checkpoints being flattened.
	// +checklocks:mu
	flatBusy map[string]bool
	ended    []string
	// +checklocks:mu
	closed bool

	warm warmInits // ready inits (warm.go)

	ret   retirement        // teardowns of closed sandboxes (retire.go)
	jobs  ckptJobs          // flattening and state digests of checkpoints, in the background
	folds *procstate.Folder // processes to fold into huge pages
	done  chan struct{}
	wg    sync.WaitGroup
	hooks testHooks
	// xfer is what moving checkpoints between nodes keeps (transfer.go).
	xfer transferState
}

// ckptJobs are the background work on checkpoints once taken.
type ckptJobs struct {
	flatSem chan struct{} // one flattening at a time
	// digests are the checkpoints' state digests and indexes (digest_jobs.go).
	digests *stateDigests
}

// procImages is the runtime's CRIU runner and the bookkeeping of the CRIU
// images of checkpoints' processes.
type procImages struct {
	mu sync.Mutex
	// swrk is made on first use (criuSwrk).
	// +checklocks:mu
	swrk *criu.Swrk
	// tplLocks serialises the making of images from templates, per
	// checkpoint.
	tplLocks keyedLocks
	// making counts durable checkpoints' images being made; Close waits
	// for them before it ends the sandboxes.
	making sync.WaitGroup
	// bytes is the size of every checkpoint's CRIU images, charged to the
	// checkpoint budget with the sealed layers.
	bytes atomic.Int64
}

// testHooks change the runtime's behaviour or observe it, for tests
// (export_test.go); all are unset in production.
type testHooks struct {
	// aheadAlways forks copies ahead even after restores that come back
	// to back (tests: their steps' length must not decide).
	aheadAlways bool
	// onBoost, if set, is called inside each checkpoint, restore or fork
	// that raised its sandbox's CPU weight, right after it did.
	onBoost func()
	// onSettle, if set, is told how each restore that killed processes
	// went on (Sandbox.settleKilled): "gone", "slow", "exiting", "waited",
	// "sockets" or "timeout".
	onSettle func(how string)
	// onRoom, if set, is told the memory use settleKilled judged the room
	// by, against the limit (Sandbox.limitsRoom).
	onRoom func(limit, current int64)
	// killedGrace, if set, replaces the constant of that name.
	killedGrace time.Duration
	// noRoom makes the sandboxes' processes find no room for memory of
	// their own at a checkpoint (procHost.MemoryRoom).
	noRoom bool
	// stopWait, if set, replaces procstate's bound on stopping the
	// command group for a checkpoint.
	stopWait time.Duration
	// onWarm, if set, is told how many inits the warm pool holds after
	// each pass that filled it as far as its target and the caps allow
	// (set while the warm loop runs).
	onWarm atomic.Pointer[func(ready int)]
	// onDigestWalk, if set, is told, for each files index built, how
	// many layers it applied over the index it started from and how many
	// entries it walked in them.
	onDigestWalk func(id string, layers, entries int)
	// onFlattened, if set, is told each checkpoint whose flattening is
	// recorded.
	onFlattened func(id string)
}

// New starts a runtime on cfg.DataDir. It reconciles what an earlier run
// left: checkpoints whose layers survived are adopted, every other layer is
// discarded, leftover cgroups are removed, and sandboxes that were live are
// reported by Ended.
func New(ctx context.Context, cfg Config) (*Runtime, error) {
	cfg, err := cfg.withDefaults()
	if err != nil {
		return nil, err
	}
	log := cfg.Logger
	if log == nil {
		log = slog.Default()
	}
	r := &Runtime{
		adm: admission{heads: map[string]int{}},
		cfg: cfg, log: log, store: filepath.Join(cfg.DataDir, "store"),
		sandboxes: map[string]*Sandbox{}, images: map[string]*imageRec{}, ckpts: map[string]*checkpoint{},
		flat: map[string]*checkpoint{}, flatBusy: map[string]bool{},
		done: make(chan struct{}), jobs: ckptJobs{flatSem: make(chan struct{}, 1), digests: newStateDigests()}, ret: retirement{slots: make(chan struct{}, retireSlots())},
		ovl: overlays{links: overlay.NewLinks()}, hot: newHotSet(0),
	}
	ranges, dropped, err := hostRanges(hostIDFiles)
	if err != nil {
		return nil, err
	}
	if dropped > 0 {
		r.log.Info("host id ranges: ranges that hold an id of a user or group of the host, or of a subordinate range, are none of a sandbox's",
			"dropped", dropped, "left", len(ranges))
	}
	r.adm.ranges, r.adm.rangesTotal = ranges, len(ranges)
	var cleanup []func()
	fail := func(err error) (*Runtime, error) {
		for i := len(cleanup) - 1; i >= 0; i-- {
			cleanup[i]()
		}
		return nil, err
	}
	if err := r.openStore(&cleanup); err != nil {
		return fail(err)
	}
	if err := r.openCgroups(); err != nil {
		return fail(err)
	}
	if err := r.admission(); err != nil {
		return fail(err)
	}
	if err := r.reconcile(ctx); err != nil {
		return fail(err)
	}
	if err := r.openHost(&cleanup); err != nil {
		return fail(err)
	}
	r.startLoops()
	return r, nil
}

// withDefaults validates cfg and fills in its defaults: an absolute data
// directory, a cgroup root of the data directory's own, and the sizes of
// disks and pools.
func (cfg Config) withDefaults() (Config, error) {
	if err := cfg.Validate(); err != nil {
		return cfg, err
	}
	abs, err := filepath.Abs(cfg.DataDir)
	if err != nil {
		return cfg, err
	}
	cfg.DataDir = abs
	if cfg.CgroupRoot == "" {
		// One cgroup root per data directory: a runtime removes the groups
		// it finds under its root as leftovers of its own previous run, so
		// two servers must never share one.
		sum := sha256.Sum256([]byte(abs))
		cfg.CgroupRoot = cgroup.DefaultRoot + "-" + hex.EncodeToString(sum[:4])
	}
	if cfg.DefaultDiskBytes == 0 {
		cfg.DefaultDiskBytes = 1 << 30
	}
	if cfg.NetPool == 0 {
		cfg.NetPool = 64
	}
	if cfg.InitPool == 0 {
		cfg.InitPool = maxFork
	}
	cfg.InitPool = min(max(cfg.InitPool, 0), maxFork)
	if cfg.FlattenDepth == 0 {
		cfg.FlattenDepth = 16
	}
	cfg.CPUWeight = cmp.Or(cfg.CPUWeight, 100)
	return cfg, nil
}

// openStore makes the data directory the runtime's: locked against a
// second runtime, its metadata tmpfs mounted, its directories, skeleton
// layer and layer store in place. What needs undoing on a later failure
// is added to cleanup.
func (r *Runtime) openStore(cleanup *[]func()) error {
	if err := os.MkdirAll(r.store, 0o700); err != nil {
		return fmt.Errorf("creating data directory: %w", err)
	}
	lock, err := lockStore(r.store)
	if errors.Is(err, ErrExists) {
		return fmt.Errorf("%w; a second server needs a data directory of its own (--data DIR, or make run DATA=DIR)", err)
	}
	if err != nil {
		return err
	}
	r.lock = lock
	*cleanup = append(*cleanup, func() { lock.Close() })
	if err := os.WriteFile(filepath.Join(r.store, cgroupRootFile), []byte(r.cfg.CgroupRoot+"\n"), 0o600); err != nil {
		return fmt.Errorf("recording the cgroup root: %w", err)
	}
	if err := mountMeta(r.store); err != nil {
		return err
	}
	for _, d := range []string{"images", "meta/checkpoints", "meta/sandboxes"} {
		if err := os.MkdirAll(filepath.Join(r.store, d), 0o700); err != nil {
			return fmt.Errorf("creating data directory: %w", err)
		}
	}
	if r.skel, err = makeSkeleton(r.store); err != nil {
		return err
	}
	if r.layers, err = layers.New(filepath.Join(r.store, "layers")); err != nil {
		return err
	}
	return nil
}

// openCgroups opens the runtime's cgroup root, and turns on favordynmods
// unless the configuration keeps the host's cgroup options.
func (r *Runtime) openCgroups() error {
	var err error
	if r.cg, err = cgroup.New(cgroup.Config{Root: r.cfg.CgroupRoot}); err != nil {
		return fmt.Errorf("opening cgroups: %w", err)
	}
	if r.cfg.KeepCgroupOptions {
		return nil
	}
	if on, err := r.cg.FavorDynMods(); err != nil {
		r.log.Warn("cgroups: favordynmods could not be turned on; moving a process between groups will wait for an RCU grace period now and then (5-15 ms)", "err", err)
	} else if on {
		r.log.Info("cgroups: turned on the cgroup2 option favordynmods, for the whole host: moving a process between groups no longer waits for an RCU grace period (keep-cgroup-options leaves it off)")
	}
	return nil
}

// openHost opens what every sandbox shares: the host's /dev/null, the
// covers, the namespace spawner and the network pool. What needs undoing
// on a later failure is added to cleanup.
func (r *Runtime) openHost(cleanup *[]func()) error {
	var err error
	if r.devnull, err = os.OpenFile(os.DevNull, os.O_RDWR, 0); err != nil {
		return err
	}
	*cleanup = append(*cleanup, func() { r.devnull.Close() })
	if r.ovl.covers, err = makeCovers(r.store); err != nil {
		return err
	}
	*cleanup = append(*cleanup, func() { r.ovl.covers.Close() })
	if r.spawn, err = launch.NewSpawnNS(r.cfg.InitBinary); err != nil {
		return err
	}
	*cleanup = append(*cleanup, func() { r.spawn.Close() })
	r.net = launch.NewNetPool(r.cfg.NetPool)
	return nil
}

// startLoops starts the runtime's background loops: warm inits, huge-page
// folding, and checkpoint expiry if checkpoints expire.
func (r *Runtime) startLoops() {
	r.warm = warmInits{ready: make(chan *warmInit, r.cfg.InitPool), kick: make(chan struct{}, 1)}
	r.wg.Add(1)
	go r.warmLoop()
	if r.hot.max > 0 {
		r.wg.Add(1)
		go r.coolLoop()
	}
	r.folds = procstate.NewFolder(r.log)
	r.wg.Add(1)
	go func() {
		defer r.wg.Done()
		r.folds.Run(r.done)
	}()
	if r.cfg.CheckpointTTL > 0 {
		r.wg.Add(1)
		go r.expireLoop()
	}
	for range digestWorkers() {
		r.wg.Add(1)
		go r.stateDigestLoop()
	}
	if r.cfg.DigestAhead {
		r.xfer.ahead = make(chan string, digestQueue)
		r.wg.Add(1)
		go r.digestLoop()
	}
}

// lockStore takes an exclusive lock on the data directory for the life of
// the runtime: two runtimes on one directory would discard each other's
// layers and cgroups.
func lockStore(store string) (*os.File, error) {
	f, err := os.OpenFile(filepath.Join(store, "lock"), os.O_RDWR|os.O_CREATE, 0o600)
	if err != nil {
		return nil, fmt.Errorf("opening data directory lock: %w", err)
	}
	if err := unix.Flock(int(f.Fd()), unix.LOCK_EX|unix.LOCK_NB); err != nil {
		f.Close()
		if errors.Is(err, unix.EWOULDBLOCK) {
			who := "another deltagym server"
			if b, err := os.ReadFile(f.Name()); err == nil && len(bytes.TrimSpace(b)) > 0 {
				who += " (pid " + string(bytes.TrimSpace(b)) + ")"
			}
			return nil, fmt.Errorf("%w: the data directory %s is in use by %s", ErrExists, filepath.Dir(store), who)
		}
		return nil, fmt.Errorf("locking data directory: %w", err)
	}
	// Whose it is, for the message above (the lock is what counts).
	if err := f.Truncate(0); err == nil {
		_, _ = f.WriteAt([]byte(strconv.Itoa(os.Getpid())+"\n"), 0)
	}
	return f, nil
}

// mountMeta mounts a tmpfs for the metadata of checkpoints and sandboxes at
// store/meta, unless one is there from an earlier run. Metadata lives as
// long as the layers it describes (which are tmpfs too): across restarts of
// the server, not across reboots; and writing it costs microseconds, not
// a journal commit. The layers' mount points (store/layers) get a tmpfs of
// their own too: every new upper and every discard makes and removes one,
// which on the data directory's disk filesystem cost a journaled mkdir and
// rmdir each (about half the CPU of a fork fan-out). A layer store on disk
// from an earlier version, with layers in it, is kept as it is.
func mountMeta(store string) error {
	for _, m := range []struct {
		dir, name, opts string
		keepDisk        bool // an earlier version's entries stay visible
	}{
		{"meta", "dg-meta", "mode=700,size=256m", false},
		{"layers", "dg-layers", "mode=700,size=16m", true},
	} {
		dir := filepath.Join(store, m.dir)
		if err := os.MkdirAll(dir, 0o700); err != nil {
			return fmt.Errorf("creating data directory: %w", err)
		}
		if layers.IsMount(dir) {
			continue
		}
		if ents, err := os.ReadDir(dir); m.keepDisk && (err != nil || len(ents) > 0) {
			continue // an earlier version's layers: not hidden under a tmpfs
		}
		if err := unix.Mount(m.name, dir, "tmpfs", unix.MS_NOSUID|unix.MS_NODEV|unix.MS_NOEXEC, m.opts); err != nil {
			return fmt.Errorf("mounting %s tmpfs: %w", m.dir, err)
		}
	}
	return nil
}

// skeleton is what the bottom layer of every root holds: the directories
// the sandbox needs whatever its image has (mount points, /tmp), with their
// modes (a parent it implies is 0755).
var skeleton = []struct {
	path string
	mode os.FileMode
}{{"proc", 0o555}, {"dev", 0o755}, {"tmp", 0o777 | os.ModeSticky}, {"run/deltagym", 0o755}, {"root", 0o700}, {"etc", 0o755}}

// makeSkeleton creates the skeleton layer.
func makeSkeleton(store string) (string, error) {
	skel := filepath.Join(store, "skel")
	for _, d := range skeleton {
		p := filepath.Join(skel, d.path)
		if err := os.MkdirAll(p, 0o755); err != nil {
			return "", fmt.Errorf("creating skeleton layer: %w", err)
		}
		if err := os.Chmod(p, d.mode); err != nil {
			return "", err
		}
	}
	return skel, nil
}

// The skeleton in the image.
//
// The skeleton is one more lower layer under every root, and each lower
// layer costs every mount and every lookup that reaches the bottom of the
// stack. An image whose top layer has every directory of the skeleton
// needs none: the skeleton sits below everything, so it only shows what
// the layers above it lack, and a directory of the top layer stands over
// the same directory of the skeleton, attributes and all. So an import
// adds the skeleton's directories its top layer lacks (addSkeleton), where
// doing so shows nothing the skeleton would not have shown; images that
// cannot take them, and those imported before, keep the skeleton layer
// (skeletonCovered).

// skeletonCovered reports whether the top layer of an image (layers, bottom
// first) has every directory of the skeleton, each component a directory.
func skeletonCovered(layers []string) bool {
	if len(layers) == 0 {
		return false
	}
	top := layers[len(layers)-1]
	for _, d := range skeleton {
		for _, p := range skeletonPrefixes(d.path) {
			if st, err := os.Lstat(filepath.Join(top, p)); err != nil || !st.IsDir() {
				return false
			}
		}
	}
	return true
}

// skeletonPrefixes returns the paths from the first component of p to p.
func skeletonPrefixes(p string) []string {
	var out []string
	for i := range len(p) {
		if p[i] == '/' {
			out = append(out, p[:i])
		}
	}
	return append(out, p)
}

// addSkeleton creates in the top layer of an image being imported (layers,
// bottom first) the skeleton's directories it lacks: each one only where no
// layer of the image has something else at that path (a file, a link, a
// whiteout), which the directory would hide or undo. A path where the top
// layer has something else is left to the skeleton layer.
func addSkeleton(layers []string) error {
	if len(layers) == 0 {
		return nil
	}
	top := layers[len(layers)-1]
	for _, d := range skeleton {
		prefixes := skeletonPrefixes(d.path)
	walk:
		for i, p := range prefixes {
			st, err := os.Lstat(filepath.Join(top, p))
			switch {
			case err == nil && st.IsDir():
				continue
			case err == nil || !errors.Is(err, os.ErrNotExist):
				break walk
			}
			for _, l := range layers[:len(layers)-1] {
				if st, err := os.Lstat(filepath.Join(l, p)); err == nil && !st.IsDir() || err != nil && !errors.Is(err, os.ErrNotExist) {
					break walk
				}
			}
			mode := os.FileMode(0o755)
			if i == len(prefixes)-1 {
				mode = d.mode
			}
			if err := os.Mkdir(filepath.Join(top, p), 0o700); err != nil {
				return fmt.Errorf("adding /%s to the image: %w", p, err)
			}
			if err := os.Lchown(filepath.Join(top, p), 0, 0); err != nil {
				return fmt.Errorf("adding /%s to the image: %w", p, err)
			}
			if err := os.Chmod(filepath.Join(top, p), mode); err != nil {
				return fmt.Errorf("adding /%s to the image: %w", p, err)
			}
		}
	}
	return nil
}

// makeCovers prepares the covers of the mount points of a root that is not
// the init's yet (overlay.Covers): /proc and /dev, as launch moves them.
func makeCovers(store string) (*overlay.Covers, error) {
	empty := filepath.Join(store, "cover")
	if err := os.MkdirAll(empty, 0o555); err != nil {
		return nil, fmt.Errorf("creating %s: %w", empty, err)
	}
	return overlay.NewCovers(empty, launch.MovedMounts...)
}

// reconcile adopts what an earlier run left in the store: its images, the
// checkpoints whose layers survived (and the layers they keep), the
// templates of sandboxes that were live (readopt); everything else is
// discarded, leftover cgroups included.
func (r *Runtime) reconcile(ctx context.Context) error {
	if err := r.loadImages(); err != nil {
		return err
	}
	keep, err := r.loadCheckpoints()
	if err != nil {
		return err
	}
	// Sandboxes that were live ended with the old server. After a crash,
	// one whose checkpoints kept templates is still there (readopt.go):
	// before its live root is discarded with the other layers, its
	// templates are saved.
	entries, err := os.ReadDir(filepath.Join(r.store, "meta", "sandboxes"))
	if err != nil {
		return err
	}
	for _, e := range entries {
		r.ended = append(r.ended, e.Name())
		r.readopt(ctx, e.Name())
		_ = os.Remove(r.sandboxRecordPath(e.Name()))
	}
	missing, err := r.layers.Reconcile(keep)
	if err != nil {
		return err
	}
	r.dropLost(missing)
	r.sweepImages()
	sort.Strings(r.ended)
	if len(r.ended) > 0 {
		r.log.Info("the sandboxes of the previous run ended with it (warm-pool ones included)", "count", len(r.ended))
	}
	names, err := r.cg.List()
	if err != nil {
		return fmt.Errorf("listing leftover cgroups: %w", err)
	}
	for _, n := range names {
		if err := r.cg.Remove(n); err != nil {
			return fmt.Errorf("removing leftover cgroup %s: %w", n, err)
		}
	}
	return nil
}

// loadImages adopts the imported images of the store; half-made imports
// (hidden directories) are removed, unreadable images left out.
func (r *Runtime) loadImages() error {
	r.mu.Lock()
	defer r.mu.Unlock()
	entries, err := os.ReadDir(filepath.Join(r.store, "images"))
	if err != nil {
		return err
	}
	for _, e := range entries {
		if strings.HasPrefix(e.Name(), ".") {
			_ = os.RemoveAll(filepath.Join(r.store, "images", e.Name()))
			continue
		}
		im, err := image.Load(filepath.Join(r.store, "images", e.Name()))
		if err != nil {
			r.log.Warn("dropping unreadable image", "image", e.Name(), "err", err)
			continue
		}
		r.images[e.Name()] = &imageRec{info: imageInfo(e.Name(), im), layers: im.Layers, skel: !skeletonCovered(im.Layers)}
	}
	return nil
}

// loadCheckpoints adopts the recorded checkpoints of known images, and
// returns the layers they keep, each with its number of references.
// Unreadable records are removed.
func (r *Runtime) loadCheckpoints() (keep map[string]int, err error) {
	r.mu.Lock()
	defer r.mu.Unlock()
	keep = map[string]int{}
	dir := filepath.Join(r.store, "meta", "checkpoints")
	entries, err := os.ReadDir(dir)
	if err != nil {
		return nil, err
	}
	for _, e := range entries {
		p := filepath.Join(dir, e.Name())
		if !strings.HasSuffix(e.Name(), ".json") {
			_ = os.Remove(p)
			continue
		}
		b, err := os.ReadFile(p)
		var c checkpoint
		if err == nil {
			err = json.Unmarshal(b, &c)
		}
		if err != nil || c.ID == "" || r.images[c.Image] == nil {
			r.log.Warn("dropping unreadable checkpoint", "file", e.Name(), "err", err)
			_ = os.Remove(p)
			continue
		}
		// A pin is its owner's (a pool, a reset cache), which did not outlive the runtime that
		// pinned it: from now on the checkpoint expires by the TTL like any other, or every
		// restart would add its pools' checkpoints to those that never go.
		c.Pinned = false
		r.ckpts[c.ID] = &c
		r.jobs.digests.add(c.ID, c.SandboxID, c.Digest)
		r.pimg.bytes.Add(c.imageBytes())
		for _, l := range c.Layers {
			keep[l]++
		}
		for _, l := range c.Flat {
			keep[l]++
		}
		if c.Shm != "" {
			keep[c.Shm]++
		}
		if len(c.Flat) > 0 {
			r.flat[stackKey(c.Layers)] = &c
		}
	}
	return keep, nil
}

// sweepImages removes what an earlier run left of process images: adoptions it did not finish
// (hidden directories) and the images of checkpoints the runtime does not hold.
func (r *Runtime) sweepImages() {
	dir := filepath.Join(r.store, "criu")
	entries, _ := os.ReadDir(dir) // none before the first images
	r.mu.Lock()
	defer r.mu.Unlock()
	for _, e := range entries {
		if e.Name() != "run" && r.ckpts[e.Name()] == nil {
			_ = os.RemoveAll(filepath.Join(dir, e.Name()))
		}
	}
}

// dropLost drops the checkpoints one of whose layers is among missing.
func (r *Runtime) dropLost(missing []string) {
	if len(missing) == 0 {
		return
	}
	r.mu.Lock()
	defer r.mu.Unlock()
	gone := map[string]bool{}
	for _, l := range missing {
		gone[l] = true
	}
	for id, c := range r.ckpts {
		for _, l := range append(slices.Concat(c.Layers, c.Flat), c.Shm) {
			if gone[l] {
				r.log.Warn("checkpoint lost: its layers did not survive (tmpfs is not kept across reboots)", "checkpoint", id)
				r.dropCheckpointLocked(c, false)
				break
			}
		}
	}
}

// Ended returns the sandboxes that were live when the previous server
// process stopped; the restart ended them.
func (r *Runtime) Ended() []string {
	r.mu.Lock()
	defer r.mu.Unlock()
	return append([]string(nil), r.ended...)
}

func imageInfo(name string, im *image.Imported) ImageInfo {
	return ImageInfo{Name: name, Digest: im.Digest, Layers: len(im.Layers), Config: im.Config}
}

var nameRE = regexp.MustCompile(`^[a-zA-Z0-9][a-zA-Z0-9._-]{0,127}$`)

// ImportImage imports an OCI layout directory, a docker save tarball or a
// rootfs directory as image name. Importing the same image again under the
// same name is a no-op; another image under a taken name is ErrExists.
func (r *Runtime) ImportImage(ctx context.Context, name, src string, opts ...image.Option) (ImageInfo, error) {
	if !nameRE.MatchString(name) {
		return ImageInfo{}, fmt.Errorf("%w: image name %q: use letters, digits, '.', '_' and '-'", ErrInvalid, name)
	}
	tmp, err := os.MkdirTemp(filepath.Join(r.store, "images"), ".import-")
	if err != nil {
		return ImageInfo{}, err
	}
	defer os.RemoveAll(tmp)
	im, err := image.Import(ctx, src, tmp, opts...)
	if err != nil {
		if errors.Is(err, image.ErrTooLarge) {
			return ImageInfo{}, fmt.Errorf("%w: importing image %s: %w", ErrBudget, name, err)
		}
		if errors.Is(err, os.ErrNotExist) || errors.Is(err, image.ErrUnknownFormat) || errors.Is(err, image.ErrInvalidImage) ||
			errors.Is(err, image.ErrUnsafePath) || errors.Is(err, image.ErrDigestMismatch) || errors.Is(err, image.ErrUnsupportedCompression) {
			return ImageInfo{}, fmt.Errorf("%w: importing image %s: %w", ErrInvalid, name, err)
		}
		return ImageInfo{}, fmt.Errorf("importing image %s: %w", name, err)
	}
	if err := addSkeleton(im.Layers); err != nil {
		return ImageInfo{}, fmt.Errorf("importing image %s: %w", name, err)
	}
	r.mu.Lock()
	defer r.mu.Unlock()
	if old := r.images[name]; old != nil {
		if old.info.Digest == im.Digest {
			return old.info, nil
		}
		return ImageInfo{}, fmt.Errorf("%w: image %s (with another digest)", ErrExists, name)
	}
	dst := filepath.Join(r.store, "images", name)
	if err := os.Rename(tmp, dst); err != nil {
		return ImageInfo{}, fmt.Errorf("storing image %s: %w", name, err)
	}
	// Layer paths were recorded under tmp; load them again from dst.
	im, err = image.Load(dst)
	if err != nil {
		return ImageInfo{}, fmt.Errorf("loading image %s: %w", name, err)
	}
	rec := &imageRec{info: imageInfo(name, im), layers: im.Layers, skel: !skeletonCovered(im.Layers)}
	r.images[name] = rec
	return rec.info, nil
}

// Image returns the image called name.
func (r *Runtime) Image(name string) (ImageInfo, error) {
	r.mu.Lock()
	defer r.mu.Unlock()
	im := r.images[name]
	if im == nil {
		return ImageInfo{}, fmt.Errorf("%w: image %q", ErrNotFound, name)
	}
	return im.info, nil
}

// Images lists the imported images by name.
func (r *Runtime) Images() []ImageInfo {
	r.mu.Lock()
	defer r.mu.Unlock()
	out := make([]ImageInfo, 0, len(r.images))
	for _, im := range r.images {
		out = append(out, im.info)
	}
	sort.Slice(out, func(i, j int) bool { return out[i].Name < out[j].Name })
	return out
}

// Get returns the live sandbox id.
func (r *Runtime) Get(id string) (*Sandbox, error) {
	r.mu.Lock()
	defer r.mu.Unlock()
	s := r.sandboxes[id]
	if s == nil {
		return nil, fmt.Errorf("%w: sandbox %q", ErrNotFound, id)
	}
	return s, nil
}

// Sandboxes returns the number of live sandboxes.
func (r *Runtime) Sandboxes() int {
	r.mu.Lock()
	defer r.mu.Unlock()
	return len(r.sandboxes)
}

// Checkpoint looks up checkpoint id.
func (r *Runtime) Checkpoint(id string) (CheckpointInfo, error) {
	r.mu.Lock()
	defer r.mu.Unlock()
	c := r.ckpts[id]
	if c == nil {
		return CheckpointInfo{}, fmt.Errorf("%w: checkpoint %q: unknown or released checkpoint", ErrNotFound, id)
	}
	return c.info(), nil
}

// ListCheckpoints describes every checkpoint held, oldest first, with what holds it.
func (r *Runtime) ListCheckpoints() []CheckpointInfo {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.adm.mu.Lock()
	defer r.adm.mu.Unlock()
	out := make([]CheckpointInfo, 0, len(r.ckpts))
	for _, c := range r.ckpts {
		ci := c.info()
		h := CheckpointHold{Pinned: c.Pinned, Heads: r.adm.heads[c.ID]}
		if used := c.used.Load(); used != 0 {
			h.LastUsed = time.Unix(0, used)
		}
		if ttl := r.cfg.CheckpointTTL; ttl > 0 && !h.Pinned && h.Heads == 0 && !h.LastUsed.IsZero() {
			h.Expires = h.LastUsed.Add(ttl)
		}
		ci.Hold = h
		out = append(out, ci)
	}
	slices.SortFunc(out, func(a, b CheckpointInfo) int {
		return cmp.Or(a.Created.Compare(b.Created), strings.Compare(a.ID, b.ID))
	})
	return out
}

// Checkpoints returns the number of checkpoints held.
func (r *Runtime) Checkpoints() int {
	r.mu.Lock()
	defer r.mu.Unlock()
	return len(r.ckpts)
}

// ReleaseCheckpoint forgets checkpoint id; its layers are freed once no
// other checkpoint or sandbox uses them.
func (r *Runtime) ReleaseCheckpoint(id string) error {
	r.mu.Lock()
	defer r.mu.Unlock()
	c := r.ckpts[id]
	if c == nil {
		return fmt.Errorf("%w: checkpoint %q: unknown or released checkpoint", ErrNotFound, id)
	}
	r.dropCheckpointLocked(c, true)
	return nil
}

// dropTemplatesLocked ends the process templates of c. Called with r.mu held.
// +checklocks:r.mu
func (r *Runtime) dropTemplatesLocked(c *checkpoint) {
	if len(c.Procs) == 0 {
		return
	}
	if s := r.sandboxes[c.SandboxID]; s != nil {
		s.procs.Drop(c.ID)
	}
}

// +checklocks:r.mu
func (r *Runtime) dropCheckpointLocked(c *checkpoint, unref bool) {
	delete(r.ckpts, c.ID)
	r.jobs.digests.drop(c.ID)
	r.dropTemplatesLocked(c)
	if len(c.Flat) > 0 {
		k := stackKey(c.Layers)
		if r.flat[k] == c {
			delete(r.flat, k)
			// Another checkpoint of the same stack may have been
			// flattened too: let it serve.
			for _, o := range r.ckpts {
				if len(o.Flat) > 0 && stackKey(o.Layers) == k {
					r.flat[k] = o
					break
				}
			}
		}
	}
	_ = os.Remove(filepath.Join(r.store, "meta", "checkpoints", c.ID+".json"))
	if len(c.Images) > 0 || len(c.Procs) > 0 {
		_ = os.RemoveAll(r.criuDir(c.ID))
		r.pimg.bytes.Add(-c.imageBytes())
	}
	if unref {
		for _, l := range c.Layers {
			r.layers.Unref(l)
		}
		for _, l := range c.Flat {
			r.layers.Unref(l)
		}
		if c.Shm != "" {
			r.layers.Unref(c.Shm)
		}
	}
}

// stackKey identifies a stack of layers.
func stackKey(stack []string) string { return strings.Join(stack, "/") }

// shorten returns the shortest known stack equivalent to stack: its
// longest prefix that a flattened checkpoint stands for, replaced by that
// checkpoint's merged layer. The caller takes its references.
func (r *Runtime) shorten(stack []string) []string {
	r.mu.Lock()
	defer r.mu.Unlock()
	if len(r.flat) == 0 {
		return stack
	}
	for n := len(stack); n > 1; n-- {
		if c := r.flat[stackKey(stack[:n])]; c != nil {
			return append(slices.Clone(c.Flat), stack[n:]...)
		}
	}
	return stack
}

// stackOf returns the shortest stack of checkpoint c's state (shorten), for a sandbox to sit
// on. One shorter than c's Layers is named an alias of c's index, so that the sandbox's next
// checkpoint finds the index of what it sits on while c is held, even once the flattened
// checkpoint whose merged layer that stack holds is released.
func (r *Runtime) stackOf(c *checkpoint) []string {
	stack := r.shorten(c.Layers)
	if len(stack) < len(c.Layers) {
		r.jobs.digests.alias(c.ID, stackKey(stack))
	}
	return stack
}

// imageLowers returns the layers under every delta of image: the skeleton
// (if the image needs it) and the image's own, bottom first.
func (r *Runtime) imageLowers(image string) []string {
	r.mu.Lock()
	defer r.mu.Unlock()
	im := r.images[image]
	if im == nil {
		return []string{r.skel}
	}
	var out []string
	if im.skel {
		out = append(out, r.skel)
	}
	return append(out, im.layers...)
}

// maybeFlatten merges a deep checkpoint's layers in the background.
func (r *Runtime) maybeFlatten(c *checkpoint) {
	if len(c.Layers) <= r.cfg.FlattenDepth {
		return
	}
	r.flatten(c, false)
}

// Hot checkpoints.
//
// Every lower layer of a root costs each mount of it and each cold lookup
// through it, in the machine's CPU per restore (machine-cpu-us/op of
// BenchmarkRollbackLoop). A checkpoint restored again and again (a rollback
// loop, a GRPO group's tries, a search returning to a node) is mounted at
// every restore, and an env's checkpoints sit on at least two deltas of
// their own: the env's setup and the reset's, the load test's on three. So
// the second time in a row a checkpoint is restored, its small top layers
// (flattenHotBytes in all) are merged into one in the background, over the
// layers below them, which stay shared; later restores mount the shorter
// stack. Large layers (an env's package installs, say) are not copied: a
// merge that would take them stops below them, and one that would merge
// fewer than two layers is not made.

// flattenHotBytes bounds the layers merged for a hot checkpoint: the merge
// copies them (into a layer counted against the checkpoint budget like
// any other), once per hot checkpoint.
const flattenHotBytes = 4 << 20

// maybeFlattenHot merges the small top layers of c, restored twice in a
// row, in the background, once per checkpoint.
func (r *Runtime) maybeFlattenHot(c *checkpoint) {
	if len(c.Layers) >= 2 && !c.hotTried.Swap(true) {
		r.flatten(c, true)
	}
}

// hotSplit returns how many of the bottom layers of stack a hot merge
// keeps: the rest, at least two, are small enough to merge. ok is false if
// no merge is worth making, or if its copy would bring the checkpoints
// past three quarters of their budget.
func (r *Runtime) hotSplit(stack []string) (keep int, ok bool) {
	var total int64
	keep = len(stack)
	for keep > 0 {
		n, sealed := r.layers.SealedSize(stack[keep-1])
		if !sealed || total+n > flattenHotBytes {
			break
		}
		total += n
		keep--
	}
	if b := r.cfg.CheckpointBudgetBytes; b > 0 && (r.CheckpointBytes()+total)*4 > b*3 {
		return keep, false
	}
	return keep, len(stack)-keep >= 2
}

// flatten merges c's layers in the background: all of them, or for a hot
// checkpoint its small top ones (hotSplit). Once made, c.Flat is the
// shorter stack that restores and later checkpoints use.
func (r *Runtime) flatten(c *checkpoint, hot bool) {
	r.mu.Lock()
	if r.flatBusy[c.ID] || r.closed || len(c.Flat) > 0 {
		r.mu.Unlock()
		return
	}
	// The layers must outlive the merge even if the checkpoint is
	// released meanwhile.
	if err := refAll(r, c.Layers); err != nil {
		r.mu.Unlock()
		return
	}
	r.flatBusy[c.ID] = true
	r.wg.Add(1)
	r.mu.Unlock()
	go func() {
		defer r.wg.Done()
		defer unrefAll(r, c.Layers)
		r.jobs.flatSem <- struct{}{}
		defer func() { <-r.jobs.flatSem }()
		done := func() {
			r.mu.Lock()
			delete(r.flatBusy, c.ID)
			r.mu.Unlock()
		}
		// Released meanwhile, or made shallow by a flattening of its
		// ancestors that finished first: nothing to do.
		r.mu.Lock()
		live := r.ckpts[c.ID] == c
		r.mu.Unlock()
		short := len(r.shorten(c.Layers))
		keep := 0
		switch {
		case !live:
			done()
			return
		case hot:
			// A stack an ancestor's flattening shortened already is the
			// deep flattener's.
			var ok bool
			if keep, ok = r.hotSplit(c.Layers); !ok || short < len(c.Layers) {
				done()
				return
			}
		case short <= r.cfg.FlattenDepth:
			done()
			return
		}
		below := r.imageLowers(c.Image)
		for _, l := range c.Layers[:keep] {
			below = append(below, r.layers.Path(l))
		}
		f, err := r.layers.Flatten(c.Layers[keep:], 0, below)
		r.mu.Lock()
		defer r.mu.Unlock()
		delete(r.flatBusy, c.ID)
		if err != nil {
			r.log.Warn("flattening checkpoint", "checkpoint", c.ID, "err", err)
			return
		}
		if r.ckpts[c.ID] != c {
			r.layers.Unref(f) // released meanwhile
			return
		}
		// c.Flat holds a reference to each of its layers, the kept ones
		// included (c.Layers holds them too: they cannot be gone).
		flat := append(slices.Clone(c.Layers[:keep]), f)
		if err := refAll(r, flat[:keep]); err != nil {
			r.layers.Unref(f)
			r.log.Warn("flattening checkpoint", "checkpoint", c.ID, "err", err)
			return
		}
		c.Flat = flat
		if err := r.writeCheckpoint(c); err != nil {
			r.log.Warn("recording flattened checkpoint", "checkpoint", c.ID, "err", err)
		}
		r.flat[stackKey(c.Layers)] = c
		r.jobs.digests.alias(c.ID, stackKey(flat))
		if r.hooks.onFlattened != nil {
			r.hooks.onFlattened(c.ID)
		}
	}()
}

// expireLoop releases the checkpoints no one has used for CheckpointTTL,
// but those pinned or that a live sandbox descends from.
func (r *Runtime) expireLoop() {
	defer r.wg.Done()
	tick := time.NewTicker(min(time.Second, r.cfg.CheckpointTTL/4+time.Millisecond))
	defer tick.Stop()
	for {
		select {
		case <-r.done:
			return
		case now := <-tick.C:
			for _, id := range r.expire(now) {
				if r.cfg.OnCheckpointExpired != nil {
					r.cfg.OnCheckpointExpired(id)
				}
			}
		}
	}
}

// expire releases the checkpoints unused since now - CheckpointTTL that
// nothing references, and returns their ids.
func (r *Runtime) expire(now time.Time) (expired []string) {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.adm.mu.Lock()
	defer r.adm.mu.Unlock()
	for _, c := range r.ckpts {
		if c.Pinned || r.adm.heads[c.ID] > 0 {
			continue
		}
		used := c.used.Load()
		if used == 0 { // adopted at start: its clock starts then
			c.used.Store(now.UnixNano())
			continue
		}
		if now.Sub(time.Unix(0, used)) > r.cfg.CheckpointTTL {
			r.dropCheckpointLocked(c, true)
			expired = append(expired, c.ID)
		}
	}
	return expired
}

// moveHead records that a live sandbox's state descends from checkpoint to
// instead of from (either may be ""): to does not expire meanwhile.
func (r *Runtime) moveHead(from, to string) {
	r.adm.mu.Lock()
	defer r.adm.mu.Unlock()
	r.adm.unpinHeadLocked(from)
	if to != "" {
		r.adm.heads[to]++
	}
}

// +checklocks:a.mu
func (a *admission) unpinHeadLocked(id string) {
	if id == "" {
		return
	}
	if a.heads[id]--; a.heads[id] <= 0 {
		delete(a.heads, id)
	}
}

// addCheckpoint persists and registers a checkpoint whose layer references
// the caller already holds for it.
func (r *Runtime) addCheckpoint(c *checkpoint) error {
	c.used.Store(time.Now().UnixNano())
	if err := r.writeCheckpoint(c); err != nil {
		return err
	}
	r.mu.Lock()
	r.ckpts[c.ID] = c
	r.jobs.digests.add(c.ID, c.SandboxID, nil)
	r.pimg.bytes.Add(c.imageBytes())
	r.mu.Unlock()
	return nil
}

// writeCheckpoint persists c atomically (write and rename).
func (r *Runtime) writeCheckpoint(c *checkpoint) error {
	b, err := json.Marshal(c)
	if err != nil {
		return err
	}
	dir := filepath.Join(r.store, "meta", "checkpoints")
	tmp := filepath.Join(dir, "."+c.ID+".tmp")
	if err := os.WriteFile(tmp, b, 0o600); err != nil {
		os.Remove(tmp)
		return recordErr(c.ID, err)
	}
	if err := os.Rename(tmp, filepath.Join(dir, c.ID+".json")); err != nil {
		os.Remove(tmp)
		return recordErr(c.ID, err)
	}
	return nil
}

// recordErr is the error of writing checkpoint id's record: a full record filesystem is the
// checkpoint budget's (ErrBudget: the caller may release checkpoints), anything else the
// machine's.
func recordErr(id string, err error) error {
	if errors.Is(err, unix.ENOSPC) || errors.Is(err, unix.EDQUOT) {
		return fmt.Errorf("writing checkpoint %s's record: the checkpoint records' filesystem is full (release checkpoints): %w: %w", id, ErrBudget, err)
	}
	return fmt.Errorf("writing checkpoint %s: %w", id, err)
}

func (r *Runtime) lookup(id string) (*checkpoint, error) {
	r.mu.Lock()
	defer r.mu.Unlock()
	c := r.ckpts[id]
	if c == nil {
		return nil, fmt.Errorf("%w: checkpoint %q: unknown or released checkpoint", ErrNotFound, id)
	}
	return c, nil
}

// newID returns a new id of prefix ("sb", "ck") that names the runtime's node.
func (r *Runtime) newID(prefix string) string { return nodeid.New(prefix, r.cfg.Node) }

func (r *Runtime) takeRange() (int, error) {
	r.adm.mu.Lock()
	defer r.adm.mu.Unlock()
	if len(r.adm.ranges) == 0 {
		return 0, fmt.Errorf("%w: no free uid range (%d sandboxes live)", ErrBudget, r.adm.rangesTotal)
	}
	h := r.adm.ranges[len(r.adm.ranges)-1]
	r.adm.ranges = r.adm.ranges[:len(r.adm.ranges)-1]
	return h, nil
}

func (r *Runtime) putRange(h int) {
	r.adm.mu.Lock()
	r.adm.ranges = append(r.adm.ranges, h)
	r.adm.mu.Unlock()
}

// Fork creates n sandboxes at checkpoint id, sharing its layers.
func (r *Runtime) Fork(ctx context.Context, id string, n int, spec Spec) ([]*Sandbox, error) {
	if n < 1 || n > maxFork {
		return nil, fmt.Errorf("%w: fork count %d (1..%d)", ErrInvalid, n, maxFork)
	}
	spec.Checkpoint = id
	if err := spec.validate(); err != nil {
		return nil, err
	}
	// All n children or none: they are admitted together.
	if err := r.admitSandboxes(n); err != nil {
		return nil, err
	}
	r.wantWarm(n)
	out := make([]*Sandbox, n)
	errs := make([]error, n)
	var wg sync.WaitGroup
	sem := make(chan struct{}, forkParallel)
	for i := range n {
		wg.Add(1)
		sem <- struct{}{}
		go func() {
			defer wg.Done()
			defer func() { <-sem }()
			out[i], errs[i] = r.create(ctx, spec)
		}()
	}
	wg.Wait()
	if err := joinDistinct(errs); err != nil {
		for _, s := range out {
			if s != nil {
				_ = s.Destroy(context.WithoutCancel(ctx))
			}
		}
		return nil, err
	}
	return out, nil
}

// joinDistinct joins the errors of a fan-out, each distinct message once
// (n children failing alike give one message, with their count).
func joinDistinct(errs []error) error {
	var out []error
	count := map[string]int{}
	for _, err := range errs {
		if err == nil {
			continue
		}
		if count[err.Error()]++; count[err.Error()] == 1 {
			out = append(out, err)
		}
	}
	for i, err := range out {
		if n := count[err.Error()]; n > 1 {
			out[i] = fmt.Errorf("%w (%d children)", err, n)
		}
	}
	return errors.Join(out...)
}

// Close destroys every live sandbox and stops the runtime. Checkpoints stay
// on disk for the next run. Close is idempotent.
func (r *Runtime) Close(ctx context.Context) error {
	r.mu.Lock()
	if r.closed {
		r.mu.Unlock()
		return nil
	}
	r.closed = true
	r.mu.Unlock()
	r.pimg.making.Wait()
	r.mu.Lock()
	live := make([]*Sandbox, 0, len(r.sandboxes))
	for _, s := range r.sandboxes {
		live = append(live, s)
	}
	r.mu.Unlock()
	var errs []error
	for _, s := range live {
		errs = append(errs, s.Destroy(ctx))
	}
	r.ret.wg.Wait()
	close(r.done)
	r.wg.Wait()
	r.drainWarm()
	errs = append(errs, r.net.Close(), r.spawn.Close())
	r.layers.Wait()
	errs = append(errs, r.cg.RemoveBase())
	r.devnull.Close()
	r.ovl.covers.Close()
	r.lock.Close()
	return errors.Join(errs...)
}

// Purge removes a data directory written by a runtime, unmounting its
// layers first. The runtime must be closed: ErrExists if one holds the
// directory. The runtime's cgroups go too, with what a crashed runtime
// left running in them: sandboxes waiting for re-adoption (readopt.go).
func Purge(dataDir string) error {
	if _, err := os.Stat(filepath.Join(dataDir, "store")); err == nil {
		lock, err := lockStore(filepath.Join(dataDir, "store"))
		if err != nil {
			return err
		}
		defer lock.Close()
	}
	err := endGroups(filepath.Join(dataDir, "store"))
	err = errors.Join(err, layers.Purge(filepath.Join(dataDir, "store", "layers")))
	_ = unix.Unmount(filepath.Join(dataDir, "store", "layers"), unix.MNT_DETACH)
	_ = unix.Unmount(filepath.Join(dataDir, "store", "meta"), unix.MNT_DETACH)
	return errors.Join(err, os.RemoveAll(dataDir))
}
