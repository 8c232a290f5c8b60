package ledger

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"time"

	"github.com/jackc/pgx/v5"
)

// Delivery runs up to Config.Conns transactions at once, one per connection (a lane), each
// holding one batch. Batches are contiguous runs of sequence numbers and commit strictly in
// order, which keeps the single delivery mark per spool (ledger_spool_marks) exact:
//
//  1. A job inserts its episodes, runs and checkpoints only after the job before it has done the
//     same, then COPYs its steps and rewards while the job before it may still be copying.
//  2. It waits until the job before it has committed, then takes the spool's advisory lock,
//     reads the mark, applies its updates (episode ends, checkpoint releases: they may touch
//     rows the job before it inserted), advances the mark and commits.
//
// Step 2 reads the mark under the lock inside the transaction, as a single connection did, so a
// transaction left committing by a killed writer is waited for and never duplicated: if the mark
// already covers the job's rows, the job rolls back and redoes the rest sequentially. A job
// never waits in Postgres for a younger one: its inserts precede the younger job's, its updates
// touch only committed rows, and the only rows a younger job can hold that it may need are
// duplicate steps (a caller's bug), which lockTimeout turns into an error. When an attempt of a
// job fails, younger jobs roll back (they may hold rows its retry needs) and retry after it
// commits; retries run one job at a time.

// lockTimeout bounds any lock wait of a delivery transaction (see above: only duplicates across
// concurrent batches or a stalled transaction of a killed writer wait at all).
const lockTimeout = "5s"

var (
	errYield = errors.New("older delivery failed")  // rolled back: retry after the older job commits
	errStop  = errors.New("older delivery stopped") // the writer is stopping
	errRedo  = errors.New("delivery mark moved")    // rows already delivered: retry trimmed
)

// lane is one delivery connection; one job uses it at a time.
type lane struct {
	conn *pgx.Conn
	mark uint64 // the spool's mark as read when the connection was opened
}

// job is one batch on its way to Postgres.
type job struct {
	batch []record
	last  uint64 // seq of the batch's last row
	steps int    // step rows in the batch
	prev  *job   // the job committing before it; nil once it has finished

	firstDone, done, trouble         chan struct{}
	firstOnce, doneOnce, troubleOnce sync.Once
	ok                               bool // committed; set before done is closed
}

func newJob(batch []record, prev *job) *job {
	j := &job{batch: batch, last: batch[len(batch)-1].seq, prev: prev,
		firstDone: make(chan struct{}), done: make(chan struct{}), trouble: make(chan struct{})}
	for i := range batch {
		if batch[i].kind == recStep {
			j.steps++
		}
	}
	return j
}

func (j *job) markFirstDone() { j.firstOnce.Do(func() { close(j.firstDone) }) }
func (j *job) markTrouble()   { j.troubleOnce.Do(func() { close(j.trouble) }) }

// deliverLoop moves durable rows to Postgres, in sequence order, until ctx is cancelled or the
// writer is closed and everything is delivered. A reader goroutine prepares batches (from memory
// or the spool) while earlier ones are being copied and committed.
func (w *Writer) deliverLoop(ctx context.Context) {
	defer close(w.deliver.done)
	lanes := make([]*lane, w.cfg.Conns)
	for i := range lanes {
		lanes[i] = &lane{}
	}
	defer func() {
		for _, ln := range lanes {
			ln.close()
		}
	}()
	batches := make(chan []record, 1)
	readerDone := make(chan struct{})
	rctx, stopReader := context.WithCancel(ctx)
	defer func() {
		stopReader()
		<-readerDone
	}()
	go w.readBatches(rctx, batches, readerDone)
	var inflight []*job // oldest first
	var prev *job
	stopped := false
	n := 0
	src := (<-chan []record)(batches) // nil once the reader is done
	for src != nil || len(inflight) > 0 {
		var oldest <-chan struct{}
		if len(inflight) > 0 {
			oldest = inflight[0].done
		}
		in := src
		if len(inflight) == len(lanes) || stopped {
			in = nil
		}
		if in == nil && oldest == nil {
			return
		}
		select {
		case <-oldest:
			j := inflight[0]
			inflight[0] = nil
			inflight = inflight[1:]
			if !j.ok || stopped {
				stopped = true // stopping: the younger jobs give up too
				continue
			}
			w.committed(j)
		case batch, ok := <-in:
			if !ok {
				src = nil
				continue
			}
			// The lane's previous job is done: jobs finish in order and at most len(lanes) run.
			j := newJob(batch, prev)
			go w.runJob(ctx, lanes[n%len(lanes)], j)
			n++
			inflight = append(inflight, j)
			prev = j
		}
	}
}

