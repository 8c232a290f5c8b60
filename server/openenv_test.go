package server_test

import (
	"bytes"
	"context"
	"encoding/json"
	"io"
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/coder/websocket"

	deltagymv1 "github.com/deltagym/deltagym/clients/go/gen/deltagym/v1"
	"github.com/deltagym/deltagym/server"
)

// oeSocket is a Go client of the OpenEnv WebSocket protocol.
type oeSocket struct {
	t testing.TB
	c *websocket.Conn
}

func dialOpenEnv(t testing.TB, b *bundle, env string) *oeSocket {
	t.Helper()
	c, resp, err := websocket.Dial(t.Context(), "ws://"+b.addr+"/openenv/"+env+"/ws",
		&websocket.DialOptions{HTTPHeader: http.Header{"Authorization": {"Bearer " + b.token}}})
	if resp != nil && resp.Body != nil {
		resp.Body.Close()
	}
	if err != nil {
		t.Fatal(err)
	}
	c.SetReadLimit(1 << 26)
	t.Cleanup(func() { c.CloseNow() })
	return &oeSocket{t, c}
}

// send sends a frame and returns the answer's type and data.
func (o *oeSocket) send(f any) (string, json.RawMessage) {
	o.t.Helper()
	b, _ := json.Marshal(f)
	ctx, cancel := context.WithTimeout(o.t.Context(), time.Minute)
	defer cancel()
	if err := o.c.Write(ctx, websocket.MessageText, b); err != nil {
		o.t.Fatal(err)
	}
	_, raw, err := o.c.Read(ctx)
	if err != nil {
		o.t.Fatal(err)
	}
	var ans struct {
		Type string          `json:"type"`
		Data json.RawMessage `json:"data"`
	}
	if err := json.Unmarshal(raw, &ans); err != nil {
		o.t.Fatalf("answer %s: %v", raw, err)
	}
	return ans.Type, ans.Data
}

type oeResult struct {
	Observation map[string]any `json:"observation"`
	Reward      float64        `json:"reward"`
	Done        bool           `json:"done"`
	Metadata    struct {
		SandboxID    string `json:"sandbox_id"`
		EpisodeID    string `json:"episode_id"`
		CheckpointID string `json:"checkpoint_id"`
		StepIndex    int    `json:"step_index"`
		StepCount    int    `json:"step_count"`
		Terminated   bool   `json:"terminated"`
		Truncated    bool   `json:"truncated"`
	} `json:"metadata"`
}

// do sends a reset or step and returns its observation, failing on an error frame.
func (o *oeSocket) do(typ string, data any) oeResult {
	o.t.Helper()
	at, raw := o.send(map[string]any{"type": typ, "data": data})
	if at != "observation" {
		o.t.Fatalf("%s %v: answered %s %s", typ, data, at, raw)
	}
	var r oeResult
	if err := json.Unmarshal(raw, &r); err != nil {
		o.t.Fatal(err)
	}
	return r
}

// fails sends a frame and returns the error frame's code and message.
func (o *oeSocket) fails(f any) (code, msg string) {
	o.t.Helper()
	at, raw := o.send(f)
	if at != "error" {
		o.t.Fatalf("%v: answered %s %s, want an error", f, at, raw)
	}
	var e struct{ Code, Message string }
	_ = json.Unmarshal(raw, &e)
	return e.Code, e.Message
}

