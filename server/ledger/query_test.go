package ledger_test

import (
	"bufio"
	"bytes"
	"encoding/base64"
	"encoding/json"
	"errors"
	"fmt"
	"math"
	"reflect"
	"strings"
	"testing"

	"github.com/deltagym/deltagym/server/ledger"
)

// branchFixture: e1 resets from pool checkpoint P and takes 5 steps, checkpointing C1 after 3
// (and C3 after 5); e2 starts from C1, takes 2 steps and checkpoints C2; e3 starts from C2, takes
// 1 step and checkpoints C4.
func branchFixture(t *testing.T, b *bundle) {
	t.Helper()
	w := b.w
	must(t, w.Checkpoint(ledger.CheckpointRow{ID: "P", Kind: ledger.KindPool, Env: "env", CreatedAt: b.at(0)}))
	must(t, w.EpisodeStarted(ledger.EpisodeStart{ID: "e1", Env: "env", Run: "r", StartCheckpoint: "P", StartedAt: b.at(1)}))
	for i := range 5 {
		must(t, w.Step(stepRow("e1", i)))
		if i == 2 {
			must(t, w.Checkpoint(ledger.CheckpointRow{ID: "C1", ParentID: "P", Kind: ledger.KindUser, Env: "env", EpisodeID: "e1", StepIndex: 3, CreatedAt: b.at(2)}))
		}
	}
	must(t, w.Checkpoint(ledger.CheckpointRow{ID: "C3", ParentID: "C1", Kind: ledger.KindUser, Env: "env", EpisodeID: "e1", StepIndex: 5, CreatedAt: b.at(3)}))
	must(t, w.EpisodeEnded(ledger.EpisodeEnd{ID: "e1", Status: ledger.StatusBranched}))
	must(t, w.EpisodeStarted(ledger.EpisodeStart{ID: "e2", Env: "env", Run: "r", StartCheckpoint: "C1", ParentEpisode: "e1", StartedAt: b.at(4)}))
	must(t, w.Step(stepRow("e2", 0)))
	must(t, w.Step(stepRow("e2", 1)))
	must(t, w.Checkpoint(ledger.CheckpointRow{ID: "C2", ParentID: "C1", Kind: ledger.KindUser, Env: "env", EpisodeID: "e2", StepIndex: 2, CreatedAt: b.at(5)}))
	must(t, w.EpisodeStarted(ledger.EpisodeStart{ID: "e3", Env: "env", Run: "r", StartCheckpoint: "C2", ParentEpisode: "e2", StartedAt: b.at(6)}))
	must(t, w.Step(stepRow("e3", 0)))
	must(t, w.Checkpoint(ledger.CheckpointRow{ID: "C4", ParentID: "C2", Kind: ledger.KindEvaluate, Env: "env", EpisodeID: "e3", StepIndex: 1, CreatedAt: b.at(7)}))
	must(t, w.CheckpointReleased("C3", b.at(8)))
}

func TestTrajectoryInheritsAcrossBranches(t *testing.T) {
	t.Parallel()
	b := setup(t, nil)
	branchFixture(t, b)
	type want struct {
		ep        string
		idx       int
		inherited bool
	}
	cases := []struct {
		episode string
		want    []want
	}{
		{"e1", []want{{"e1", 0, false}, {"e1", 1, false}, {"e1", 2, false}, {"e1", 3, false}, {"e1", 4, false}}},
		{"e2", []want{{"e1", 0, true}, {"e1", 1, true}, {"e1", 2, true}, {"e2", 0, false}, {"e2", 1, false}}},
		{"e3", []want{{"e1", 0, true}, {"e1", 1, true}, {"e1", 2, true}, {"e2", 0, true}, {"e2", 1, true}, {"e3", 0, false}}},
	}
	for _, c := range cases {
		t.Run(c.episode, func(t *testing.T) {
			tr, err := b.store.Trajectory(t.Context(), c.episode)
			must(t, err)
			var got []want
			for _, s := range tr.Steps {
				got = append(got, want{s.EpisodeID, s.Index, s.Inherited})
			}
			if !reflect.DeepEqual(got, c.want) {
				t.Fatalf("path = %v, want %v", got, c.want)
			}
			if tr.Episode.ID != c.episode {
				t.Fatalf("episode = %s", tr.Episode.ID)
			}
		})
	}
	if _, err := b.store.Trajectory(t.Context(), "nope"); !errors.Is(err, ledger.ErrNotFound) {
		t.Fatalf("unknown episode: %v, want ErrNotFound", err)
	}
}

