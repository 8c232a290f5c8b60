package ledger_test

import (
	"context"
	"encoding/json"
	"errors"
	"maps"
	"testing"
	"time"

	"github.com/deltagym/deltagym/server/ledger"
	"github.com/deltagym/deltagym/server/ledger/pgtest"
)

// refusedRows appends the rows of four episodes, interleaved — each a start, steps 0 to 19, a
// trainer's reward and an end — and, among them, a step of e2 at index 20 that Postgres
// refuses: its action is not JSON, which ActionValid vouches for, so the writer sends it as it
// is (a row no check of the writer's catches). It returns the rows appended.
func refusedRows(t *testing.T, w *ledger.Writer, at func(int) time.Time) int {
	t.Helper()
	n := 0
	add := func(err error) {
		t.Helper()
		must(t, err)
		n++
	}
	eps := []string{"e0", "e1", "e2", "e3"}
	for i, ep := range eps {
		add(w.EpisodeStarted(ledger.EpisodeStart{ID: ep, Env: "env", Run: "r", StartedAt: at(i)}))
	}
	for i := range 20 {
		for _, ep := range eps {
			add(w.Step(stepRow(ep, i)))
		}
		if i == 10 {
			poison := stepRow("e2", 20)
			poison.Action, poison.ActionValid = json.RawMessage(`{"cmd": "echo`), true
			add(w.Step(poison))
		}
	}
	for i, ep := range eps {
		step := 19
		add(w.Reward(ledger.RewardRow{EpisodeID: ep, StepIndex: &step, Source: ledger.SourceTrainer, Value: float64(i)}))
		add(w.EpisodeEnded(ledger.EpisodeEnd{ID: ep, Status: ledger.StatusTerminated, TotalReward: float64(i), EndedAt: at(10 + i)}))
	}
	return n
}

// checkRefused checks that every row refusedRows appended but the refused one is stored.
func checkRefused(t *testing.T, b *bundle) {
	t.Helper()
	if n := count(t, b.url, "SELECT count(*) FROM steps"); n != 80 {
		t.Errorf("%d steps stored, want 80 (the refused one set aside)", n)
	}
	if n := count(t, b.url, "SELECT count(*) FROM steps WHERE episode_id = 'e2' AND idx = 20"); n != 0 {
		t.Errorf("the refused step is stored")
	}
	if n := count(t, b.url, "SELECT count(*) FROM rewards"); n != 4 {
		t.Errorf("%d rewards stored, want 4", n)
	}
	if n := count(t, b.url, "SELECT count(*) FROM episodes WHERE status = 'terminated'"); n != 4 {
		t.Errorf("%d episodes ended, want 4", n)
	}
}

// A row Postgres refuses is set aside, logged and counted (Stats.Dropped), and every other row
// of its batch — other episodes' steps, rewards and ends among them — is stored: neither lost
// with it nor retried forever. Rows appended after it are delivered as before; so are rows
// read back from the spool (the in-memory queue overflowed), where the refused row is set aside
// the same way.
func TestRefusedRowSetAside(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		name    string
		mod     func(*ledger.Config)
		spooled bool
	}{
		{"memory", func(c *ledger.Config) { c.DeliveryDelay = time.Hour }, false}, // one batch, at Flush
		{"spool", func(c *ledger.Config) { c.QueueRows = 1; c.BatchRows = 16; c.Conns = 2 }, true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			b := setup(t, tc.mod)
			n := refusedRows(t, b.w, b.at)
			must(t, b.w.Flush(t.Context()))
			checkRefused(t, b)
			st := b.w.Stats()
			if st.Dropped != 1 || st.Delivered != uint64(n) || (st.Spooled > 0) != tc.spooled {
				t.Fatalf("stats %+v: want 1 row dropped and all %d delivered, read back from the spool: %v", st, n, tc.spooled)
			}
			// The ledger goes on.
			must(t, b.w.EpisodeStarted(ledger.EpisodeStart{ID: "after", Env: "env", StartedAt: b.at(20)}))
			must(t, b.w.Step(stepRow("after", 0)))
			must(t, b.w.Flush(t.Context()))
			if _, err := b.store.Episode(t.Context(), "after"); err != nil {
				t.Fatalf("the episode recorded after: %v", err)
			}
			if st := b.w.Stats(); st.Dropped != 1 {
				t.Fatalf("dropped %d after, want 1", st.Dropped)
			}
		})
	}
}