// readBatches reads the batches to deliver, in order, into batches until ctx ends or the
// writer is closed and drained; it then closes batches and done.
func (w *Writer) readBatches(ctx context.Context, batches chan<- []record, done chan<- struct{}) {
	defer close(done)
	defer close(batches)
	w.mu.Lock()
	pos := w.delivered
	w.mu.Unlock()
	for {
		batch := w.nextBatch(ctx, pos)
		if batch == nil {
			return
		}
		pos = batch[len(batch)-1].seq
		select {
		case batches <- batch:
		case <-ctx.Done():
			return
		}
	}
}

// committed accounts for j, committed: the rows are delivered, the vacuumer counts its steps
// and the spool drops them.
func (w *Writer) committed(j *job) {
	w.mu.Lock()
	w.delivered = max(w.delivered, j.last)
	w.notifyLocked()
	w.mu.Unlock()
	if j.steps > 0 {
		w.vac.steps.Add(uint64(j.steps))
		select {
		case w.vac.kick <- struct{}{}:
		default:
		}
	}
	// After trim, the reader may read into the slabs j's rows were read back into
	// (spool.takeSlab): j is done with them. (pgx's CopyFrom can return on a server error
	// before its sending goroutine has stopped reading rows; that goroutine ends at its next
	// write to the failed connection, microseconds later, long before a retry reconnects and
	// commits.)
	if err := w.sp.trim(j.last); err != nil {
		w.cfg.Logger.Error("ledger spool trim", "err", err)
	}
}

// runJob delivers j on ln, retrying (reconnecting) until it is committed or ctx ends.
func (w *Writer) runJob(ctx context.Context, ln *lane, j *job) {
	defer func() {
		j.prev, j.batch = nil, nil
		j.markFirstDone()
		j.doneOnce.Do(func() { close(j.done) })
	}()
	backoff := 10 * time.Millisecond
	sequential := false // one job at a time: wait for the older job to commit before starting
	for {
		err := w.connectLane(ctx, ln)
		if err == nil {
			// After a reconnect the mark says whether an earlier attempt committed after all.
			for len(j.batch) > 0 && j.batch[0].seq <= ln.mark {
				j.batch = j.batch[1:]
			}
			if len(j.batch) == 0 {
				// Every row is in Postgres, so every older one is too.
				j.ok = true
				return
			}
			err = w.attempt(ctx, ln, j, sequential, false)
			if isDataError(err) {
				j.markTrouble()
				err = w.attempt(ctx, ln, j, true, true)
			}
			switch {
			case err == nil:
				j.ok = true
				return
			case errors.Is(err, errStop):
				return
			case errors.Is(err, errYield), errors.Is(err, errRedo):
				j.markTrouble()
				sequential = true
				continue
			}
			ln.close()
		}
		j.markTrouble()
		if ctx.Err() != nil {
			return
		}
		w.retries.Add(1)
		w.cfg.Logger.Warn("ledger delivery; retrying", "err", err, "backoff", backoff)
		if !sleepCtx(ctx, backoff) {
			return
		}
		backoff = min(backoff*2, time.Second)
		sequential = true
	}
}

// waitPrev waits until the older job has committed. With yield set, it returns errYield as soon
// as an attempt of the older job fails instead.
func waitPrev(ctx context.Context, j *job, yield bool) error {
	p := j.prev
	if p == nil {
		return nil
	}
	select {
	case <-p.done:
	default:
		var trouble <-chan struct{}
		if yield {
			trouble = p.trouble
		}
		select {
		case <-p.done:
		case <-trouble:
			return errYield
		case <-ctx.Done():
			return ctx.Err()
		}
	}
	if !p.ok {
		return errStop
	}
	return nil
}

// attempt runs one delivery transaction of j. Sequential attempts wait for the older job first
// and trim the batch under the lock; the others overlap the older job (see the top of the file).
// The safe path (after Postgres rejected a row) does every row on its own under a savepoint,
// logging and skipping the rows that fail.
func (w *Writer) attempt(ctx context.Context, ln *lane, j *job, sequential, safe bool) error {
	if sequential || safe {
		if err := waitPrev(ctx, j, false); err != nil {
			return err
		}
	}
	tx, err := ln.conn.Begin(ctx)
	if err != nil {
		return fmt.Errorf("beginning delivery: %w", err)
	}
	defer tx.Rollback(context.WithoutCancel(ctx))
	var d *delivery
	if !sequential && !safe {
		if d, err = overlap(ctx, tx, j); err != nil {
			return err
		}
	}
	mark, err := w.lockMark(ctx, tx)
	if err != nil {
		return err
	}
	if d != nil && mark >= j.batch[0].seq {
		ln.mark = mark // rows already delivered: runJob trims them and redoes the rest
		return errRedo
	}
	for len(j.batch) > 0 && j.batch[0].seq <= mark {
		j.batch = j.batch[1:]
	}
	if len(j.batch) == 0 {
		return nil
	}
	if err := w.apply(ctx, tx, j, d, safe); err != nil {
		return err
	}
	last := j.batch[len(j.batch)-1].seq
	if _, err := tx.Exec(ctx, upsertMark, w.sp.id, int64(last)); err != nil {
		return fmt.Errorf("recording delivery mark: %w", err)
	}
	if err := tx.Commit(ctx); err != nil {
		return fmt.Errorf("committing delivery: %w", err)
	}
	ln.mark = last
	return nil
}

