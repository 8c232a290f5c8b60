package ledger

import (
	"context"
	"crypto/sha256"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"slices"
	"sync"
	"sync/atomic"
	"time"
	"unicode/utf8"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"golang.org/x/sys/unix"

	"github.com/deltagym/deltagym/internal/wiretext"
)

// Config configures a Writer.
type Config struct {
	// URL is the Postgres URL of the ledger database. Required. It need not be reachable:
	// rows wait in the spool until it is.
	URL string
	// SpoolDir holds the durable spool. Required. One writer per directory at a time.
	SpoolDir string
	// GroupCommit is the group-commit window: rows appended within it are fsynced together,
	// and written together unless a caller waits for them (Stored), which has them written at
	// once. A SIGKILL loses at most the rows of the last window that no caller waited for
	// (plus the write in flight); a crash of the machine those not yet fsynced. Default 10ms.
	GroupCommit time.Duration
	// Sync makes Stored wait for the fsync of the rows, not only for their write to the spool
	// file: a row a caller was told is stored then survives a crash of the machine, not only
	// one of the process, at the cost of a disk flush per group of concurrent callers
	// (docs/OPERATIONS.md, "The ledger's acknowledgements").
	Sync bool
	// PageCache writes the spool through the page cache instead of with O_DIRECT (spool.go's
	// directIO says why that is the default): a caller of Stored then waits for a copy into
	// memory, where an O_DIRECT write waits for the device, behind whatever else the disk is
	// doing; each row costs the writer a little more CPU. Worth it where callers wait for
	// writes but not for fsyncs (the server without --ledger-sync).
	PageCache bool
	// QueueRows and QueueBytes bound the in-memory queue to Postgres. Past them rows are still
	// spooled (never blocking the caller) and the deliverer reads them back from the spool
	// until it has caught up, which costs more CPU per row than it has been spared: a writer
	// that overflows once stays behind longer. Defaults 100,000 rows and 256 MiB: 64 MiB holds
	// some 15,000 rows of 4 KiB, a third of a second at 50,000 steps/s, too little to ride out
	// a slow commit (BenchmarkWriterSteps paced at that rate with DELTAGYM_LEDGER_BENCH_QUEUE_MB;
	// docs/PERFORMANCE.md, "Figures behind design choices"). The memory is held only while
	// Postgres is behind.
	QueueRows  int
	QueueBytes int
	// BatchRows and BatchBytes bound one delivery transaction (up to Conns+2 batches are in
	// flight: being read, queued, and Conns being copied or committed). Defaults 8192 rows and
	// 16 MiB.
	BatchRows  int
	BatchBytes int
	// DeliveryDelay is how long durable rows may wait to be delivered together with later ones
	// while fewer than BatchRows/4 are waiting: at a low row rate it turns a Postgres
	// transaction (and WAL fsync) per group commit into one per DeliveryDelay. Flush, Close and
	// the Store's queries (which flush) skip it. Default 100ms; negative means no delay.
	DeliveryDelay time.Duration
	// Conns is the number of delivery connections: up to Conns batches are copied into
	// Postgres at once (a COPY keeps one backend busy on one CPU); they still commit in order.
	// Default 4: on 2 CPUs, 2 leave them idle while a batch commits (its WAL flush) or the next
	// one is read back, and 4 deliver more steps/s saturated (BenchmarkWriterSteps with
	// DELTAGYM_LEDGER_BENCH_CONNS; docs/PERFORMANCE.md, "Figures behind design choices"). The
	// writer opens one more connection for its vacuums (VacuumSteps).
	Conns int
	// ObservationCap caps a stored observation; its full size and SHA-256 are kept. Default 64 KiB.
	ObservationCap int
	// SegmentBytes is the size at which the spool starts a new segment file. Default 64 MiB.
	SegmentBytes int64
	// MaxPending bounds the frames waiting for the next group commit. Only a disk slower than
	// the rows arriving fills it; appends then wait for the disk (never for Postgres).
	// Default 256 MiB.
	MaxPending int
	// VacuumSteps is how many steps the writer delivers between two vacuums of the steps table,
	// which it runs itself while their pages are still in Postgres's shared buffers (vacuum.go
	// says why). Default 10,000; negative: never (autovacuum alone).
	VacuumSteps int
	// vacuumBackoff and vacuumBackoffMax are the first and the longest wait after a failed or
	// held-back vacuum. Defaults 1s and 1m (SetVacuumBackoff, for the tests).
	vacuumBackoff, vacuumBackoffMax time.Duration
	// Logger receives delivery errors. Default slog.Default().
	Logger *slog.Logger
}

// Validate checks the config and fills in defaults.
func (c *Config) Validate() error {
	if c.URL == "" {
		return fmt.Errorf("ledger writer needs a Postgres URL: %w", ErrInvalid)
	}
	if c.SpoolDir == "" {
		return fmt.Errorf("ledger writer needs a spool dir: %w", ErrInvalid)
	}
	if _, err := pgx.ParseConfig(c.URL); err != nil {
		return fmt.Errorf("parsing ledger URL: %w: %w", err, ErrInvalid)
	}
	if c.GroupCommit <= 0 {
		c.GroupCommit = 10 * time.Millisecond
	}
	if c.QueueRows <= 0 {
		c.QueueRows = 100_000
	}
	if c.QueueBytes <= 0 {
		c.QueueBytes = 256 << 20
	}
	if c.BatchRows <= 0 {
		c.BatchRows = 8192
	}
	if c.BatchBytes <= 0 {
		c.BatchBytes = 16 << 20
	}
	if c.DeliveryDelay == 0 {
		c.DeliveryDelay = 100 * time.Millisecond
	}
	if c.Conns <= 0 {
		c.Conns = 4
	}
	if c.ObservationCap <= 0 {
		c.ObservationCap = 64 << 10
	}
	if c.SegmentBytes <= 0 {
		c.SegmentBytes = 64 << 20
	}
	if c.MaxPending <= 0 {
		c.MaxPending = 256 << 20
	}
	if c.VacuumSteps == 0 {
		c.VacuumSteps = defaultVacuumSteps
	}
	if c.vacuumBackoff <= 0 {
		c.vacuumBackoff = time.Second
	}
	if c.vacuumBackoffMax < c.vacuumBackoff {
		c.vacuumBackoffMax = max(time.Minute, c.vacuumBackoff)
	}
	if c.Logger == nil {
		c.Logger = slog.Default()
	}
	return nil
}

