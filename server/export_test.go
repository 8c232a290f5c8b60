package server

import (
	"context"

	"github.com/deltagym/deltagym/sandbox"
	"github.com/deltagym/deltagym/server/episode"
	"github.com/deltagym/deltagym/server/ledger"
)

// Unexported functions the external tests use.
var (
	TraceExporter = traceExporter
)

// InfraFailure is episode.InfraFailure with the server's idea of an internal error.
func InfraFailure(ctx context.Context, box *sandbox.Sandbox, err error) (gone, infra bool) {
	return episode.InfraFailure(ctx, box, err, isInternal)
}

// PostgresMemoryLimit is postgresMemoryLimit, for tests.
func (c *Config) PostgresMemoryLimit() int64 { return c.postgresMemoryLimit() }

// RuntimeConfig is the sandbox runtime's config the admission flags give on host h.
func (a *Admission) RuntimeConfig(h sandbox.Host) sandbox.Config {
	var c sandbox.Config
	a.runtimeConfig(&c, h)
	return c
}

// LedgerWriter is the server's ledger writer (nil without a ledger), for tests that append a
// row no request can make.
func (s *Server) LedgerWriter() *ledger.Writer { return s.writer }
