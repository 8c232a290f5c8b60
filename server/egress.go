package server

import (
	"context"
	"flag"
	"fmt"
	"math"
	"strconv"
	"time"

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
	return egress.New(egress.Config{Resolver: s.cfg.Egress.Resolver, Recorder: r, Limits: egressLimits(s.cfg.Egress.Limits), Log: s.log})
}

// egressLimits are the limits in force of a config's Config.Egress.Limits: a field left 0 is
// egress.DefaultLimits's, a negative one bounds nothing (0 in egress.Limits).
func egressLimits(c egress.Limits) egress.Limits {
	d := egress.DefaultLimits()
	pick := func(v, def int64) int64 {
		switch {
		case v < 0:
			return 0
		case v == 0:
			return def
		}
		return v
	}
	l := egress.Limits{
		MaxConns:           int(pick(int64(c.MaxConns), int64(d.MaxConns))),
		ConnBurst:          int(pick(int64(c.ConnBurst), int64(d.ConnBurst))),
		MaxBytesUp:         pick(c.MaxBytesUp, d.MaxBytesUp),
		MaxBytesDown:       pick(c.MaxBytesDown, d.MaxBytesDown),
		BytesPerSecondUp:   pick(c.BytesPerSecondUp, d.BytesPerSecondUp),
		BytesPerSecondDown: pick(c.BytesPerSecondDown, d.BytesPerSecondDown),
		IdleTimeout:        time.Duration(pick(int64(c.IdleTimeout), int64(d.IdleTimeout))),
		ConnsPerSecond:     c.ConnsPerSecond,
	}
	switch {
	case c.ConnsPerSecond < 0:
		l.ConnsPerSecond, l.ConnBurst = 0, 0
	case c.ConnsPerSecond == 0:
		l.ConnsPerSecond = d.ConnsPerSecond
	}
	return l
}

// registerEgressFlags binds the server's egress limits (Config.Egress.Limits) to flags of fs.
func registerEgressFlags(fs *flag.FlagSet, l *egress.Limits) {
	d := egress.DefaultLimits()
	const tail = "; an env's egress.limits may lower it (0: the default; -1: no limit)"
	count := func(p *int, name, what string, def int) {
		fs.Func(name, fmt.Sprintf("%s (default %d%s)", what, def, tail), func(v string) error {
			n, err := strconv.Atoi(v)
			if err != nil || n < -1 {
				return fmt.Errorf("%q: a number, 0 for the default, or -1 for no limit", v)
			}
			*p = n
			return nil
		})
	}
	size := func(p *int64, name, what string, def int64) {
		fs.Func(name, fmt.Sprintf("%s: a size such as 64MiB (default %s%s)", what, sizeText(def), tail), func(v string) error {
			n, err := parseBytes(v)
			if err != nil || n < -1 {
				return fmt.Errorf("%q: a size in bytes, such as 1073741824 or 1GiB, 0 for the default, or -1 for no limit", v)
			}
			*p = n
			return nil
		})
	}
	count(&l.MaxConns, "egress-max-connections", "egress connections a sandbox holds open at once", d.MaxConns)
	fs.Func("egress-connections-per-second", fmt.Sprintf("new egress connections a sandbox makes a second, a token bucket of --egress-connection-burst (default %v%s)", d.ConnsPerSecond, tail),
		func(v string) error {
			r, err := strconv.ParseFloat(v, 64)
			if err != nil || math.IsNaN(r) || (r < 0 && r != -1) || r > 1e9 {
				return fmt.Errorf("%q: a rate such as 10 or 0.5, 0 for the default, or -1 for no limit", v)
			}
			l.ConnsPerSecond = r
			return nil
		})
	count(&l.ConnBurst, "egress-connection-burst", "egress connections a sandbox may make at once before --egress-connections-per-second holds it", d.ConnBurst)
	size(&l.MaxBytesUp, "egress-max-bytes-up", "bytes a sandbox sends through the egress proxy over its life", d.MaxBytesUp)
	size(&l.MaxBytesDown, "egress-max-bytes-down", "bytes a sandbox receives through the egress proxy over its life", d.MaxBytesDown)
	size(&l.BytesPerSecondUp, "egress-bytes-per-second-up", "bytes a second a sandbox sends through the egress proxy", d.BytesPerSecondUp)
	size(&l.BytesPerSecondDown, "egress-bytes-per-second-down", "bytes a second a sandbox receives through the egress proxy", d.BytesPerSecondDown)
	fs.Func("egress-idle-timeout", fmt.Sprintf("close an egress connection through which nothing went for this `duration` (default %v%s)", d.IdleTimeout, tail),
		func(v string) error {
			if v == "-1" {
				l.IdleTimeout = -1
				return nil
			}
			t, err := time.ParseDuration(v)
			if err != nil || t < 0 {
				return fmt.Errorf("%q: a duration such as 30s, 0 for the default, or -1 for no limit", v)
			}
			l.IdleTimeout = t
			return nil
		})
}

// sizeText writes n bytes in the largest binary unit that divides it.
func sizeText(n int64) string {
	for _, u := range []struct {
		shift uint
		name  string
	}{{30, "GiB"}, {20, "MiB"}, {10, "KiB"}} {
		if n > 0 && n%(1<<u.shift) == 0 {
			return fmt.Sprintf("%d%s", n>>u.shift, u.name)
		}
	}
	return strconv.FormatInt(n, 10)
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
