package ledger

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
)

// The steps table only grows, and every page of it must be vacuumed once: to set its tuples'
// hint bits and its visibility-map bit, and in the end to freeze it before the transaction ids
// wrap around. Autovacuum does that long after the page was written: once a fifth or so of the
// table is new, at a throttled pace that does not keep up with 50,000 steps/s, and by then the
// page has left Postgres's shared buffers and the memory group's page cache, so the vacuum
// reads it back from disk, dirties it and writes it again (BenchmarkWriterSteps with
// DELTAGYM_LEDGER_BENCH_VACUUM_STEPS=-1 shows what that costs Postgres per step).
//
// A COPY leaves the pages it fills in a ring of shared buffers (16 MB per backend) until the
// ring comes round to them. Vacuumed while they are still there, they are neither read nor
// dirtied again: the vacuum sets their bits before they are first written. So the writer
// vacuums the steps table itself, after every Config.VacuumSteps steps it delivers, on a
// connection of its own, and freezes as it goes (vacuum_freeze_min_age 0 on that connection:
// the rows every snapshot sees), so that the anti-wraparound vacuum finds the pages all-frozen
// and skips them. In steady state, at the default interval, each vacuum reads and dirties
// almost none of its pages; at ten times that, it reads and dirties them all (VACUUM VERBOSE in
// BenchmarkWriterSteps, DELTAGYM_LEDGER_BENCH_VACUUM_STEPS=n). It is not a VACUUM (FREEZE): that would be an
// aggressive vacuum, which scans every page not yet frozen (a whole table autovacuum had
// marked all-visible, the first time on an older ledger) and waits for a page a COPY has
// pinned instead of skipping it till next time. Nor does it truncate the table: a COPY
// extends it ahead of its rows, and truncating those empty pages back would take an exclusive
// lock.
//
// A vacuum marks and freezes only rows every snapshot sees. The delivery's own transactions
// hold that back a little: their COPYs' snapshots are as old as the oldest batch then in
// flight, so the last batches committed wait for a later vacuum (under saturation, up to a few
// times Conns×BatchRows steps). A long transaction elsewhere (an export, a psql session left
// open, or a write in any database of the cluster, since a snapshot's horizon is the oldest
// transaction running anywhere) holds it back for as long as it runs, and each vacuum would then scan again all the
// pages since it began. So after each vacuum the writer reads how many pages are all-visible
// (pg_class.relallvisible, which the vacuum just set): when that has not grown over vacuums
// spanning more than four times the larger of VacuumSteps and Conns×BatchRows steps, it logs
// so and waits before trying again (1 s, doubling up to a minute) instead of vacuuming every
// VacuumSteps, until a vacuum gains pages again. It does not wait otherwise: a vacuum that
// found its pages gone from the shared buffers (after a checkpoint, say) reads them back faster
// than steps arrive, so the next vacuums, taken back to back, catch up, where waiting in
// proportion to the time taken would let the pages between vacuums grow without end.
//
// A vacuum that finds the table locked by another (autovacuum's, or an ANALYZE) is skipped,
// not counted, and tried again, steps or not, after the same waits as a held one; so is one
// that fails (Postgres restarting), on a new connection. (A TOAST table found locked is
// skipped without a word from Postgres: that vacuum counts, and its TOAST pages, those of
// observations too big for a page, wait for the next.)

// defaultVacuumSteps is Config.VacuumSteps's default: in BenchmarkWriterSteps a vacuum this
// often reads and dirties almost no page again, where at five times the interval it reads back
// part of them (docs/PERFORMANCE.md, "The ledger").
const defaultVacuumSteps = 10_000

// vacuumConn is the writer's vacuum connection: what it learned about the server when it
// connected, and the notices its last statement received.
type vacuumConn struct {
	conn    *pgx.Conn
	stmt    string // the VACUUM for the server's version
	notices []*pgconn.Notice
	skipped bool // the last statement found the table locked (SKIP_LOCKED)
}

func (vc *vacuumConn) close() {
	if vc.conn != nil {
		_ = vc.conn.Close(context.Background())
		vc.conn = nil
	}
}

// vacuumLoop vacuums the steps table after every Config.VacuumSteps steps delivered, until ctx
// ends.
func (w *Writer) vacuumLoop(ctx context.Context) {
	defer close(w.vac.done)
	vc := &vacuumConn{}
	defer vc.close()
	every := uint64(w.cfg.VacuumSteps)
	p := &vacuumPlan{w: w, every: every, patience: 4 * max(every, uint64(w.cfg.Conns*w.cfg.BatchRows)), backoff: w.cfg.vacuumBackoff}
	for {
		if !p.awaitDue(ctx) || !sleepCtx(ctx, time.Until(p.next)) {
			return
		}
		start := w.vac.steps.Load()
		vis, err := w.vacuum(ctx, vc)
		switch {
		case ctx.Err() != nil:
			return
		case errors.Is(err, errNoVacuum):
			w.cfg.Logger.Warn("ledger: the writer does not vacuum the steps table; autovacuum will", "err", err)
			return
		case err != nil:
			p.failed(err)
			vc.close()
		case vc.skipped:
			p.skipped()
		default:
			p.ran(start, vis)
		}
	}
}