func TestOpenEnvEpisode(t *testing.T) {
	b := setup(t, nil)
	o := dialOpenEnv(t, b, "task")
	r := o.do("reset", map[string]any{"seed": 7, "Q": "why"})
	if r.Metadata.SandboxID == "" || r.Metadata.EpisodeID == "" || r.Metadata.CheckpointID == "" || r.Done {
		t.Fatalf("reset: %+v", r)
	}
	if got := r.Observation["stdout"]; got != "seed=7 q=why\n" || r.Observation["task"] != "write 42 to /tmp/answer" {
		t.Fatalf("reset's observation: %v", r.Observation)
	}
	first := r.Metadata
	r = o.do("step", map[string]any{"command": "echo hi; echo err >&2; exit 3"})
	if r.Observation["stdout"] != "hi\n" || r.Observation["stderr"] != "err\n" || r.Observation["exit_code"] != 3.0 || r.Metadata.StepIndex != 0 {
		t.Fatalf("step: %+v", r)
	}
	if nested := r.Observation["metadata"].(map[string]any); nested["sandbox_id"] != first.SandboxID {
		t.Fatalf("the observation's own metadata: %v", nested)
	}
	r = o.do("step", map[string]any{"command": "", "write_file": map[string]any{"path": "/tmp/answer", "content": "41"}, "checkpoint": true})
	ck := r.Metadata.CheckpointID
	if ck == "" || r.Observation["checkpoint_id"] != ck || r.Observation["size"] != 2.0 {
		t.Fatalf("write with a checkpoint: %+v", r)
	}
	if k := dialOpenEnv(t, b, "task").do("reset", map[string]any{"checkpoint_id": ck}); k.Observation["task"] != "write 42 to /tmp/answer" {
		t.Fatalf("a reset from a checkpoint shows no task: %+v", k)
	}
	if r = o.do("step", map[string]any{"command": "", "read_file": "/tmp/answer"}); r.Observation["content"] != "41" {
		t.Fatalf("read: %+v", r)
	}
	if r = o.do("step", map[string]any{"command": "", "read_file": "/nonexistent"}); r.Observation["error"] == nil || r.Observation["errno"] != "no such file or directory" {
		t.Fatalf("a read of a missing file: %+v", r)
	}
	if r = o.do("step", map[string]any{"command": "", "evaluate": true}); r.Reward != 0 || r.Done || r.Observation["evaluation"] == nil {
		t.Fatalf("evaluate of a wrong answer: %+v", r)
	}
	r = o.do("step", map[string]any{"command": "echo 42 > /tmp/answer", "restore": ck})
	if r.Metadata.EpisodeID == first.EpisodeID || r.Observation["restored_to"] != ck || r.Observation["metadata"].(map[string]any)["start_checkpoint_id"] != ck {
		t.Fatalf("a step with a restore: %+v", r)
	}
	if at, raw := o.send(map[string]any{"type": "state"}); at != "state" || !strings.Contains(string(raw), `"step_count":3`) {
		t.Fatalf("state: %s %s", at, raw)
	}
	if r = o.do("step", map[string]any{"command": "submit"}); r.Reward != 1 || !r.Done || !r.Metadata.Terminated {
		t.Fatalf("submit of the right answer: %+v", r)
	}
	// The ledger has the episode's path as the API's would be: two steps inherited from the
	// checkpoint, and its own two.
	tr := b.episode(t, r.Metadata.EpisodeID)
	if st := tr.GetSteps(); tr.GetEpisode().GetStatus() != deltagymv1.EpisodeStatus_EPISODE_STATUS_TERMINATED || len(st) != 4 ||
		!st[1].GetInherited() || st[1].GetAction().GetWriteFile().GetContent() == nil ||
		st[2].GetAction().GetExec().GetCommand() != "echo 42 > /tmp/answer" || st[3].GetReward() != 1 {
		t.Fatalf("the ledger's trajectory: %v", tr)
	}
	code, msg := o.fails(map[string]any{"type": "step", "data": map[string]any{"command": "true"}})
	if code != "EXECUTION_ERROR" || !strings.Contains(msg, "ended") {
		t.Fatalf("a step after the end: %s %s", code, msg)
	}
	// The same reset again restores the start: the same sandbox, a new episode.
	r = o.do("reset", map[string]any{"seed": 7, "Q": "why"})
	if r.Metadata.SandboxID != first.SandboxID || r.Metadata.EpisodeID == first.EpisodeID || r.Observation["stdout"] != "seed=7 q=why\n" {
		t.Fatalf("a reset like the last: %+v", r)
	}
	if r = o.do("step", map[string]any{"command": "cat /tmp/answer /tmp/seed"}); r.Observation["stdout"] != "7\n" {
		t.Fatalf("the state after a reset like the last: %+v", r)
	}
	// Another seed is another Reset: a new sandbox, and the old one is closed.
	r = o.do("reset", map[string]any{"seed": 8})
	if r.Metadata.SandboxID == first.SandboxID {
		t.Fatalf("a reset with another seed kept the sandbox: %+v", r)
	}
	if _, err := b.srv.Pools().Lease(first.SandboxID); err == nil {
		t.Fatal("the session's previous sandbox is still leased")
	}
	// Closing the socket closes its sandbox.
	last := r.Metadata.SandboxID
	o.c.Close(websocket.StatusNormalClosure, "")
	waitUnleased(t, b, last)
}

