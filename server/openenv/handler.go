package openenv

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"net/http"
	"strings"
	"sync"
	"time"

	"github.com/deltagym/deltagym/envpool"
	"github.com/deltagym/deltagym/internal/errdefs"
	"github.com/deltagym/deltagym/server/episode"
)

// Prefix is where the protocol is served: Prefix + "{env}/ws" and the rest.
const Prefix = "/openenv/"

// Config is what a Handler drives and how it reports.
type Config struct {
	Core  *episode.Core
	Pools *envpool.Manager
	Log   *slog.Logger
	// Describe is an error's message for a client (the server's, with host paths scrubbed and
	// internal errors reduced to a pointer at its log).
	Describe func(error) string
	// MaxMessageBytes bounds a frame or body a client sends.
	MaxMessageBytes int64
	// LeaseTTL is the sandboxes' lease TTL: sockets renew their sandbox's lease well within it,
	// and an MCP session idle (no call, no socket) past it is closed.
	LeaseTTL time.Duration
	// StepCap bounds a command's run (DefaultStepCap when 0): the step answers, timed out with
	// what the command printed, before the client stops waiting.
	StepCap time.Duration
	// MaxSessions bounds the open sessions (sockets and MCP sessions); a session past it is
	// refused with CAPACITY_REACHED.
	MaxSessions int
	// Node is the node's name, carried by the IDs of the MCP sessions it makes (as a
	// sandbox's by its ID: internal/nodeid), so that a node passes a call on another's session
	// to it. "": IDs of no node.
	Node string
}

// Handler serves OpenEnv's protocol for every env of the catalog, at Prefix + env.
type Handler struct {
	core *episode.Core
	cfg  Config
	log  *slog.Logger
	mux  *http.ServeMux

	mu sync.Mutex
	// +checklocks:mu
	sockets map[*socket]struct{}
	// +checklocks:mu
	own int // sockets with a session of their own (not attached to an MCP session)
	// +checklocks:mu
	mcp map[string]*mcpSession
	// +checklocks:mu
	closing bool
}

// New returns the handler.
func New(cfg Config) *Handler {
	if cfg.StepCap <= 0 {
		cfg.StepCap = DefaultStepCap
	}
	h := &Handler{core: cfg.Core, cfg: cfg, log: cfg.Log, sockets: map[*socket]struct{}{}, mcp: map[string]*mcpSession{}}
	if h.log == nil {
		h.log = slog.Default()
	}
	m := http.NewServeMux()
	m.HandleFunc("GET "+Prefix+"{env}/ws", h.serveWS)
	m.HandleFunc("GET "+Prefix+"{env}/health", h.health)
	m.HandleFunc("GET "+Prefix+"{env}/schema", h.schema)
	m.HandleFunc("GET "+Prefix+"{env}/metadata", h.metadata)
	m.HandleFunc("GET "+Prefix+"{env}/state", h.stateless)
	m.HandleFunc("POST "+Prefix+"{env}/reset", h.stateless)
	m.HandleFunc("POST "+Prefix+"{env}/step", h.stateless)
	m.HandleFunc("POST "+Prefix+"{env}/mcp", h.serveMCP)
	m.HandleFunc(Prefix, h.notFound)
	h.mux = m
	return h
}

// ServeHTTP serves a request under Prefix.
func (h *Handler) ServeHTTP(w http.ResponseWriter, r *http.Request) { h.mux.ServeHTTP(w, r) }

// Close ends every socket (with "going away") and session, closing their sandboxes, and
// refuses new ones. The HTTP server's shutdown does not wait for WebSockets: they are
// hijacked connections.
func (h *Handler) Close(ctx context.Context) {
	h.mu.Lock()
	h.closing = true
	socks := make([]*socket, 0, len(h.sockets))
	for s := range h.sockets {
		socks = append(socks, s)
	}
	sessions := make([]*mcpSession, 0, len(h.mcp))
	for _, m := range h.mcp {
		sessions = append(sessions, m)
	}
	h.mcp = map[string]*mcpSession{}
	h.mu.Unlock()
	// Every session's call in progress is aborted at once; the waits below end with ctx.
	for _, k := range socks {
		k.shutdown()
	}
	var wg sync.WaitGroup
	for _, m := range sessions {
		m.s.end()
		wg.Go(func() { m.s.close(ctx) })
	}
	closed := make(chan struct{})
	go func() {
		for _, k := range socks {
			<-k.done
		}
		wg.Wait()
		close(closed)
	}()
	select {
	case <-closed:
	case <-ctx.Done():
		h.log.Warn("OpenEnv sessions still closing at the end of the shutdown's time", "err", ctx.Err())
	}
}

// keepAliveEvery is how often a socket renews its sandbox's lease.
func (h *Handler) keepAliveEvery() time.Duration {
	return max(h.cfg.LeaseTTL/4, 50*time.Millisecond)
}

// admit counts a new session in, or says why not.
// +checklocks:h.mu
func (h *Handler) admitLocked() error {
	if h.closing {
		return errClosing
	}
	h.reapLocked()
	if max := h.cfg.MaxSessions; max > 0 && h.own+len(h.mcp) >= max {
		return errCapacity
	}
	return nil
}