// Stats counts a writer's rows since it was opened (sequence numbers count from its spool's
// first record).
type Stats struct {
	Appended  uint64 // last sequence number appended
	Written   uint64 // last sequence number written to the spool file (a SIGKILL keeps it)
	Synced    uint64 // last sequence number durable in the spool (fsynced)
	Delivered uint64 // last sequence number committed to Postgres
	Spooled   uint64 // rows that bypassed the full in-memory queue and were read back from disk
	Dropped   uint64 // rows Postgres rejected (e.g. a duplicate step), logged and skipped
	Retries   uint64 // failed delivery attempts (Postgres unreachable, restarting…)
	Vacuums   uint64 // vacuums of the steps table the writer ran (Config.VacuumSteps)
	// MaxSync is the longest spool fsync so far: with GroupCommit, how long written rows may
	// wait to be durable.
	MaxSync time.Duration
}

// Writer records ledger rows asynchronously. Its append methods (Step, EpisodeStarted,
// EpisodeEnded, Checkpoint, CheckpointReleased, Reward) never wait for Postgres or the disk: a row
// is encoded into the current group-commit buffer, which a syncer goroutine appends to the spool
// and fsyncs every GroupCommit window. A caller that must not answer before its rows are stored
// calls Stored, which has the buffer written at once (group commit: the rows of every caller
// waiting by then go in one write) and waits for that write (and its fsync with Config.Sync).
// A deliverer then copies durable rows to Postgres in
// batches (COPY for steps and rewards) over up to Config.Conns connections at once, committing
// them in order and recording in the same transaction how far the spool has been delivered, so
// that redelivery after a crash or outage neither loses nor duplicates a row (deliver.go). The append methods take ownership of the slices in the rows they are given.
type Writer struct {
	cfg Config
	sp  *spool

	mu sync.Mutex
	// +checklocks:mu
	nextSeq uint64
	// +checklocks:mu
	chunks [][]byte // frames not yet written to the spool
	// +checklocks:mu
	pending int // bytes in chunks
	// +checklocks:mu
	free [][]byte // written chunks kept for reuse
	// +checklocks:mu
	drained *sync.Cond // on mu: pending went down, or the writer closed
	// +checklocks:mu
	mem []record // undelivered rows with contiguous seqs, when not overflowing
	// +checklocks:mu
	memBytes int
	// +checklocks:mu
	overflow bool // the queue was full: rows from here on are read back from the spool
	// +checklocks:mu
	unsynced [][]byte // chunks written to the spool but not yet fsynced: written again if a sync fails
	// +checklocks:mu
	written uint64 // last seq written to the spool file
	// +checklocks:mu
	synced uint64 // last seq fsynced
	// +checklocks:mu
	failures uint64 // failed spool writes so far (Stored fails when one happens while it waits)
	// +checklocks:mu
	delivered uint64
	// +checklocks:mu
	flushTo uint64 // rows up to here are delivered without DeliveryDelay
	// +checklocks:mu
	closed bool
	// +checklocks:mu
	changed chan struct{} // closed and replaced whenever written, synced or delivered advance, or a spool write fails
	// +checklocks:mu
	syncErr error
	// +checklocks:mu
	maxSync time.Duration

	syncer syncSignals

	deliver deliverLoop

	vac vacuumSignals

	// +checklocks:mu
	spooled          atomic.Uint64 // counted under mu, where an append overflows
	dropped, retries atomic.Uint64

	closeOnce sync.Once
	closeErr  error

	beforeWait func() // tests: called by waitDelivered before it waits (SetBeforeWait)
}

// syncSignals are the channels between the appenders and the syncer (syncLoop).
type syncSignals struct {
	kick     chan struct{} // the buffer became non-empty
	writeNow chan struct{} // a caller waits for its rows (Stored): write the buffer now
	flushNow chan struct{} // skip the rest of the window: write and fsync now
	stop     chan struct{}
	done     chan struct{}
}

// vacuumSignals are what the deliverer tells the vacuumer (vacuumLoop), and its count.
type vacuumSignals struct {
	steps atomic.Uint64 // step rows committed to Postgres
	kick  chan struct{} // steps advanced
	done  chan struct{}
	runs  atomic.Uint64 // vacuums run
}

