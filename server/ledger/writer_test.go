package ledger_test

import (
	"bytes"
	"context"
	"crypto/sha256"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"runtime"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/deltagym/deltagym/server/ledger"
	"github.com/deltagym/deltagym/server/ledger/pgtest"
)

func stepRow(ep string, i int) ledger.StepRow {
	return ledger.StepRow{
		EpisodeID:   ep,
		Index:       i,
		Action:      json.RawMessage(fmt.Sprintf(`{"cmd":"echo %d"}`, i)),
		Observation: []byte(fmt.Sprintf("out %s %d", ep, i)),
		Reward:      float64(i) / 10,
		Duration:    time.Duration(i) * time.Microsecond,
	}
}

func TestWriterCountsMatch(t *testing.T) {
	t.Parallel()
	b := setup(t, nil)
	const episodes, steps = 100, 100
	for e := range episodes {
		ep := fmt.Sprintf("ep-%03d", e)
		must(t, b.w.EpisodeStarted(ledger.EpisodeStart{ID: ep, Env: "env", Run: "r", Group: fmt.Sprintf("g%d", e%10), StartedAt: b.at(e)}))
		for i := range steps {
			must(t, b.w.Step(stepRow(ep, i)))
		}
		must(t, b.w.Reward(ledger.RewardRow{EpisodeID: ep, Source: ledger.SourceVerifier, Value: 1}))
		must(t, b.w.EpisodeEnded(ledger.EpisodeEnd{ID: ep, Status: ledger.StatusTerminated, TotalReward: 1}))
	}
	must(t, b.w.Flush(t.Context()))
	if n := count(t, b.url, "SELECT count(*) FROM steps"); n != episodes*steps {
		t.Fatalf("steps stored = %d, want %d", n, episodes*steps)
	}
	if n := count(t, b.url, "SELECT count(*) FROM episodes WHERE status = 'terminated' AND ended_at IS NOT NULL"); n != episodes {
		t.Fatalf("terminated episodes = %d, want %d", n, episodes)
	}
	if n := count(t, b.url, "SELECT count(*) FROM rewards"); n != episodes {
		t.Fatalf("rewards = %d, want %d", n, episodes)
	}
	if n := count(t, b.url, "SELECT count(*) FROM runs"); n != 1 {
		t.Fatalf("runs = %d, want 1", n)
	}
	st := b.w.Stats()
	if st.Delivered != st.Appended || st.Appended != episodes*(steps+3) {
		t.Fatalf("stats %+v: want %d appended and delivered", st, episodes*(steps+3))
	}
}

func TestObservationCap(t *testing.T) {
	t.Parallel()
	b := setup(t, func(c *ledger.Config) { c.ObservationCap = 1000 })
	must(t, b.w.EpisodeStarted(ledger.EpisodeStart{ID: "e", Env: "env"}))
	obs := bytes.Repeat([]byte("0123456789"), 500)
	r := stepRow("e", 0)
	r.Observation = obs
	must(t, b.w.Step(r))
	tr, err := b.store.Trajectory(t.Context(), "e")
	must(t, err)
	got := tr.Steps[0]
	sum := sha256.Sum256(obs)
	if len(got.Observation) != 1000 || got.ObservationSize != 5000 || !bytes.Equal(got.ObservationSHA256, sum[:]) {
		t.Fatalf("stored obs len %d size %d sha %x; want 1000, 5000, %x", len(got.Observation), got.ObservationSize, got.ObservationSHA256, sum)
	}
}

