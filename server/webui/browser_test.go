package webui_test

import (
	"context"
	"fmt"
	"io"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	"connectrpc.com/connect"
	"github.com/chromedp/cdproto/network"
	"github.com/chromedp/chromedp"

	deltagymv1 "github.com/deltagym/deltagym/clients/go/gen/deltagym/v1"
	"github.com/deltagym/deltagym/clients/go/gen/deltagym/v1/deltagymv1connect"
	"github.com/deltagym/deltagym/server/servertest"
)

// chromium is Debian's package's browser (make deps installs it: scripts/deps.sh, group
// browser); DELTAGYM_CHROMIUM names another.
func chromium(t *testing.T) string {
	t.Helper()
	p := os.Getenv("DELTAGYM_CHROMIUM")
	if p == "" {
		p = "/usr/bin/chromium"
	}
	if _, err := exec.LookPath(p); err != nil {
		t.Skipf("no browser at %s (make deps installs Debian's chromium; DELTAGYM_CHROMIUM names another): %v", p, err)
	}
	return p
}

// uiEnv is the catalog of the test's server: one env whose verifier rewards 42 in /tmp/answer.
const uiEnv = `{"name": "uitask", "image": "default", "task": "write 42 to /tmp/answer",
	"verifier": "if [ \"$(cat /tmp/answer 2>/dev/null)\" = 42 ]; then echo 1; else echo 0; fi",
	"budgets": {"max_steps": 50}, "pool_size": 1}`

type uiBundle struct {
	srv    *servertest.Server
	base   string
	env    deltagymv1connect.EnvServiceClient
	ledger deltagymv1connect.LedgerServiceClient
	token  string
}

func setupServer(t *testing.T) uiBundle {
	t.Helper()
	envs := t.TempDir()
	if err := os.WriteFile(filepath.Join(envs, "uitask.json"), []byte(uiEnv), 0o644); err != nil {
		t.Fatal(err)
	}
	srv, reason, err := servertest.Start(t.Context(), servertest.Options{EnvsDir: envs})
	if err != nil {
		t.Fatal(err)
	}
	if srv == nil {
		t.Skip(reason)
	}
	t.Cleanup(func() {
		if err := srv.Close(); err != nil {
			t.Error(err)
		}
	})
	base := "http://" + srv.Addr
	auth := connect.WithInterceptors(bearer(srv.Token()))
	return uiBundle{srv: srv, base: base, token: srv.Token(),
		env:    deltagymv1connect.NewEnvServiceClient(http.DefaultClient, base, auth),
		ledger: deltagymv1connect.NewLedgerServiceClient(http.DefaultClient, base, auth)}
}

type bearer string

func (b bearer) WrapUnary(next connect.UnaryFunc) connect.UnaryFunc {
	return func(ctx context.Context, req connect.AnyRequest) (connect.AnyResponse, error) {
		req.Header().Set("Authorization", "Bearer "+string(b))
		return next(ctx, req)
	}
}

func (b bearer) WrapStreamingClient(next connect.StreamingClientFunc) connect.StreamingClientFunc {
	return next
}

func (b bearer) WrapStreamingHandler(next connect.StreamingHandlerFunc) connect.StreamingHandlerFunc {
	return next
}

// result is a value and its error, taken at once from a call: of(f()).in(t).
type result[T any] struct {
	v   T
	err error
}

func of[T any](v T, err error) result[T] { return result[T]{v, err} }

// in returns the value, or fails t with the error.
func (r result[T]) in(t *testing.T) T {
	t.Helper()
	if r.err != nil {
		t.Fatal(r.err)
	}
	return r.v
}

func execAction(cmd string) *deltagymv1.Action {
	return &deltagymv1.Action{Kind: &deltagymv1.Action_Exec{Exec: &deltagymv1.ExecAction{Command: cmd}}}
}

var submit = &deltagymv1.Action{Kind: &deltagymv1.Action_Submit{Submit: &deltagymv1.SubmitAction{}}}

// uiRun is the run the test makes: a Reset, steps with checkpoints, a Restore to an earlier
// checkpoint, a Fork, rewards from the verifier and from ReportReward.
type uiRun struct {
	run      string
	restored string // a checkpoint taken after the Restore: its steps are partly inherited
	forkSB   string // the sandbox of the first Fork, its episode submitted
	liveSB   string // the sandbox of the second Fork, its episode running
	search   searchRun
}

