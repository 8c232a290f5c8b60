package openenv

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"sort"
	"strings"
	"time"

	"github.com/deltagym/deltagym/internal/errdefs"
	"github.com/deltagym/deltagym/internal/nodeid"
)

// An mcpSession is a session made by openenv/session/create: it lives until
// openenv/session/close, or until it has been idle (no call, no socket) for a lease's TTL, and
// at most one WebSocket attaches to it at a time (/ws?session_id=).
type mcpSession struct {
	id string // immutable
	s  *session
	// The fields below are guarded by Handler.mu, which checklocks cannot name from here.

	// socket is the WebSocket attached, nil for none.
	// +checklocksignore
	socket *socket
	// used is when a call last touched the session.
	// +checklocksignore
	used time.Time
	// closing asks the attached socket to close the session when it ends.
	// +checklocksignore
	closing bool
}

var errSessionNotFound = fmt.Errorf("session not found: %w", errdefs.ErrNotFound)

// JSON-RPC 2.0's error codes.
const (
	rpcParse          = -32700
	rpcInvalidRequest = -32600
	rpcNoMethod       = -32601
	rpcInvalidParams  = -32602
	rpcServer         = -32000
)

type rpcRequest struct {
	JSONRPC string          `json:"jsonrpc"`
	Method  string          `json:"method"`
	Params  json.RawMessage `json:"params,omitempty"`
	ID      json.RawMessage `json:"id,omitempty"`
}

type rpcResponse struct {
	JSONRPC string          `json:"jsonrpc"`
	ID      json.RawMessage `json:"id"`
	Result  any             `json:"result,omitempty"`
	Error   *rpcError       `json:"error,omitempty"`
	// notification says the request had no id: nothing is sent back.
	notification bool
}

type rpcError struct {
	Code    int    `json:"code"`
	Message string `json:"message"`
	// Data carries OpenEnv's error code.
	Data *errorData `json:"data,omitempty"`
}

// serveMCP answers a JSON-RPC request (HTTP 200 for the protocol's own errors, as JSON-RPC over
// HTTP does).
func (h *Handler) serveMCP(w http.ResponseWriter, r *http.Request) {
	env, err := h.envOf(r)
	if err != nil {
		h.httpError(w, err)
		return
	}
	body, err := io.ReadAll(http.MaxBytesReader(w, r.Body, h.cfg.MaxMessageBytes))
	if err != nil {
		writeJSON(w, http.StatusRequestEntityTooLarge, rpcResponse{JSONRPC: "2.0", ID: json.RawMessage("null"),
			Error: &rpcError{Code: rpcInvalidRequest, Message: fmt.Sprintf("reading the request: %v", err)}})
		return
	}
	resp := h.rpcEnv(r.Context(), env, body)
	if resp.notification {
		// JSON-RPC answers no notification (a request without an id), MCP's
		// notifications/initialized among them.
		w.WriteHeader(http.StatusAccepted)
		return
	}
	writeJSON(w, http.StatusOK, resp)
}

// rpcEnv answers a JSON-RPC request on env's /mcp, whose session is named by its params.
func (h *Handler) rpcEnv(ctx context.Context, env string, body []byte) rpcResponse {
	req, resp, ok := decodeRPC(body)
	if !ok {
		return resp
	}
	var p struct {
		SessionID string `json:"session_id"`
	}
	_ = json.Unmarshal(req.Params, &p)
	switch req.Method {
	case "openenv/session/create":
		id, err := h.createMCP(env)
		return h.reply(resp, map[string]any{"session_id": id}, err)
	case "openenv/session/close":
		closed, err := h.closeMCP(ctx, env, p.SessionID)
		return h.reply(resp, map[string]any{"session_id": p.SessionID, "closed": closed, "closing": !closed}, err)
	case "tools/call":
		m, err := h.useMCP(env, p.SessionID)
		if err != nil {
			return h.reply(resp, nil, err)
		}
		return h.call(ctx, m.s, req, resp)
	}
	return h.dispatch(ctx, nil, req, resp)
}