var (
	errClosing  = fmt.Errorf("the server is shutting down: %w", errdefs.ErrUnavailable)
	errCapacity = fmt.Errorf("too many OpenEnv sessions are open on this server; close some, or raise the server's --openenv-max-sessions: %w",
		errdefs.ErrResourceExhausted)
)

// Error codes of OpenEnv's error frames.
const (
	codeInvalidJSON = "INVALID_JSON"
	codeUnknownType = "UNKNOWN_TYPE"
	codeValidation  = "VALIDATION_ERROR"
	codeExecution   = "EXECUTION_ERROR"
	codeCapacity    = "CAPACITY_REACHED"
	codeSession     = "SESSION_ERROR"
)

// codeOf is the error code of err: the caller's mistakes are VALIDATION_ERROR, a server or
// pool at its caps CAPACITY_REACHED, the rest EXECUTION_ERROR.
func codeOf(err error) string {
	switch {
	case errors.Is(err, errdefs.ErrInvalidArgument), errors.Is(err, envpool.ErrUnknownEnv):
		return codeValidation
	case errors.Is(err, errCapacity), errors.Is(err, errdefs.ErrResourceExhausted):
		return codeCapacity
	case errors.Is(err, errSessionClosed), errors.Is(err, errClosing):
		return codeSession
	}
	return codeExecution
}

// describe is err's message for a client.
func (h *Handler) describe(err error) string {
	if h.cfg.Describe != nil {
		return h.cfg.Describe(err)
	}
	return err.Error()
}

// errorData is the data of an error frame.
type errorData struct {
	Message string `json:"message"`
	Code    string `json:"code"`
}

// envOf checks that the path's env is in the catalog.
func (h *Handler) envOf(r *http.Request) (string, error) {
	name := r.PathValue("env")
	if _, err := h.cfg.Pools.Env(name); err != nil {
		return "", err
	}
	return name, nil
}

// writeJSON answers v with status.
func writeJSON(w http.ResponseWriter, status int, v any) {
	w.Header().Set("Content-Type", "application/json")
	w.WriteHeader(status)
	_ = json.NewEncoder(w).Encode(v)
}

// httpError answers err as OpenEnv's HTTP server does: {"detail": message}, with its code.
func (h *Handler) httpError(w http.ResponseWriter, err error) {
	status := http.StatusInternalServerError
	switch {
	case errors.Is(err, errdefs.ErrInvalidArgument):
		status = http.StatusUnprocessableEntity
	case errors.Is(err, errdefs.ErrNotFound):
		status = http.StatusNotFound
	case errors.Is(err, errCapacity), errors.Is(err, errdefs.ErrResourceExhausted):
		status = http.StatusServiceUnavailable
	case errors.Is(err, errdefs.ErrFailedPrecondition), errors.Is(err, errdefs.ErrAborted):
		status = http.StatusConflict
	case errors.Is(err, errClosing), errors.Is(err, errdefs.ErrUnavailable):
		status = http.StatusServiceUnavailable
	}
	writeJSON(w, status, map[string]any{"detail": h.describe(err), "code": codeOf(err)})
}

// endpoints are the paths below an env's, with the method each takes.
var endpoints = map[string]string{"ws": "GET", "health": "GET", "schema": "GET", "metadata": "GET", "state": "GET",
	"reset": "POST", "step": "POST", "mcp": "POST"}

// notFound answers what no endpoint serves: the list of envs at Prefix, 405 for an endpoint
// asked with the wrong method, 404 for the rest.
func (h *Handler) notFound(w http.ResponseWriter, r *http.Request) {
	if r.URL.Path == Prefix && r.Method == http.MethodGet {
		var envs []map[string]string
		for _, e := range h.cfg.Pools.Envs() {
			envs = append(envs, map[string]string{"name": e.Name(), "base_url": Prefix + e.Name(), "description": e.Spec().GetDescription()})
		}
		writeJSON(w, http.StatusOK, map[string]any{"envs": envs})
		return
	}
	const usage = "OpenEnv serves " + Prefix + "{env}/ws, /health, /schema, /metadata, /state (GET) and /reset, /step, /mcp (POST); GET " +
		Prefix + " lists the envs"
	rest, _ := strings.CutPrefix(r.URL.Path, Prefix)
	if _, ep, ok := strings.Cut(rest, "/"); ok && endpoints[ep] != "" && endpoints[ep] != r.Method {
		w.Header().Set("Allow", endpoints[ep])
		writeJSON(w, http.StatusMethodNotAllowed, map[string]any{"detail": fmt.Sprintf("%s takes %s, not %s: %s", r.URL.Path, endpoints[ep], r.Method, usage),
			"code": codeValidation})
		return
	}
	writeJSON(w, http.StatusNotFound, map[string]any{"detail": usage, "code": codeValidation})
}

// task is env's task text ("" for an env gone from the catalog).
func (h *Handler) task(env string) string {
	e, err := h.cfg.Pools.Env(env)
	if err != nil {
		return ""
	}
	return e.Task()
}