// searchRun is what a search leaves: two sandboxes reach one state (a and b, one drawn node,
// taken without dedupe), one goes on (a2, then a3), and the search releases what it no longer
// keeps (a and a2). Its episodes carry a score reported as a search reports it.
type searchRun struct {
	a, b, a2, a3 string
	scoreA       float64 // the score of a's episode; b's is scoreB
	scoreB       float64
}

func makeRun(t *testing.T, b uiBundle) uiRun {
	t.Helper()
	ctx := t.Context()
	r := uiRun{run: "ui-run"}
	reset := of(b.env.Reset(ctx, connect.NewRequest(&deltagymv1.ResetRequest{Env: "uitask", Run: r.run, GroupId: "g1"}))).in(t).Msg
	sb := reset.GetSandboxId()
	step := func(sb string, a *deltagymv1.Action, ckpt bool) *deltagymv1.StepResponse {
		// Each checkpoint's digest is in before the step answers: the tree the test reads is
		// the one the page draws, merged by digest.
		return of(b.env.Step(ctx, connect.NewRequest(&deltagymv1.StepRequest{SandboxId: sb, Action: a, Checkpoint: ckpt,
			CheckpointWaitForDigest: ckpt}))).in(t).Msg
	}
	c1 := step(sb, execAction("echo 1 > /tmp/answer"), true).GetCheckpointId()
	c2 := step(sb, execAction("echo 42 > /tmp/answer"), true).GetCheckpointId()
	if c1 == "" || c2 == "" {
		t.Fatalf("steps with checkpoints gave %q and %q", c1, c2)
	}
	first := reset.GetEpisodeId()
	of(b.env.Restore(ctx, connect.NewRequest(&deltagymv1.RestoreRequest{SandboxId: sb, CheckpointId: c1}))).in(t)
	step(sb, execAction("echo 42 > /tmp/answer; printf 'a\\nb\\n' > /tmp/extra"), false)
	r.restored = step(sb, execAction("echo more >> /tmp/extra"), true).GetCheckpointId()
	if st := step(sb, submit, false); st.GetReward() != 1 {
		t.Fatalf("the restored episode's submit: reward %v, want 1", st.GetReward())
	}
	fork := of(b.env.Fork(ctx, connect.NewRequest(&deltagymv1.ForkRequest{Source: &deltagymv1.ForkRequest_CheckpointId{CheckpointId: c2},
		N: 1, GroupId: "g1"}))).in(t).Msg
	r.forkSB = fork.GetSandboxIds()[0]
	// A checkpoint of c2's state again (one drawn node with c2), then a change: reward 0.
	if same := step(r.forkSB, execAction("true"), true); same.GetCheckpointDigest().GetFiles() == "" {
		t.Fatalf("checkpoint %s has no digest", same.GetCheckpointId())
	}
	step(r.forkSB, execAction("echo 7 > /tmp/answer"), true)
	if st := step(r.forkSB, submit, false); st.GetReward() != 0 {
		t.Fatalf("the fork's submit: reward %v, want 0", st.GetReward())
	}
	// Another group from c1: a checkpoint of its own, then back at c2's state by a
	// deduplicating checkpoint, which gives c2 a second parent (a DAG).
	fork2 := of(b.env.Fork(ctx, connect.NewRequest(&deltagymv1.ForkRequest{Source: &deltagymv1.ForkRequest_CheckpointId{CheckpointId: c1},
		N: 1, GroupId: "g2"}))).in(t).Msg
	r.liveSB = fork2.GetSandboxIds()[0]
	step(r.liveSB, execAction("echo x > /tmp/other"), true)
	back := of(b.env.Step(ctx, connect.NewRequest(&deltagymv1.StepRequest{SandboxId: r.liveSB, Action: execAction("rm /tmp/other; echo 42 > /tmp/answer"),
		Checkpoint: true, CheckpointDedupe: true}))).in(t).Msg
	if !back.GetCheckpointDeduplicated() {
		t.Fatalf("a deduplicating checkpoint at c2's state made a new one, %s", back.GetCheckpointId())
	}
	of(b.ledger.ReportReward(ctx, connect.NewRequest(&deltagymv1.ReportRewardRequest{EpisodeId: first, Name: "judge", Value: 0.5, Source: "judge"}))).in(t)

	// A search from c1.
	s := searchRun{scoreA: 3, scoreB: 1}
	sf := of(b.env.Fork(ctx, connect.NewRequest(&deltagymv1.ForkRequest{Source: &deltagymv1.ForkRequest_CheckpointId{CheckpointId: c1},
		N: 2, GroupId: "search"}))).in(t).Msg
	sa, sbb := sf.GetSandboxIds()[0], sf.GetSandboxIds()[1]
	ca := step(sa, execAction("echo 9 > /tmp/answer"), true)
	cb := step(sbb, execAction("echo 9 > /tmp/answer"), true)
	if ca.GetCheckpointDigest().GetFiles() != cb.GetCheckpointDigest().GetFiles() {
		t.Fatalf("two sandboxes at one state took checkpoints of digests %v and %v", ca.GetCheckpointDigest(), cb.GetCheckpointDigest())
	}
	s.a, s.b = ca.GetCheckpointId(), cb.GetCheckpointId()
	s.a2 = step(sa, execAction("echo 10 > /tmp/answer"), true).GetCheckpointId()
	s.a3 = step(sa, execAction("echo 11 > /tmp/answer"), true).GetCheckpointId()
	for _, id := range []string{s.a, s.a2} {
		of(b.env.ReleaseCheckpoint(ctx, connect.NewRequest(&deltagymv1.ReleaseCheckpointRequest{CheckpointId: id}))).in(t)
	}
	for i, v := range []float64{s.scoreA, s.scoreB} {
		of(b.ledger.ReportReward(ctx, connect.NewRequest(&deltagymv1.ReportRewardRequest{EpisodeId: sf.GetEpisodeIds()[i],
			Name: "score", Value: v, Source: "goexplore"}))).in(t)
	}
	r.search = s
	return r
}