// render draws a forest as "A(B(C),D)".
func render(nodes []*ledger.CheckpointNode) string {
	var parts []string
	for _, n := range nodes {
		s := n.ID
		if len(n.Children) > 0 {
			s += "(" + render(n.Children) + ")"
		}
		parts = append(parts, s)
	}
	return strings.Join(parts, ",")
}

func TestCheckpointTree(t *testing.T) {
	t.Parallel()
	b := setup(t, nil)
	branchFixture(t, b)
	cases := []struct {
		name, run, episode, want string
	}{
		{"run", "r", "", "P(C1(C3,C2(C4)))"},
		{"episode e2: ancestors, own, descendants", "", "e2", "P(C1(C2(C4)))"},
		{"episode e1", "", "e1", "P(C1(C3,C2(C4)))"},
		{"episode e3", "", "e3", "P(C1(C2(C4)))"},
		{"unknown run", "none", "", ""},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			roots, err := b.store.CheckpointTree(t.Context(), c.run, c.episode)
			must(t, err)
			if got := render(roots); got != c.want {
				t.Fatalf("tree = %q, want %q", got, c.want)
			}
		})
	}
	roots, err := b.store.CheckpointTree(t.Context(), "r", "")
	must(t, err)
	c1 := roots[0].Children[0]
	if c3 := c1.Children[0]; c3.ReleasedAt == nil || c3.StepIndex != 5 || c3.EpisodeID != "e1" || c1.Children[1].ReleasedAt != nil {
		t.Fatalf("C3 = %+v, want released, step 5 of e1; C2 not released", c3.CheckpointRow)
	}
	if _, err := b.store.CheckpointTree(t.Context(), "r", "e1"); !errors.Is(err, ledger.ErrInvalid) {
		t.Fatalf("both run and episode: %v, want ErrInvalid", err)
	}
}

func TestAdvantages(t *testing.T) {
	t.Parallel()
	b := setup(t, nil)
	type ep struct {
		id     string
		status ledger.Status
		class  ledger.FailureClass
		reward []float64 // verifier rewards in order; the last counts
	}
	eps := []ep{
		{"a", ledger.StatusTerminated, "", []float64{0.2, 1.0}},
		{"b", ledger.StatusTerminated, "", []float64{0}},
		{"c", ledger.StatusTruncated, "", []float64{0.5}},
		{"d", ledger.StatusFailed, ledger.FailureInfra, []float64{1}},
		{"e", ledger.StatusTerminated, ledger.FailureInfra, []float64{1}},
		{"f", ledger.StatusRunning, "", nil},
		{"g", ledger.StatusTerminated, "", nil},
		{"h", ledger.StatusBranched, "", []float64{1}},
	}
	for i, e := range eps {
		must(t, b.w.EpisodeStarted(ledger.EpisodeStart{ID: e.id, Env: "env", Group: "G", StartedAt: b.at(i)}))
		for _, r := range e.reward {
			must(t, b.w.Reward(ledger.RewardRow{EpisodeID: e.id, Source: ledger.SourceVerifier, Value: r,
				Components: map[string]float64{"tests": r}}))
		}
		if e.status != ledger.StatusRunning {
			must(t, b.w.EpisodeEnded(ledger.EpisodeEnd{ID: e.id, Status: e.status, FailureClass: e.class}))
		}
	}
	got, err := b.store.Advantages(t.Context(), "G", "")
	must(t, err)
	// By hand: rewards 1, 0, 0.5; mean 0.5; sample std sqrt((0.25+0.25+0)/2) = 0.5.
	want := map[string]float64{"a": 0.5 / 0.5001, "b": -0.5 / 0.5001, "c": 0}
	if math.Abs(got.Mean-0.5) > 1e-12 || math.Abs(got.Std-0.5) > 1e-12 || len(got.Counted) != 3 {
		t.Fatalf("mean %v std %v counted %v", got.Mean, got.Std, got.Counted)
	}
	for _, a := range got.Counted {
		if math.Abs(a.Advantage-want[a.EpisodeID]) > 1e-12 {
			t.Errorf("advantage of %s = %v, want %v", a.EpisodeID, a.Advantage, want[a.EpisodeID])
		}
	}
	wantExcluded := map[string]string{"d": "infra failure", "e": "infra failure", "f": "not finished: running",
		"g": "no reward from verifier", "h": "not finished: branched"}
	gotExcluded := map[string]string{}
	for _, x := range got.Excluded {
		gotExcluded[x.EpisodeID] = x.Reason
	}
	if !reflect.DeepEqual(gotExcluded, wantExcluded) {
		t.Fatalf("excluded = %v, want %v", gotExcluded, wantExcluded)
	}

	// A trainer's rewards, all equal: every advantage is 0.
	for _, id := range []string{"a", "b", "c", "g"} {
		must(t, b.store.ReportReward(t.Context(), ledger.RewardRow{EpisodeID: id, Source: "trainer-v2", Value: 3}))
	}
	got, err = b.store.Advantages(t.Context(), "G", "trainer-v2")
	must(t, err)
	if len(got.Counted) != 4 || got.Std != 0 {
		t.Fatalf("trainer source: counted %v std %v", got.Counted, got.Std)
	}
	for _, a := range got.Counted {
		if a.Advantage != 0 {
			t.Fatalf("all-equal group: advantage of %s = %v, want 0", a.EpisodeID, a.Advantage)
		}
	}
	if _, err := b.store.Advantages(t.Context(), "nogroup", ""); !errors.Is(err, ledger.ErrNotFound) {
		t.Fatalf("unknown group: %v, want ErrNotFound", err)
	}
}

