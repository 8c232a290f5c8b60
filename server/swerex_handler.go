package server

import (
	"net/http"

	"github.com/deltagym/deltagym/server/swerex"
)

// mountSwerex serves the SWE-ReX front end (server/swerex), over the server's episode core, on
// mux at swerex.Prefix.
func (s *Server) mountSwerex(mux *http.ServeMux) {
	mux.Handle(swerex.Prefix, swerex.New(swerex.Config{Core: s.core, Logger: s.log, Message: s.message, Internal: isInternal,
		MaxBody: int64(s.cfg.MaxRequestBytes)}))
}