// waitUnleased waits until sandbox id is no longer leased.
func waitUnleased(t *testing.T, b *bundle, id string) {
	t.Helper()
	deadline := time.Now().Add(30 * time.Second)
	for {
		if _, err := b.srv.Pools().Lease(id); err != nil {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("sandbox %s still leased 30 s after its socket closed", id)
		}
		time.Sleep(10 * time.Millisecond) // a watchdog's poll: the close runs on the server's side
	}
}

func TestOpenEnvForkFromCheckpoint(t *testing.T) {
	b := setup(t, nil)
	o := dialOpenEnv(t, b, "plain")
	o.do("reset", nil)
	r := o.do("step", map[string]any{"command": "echo forked > /tmp/x", "checkpoint": true})
	ck := r.Metadata.CheckpointID
	kids := make([]oeResult, 3)
	for i := range kids {
		k := dialOpenEnv(t, b, "plain")
		kids[i] = k.do("reset", map[string]any{"checkpoint_id": ck, "group_id": "g1"})
		if got := k.do("step", map[string]any{"command": "cat /tmp/x"}); got.Observation["stdout"] != "forked\n" || got.Metadata.StepIndex != 1 {
			t.Fatalf("a fork's step: %+v", got)
		}
	}
	if kids[0].Metadata.SandboxID == kids[1].Metadata.SandboxID {
		t.Fatal("two forks share a sandbox")
	}
	if got := b.srv.Pools(); got == nil {
		t.Fatal("no pools")
	}
	code, msg := dialOpenEnv(t, b, "task").fails(map[string]any{"type": "reset", "data": map[string]any{"checkpoint_id": ck}})
	if code != "VALIDATION_ERROR" || !strings.Contains(msg, `/openenv/plain`) {
		t.Fatalf("a fork of another env's checkpoint: %s %s", code, msg)
	}
}

func TestOpenEnvBadInput(t *testing.T) {
	b := setup(t, nil)
	o := dialOpenEnv(t, b, "plain")
	for _, c := range []struct {
		frame any
		code  string
		says  string
	}{
		{"not json", "INVALID_JSON", "not a JSON object"},
		{map[string]any{"type": "jump"}, "UNKNOWN_TYPE", "reset, step, state"},
		{map[string]any{"type": "step", "data": map[string]any{"cmd": "ls"}}, "VALIDATION_ERROR", "unknown field"},
		{map[string]any{"type": "step", "data": map[string]any{"read_file": "/x"}}, "VALIDATION_ERROR", "command is required"},
		{map[string]any{"type": "step", "data": map[string]any{"command": ""}}, "VALIDATION_ERROR", "exactly one"},
		{map[string]any{"type": "step", "data": map[string]any{"command": "ls", "read_file": "/x"}}, "VALIDATION_ERROR", "at once"},
		{map[string]any{"type": "step", "data": map[string]any{"command": "", "checkpoint": true, "evaluate": true}}, "VALIDATION_ERROR", "exactly one"},
		{map[string]any{"type": "step", "data": map[string]any{"command": "ls", "timeout": -1}}, "VALIDATION_ERROR", "timeout"},
		{map[string]any{"type": "step", "data": map[string]any{"command": "", "restore": "ck-nope"}}, "EXECUTION_ERROR", "ck-nope"},
		{map[string]any{"type": "reset", "data": map[string]any{"seed": "x"}}, "VALIDATION_ERROR", "seed is an integer"},
		{map[string]any{"type": "reset", "data": []int{1}}, "VALIDATION_ERROR", "keyword arguments"},
		{map[string]any{"type": "reset", "data": map[string]any{"opt": map[string]any{}}}, "VALIDATION_ERROR", "string, number or boolean"},
		{map[string]any{"type": "reset", "data": map[string]any{"fresh_entropy": true}}, "VALIDATION_ERROR", "goes with checkpoint_id"},
	} {
		var code, msg string
		if s, ok := c.frame.(string); ok {
			// A text frame that is not JSON.
			ctx := t.Context()
			must(t, o.c.Write(ctx, websocket.MessageText, []byte(s)))
			_, raw, err := o.c.Read(ctx)
			must(t, err)
			var f struct {
				Data struct{ Code, Message string }
			}
			_ = json.Unmarshal(raw, &f)
			code, msg = f.Data.Code, f.Data.Message
		} else {
			code, msg = o.fails(c.frame)
		}
		if code != c.code || !strings.Contains(msg, c.says) {
			t.Errorf("%v: %s %q, want %s saying %q", c.frame, code, msg, c.code, c.says)
		}
	}
	// The socket goes on after errors, and nothing was leased for the bad ones but the reset's.
	r := o.do("step", map[string]any{"command": "echo A > /tmp/state; cat /tmp/plain", "checkpoint": true})
	if r.Observation["stdout"] != "plain\n" {
		t.Fatalf("a step after errors: %+v", r)
	}
	ck, ep := r.Metadata.CheckpointID, r.Metadata.EpisodeID
	o.do("step", map[string]any{"command": "echo B > /tmp/state"})
	// An action the runtime would refuse is refused before its restore: nothing changes.
	for _, bad := range []map[string]any{
		{"command": "true", "session": "../x"},
		{"command": "", "write_file": map[string]any{"path": "/tmp/a\x00b", "content": "x"}},
		{"command": "", "write_file": map[string]any{"path": "/tmp/a", "content": "x", "mode": 0o4777}},
		{"command": "", "submit": strings.Repeat("x", 200_000)},
	} {
		bad["restore"] = ck
		if code, _ := o.fails(map[string]any{"type": "step", "data": bad}); code != "VALIDATION_ERROR" {
			t.Errorf("%.80v: %s, want VALIDATION_ERROR", bad, code)
		}
	}
	if r := o.do("step", map[string]any{"command": "cat /tmp/state"}); r.Observation["stdout"] != "B\n" || r.Metadata.EpisodeID != ep {
		t.Fatalf("refused actions with a restore changed the sandbox: %+v", r)
	}
	// A timeout below a nanosecond is the shortest, not none.
	if r := o.do("step", map[string]any{"command": "sleep 30", "timeout": 1e-10}); r.Observation["timed_out"] != true {
		t.Fatalf("a step with a tiny timeout: %+v", r)
	}
	if n := len(b.srv.Pools().Leases()); n != 1 {
		t.Fatalf("%d sandboxes leased, want the one socket's", n)
	}
}