func TestListEpisodesPaginates(t *testing.T) {
	t.Parallel()
	b := setup(t, nil)
	for i := range 25 {
		must(t, b.w.EpisodeStarted(ledger.EpisodeStart{ID: fmt.Sprintf("e%02d", i), Env: fmt.Sprintf("env%d", i%2),
			Run: "r", Group: fmt.Sprintf("g%d", i%5), StartedAt: b.at(i)}))
	}
	must(t, b.w.EpisodeStarted(ledger.EpisodeStart{ID: "other", Env: "env0", Run: "r2", StartedAt: b.at(30)}))
	var ids []string
	tok, pages := "", 0
	for {
		eps, next, err := b.store.ListEpisodes(t.Context(), ledger.EpisodeFilter{Run: "r", PageSize: 10, PageToken: tok})
		must(t, err)
		pages++
		for _, e := range eps {
			ids = append(ids, e.ID)
		}
		if next == "" {
			break
		}
		tok = next
	}
	if pages != 3 || len(ids) != 25 || ids[0] != "e00" || ids[24] != "e24" {
		t.Fatalf("%d pages, ids %v", pages, ids)
	}
	cases := []struct {
		f    ledger.EpisodeFilter
		want int
	}{
		{ledger.EpisodeFilter{Group: "g3"}, 5},
		{ledger.EpisodeFilter{Env: "env0"}, 14},
		{ledger.EpisodeFilter{Env: "env0", Run: "r"}, 13},
		{ledger.EpisodeFilter{}, 26},
	}
	for _, c := range cases {
		t.Run(fmt.Sprintf("%+v", c.f), func(t *testing.T) {
			eps, _, err := b.store.ListEpisodes(t.Context(), c.f)
			must(t, err)
			if len(eps) != c.want {
				t.Fatalf("%d episodes, want %d", len(eps), c.want)
			}
		})
	}
	if _, _, err := b.store.ListEpisodes(t.Context(), ledger.EpisodeFilter{PageToken: "!!"}); !errors.Is(err, ledger.ErrInvalid) {
		t.Fatalf("bad token: %v", err)
	}
}