// vacuumPlan decides when the writer's next vacuum runs.
type vacuumPlan struct {
	w *Writer
	// every is the steps between two vacuums; patience, how many may pass without a vacuum
	// gaining pages before it waits.
	every, patience uint64
	// at is the steps delivered when the last vacuum started; gainedAt, when the last one that
	// gained pages did. No vacuum starts before next; owed means one is due at next whether
	// steps arrive or not (the last was skipped or failed).
	at, gainedAt                  uint64
	next                          time.Time
	owed, held, failing, skipping bool
	last                          relVisibility
	backoff                       time.Duration
}

// awaitDue waits until a vacuum is due (false: ctx ended).
func (p *vacuumPlan) awaitDue(ctx context.Context) bool {
	for {
		var retry <-chan time.Time
		if p.owed {
			retry = time.After(time.Until(p.next))
		}
		select {
		case <-ctx.Done():
			return false
		case <-p.w.vac.kick:
		case <-retry:
		}
		if p.owed || p.w.vac.steps.Load() >= p.at+p.every {
			return true
		}
	}
}

// wait puts off the next vacuum, after a failed or held one.
func (p *vacuumPlan) wait() {
	p.next = time.Now().Add(p.backoff)
	p.backoff = min(2*p.backoff, p.w.cfg.vacuumBackoffMax)
}

func (p *vacuumPlan) failed(err error) {
	if !p.failing {
		p.w.cfg.Logger.Warn("ledger: vacuuming the steps table", "err", err, "retry_in", p.backoff)
	}
	p.failing, p.owed = true, true
	p.wait()
}

func (p *vacuumPlan) skipped() {
	if !p.skipping {
		p.w.cfg.Logger.Info("ledger: another vacuum or analyze holds the steps table; the writer's waits till it is done", "retry_in", p.backoff)
	}
	p.skipping, p.owed = true, true
	p.wait()
}

// ran accounts for a vacuum that started at start steps and left vis.
func (p *vacuumPlan) ran(start uint64, vis relVisibility) {
	log := p.w.cfg.Logger
	p.skipping = false
	if p.failing {
		log.Info("ledger: vacuuming the steps table again")
	}
	p.failing, p.owed, p.at = false, false, start
	if p.w.vac.runs.Add(1) == 1 {
		log.Info(fmt.Sprintf("ledger: vacuuming the steps table every %d steps", p.every))
	}
	log.Debug("ledger: vacuumed the steps table", "steps", p.at, "pages", vis.pages, "all_visible", vis.visible)
	if vis.visible > p.last.visible || vis.pages <= p.last.pages {
		p.gainedAt = p.at
	}
	p.last = vis
	if p.at-p.gainedAt <= p.patience {
		if p.held {
			log.Info("ledger: the steps' vacuum is no longer held back")
		}
		p.held, p.backoff, p.next = false, p.w.cfg.vacuumBackoff, time.Time{}
		return
	}
	if !p.held {
		log.Info("ledger: an older transaction holds the steps' vacuum back: it marks no page; trying less often until it does",
			"steps", p.at-p.gainedAt)
	}
	p.held = true
	p.wait()
}

// relVisibility is a table's size in pages and how many of them are all-visible, as its last
// vacuum left them in pg_class.
type relVisibility struct{ pages, visible int64 }

// errNoVacuum means the writer cannot vacuum the steps table at all: its role may not, or the
// server is older than PostgreSQL 12.
var errNoVacuum = errors.New("cannot vacuum")

// vacuum runs one VACUUM of the steps table on vc, connecting it first if need be, and reads
// what it left. A connection that was closed under it (an idle timeout, a restart) is opened
// again once.
func (w *Writer) vacuum(ctx context.Context, vc *vacuumConn) (relVisibility, error) {
	var vis relVisibility
	for attempt := 0; ; attempt++ {
		fresh := vc.conn == nil
		if fresh {
			if err := w.connectVacuum(ctx, vc); err != nil {
				return vis, err
			}
		}
		vc.notices, vc.skipped = vc.notices[:0], false
		_, err := vc.conn.Exec(ctx, vc.stmt)
		if err == nil {
			break
		}
		if fresh || attempt > 0 || !vc.conn.IsClosed() || ctx.Err() != nil {
			return vis, err
		}
		vc.close()
	}
	// What it may not vacuum is a warning, not an error: "permission denied to vacuum "steps",
	// skipping it" (PostgreSQL 16 and later), "skipping "steps" --- only table or database
	// owner can vacuum it" (12 to 15), in English. connectVacuum checks the privileges first;
	// this is for what it could not foresee.
	for _, n := range vc.notices {
		if strings.Contains(n.Message, "permission denied") || strings.Contains(n.Message, "owner can vacuum") {
			return vis, fmt.Errorf("%w: %s", errNoVacuum, n.Message)
		}
		w.cfg.Logger.Warn("ledger: vacuuming the steps table", "notice", n.Message)
	}
	if vc.skipped {
		return vis, nil
	}
	err := vc.conn.QueryRow(ctx, "SELECT relpages, relallvisible FROM pg_class WHERE oid = 'steps'::regclass").
		Scan(&vis.pages, &vis.visible)
	return vis, err
}