// overlap runs the part of j's transaction that may overlap the older job: once the older job
// has done its inserts, j's own and its COPY; then it waits for the older job to commit
// (errYield as soon as an attempt of the older job fails).
func overlap(ctx context.Context, tx pgx.Tx, j *job) (*delivery, error) {
	if p := j.prev; p != nil {
		select {
		case <-p.trouble: // the older job is retrying: do not race it
			return nil, errYield
		default:
		}
		select {
		case <-p.firstDone:
		case <-p.trouble:
			return nil, errYield
		case <-ctx.Done():
			return nil, ctx.Err()
		}
	}
	d := prepare(j.batch)
	if err := d.first(ctx, tx); err != nil {
		return nil, err
	}
	j.markFirstDone()
	if err := d.copy(ctx, tx); err != nil {
		return nil, err
	}
	if err := waitPrev(ctx, j, true); err != nil {
		return nil, err
	}
	return d, nil
}

// lockMark takes the spool's advisory lock and reads its delivery mark in tx. A writer killed
// after sending COMMIT leaves a transaction that may still commit after a new writer on the
// same spool read the mark: serialising the spool's marks and reading the mark under the lock,
// inside the transaction, delivers rows never twice.
func (w *Writer) lockMark(ctx context.Context, tx pgx.Tx) (uint64, error) {
	if _, err := tx.Exec(ctx, "SELECT pg_advisory_xact_lock($1, hashtext($2))", spoolLockClass, w.sp.id); err != nil {
		return 0, fmt.Errorf("locking spool mark: %w", err)
	}
	var mark int64
	if err := tx.QueryRow(ctx, "SELECT coalesce((SELECT seq FROM ledger_spool_marks WHERE spool_id = $1), 0)", w.sp.id).Scan(&mark); err != nil {
		return 0, fmt.Errorf("reading delivery mark: %w", err)
	}
	return uint64(mark), nil
}

// apply writes j's rows in tx under the spool's lock: row by row on the safe path; else its
// inserts and COPY if overlap did not (d nil), then its updates.
func (w *Writer) apply(ctx context.Context, tx pgx.Tx, j *job, d *delivery, safe bool) error {
	switch {
	case safe:
		j.markFirstDone()
		for i := range j.batch {
			if err := w.applyOne(ctx, tx, &j.batch[i]); err != nil {
				return err
			}
		}
		return nil
	case d == nil:
		d = prepare(j.batch)
		if err := d.first(ctx, tx); err != nil {
			return err
		}
		j.markFirstDone()
		if err := d.copy(ctx, tx); err != nil {
			return err
		}
	}
	return d.updates(ctx, tx)
}

// commitDurably makes a connection's commits wait for the WAL, whatever the database's default
// (synchronous_commit): the spool drops what a delivery committed, and a reward ReportReward
// acknowledged must be stored. With it off (a setting some databases run with), a Postgres
// crash loses the last commits, delivery marks included, and their rows would be gone from
// both places: TestPostgresKilled lost 1,294 of 20,000 steps that way on a cluster run with
// it off.
func commitDurably(c *pgx.ConnConfig) { c.RuntimeParams["synchronous_commit"] = "on" }