// rpc answers a JSON-RPC request sent on a socket (a frame of type mcp), on that socket's
// session.
func (h *Handler) rpc(ctx context.Context, s *session, body []byte) rpcResponse {
	req, resp, ok := decodeRPC(body)
	if !ok {
		return resp
	}
	if req.Method == "tools/call" {
		return h.call(ctx, s, req, resp)
	}
	return h.dispatch(ctx, s, req, resp)
}

func decodeRPC(body []byte) (rpcRequest, rpcResponse, bool) {
	var req rpcRequest
	resp := rpcResponse{JSONRPC: "2.0", ID: json.RawMessage("null")}
	if err := json.Unmarshal(body, &req); err != nil {
		resp.Error = &rpcError{Code: rpcParse, Message: fmt.Sprintf("the request is not JSON-RPC 2.0 (a JSON object): %v", err)}
		return req, resp, false
	}
	hasID := len(req.ID) > 0 && string(req.ID) != "null"
	if hasID {
		resp.ID = req.ID
	}
	if req.JSONRPC != "2.0" || req.Method == "" {
		resp.Error = &rpcError{Code: rpcInvalidRequest, Message: `a JSON-RPC request has "jsonrpc": "2.0" and a method`}
		return req, resp, false
	}
	if !hasID {
		// A request without an id is a notification: JSON-RPC answers none.
		resp.notification = true
		return req, resp, false
	}
	return req, resp, true
}

// dispatch answers the methods that need no session of the request's own.
func (h *Handler) dispatch(ctx context.Context, s *session, req rpcRequest, resp rpcResponse) rpcResponse {
	switch req.Method {
	case "initialize":
		return h.reply(resp, map[string]any{"protocolVersion": "2025-06-18", "capabilities": map[string]any{"tools": map[string]any{}},
			"serverInfo": map[string]any{"name": "deltagym", "version": "1"}}, nil)
	case "tools/list":
		return h.reply(resp, map[string]any{"tools": tools}, nil)
	case "ping":
		return h.reply(resp, map[string]any{}, nil)
	}
	resp.Error = &rpcError{Code: rpcNoMethod, Message: fmt.Sprintf("no method %.64q: the methods are initialize, tools/list, tools/call, openenv/session/create and openenv/session/close", req.Method)}
	return resp
}

func (h *Handler) reply(resp rpcResponse, result any, err error) rpcResponse {
	if err != nil {
		code := rpcServer
		if errors.Is(err, errdefs.ErrInvalidArgument) || errors.Is(err, errSessionNotFound) {
			code = rpcInvalidParams
		}
		msg := h.describe(err)
		resp.Error = &rpcError{Code: code, Message: msg, Data: &errorData{Code: codeOf(err), Message: msg}}
		return resp
	}
	resp.Result = result
	return resp
}

// call runs a tool on s: the tool's arguments become an action, and its answer is MCP's
// content with the observation as structured data.
func (h *Handler) call(ctx context.Context, s *session, req rpcRequest, resp rpcResponse) rpcResponse {
	var p struct {
		Name      string          `json:"name"`
		Arguments json.RawMessage `json:"arguments"`
	}
	if err := json.Unmarshal(req.Params, &p); err != nil {
		return h.reply(resp, nil, invalid("tools/call's params are {name, arguments, session_id}: %v", err))
	}
	raw, err := toolArgs(p.Name, p.Arguments)
	if err != nil {
		return h.reply(resp, nil, err)
	}
	res, err := s.step(ctx, raw)
	if err != nil {
		return h.reply(resp, nil, err)
	}
	return h.reply(resp, toolResult(res), nil)
}