// NewWriter opens (recovering) the spool and starts the syncer and deliverer. Rows left in the
// spool by an earlier writer are delivered first.
//
// +checklocksignore: the writer is not shared before its goroutines start.
func NewWriter(cfg Config) (*Writer, error) {
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	sp, first, last, err := openSpool(cfg.SpoolDir, cfg.SegmentBytes)
	if err != nil {
		return nil, err
	}
	sp.log = cfg.Logger
	if cfg.PageCache {
		if err := sp.usePageCache(); err != nil {
			_ = sp.close()
			return nil, err
		}
	}
	// Rows a previous writer delivered before closing need not be read back.
	if d := sp.deliveredHint(); d >= first && d <= last {
		first = d + 1
	}
	w := &Writer{
		cfg:       cfg,
		sp:        sp,
		nextSeq:   last + 1,
		written:   last,
		synced:    last,
		delivered: first - 1,
		overflow:  last >= first, // recovered rows are read from the spool
		changed:   make(chan struct{}),
		syncer: syncSignals{kick: make(chan struct{}, 1), writeNow: make(chan struct{}, 1), flushNow: make(chan struct{}, 1),
			stop: make(chan struct{}), done: make(chan struct{})},
		deliver: deliverLoop{done: make(chan struct{})},
		vac:     vacuumSignals{kick: make(chan struct{}, 1), done: make(chan struct{})},
	}
	w.drained = sync.NewCond(&w.mu)
	ctx, cancel := context.WithCancel(context.Background())
	w.deliver.cancel = cancel
	go w.syncLoop()
	go w.deliverLoop(ctx)
	if cfg.VacuumSteps > 0 {
		go w.vacuumLoop(ctx)
	} else {
		close(w.vac.done)
	}
	return w, nil
}

// SpoolID names this writer's spool (its delivery mark in Postgres).
func (w *Writer) SpoolID() string { return w.sp.id }

// EpisodeStarted records the start of an episode. A zero StartedAt means now.
func (w *Writer) EpisodeStarted(r EpisodeStart) error {
	if err := r.validate(); err != nil {
		return err
	}
	if r.StartedAt.IsZero() {
		r.StartedAt = time.Now()
	}
	return w.append(record{kind: recEpisodeStart, start: &r})
}

// EpisodeEnded records how an episode ended. A zero EndedAt means now.
func (w *Writer) EpisodeEnded(r EpisodeEnd) error {
	if err := r.validate(); err != nil {
		return err
	}
	if r.EndedAt.IsZero() {
		r.EndedAt = time.Now()
	}
	r.FailureMessage = text(r.FailureMessage) // it may quote a sandbox's output or names
	return w.append(record{kind: recEpisodeEnd, end: &r})
}

// SandboxesEnded records that sandboxes ids ended with the server that ran them (a crash): the
// episodes still running in them end failed, class infra, as a graceful shutdown ends them
// (sandbox ids are never reused: no later episode runs in one). A zero at means now.
func (w *Writer) SandboxesEnded(ids []string, at time.Time) error {
	if len(ids) == 0 {
		return nil
	}
	if at.IsZero() {
		at = time.Now()
	}
	return w.append(record{kind: recSandboxesEnded, ended: &sandboxesEnded{IDs: slices.Clone(ids), At: at}})
}

// MaxIDLen bounds the ids of episodes and checkpoints the writer takes, in bytes: a step keeps
// them inline and uncompressed (migration 0006). The server's own are under 40.
const MaxIDLen = 1024

// MaxActionBytes bounds a step's action JSON. The episode core cuts an action's bulk
// (episode.ActionBytesCap); what remains — argv, environment, a path — is far smaller. A step's
// row is one value of a COPY, and a frame of the spool at most maxPayload.
const MaxActionBytes = 8 << 20

// Step records one step. It caps the observation at Config.ObservationCap and fills in its
// full size and SHA-256 unless ObservationSHA256 is already set (then 32 bytes). Ids over
// MaxIDLen are refused (ErrInvalid). An empty action is stored as JSON null; one that is not
// JSON is refused (ErrInvalid) unless ActionValid vouches for it. What of a JSON action jsonb
// cannot hold is stored as U+FFFD: NUL and a lone surrogate (jsonbText), and, in an action
// ActionValid does not vouch for, each byte that is not UTF-8. A zero StartedAt means now.
func (w *Writer) Step(r StepRow) error {
	if r.EpisodeID == "" || r.Index < 0 {
		return fmt.Errorf("step needs an episode id and an index >= 0: %w", ErrInvalid)
	}
	// The steps table keeps these inline and uncompressed (migration 0006): bounded, a row
	// of them always fits a page.
	if len(r.EpisodeID) > MaxIDLen || len(r.CheckpointID) > MaxIDLen {
		return fmt.Errorf("step %d: episode id of %d bytes, checkpoint id of %d: over %d: %w",
			r.Index, len(r.EpisodeID), len(r.CheckpointID), MaxIDLen, ErrInvalid)
	}
	if r.ObservationSHA256 != nil && len(r.ObservationSHA256) != sha256.Size {
		return fmt.Errorf("episode %s step %d: observation SHA-256 of %d bytes, want %d: %w",
			r.EpisodeID, r.Index, len(r.ObservationSHA256), sha256.Size, ErrInvalid)
	}
	if len(r.Action) > MaxActionBytes {
		return fmt.Errorf("episode %s step %d: action of %d bytes is over the ledger's %d (cut its bulk: episode.ActionBytesCap): %w",
			r.EpisodeID, r.Index, len(r.Action), MaxActionBytes, ErrInvalid)
	}
	if len(r.Action) == 0 {
		r.Action = json.RawMessage("null")
	} else if !r.ActionValid {
		if !json.Valid(r.Action) {
			return fmt.Errorf("episode %s step %d: action is not JSON: %w", r.EpisodeID, r.Index, ErrInvalid)
		}
		if !utf8.Valid(r.Action) { // encoding/json's Valid takes any bytes in a string; jsonb does not
			r.Action = json.RawMessage(wiretext.String(string(r.Action)))
		}
	}
	r.Action = jsonbText(r.Action)
	if r.ObservationSHA256 == nil {
		sum := sha256.Sum256(r.Observation)
		r.ObservationSHA256 = sum[:]
		r.ObservationSize = int64(len(r.Observation))
	}
	if r.Observation == nil {
		r.Observation = []byte{}
	}
	if len(r.Observation) > w.cfg.ObservationCap {
		r.Observation = r.Observation[:w.cfg.ObservationCap]
	}
	if r.StartedAt.IsZero() {
		r.StartedAt = time.Now()
	}
	return w.append(record{kind: recStep, step: &r})
}

