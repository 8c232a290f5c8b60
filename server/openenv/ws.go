package openenv

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"sync"
	"sync/atomic"
	"time"

	"github.com/coder/websocket"

	"github.com/deltagym/deltagym/internal/errdefs"
)

// pingEvery is how often the server pings a socket, and how long it waits for the pong: a
// client gone without closing its connection frees its sandbox within twice that.
const pingEvery = 30 * time.Second

// A socket reads ahead of the frame being answered, so that it answers the client's pings during
// a long step: at most queuedFrames frames, and while they hold less than readAhead bytes; a
// large frame is read once those before it are answered. A socket so holds at most one large
// frame besides the one it answers.
const (
	queuedFrames = 4
	readAhead    = 1 << 20
)

// inbound is a frame read: its bytes, or, for a frame past the handler's limit (read and
// dropped), its size so far.
type inbound struct {
	buf      *bytes.Buffer
	tooLarge int64
}

// A socket is one WebSocket: one session, answered one frame at a time, in order.
type socket struct {
	h   *Handler
	c   *websocket.Conn
	s   *session
	mcp *mcpSession // the MCP session it is attached to, nil for a socket's own session
	// conn is the connection's life: reads and the close handshake run under it.
	conn       context.Context
	connCancel context.CancelFunc
	// ctx is the calls': it ends when the client goes away or the server shuts down, which
	// aborts the call in progress and ends run.
	ctx       context.Context
	cancel    context.CancelFunc
	goingAway atomic.Bool // the server shuts down
	// queued is the bytes of the frames read and not yet answered, pending their count;
	// answered signals the reader that one was.
	queued   atomic.Int64
	pending  atomic.Int32
	answered chan struct{}
	done     chan struct{} // closed once the socket is over and its session closed or detached
}

// frame is a message of either side.
type frame struct {
	Type string          `json:"type"`
	Data json.RawMessage `json:"data,omitempty"`
}

func (h *Handler) serveWS(w http.ResponseWriter, r *http.Request) {
	env := r.PathValue("env")
	_, refuse := h.cfg.Pools.Env(env)
	c, err := websocket.Accept(w, r, nil)
	if err != nil {
		return // Accept answered the request
	}
	c.SetReadLimit(-1) // read enforces the limit itself, answering a frame past it with an error
	k := &socket{h: h, c: c, done: make(chan struct{}), answered: make(chan struct{}, 1)}
	k.conn, k.connCancel = context.WithCancel(context.Background())
	k.ctx, k.cancel = context.WithCancel(k.conn)
	defer close(k.done)
	defer k.connCancel()
	if refuse == nil {
		refuse = h.attach(k, env, r.URL.Query().Get("session_id"))
	}
	if refuse != nil {
		k.refuse(refuse)
		return
	}
	k.run()
}

// attach admits k: with an MCP session's ID, to that session; else to a session of its own.
func (h *Handler) attach(k *socket, env, sid string) error {
	h.mu.Lock()
	defer h.mu.Unlock()
	if sid != "" {
		m := h.mcp[sid]
		switch {
		case h.closing:
			return errClosing
		case m == nil || m.s.env != env:
			return fmt.Errorf("%w: no MCP session %.64q on env %q (openenv/session/create makes one)", errSessionNotFound, sid, env)
		case m.socket != nil:
			return fmt.Errorf("MCP session %s already has a WebSocket attached: %w", sid, errdefs.ErrFailedPrecondition)
		}
		m.socket, k.mcp, k.s = k, m, m.s
	} else {
		if err := h.admitLocked(); err != nil {
			return err
		}
		k.s = h.newSession(env)
		h.own++
	}
	h.sockets[k] = struct{}{}
	return nil
}

// refuse answers a socket that gets no session: an error frame at once, and again to the
// client's first frame (a client whose first send fails on the closed socket reads the queued
// frame; one whose send succeeds reads the answer to it), then a close.
func (k *socket) refuse(err error) {
	ctx, cancel := context.WithTimeout(k.ctx, 10*time.Second)
	defer cancel()
	k.sendError(err)
	if _, r, rerr := k.c.Reader(ctx); rerr == nil {
		if _, rerr := io.Copy(io.Discard, r); rerr == nil {
			k.sendError(err)
		}
	}
	_ = k.c.Close(websocket.StatusPolicyViolation, truncateReason(k.h.describe(err)))
}