// toolResult is MCP's answer to a tool call: the output as text, and the observation as data.
func toolResult(r Result) map[string]any {
	o := r.Observation
	var text string
	failed := o.Error != ""
	switch {
	case o.Error != "":
		text = o.Error
	case o.Stdout != nil:
		// What a model reads is this text: a failure is said in it, not only in data.
		text = *o.Stdout + *o.Stderr
		switch {
		case o.TimedOut:
			text += fmt.Sprintf("\n[timed out after %.1f s: killed]", o.Duration)
			failed = true
		case o.Signal != "":
			text += "\n[killed by " + o.Signal + "]"
			failed = true
		case o.ExitCode != nil && *o.ExitCode != 0:
			text += fmt.Sprintf("\n[exit code %d]", *o.ExitCode)
			failed = true
		}
	case o.Content != nil:
		text = *o.Content
	default:
		b, _ := json.Marshal(o)
		text = string(b)
	}
	// The data is the observation with the step's reward and done beside its fields: what a tool
	// caller reads first (stdout, content, checkpoint_id) is at the top.
	data := toolData{Observation: o, Reward: r.Reward, Done: r.Done}
	return map[string]any{"content": []map[string]any{{"type": "text", "text": text}}, "isError": failed, "data": data}
}

// toolData is a tool call's structured answer: the observation's fields, with the step's reward
// and done among them (JSON flattens the embedded observation).
type toolData struct {
	Observation
	Reward float64 `json:"reward"`
	Done   bool    `json:"done"`
}

// createMCP makes a session of env.
func (h *Handler) createMCP(env string) (string, error) {
	id := nodeid.New("os", h.cfg.Node)
	m := &mcpSession{id: id, s: h.newSession(env), used: time.Now()}
	h.mu.Lock()
	defer h.mu.Unlock()
	if err := h.admitLocked(); err != nil {
		return "", err
	}
	h.mcp[id] = m
	return id, nil
}

// reapLocked forgets the MCP sessions idle past a lease's TTL with no socket (their sandboxes'
// leases have expired too) and closes them.
// +checklocks:h.mu
func (h *Handler) reapLocked() {
	for id, m := range h.mcp {
		if h.idleLocked(m) {
			delete(h.mcp, id)
			go m.s.close(context.Background())
		}
	}
}

// idleLocked says m has had no call and no socket for a lease's TTL.
// +checklocks:h.mu
func (h *Handler) idleLocked(m *mcpSession) bool {
	return m.socket == nil && time.Since(m.used) > h.cfg.LeaseTTL
}

// useMCP finds session id of env and marks it used.
func (h *Handler) useMCP(env, id string) (*mcpSession, error) {
	h.mu.Lock()
	defer h.mu.Unlock()
	m := h.mcp[id]
	if id == "" {
		return nil, invalid("tools/call needs the session_id that openenv/session/create returned")
	}
	if m != nil && h.idleLocked(m) {
		delete(h.mcp, id)
		go m.s.close(context.Background())
		m = nil
	}
	switch {
	case m == nil || m.s.env != env:
		return nil, fmt.Errorf("%w: no MCP session %.64q on env %q (openenv/session/create makes one; a session idle for the lease's TTL is closed)",
			errSessionNotFound, id, env)
	case m.closing:
		return nil, fmt.Errorf("MCP session %s is closing (openenv/session/close): it takes no more calls: %w", id, errdefs.ErrFailedPrecondition)
	}
	m.used = time.Now()
	return m, nil
}

// closeMCP closes session id, or, with a socket attached, has the socket close it when it
// ends; it says which.
func (h *Handler) closeMCP(ctx context.Context, env, id string) (bool, error) {
	h.mu.Lock()
	m := h.mcp[id]
	if m == nil || m.s.env != env {
		h.mu.Unlock()
		return false, fmt.Errorf("%w: no MCP session %.64q on env %q", errSessionNotFound, id, env)
	}
	if m.socket != nil {
		m.closing = true
		h.mu.Unlock()
		return false, nil
	}
	delete(h.mcp, id)
	h.mu.Unlock()
	m.s.close(ctx)
	return true, nil
}