// drawnNode is a node of the tree as the page should draw it: the checkpoints of one state
// digest, and their parents.
type drawnNode struct {
	IDs     []string `json:"ids"`
	Parents []string `json:"parents"`
}

// wantDrawn merges the ledger's nodes as the page does: equal digests make one node.
func wantDrawn(nodes []*deltagymv1.CheckpointNode) []drawnNode {
	var out []drawnNode
	byDigest := map[string]int{}
	for _, n := range nodes {
		key := ""
		if d := n.GetDigest(); d.GetFiles() != "" {
			key = d.GetFiles() + " " + d.GetProcesses()
		}
		i, ok := byDigest[key]
		if !ok || key == "" {
			i = len(out)
			out = append(out, drawnNode{})
			if key != "" {
				byDigest[key] = i
			}
		}
		out[i].IDs = append(out[i].IDs, n.GetCheckpointId())
	}
	parentsOf := func(n *deltagymv1.CheckpointNode) []string {
		if len(n.GetParentIds()) > 0 {
			return n.GetParentIds()
		}
		if n.GetParentId() != "" {
			return []string{n.GetParentId()}
		}
		return nil
	}
	byID := map[string]*deltagymv1.CheckpointNode{}
	for _, n := range nodes {
		byID[n.GetCheckpointId()] = n
	}
	for i := range out {
		for _, id := range out[i].IDs {
			for _, p := range parentsOf(byID[id]) {
				if !slices.Contains(out[i].IDs, p) && !slices.Contains(out[i].Parents, p) {
					out[i].Parents = append(out[i].Parents, p)
				}
			}
		}
		if out[i].Parents == nil {
			out[i].Parents = []string{}
		}
	}
	return out
}

// readDrawn reads the drawn nodes from the page's data attributes.
const readDrawn = `[...document.querySelectorAll('#checkpoint-tree g.node')].map(g => ({
	ids: g.dataset.checkpointIds.split(' ').filter(Boolean),
	parents: g.dataset.parentIds.split(' ').filter(Boolean)}))`

