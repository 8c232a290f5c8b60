package ledger

import (
	"context"
	"time"
)

// Buffered returns the bytes of rows waiting for the next group commit. It drops when the syncer
// takes the window for a spool write, which is how TestSIGKILLLosesAtMostOneWindow sees when
// the write+fsync in flight at the kill began.
func (w *Writer) Buffered() int {
	w.mu.Lock()
	defer w.mu.Unlock()
	return w.pending
}

// Setting returns a server setting as one of the store's connections sees it.
func (s *Store) Setting(ctx context.Context, name string) (string, error) {
	var v string
	err := s.pool.QueryRow(ctx, "SELECT current_setting($1)", name).Scan(&v)
	return v, err
}

// SetDirectSpool turns the spool's O_DIRECT writes on or off (directIO), for comparisons.
func SetDirectSpool(on bool) { directIO = on }

// SetSlabReuse turns the spool reader's slab reuse on or off (to compare).
func SetSlabReuse(on bool) { reuseSlabs = on }

// ReaderSlabs returns how many retired and spare slabs the spool's reader keeps.
func (w *Writer) ReaderSlabs() int { return int(w.sp.slabsKept.Load()) }

// SetVacuumBackoff sets c's first and longest wait after a failed or held-back vacuum.
func SetVacuumBackoff(c *Config, first, longest time.Duration) {
	c.vacuumBackoff, c.vacuumBackoffMax = first, longest
}

// VacuumStatement is vacuumStatement, for a server_version_num.
func VacuumStatement(version int) (string, error) { return vacuumStatement(version) }

// SetBeforeWait makes Flush and Close call f each time before they wait for deliveries. Set it
// before the first of those.
func (w *Writer) SetBeforeWait(f func()) { w.beforeWait = f }

// EncodeToken is ListEpisodes's page token for the episode id started at at.
var EncodeToken = encodeToken