// toolAction recognises the MCP actions that OpenEnv's MCP client steps with over a socket:
// {"type": "list_tools"} and {"type": "call_tool", "tool_name", "arguments"}.
func toolAction(data json.RawMessage) (mcpAction, bool) {
	if !bytes.Contains(data, []byte(`"type"`)) {
		return mcpAction{}, false
	}
	var a mcpAction
	if json.Unmarshal(data, &a) != nil || (a.Type != "list_tools" && a.Type != "call_tool") {
		return mcpAction{}, false
	}
	return a, true
}

type mcpAction struct {
	Type      string          `json:"type"`
	ToolName  string          `json:"tool_name"`
	Arguments json.RawMessage `json:"arguments"`
}

// answerTool answers an MCP action stepped over a socket, as OpenEnv's MCP observations.
func (k *socket) answerTool(a mcpAction) {
	if a.Type == "list_tools" {
		k.send(frame{Type: "observation", Data: mustJSON(map[string]any{"observation": map[string]any{"tools": tools}, "reward": 0, "done": false})})
		return
	}
	obs := map[string]any{"tool_name": a.ToolName}
	var res Result
	raw, err := toolArgs(a.ToolName, a.Arguments)
	if err == nil {
		res, err = k.s.step(k.ctx, raw)
	}
	if err != nil {
		obs["error"] = map[string]any{"error_type": codeOf(err), "message": k.h.describe(err)}
	} else {
		obs["result"] = toolResult(res)
		obs["metadata"] = res.Metadata
	}
	k.send(frame{Type: "observation", Data: mustJSON(map[string]any{"observation": obs, "reward": res.Reward, "done": res.Done})})
}

// toolArgs turns a tool's arguments into the action it stands for.
func toolArgs(name string, args json.RawMessage) (json.RawMessage, error) {
	var m map[string]json.RawMessage
	if t := bytes.TrimSpace(args); len(t) > 0 && !bytes.Equal(t, []byte("null")) {
		if err := json.Unmarshal(args, &m); err != nil {
			return nil, invalid("tool %.64q's arguments are an object, not %.64s", name, args)
		}
	}
	if m == nil {
		m = map[string]json.RawMessage{}
	}
	if t, ok := toolNamed(name); ok {
		props, _ := t.InputSchema["properties"].(obj)
		for k := range m {
			if _, known := props[k]; !known {
				return nil, invalid("tool %s takes no argument %.64q (its arguments: %s)", name, k, strings.Join(sortedKeys(props), ", "))
			}
		}
	}
	a := map[string]json.RawMessage{"command": json.RawMessage(`""`)}
	take := func(keys ...string) {
		for _, k := range keys {
			if v, ok := m[k]; ok {
				a[k] = v
			}
		}
	}
	switch name {
	case "bash":
		take("command", "timeout", "cwd", "env", "session")
	case "write_file":
		a["write_file"] = mustJSON(m)
	case "read_file":
		a["read_file"] = mustJSON(m)
	case "submit":
		a["submit"] = json.RawMessage("true")
		if v, ok := m["answer"]; ok {
			a["submit"] = v
		}
	case "checkpoint":
		a["checkpoint"] = json.RawMessage("true")
	case "restore":
		id, ok := m["checkpoint_id"]
		if !ok {
			return nil, invalid("tool restore needs checkpoint_id, the checkpoint to restore")
		}
		a["restore"] = id
		take("fresh_entropy")
	case "evaluate":
		a["evaluate"] = json.RawMessage("true")
	default:
		names := make([]string, len(tools))
		for i, t := range tools {
			names[i] = t.Name
		}
		return nil, invalid("no tool %.64q: the tools are %s", name, strings.Join(names, ", "))
	}
	return mustJSON(a), nil
}

func toolNamed(name string) (tool, bool) {
	for _, t := range tools {
		if t.Name == name {
			return t, true
		}
	}
	return tool{}, false
}

func sortedKeys(m obj) []string {
	keys := make([]string, 0, len(m))
	for k := range m {
		keys = append(keys, k)
	}
	sort.Strings(keys)
	return keys
}