// run answers k's frames until the client closes, goes away, or the server shuts down; then
// closes k's own session (and its sandbox) or detaches k from its MCP session.
func (k *socket) run() {
	msgs := make(chan inbound, queuedFrames)
	go k.read(msgs)
	go k.ping()
	tick := time.NewTicker(k.h.keepAliveEvery())
	defer tick.Stop()
	defer k.end()
	for {
		select {
		case in, ok := <-msgs:
			if !ok {
				return
			}
			goOn := true
			if in.buf == nil {
				k.sendError(invalid("a frame of %d bytes, past the server's %d (--max-request-bytes): write a large file in parts (write_file with append)",
					in.tooLarge, k.h.cfg.MaxMessageBytes))
			} else {
				goOn = k.handle(in.buf.Bytes())
				k.queued.Add(-int64(in.buf.Len()))
				putBuffer(in.buf)
			}
			k.pending.Add(-1)
			select {
			case k.answered <- struct{}{}:
			default:
			}
			if !goOn {
				return
			}
		case <-tick.C:
			k.s.keepAlive()
		case <-k.ctx.Done():
			return
		}
	}
}

func (k *socket) read(msgs chan<- inbound) {
	defer close(msgs)
	for {
		for k.queued.Load() >= readAhead {
			select {
			case <-k.answered:
			case <-k.ctx.Done():
				return
			}
		}
		in, err := k.readFrame()
		if err != nil {
			k.cancel() // aborts the call in progress: nobody is left to answer
			return
		}
		k.pending.Add(1)
		select {
		case msgs <- in:
		case <-k.ctx.Done():
			if in.buf != nil {
				putBuffer(in.buf)
			}
			return
		}
	}
}

// readFrame reads the next frame; one past the limit is read to its end and dropped.
func (k *socket) readFrame() (inbound, error) {
	_, r, err := k.c.Reader(k.conn)
	if err != nil {
		return inbound{}, err
	}
	limit := k.h.cfg.MaxMessageBytes
	buf := getBuffer()
	n, err := buf.ReadFrom(io.LimitReader(r, limit+1))
	if err != nil {
		putBuffer(buf)
		return inbound{}, err
	}
	if n > limit {
		putBuffer(buf)
		m, err := io.Copy(io.Discard, r)
		return inbound{tooLarge: n + m}, err
	}
	k.queued.Add(n)
	return inbound{buf: buf}, nil
}

// buffers are the frames' buffers, read and written, used again: a step's frames are most of
// what the front end allocates.
var buffers = sync.Pool{New: func() any { return new(bytes.Buffer) }}

// maxPooled is the largest buffer kept for use again: a large write_file's frame is not kept.
const maxPooled = 64 << 10

func getBuffer() *bytes.Buffer {
	b := buffers.Get().(*bytes.Buffer)
	b.Reset()
	return b
}

func putBuffer(b *bytes.Buffer) {
	if b.Cap() <= maxPooled {
		buffers.Put(b)
	}
}

func (k *socket) ping() {
	t := time.NewTicker(pingEvery)
	defer t.Stop()
	for {
		select {
		case <-t.C:
			if k.pending.Load() > 0 {
				// The client is heard from: it sent what is being answered. Its pong may wait
				// behind frames the reader has not read yet.
				continue
			}
			ctx, cancel := context.WithTimeout(k.ctx, pingEvery)
			err := k.c.Ping(ctx)
			cancel()
			if err != nil {
				k.cancel()
				return
			}
		case <-k.ctx.Done():
			return
		}
	}
}

// end closes or detaches k's session and the socket.
func (k *socket) end() {
	k.cancel()
	h := k.h
	m := k.mcp // set by attach, before run
	var mid string
	if m != nil {
		mid = m.id
	}
	h.mu.Lock()
	delete(h.sockets, k)
	closeSession := m == nil
	if m == nil {
		h.own--
	}
	if m != nil {
		m.socket, m.used = nil, time.Now()
		if m.closing {
			delete(h.mcp, mid)
			closeSession = true
		}
	}
	h.mu.Unlock()
	if closeSession {
		k.s.close(context.Background())
	} else {
		k.s.keepAlive()
	}
	if k.goingAway.Load() {
		_ = k.c.Close(websocket.StatusGoingAway, "the server is shutting down")
	} else {
		_ = k.c.Close(websocket.StatusNormalClosure, "")
	}
	k.connCancel()
}