// Checkpoint records a checkpoint. A zero CreatedAt means now.
func (w *Writer) Checkpoint(r CheckpointRow) error {
	if err := r.validate(); err != nil {
		return err
	}
	if r.CreatedAt.IsZero() {
		r.CreatedAt = time.Now()
	}
	r.ReleasedAt = nil
	return w.append(record{kind: recCheckpoint, ckpt: &r})
}

// CheckpointReleased records that checkpoint id was released. A zero at means now.
func (w *Writer) CheckpointReleased(id string, at time.Time) error {
	if id == "" {
		return fmt.Errorf("checkpoint release needs an id: %w", ErrInvalid)
	}
	if at.IsZero() {
		at = time.Now()
	}
	return w.append(record{kind: recRelease, release: &checkpointRelease{ID: id, At: at}})
}

// CheckpointDigest records checkpoint id's state digest, once computed. It may come before or
// after the checkpoint's own row, or for a checkpoint never recorded (one a deduplicating
// Checkpoint released at once), which the ledger's queries do not show.
func (w *Writer) CheckpointDigest(id string, d Digest) error {
	if err := d.validate(id); err != nil {
		return err
	}
	return w.append(record{kind: recDigest, digest: &checkpointDigest{ID: id, Digest: d}})
}

// CheckpointEdge records a parent link of the checkpoint graph besides the child's own
// parent_id (CheckpointEdge). Recording one twice keeps one.
func (w *Writer) CheckpointEdge(e CheckpointEdge) error {
	if err := e.validate(); err != nil {
		return err
	}
	if e.CreatedAt.IsZero() {
		e.CreatedAt = time.Now()
	}
	return w.append(record{kind: recEdge, edge: &e})
}

// Reward records a reward (typically the verifier's). A zero CreatedAt means now.
//
// Its source and component names are stored as text() keeps them (a verifier, which the
// sandbox's state may steer, names the components): NUL and bytes that are not UTF-8 become
// U+FFFD, and of names that then read the same one is kept.
func (w *Writer) Reward(r RewardRow) error {
	if err := r.validate(); err != nil {
		return err
	}
	r.Source = text(r.Source)
	for k := range r.Components {
		if text(k) != k { // a copy: the caller's map is left as it is
			comps := make(map[string]float64, len(r.Components))
			for k, v := range r.Components {
				comps[text(k)] = v
			}
			r.Components = comps
			break
		}
	}
	if r.CreatedAt.IsZero() {
		r.CreatedAt = time.Now()
	}
	return w.append(record{kind: recReward, reward: &r})
}

func (w *Writer) append(r record) error {
	size := r.size()
	if size > maxPayload/2 { // a frame recovery would call corrupt must never be acknowledged
		return fmt.Errorf("a row of about %d bytes is over the spool's frame cap of %d: %w", size, maxPayload, ErrInvalid)
	}
	w.mu.Lock()
	for w.pending >= w.cfg.MaxPending && !w.closed {
		w.drained.Wait() // the disk is behind: see Config.MaxPending
	}
	if w.closed {
		w.mu.Unlock()
		return ErrClosed
	}
	r.seq = w.nextSeq
	w.nextSeq++
	wasEmpty := w.pending == 0
	w.appendFrameLocked(&r, size)
	big := w.pending >= 8<<20
	if !w.overflow && len(w.mem) < w.cfg.QueueRows && w.memBytes+size <= w.cfg.QueueBytes {
		w.mem = append(w.mem, r)
		w.memBytes += size
	} else {
		w.overflow = true
		w.spooled.Add(1)
	}
	w.mu.Unlock()
	if wasEmpty {
		select {
		case w.syncer.kick <- struct{}{}:
		default:
		}
	}
	if big {
		w.requestSync()
	}
	return nil
}

// chunkSize is the unit of the group-commit buffer: frames are appended to fixed chunks that are
// reused, so a growing window never copies what it already holds.
const chunkSize = 4 << 20

// +checklocks:w.mu
func (w *Writer) appendFrameLocked(r *record, size int) {
	n := len(w.chunks)
	if n == 0 || cap(w.chunks[n-1])-len(w.chunks[n-1]) < size+frameHeader+1024 {
		var c []byte
		if k := len(w.free); k > 0 && size+frameHeader+1024 <= chunkSize {
			c, w.free = w.free[k-1][:0], w.free[:k-1]
		} else {
			c = make([]byte, 0, max(chunkSize, size+frameHeader+1024))
		}
		w.chunks = append(w.chunks, c)
		n++
	}
	before := len(w.chunks[n-1])
	w.chunks[n-1] = appendFrame(w.chunks[n-1], r)
	w.pending += len(w.chunks[n-1]) - before
}

func (w *Writer) requestSync() {
	select {
	case w.syncer.flushNow <- struct{}{}:
	default:
	}
}

// notifyLocked wakes everyone waiting for progress.
//
// +checklocks:w.mu
func (w *Writer) notifyLocked() {
	close(w.changed)
	w.changed = make(chan struct{})
}