func TestEpisodeRewards(t *testing.T) {
	t.Parallel()
	b := setup(t, nil)
	for i, id := range []string{"a", "b", "c"} {
		must(t, b.w.EpisodeStarted(ledger.EpisodeStart{ID: id, Env: "env", Run: "r", StartedAt: b.at(i)}))
	}
	must(t, b.store.ReportReward(t.Context(), ledger.RewardRow{EpisodeID: "a", Source: "judge", Components: map[string]float64{"score": 1}, Value: 1}))
	must(t, b.store.ReportReward(t.Context(), ledger.RewardRow{EpisodeID: "a", Source: "judge", Components: map[string]float64{"score": 2}, Value: 2}))
	must(t, b.store.ReportReward(t.Context(), ledger.RewardRow{EpisodeID: "c", Source: "search", Components: map[string]float64{"cells": 5}, Value: 5}))
	got, err := b.store.EpisodeRewards(t.Context(), []string{"a", "b", "c", "unknown"})
	must(t, err)
	if len(got) != 2 || len(got["a"]) != 2 || got["a"][0].Value != 1 || got["a"][1].Value != 2 || len(got["c"]) != 1 ||
		got["c"][0].Source != "search" || got["c"][0].Components["cells"] != 5 {
		t.Fatalf("rewards of a, b, c: %+v; want a's two in the order reported, none for b, c's one", got)
	}
	if got, err := b.store.EpisodeRewards(t.Context(), nil); err != nil || len(got) != 0 {
		t.Fatalf("rewards of no episodes: %v, %v", got, err)
	}
}

func TestExportRoundTrip(t *testing.T) {
	t.Parallel()
	b := setup(t, nil)
	type written struct {
		start   ledger.EpisodeStart
		end     ledger.EpisodeEnd
		steps   []ledger.StepRow
		rewards []ledger.RewardRow
	}
	var all []written
	for i, run := range []string{"r1", "r1", "r2"} {
		wr := written{
			start: ledger.EpisodeStart{ID: fmt.Sprintf("x%d", i), Env: "env", Run: run, Group: "g", Seed: int64(42 + i), StartedAt: b.at(i)},
			end:   ledger.EpisodeEnd{ID: fmt.Sprintf("x%d", i), Status: ledger.StatusTerminated, TotalReward: float64(i), EndedAt: b.at(10 + i)},
		}
		must(t, b.w.EpisodeStarted(wr.start))
		for j := range 3 {
			s := stepRow(wr.start.ID, j)
			s.StartedAt = b.at(100 + j)
			s.Terminated = j == 2
			must(t, b.w.Step(s))
			wr.steps = append(wr.steps, s)
		}
		step := 2
		rw := ledger.RewardRow{EpisodeID: wr.start.ID, StepIndex: &step, Source: ledger.SourceVerifier, Value: float64(i),
			Components: map[string]float64{"pass": 1, "style": 0.5}, CreatedAt: b.at(200)}
		must(t, b.w.Reward(rw))
		wr.rewards = append(wr.rewards, rw)
		must(t, b.w.EpisodeEnded(wr.end))
		all = append(all, wr)
	}
	var buf bytes.Buffer
	must(t, b.store.Export(t.Context(), &buf, "r1"))
	var lines []ledger.ExportedEpisode
	sc := bufio.NewScanner(&buf)
	sc.Buffer(nil, 1<<24)
	for sc.Scan() {
		var e ledger.ExportedEpisode
		must(t, json.Unmarshal(sc.Bytes(), &e))
		lines = append(lines, e)
	}
	if len(lines) != 2 {
		t.Fatalf("exported %d episodes of r1, want 2", len(lines))
	}
	for i, got := range lines {
		wr := all[i]
		e := got.Episode
		if e.ID != wr.start.ID || e.Run != "r1" || e.Seed != wr.start.Seed || e.Group != "g" || e.Status != ledger.StatusTerminated ||
			e.TotalReward == nil || *e.TotalReward != wr.end.TotalReward || !e.StartedAt.Equal(wr.start.StartedAt) ||
			e.EndedAt == nil || !e.EndedAt.Equal(wr.end.EndedAt) {
			t.Fatalf("episode %d = %+v, want %+v / %+v", i, e, wr.start, wr.end)
		}
		if len(got.Steps) != len(wr.steps) {
			t.Fatalf("episode %s: %d steps, want %d", e.ID, len(got.Steps), len(wr.steps))
		}
		for j, s := range got.Steps {
			w := wr.steps[j]
			var ga, wa any
			must(t, json.Unmarshal(s.Action, &ga))
			must(t, json.Unmarshal(w.Action, &wa))
			if !reflect.DeepEqual(ga, wa) || string(s.Observation) != "null" || !bytes.Equal(s.ObservationRaw, w.Observation) || s.Index != w.Index ||
				s.Reward != w.Reward || s.Terminated != w.Terminated || s.Duration != w.Duration ||
				!s.StartedAt.Equal(w.StartedAt) || s.ObservationSize != int64(len(w.Observation)) || len(s.ObservationSHA256) != 32 {
				t.Fatalf("step %s/%d = %+v, want %+v", e.ID, j, s, w)
			}
		}
		if len(got.Rewards) != 1 || got.Rewards[0].Value != wr.rewards[0].Value || *got.Rewards[0].StepIndex != 2 ||
			!reflect.DeepEqual(got.Rewards[0].Components, wr.rewards[0].Components) || got.Rewards[0].Source != "verifier" {
			t.Fatalf("rewards of %s = %+v", e.ID, got.Rewards)
		}
	}
	buf.Reset()
	must(t, b.store.Export(t.Context(), &buf, ""))
	if n := strings.Count(buf.String(), "\n"); n != 3 {
		t.Fatalf("exported %d episodes of every run, want 3", n)
	}
}