func TestOpenEnvLargeFrame(t *testing.T) {
	b := setup(t, func(c *server.Config) { c.MaxRequestBytes = 1 << 20 })
	o := dialOpenEnv(t, b, "plain")
	o.do("reset", nil)
	big, _ := json.Marshal(map[string]any{"type": "step", "data": map[string]any{"command": "",
		"write_file": map[string]any{"path": "/tmp/big", "content": strings.Repeat("x", 3<<20)}}})
	code, msg := o.fails(json.RawMessage(big))
	if code != "VALIDATION_ERROR" || !strings.Contains(msg, "past the server's 1048576") {
		t.Fatalf("a frame past the limit: %s %s", code, msg)
	}
	if r := o.do("step", map[string]any{"command": "ls /tmp/big || echo none"}); r.Observation["stdout"] != "none\n" {
		t.Fatalf("the socket after a frame past the limit: %+v", r)
	}
}

func TestOpenEnvHTTP(t *testing.T) {
	b := setup(t, nil)
	get := func(path string, auth bool) (int, map[string]any) {
		t.Helper()
		req, _ := http.NewRequestWithContext(t.Context(), http.MethodGet, "http://"+b.addr+path, nil)
		if auth {
			req.Header.Set("Authorization", "Bearer "+b.token)
		}
		resp, err := http.DefaultClient.Do(req)
		must(t, err)
		defer resp.Body.Close()
		var m map[string]any
		_ = json.NewDecoder(resp.Body).Decode(&m)
		return resp.StatusCode, m
	}
	if code, m := get("/t/"+b.token+"/openenv/task/health", false); code != 200 || m["status"] != "healthy" {
		t.Fatalf("health through the URL token: %d %v", code, m)
	}
	if code, _ := get("/openenv/task/health", false); code != http.StatusUnauthorized {
		t.Fatalf("health without a token: %d", code)
	}
	if code, m := get("/openenv/nope/health", true); code != 404 || !strings.Contains(m["detail"].(string), "nope") {
		t.Fatalf("health of an unknown env: %d %v", code, m)
	}
	code, m := get("/openenv/task/schema", true)
	action, _ := m["action"].(map[string]any)
	if code != 200 || action["title"] != "DeltagymAction" || action["required"].([]any)[0] != "command" || m["observation"] == nil || m["state"] == nil {
		t.Fatalf("schema: %d %v", code, m)
	}
	if code, m := get("/openenv/task/metadata", true); code != 200 || m["name"] != "task" {
		t.Fatalf("metadata: %d %v", code, m)
	}
	if code, m := get("/openenv/", true); code != 200 || len(m["envs"].([]any)) != len(testEnvs) {
		t.Fatalf("the list of envs: %d %v", code, m)
	}
	if code, m := get("/openenv/task/reset", true); code != http.StatusMethodNotAllowed || !strings.Contains(m["detail"].(string), "takes POST") {
		t.Fatalf("a reset by GET: %d %v", code, m)
	}
	post := func(path, body string) (int, map[string]any) {
		t.Helper()
		req, _ := http.NewRequestWithContext(t.Context(), http.MethodPost, "http://"+b.addr+path, strings.NewReader(body))
		req.Header.Set("Authorization", "Bearer "+b.token)
		resp, err := http.DefaultClient.Do(req)
		must(t, err)
		defer resp.Body.Close()
		raw, _ := io.ReadAll(resp.Body)
		var m map[string]any
		_ = json.Unmarshal(raw, &m)
		return resp.StatusCode, m
	}
	if code, m := post("/openenv/task/reset", `{"seed": 3}`); code != 200 || !strings.Contains(m["observation"].(map[string]any)["stdout"].(string), "seed=3") {
		t.Fatalf("stateless reset: %d %v", code, m)
	}
	if code, m := post("/openenv/task/step", `{"action": {"command": "echo $((6*7))"}}`); code != 200 || m["observation"].(map[string]any)["stdout"] != "42\n" {
		t.Fatalf("stateless step: %d %v", code, m)
	}
	if code, m := post("/openenv/task/step", `{"action": {"command": 1}}`); code != 422 || m["code"] != "VALIDATION_ERROR" {
		t.Fatalf("stateless step with a bad action: %d %v", code, m)
	}
	waitNoLeases(t, b)
	// MCP: a session, its tools, a call, a close.
	rpc := func(method string, params map[string]any) map[string]any {
		body, _ := json.Marshal(map[string]any{"jsonrpc": "2.0", "id": 1, "method": method, "params": params})
		code, m := post("/openenv/task/mcp", string(body))
		if code != 200 {
			t.Fatalf("%s: %d %v", method, code, m)
		}
		return m
	}
	sid := rpc("openenv/session/create", map[string]any{})["result"].(map[string]any)["session_id"].(string)
	var names []string
	for _, tl := range rpc("tools/list", map[string]any{"session_id": sid})["result"].(map[string]any)["tools"].([]any) {
		names = append(names, tl.(map[string]any)["name"].(string))
	}
	if got := strings.Join(names, ","); got != "bash,write_file,read_file,submit,checkpoint,restore,evaluate" {
		t.Fatalf("tools: %s", got)
	}
	res := rpc("tools/call", map[string]any{"session_id": sid, "name": "bash", "arguments": map[string]any{"command": "echo 42 > /tmp/answer; echo ok"}})
	if text := res["result"].(map[string]any)["content"].([]any)[0].(map[string]any)["text"]; text != "ok\n" {
		t.Fatalf("tools/call bash: %v", res)
	}
	res = rpc("tools/call", map[string]any{"session_id": sid, "name": "bash", "arguments": map[string]any{"command": "echo out; exit 2"}})
	if r := res["result"].(map[string]any); r["content"].([]any)[0].(map[string]any)["text"] != "out\n\n[exit code 2]" || r["isError"] != true {
		t.Fatalf("tools/call bash of a failing command: %v", res)
	}
	if e := rpc("tools/call", map[string]any{"session_id": sid, "name": "bash", "arguments": map[string]any{"cmd": "ls"}})["error"].(map[string]any); !strings.Contains(e["message"].(string), `no argument "cmd"`) {
		t.Fatalf("tools/call with an unknown argument: %v", e)
	}
	for _, note := range []string{`{"jsonrpc": "2.0", "method": "notifications/initialized"}`, `{"jsonrpc": "2.0", "method": "ping"}`} {
		if code, m := post("/openenv/task/mcp", note); code != http.StatusAccepted || m != nil {
			t.Fatalf("a notification %s: %d %v", note, code, m)
		}
	}
	if code, m := post("/openenv/task/step", `{"action": {"command": "true"}} {}`); code != 422 {
		t.Fatalf("a step's body with more after it: %d %v", code, m)
	}
	res = rpc("tools/call", map[string]any{"session_id": sid, "name": "submit"})
	if r := res["result"].(map[string]any)["data"].(map[string]any); r["reward"] != 1.0 || r["done"] != true || r["verdict"] == nil {
		t.Fatalf("tools/call submit: %v", res)
	}
	if e := rpc("tools/call", map[string]any{"session_id": sid, "name": "rm"})["error"].(map[string]any); e["code"] != -32602.0 || !strings.Contains(e["message"].(string), "bash") {
		t.Fatalf("an unknown tool: %v", e)
	}
	if r := rpc("openenv/session/close", map[string]any{"session_id": sid})["result"].(map[string]any); r["closed"] != true {
		t.Fatalf("close: %v", r)
	}
	if e := rpc("tools/call", map[string]any{"session_id": sid, "name": "bash", "arguments": map[string]any{"command": "true"}})["error"]; e == nil {
		t.Fatal("a call on a closed session succeeded")
	}
	waitNoLeases(t, b)
}

