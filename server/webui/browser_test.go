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

	// Live: a checkpoint taken now appears, and the selection stays.
	step := of(b.env.Step(ctx, connect.NewRequest(&deltagymv1.StepRequest{SandboxId: r.liveSB, Action: execAction("echo live > /tmp/live"), Checkpoint: true}))).in(t).Msg
	waitFor("the new checkpoint", `document.querySelector('#checkpoint-tree g.node[data-checkpoint-ids~="`+step.GetCheckpointId()+`"]') !== null`)
	if kept := of(chromedp.Run(bctx, chromedp.Evaluate[string](`document.querySelector('#checkpoint-tree g.node.selected')?.dataset.nodeKey || ''`))).in(t); kept != r.restored {
		t.Errorf("after an update the selected node is %q, want %s", kept, r.restored)
	}
	shot(t, bctx, "run")

	// Sign out: the cookie is gone, the form is back.
	run("signing out", chromedp.Click("#sign-out"), chromedp.WaitVisible("#sign-in"))
	if c := sessionCookie(); c != nil {
		t.Errorf("after sign-out the browser keeps cookie %+v", c)
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