// An export shows each observation as the JSON its decoder makes of it; one it cannot decode,
// or one cut at the cap, keeps its bytes, marked.
func TestExportObservations(t *testing.T) {
	t.Parallel()
	b := setup(t, func(c *ledger.Config) { c.ObservationCap = 16 })
	must(t, b.w.EpisodeStarted(ledger.EpisodeStart{ID: "o", Env: "env", Run: "obs", StartedAt: b.at(0)}))
	for i, obs := range []string{"fine", "bad", "far too long to be kept whole"} {
		must(t, b.w.Step(ledger.StepRow{EpisodeID: "o", Index: i, Observation: []byte(obs)}))
	}
	decode := func(stored []byte) (json.RawMessage, bool) {
		if string(stored) == "bad" {
			return nil, false
		}
		j, err := json.Marshal(map[string]string{"text": string(stored)})
		return j, err == nil
	}
	var buf bytes.Buffer
	must(t, b.store.ExportWith(t.Context(), &buf, ledger.ExportOptions{Run: "obs", Observation: decode}))
	var line struct {
		Steps []map[string]any `json:"steps"`
	}
	must(t, json.Unmarshal(buf.Bytes(), &line))
	want := []struct {
		obs       any
		raw       string
		truncated bool
	}{
		{map[string]any{"text": "fine"}, "", false},
		{nil, "bad", false},
		{map[string]any{"text": "far too long to "}, "", true}, // a cut one is given to the decoder too
	}
	if len(line.Steps) != len(want) {
		t.Fatalf("exported %d steps, want %d: %s", len(line.Steps), len(want), buf.String())
	}
	for i, w := range want {
		st := line.Steps[i]
		raw, _ := base64.StdEncoding.DecodeString(fmt.Sprint(st["observation_raw"]))
		if st["observation_raw"] == nil {
			raw = nil
		}
		trunc, _ := st["observation_truncated"].(bool)
		if !reflect.DeepEqual(st["observation"], w.obs) || string(raw) != w.raw || trunc != w.truncated {
			t.Errorf("step %d exported as %v, want observation %v, raw %q, truncated %v", i, st, w.obs, w.raw, w.truncated)
		}
	}
}