func TestInvalidRows(t *testing.T) {
	t.Parallel()
	b := setup(t, nil)
	cases := []struct {
		name string
		err  error
	}{
		{"action not JSON", b.w.Step(ledger.StepRow{EpisodeID: "e", Action: json.RawMessage("{")})},
		// An action past the cap would make a frame the spool's recovery calls corrupt.
		{"action over the cap", b.w.Step(ledger.StepRow{EpisodeID: "e", ActionValid: true,
			Action: json.RawMessage(`"` + strings.Repeat("a", ledger.MaxActionBytes) + `"`)})},
		{"step without episode", b.w.Step(ledger.StepRow{})},
		{"end status running", b.w.EpisodeEnded(ledger.EpisodeEnd{ID: "e", Status: ledger.StatusRunning})},
		{"end status unknown", b.w.EpisodeEnded(ledger.EpisodeEnd{ID: "e", Status: "exploded"})},
		{"failure class unknown", b.w.EpisodeEnded(ledger.EpisodeEnd{ID: "e", Status: ledger.StatusFailed, FailureClass: "cosmic"})},
		{"checkpoint kind unknown", b.w.Checkpoint(ledger.CheckpointRow{ID: "c", Env: "env", Kind: "other"})},
		{"reward without source", b.w.Reward(ledger.RewardRow{EpisodeID: "e"})},
		{"episode without env", b.w.EpisodeStarted(ledger.EpisodeStart{ID: "e"})},
		{"report reward unknown episode", b.store.ReportReward(t.Context(), ledger.RewardRow{EpisodeID: "nope", Source: "trainer"})},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			if !errors.Is(c.err, ledger.ErrInvalid) && !errors.Is(c.err, ledger.ErrNotFound) {
				t.Fatalf("err = %v, want ErrInvalid or ErrNotFound", c.err)
			}
		})
	}
	if st := b.w.Stats(); st.Appended != 0 {
		t.Fatalf("invalid rows were appended: %+v", st)
	}
}

func TestCloseTwiceAndAppendAfterClose(t *testing.T) {
	t.Parallel()
	b := setup(t, nil)
	must(t, b.w.EpisodeStarted(ledger.EpisodeStart{ID: "e", Env: "env"}))
	must(t, b.w.Close(t.Context()))
	must(t, b.w.Close(t.Context()))
	if err := b.w.Step(stepRow("e", 0)); !errors.Is(err, ledger.ErrClosed) {
		t.Fatalf("Step after Close = %v, want ErrClosed", err)
	}
	if n := count(t, b.url, "SELECT count(*) FROM episodes"); n != 1 {
		t.Fatalf("Close did not deliver: %d episodes", n)
	}
	w2, err := ledger.NewWriter(ledger.Config{URL: b.url, SpoolDir: b.spool, Logger: quiet})
	if err != nil {
		t.Fatalf("reopening a closed spool: %v", err)
	}
	must(t, w2.Close(t.Context()))
}

func TestSpoolLocked(t *testing.T) {
	t.Parallel()
	b := setup(t, nil)
	if _, err := ledger.NewWriter(ledger.Config{URL: b.url, SpoolDir: b.spool, Logger: quiet}); !errors.Is(err, ledger.ErrSpoolLocked) {
		t.Fatalf("second writer on a spool = %v, want ErrSpoolLocked", err)
	}
}