func TestBrowser(t *testing.T) {
	browser := chromium(t)
	b := setupServer(t)
	r := makeRun(t, b)
	ctx := t.Context()

	tree := of(b.ledger.GetCheckpointTree(ctx, connect.NewRequest(&deltagymv1.GetCheckpointTreeRequest{
		Scope: &deltagymv1.GetCheckpointTreeRequest_Run{Run: r.run}}))).in(t).Msg.GetNodes()
	want := wantDrawn(tree)
	multi := 0
	for _, n := range tree {
		multi = max(multi, len(n.GetParentIds()))
	}
	if len(want) == len(tree) || multi < 2 {
		t.Errorf("the run's %d checkpoints make %d drawn nodes, the most parents of one is %d: want some merged by digest and a DAG link",
			len(tree), len(want), multi)
	}
	var node *deltagymv1.CheckpointNode
	for _, n := range tree {
		if n.GetCheckpointId() == r.restored {
			node = n
		}
	}
	if node == nil {
		t.Fatalf("the ledger's tree of %s lacks checkpoint %s", r.run, r.restored)
	}

	opts := append(slices.Clone(chromedp.DefaultExecAllocatorOptions[:]), chromedp.ExecPath(browser), chromedp.DisableGPU,
		chromedp.NoSandbox, chromedp.WindowSize(1400, 1100), chromedp.UserDataDir(t.TempDir()))
	alloc, cancelAlloc := chromedp.NewExecAllocator(ctx, opts...)
	defer cancelAlloc()
	bctx, cancel := chromedp.NewContext(alloc)
	defer cancel()
	bctx, cancelT := context.WithTimeout(bctx, 3*time.Minute)
	defer cancelT()
	run := func(what string, steps ...chromedp.Action[chromedp.Void]) {
		t.Helper()
		if err := chromedp.Do(bctx, steps...); err != nil {
			shot(t, bctx, "failed")
			t.Fatalf("%s: %v", what, err)
		}
	}
	waitFor := func(what, expr string) {
		t.Helper()
		run(what, chromedp.Poll[chromedp.Void](expr, chromedp.WithPollingInterval(50*time.Millisecond), chromedp.WithPollingTimeout(time.Minute)))
	}
	sessionCookie := func() *network.Cookie {
		t.Helper()
		res, err := chromedp.Call(bctx, network.GetCookies, network.GetCookiesParams{URLs: []string{b.base + "/"}})
		if err != nil {
			t.Fatal(err)
		}
		for _, c := range res.Cookies {
			if c.Name == "deltagym_session" {
				return c
			}
		}
		return nil
	}

	// A wrong token: the form says so, and no cookie is set.
	run("opening /ui/", chromedp.Navigate(b.base+"/ui/"), chromedp.WaitVisible("#sign-in"),
		chromedp.SendKeys("#token", "not-the-token"), chromedp.Click("#sign-in-button"), chromedp.WaitVisible("#sign-in-error"))
	msg := of(chromedp.Run(bctx, chromedp.Text("#sign-in-error"))).in(t)
	if !strings.Contains(msg, "wrong token") || sessionCookie() != nil {
		t.Fatalf("a wrong token: the page says %q, cookie %v; want an error and no cookie", msg, sessionCookie())
	}

	// The right token: signed in, the run listed.
	run("signing in", chromedp.Navigate(b.base+"/ui/"), chromedp.WaitVisible("#sign-in"), chromedp.SendKeys("#token", b.token),
		chromedp.Click("#sign-in-button"), chromedp.WaitVisible(`button.run[data-run="`+r.run+`"]`))
	ck := sessionCookie()
	if ck == nil || !ck.HTTPOnly || ck.SameSite != network.CookieSameSiteStrict || ck.Path != "/" {
		t.Fatalf("session cookie %+v: want HttpOnly, SameSite=Strict, Path=/", ck)
	}
	plainHTTP(t, b, ck.Value)

	// The run's tree: the drawn nodes are the ledger's, with their parents.
	run("opening the run", chromedp.Click(`button.run[data-run="`+r.run+`"]`))
	waitFor("the tree", fmt.Sprintf(`document.querySelectorAll('#checkpoint-tree g.node').length === %d`, len(want)))
	waitFor("the groups", `document.querySelectorAll('#groups tr[data-episode-id]').length > 0`)
	got := of(chromedp.Run(bctx, chromedp.Evaluate[[]drawnNode](readDrawn))).in(t)
	if !slices.EqualFunc(got, want, func(a, b drawnNode) bool { return slices.Equal(a.IDs, b.IDs) && slices.Equal(a.Parents, b.Parents) }) {
		t.Fatalf("drawn nodes\n%+v\nwant (the ledger's)\n%+v", got, want)
	}
	// The tree's box takes the window's height, and the root is in view in it at load.
	if bad := of(chromedp.Run(bctx, chromedp.Evaluate[string](rootInView))).in(t); bad != "" {
		shot(t, bctx, "root")
		t.Errorf("at load the tree's root is not in view: %s", bad)
	}

	// A node's steps are its episode's trajectory up to it.
	sel := `#checkpoint-tree g.node[data-node-key="` + r.restored + `"] circle`
	run("selecting a node", chromedp.Click(sel), chromedp.WaitVisible(`#node-panel[data-node-key="`+r.restored+`"]`))
	traj := of(b.ledger.GetTrajectory(ctx, connect.NewRequest(&deltagymv1.GetTrajectoryRequest{EpisodeId: node.GetEpisodeId()}))).in(t).Msg
	var wantSteps []string
	own := int32(0)
	for _, s := range traj.GetSteps() {
		if s.GetInherited() || own < node.GetStepIndex() {
			wantSteps = append(wantSteps, fmt.Sprintf("%d %s", s.GetStepIndex(), s.GetEpisodeId()))
		}
		if !s.GetInherited() {
			own++
		}
	}
	if len(wantSteps) < 2 || !strings.Contains(fmt.Sprint(traj.GetSteps()), "inherited:true") {
		t.Fatalf("the restored episode's trajectory to %s has %d steps, want inherited ones and its own", r.restored, len(wantSteps))
	}
	waitFor("the steps", fmt.Sprintf(`document.querySelectorAll('#steps tr[data-step-index]').length === %d`, len(wantSteps)))
	gotSteps := of(chromedp.Run(bctx, chromedp.Evaluate[[]string](
		`[...document.querySelectorAll('#steps tr[data-step-index]')].map(tr => tr.dataset.stepIndex + ' ' + tr.dataset.episodeId)`))).in(t)
	if !slices.Equal(gotSteps, wantSteps) {
		t.Fatalf("steps shown %q, want GetTrajectory's %q", gotSteps, wantSteps)
	}

	// The diff against its parent: the API's answer, or its error shown as a message.
	run("opening the diff", chromedp.Click("#diff-toggle"))
	waitFor("the diff", `['done', 'error'].includes(document.querySelector('#diff-panel')?.dataset.state)`)
	if base := of(chromedp.Run(bctx, chromedp.Evaluate[string](`document.querySelector('#diff-panel').dataset.base`))).in(t); base != node.GetParentId() {
		t.Errorf("the diff of %s is against %s, want its parent %s (held)", r.restored, base, node.GetParentId())
	}
	diff, derr := b.env.DiffCheckpoints(ctx, connect.NewRequest(&deltagymv1.DiffCheckpointsRequest{BaseCheckpointId: node.GetParentId(),
		CheckpointId: r.restored, Detail: deltagymv1.DiffDetail_DIFF_DETAIL_LINES}))
	if derr != nil {
		text := of(chromedp.Run(bctx, chromedp.Text("#diff-error"))).in(t)
		if !strings.Contains(text, connect.CodeOf(derr).String()) {
			t.Errorf("the diff panel says %q; the API answered %v", text, derr)
		}
	} else {
		var wantPaths []string
		for _, p := range diff.Msg.GetPaths() {
			wantPaths = append(wantPaths, p.GetPath())
		}
		gotPaths := of(chromedp.Run(bctx, chromedp.Evaluate[[]string](`[...document.querySelectorAll('#diff-paths tr[data-path]')].map(tr => tr.dataset.path)`))).in(t)
		if !slices.Equal(gotPaths, wantPaths) || !slices.Contains(gotPaths, "/tmp/extra") {
			t.Errorf("diff paths shown %q, want the API's %q (with /tmp/extra)", gotPaths, wantPaths)
		}
		run("the unified diff", chromedp.Click("#diff-unified"), chromedp.WaitVisible(`pre.unified[data-path="/tmp/extra"]`))
	}

	// Fork from the node: a new sandbox, which the API lists.
	run("forking", chromedp.Click("#fork"), chromedp.WaitVisible("#fork-result"))
	forked := of(chromedp.Run(bctx, chromedp.AttributeValue("#fork-result", "data-sandbox-id"))).in(t)
	if !forked.Exists || forked.Value == "" {
		t.Fatal("the fork shows no sandbox ID")
	}
	sb := of(b.env.GetSandbox(ctx, connect.NewRequest(&deltagymv1.GetSandboxRequest{SandboxId: forked.Value}))).in(t).Msg.GetSandbox()
	if sb.GetStartCheckpointId() != r.restored {
		t.Errorf("the forked sandbox %s started from %q, want %s", forked.Value, sb.GetStartCheckpointId(), r.restored)
	}

	searchNodes(t, b, bctx, r.search, tree, run, waitFor)

	// Live: a checkpoint taken now appears, and the selection stays.
	step := of(b.env.Step(ctx, connect.NewRequest(&deltagymv1.StepRequest{SandboxId: r.liveSB, Action: execAction("echo live > /tmp/live"), Checkpoint: true}))).in(t).Msg
	waitFor("the new checkpoint", `document.querySelector('#checkpoint-tree g.node[data-checkpoint-ids~="`+step.GetCheckpointId()+`"]') !== null`)
	if kept := of(chromedp.Run(bctx, chromedp.Evaluate[string](`document.querySelector('#checkpoint-tree g.node.selected')?.dataset.nodeKey || ''`))).in(t); kept != r.search.a3 {
		t.Errorf("after an update the selected node is %q, want %s", kept, r.search.a3)
	}
	shot(t, bctx, "run")

	// Sign out: the cookie is gone, the form is back.
	run("signing out", chromedp.Click("#sign-out"), chromedp.WaitVisible("#sign-in"))
	if c := sessionCookie(); c != nil {
		t.Errorf("after sign-out the browser keeps cookie %+v", c)
	}
}