// A refused row that a writer left in its spool (Postgres was down) does not hold up the next
// writer on the spool: it sets the row aside and delivers the rest.
func TestRefusedRowInSpoolSetAside(t *testing.T) {
	t.Parallel()
	srv, url := pgtest.Private(t)
	spool := t.TempDir()
	must(t, srv.Stop(t.Context()))
	w, err := ledger.NewWriter(ledger.Config{URL: url, SpoolDir: spool, Logger: quiet})
	must(t, err)
	t0 := time.Now().UTC().Truncate(time.Millisecond)
	at := func(i int) time.Time { return t0.Add(time.Duration(i) * time.Millisecond) }
	n := refusedRows(t, w, at)
	ctx, cancel := context.WithTimeout(t.Context(), 100*time.Millisecond)
	defer cancel()
	if err := w.Close(ctx); !errors.Is(err, ledger.ErrUndelivered) {
		t.Fatalf("Close with Postgres down = %v, want ErrUndelivered", err)
	}
	must(t, srv.StartAgain(t.Context()))
	b := setupURL(t, url, func(c *ledger.Config) { c.SpoolDir = spool })
	must(t, b.w.Flush(t.Context()))
	checkRefused(t, b)
	if st := b.w.Stats(); st.Dropped != 1 || st.Delivered != uint64(n) {
		t.Fatalf("stats %+v: want 1 row dropped and all %d delivered", st, n)
	}
}