func waitNoLeases(t *testing.T, b *bundle) {
	t.Helper()
	deadline := time.Now().Add(30 * time.Second)
	for len(b.srv.Pools().Leases()) > 0 {
		if time.Now().After(deadline) {
			t.Fatalf("%d sandboxes still leased", len(b.srv.Pools().Leases()))
		}
		time.Sleep(10 * time.Millisecond) // a watchdog's poll
	}
}

func TestOpenEnvCapacity(t *testing.T) {
	b := setup(t, func(c *server.Config) { c.OpenEnv.MaxSessions = 2 })
	first, second := dialOpenEnv(t, b, "plain"), dialOpenEnv(t, b, "plain")
	first.do("reset", nil)
	second.do("reset", nil)
	if code, msg := dialOpenEnv(t, b, "plain").fails(map[string]any{"type": "reset"}); code != "CAPACITY_REACHED" || !strings.Contains(msg, "openenv-max-sessions") {
		t.Fatalf("a session past the cap: %s %s", code, msg)
	}
	first.c.Close(websocket.StatusNormalClosure, "")
	second.c.Close(websocket.StatusNormalClosure, "")
	create := func() map[string]any {
		req, _ := http.NewRequestWithContext(t.Context(), http.MethodPost, "http://"+b.addr+"/openenv/plain/mcp",
			strings.NewReader(`{"jsonrpc": "2.0", "id": 1, "method": "openenv/session/create"}`))
		req.Header.Set("Authorization", "Bearer "+b.token)
		resp, err := http.DefaultClient.Do(req)
		must(t, err)
		defer resp.Body.Close()
		var m map[string]any
		must(t, json.NewDecoder(resp.Body).Decode(&m))
		return m
	}
	// The closed sockets' slots free as their ends run, each on its own time: wait for both.
	createEventually := func() map[string]any {
		for deadline := time.Now().Add(30 * time.Second); ; time.Sleep(10 * time.Millisecond) { // a watchdog's poll
			m := create()
			if m["error"] == nil {
				return m
			}
			if time.Now().After(deadline) {
				t.Fatalf("no MCP session after the sockets closed: %v", m)
			}
		}
	}
	a, spare := createEventually(), createEventually()
	closeReq, _ := http.NewRequestWithContext(t.Context(), http.MethodPost, "http://"+b.addr+"/openenv/plain/mcp",
		strings.NewReader(`{"jsonrpc": "2.0", "id": 2, "method": "openenv/session/close", "params": {"session_id": "`+
			spare["result"].(map[string]any)["session_id"].(string)+`"}}`))
	closeReq.Header.Set("Authorization", "Bearer "+b.token)
	closeResp, err := http.DefaultClient.Do(closeReq)
	must(t, err)
	var closed map[string]any
	must(t, json.NewDecoder(closeResp.Body).Decode(&closed))
	closeResp.Body.Close()
	if r, _ := closed["result"].(map[string]any); r == nil || r["closed"] != true {
		t.Fatalf("closing the spare MCP session: %v", closed)
	}
	// An MCP session with its socket attached is one session: there is room for one more.
	sid := a["result"].(map[string]any)["session_id"].(string)
	attached, resp, err := websocket.Dial(t.Context(), "ws://"+b.addr+"/openenv/plain/ws?session_id="+sid,
		&websocket.DialOptions{HTTPHeader: http.Header{"Authorization": {"Bearer " + b.token}}})
	if resp != nil && resp.Body != nil {
		resp.Body.Close()
	}
	must(t, err)
	defer attached.CloseNow()
	(&oeSocket{t, attached}).do("reset", nil)
	if m := create(); m["error"] != nil {
		t.Fatalf("a second MCP session beside one with a socket attached: %v", m)
	}
	if m := create(); m["error"] == nil || m["error"].(map[string]any)["data"].(map[string]any)["code"] != "CAPACITY_REACHED" {
		t.Fatalf("a third MCP session: %v", m)
	}
	c, resp, err := websocket.Dial(t.Context(), "ws://"+b.addr+"/openenv/plain/ws", nil)
	if resp != nil && resp.Body != nil {
		resp.Body.Close()
	}
	if err == nil {
		c.CloseNow()
		t.Fatal("a socket without a token was accepted")
	}
}

