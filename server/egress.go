package server

import (
	"context"

	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/metric"

	"github.com/deltagym/deltagym/sandbox/egress"
	"github.com/deltagym/deltagym/server/ledger"
)

// egressRecorder records each connection through the egress proxy in the ledger (table egress)
// and the metrics deltagym_egress_connections_total and deltagym_egress_bytes_total.
type egressRecorder struct {
	s     *Server
	conns metric.Int64Counter
	bytes metric.Int64Counter
}

var _ egress.Recorder = (*egressRecorder)(nil)

// newEgress makes the proxy that envs with an egress allow-list use.
func (s *Server) newEgress() (*egress.Proxy, error) {
	m := s.obs.meterProvider.Meter("github.com/deltagym/deltagym/server")
	r := &egressRecorder{s: s}
	var err error
	if r.conns, err = m.Int64Counter("deltagym.egress.connections",
		metric.WithDescription("connections of sandboxes through the egress proxy, by env and result (allowed, refused)")); err != nil {
		return nil, err
	}
	if r.bytes, err = m.Int64Counter("deltagym.egress.bytes", metric.WithUnit("By"),
		metric.WithDescription("bytes through the egress proxy, by env and direction (up: from the sandbox)")); err != nil {
		return nil, err
	}
	return egress.New(egress.Config{Resolver: s.cfg.EgressResolver, Recorder: r, Log: s.log})
}

// Egress implements egress.Recorder: the row names the episode running in the sandbox, if any
// (none while an env's pool is being set up).
func (r *egressRecorder) Egress(rec egress.Record) {
	result := "refused"
	if rec.Allowed {
		result = "allowed"
	}
	ctx := context.Background()
	env := attribute.String("env", rec.Env)
	r.conns.Add(ctx, 1, metric.WithAttributes(env, attribute.String("result", result)))
	if rec.Allowed {
		r.bytes.Add(ctx, rec.BytesUp, metric.WithAttributes(env, attribute.String("direction", "up")))
		r.bytes.Add(ctx, rec.BytesDown, metric.WithAttributes(env, attribute.String("direction", "down")))
	}
	s := r.s
	if s.writer == nil {
		return
	}
	var episodeID string
	if s.core != nil {
		if info, err := s.core.Sandbox(rec.Sandbox); err == nil {
			episodeID = info.EpisodeID
		}
	}
	row := ledger.EgressRow{Env: rec.Env, Sandbox: rec.Sandbox, EpisodeID: episodeID, Host: rec.Host, Port: int(rec.Port),
		Allowed: rec.Allowed, Reason: rec.Reason, BytesUp: rec.BytesUp, BytesDown: rec.BytesDown,
		StartedAt: rec.Start, Duration: rec.Duration}
	if rec.Addr.IsValid() {
		row.Address = rec.Addr.String()
	}
	s.ledgerErr(s.writer.Egress(row))
}