// syncLoop is the group commit. Buffered rows are written to the spool when a caller waits for
// them (writeNow), and at the end of the window that starts when the first of them is seen
// (due), when an fsync of everything written starts too. The fsync runs beside the writes
// (startSync), so that a caller waiting for a write never waits for a disk flush; with
// Config.Sync, callers wait for the fsync after their write, and those arriving while one is in
// flight share the next. While a write or an fsync is in flight, rows and callers gather for
// the next.
func (w *Writer) syncLoop() {
	defer close(w.syncer.done)
	timer := time.NewTimer(time.Hour)
	timer.Stop()
	var (
		due      time.Time // when the rows not yet covered by an fsync must have one started
		inFlight bool      // an fsync runs
		covered  uint64    // the last row the fsync in flight covers
		want     bool      // an fsync is to start as soon as none runs
		done     = make(chan syncResult, 1)
	)
	write := func() {
		inFlight = w.rollOver(inFlight, done)
		w.writeOnce()
	}
	for {
		var expired <-chan time.Time
		if !due.IsZero() {
			timer.Reset(time.Until(due))
			expired = timer.C
		}
		select {
		case <-w.syncer.kick:
		case <-w.syncer.writeNow:
			write()
			want = want || w.cfg.Sync
		case <-w.syncer.flushNow:
			write()
			want = true
		case <-expired:
			write()
			want = true
		case r := <-done:
			inFlight = false
			w.endSync(r)
		case <-w.syncer.stop:
			timer.Stop()
			w.syncAll(inFlight, done)
			return
		}
		timer.Stop()
		if want && !inFlight {
			want = false
			covered, inFlight = w.startSync(done)
		}
		switch {
		case !w.uncovered(covered) || want:
			due = time.Time{} // nothing waits, or an fsync starts once the one in flight ends
		case due.IsZero() || !time.Now().Before(due):
			due = time.Now().Add(w.cfg.GroupCommit)
		}
	}
}

// syncResult is the outcome of an fsync: it covered the rows up to seq to, the first chunks of
// unsynced, and took took.
type syncResult struct {
	to     uint64
	chunks int
	took   time.Duration
	err    error
}

// writeOnce writes the buffered rows to the spool file, and returns at once if there are none.
func (w *Writer) writeOnce() {
	w.mu.Lock()
	chunks, last := w.chunks, w.nextSeq-1
	w.chunks, w.pending = nil, 0
	w.drained.Broadcast()
	w.mu.Unlock()
	if len(chunks) == 0 {
		return
	}
	err := w.sp.append(chunks)
	w.mu.Lock()
	defer w.mu.Unlock()
	if err != nil {
		// The rows go back in front of the buffer, for the next write.
		w.cfg.Logger.Error("ledger spool write", "err", err)
		w.requeueLocked(chunks, err)
		return
	}
	w.syncErr = nil
	w.written = last
	w.unsynced = append(w.unsynced, chunks...)
	w.notifyLocked()
}

// requeueLocked puts chunks back in front of the buffer after a failed spool write (err).
//
// +checklocks:w.mu
func (w *Writer) requeueLocked(chunks [][]byte, err error) {
	for _, c := range chunks {
		w.pending += len(c)
	}
	w.chunks = append(chunks, w.chunks...)
	w.syncErr = err
	w.failures++
	w.notifyLocked()
}

// startSync starts an fsync of every row written so far (up to the last row it returns),
// reporting to done; false if there is none to make durable or it could not start.
func (w *Writer) startSync(done chan<- syncResult) (uint64, bool) {
	w.mu.Lock()
	r := syncResult{to: w.written, chunks: len(w.unsynced)}
	idle := w.written == w.synced
	w.mu.Unlock()
	if idle {
		return 0, false
	}
	fd, err := w.sp.beginSync()
	if err != nil {
		w.cfg.Logger.Error("ledger spool sync", "err", err)
		return 0, false
	}
	go func() {
		start := time.Now()
		r.err = fdatasync(fd)
		r.took = time.Since(start)
		_ = unix.Close(fd)
		done <- r
	}()
	return r.to, true
}

// endSync records an fsync's outcome. After a failure nothing written since the last good one
// is in the spool any more: those rows go back in front of the buffer, to be written again.
func (w *Writer) endSync(r syncResult) {
	w.sp.endSync(r.err)
	w.mu.Lock()
	if r.err != nil {
		w.cfg.Logger.Error("ledger spool sync", "err", r.err)
		back := w.unsynced
		w.unsynced, w.written = nil, w.synced
		w.requeueLocked(back, fmt.Errorf("syncing spool: %w", r.err))
		w.mu.Unlock()
		return
	}
	w.maxSync = max(w.maxSync, r.took)
	w.synced = r.to
	for i, c := range w.unsynced[:r.chunks] {
		if cap(c) == chunkSize && len(w.free) < 16 {
			w.free = append(w.free, c[:0])
		}
		w.unsynced[i] = nil
	}
	w.unsynced = w.unsynced[r.chunks:]
	if len(w.unsynced) == 0 {
		w.unsynced = nil
	}
	clean, last := w.synced == w.written, w.written
	w.notifyLocked()
	w.mu.Unlock()
	if clean {
		w.sp.rotateIfFull(last)
	}
}

// rollOver, once the active segment is full, makes it durable to its end and starts the next
// (endSync), before anything more is written to it: with writes going on while each fsync runs,
// a segment would otherwise never be durable to its end, and grow for as long as they go on. It
// reports whether an fsync is still in flight (never, after a roll-over).
func (w *Writer) rollOver(inFlight bool, done chan syncResult) bool {
	if !w.sp.full() {
		return inFlight
	}
	if inFlight {
		w.endSync(<-done)
	}
	if _, ok := w.startSync(done); ok {
		w.endSync(<-done)
	}
	return false
}