// Postgres stops in the middle of a stream of writes and comes back: nothing is lost, nothing
// duplicated, and appends never wait for it.
func TestPostgresOutage(t *testing.T) {
	t.Parallel()
	srv, url := pgtest.Private(t)
	b := setupURL(t, url, func(c *ledger.Config) {
		c.QueueRows = 500 // small, so the outage overflows it and rows come back from disk
		c.SegmentBytes = 256 << 10
	})
	const total = 30_000
	// The appender streams rows throughout; it waits only at 12,000 until Postgres is down (so
	// rows 12,000-20,000 are appended during the outage) and at 20,000 until it is back.
	reached := map[int]chan struct{}{3_000: make(chan struct{}), 12_000: make(chan struct{}), 20_000: make(chan struct{})}
	stopped, resume := make(chan struct{}), make(chan struct{})
	var stopOnce, resumeOnce sync.Once
	releaseStopped := func() { stopOnce.Do(func() { close(stopped) }) }
	releaseResume := func() { resumeOnce.Do(func() { close(resume) }) }
	defer releaseResume() // a failing test must not strand the appender
	defer releaseStopped()
	appendDone := make(chan time.Duration, 1)
	go func() {
		var slowest time.Duration
		ep := ""
		for i := range total {
			if i%100 == 0 {
				ep = fmt.Sprintf("ep-%d", i/100)
				_ = b.w.EpisodeStarted(ledger.EpisodeStart{ID: ep, Env: "env", Run: "outage", StartedAt: b.at(i)})
			}
			start := time.Now()
			_ = b.w.Step(stepRow(ep, i%100))
			if i%100 == 99 {
				_ = b.w.Reward(ledger.RewardRow{EpisodeID: ep, Source: ledger.SourceVerifier, Value: 1})
				_ = b.w.EpisodeEnded(ledger.EpisodeEnd{ID: ep, Status: ledger.StatusTruncated})
			}
			slowest = max(slowest, time.Since(start))
			if ch, ok := reached[i]; ok {
				close(ch)
				switch i {
				case 12_000:
					<-stopped
				case 20_000:
					<-resume
				}
			}
		}
		appendDone <- slowest
	}()

	<-reached[3_000]
	must(t, b.w.Flush(t.Context())) // some rows are in Postgres before the outage
	before := b.w.Stats().Delivered
	stopStart := time.Now()
	must(t, srv.Stop(t.Context())) // while rows keep coming
	releaseStopped()
	<-reached[20_000]
	ctx, cancel := context.WithTimeout(t.Context(), 200*time.Millisecond)
	if err := b.w.Flush(ctx); !errors.Is(err, ledger.ErrUndelivered) {
		t.Fatalf("Flush during the outage = %v, want ErrUndelivered", err)
	}
	cancel()
	must(t, srv.StartAgain(t.Context()))
	t.Logf("postgres down for %v", time.Since(stopStart))
	releaseResume()
	slowest := <-appendDone
	ctx, cancel = context.WithTimeout(t.Context(), time.Minute)
	defer cancel()
	must(t, b.w.Close(ctx))

	st := b.w.Stats()
	t.Logf("stats %+v; delivered %d before the outage; slowest append %v", st, before, slowest)
	if st.Retries == 0 || st.Spooled == 0 {
		t.Fatalf("the outage was not felt: %+v", st)
	}
	if n := count(t, url, "SELECT count(*) FROM steps"); n != total {
		t.Fatalf("steps = %d, want %d", n, total)
	}
	if n := count(t, url, "SELECT count(*) FROM rewards"); n != total/100 {
		t.Fatalf("rewards = %d, want %d (a duplicate or a loss)", n, total/100)
	}
	if n := count(t, url, "SELECT count(*) FROM episodes WHERE status = 'truncated'"); n != total/100 {
		t.Fatalf("ended episodes = %d, want %d", n, total/100)
	}
	segs, _ := filepath.Glob(filepath.Join(b.spool, "*.seg"))
	if len(segs) > 1 {
		t.Fatalf("delivered spool segments not trimmed: %d left", len(segs))
	}
	if slowest > 250*time.Millisecond { // generous for a loaded 2-core machine; the outage is longer
		t.Errorf("an append took %v during the outage; appends must not wait for Postgres", slowest)
	}
}