func TestOpenEnvLongStep(t *testing.T) {
	b := setup(t, func(c *server.Config) {
		c.OpenEnv.StepCap = 2 * time.Second
		c.Lease.TTL = time.Second
		c.PublicHealth = true
	})
	o := dialOpenEnv(t, b, "plain")
	r := o.do("reset", nil)
	first, err := b.srv.Pools().Lease(r.Metadata.SandboxID)
	must(t, err)
	expires := first.Expires()
	// The socket renews its sandbox's lease while it is open, with no message sent.
	deadline := time.Now().Add(30 * time.Second)
	for !first.Expires().After(expires.Add(100 * time.Millisecond)) {
		if time.Now().After(deadline) {
			t.Fatal("the lease of an open socket's sandbox was not renewed")
		}
		time.Sleep(10 * time.Millisecond) // a watchdog's poll
	}
	// A command past the cap answers timed out, with what it printed; the server answers
	// pings while it runs.
	done := make(chan oeResult)
	go func() {
		done <- o.do("step", map[string]any{"command": "echo partial; touch /tmp/started; sleep 100"})
	}()
	box, err := b.srv.Runtime().Get(r.Metadata.SandboxID)
	must(t, err)
	for deadline := time.Now().Add(30 * time.Second); ; time.Sleep(10 * time.Millisecond) { // a watchdog's poll
		if _, _, err := box.ReadFile(t.Context(), "/tmp/started", 0, 1); err == nil {
			break
		}
		if time.Now().After(deadline) {
			t.Fatal("the step did not start")
		}
	}
	pinged := make(chan error, 1)
	go func() { pinged <- o.c.Ping(t.Context()) }()
	select {
	case err := <-pinged:
		must(t, err)
	case r = <-done:
		t.Fatalf("the step answered (%+v) before a ping during it did", r)
	}
	r = <-done
	if r.Observation["timed_out"] != true || r.Observation["stdout"] != "partial\n" {
		t.Fatalf("a step past the cap: %+v", r)
	}
	// With --public-health, AutoEnv's probe needs no token.
	resp, err := http.Get("http://" + b.addr + "/openenv/plain/health")
	must(t, err)
	resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		t.Fatalf("public health: %d", resp.StatusCode)
	}
}

