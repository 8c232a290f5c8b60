package server_test

import (
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"strings"
	"testing"

	"github.com/coder/websocket"

	deltagymv1 "github.com/deltagym/deltagym/clients/go/gen/deltagym/v1"
	"github.com/deltagym/deltagym/internal/nodeid"
	"github.com/deltagym/deltagym/server"
)

// swerexCall sends a SWE-ReX request to the server at addr and returns its status and body.
func swerexCall(t *testing.T, addr, method, path, body, token string, header map[string]string) (int, string) {
	t.Helper()
	req, err := http.NewRequestWithContext(t.Context(), method, "http://"+addr+path, strings.NewReader(body))
	if err != nil {
		t.Fatal(err)
	}
	req.Header.Set("Content-Type", "application/json")
	if token != "" {
		req.Header.Set("X-API-Key", token)
	}
	for k, v := range header {
		req.Header.Set(k, v)
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	if err != nil {
		t.Fatal(err)
	}
	return resp.StatusCode, string(b)
}

// TestSwerexProxy: SWE-ReX's client, which follows no error to another node, reaches a sandbox
// of node A through node B: B passes the request on to A, whose answer it returns; a sandbox
// of a node B does not know gets WRONG_NODE in SWE-ReX's form, and a request already passed
// on is never passed on again.
func TestSwerexProxy(t *testing.T) {
	const token = "cluster-token"
	a := setup(t, func(c *server.Config) { c.Cluster.Node, c.AuthToken, c.NoLedger = "node-a", token, true })
	b := setup(t, func(c *server.Config) {
		c.Cluster.Node, c.AuthToken, c.NoLedger = "node-b", token, true
		c.Cluster.Peers = a.addr
	})
	ca := a.clients()[0].c
	rr, err := ca.Reset(t.Context(), &deltagymv1.ResetRequest{Env: "plain"})
	must(t, err)
	sb := rr.GetSandboxId()

	code, body := swerexCall(t, b.addr, http.MethodGet, "/swerex/"+sb+"/is_alive", "", token, nil)
	if code != http.StatusOK || !strings.Contains(body, `"is_alive":true`) {
		t.Fatalf("is_alive through node B: %d %s", code, body)
	}
	code, body = swerexCall(t, b.addr, http.MethodPost, "/swerex/"+sb+"/execute", `{"command": "echo via-b > /tmp/via; cat /tmp/via", "shell": true}`, token, nil)
	var out struct {
		Stdout   string `json:"stdout"`
		ExitCode int    `json:"exit_code"`
	}
	if code != http.StatusOK || json.Unmarshal([]byte(body), &out) != nil || out.Stdout != "via-b\n" || out.ExitCode != 0 {
		t.Fatalf("execute through node B: %d %s", code, body)
	}
	if got := run(t, ca, sb, "cat /tmp/via"); got != "via-b\n" {
		t.Fatalf("node A's sandbox after an execute through node B reads %q", got)
	}
	// A token in the URL, which the gate strips, goes on in the header.
	if code, body = swerexCall(t, b.addr, http.MethodGet, "/t/"+token+"/swerex/"+sb+"/is_alive", "", "", nil); code != http.StatusOK || !strings.Contains(body, `"is_alive":true`) {
		t.Fatalf("is_alive through node B with the token in the URL: %d %s", code, body)
	}
	// So does one whose client also sent an X-API-Key the gate did not look at (a token in the
	// URL is checked first): the next node, which looks at an X-API-Key first, sees the header.
	if code, body = swerexCall(t, b.addr, http.MethodGet, "/t/"+token+"/swerex/"+sb+"/is_alive", "", "stale", nil); code != http.StatusOK || !strings.Contains(body, `"is_alive":true`) {
		t.Fatalf("is_alive through node B with the token in the URL and another X-API-Key: %d %s", code, body)
	}
	// The token is still checked, by both nodes.
	if code, body = swerexCall(t, b.addr, http.MethodGet, "/swerex/"+sb+"/is_alive", "", "wrong", nil); code != 511 || !strings.Contains(body, "PermissionError") {
		t.Fatalf("is_alive through node B with a wrong token: %d %s", code, body)
	}
	// A request another node passed on is answered here: WRONG_NODE, not passed on again.
	code, body = swerexCall(t, b.addr, http.MethodGet, "/swerex/"+sb+"/is_alive", "", token, map[string]string{"Deltagym-Proxied-By": "node-z"})
	if code != 511 || !strings.Contains(body, "is on node node-a") {
		t.Fatalf("is_alive of node A's sandbox on node B, passed on already: %d %s", code, body)
	}
	far := nodeid.New("sb", "node-z")
	code, body = swerexCall(t, b.addr, http.MethodGet, "/swerex/"+far+"/is_alive", "", token, nil)
	if code != 511 || !strings.Contains(body, "node-z") {
		t.Fatalf("is_alive of a sandbox of a node B does not know: %d %s", code, body)
	}
}

// TestOpenEnvProxy: an MCP session made on node A is reachable through node B, whose calls on
// it (and a WebSocket attaching to it) go to A: a client behind a load balancer keeps its
// session whichever node its requests reach. Its ID names node A.
func TestOpenEnvProxy(t *testing.T) {
	const token = "cluster-token"
	a := setup(t, func(c *server.Config) { c.Cluster.Node, c.AuthToken, c.NoLedger = "node-a", token, true })
	b := setup(t, func(c *server.Config) {
		c.Cluster.Node, c.AuthToken, c.NoLedger = "node-b", token, true
		c.Cluster.Peers = a.addr
	})
	sid := mcpCall(t, a, "plain", "openenv/session/create", nil)["result"].(map[string]any)["session_id"].(string)
	if nodeid.Node(sid) != "node-a" {
		t.Fatalf("an MCP session of node A is %q", sid)
	}
	res := mcpCall(t, b, "plain", "tools/call", map[string]any{"session_id": sid, "name": "bash", "arguments": map[string]any{"command": "echo through-b > /tmp/t; cat /tmp/t"}})
	if out, _ := json.Marshal(res); !strings.Contains(string(out), "through-b") || res["error"] != nil {
		t.Fatalf("tools/call on node A's session through node B: %s", out)
	}
	res = mcpCall(t, a, "plain", "tools/call", map[string]any{"session_id": sid, "name": "bash", "arguments": map[string]any{"command": "cat /tmp/t"}})
	if out, _ := json.Marshal(res); !strings.Contains(string(out), "through-b") {
		t.Fatalf("node A's session after a call through node B: %s", out)
	}
	// A session of a node B does not know is not found there, as any unknown session.
	res = mcpCall(t, b, "plain", "tools/call", map[string]any{"session_id": nodeid.New("os", "node-z"), "name": "bash", "arguments": map[string]any{"command": "true"}})
	if res["error"] == nil {
		t.Fatalf("tools/call on a session of an unknown node: %v", res)
	}
	// A WebSocket through node B attaches to node A's session.
	ws, resp, err := websocket.Dial(t.Context(), "ws://"+b.addr+"/openenv/plain/ws?session_id="+sid,
		&websocket.DialOptions{HTTPHeader: http.Header{"Authorization": {"Bearer " + token}}})
	if resp != nil && resp.Body != nil {
		resp.Body.Close()
	}
	must(t, err)
	if r := (&oeSocket{t, ws}).do("step", map[string]any{"command": "cat /tmp/t"}); !strings.Contains(fmt.Sprint(r.Observation), "through-b") {
		t.Fatalf("a step on node A's session through a socket to node B: %v", r.Observation)
	}
	ws.CloseNow()
	// A reset from node A's checkpoint on a socket of node B: B fetches the checkpoint first.
	ca := a.clients()[0].c
	rr, err := ca.Reset(t.Context(), &deltagymv1.ResetRequest{Env: "plain"})
	must(t, err)
	run(t, ca, rr.GetSandboxId(), "echo from-a > /tmp/from")
	ck, err := ca.Checkpoint(t.Context(), &deltagymv1.CheckpointRequest{SandboxId: rr.GetSandboxId()})
	must(t, err)
	onB := dialOpenEnv(t, b, "plain")
	onB.do("reset", map[string]any{"checkpoint_id": ck.GetCheckpointId()})
	if r := onB.do("step", map[string]any{"command": "cat /tmp/from"}); !strings.Contains(fmt.Sprint(r.Observation), "from-a") {
		t.Fatalf("a step after a reset on node B from node A's checkpoint: %v", r.Observation)
	}
	closed := mcpCall(t, b, "plain", "openenv/session/close", map[string]any{"session_id": sid})
	if out, _ := json.Marshal(closed); closed["error"] != nil || !strings.Contains(string(out), sid) {
		t.Fatalf("openenv/session/close of node A's session through node B: %s", out)
	}
}
