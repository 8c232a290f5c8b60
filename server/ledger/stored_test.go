package ledger

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"os"
	"path/filepath"
	"sync"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/deltagym/deltagym/internal/errdefs"
)

// A failed fsync takes the segment back to the last one that succeeded, rows written without
// an fsync since included: the writer writes them all again, and a reopened spool finds every
// row once, in order. Direct and through the page cache.
func TestSpoolFailedSyncDropsUnsyncedRows(t *testing.T) {
	for _, direct := range []bool{true, false} {
		t.Run(map[bool]string{true: "direct", false: "buffered"}[direct], func(t *testing.T) {
			dir := t.TempDir()
			if direct && !takesDirect(t, dir) {
				t.Skipf("%s refuses O_DIRECT", dir)
			}
			directIO = direct
			t.Cleanup(func() { directIO = true })
			sp, _, _, err := openSpool(dir, 64<<20)
			if err != nil {
				t.Fatal(err)
			}
			defer func() { _ = sp.close() }()
			if _, err := sp.write(frames(1, 3, 100), 3, true); err != nil {
				t.Fatal(err)
			}
			synced := sp.activeSize
			if _, err := sp.write(frames(4, 40, 300), 40, false); err != nil { // written, not synced
				t.Fatal(err)
			}
			if sp.activeSize == synced {
				t.Fatal("the unsynced write wrote nothing")
			}
			if recs, err := sp.read(1, 40, 1000, 1<<30); len(recs) != 3 || err == nil {
				t.Fatalf("the reader took %d rows (%v); want the 3 synced ones and no further", len(recs), err)
			}
			failNth(t, &fdatasync, 1, func(orig func(int) error, fail func() bool) func(int) error {
				return func(fd int) error {
					if fail() {
						return unix.EIO
					}
					return orig(fd)
				}
			})
			if dropped, err := sp.write(frames(41, 50, 300), 50, true); !errors.Is(err, unix.EIO) || !dropped {
				t.Fatalf("a write whose fsync fails: %v (dropped %v), want EIO, the unsynced rows dropped", err, dropped)
			}
			if fi, _ := os.Stat(filepath.Join(dir, segName(1))); sp.activeSize != synced || fi.Size() != synced {
				t.Fatalf("after the failed fsync: activeSize %d, file %d bytes; want the last fsync's %d", sp.activeSize, fi.Size(), synced)
			}
			if _, err := sp.write(frames(4, 50, 300), 50, true); err != nil {
				t.Fatal(err)
			}
			_ = sp.close()
			again, first, last, err := openSpool(dir, 64<<20)
			if err != nil || first != 1 || last != 50 {
				t.Fatalf("reopened: [%d, %d], %v; want [1, 50]", first, last, err)
			}
			defer func() { _ = again.close() }()
			recs, err := again.read(1, 50, 1000, 1<<30)
			if err != nil || len(recs) != 50 {
				t.Fatalf("read %d records after reopening: %v", len(recs), err)
			}
			checkRecords(t, recs, 1)
		})
	}
}

// storedWriter is a writer whose group-commit window never ends within a test: only Stored
// (or Close) has its rows written. Its Postgres is unreachable: Stored never waits for it.
func storedWriter(t *testing.T, fsync bool) (*Writer, string) {
	t.Helper()
	dir := t.TempDir()
	w, err := NewWriter(Config{URL: "postgres://deltagym@127.0.0.1:1/none?connect_timeout=1", SpoolDir: dir, GroupCommit: time.Hour,
		Sync: fsync, Logger: slog.New(slog.NewTextHandler(io.Discard, nil))})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = w.Close(t.Context()) })
	return w, dir
}

func storedStep(t *testing.T, w *Writer, i int) {
	t.Helper()
	if err := w.Step(StepRow{EpisodeID: "ep", Index: i, Action: json.RawMessage(`"a"`), Observation: []byte("obs")}); err != nil {
		t.Fatal(err)
	}
}

// Stored has the rows appended before it written to the spool file at once, not at the end
// of the window, without waiting for Postgres (down here); with Config.Sync it waits for their
// fsync too. Concurrent callers each get their rows stored.
func TestStoredWritesAtOnce(t *testing.T) {
	for _, fsync := range []bool{false, true} {
		t.Run(map[bool]string{false: "write", true: "sync"}[fsync], func(t *testing.T) {
			w, _ := storedWriter(t, fsync)
			storedStep(t, w, 0)
			if st := w.Stats(); st.Written == st.Appended {
				t.Fatalf("row %d written before the window ended or anyone waited for it", st.Appended)
			}
			if err := w.Stored(t.Context()); err != nil {
				t.Fatal(err)
			}
			st := w.Stats()
			if st.Written != st.Appended {
				t.Fatalf("Stored returned with rows up to %d written, %d appended", st.Written, st.Appended)
			}
			if fsync != (st.Synced == st.Appended) {
				t.Fatalf("sync=%v: Stored returned with rows up to %d fsynced, %d appended", fsync, st.Synced, st.Appended)
			}
			var wg sync.WaitGroup
			errs := make(chan error, 16)
			for i := 1; i <= 16; i++ {
				wg.Go(func() {
					storedStep(t, w, i)
					errs <- w.Stored(t.Context())
				})
			}
			wg.Wait()
			close(errs)
			for err := range errs {
				if err != nil {
					t.Fatal(err)
				}
			}
			if st := w.Stats(); st.Written != 17 || st.Appended != 17 {
				t.Fatalf("after 17 stored rows: %+v", st)
			}
		})
	}
}

