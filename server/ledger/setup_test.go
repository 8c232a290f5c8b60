package ledger_test

import (
	"bytes"
	"encoding/json"
	"reflect"
	"strings"
	"testing"

	"github.com/deltagym/deltagym/server/ledger"
)

// setupFixture: e1 takes steps 0 (setup), 1, 2 (setup) and 3, checkpointing C1 after three;
// e2 starts from C1 and takes steps 0 and 1 (setup), checkpointing C2 after both; e3 starts
// from C2 and takes one setup step.
func setupFixture(t *testing.T, b *bundle) {
	t.Helper()
	w := b.w
	step := func(ep string, i int, setup bool) {
		r := stepRow(ep, i)
		r.Setup = setup
		must(t, w.Step(r))
	}
	must(t, w.Checkpoint(ledger.CheckpointRow{ID: "P", Kind: ledger.KindPool, Env: "env", CreatedAt: b.at(0)}))
	must(t, w.EpisodeStarted(ledger.EpisodeStart{ID: "e1", Env: "env", Run: "r", StartCheckpoint: "P", StartedAt: b.at(1)}))
	for i, setup := range []bool{true, false, true, false} {
		step("e1", i, setup)
		if i == 2 {
			must(t, w.Checkpoint(ledger.CheckpointRow{ID: "C1", ParentID: "P", Kind: ledger.KindUser, Env: "env", EpisodeID: "e1", StepIndex: 3, CreatedAt: b.at(2)}))
		}
	}
	must(t, w.EpisodeStarted(ledger.EpisodeStart{ID: "e2", Env: "env", Run: "r", StartCheckpoint: "C1", ParentEpisode: "e1", StartedAt: b.at(3)}))
	step("e2", 0, false)
	step("e2", 1, true)
	must(t, w.Checkpoint(ledger.CheckpointRow{ID: "C2", ParentID: "C1", Kind: ledger.KindUser, Env: "env", EpisodeID: "e2", StepIndex: 2, CreatedAt: b.at(4)}))
	must(t, w.EpisodeStarted(ledger.EpisodeStart{ID: "e3", Env: "env", Run: "r", StartCheckpoint: "C2", ParentEpisode: "e2", StartedAt: b.at(5)}))
	step("e3", 0, true)
}

// The setup column: stored, read back on trajectories (inherited steps too) and in exports, and
// left out of the agent's steps a checkpoint's place counts (what a restarted server labels
// checkpoints with, so that max_steps counts the agent's steps across branches).
func TestSetupSteps(t *testing.T) {
	t.Parallel()
	b := setup(t, nil)
	setupFixture(t, b)
	tr, err := b.store.Trajectory(t.Context(), "e3")
	must(t, err)
	var got []bool
	for _, s := range tr.Steps {
		got = append(got, s.Setup)
	}
	if want := []bool{true, false, true, false, true, true}; !reflect.DeepEqual(got, want) {
		t.Fatalf("e3's path's setup flags = %v, want %v", got, want)
	}
	for _, c := range []struct {
		id                 string
		own, global, agent int
	}{{"C1", 3, 3, 1}, {"C2", 2, 5, 2}} {
		p, err := b.store.CheckpointPlace(t.Context(), c.id)
		must(t, err)
		if p.Own != c.own || p.Global != c.global || p.Agent != c.agent {
			t.Errorf("%s's place = own %d, global %d, agent %d; want %d, %d, %d", c.id, p.Own, p.Global, p.Agent, c.own, c.global, c.agent)
		}
	}
	var out bytes.Buffer
	must(t, b.store.Export(t.Context(), &out, "r"))
	setups := map[string][]bool{}
	for line := range strings.Lines(out.String()) {
		var e struct {
			Episode struct {
				ID string `json:"id"`
			} `json:"episode"`
			Steps []struct {
				Setup bool `json:"setup"`
			} `json:"steps"`
		}
		must(t, json.Unmarshal([]byte(line), &e))
		for _, s := range e.Steps {
			setups[e.Episode.ID] = append(setups[e.Episode.ID], s.Setup)
		}
	}
	want := map[string][]bool{"e1": {true, false, true, false}, "e2": {false, true}, "e3": {true}}
	if !reflect.DeepEqual(setups, want) {
		t.Fatalf("exported setup flags = %v, want %v", setups, want)
	}
}
