package ledger_test

import (
	"bytes"
	"crypto/sha256"
	"encoding/json"
	"fmt"
	"testing"
	"time"

	"github.com/deltagym/deltagym/server/ledger"
)

// Tiny batches over three connections: many transactions overlap, and each batch's updates
// (episode ends, checkpoint releases) touch rows an older, concurrent batch inserted. Every row
// must land, every update must apply, and the mark must end at the last row.
func TestConcurrentBatchesCommitInOrder(t *testing.T) {
	t.Parallel()
	b := setup(t, func(c *ledger.Config) { c.Conns, c.BatchRows, c.DeliveryDelay = 3, 5, -1 })
	const episodes, steps = 60, 7
	for e := range episodes {
		ep := fmt.Sprintf("ep-%03d", e)
		must(t, b.w.EpisodeStarted(ledger.EpisodeStart{ID: ep, Env: "env", Run: fmt.Sprintf("run-%d", e%4), StartedAt: b.at(e)}))
		for i := range steps {
			must(t, b.w.Step(stepRow(ep, i)))
		}
		ck := "ck-" + ep
		must(t, b.w.Checkpoint(ledger.CheckpointRow{ID: ck, Kind: ledger.KindUser, Env: "env", EpisodeID: ep, StepIndex: steps}))
		must(t, b.w.CheckpointReleased(ck, time.Time{}))
		must(t, b.w.Reward(ledger.RewardRow{EpisodeID: ep, Source: ledger.SourceVerifier, Value: float64(e)}))
		must(t, b.w.EpisodeEnded(ledger.EpisodeEnd{ID: ep, Status: ledger.StatusTerminated, TotalReward: float64(e)}))
	}
	must(t, b.w.Flush(t.Context()))
	for _, c := range []struct {
		q    string
		want int
	}{
		{"SELECT count(*) FROM steps", episodes * steps},
		{"SELECT count(*) FROM episodes WHERE status = 'terminated' AND total_reward = substr(id, 4)::int", episodes},
		{"SELECT count(*) FROM checkpoints WHERE released_at IS NOT NULL", episodes},
		{"SELECT count(*) FROM rewards", episodes},
		{"SELECT count(*) FROM runs", 4},
	} {
		if n := count(t, b.url, c.q); n != c.want {
			t.Errorf("%s = %d, want %d", c.q, n, c.want)
		}
	}
	st := b.w.Stats()
	if st.Delivered != st.Appended || st.Dropped != 0 {
		t.Fatalf("stats %+v: want everything delivered, nothing dropped", st)
	}
	if n := count(t, b.url, "SELECT seq FROM ledger_spool_marks WHERE spool_id = $1", b.w.SpoolID()); uint64(n) != st.Appended {
		t.Fatalf("mark = %d, want %d", n, st.Appended)
	}
}

// A step appended twice, the copies in adjacent batches on different connections: the younger
// batch may hold the row the older one needs while waiting for it to commit. The lock timeout
// breaks the wait, the batches are redone in order, and the copy is skipped (the row-by-row
// path inserts steps with ON CONFLICT DO NOTHING).
func TestDuplicateStepsAcrossConcurrentBatches(t *testing.T) {
	t.Parallel()
	b := setup(t, func(c *ledger.Config) { c.Conns, c.BatchRows, c.DeliveryDelay = 2, 4, -1 })
	must(t, b.w.EpisodeStarted(ledger.EpisodeStart{ID: "e", Env: "env"}))
	const steps = 40
	dups := map[int]bool{9: true, 25: true}
	for i := range steps {
		must(t, b.w.Step(stepRow("e", i)))
		if dups[i-3] {
			must(t, b.w.Step(stepRow("e", i-3))) // three rows later: most likely the next batch
		}
	}
	must(t, b.w.Flush(t.Context()))
	if n := count(t, b.url, "SELECT count(*) FROM steps"); n != steps {
		t.Fatalf("steps = %d, want %d", n, steps)
	}
	st := b.w.Stats()
	if st.Delivered != st.Appended || st.Appended != uint64(steps+len(dups)+1) {
		t.Fatalf("stats %+v: want %d appended and delivered", st, steps+len(dups)+1)
	}
	t.Logf("stats %+v", st)
}

// Steps go to Postgres as a hand-encoded binary COPY stream: every column must read back as
// written, including NULLs, timestamps to the microsecond and a row bigger than one COPY
// message (a 100 KiB observation under a 128 KiB cap).
func TestStepColumnsRoundTrip(t *testing.T) {
	t.Parallel()
	b := setup(t, func(c *ledger.Config) { c.ObservationCap = 128 << 10 })
	must(t, b.w.EpisodeStarted(ledger.EpisodeStart{ID: "e", Env: "env"}))
	big := make([]byte, 100<<10)
	for i := range big {
		big[i] = byte(i * 7)
	}
	at := time.Date(2026, 11, 30, 17, 4, 5, 123456789, time.UTC)
	rows := []ledger.StepRow{
		{EpisodeID: "e", Index: 0, Action: json.RawMessage(`{"exec":["ls","-l"],"n":1.5}`), Observation: []byte("héllo\x00world"),
			Reward: -2.25, Terminated: true, StartedAt: at, Duration: 1500 * time.Microsecond, CheckpointID: "ck-1"},
		{EpisodeID: "e", Index: 1, Observation: big, Truncated: true, StartedAt: at.Add(-30 * 365 * 24 * time.Hour)},
		{EpisodeID: "e", Index: 2, Action: json.RawMessage(`"plain"`), StartedAt: at},
	}
	for _, r := range rows {
		must(t, b.w.Step(r))
	}
	tr, err := b.store.Trajectory(t.Context(), "e")
	must(t, err)
	if len(tr.Steps) != len(rows) {
		t.Fatalf("%d steps read back, want %d", len(tr.Steps), len(rows))
	}
	for i, want := range rows {
		t.Run(fmt.Sprint(i), func(t *testing.T) {
			got := tr.Steps[i]
			wantAction := string(want.Action)
			if wantAction == "" {
				wantAction = "null"
			}
			var ga, wa any
			must(t, json.Unmarshal(got.Action, &ga))
			must(t, json.Unmarshal([]byte(wantAction), &wa))
			sum := sha256.Sum256(want.Observation)
			switch {
			case got.EpisodeID != "e" || got.Index != want.Index:
				t.Errorf("key %s/%d", got.EpisodeID, got.Index)
			case fmt.Sprint(ga) != fmt.Sprint(wa):
				t.Errorf("action %s, want %s", got.Action, wantAction)
			case !bytes.Equal(got.Observation, want.Observation) && len(got.Observation)+len(want.Observation) > 0:
				t.Errorf("observation differs (%d bytes, want %d)", len(got.Observation), len(want.Observation))
			case got.ObservationSize != int64(len(want.Observation)) || !bytes.Equal(got.ObservationSHA256, sum[:]):
				t.Errorf("size %d sha %x", got.ObservationSize, got.ObservationSHA256)
			case got.Reward != want.Reward || got.Terminated != want.Terminated || got.Truncated != want.Truncated:
				t.Errorf("reward %v terminated %v truncated %v", got.Reward, got.Terminated, got.Truncated)
			case !got.StartedAt.Equal(want.StartedAt.Truncate(time.Microsecond)):
				t.Errorf("started_at %v, want %v", got.StartedAt, want.StartedAt.Truncate(time.Microsecond))
			case got.Duration != want.Duration || got.CheckpointID != want.CheckpointID:
				t.Errorf("duration %v checkpoint %q", got.Duration, got.CheckpointID)
			}
		})
	}
}