func TestOpenEnvShutdown(t *testing.T) {
	b := setup(t, nil)
	o := dialOpenEnv(t, b, "plain")
	r := o.do("reset", nil)
	frame, _ := json.Marshal(map[string]any{"type": "step", "data": map[string]any{"command": "touch /tmp/started; sleep 100"}})
	must(t, o.c.Write(t.Context(), websocket.MessageText, frame))
	box, err := b.srv.Runtime().Get(r.Metadata.SandboxID)
	must(t, err)
	for deadline := time.Now().Add(30 * time.Second); ; time.Sleep(10 * time.Millisecond) { // a watchdog's poll
		if _, _, err := box.ReadFile(t.Context(), "/tmp/started", 0, 1); err == nil {
			break
		}
		if time.Now().After(deadline) {
			t.Fatal("the step did not start")
		}
	}
	// The server shuts down with the step running: the step is aborted and the socket told,
	// not dropped.
	ctx, cancel := context.WithTimeout(t.Context(), time.Minute)
	defer cancel()
	closed := make(chan error, 1)
	go func() { closed <- b.srv.Close(ctx) }()
	for {
		_, raw, err := o.c.Read(ctx)
		if err != nil {
			if websocket.CloseStatus(err) != websocket.StatusGoingAway {
				t.Fatalf("the socket ended with %v, want going away", err)
			}
			break
		}
		if !strings.Contains(string(raw), `"error"`) {
			t.Fatalf("an answer to the aborted step that is no error: %s", raw)
		}
	}
	must(t, <-closed)
}