// Stored fails when the spool write meant to hold its rows fails, as unavailable; the rows stay
// queued, and the next Stored writes them: the spool holds every row once, in order.
func TestStoredFailsWhenTheSpoolWriteFails(t *testing.T) {
	w, dir := storedWriter(t, false)
	storedStep(t, w, 0)
	if err := w.Stored(t.Context()); err != nil {
		t.Fatal(err)
	}
	if !w.sp.direct {
		t.Skip("the spool does not write with O_DIRECT here: the failure is injected into direct writes")
	}
	failNth(t, &pwrite, 1, func(orig func(int, []byte, int64) (int, error), fail func() bool) func(int, []byte, int64) (int, error) {
		return func(fd int, b []byte, off int64) (int, error) {
			if fail() {
				return 0, unix.ENOSPC
			}
			return orig(fd, b, off)
		}
	})
	storedStep(t, w, 1)
	err := w.Stored(t.Context())
	if !errors.Is(err, ErrSpoolWrite) || !errors.Is(err, errdefs.ErrUnavailable) || !errors.Is(err, unix.ENOSPC) {
		t.Fatalf("Stored over a failing write: %v, want ErrSpoolWrite (unavailable) with ENOSPC", err)
	}
	if st := w.Stats(); st.Written != 1 {
		t.Fatalf("after the failed write: %+v, want row 1 written and no other", st)
	}
	storedStep(t, w, 2)
	if err := w.Stored(t.Context()); err != nil {
		t.Fatal(err)
	}
	// Postgres is down: Close stores every row, and delivers none.
	ctx, cancel := context.WithCancel(t.Context())
	cancel()
	if err := w.Close(ctx); !errors.Is(err, ErrUndelivered) {
		t.Fatalf("closing with Postgres down: %v, want ErrUndelivered", err)
	}
	sp, first, last, err := openSpool(dir, 64<<20)
	if err != nil || first > 1 || last != 3 {
		t.Fatalf("the spool after: [%d, %d], %v; want rows 1 to 3", first, last, err)
	}
	defer func() { _ = sp.close() }()
	recs, err := sp.read(1, 3, 10, 1<<20)
	if err != nil || len(recs) != 3 {
		t.Fatalf("read %d rows: %v", len(recs), err)
	}
	for i, r := range recs {
		if r.seq != uint64(i+1) || r.step.Index != i {
			t.Fatalf("row %d: seq %d, step %d", i, r.seq, r.step.Index)
		}
	}
}

// A steady stream of callers waiting for their rows, each write landing while the last fsync
// runs, still has the spool start a new segment each time one is full: none grows much past
// Config.SegmentBytes.
func TestStoredCallersRollSegmentsOver(t *testing.T) {
	dir := t.TempDir()
	const segBytes = 256 << 10
	w, err := NewWriter(Config{URL: "postgres://deltagym@127.0.0.1:1/none?connect_timeout=1", SpoolDir: dir, SegmentBytes: segBytes,
		Logger: slog.New(slog.NewTextHandler(io.Discard, nil))})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = w.Close(t.Context()) })
	obs := make([]byte, 4096)
	var wg sync.WaitGroup
	for c := range 8 {
		wg.Go(func() {
			for i := range 200 {
				if err := w.Step(StepRow{EpisodeID: fmt.Sprintf("ep%d", c), Index: i, Observation: obs}); err != nil {
					t.Error(err)
					return
				}
				if err := w.Stored(t.Context()); err != nil {
					t.Error(err)
					return
				}
			}
		})
	}
	wg.Wait()
	segs, err := filepath.Glob(filepath.Join(dir, "*.seg"))
	must(t, err)
	for _, p := range segs {
		fi, err := os.Stat(p)
		must(t, err)
		// A segment is full once past segBytes: the write that took it there is its last.
		if fi.Size() > 2*segBytes {
			t.Fatalf("segment %s holds %d bytes, SegmentBytes %d: %d segments for 6.5 MB of rows", filepath.Base(p), fi.Size(), segBytes, len(segs))
		}
	}
	if len(segs) < 10 {
		t.Fatalf("%d segments for 6.5 MB of rows in segments of %d bytes", len(segs), segBytes)
	}
}

func must(t *testing.T, err error) {
	t.Helper()
	if err != nil {
		t.Fatal(err)
	}
}