// graphFixture adds to branchFixture the links of deduplicating checkpoints: C2's sandbox found
// C3's state (C3 gets a second parent, newer than it), then C3's sandbox C2's (a cycle: C2 back
// to a state it had been reached from), C4's C1's (a cycle through parent_id: an undo to an
// ancestor) and C4's X, a checkpoint of another run (X joins run r's graph); and digests, one
// of a checkpoint the ledger has no row of.
func graphFixture(t *testing.T, b *bundle) {
	t.Helper()
	branchFixture(t, b)
	w := b.w
	must(t, w.EpisodeStarted(ledger.EpisodeStart{ID: "e9", Env: "env", Run: "r2", StartCheckpoint: "P", StartedAt: b.at(9)}))
	must(t, w.Checkpoint(ledger.CheckpointRow{ID: "X", ParentID: "P", Kind: ledger.KindUser, Env: "env", EpisodeID: "e9", CreatedAt: b.at(10)}))
	must(t, w.CheckpointEdge(ledger.CheckpointEdge{ChildID: "C3", ParentID: "C2", CreatedAt: b.at(11)}))
	must(t, w.CheckpointEdge(ledger.CheckpointEdge{ChildID: "C2", ParentID: "C3", CreatedAt: b.at(12)}))
	must(t, w.CheckpointEdge(ledger.CheckpointEdge{ChildID: "C1", ParentID: "C4", CreatedAt: b.at(13)}))
	must(t, w.CheckpointEdge(ledger.CheckpointEdge{ChildID: "X", ParentID: "C4", CreatedAt: b.at(14)}))
	// Recorded again (a replay): kept once.
	must(t, w.CheckpointEdge(ledger.CheckpointEdge{ChildID: "X", ParentID: "C4", CreatedAt: b.at(15)}))
	must(t, w.CheckpointDigest("C2", ledger.Digest{Files: "sha256:f2", Processes: "sha256:p2"}))
	must(t, w.CheckpointDigest("C2", ledger.Digest{Files: "sha256:other"}))
	must(t, w.CheckpointDigest("released-at-once", ledger.Digest{Files: "sha256:f"}))
}

func TestCheckpointGraph(t *testing.T) {
	t.Parallel()
	b := setup(t, nil)
	graphFixture(t, b)
	// Every link is kept, those closing a cycle too; the order follows parent_id and the links
	// that close no cycle with those recorded before them (C3 after C2), not C2's from C3 nor
	// C1's from C4.
	all := map[string]string{"P": "", "C1": "P C4", "C2": "C1 C3", "C3": "C1 C2", "C4": "C2", "X": "P C4"}
	cases := []struct {
		name, run, episode string
		order              string            // the nodes in the answer's order
		parents            map[string]string // a node's ParentIDs, joined by spaces
		tree               string
	}{
		{"run r", "r", "", "P C1 C2 C3 C4 X", all, "P(C1(C3,C2(C4)),X)"},
		{"run r2: X's link from C4, outside the set, is listed", "r2", "", "P X", map[string]string{"P": "", "X": "P C4"}, "P(X)"},
		// C4's descendants by either link, through the cycles: X, and C1 with its own.
		{"episode e3: descendants by both links", "", "e3", "P C1 C2 C3 C4 X", all, "P(C1(C3,C2(C4)),X)"},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			nodes, err := b.store.CheckpointGraph(t.Context(), c.run, c.episode)
			must(t, err)
			var order []string
			pos := map[string]int{}
			for i, n := range nodes {
				order = append(order, n.ID)
				pos[n.ID] = i
			}
			if got := strings.Join(order, " "); got != c.order {
				t.Fatalf("order = %q, want %q", got, c.order)
			}
			for _, n := range nodes {
				if len(n.ParentIDs) > 0 && n.ParentIDs[0] != n.ParentID {
					t.Fatalf("%s: parents %q, want its parent_id %s first", n.ID, n.ParentIDs, n.ParentID)
				}
				if i, ok := pos[n.ParentID]; ok && i >= pos[n.ID] {
					t.Fatalf("%s comes before its parent %s", n.ID, n.ParentID)
				}
				if want, ok := c.parents[n.ID]; ok && strings.Join(n.ParentIDs, " ") != want {
					t.Fatalf("%s: parents %q, want %q", n.ID, n.ParentIDs, want)
				}
				if wantDigest := (n.ID == "C2"); wantDigest != (n.Digest == ledger.Digest{Files: "sha256:f2", Processes: "sha256:p2"}) ||
					!wantDigest && n.Digest != (ledger.Digest{}) {
					t.Fatalf("%s: digest %+v", n.ID, n.Digest)
				}
			}
			roots, err := b.store.CheckpointTree(t.Context(), c.run, c.episode)
			must(t, err)
			if got := render(roots); got != c.tree {
				t.Fatalf("tree = %q, want %q", got, c.tree)
			}
		})
	}
	if n := count(t, b.url, "SELECT count(*) FROM checkpoint_edges WHERE child_id = 'X'"); n != 1 {
		t.Fatalf("X has %d edge rows, want 1", n)
	}
	for _, bad := range []ledger.CheckpointEdge{{ChildID: "A"}, {ParentID: "A"}, {ChildID: "A", ParentID: "A"}} {
		if err := b.w.CheckpointEdge(bad); !errors.Is(err, ledger.ErrInvalid) {
			t.Fatalf("edge %+v: %v, want ErrInvalid", bad, err)
		}
	}
	if err := b.w.CheckpointDigest("A", ledger.Digest{}); !errors.Is(err, ledger.ErrInvalid) {
		t.Fatalf("empty digest: %v, want ErrInvalid", err)
	}
}

