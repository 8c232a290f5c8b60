package ledger_test

import (
	"testing"

	"github.com/deltagym/deltagym/server/ledger"
)

// Text a sandbox controls reaches the ledger's text columns (a failure message quoting a file's
// name, the host a sandbox asked for): bytes that are not UTF-8, and NUL, which no Postgres
// text value holds, are stored as U+FFFD instead of failing the batch they are in.
func TestTextNotUTF8(t *testing.T) {
	t.Parallel()
	b := setup(t, nil)
	must(t, b.w.EpisodeStarted(ledger.EpisodeStart{ID: "e", Env: "env", Sandbox: "sb-1", StartedAt: b.at(0)}))
	must(t, b.w.EpisodeEnded(ledger.EpisodeEnd{ID: "e", Status: ledger.StatusFailed, FailureClass: ledger.FailureAgent,
		FailureMessage: "reading /work/bad\xff\nname: nul\x00", EndedAt: b.at(1)}))
	must(t, b.w.Egress(ledger.EgressRow{Env: "env", Sandbox: "sb-1", EpisodeID: "e", Host: "h\xfe.example", Port: 80,
		Reason: "refused \xff", StartedAt: b.at(2)}))
	must(t, b.w.EpisodeStarted(ledger.EpisodeStart{ID: "after", Env: "env", StartedAt: b.at(3)})) // the rows after are stored too
	must(t, b.w.Flush(t.Context()))
	e, err := b.store.Episode(t.Context(), "e")
	must(t, err)
	if want := "reading /work/bad\uFFFD\nname: nul\uFFFD"; e.FailureMessage != want || e.Status != ledger.StatusFailed {
		t.Errorf("episode e: %q (%s), want %q", e.FailureMessage, e.Status, want)
	}
	if n := count(t, b.url, "SELECT count(*) FROM egress WHERE host = $1 AND reason = $2", "h\uFFFD.example", "refused \uFFFD"); n != 1 {
		t.Errorf("%d egress rows with the host made valid, want 1", n)
	}
	if _, err := b.store.Episode(t.Context(), "after"); err != nil {
		t.Errorf("the episode recorded after: %v", err)
	}
}