// The postmaster of a supervised cluster (as the server runs its own) is killed outright in the
// middle of a stream of writes, and its backends with it (killed alone, it can leave backends
// that finish the whole stream before they see it gone, and the writer never feels the kill):
// the cluster is started again, recovers, and every row is delivered once.
func TestPostgresKilled(t *testing.T) {
	t.Parallel()
	srv, url := pgtest.Supervised(t)
	b := setupURL(t, url, func(c *ledger.Config) { c.QueueRows = 500 })
	const total = 20_000
	killAt := make(chan struct{})
	killed := make(chan struct{})
	appended := make(chan struct{})
	go func() {
		defer close(appended)
		ep := ""
		for i := range total {
			if i%100 == 0 {
				ep = fmt.Sprintf("ep-%d", i/100)
				_ = b.w.EpisodeStarted(ledger.EpisodeStart{ID: ep, Env: "env", Run: "killed", StartedAt: b.at(i)})
			}
			_ = b.w.Step(stepRow(ep, i%100))
			if i%100 == 99 {
				_ = b.w.EpisodeEnded(ledger.EpisodeEnd{ID: ep, Status: ledger.StatusTruncated})
			}
			if i == 5_000 {
				// The rest is appended once Postgres is killed, so that
				// its delivery meets the kill.
				close(killAt)
				<-killed
			}
		}
	}()
	<-killAt
	must(t, b.w.Flush(t.Context())) // some rows are in Postgres before the kill
	pid := srv.Pid()
	if pid == 0 {
		t.Fatal("no postmaster")
	}
	// The postmaster leads its process group (pgserver starts it with Setpgid): killing the
	// group ends it and every backend at once, so no backend started meanwhile goes on serving.
	must(t, syscall.Kill(-pid, syscall.SIGKILL))
	close(killed)
	<-appended
	ctx, cancel := context.WithTimeout(t.Context(), 2*time.Minute)
	defer cancel()
	must(t, b.w.Flush(ctx))
	st := b.w.Stats()
	// The supervisor counts its restart once the new postmaster is ready,
	// which the writer may have found first.
	for deadline := time.Now().Add(time.Minute); srv.Restarts() == 0 && time.Now().Before(deadline); {
		time.Sleep(10 * time.Millisecond)
	}
	t.Logf("stats %+v; postgres restarts %d", st, srv.Restarts())
	if srv.Restarts() != 1 || srv.Pid() == pid || srv.Pid() == 0 {
		t.Fatalf("postmaster %d killed: %d restarts, now pid %d; want it started again once", pid, srv.Restarts(), srv.Pid())
	}
	if st.Retries == 0 {
		t.Fatalf("the kill was not felt: %+v", st)
	}
	if n := count(t, url, "SELECT count(*) FROM steps"); n != total {
		t.Fatalf("steps = %d, want %d", n, total)
	}
	if n := count(t, url, "SELECT count(*) FROM episodes WHERE status = 'truncated'"); n != total/100 {
		t.Fatalf("ended episodes = %d, want %d", n, total/100)
	}
}

// The test clusters run with synchronous_commit off (pgserver's NoSync); the store's own
// connections turn it on, so that a reward ReportReward acknowledged survives a Postgres crash.
func TestStoreCommitsSynchronously(t *testing.T) {
	t.Parallel()
	b := setup(t, nil)
	if def := count(t, b.url, "SELECT (current_setting('synchronous_commit') = 'off')::int"); def != 1 {
		t.Skip("the test cluster does not run with synchronous_commit off")
	}
	v, err := b.store.Setting(t.Context(), "synchronous_commit")
	must(t, err)
	if v != "on" {
		t.Fatalf("synchronous_commit = %s on the store's connections, want on", v)
	}
}