// connectVacuum opens vc's connection, reads the server's version and checks that its role
// may vacuum the steps table.
func (w *Writer) connectVacuum(ctx context.Context, vc *vacuumConn) error {
	cfg, err := pgx.ParseConfig(w.cfg.URL)
	if err != nil {
		return fmt.Errorf("parsing ledger URL: %w", err)
	}
	if cfg.RuntimeParams["application_name"] == "" {
		cfg.RuntimeParams["application_name"] = "deltagym ledger vacuum"
	}
	cfg.OnNotice = func(_ *pgconn.PgConn, n *pgconn.Notice) {
		if n.Code == "55P03" { // lock_not_available: SKIP_LOCKED skipped the table
			vc.skipped = true
			return
		}
		vc.notices = append(vc.notices, n)
	}
	cctx, cancel := context.WithTimeout(ctx, 10*time.Second)
	defer cancel()
	c, err := pgx.ConnectConfig(cctx, cfg)
	if err != nil {
		return fmt.Errorf("connecting to ledger database: %w", err)
	}
	// Freeze the rows every snapshot sees, as it sets their pages all-visible (see above), and
	// let a long vacuum (the first of an older ledger) finish whatever the role's statement
	// timeout. SET, not the startup packet, which a pooler such as PgBouncer may refuse or drop.
	var version int
	var may bool
	_, err = c.Exec(cctx, "SET vacuum_freeze_min_age = 0")
	if err == nil {
		_, err = c.Exec(cctx, "SET statement_timeout = 0")
	}
	if err == nil {
		err = c.QueryRow(cctx, "SELECT current_setting('server_version_num')::int").Scan(&version)
	}
	if err == nil {
		vc.stmt, err = vacuumStatement(version)
	}
	if err == nil {
		err = c.QueryRow(cctx, mayVacuumQuery(version)).Scan(&may)
	}
	if err == nil && !may {
		err = fmt.Errorf("%w: role %q may not vacuum the steps table (it may if it owns the table or the database, or on PostgreSQL 17 and later holds MAINTAIN on it: GRANT MAINTAIN ON steps TO %s; --ledger-vacuum-steps -1 stops the writer trying)",
			errNoVacuum, c.Config().User, c.Config().User)
	}
	if err != nil {
		_ = c.Close(context.Background())
		return err
	}
	vc.conn = c
	return nil
}

// vacuumStatement is the VACUUM for a server of the given version (server_version_num).
// SKIP_LOCKED (PostgreSQL 12) skips a table autovacuum is vacuuming or analyzing instead of
// waiting for it; TRUNCATE false (12) leaves the empty pages a COPY extended the table by;
// SKIP_DATABASE_STATS (16) skips the scan of pg_class for the database's oldest transaction
// id, which a vacuum of one table every fraction of a second need not repeat (autovacuum
// does it).
func vacuumStatement(version int) (string, error) {
	switch {
	case version >= 160000:
		return "VACUUM (SKIP_LOCKED, TRUNCATE false, SKIP_DATABASE_STATS) steps", nil
	case version >= 120000:
		return "VACUUM (SKIP_LOCKED, TRUNCATE false) steps", nil
	}
	return "", fmt.Errorf("%w: the server (server_version_num %d) has no VACUUM (SKIP_LOCKED), which PostgreSQL 12 and later have", errNoVacuum, version)
}

// mayVacuumQuery asks whether the session's role may vacuum the steps table: on PostgreSQL 17
// and later, if it holds MAINTAIN on it (its owner does, as do pg_maintain and superusers) or
// owns the database; before, if it owns either (superusers pass pg_has_role).
func mayVacuumQuery(version int) string {
	owns := "pg_has_role((SELECT datdba FROM pg_database WHERE datname = current_database()), 'USAGE')"
	if version >= 170000 {
		return "SELECT has_table_privilege('steps', 'MAINTAIN') OR " + owns
	}
	return "SELECT pg_has_role((SELECT relowner FROM pg_class WHERE oid = 'steps'::regclass), 'USAGE') OR " + owns
}
