package swerex

import (
	"context"
	"log/slog"
	"net/http"
	"regexp"
	"strings"
	"sync"
	"time"

	"github.com/deltagym/deltagym/sandbox"
	"github.com/deltagym/deltagym/server/episode"
)

// Prefix is the path the handler serves: /swerex/{sandbox_id}/{endpoint}.
const Prefix = "/swerex/"

// Config configures a Handler.
type Config struct {
	// Core is the episode core whose sandboxes the handler drives. Required.
	Core *episode.Core
	// Logger receives internal errors. Default slog.Default().
	Logger *slog.Logger
	// Message is an error's text for a client (host paths scrubbed, errdefs.Strip). Default:
	// its Error().
	Message func(error) string
	// Internal reports whether an error is the server's own fault. Default episode.Internal.
	Internal func(error) bool
	// MaxBody bounds a request's body. Default: the sandbox's file cap and 1 MiB.
	MaxBody int64
}

// Handler serves SWE-ReX's HTTP API (that of swe-rex 1.4.0's server, swerex/server.py) for each
// sandbox that the episode core handed out: RemoteRuntime(host="http://HOST:PORT/swerex/ID")
// drives sandbox ID. Every command and file action it asks for is a Step of the sandbox's
// episode, recorded in the ledger with its output; /close closes the sandbox as the API's
// Close does. Errors take SWE-ReX's form (statusException), which its client raises as the
// exceptions its own server's would be.
type Handler struct {
	cfg  Config
	core *episode.Core
	log  *slog.Logger

	mu sync.Mutex
	// +checklocks:mu
	sessions map[string]map[string]*shell // by sandbox id, the sessions created and not closed
}

// New returns a Handler.
func New(cfg Config) *Handler {
	if cfg.Logger == nil {
		cfg.Logger = slog.Default()
	}
	if cfg.Message == nil {
		cfg.Message = func(err error) string { return err.Error() }
	}
	if cfg.Internal == nil {
		cfg.Internal = episode.Internal
	}
	if cfg.MaxBody <= 0 {
		cfg.MaxBody = sandbox.MaxFileBytes + 1<<20
	}
	return &Handler{cfg: cfg, core: cfg.Core, log: cfg.Logger, sessions: map[string]map[string]*shell{}}
}

// call is one request to a sandbox's endpoint.
type call struct {
	w   http.ResponseWriter
	r   *http.Request
	ctx context.Context
	id  string // the sandbox
}

// endpoints are the handler's, each with its method.
var endpoints = map[string]struct {
	method string
	serve  func(*Handler, *call) (any, error)
}{
	"":               {http.MethodGet, (*Handler).root},
	"is_alive":       {http.MethodGet, (*Handler).isAlive},
	"create_session": {http.MethodPost, (*Handler).createSession},
	"run_in_session": {http.MethodPost, (*Handler).runInSession},
	"close_session":  {http.MethodPost, (*Handler).closeSession},
	"execute":        {http.MethodPost, (*Handler).execute},
	"read_file":      {http.MethodPost, (*Handler).readFile},
	"write_file":     {http.MethodPost, (*Handler).writeFile},
	"upload":         {http.MethodPost, (*Handler).upload},
	"close":          {http.MethodPost, (*Handler).close},
}

// sandboxIDRE is what a sandbox id may be (the episode core checks it again).
var sandboxIDRE = regexp.MustCompile(`^[A-Za-z0-9_.-]{1,128}$`)

// ServeHTTP serves /swerex/{sandbox_id}/{endpoint}.
func (h *Handler) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	rest, _ := strings.CutPrefix(r.URL.Path, Prefix)
	id, endpoint, _ := strings.Cut(rest, "/")
	if !sandboxIDRE.MatchString(id) || id == "." || id == ".." {
		WriteException(w, excValue, "the path is /swerex/{sandbox_id}/{endpoint}, with the id of a sandbox that Reset or Fork handed out; "+
			"give RemoteRuntime host=\"http://HOST:PORT/swerex/SANDBOX_ID\" and port=None", map[string]any{"code": "invalid_argument"})
		return
	}
	e, ok := endpoints[endpoint]
	if !ok {
		WriteException(w, excValue, "no endpoint /"+endpoint+" here: the SWE-ReX API has /is_alive, /create_session, /run_in_session, "+
			"/close_session, /execute, /read_file, /write_file, /upload and /close", map[string]any{"code": "not_found"})
		return
	}
	if r.Method != e.method && (e.method != http.MethodGet || r.Method != http.MethodHead) {
		WriteException(w, excValue, "/"+endpoint+" takes "+e.method+", not "+r.Method, map[string]any{"code": "invalid_argument"})
		return
	}
	out, err := e.serve(h, &call{w: w, r: r, ctx: r.Context(), id: id})
	if err != nil {
		h.writeError(w, r, err)
		return
	}
	if a, ok := out.(streamed); ok {
		a.writeJSON(w)
		return
	}
	writeJSON(w, out)
}

// streamed is an answer that writes its JSON itself, as it goes (read_file's content).
type streamed interface{ writeJSON(http.ResponseWriter) }

// Owns reports whether path is the handler's: Prefix and what is under it, and Prefix without
// its slash (which the handler answers in SWE-ReX's form, as it does unclean paths under it).
func Owns(path string) bool {
	return strings.HasPrefix(path, Prefix) || path == strings.TrimSuffix(Prefix, "/")
}

// root answers what SWE-ReX's server answers at its root, for a sandbox that is there.
func (h *Handler) root(c *call) (any, error) {
	if _, err := h.core.Touch(c.id); err != nil {
		return nil, err
	}
	return map[string]string{"message": "hello world"}, nil
}

// isAlive says the sandbox is there and renews its lease; a sandbox that is not is an error
// (the client raises it, rather than waiting for a sandbox that will not come).
func (h *Handler) isAlive(c *call) (any, error) {
	if _, err := h.core.Touch(c.id); err != nil {
		return nil, err
	}
	return isAliveResponse{IsAlive: true}, nil
}

// close closes the sandbox: its episode is truncated and the sandbox freed, as by the API's
// Close.
func (h *Handler) close(c *call) (any, error) {
	if err := h.core.Close(c.ctx, c.id); err != nil {
		return nil, err
	}
	h.mu.Lock()
	delete(h.sessions, c.id)
	h.mu.Unlock()
	return empty{}, nil
}

// step performs action a as a step of the sandbox's episode.
func (h *Handler) step(c *call, a episode.Action) (episode.StepResult, error) {
	return h.core.Step(c.ctx, episode.StepRequest{SandboxID: c.id, Action: a})
}

// seconds converts a client's timeout in seconds (nil: the env's step timeout); one under a
// nanosecond is a nanosecond, not 0 (which would be the env's whole step timeout).
func seconds(field string, t *float64) (time.Duration, error) {
	if t == nil {
		return 0, nil
	}
	if !(*t > 0) || *t > 1e6 {
		return 0, invalid("%s %v is not a number of seconds above 0 (null: the env's step timeout)", field, *t)
	}
	return max(time.Duration(*t*float64(time.Second)), time.Nanosecond), nil
}