// A writer closed while Postgres is down keeps its rows in the spool; the next writer on the
// same directory delivers them.
func TestSpoolSurvivesWriterRestart(t *testing.T) {
	t.Parallel()
	srv, url := pgtest.Private(t)
	spool := t.TempDir()
	must(t, srv.Stop(t.Context()))
	w, err := ledger.NewWriter(ledger.Config{URL: url, SpoolDir: spool, Logger: quiet})
	must(t, err)
	must(t, w.EpisodeStarted(ledger.EpisodeStart{ID: "e", Env: "env"}))
	for i := range 500 {
		must(t, w.Step(stepRow("e", i)))
	}
	ctx, cancel := context.WithTimeout(t.Context(), 100*time.Millisecond)
	defer cancel()
	if err := w.Close(ctx); !errors.Is(err, ledger.ErrUndelivered) {
		t.Fatalf("Close with Postgres down = %v, want ErrUndelivered", err)
	}
	must(t, srv.StartAgain(t.Context()))
	w2, err := ledger.NewWriter(ledger.Config{URL: url, SpoolDir: spool, Logger: quiet})
	must(t, err)
	must(t, w2.Close(t.Context()))
	if n := count(t, url, "SELECT count(*) FROM steps"); n != 500 {
		t.Fatalf("steps = %d, want 500", n)
	}
	// A third writer knows from the closed spool that everything was delivered, and goes on.
	w3, err := ledger.NewWriter(ledger.Config{URL: url, SpoolDir: spool, Logger: quiet})
	must(t, err)
	if st := w3.Stats(); st.Delivered != 501 || st.Appended != 501 {
		t.Fatalf("reopened spool stats %+v, want 501 appended and delivered", st)
	}
	must(t, w3.Step(stepRow("e", 500)))
	must(t, w3.Close(t.Context()))
	if n := count(t, url, "SELECT count(*) FROM steps"); n != 501 {
		t.Fatalf("steps = %d, want 501", n)
	}
	if _, err := os.Stat(filepath.Join(spool, "id")); err != nil {
		t.Fatal(err)
	}
}

// Close stops every goroutine the writer started (not parallel: counts the process's goroutines).
func TestWriterCloseLeaksNoGoroutine(t *testing.T) {
	url := pgtest.Start(t)
	before := runtime.NumGoroutine()
	w, err := ledger.NewWriter(ledger.Config{URL: url, SpoolDir: t.TempDir(), Logger: quiet})
	must(t, err)
	must(t, w.EpisodeStarted(ledger.EpisodeStart{ID: "e", Env: "env"}))
	must(t, w.Flush(t.Context()))
	must(t, w.Close(t.Context()))
	// Like goleak: allow goroutines that are already on their way out (context.AfterFunc
	// callbacks fired by the cancellation) a moment to finish.
	deadline := time.Now().Add(2 * time.Second)
	for delay := time.Microsecond; runtime.NumGoroutine() > before; delay *= 2 {
		if time.Now().After(deadline) {
			buf := make([]byte, 1<<16)
			t.Fatalf("%d goroutines before, %d after Close:\n%s", before, runtime.NumGoroutine(), buf[:runtime.Stack(buf, true)])
		}
		time.Sleep(min(delay, 10*time.Millisecond))
	}
}

// The episodes still running in sandboxes that ended with a crashed server end failed (infra);
// others, and those that had ended, keep their status.
func TestSandboxesEnded(t *testing.T) {
	t.Parallel()
	b := setup(t, nil)
	for i, e := range []struct{ id, sandbox string }{{"a", "sb-1"}, {"b", "sb-2"}, {"c", "sb-1"}, {"d", ""}} {
		must(t, b.w.EpisodeStarted(ledger.EpisodeStart{ID: e.id, Env: "env", Sandbox: e.sandbox, StartedAt: b.at(i)}))
	}
	must(t, b.w.EpisodeEnded(ledger.EpisodeEnd{ID: "c", Status: ledger.StatusTerminated, TotalReward: 1, EndedAt: b.at(5)}))
	must(t, b.w.EpisodeStarted(ledger.EpisodeStart{ID: "f", Env: "env", Sandbox: "sb-1", StartedAt: b.at(6)}))
	must(t, b.w.EpisodeEnded(ledger.EpisodeEnd{ID: "f", Status: ledger.StatusFailed, FailureClass: ledger.FailureVerifier,
		FailureMessage: "the verifier failed: exit status 2", EndedAt: b.at(7)}))
	must(t, b.w.SandboxesEnded(nil, time.Time{})) // nothing to record
	must(t, b.w.SandboxesEnded([]string{"sb-1", "sb-3"}, b.at(10)))
	want := map[string]ledger.Status{"a": ledger.StatusFailed, "b": ledger.StatusRunning, "c": ledger.StatusTerminated, "d": ledger.StatusRunning}
	for id, status := range want {
		e, err := b.store.Episode(t.Context(), id)
		must(t, err)
		if e.Status != status {
			t.Errorf("episode %s: %s, want %s", id, e.Status, status)
		}
	}
	a, err := b.store.Episode(t.Context(), "a")
	must(t, err)
	if a.FailureClass != ledger.FailureInfra || a.EndedAt == nil || !a.EndedAt.Equal(b.at(10)) || a.Sandbox != "sb-1" {
		t.Errorf("episode a: %+v, want failed (infra) at %v in sb-1", a, b.at(10))
	}
	if !strings.Contains(a.FailureMessage, "server ended") {
		t.Errorf("episode a: failure message %q", a.FailureMessage)
	}
	// An episode that had ended keeps its own status and message.
	f, err := b.store.Episode(t.Context(), "f")
	must(t, err)
	if f.Status != ledger.StatusFailed || f.FailureClass != ledger.FailureVerifier || f.FailureMessage != "the verifier failed: exit status 2" {
		t.Errorf("episode f: %+v", f)
	}
	if st := b.w.Stats(); st.Appended != 8 || st.Delivered != 8 {
		t.Errorf("stats %+v: want 8 records appended and delivered", st)
	}
}

