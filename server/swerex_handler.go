package server

import (
	"net/http"
	"strings"

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

// swerexProxy returns the reverse proxy of a SWE-ReX request to the node that holds its
// sandbox (passOn); nil when this node answers it.
func (s *Server) swerexProxy(r *http.Request) http.Handler {
	rest, _ := strings.CutPrefix(r.URL.Path, swerex.Prefix)
	id, _, _ := strings.Cut(rest, "/")
	return s.passOn(r, id, func(w http.ResponseWriter, msg string) {
		swerex.WriteException(w, swerex.Unavailable, msg, map[string]any{"code": "unavailable"})
	})
}