// shutdown ends k for a server that shuts down: the call in progress is aborted, the session
// closed, the client told.
func (k *socket) shutdown() {
	k.goingAway.Store(true)
	k.cancel()
}

// handle answers one frame; false ends the socket (a close frame).
func (k *socket) handle(data []byte) bool {
	var f frame
	if err := json.Unmarshal(data, &f); err != nil {
		k.send(frame{Type: "error", Data: mustJSON(errorData{Code: codeInvalidJSON,
			Message: fmt.Sprintf("the message is not a JSON object: %v", err)})})
		return true
	}
	switch f.Type {
	case "reset":
		args, err := kwargs(f.Data)
		if err != nil {
			k.sendError(err)
			return true
		}
		k.answer(k.s.reset(k.ctx, args))
	case "step":
		if tool, ok := toolAction(f.Data); ok {
			k.answerTool(tool)
			return true
		}
		k.answer(k.s.step(k.ctx, f.Data))
	case "state":
		st, err := k.s.state(k.ctx)
		if err != nil {
			k.sendError(err)
			return true
		}
		k.send(frame{Type: "state", Data: mustJSON(st)})
	case "mcp":
		if resp := k.h.rpc(k.ctx, k.s, f.Data); !resp.notification {
			k.send(frame{Type: "mcp", Data: mustJSON(resp)})
		}
	case "close":
		return false
	default:
		k.send(frame{Type: "error", Data: mustJSON(errorData{Code: codeUnknownType,
			Message: fmt.Sprintf("unknown message type %.64q: the types are reset, step, state, mcp and close", f.Type)})})
	}
	return true
}

// kwargs reads a reset's data: an object of keyword arguments, or nothing.
func kwargs(data json.RawMessage) (map[string]json.RawMessage, error) {
	if t := bytes.TrimSpace(data); len(t) == 0 || bytes.Equal(t, []byte("null")) {
		return nil, nil
	}
	var m map[string]json.RawMessage
	if err := json.Unmarshal(data, &m); err != nil {
		return nil, invalid("reset's data is an object of keyword arguments (seed, checkpoint_id, group_id, run, fresh_entropy, task options), not %.64s", data)
	}
	return m, nil
}

func (k *socket) answer(r Result, err error) {
	if err != nil {
		k.sendError(err)
		return
	}
	buf := getBuffer()
	defer putBuffer(buf)
	enc := json.NewEncoder(buf)
	enc.SetEscapeHTML(false) // text as it is: a model reads it
	if err := enc.Encode(observationFrame{Type: "observation", Data: &r}); err != nil {
		panic(fmt.Sprintf("openenv: encoding an observation: %v", err)) // the package's own types
	}
	k.write(buf.Bytes())
}

// observationFrame is the answer to a reset or step.
type observationFrame struct {
	Type string  `json:"type"`
	Data *Result `json:"data"`
}

func (k *socket) sendError(err error) {
	k.send(frame{Type: "error", Data: mustJSON(errorData{Code: codeOf(err), Message: k.h.describe(err)})})
}

// writeWait bounds a frame's write: a client that reads nothing for that long is gone.
const writeWait = 30 * time.Second

// write writes a text frame within the connection's life, not the calls': a write whose context
// ends closes the connection, and the answer to a call aborted by a shutdown is still to be sent.
func (k *socket) write(b []byte) {
	ctx, cancel := context.WithTimeout(k.conn, writeWait)
	defer cancel()
	if err := k.c.Write(ctx, websocket.MessageText, b); err != nil {
		k.cancel()
	}
}

func (k *socket) send(f frame) {
	// The frame is written around its data, which is JSON already: encoding the frame would
	// scan the data again.
	b := make([]byte, 0, len(f.Data)+len(f.Type)+20)
	b = append(b, `{"type":`...)
	b = append(b, mustJSON(f.Type)...)
	if len(f.Data) > 0 {
		b = append(b, `,"data":`...)
		b = append(b, f.Data...)
	}
	b = append(b, '}')
	k.write(b)
}

func mustJSON(v any) json.RawMessage {
	b, err := json.Marshal(v)
	if err != nil {
		panic(fmt.Sprintf("openenv: encoding %T: %v", v, err)) // only the package's own types are encoded
	}
	return b
}

// truncateReason fits a close reason in a control frame (123 bytes).
func truncateReason(s string) string {
	if len(s) > 120 {
		return s[:120]
	}
	return s
}