// A writer that read a burst back from its spool and caught up lets go of the reader's slabs
// while it waits, with no row from memory to prompt it.
func TestCaughtUpWriterDropsSlabs(t *testing.T) {
	t.Parallel()
	b := setup(t, func(c *ledger.Config) { c.QueueRows = 100 })
	must(t, b.w.EpisodeStarted(ledger.EpisodeStart{ID: "ep", Env: "env"}))
	obs := bytes.Repeat([]byte("0123456789abcdef"), 250) // 4,000 bytes: 20 MB, several slabs
	for i := range 5000 {
		r := stepRow("ep", i)
		r.Observation = obs
		must(t, b.w.Step(r))
	}
	must(t, b.w.Flush(t.Context()))
	if b.w.Stats().Spooled == 0 {
		t.Fatal("no row was read back from the spool: the test needs an overflow")
	}
	deadline := time.Now().Add(10 * time.Second)
	for b.w.ReaderSlabs() > 0 {
		if time.Now().After(deadline) {
			t.Fatalf("the idle writer still keeps %d slabs", b.w.ReaderSlabs())
		}
		time.Sleep(10 * time.Millisecond)
	}
}

// Close returns nil when the deliverer delivered the last rows just as it ended: the ending and
// the rows' delivery then wake Close together, and it must not take the first for rows left
// over ("flushing ledger: 1 rows: rows left undelivered"). Close is held before it waits until
// both have happened, as when its goroutine is not running then.
func TestCloseRightAfterLastDelivery(t *testing.T) {
	t.Parallel()
	url := pgtest.Start(t)
	held := 0
	for i := range 20 {
		w, err := ledger.NewWriter(ledger.Config{URL: url, SpoolDir: t.TempDir(), Logger: quiet})
		must(t, err)
		w.SetBeforeWait(func() {
			held++
			deadline := time.Now().Add(10 * time.Second)
			for w.Stats().Delivered < w.Stats().Appended && time.Now().Before(deadline) {
				time.Sleep(time.Millisecond)
			}
			time.Sleep(20 * time.Millisecond) // the deliverer ends once it has delivered all
		})
		must(t, w.EpisodeStarted(ledger.EpisodeStart{ID: fmt.Sprintf("close-%d", i), Env: "env"}))
		if err := w.Close(t.Context()); err != nil {
			t.Fatalf("close %d: %v", i, err)
		}
	}
	if held < 10 {
		t.Fatalf("Close waited for the deliveries %d times in 20, too few to test the race", held)
	}
}