// TestCheckpointGraphCycle reads a graph whose cycle of links lies among checkpoints whose own
// parents are outside the set: A and B, each found again from the other, reached from episode
// u1's E. Every node is in the answer and in the forest once, under a parent that comes before
// it; B, whose only parent in the set (A) comes after it, is a root.
func TestCheckpointGraphCycle(t *testing.T) {
	t.Parallel()
	b := setup(t, nil)
	w := b.w
	must(t, w.Checkpoint(ledger.CheckpointRow{ID: "Q", Kind: ledger.KindPool, Env: "env", CreatedAt: b.at(0)}))
	must(t, w.EpisodeStarted(ledger.EpisodeStart{ID: "u1", Env: "env", Run: "u", StartCheckpoint: "Q", StartedAt: b.at(1)}))
	must(t, w.Checkpoint(ledger.CheckpointRow{ID: "E", ParentID: "Q", Kind: ledger.KindUser, Env: "env", EpisodeID: "u1", CreatedAt: b.at(2)}))
	must(t, w.Checkpoint(ledger.CheckpointRow{ID: "Q2", Kind: ledger.KindPool, Env: "env", CreatedAt: b.at(3)}))
	must(t, w.EpisodeStarted(ledger.EpisodeStart{ID: "u2", Env: "env", Run: "u2", StartCheckpoint: "Q2", StartedAt: b.at(4)}))
	must(t, w.Checkpoint(ledger.CheckpointRow{ID: "A", ParentID: "Q2", Kind: ledger.KindUser, Env: "env", EpisodeID: "u2", CreatedAt: b.at(5)}))
	must(t, w.Checkpoint(ledger.CheckpointRow{ID: "B", ParentID: "Q2", Kind: ledger.KindUser, Env: "env", EpisodeID: "u2", CreatedAt: b.at(6)}))
	must(t, w.CheckpointEdge(ledger.CheckpointEdge{ChildID: "A", ParentID: "B", CreatedAt: b.at(7)}))
	must(t, w.CheckpointEdge(ledger.CheckpointEdge{ChildID: "B", ParentID: "A", CreatedAt: b.at(8)}))
	must(t, w.CheckpointEdge(ledger.CheckpointEdge{ChildID: "A", ParentID: "E", CreatedAt: b.at(9)}))
	cases := []struct {
		name, run, episode string
		order, tree        string
	}{
		{"episode u1: down through the cycle", "", "u1", "Q E B A", "Q(E),B(A)"},
		{"run u: the checkpoint E found", "u", "", "Q E Q2 A", "Q(E),Q2(A)"},
		{"run u2", "u2", "", "Q2 B A", "Q2(A,B)"},
	}
	parents := map[string]string{"Q": "", "E": "Q", "Q2": "", "A": "Q2 B E", "B": "Q2 A"}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			nodes, err := b.store.CheckpointGraph(t.Context(), c.run, c.episode)
			must(t, err)
			var order []string
			for _, n := range nodes {
				order = append(order, n.ID)
				if got := strings.Join(n.ParentIDs, " "); got != parents[n.ID] {
					t.Fatalf("%s: parents %q, want %q", n.ID, got, parents[n.ID])
				}
			}
			if got := strings.Join(order, " "); got != c.order {
				t.Fatalf("order = %q, want %q", got, c.order)
			}
			roots, err := b.store.CheckpointTree(t.Context(), c.run, c.episode)
			must(t, err)
			if got := render(roots); got != c.tree {
				t.Fatalf("tree = %q, want %q", got, c.tree)
			}
		})
	}
}