// uncovered reports whether rows are buffered, or written past covered (the last row of the
// fsync in flight, if any) and not yet fsynced.
func (w *Writer) uncovered(covered uint64) bool {
	w.mu.Lock()
	defer w.mu.Unlock()
	return w.pending > 0 || w.written > max(w.synced, covered)
}

// syncAll writes and fsyncs every row, once the fsync in flight (if inFlight) has reported to
// done: the end of the syncer. It gives up after a failure (Close reports it).
func (w *Writer) syncAll(inFlight bool, done chan syncResult) {
	if inFlight {
		w.endSync(<-done)
	}
	w.writeOnce()
	if _, ok := w.startSync(done); ok {
		w.endSync(<-done)
	}
}

// Stored waits until every row appended before the call is stored in the spool: written to
// the spool file, where a SIGKILL of the process does not lose it, and with Config.Sync
// fsynced too, where a crash of the machine does not. It has the buffered rows written at
// once: rows appended by concurrent callers go in one write, and each caller waits for the
// write that holds its rows. Postgres is not waited for. If the write that was to hold them
// fails, Stored returns an error wrapping ErrSpoolWrite; the rows stay buffered and later
// writes retry them. It returns ctx's error if ctx ends first, and ErrClosed if the writer
// closed without storing them.
func (w *Writer) Stored(ctx context.Context) error {
	w.mu.Lock()
	target, failures := w.nextSeq-1, w.failures
	w.mu.Unlock()
	asked := false
	for {
		w.mu.Lock()
		done, failed, err, ch := w.storedLocked() >= target, w.failures != failures, w.syncErr, w.changed
		w.mu.Unlock()
		switch {
		case done:
			return nil
		case failed:
			return fmt.Errorf("storing ledger rows: %w: %w", ErrSpoolWrite, err)
		case !asked:
			asked = true
			select {
			case w.syncer.writeNow <- struct{}{}:
			default: // already asked: the next write takes these rows too
			}
		}
		select {
		case <-ch:
		case <-w.syncer.done:
			w.mu.Lock()
			done = w.storedLocked() >= target
			w.mu.Unlock()
			if done {
				return nil
			}
			return fmt.Errorf("storing ledger rows: %w", ErrClosed)
		case <-ctx.Done():
			return fmt.Errorf("storing ledger rows: %w", ctx.Err())
		}
	}
}

// storedLocked is the last row Stored counts as stored.
//
// +checklocks:w.mu
func (w *Writer) storedLocked() uint64 {
	if w.cfg.Sync {
		return w.synced
	}
	return w.written
}

// popMemLocked drops rows up to pos (handed to the deliverer) from the in-memory queue.
//
// +checklocks:w.mu
func (w *Writer) popMemLocked(pos uint64) {
	i := 0
	for i < len(w.mem) && w.mem[i].seq <= pos {
		w.memBytes -= w.mem[i].size()
		w.mem[i] = record{}
		i++
	}
	w.mem = w.mem[i:]
	if len(w.mem) == 0 {
		w.mem = w.mem[:0:0]
	}
}

// nextBatch waits for durable rows after pos and returns a batch of them: from the in-memory
// queue when it holds the next row, from the spool otherwise. nil means stop.
func (w *Writer) nextBatch(ctx context.Context, pos uint64) []record {
	var readyAt time.Time // when rows were first seen waiting (DeliveryDelay)
	var timer *time.Timer
	defer func() {
		if timer != nil {
			timer.Stop()
		}
	}()
	w.mu.Lock()
	for {
		w.popMemLocked(pos)
		next := pos + 1
		wait := w.deliveryWaitLocked(pos, &readyAt)
		if next <= w.synced && wait <= 0 {
			if batch := w.memBatchLocked(next); batch != nil {
				w.mu.Unlock()
				w.sp.dropSlabs() // the reader's own state: this is the reader
				return batch
			}
			to := w.spoolEndLocked()
			w.mu.Unlock()
			batch, more := w.spoolBatch(ctx, next, to)
			if batch != nil || !more {
				return batch
			}
			w.mu.Lock()
			continue
		}
		if w.closed && next == w.nextSeq {
			w.mu.Unlock()
			return nil
		}
		ch := w.changed
		fromMemory := !w.overflow
		w.mu.Unlock()
		if !w.waitRows(ctx, ch, fromMemory, wait, &timer) {
			return nil
		}
		w.mu.Lock()
	}
}

// deliveryWaitLocked returns how much longer the durable rows after pos may wait for more
// (Config.DeliveryDelay; 0 or less: deliver now). readyAt is when rows were first seen
// waiting, set on the first call that sees them.
//
// +checklocks:w.mu
func (w *Writer) deliveryWaitLocked(pos uint64, readyAt *time.Time) time.Duration {
	if pos+1 > w.synced || w.closed || w.flushTo > pos || w.synced-pos >= uint64(w.cfg.BatchRows/4) || w.cfg.DeliveryDelay <= 0 {
		return 0
	}
	if readyAt.IsZero() {
		*readyAt = time.Now()
	}
	return w.cfg.DeliveryDelay - time.Since(*readyAt)
}

// memBatchLocked takes a batch from the in-memory queue if it starts with row next.
//
// +checklocks:w.mu
func (w *Writer) memBatchLocked(next uint64) []record {
	if len(w.mem) == 0 || w.mem[0].seq != next {
		return nil
	}
	n, bytes := 0, 0
	for n < len(w.mem) && n < w.cfg.BatchRows && bytes < w.cfg.BatchBytes && w.mem[n].seq <= w.synced {
		bytes += w.mem[n].size()
		n++
	}
	batch := append([]record(nil), w.mem[:n]...)
	w.popMemLocked(batch[n-1].seq)
	return batch
}