// mcpCall posts a JSON-RPC request to env's /mcp and returns the answer.
func mcpCall(t *testing.T, b *bundle, env, method string, params map[string]any) map[string]any {
	t.Helper()
	body, _ := json.Marshal(map[string]any{"jsonrpc": "2.0", "id": 1, "method": method, "params": params})
	req, _ := http.NewRequestWithContext(t.Context(), http.MethodPost, "http://"+b.addr+"/openenv/"+env+"/mcp", bytes.NewReader(body))
	req.Header.Set("Authorization", "Bearer "+b.token)
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		return map[string]any{"transport_error": err.Error()}
	}
	defer resp.Body.Close()
	var m map[string]any
	_ = json.NewDecoder(resp.Body).Decode(&m)
	return m
}

// A shutdown aborts the MCP calls in progress and those waiting their turn: it ends in its time.
func TestOpenEnvShutdownMCP(t *testing.T) {
	b := setup(t, nil)
	sid := mcpCall(t, b, "plain", "openenv/session/create", nil)["result"].(map[string]any)["session_id"].(string)
	mcpCall(t, b, "plain", "tools/call", map[string]any{"session_id": sid, "name": "bash", "arguments": map[string]any{"command": "true"}})
	answers := make(chan map[string]any, 3)
	for range 3 {
		go func() {
			answers <- mcpCall(t, b, "plain", "tools/call", map[string]any{"session_id": sid, "name": "bash",
				"arguments": map[string]any{"command": "touch /tmp/started; sleep 50"}})
		}()
	}
	box, err := b.srv.Runtime().Get(b.srv.Pools().Leases()[0].ID())
	must(t, err)
	for deadline := time.Now().Add(30 * time.Second); ; time.Sleep(10 * time.Millisecond) { // a watchdog's poll
		if _, _, err := box.ReadFile(t.Context(), "/tmp/started", 0, 1); err == nil {
			break
		}
		if time.Now().After(deadline) {
			t.Fatal("the call did not start")
		}
	}
	start := time.Now()
	ctx, cancel := context.WithTimeout(t.Context(), 20*time.Second)
	defer cancel()
	must(t, b.srv.Close(ctx))
	if took := time.Since(start); took > 15*time.Second {
		t.Fatalf("the shutdown took %v with MCP calls running and waiting", took)
	}
	for range 3 {
		if a := <-answers; a["result"] != nil {
			t.Fatalf("a call answered a result across the shutdown: %v", a)
		}
	}
}

// An MCP session idle (no call, no socket) for the lease's TTL is closed, and found no more.
func TestOpenEnvMCPIdle(t *testing.T) {
	b := setup(t, func(c *server.Config) { c.Lease.TTL = 500 * time.Millisecond })
	sid := mcpCall(t, b, "plain", "openenv/session/create", nil)["result"].(map[string]any)["session_id"].(string)
	mcpCall(t, b, "plain", "tools/call", map[string]any{"session_id": sid, "name": "bash", "arguments": map[string]any{"command": "true"}})
	waitNoLeases(t, b) // the lease expires, unrenewed
	e, _ := mcpCall(t, b, "plain", "tools/call", map[string]any{"session_id": sid, "name": "bash", "arguments": map[string]any{"command": "true"}})["error"].(map[string]any)
	if e == nil || !strings.Contains(e["message"].(string), "idle") {
		t.Fatalf("a call on an idle session: %v", e)
	}
}

// A step past the env's step budget says which budget ended the episode.
func TestOpenEnvBudgetSpent(t *testing.T) {
	b := setup(t, nil)
	o := dialOpenEnv(t, b, "short")
	o.do("reset", nil)
	o.do("step", map[string]any{"command": "true"})
	if r := o.do("step", map[string]any{"command": "true"}); !r.Done || !r.Metadata.Truncated {
		t.Fatalf("the step that spends the budget: %+v", r)
	}
	if code, msg := o.fails(map[string]any{"type": "step", "data": map[string]any{"command": "true"}}); code != "EXECUTION_ERROR" || !strings.Contains(msg, "max_steps 2") {
		t.Fatalf("a step past the budget: %s %s", code, msg)
	}
}