// rootInView says why the tree's first root is not inside both the tree's box and the window,
// or that the box is short of the window's height; "" when all is well.
const rootInView = `(() => {
	const g = document.querySelector('#checkpoint-tree g.node.root circle');
	if (!g) return 'no root drawn';
	const r = g.getBoundingClientRect();
	const b = document.querySelector('.tree-box').getBoundingClientRect();
	const inBox = r.width > 0 && r.left >= b.left && r.right <= b.right && r.top >= b.top && r.bottom <= b.bottom;
	const inWindow = r.left >= 0 && r.top >= 0 && r.right <= innerWidth && r.bottom <= innerHeight;
	if (inBox && inWindow && b.height >= 0.6 * innerHeight) return '';
	return JSON.stringify({root: r, box: b, window: [innerWidth, innerHeight]});
})()`

// watchDiffs records the bodies of the page's DiffCheckpoints calls in window.diffCalls.
const watchDiffs = `(() => {
	if (window.diffCalls) return true;
	window.diffCalls = [];
	const f = window.fetch;
	window.fetch = function (url, init) {
		if (String(url).endsWith('/DiffCheckpoints')) window.diffCalls.push(JSON.parse(init.body));
		return f.call(window, url, init);
	};
	return true;
})()`

// diffCall is the body of one of the page's DiffCheckpoints calls.
type diffCall struct {
	Base       string `json:"baseCheckpointId"`
	Checkpoint string `json:"checkpointId"`
}

