package server

import (
	"fmt"
	"log/slog"
	"net/http"
	"net/http/httputil"
	"net/url"
	"strings"

	"github.com/deltagym/deltagym/internal/nodeid"

	"github.com/deltagym/deltagym/server/swerex"
)

// mountSwerex serves the SWE-ReX front end (server/swerex), over the server's episode core, on
// mux at swerex.Prefix.
func (s *Server) mountSwerex(mux *http.ServeMux) {
	s.swerex = swerex.New(swerex.Config{Core: s.core, Logger: s.log, Message: s.message, Internal: isInternal,
		MaxBody: int64(s.cfg.MaxRequestBytes)})
	mux.Handle(swerex.Prefix, s.swerex)
}

// swerexFirst sends the SWE-ReX front end's paths (swerex.Owns) to it before mux sees them:
// mux answers an unclean path (/swerex/./x) with a redirect and /swerex with one to /swerex/,
// which SWE-ReX's client cannot read; the front end answers them in its error form. A path
// whose sandbox another node of the cluster holds goes to that node (swerexProxy): SWE-ReX's
// client follows no error to the right node.
func (s *Server) swerexFirst(mux http.Handler) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if swerex.Owns(r.URL.Path) && s.swerex != nil {
			if p := s.swerexProxy(r); p != nil {
				p.ServeHTTP(w, r)
				return
			}
			s.swerex.ServeHTTP(w, r)
			return
		}
		mux.ServeHTTP(w, r)
	})
}

// proxiedHeader marks a request one node passed to another, which answers it itself: a request
// is passed on once at most, whatever the nodes believe of each other.
const proxiedHeader = "Deltagym-Proxied-By"

// swerexProxy returns the reverse proxy of a SWE-ReX request to the node that holds its
// sandbox, when that is another node whose address this node knows (--peers); nil when this
// node answers it: its own sandbox, an ID of no node, a node it does not know (the front end
// then says WRONG_NODE), or a request another node passed on.
func (s *Server) swerexProxy(r *http.Request) http.Handler {
	if r.Header.Get(proxiedHeader) != "" {
		return nil
	}
	rest, _ := strings.CutPrefix(r.URL.Path, swerex.Prefix)
	id, _, _ := strings.Cut(rest, "/")
	owner := nodeid.Node(id)
	if owner == "" || owner == s.cfg.Cluster.Node {
		return nil
	}
	addr := s.peerAddr(owner)
	if addr == "" {
		return nil
	}
	target := &url.URL{Scheme: "http", Host: addr}
	node := s.cfg.Cluster.Node
	return &httputil.ReverseProxy{
		Rewrite: func(pr *httputil.ProxyRequest) {
			pr.SetURL(target)
			pr.Out.Host = addr
			pr.Out.Header.Set(proxiedHeader, node)
		},
		FlushInterval: -1, // read_file's content streams
		ErrorHandler: func(w http.ResponseWriter, _ *http.Request, err error) {
			swerex.WriteException(w, swerex.Unavailable, fmt.Sprintf("sandbox %s is on node %s (%s), which did not answer: %v", id, owner, addr, err),
				map[string]any{"code": "unavailable"})
		},
		ErrorLog: slog.NewLogLogger(s.log.Handler(), slog.LevelWarn),
	}
}
