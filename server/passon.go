package server

import (
	"bytes"
	"encoding/json"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"net/http/httputil"
	"net/url"
	"strings"

	"github.com/deltagym/deltagym/internal/nodeid"
	"github.com/deltagym/deltagym/server/openenv"
)

// The protocol front ends (SWE-ReX's, OpenEnv's) serve clients that know one address and follow
// no error to another: a request about a sandbox or session of another node of the cluster is
// passed on to that node, whose answer goes back as it comes.

// proxiedHeader marks a request one node passed to another, which answers it itself: a request
// is passed on once at most, whatever the nodes believe of each other.
const proxiedHeader = "Deltagym-Proxied-By"

// passOn returns the reverse proxy of r to the node that holds id (a sandbox's or an MCP
// session's ID), when that is another node whose address this node knows (--peers); nil when
// this node answers r: its own ID, an ID of no node, a node it does not know (the front end
// then says WRONG_NODE or not found), or a request another node passed on. unavailable answers
// in the front end's error form when that node does not answer.
func (s *Server) passOn(r *http.Request, id string, unavailable func(http.ResponseWriter, string)) http.Handler {
	if s.peers == nil || r.Header.Get(proxiedHeader) != "" {
		return nil
	}
	owner := nodeid.Node(id)
	if owner == "" || owner == s.cfg.Cluster.Node {
		return nil
	}
	addr := s.peerAddr(owner)
	if addr == "" {
		return nil
	}
	target := &url.URL{Scheme: "http", Host: addr}
	node, token := s.cfg.Cluster.Node, s.token
	return &httputil.ReverseProxy{
		Rewrite: func(pr *httputil.ProxyRequest) {
			pr.SetURL(target)
			pr.Out.Host = addr
			pr.Out.Header.Set(proxiedHeader, node)
			// The request passed this node's gate, however it carried the token (a header, an
			// X-API-Key, a /t/<token>/ prefix the gate stripped): it goes on with the cluster's
			// token in the header, and no other: an X-API-Key the gate did not look at (the URL's
			// token is checked first) would be the one the next node checks.
			if token != "" {
				pr.Out.Header.Set("Authorization", "Bearer "+token)
				pr.Out.Header.Del("X-API-Key")
			}
		},
		FlushInterval: -1, // answers that stream (SWE-ReX's read_file) go on as they come
		ErrorHandler: func(w http.ResponseWriter, _ *http.Request, err error) {
			unavailable(w, fmt.Sprintf("%s is on node %s (%s), which did not answer: %v", id, owner, addr, err))
		},
		ErrorLog: slog.NewLogLogger(s.log.Handler(), slog.LevelWarn),
	}
}

// openenvFirst passes OpenEnv's requests about an MCP session of another node on to that node
// (openenvProxy) and gives the rest to h.
func (s *Server) openenvFirst(h http.Handler) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if p := s.openenvProxy(r); p != nil {
			p.ServeHTTP(w, r)
			return
		}
		h.ServeHTTP(w, r)
	})
}

// openenvProxy returns the reverse proxy of an OpenEnv request that names an MCP session of
// another node: a WebSocket attaching to it (/openenv/{env}/ws?session_id=) or a JSON-RPC call
// on it (POST /openenv/{env}/mcp, session_id in its params); nil for any other request. The
// body of an MCP call is read (the server's request cap bounds it) and given back to whichever
// handler serves it.
func (s *Server) openenvProxy(r *http.Request) http.Handler {
	rest, ok := strings.CutPrefix(r.URL.Path, openenv.Prefix)
	if !ok || s.peers == nil || r.Header.Get(proxiedHeader) != "" {
		return nil // a node of no cluster reads no MCP body twice
	}
	_, endpoint, _ := strings.Cut(rest, "/")
	var id string
	switch {
	case endpoint == "ws":
		id = r.URL.Query().Get("session_id")
	case endpoint == "mcp" && r.Method == http.MethodPost && r.Body != nil:
		body, err := io.ReadAll(r.Body)
		r.Body = io.NopCloser(bytes.NewReader(body))
		if err != nil {
			return nil // the handler reads what is left and answers the error
		}
		var call struct {
			Params struct {
				SessionID string `json:"session_id"`
			} `json:"params"`
		}
		if json.Unmarshal(body, &call) != nil {
			return nil
		}
		id = call.Params.SessionID
	}
	if id == "" {
		return nil
	}
	return s.passOn(r, id, func(w http.ResponseWriter, msg string) {
		w.Header().Set("Content-Type", "application/json")
		w.WriteHeader(http.StatusServiceUnavailable)
		_ = json.NewEncoder(w).Encode(map[string]string{"detail": msg, "code": "NODE_UNAVAILABLE"})
	})
}