// searchNodes checks the nodes a search leaves: a node whose first checkpoint is released is
// diffed and forked by its held one; a node with every checkpoint released shows why no diff
// is possible and calls nothing; a node whose parent is released is diffed against the nearest
// held ancestor, which the panel names; and the tree can be coloured by the search's score.
func searchNodes(t *testing.T, b uiBundle, bctx context.Context, s searchRun, tree []*deltagymv1.CheckpointNode,
	run func(string, ...chromedp.Action[chromedp.Void]), waitFor func(string, string)) {
	t.Helper()
	ctx := t.Context()
	eval := func(expr string) string {
		t.Helper()
		return of(chromedp.Run(bctx, chromedp.Evaluate[string](expr))).in(t)
	}
	calls := func() []diffCall {
		t.Helper()
		return of(chromedp.Run(bctx, chromedp.Evaluate[[]diffCall](`window.diffCalls`))).in(t)
	}
	nodeSel := func(id string) string { return `#checkpoint-tree g.node[data-checkpoint-ids~="` + id + `"]` }
	parentOf := map[string]string{}
	for _, n := range tree {
		parentOf[n.GetCheckpointId()] = n.GetParentId()
	}
	wantPaths := func(base, id string) []string {
		t.Helper()
		d := of(b.env.DiffCheckpoints(ctx, connect.NewRequest(&deltagymv1.DiffCheckpointsRequest{BaseCheckpointId: base, CheckpointId: id,
			Detail: deltagymv1.DiffDetail_DIFF_DETAIL_LINES}))).in(t).Msg
		var out []string
		for _, p := range d.GetPaths() {
			out = append(out, p.GetPath())
		}
		return out
	}
	shownPaths := func() []string {
		t.Helper()
		return of(chromedp.Run(bctx, chromedp.Evaluate[[]string](`[...document.querySelectorAll('#diff-paths tr[data-path]')].map(tr => tr.dataset.path)`))).in(t)
	}
	if !of(chromedp.Run(bctx, chromedp.Evaluate[bool](watchDiffs))).in(t) {
		t.Fatal("watching the page's DiffCheckpoints calls")
	}

	// a and b: one node, a first and released, b held.
	if ids := strings.Fields(eval(`document.querySelector('` + nodeSel(s.b) + `')?.dataset.checkpointIds || ''`)); !slices.Equal(ids, []string{s.a, s.b}) {
		t.Fatalf("the node of %s holds %q, want [%s %s]: one state, its first checkpoint released", s.b, ids, s.a, s.b)
	}
	run("selecting the node of a released and a held checkpoint", chromedp.Click(nodeSel(s.b)+" circle"),
		chromedp.WaitVisible(`#node-panel[data-held-id="`+s.b+`"]`), chromedp.Click("#diff-toggle"))
	waitFor("the held checkpoint's diff", `['done', 'error'].includes(document.querySelector('#diff-panel')?.dataset.state)`)
	if st := eval(`document.querySelector('#diff-panel').dataset.state`); st != "done" {
		t.Fatalf("the diff of %s: %s (%s)", s.b, st, eval(`document.querySelector('#diff-error')?.textContent || ''`))
	}
	if c := calls(); len(c) != 1 || c[0] != (diffCall{parentOf[s.b], s.b}) {
		t.Errorf("the page's DiffCheckpoints calls %+v, want one of %s against its parent %s", c, s.b, parentOf[s.b])
	}
	if got, want := shownPaths(), wantPaths(parentOf[s.b], s.b); !slices.Equal(got, want) || !slices.Contains(got, "/tmp/answer") {
		t.Errorf("diff paths shown %q, want the API's %q (with /tmp/answer)", got, want)
	}
	run("forking the held checkpoint", chromedp.Click("#fork"), chromedp.WaitVisible("#fork-result"))
	forked := eval(`document.querySelector('#fork-result').dataset.sandboxId`)
	sb := of(b.env.GetSandbox(ctx, connect.NewRequest(&deltagymv1.GetSandboxRequest{SandboxId: forked}))).in(t).Msg.GetSandbox()
	if sb.GetStartCheckpointId() != s.b {
		t.Errorf("the fork of the node of %s and %s started from %q, want the held %s", s.a, s.b, sb.GetStartCheckpointId(), s.b)
	}
	of(b.env.Close(ctx, connect.NewRequest(&deltagymv1.CloseRequest{SandboxId: forked}))).in(t)

	// a2: every checkpoint released. The panel says why there is no diff, calls nothing, and
	// cannot fork.
	run("selecting a released node", chromedp.Click(nodeSel(s.a2)+" circle"),
		chromedp.WaitVisible(`#node-panel[data-node-key="`+s.a2+`"] #diff-unavailable`))
	msg := eval(`document.querySelector('#diff-unavailable').textContent`)
	if !strings.Contains(msg, "released") || !strings.Contains(msg, "held by the server") || !strings.Contains(msg, "close(keep=") {
		t.Errorf("a released node's diff says %q; want why (released, a diff needs both held) and what to do (close(keep=...))", msg)
	}
	if state := eval(`JSON.stringify([!!document.querySelector('#diff-toggle'), document.querySelector('#fork').disabled,
		document.querySelector('#fork-unavailable')?.textContent || ''])`); state != `[false,true," every checkpoint of this node was released: none can be forked"]` {
		t.Errorf("a released node's panel: [diff button, fork disabled, reason] = %s; want no diff button and the fork disabled with its reason", state)
	}
	if c := calls(); len(c) != 1 {
		t.Errorf("the page called DiffCheckpoints for a released node: %+v", c[1:])
	}

	// a3: its parent a2 released, a's node held by b: the diff is against b, two levels up.
	run("selecting a node under a released one", chromedp.Click(nodeSel(s.a3)+" circle"),
		chromedp.WaitVisible(`#node-panel[data-node-key="`+s.a3+`"] #diff-toggle`))
	if text := eval(`document.querySelector('#diff-toggle').textContent`); !strings.Contains(text, "2 levels up") {
		t.Errorf("the diff button of %s (its parent released) says %q; want it to name the ancestor, 2 levels up", s.a3, text)
	}
	run("the diff two levels up", chromedp.Click("#diff-toggle"))
	waitFor("the diff two levels up", `document.querySelector('#diff-panel')?.dataset.state === 'done'`)
	if c := calls(); len(c) != 2 || c[1] != (diffCall{s.b, s.a3}) {
		t.Errorf("the page's DiffCheckpoints calls %+v, want a second of %s against %s", c, s.a3, s.b)
	}
	if got, want := shownPaths(), wantPaths(s.b, s.a3); !slices.Equal(got, want) {
		t.Errorf("diff paths shown %q, want the API's %q", got, want)
	}

	// Colour by the search's score: listed beside the judge's, and the legend follows.
	options := of(chromedp.Run(bctx, chromedp.Evaluate[[]string](`[...document.querySelectorAll('#colour-by option')].map(o => o.textContent)`))).in(t)
	if !slices.Equal(options, []string{"total reward", "score (goexplore)", "judge (judge)"}) {
		t.Errorf("colour-by choices %q, want total reward and the reported rewards", options)
	}
	if src, reward := eval(`document.querySelector('#legend-range').dataset.source`), eval(`document.querySelector('`+nodeSel(s.a3)+`').dataset.reward`); src != "total reward" || reward != "" {
		t.Errorf("by default the legend shows %q and %s's reward is %q; want total reward, and none (its episode runs)", src, s.a3, reward)
	}
	eval(`(() => {
		const sel = document.querySelector('#colour-by');
		sel.value = [...sel.options].find(o => o.textContent === 'score (goexplore)').value;
		sel.dispatchEvent(new Event('change', {bubbles: true}));
		return '';
	})()`)
	waitFor("the legend of the score", `document.querySelector('#legend-range').dataset.source === 'score (goexplore)'`)
	got := eval(`(() => { const l = document.querySelector('#legend-range');
		return [l.dataset.min, l.dataset.max, l.textContent.trim(), document.querySelector('` + nodeSel(s.a3) + `').dataset.reward].join('|'); })()`)
	// a3 was taken in a's episode alone; a and b's node in both, as was every node above it.
	want := fmt.Sprintf("%v|%v|score (goexplore): %v to %v|%v", (s.scoreA+s.scoreB)/2, s.scoreA, (s.scoreA+s.scoreB)/2, s.scoreA, s.scoreA)
	if got != want {
		t.Errorf("coloured by the score: [min, max, legend, %s's reward] = %q, want %q", s.a3, got, want)
	}
}