// spoolEndLocked is the last durable row that only the spool holds.
//
// +checklocks:w.mu
func (w *Writer) spoolEndLocked() uint64 {
	to := w.synced
	if len(w.mem) > 0 {
		to = min(to, w.mem[0].seq-1)
	}
	return to
}

// spoolBatch reads a batch of rows next..to back from the spool. With no rows, more says
// whether to look again (a read failed: after a second) or stop (ctx ended).
func (w *Writer) spoolBatch(ctx context.Context, next, to uint64) (batch []record, more bool) {
	batch, err := w.sp.read(next, to, w.cfg.BatchRows, w.cfg.BatchBytes)
	if err != nil {
		w.cfg.Logger.Error("ledger spool read", "err", err)
		if len(batch) == 0 {
			return nil, sleepCtx(ctx, time.Second)
		}
	}
	if last := batch[len(batch)-1].seq; last == to {
		w.mu.Lock()
		if w.overflow && last == w.synced && len(w.mem) == 0 {
			// Caught up with the spool: new rows may use the in-memory queue again.
			w.overflow = false
		}
		w.mu.Unlock()
	}
	return batch, true
}

// waitRows waits for ch (progress), for wait when positive (the delivery delay's end, on
// *timer, made on first use), or for ctx's end, which it reports as false. fromMemory says
// rows come from memory now, so that the reader's slabs can go (a server that caught up and
// went idle would otherwise keep them).
func (w *Writer) waitRows(ctx context.Context, ch <-chan struct{}, fromMemory bool, wait time.Duration, timer **time.Timer) bool {
	if fromMemory {
		w.sp.dropSlabs()
	}
	var expired <-chan time.Time
	if wait > 0 {
		if *timer == nil {
			*timer = time.NewTimer(wait)
		} else {
			(*timer).Reset(wait)
		}
		expired = (*timer).C
	}
	select {
	case <-ch:
	case <-expired:
	case <-ctx.Done():
		return false
	}
	return true
}

// isDataError reports whether Postgres rejected the rows themselves (a bad value or a duplicate
// key), as opposed to the connection or the server failing.
func isDataError(err error) bool {
	var pe *pgconn.PgError
	if !errors.As(err, &pe) || len(pe.Code) < 2 {
		return false
	}
	switch pe.Code[:2] {
	case "22", "23", "54": // data exception, integrity constraint violation, limit exceeded
		return true
	}
	return false
}

// spoolLockClass is the first key of the advisory locks that serialise a spool's deliveries
// (the second is a hash of the spool id).
const spoolLockClass int32 = 0x64676c73 // "dgls"

var rewardColumns = []string{"episode_id", "step_index", "source", "components", "value", "created_at"}

const (
	insertRun     = "INSERT INTO runs (name) VALUES ($1) ON CONFLICT DO NOTHING"
	insertEpisode = `INSERT INTO episodes (id, env, run, group_id, seed, start_checkpoint, parent_episode, sandbox, started_at)
		VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9) ON CONFLICT (id) DO NOTHING`
	insertCheckpoint = `INSERT INTO checkpoints (id, parent_id, kind, env, sandbox, episode_id, step_index, created_at)
		VALUES ($1, $2, $3, $4, $5, $6, $7, $8) ON CONFLICT (id) DO NOTHING`
	updateEpisode = `UPDATE episodes SET status = $2, failure_class = $3, total_reward = $4, ended_at = $5,
		failure_message = $6 WHERE id = $1`
	insertDigest  = `INSERT INTO checkpoint_digests (id, files, processes) VALUES ($1, $2, $3) ON CONFLICT (id) DO NOTHING`
	insertEdge    = `INSERT INTO checkpoint_edges (child_id, parent_id, created_at) VALUES ($1, $2, $3) ON CONFLICT DO NOTHING`
	updateRelease = "UPDATE checkpoints SET released_at = $2 WHERE id = $1 AND released_at IS NULL"
	updateEnded   = `UPDATE episodes SET status = 'failed', failure_class = 'infra', ended_at = $2,
		failure_message = 'the server ended (it crashed or was killed) while the episode ran'
		WHERE sandbox = ANY($1) AND status = 'running'`
	insertStep = `INSERT INTO steps (episode_id, idx, action, observation, observation_size, observation_sha256,
		reward, terminated, truncated, started_at, duration_ns, checkpoint_id, setup)
		VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12, $13) ON CONFLICT DO NOTHING`
	insertReward = `INSERT INTO rewards (episode_id, step_index, source, components, value, created_at)
		VALUES ($1, $2, $3, $4, $5, $6)`
	upsertMark = `INSERT INTO ledger_spool_marks (spool_id, seq) VALUES ($1, $2)
		ON CONFLICT (spool_id) DO UPDATE SET seq = excluded.seq, updated_at = now()`
)

func nullStr(s string) any {
	if s == "" {
		return nil
	}
	return s
}

func stepValues(s *StepRow) []any {
	return []any{s.EpisodeID, int32(s.Index), s.Action, s.Observation, s.ObservationSize,
		s.ObservationSHA256, s.Reward, s.Terminated, s.Truncated, s.StartedAt, int64(s.Duration), nullStr(s.CheckpointID), s.Setup}
}

func rewardValues(r *RewardRow) []any {
	var step any
	if r.StepIndex != nil {
		step = int32(*r.StepIndex)
	}
	comps := r.Components
	if comps == nil {
		comps = map[string]float64{}
	}
	return []any{r.EpisodeID, step, r.Source, comps, r.Value, r.CreatedAt}
}