// What of an action jsonb cannot hold — NUL and a lone surrogate, escaped, and, in an action
// ActionValid does not vouch for, bytes that are not UTF-8 — is stored as U+FFFD, and the rest
// as it was: the step is stored, not refused. An escaped backslash before "u0000" is text.
func TestActionStoredAsJSONBTakesIt(t *testing.T) {
	t.Parallel()
	b := setup(t, nil)
	must(t, b.w.EpisodeStarted(ledger.EpisodeStart{ID: "e", Env: "env"}))
	actions := []struct {
		json  string
		valid bool
		want  map[string]string
	}{
		{`{"a":"x\u0000y","b":"\ud800","c":"\\u0000","d":"\ud83d\ude00","e":"\udc00\u0041","f":"\ud800\u0000"}`, true,
			map[string]string{"a": "x\uFFFDy", "b": "\uFFFD", "c": `\u0000`, "d": "😀", "e": "\uFFFDA", "f": "\uFFFD\uFFFD"}},
		{"{\"a\":\"\xff\\u0000\",\"b\\u0000\":\"\\\\\"}", false, map[string]string{"a": "\uFFFD\uFFFD", "b\uFFFD": `\`}},
	}
	for i, a := range actions {
		r := stepRow("e", i)
		r.Action, r.ActionValid = json.RawMessage(a.json), a.valid
		must(t, b.w.Step(r))
	}
	tr, err := b.store.Trajectory(t.Context(), "e")
	must(t, err)
	if len(tr.Steps) != len(actions) {
		t.Fatalf("%d steps stored, want %d (stats %+v)", len(tr.Steps), len(actions), b.w.Stats())
	}
	for i, a := range actions {
		var got map[string]string
		must(t, json.Unmarshal(tr.Steps[i].Action, &got))
		if !maps.Equal(got, a.want) {
			t.Errorf("action %d: stored %q, want %q", i, got, a.want)
		}
	}
}

// A reward's source and component names a verifier chose are stored with NUL and bytes that
// are not UTF-8 as U+FFFD, the caller's map left as it was; ReportReward and the Store's
// queries refuse such text from their caller (ErrInvalid) without touching Postgres.
func TestRewardTextAndQueriesWithNUL(t *testing.T) {
	t.Parallel()
	b := setup(t, nil)
	must(t, b.w.EpisodeStarted(ledger.EpisodeStart{ID: "e", Env: "env", Group: "g"}))
	comps := map[string]float64{"pass\x00ed": 1, "bad\xff": 2, "ok": 3}
	must(t, b.w.Reward(ledger.RewardRow{EpisodeID: "e", Source: "verif\x00ier", Components: comps, Value: 1}))
	if _, ok := comps["pass\x00ed"]; !ok || len(comps) != 3 {
		t.Errorf("the caller's components changed: %v", comps)
	}
	tr, err := b.store.Trajectory(t.Context(), "e")
	must(t, err)
	want := map[string]float64{"pass\uFFFDed": 1, "bad\uFFFD": 2, "ok": 3}
	if len(tr.Rewards) != 1 || tr.Rewards[0].Source != "verif\uFFFDier" || !maps.Equal(tr.Rewards[0].Components, want) {
		t.Fatalf("rewards stored: %+v, want one from %q with %v", tr.Rewards, "verif\uFFFDier", want)
	}

	ctx := t.Context()
	for name, err := range map[string]error{
		"report source":    b.store.ReportReward(ctx, ledger.RewardRow{EpisodeID: "e", Source: "s\x00", Components: map[string]float64{"n": 1}}),
		"report name":      b.store.ReportReward(ctx, ledger.RewardRow{EpisodeID: "e", Source: "s", Components: map[string]float64{"n\x00": 1}}),
		"report episode":   b.store.ReportReward(ctx, ledger.RewardRow{EpisodeID: "e\x00", Source: "s"}),
		"report not UTF-8": b.store.ReportReward(ctx, ledger.RewardRow{EpisodeID: "e", Source: "s\xff"}),
		"episode":          second(b.store.Episode(ctx, "e\x00")),
		"trajectory":       second(b.store.Trajectory(ctx, "e\x00")),
		"list run":         third(b.store.ListEpisodes(ctx, ledger.EpisodeFilter{Run: "r\x00"})),
		"list group":       third(b.store.ListEpisodes(ctx, ledger.EpisodeFilter{Group: "g\x00"})),
		"list env":         third(b.store.ListEpisodes(ctx, ledger.EpisodeFilter{Env: "e\x00"})),
		"tree run":         second(b.store.CheckpointGraph(ctx, "r\x00", "")),
		"tree episode":     second(b.store.CheckpointGraph(ctx, "", "e\x00")),
		"advantages group": second(b.store.Advantages(ctx, "g\x00", "")),
		"advantages src":   second(b.store.Advantages(ctx, "g", "s\x00")),
		"checkpoint place": second(b.store.CheckpointPlace(ctx, "c\x00")),
		"export run":       b.store.Export(ctx, discard{}, "r\x00"),
	} {
		if !errors.Is(err, ledger.ErrInvalid) {
			t.Errorf("%s: %v, want ErrInvalid", name, err)
		}
	}
	if n := count(t, b.url, "SELECT count(*) FROM rewards"); n != 1 {
		t.Errorf("%d rewards stored, want the verifier's alone", n)
	}
	// A page token naming an id with NUL is no token of the ledger's.
	if _, _, err := b.store.ListEpisodes(ctx, ledger.EpisodeFilter{PageToken: pageToken(b.at(0), "e\x00")}); !errors.Is(err, ledger.ErrInvalid) {
		t.Errorf("page token with NUL: %v, want ErrInvalid", err)
	}
}

func second[T any](_ T, err error) error        { return err }
func third[T, U any](_ T, _ U, err error) error { return err }

type discard struct{}

func (discard) Write(p []byte) (int, error) { return len(p), nil }

// pageToken is a token as the Store makes them (ListEpisodes's next page).
func pageToken(at time.Time, id string) string {
	return ledger.EncodeToken(at, id)
}