// shot saves a screenshot of the page into the test's artifact directory (go test -artifacts
// keeps it, under -outputdir).
func shot(t *testing.T, ctx context.Context, name string) {
	t.Helper()
	buf, err := chromedp.Run(ctx, chromedp.FullScreenshot(100))
	if err != nil {
		t.Logf("screenshot %s: %v", name, err)
		return
	}
	p := filepath.Join(t.ArtifactDir(), name+".png")
	if err := os.WriteFile(p, buf, 0o644); err != nil {
		t.Error(err)
		return
	}
	t.Logf("screenshot: %s", p)
}

// plainHTTP checks the real server's gate with the browser's session cookie: the page's calls
// need the CSRF token beside it, and nothing else takes it.
func plainHTTP(t *testing.T, b uiBundle, cookie string) {
	t.Helper()
	post := func(path, ctype string, withCookie bool, hdr ...string) (int, string) {
		req := of(http.NewRequestWithContext(t.Context(), "POST", b.base+path, strings.NewReader("{}"))).in(t)
		req.Header.Set("Content-Type", ctype)
		for i := 0; i+1 < len(hdr); i += 2 {
			req.Header.Set(hdr[i], hdr[i+1])
		}
		if withCookie {
			req.AddCookie(&http.Cookie{Name: "deltagym_session", Value: cookie})
		}
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		defer resp.Body.Close()
		body := of(io.ReadAll(resp.Body)).in(t)
		// gRPC's status comes in a header or, after the body, in a trailer.
		return resp.StatusCode, resp.Header.Get("Grpc-Status") + resp.Trailer.Get("Grpc-Status") + string(body)
	}
	list := "/deltagym.v1.EnvService/ListEnvs"
	if code, body := post(list, "application/json", false); code != http.StatusUnauthorized {
		t.Errorf("ListEnvs without a cookie: %d %s, want 401", code, body)
	}
	if code, body := post(list, "application/json", true); code != http.StatusForbidden || !strings.Contains(body, "X-CSRF-Token") {
		t.Errorf("ListEnvs with the cookie, no CSRF header: %d %s, want 403 naming the header", code, body)
	}
	if code, body := post("/deltagym.v1.EnvService/Reset", "application/json", true); code != http.StatusUnauthorized {
		t.Errorf("Reset with the cookie: %d %s, want 401", code, body)
	}
	if code, body := post("/openenv/uitask/reset", "application/json", true); code != http.StatusUnauthorized {
		t.Errorf("OpenEnv with the cookie: %d %s, want 401", code, body)
	}
	if code, body := post(list, "application/grpc", true); code == http.StatusOK && !strings.HasPrefix(body, "16") {
		t.Errorf("gRPC with the cookie: %d %s, want unauthenticated", code, body)
	}
	if code, body := post(list, "application/json", false, "Authorization", "Bearer "+b.token); code != http.StatusOK {
		t.Errorf("ListEnvs with the bearer token: %d %s", code, body)
	}
}