func (w *Writer) applyOne(ctx context.Context, tx pgx.Tx, r *record) error {
	sp, err := tx.Begin(ctx)
	if err != nil {
		return fmt.Errorf("beginning savepoint: %w", err)
	}
	switch r.kind {
	case recEpisodeStart:
		s := r.start
		if s.Run != "" {
			_, err = sp.Exec(ctx, insertRun, s.Run)
		}
		if err == nil {
			_, err = sp.Exec(ctx, insertEpisode, s.ID, s.Env, s.Run, s.Group, s.Seed, nullStr(s.StartCheckpoint), nullStr(s.ParentEpisode), nullStr(s.Sandbox), s.StartedAt)
		}
	case recCheckpoint:
		c := r.ckpt
		_, err = sp.Exec(ctx, insertCheckpoint, c.ID, nullStr(c.ParentID), string(c.Kind), c.Env, c.Sandbox, nullStr(c.EpisodeID), int32(c.StepIndex), c.CreatedAt)
	case recStep:
		_, err = sp.Exec(ctx, insertStep, stepValues(r.step)...)
	case recReward:
		_, err = sp.Exec(ctx, insertReward, rewardValues(r.reward)...)
	case recEpisodeEnd:
		e := r.end
		_, err = sp.Exec(ctx, updateEpisode, e.ID, string(e.Status), nullStr(string(e.FailureClass)), e.TotalReward, e.EndedAt, nullStr(e.FailureMessage))
	case recRelease:
		_, err = sp.Exec(ctx, updateRelease, r.release.ID, r.release.At)
	case recSandboxesEnded:
		_, err = sp.Exec(ctx, updateEnded, r.ended.IDs, r.ended.At)
	case recEgress:
		_, err = sp.Exec(ctx, insertEgress, egressValues(r.egress)...)
	case recDigest:
		_, err = sp.Exec(ctx, insertDigest, r.digest.ID, r.digest.Digest.Files, r.digest.Digest.Processes)
	case recEdge:
		_, err = sp.Exec(ctx, insertEdge, r.edge.ChildID, r.edge.ParentID, r.edge.CreatedAt)
	}
	if err != nil {
		_ = sp.Rollback(ctx)
		if !isDataError(err) {
			return err
		}
		w.dropped.Add(1)
		w.cfg.Logger.Error("ledger row rejected by Postgres; skipped", "seq", r.seq, "kind", r.kind, "err", err)
		return nil
	}
	return sp.Commit(ctx)
}

// Flush waits until every row appended before the call is committed to Postgres (the group
// commit is cut short). It returns ctx's error wrapped with ErrUndelivered if ctx ends first.
func (w *Writer) Flush(ctx context.Context) error {
	w.mu.Lock()
	target := w.nextSeq - 1
	if target > w.flushTo {
		w.flushTo = target
		w.notifyLocked()
	}
	w.mu.Unlock()
	w.requestSync()
	return w.waitDelivered(ctx, target)
}

func (w *Writer) waitDelivered(ctx context.Context, target uint64) error {
	for {
		w.mu.Lock()
		done, ch := w.delivered >= target, w.changed
		w.mu.Unlock()
		if done {
			return nil
		}
		if w.beforeWait != nil {
			w.beforeWait()
		}
		select {
		case <-ch:
		case <-w.deliver.done:
			// The deliverer may have delivered the last rows just before it ended (both are
			// ready then, and select picks either).
			w.mu.Lock()
			done, left := w.delivered >= target, target-min(w.delivered, target)
			w.mu.Unlock()
			if done {
				return nil
			}
			return fmt.Errorf("flushing ledger: %d rows: %w", left, ErrUndelivered)
		case <-ctx.Done():
			w.mu.Lock()
			done, left := w.delivered >= target, target-min(w.delivered, target)
			w.mu.Unlock()
			if done {
				return nil
			}
			return fmt.Errorf("flushing ledger: %d rows: %w: %w", left, ErrUndelivered, ctx.Err())
		}
	}
}

// Stats returns the writer's counters.
func (w *Writer) Stats() Stats {
	w.mu.Lock()
	defer w.mu.Unlock()
	return Stats{
		Appended:  w.nextSeq - 1,
		Written:   w.written,
		Synced:    w.synced,
		Delivered: w.delivered,
		Spooled:   w.spooled.Load(),
		Dropped:   w.dropped.Load(),
		Retries:   w.retries.Load(),
		Vacuums:   w.vac.runs.Load(),
		MaxSync:   w.maxSync,
	}
}

// Close stops accepting rows, makes every row durable in the spool and delivers what it can
// before ctx ends. Rows still undelivered then stay in the spool for the next writer on the same
// directory, and Close returns an error wrapping ErrUndelivered. Close is idempotent.
func (w *Writer) Close(ctx context.Context) error {
	w.closeOnce.Do(func() {
		w.mu.Lock()
		w.closed = true
		target := w.nextSeq - 1
		w.notifyLocked()
		w.drained.Broadcast()
		w.mu.Unlock()
		close(w.syncer.stop)
		<-w.syncer.done
		var errs []error
		w.mu.Lock()
		if w.syncErr != nil {
			errs = append(errs, fmt.Errorf("closing ledger writer: %w", w.syncErr))
		}
		w.mu.Unlock()
		errs = append(errs, w.waitDelivered(ctx, target))
		w.deliver.cancel()
		<-w.deliver.done
		<-w.vac.done
		w.mu.Lock()
		delivered := w.delivered
		w.mu.Unlock()
		errs = append(errs, w.sp.setDeliveredHint(delivered), w.sp.close())
		w.closeErr = errors.Join(errs...)
	})
	return w.closeErr
}

func sleepCtx(ctx context.Context, d time.Duration) bool {
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-ctx.Done():
		return false
	case <-t.C:
		return true
	}
}