// connectLane (re)connects ln, migrates and reads this spool's delivery mark.
func (w *Writer) connectLane(ctx context.Context, ln *lane) error {
	if ln.conn != nil {
		return nil
	}
	cctx, cancel := context.WithTimeout(ctx, 10*time.Second)
	defer cancel()
	cfg, err := pgx.ParseConfig(w.cfg.URL)
	if err != nil {
		return fmt.Errorf("parsing ledger URL: %w", err)
	}
	cfg.RuntimeParams["lock_timeout"] = lockTimeout
	commitDurably(cfg)
	conn, err := pgx.ConnectConfig(cctx, cfg)
	if err != nil {
		return fmt.Errorf("connecting to ledger database: %w", err)
	}
	applied, err := Migrate(cctx, conn)
	if err != nil {
		_ = conn.Close(context.Background())
		return err
	}
	if len(applied) > 0 {
		w.cfg.Logger.Info("ledger schema migrated", "applied", applied)
	}
	var mark int64
	err = conn.QueryRow(cctx, "SELECT seq FROM ledger_spool_marks WHERE spool_id = $1", w.sp.id).Scan(&mark)
	if err != nil && !errors.Is(err, pgx.ErrNoRows) {
		_ = conn.Close(context.Background())
		return fmt.Errorf("reading delivery mark: %w", err)
	}
	if uint64(mark) < ln.mark {
		// Only a database that acknowledges commits it can lose does this (fsync off and a
		// machine crash): the rows between are no longer in the spool either.
		w.cfg.Logger.Error("the ledger database lost rows it had committed: its delivery mark went back",
			"spool", w.sp.id, "mark", mark, "committed", ln.mark)
	}
	ln.conn, ln.mark = conn, uint64(mark)
	return nil
}

func (ln *lane) close() {
	if ln.conn != nil {
		_ = ln.conn.Close(context.Background())
		ln.conn = nil
	}
}

// delivery is a batch sorted for the fast path: inserts of episodes, runs and checkpoints
// first, COPY of steps and rewards, then the updates in order.
type delivery struct {
	inserts, later pgx.Batch
	steps          []*StepRow
	rewards        [][]any
}

func prepare(batch []record) *delivery {
	d := &delivery{}
	runs := map[string]bool{}
	for i := range batch {
		r := &batch[i]
		switch r.kind {
		case recEpisodeStart:
			s := r.start
			if s.Run != "" && !runs[s.Run] {
				runs[s.Run] = true
				d.inserts.Queue(insertRun, s.Run)
			}
			d.inserts.Queue(insertEpisode, s.ID, s.Env, s.Run, s.Group, s.Seed, nullStr(s.StartCheckpoint), nullStr(s.ParentEpisode), nullStr(s.Sandbox), s.StartedAt)
		case recCheckpoint:
			c := r.ckpt
			d.inserts.Queue(insertCheckpoint, c.ID, nullStr(c.ParentID), string(c.Kind), c.Env, c.Sandbox, nullStr(c.EpisodeID), int32(c.StepIndex), c.CreatedAt)
		case recStep:
			d.steps = append(d.steps, r.step)
		case recReward:
			d.rewards = append(d.rewards, rewardValues(r.reward))
		case recEpisodeEnd:
			e := r.end
			d.later.Queue(updateEpisode, e.ID, string(e.Status), nullStr(string(e.FailureClass)), e.TotalReward, e.EndedAt, nullStr(e.FailureMessage))
		case recRelease:
			d.later.Queue(updateRelease, r.release.ID, r.release.At)
		case recSandboxesEnded:
			d.later.Queue(updateEnded, r.ended.IDs, r.ended.At)
		case recEgress:
			d.inserts.Queue(insertEgress, egressValues(r.egress)...)
		case recDigest:
			d.inserts.Queue(insertDigest, r.digest.ID, r.digest.Digest.Files, r.digest.Digest.Processes)
		case recEdge:
			d.inserts.Queue(insertEdge, r.edge.ChildID, r.edge.ParentID, r.edge.CreatedAt)
		}
	}
	return d
}

func (d *delivery) first(ctx context.Context, tx pgx.Tx) error {
	if d.inserts.Len() == 0 {
		return nil
	}
	if err := tx.SendBatch(ctx, &d.inserts).Close(); err != nil {
		return fmt.Errorf("inserting episodes and checkpoints: %w", err)
	}
	return nil
}

func (d *delivery) copy(ctx context.Context, tx pgx.Tx) error {
	if len(d.steps) > 0 {
		if _, err := tx.Conn().PgConn().CopyFrom(ctx, &stepCopier{rows: d.steps}, copySteps); err != nil {
			return fmt.Errorf("copying steps: %w", err)
		}
	}
	if len(d.rewards) > 0 {
		if _, err := tx.CopyFrom(ctx, pgx.Identifier{"rewards"}, rewardColumns, pgx.CopyFromRows(d.rewards)); err != nil {
			return fmt.Errorf("copying rewards: %w", err)
		}
	}
	return nil
}

func (d *delivery) updates(ctx context.Context, tx pgx.Tx) error {
	if d.later.Len() == 0 {
		return nil
	}
	if err := tx.SendBatch(ctx, &d.later).Close(); err != nil {
		return fmt.Errorf("updating episodes and checkpoints: %w", err)
	}
	return nil
}

// deliverLoop is the delivering goroutine: cancel stops it, done is closed once it has returned.
type deliverLoop struct {
	cancel context.CancelFunc
	done   chan struct{}
}
