package ledger

import (
	"context"
	"errors"
	"fmt"
	"strconv"
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
// reads it back from disk, dirties it and writes it again (BenchmarkWriterSteps, a vacuum of
// 600,000 rows alongside as many new ones: 5.3 s, 200,064 pages read and dirtied, Postgres
// 26.75 µs of CPU per step against 17 without it).
//
// A COPY leaves the pages it fills in a ring of shared buffers (16 MB per backend) until the
// ring comes round to them. Vacuumed while they are still there, they are neither read nor
// dirtied again: the vacuum sets their bits before they are first written. So the writer
// vacuums the steps table itself, after every Config.VacuumSteps steps it delivers, on a
// connection of its own, and freezes as it goes, so that the anti-wraparound vacuum finds the
// pages all-frozen and skips them. Every 10,000 steps, each vacuum read and dirtied almost
// none of its 3,000–4,000 pages and took 10–20 ms of CPU; every 100,000 it read and dirtied
// them all (VACUUM VERBOSE in the benchmark).
//
// A vacuum marks and freezes only rows every snapshot sees. The delivery's own transactions
// hold that back a little: their COPYs' snapshots are as old as the oldest batch then in
// flight, so the last batches committed wait for a later vacuum (under saturation, up to a few
// times Conns×BatchRows steps). A long transaction elsewhere (an export, a psql session left
// open) holds it back for as long as it runs, and each vacuum would then scan again all the
// pages since it began. So after each vacuum the writer reads how many pages are all-visible
// (pg_class.relallvisible, which the vacuum just set): when that has not grown over vacuums
// spanning more than four times the larger of VacuumSteps and Conns×BatchRows steps, it waits
// before trying again (1 s, doubling up to a minute) instead of vacuuming every VacuumSteps,
// until a vacuum gains pages again. It does not wait otherwise: a vacuum that found its pages
// gone from the shared buffers (after a checkpoint, say) reads them back at about twice the
// rate steps arrive, so the next vacuums, taken back to back, catch up, where waiting in
// proportion to the time taken (tried first) let the pages between vacuums grow without end.

// defaultVacuumSteps is Config.VacuumSteps's default: BenchmarkWriterSteps with a vacuum every
// 10,000 steps read and dirtied almost no page again, every 50,000 about a third of them.
const defaultVacuumSteps = 10_000

// vacuumConn is the writer's vacuum connection and the notices its last statement received.
type vacuumConn struct {
	conn    *pgx.Conn
	notices []*pgconn.Notice
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
	defer close(w.vacuumDone)
	vc := &vacuumConn{}
	defer vc.close()
	every := uint64(w.cfg.VacuumSteps)
	// patience is how many steps may pass without a vacuum gaining pages before it waits.
	patience := 4 * max(every, uint64(w.cfg.Conns*w.cfg.BatchRows))
	// at is the steps delivered when the last vacuum started; gainedAt, when the last one that
	// gained pages did. No vacuum starts before next.
	var at, gainedAt uint64
	var next time.Time
	var last relVisibility
	backoff := time.Second // after a failure or a vacuum held back
	for {
		select {
		case <-ctx.Done():
			return
		case <-w.vacuumKick:
		}
		if w.stepsDelivered.Load() < at+every {
			continue
		}
		if !sleepCtx(ctx, time.Until(next)) {
			return
		}
		at = w.stepsDelivered.Load()
		vis, err := w.vacuum(ctx, vc)
		switch {
		case ctx.Err() != nil:
			return
		case errors.Is(err, errNoVacuum):
			w.cfg.Logger.Warn("ledger: the writer does not vacuum the steps table; autovacuum will", "err", err)
			return
		case err != nil:
			w.cfg.Logger.Warn("ledger: vacuuming the steps table", "err", err, "retry_in", backoff)
			vc.close()
		default:
			w.vacuums.Add(1)
			if vis.visible > last.visible || vis.pages <= last.pages {
				gainedAt = at
			}
			last = vis
			if at-gainedAt <= patience {
				backoff, next = time.Second, time.Time{}
				continue
			}
			w.cfg.Logger.Debug("ledger: an older snapshot holds the steps' vacuum back", "steps", at-gainedAt, "retry_in", backoff)
		}
		next = time.Now().Add(backoff)
		backoff = min(2*backoff, time.Minute)
	}
}

// relVisibility is a table's size in pages and how many of them are all-visible, as its last
// vacuum left them in pg_class.
type relVisibility struct{ pages, visible int64 }

// errNoVacuum means the writer cannot vacuum the steps table at all (not its owner, a server
// too old).
var errNoVacuum = errors.New("cannot vacuum")

// vacuum runs one VACUUM of the steps table on vc, connecting it first if need be, and reads
// what it left.
func (w *Writer) vacuum(ctx context.Context, vc *vacuumConn) (relVisibility, error) {
	var vis relVisibility
	if vc.conn == nil {
		cfg, err := pgx.ParseConfig(w.cfg.URL)
		if err != nil {
			return vis, fmt.Errorf("parsing ledger URL: %w", err)
		}
		cfg.OnNotice = func(_ *pgconn.PgConn, n *pgconn.Notice) {
			// A vacuum or analyze of the table already running (autovacuum's) holds the lock
			// SKIP_LOCKED skips on: this one is not needed then.
			if n.Code != "55P03" {
				vc.notices = append(vc.notices, n)
			}
		}
		cctx, cancel := context.WithTimeout(ctx, 10*time.Second)
		c, err := pgx.ConnectConfig(cctx, cfg)
		cancel()
		if err != nil {
			return vis, fmt.Errorf("connecting to ledger database: %w", err)
		}
		vc.conn = c
	}
	q, err := vacuumStatement(vc.conn.PgConn().ParameterStatus("server_version"))
	if err != nil {
		return vis, err
	}
	vc.notices = vc.notices[:0]
	if _, err := vc.conn.Exec(ctx, q); err != nil {
		return vis, err
	}
	// A vacuum it may not run is a warning, not an error: "permission denied to vacuum
	// "steps", skipping it" when another role owns the table.
	for _, n := range vc.notices {
		if strings.Contains(n.Message, "permission denied") {
			return vis, fmt.Errorf("%w: %s (its owner can)", errNoVacuum, n.Message)
		}
		w.cfg.Logger.Warn("ledger: vacuuming the steps table", "notice", n.Message)
	}
	err = vc.conn.QueryRow(ctx, "SELECT relpages, relallvisible FROM pg_class WHERE oid = 'steps'::regclass").
		Scan(&vis.pages, &vis.visible)
	return vis, err
}

// vacuumStatement is the VACUUM for a server of the given version (its server_version
// parameter, "17.6 (Debian …)"). SKIP_LOCKED (PostgreSQL 12) skips a table autovacuum is
// vacuuming or analyzing instead of waiting for it; SKIP_DATABASE_STATS (16) skips the scan
// of pg_class for the database's oldest transaction id, which a vacuum of one table every
// fraction of a second need not repeat (autovacuum does it).
func vacuumStatement(version string) (string, error) {
	major, err := strconv.Atoi(strings.SplitN(strings.SplitN(version, " ", 2)[0], ".", 2)[0])
	if err != nil {
		return "", fmt.Errorf("%w: reading the server's version %q: %w", errNoVacuum, version, err)
	}
	switch {
	case major >= 16:
		return "VACUUM (FREEZE, SKIP_LOCKED, SKIP_DATABASE_STATS) steps", nil
	case major >= 12:
		return "VACUUM (FREEZE, SKIP_LOCKED) steps", nil
	}
	return "", fmt.Errorf("%w: PostgreSQL %d has no VACUUM (SKIP_LOCKED), which 12 and later have", errNoVacuum, major)
}
