package openenv

import (
	"bytes"
	"encoding/json"
	"errors"
	"io"
	"net/http"
	"strings"
)

// health answers AutoEnv's probe: the env is in the catalog (its pool may still be warming: a
// reset waits for it).
func (h *Handler) health(w http.ResponseWriter, r *http.Request) {
	name := r.PathValue("env")
	e, err := h.cfg.Pools.Env(name)
	if err != nil {
		h.httpError(w, err)
		return
	}
	if err := e.Err(); err != nil {
		writeJSON(w, http.StatusServiceUnavailable, map[string]any{"status": "unhealthy", "detail": h.describe(err)})
		return
	}
	writeJSON(w, http.StatusOK, map[string]any{"status": "healthy"})
}

// metadata is OpenEnv's EnvironmentMetadata of the env.
func (h *Handler) metadata(w http.ResponseWriter, r *http.Request) {
	e, err := h.cfg.Pools.Env(r.PathValue("env"))
	if err != nil {
		h.httpError(w, err)
		return
	}
	spec := e.Spec()
	writeJSON(w, http.StatusOK, map[string]any{"name": spec.GetName(), "description": spec.GetDescription(),
		"readme_content": spec.GetTask(), "version": "deltagym.v1", "author": "deltagym"})
}

func (h *Handler) schema(w http.ResponseWriter, r *http.Request) {
	if _, err := h.envOf(r); err != nil {
		h.httpError(w, err)
		return
	}
	writeJSON(w, http.StatusOK, schemas)
}

// stateless answers POST /reset, POST /step and GET /state as OpenEnv's HTTP servers do: each
// on an instance of its own, closed after it.
func (h *Handler) stateless(w http.ResponseWriter, r *http.Request) {
	env, err := h.envOf(r)
	if err != nil {
		h.httpError(w, err)
		return
	}
	if r.Method == http.MethodGet {
		// A fresh instance has no episode yet: leasing a sandbox to say so would be waste.
		writeJSON(w, http.StatusOK, map[string]any{"episode_id": nil, "step_count": 0, "env": env})
		return
	}
	body, err := io.ReadAll(http.MaxBytesReader(w, r.Body, h.cfg.MaxMessageBytes))
	if err != nil {
		h.httpError(w, invalid("reading the request body: %v", err))
		return
	}
	h.mu.Lock()
	err = h.admitLocked()
	if err == nil {
		h.own++ // a session while the request runs
	}
	h.mu.Unlock()
	if err != nil {
		h.httpError(w, err)
		return
	}
	s := h.newSession(env)
	defer func() {
		s.close(r.Context())
		h.mu.Lock()
		h.own--
		h.mu.Unlock()
	}()
	var res Result
	if strings.HasSuffix(r.URL.Path, "/reset") {
		var args map[string]json.RawMessage
		if args, err = kwargs(body); err == nil {
			res, err = s.reset(r.Context(), args)
		}
	} else {
		var action json.RawMessage
		if action, err = stepBody(body); err == nil {
			res, err = s.step(r.Context(), action)
		}
	}
	if err != nil {
		h.httpError(w, err)
		return
	}
	writeJSON(w, http.StatusOK, res)
}

// stepBody reads OpenEnv's StepRequest: {"action": {...}, "timeout_s", "request_id"}. A
// timeout_s bounds the command unless the action bounds it itself.
func stepBody(body []byte) (json.RawMessage, error) {
	var req struct {
		Action    map[string]json.RawMessage `json:"action"`
		TimeoutS  *float64                   `json:"timeout_s"`
		RequestID string                     `json:"request_id"`
	}
	dec := json.NewDecoder(bytes.NewReader(body))
	dec.DisallowUnknownFields()
	err := dec.Decode(&req)
	if err == nil && dec.More() {
		err = errors.New("more after the object")
	}
	if err != nil {
		return nil, invalid(`a step's body is {"action": {...}, "timeout_s": seconds, "request_id": "..."}: %v`, err)
	}
	if req.Action == nil {
		return nil, invalid(`a step's body has an "action" object`)
	}
	if _, ok := req.Action["timeout"]; !ok && req.TimeoutS != nil {
		req.Action["timeout"] = mustJSON(*req.TimeoutS)
	}
	return mustJSON(req.Action), nil
}
