package server

import (
	"context"
	"errors"
	"fmt"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/collectors"
	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/metric"

	"github.com/deltagym/deltagym/sandbox"
)

// Runtime gauges on /metrics (Prometheus names): deltagym_sandboxes_live,
// deltagym_sandboxes_retiring (closed, teardown not over; counted in live too),
// deltagym_checkpoints, deltagym_checkpoints_bytes (charged to the checkpoint budget: sealed
// layers and CRIU images) and deltagym_layers_discard_backlog; deltagym_admission_cap{cap} and
// deltagym_admission_used{cap} for each admission cap in force (sandbox.CapUses); all read from
// the sandbox runtime at each scrape; and the standard process collector's process_resident_memory_bytes and
// process_cpu_seconds_total, so a load generator that did not start the server can follow
// its memory and CPU over time. With a ledger, deltagym_ledger_rows_refused_total counts the
// rows its Postgres refused, which the writer set aside (ledger.Stats.Dropped).
const (
	metricSandboxes       = "deltagym.sandboxes.live"
	metricRetiring        = "deltagym.sandboxes.retiring"
	metricCap             = "deltagym.admission.cap"
	metricCapUsed         = "deltagym.admission.used"
	metricCheckpoints     = "deltagym.checkpoints"
	metricDiscardBacklog  = "deltagym.layers.discard_backlog"
	metricCheckpointBytes = "deltagym.checkpoints.bytes"
	metricLedgerRefused   = "deltagym.ledger.rows_refused"
)

// registerRuntimeMetrics exports the runtime gauges and the process collector. A failure
// leaves the server serving without them and is logged: metrics are not worth refusing to
// start for.
func (s *Server) registerRuntimeMetrics() {
	count := func(f func() int) func() int64 { return func() int64 { return int64(f()) } }
	if err := s.obs.registerRuntime(count(s.rt.Sandboxes), count(s.rt.Checkpoints), count(s.rt.DiscardBacklog), s.rt.CheckpointBytes); err != nil {
		s.log.Warn("runtime metrics not exported", "err", err)
	}
	if err := s.obs.registerAdmission(count(s.rt.Retiring), s.rt.CapUses); err != nil {
		s.log.Warn("admission metrics not exported", "err", err)
	}
	if w := s.writer; w != nil {
		if err := s.obs.registerLedger(func() int64 { return int64(w.Stats().Dropped) }); err != nil {
			s.log.Warn("ledger metrics not exported", "err", err)
		}
	}
}

// registerLedger registers the counter of ledger rows Postgres refused, observed at each
// collection.
func (o *observability) registerLedger(refused func() int64) error {
	m := o.meterProvider.Meter("github.com/deltagym/deltagym/server")
	if _, err := m.Int64ObservableCounter(metricLedgerRefused,
		metric.WithDescription("ledger rows Postgres refused, which the writer logged and set aside, delivering the rest of their batch"),
		metric.WithInt64Callback(func(_ context.Context, obs metric.Int64Observer) error {
			obs.Observe(refused())
			return nil
		})); err != nil {
		return fmt.Errorf("registering counter %s: %w", metricLedgerRefused, err)
	}
	return nil
}

// registerAdmission registers the gauges of retiring sandboxes and of the admission caps in
// force and their use, observed at each collection.
func (o *observability) registerAdmission(retiring func() int64, caps func() []sandbox.CapUse) error {
	m := o.meterProvider.Meter("github.com/deltagym/deltagym/server")
	if _, err := m.Int64ObservableGauge(metricRetiring,
		metric.WithDescription("closed sandboxes whose teardown is not over; they count against the caps until it is"),
		metric.WithInt64Callback(func(_ context.Context, obs metric.Int64Observer) error {
			obs.Observe(retiring())
			return nil
		})); err != nil {
		return fmt.Errorf("registering gauge %s: %w", metricRetiring, err)
	}
	limit, err := m.Int64ObservableGauge(metricCap, metric.WithDescription("each admission cap in force, by cap (sandboxes, checkpoints, checkpoint-bytes, descriptors, mounts)"))
	if err != nil {
		return fmt.Errorf("registering gauge %s: %w", metricCap, err)
	}
	used, err := m.Int64ObservableGauge(metricCapUsed, metric.WithDescription("what counts against each admission cap in force, by cap"))
	if err != nil {
		return fmt.Errorf("registering gauge %s: %w", metricCapUsed, err)
	}
	_, err = m.RegisterCallback(func(_ context.Context, obs metric.Observer) error {
		for _, c := range caps() {
			attrs := metric.WithAttributes(attribute.String("cap", string(c.Cap)))
			obs.ObserveInt64(limit, c.Limit, attrs)
			obs.ObserveInt64(used, c.Use, attrs)
		}
		return nil
	}, limit, used)
	if err != nil {
		return fmt.Errorf("registering the admission gauges' callback: %w", err)
	}
	return nil
}

// registerRuntime registers one observable gauge per counter function, observed at each
// collection, and the process collector (unless already registered).
func (o *observability) registerRuntime(sandboxes, checkpoints, discardBacklog, checkpointBytes func() int64) error {
	m := o.meterProvider.Meter("github.com/deltagym/deltagym/server")
	for _, g := range []struct {
		name, desc string
		read       func() int64
	}{
		{metricSandboxes, "live sandboxes, pooled and leased", sandboxes},
		{metricCheckpoints, "checkpoints held by the sandbox runtime", checkpoints},
		{metricDiscardBacklog, "released delta layers whose background discard has not finished", discardBacklog},
		{metricCheckpointBytes, "bytes charged to the checkpoint budget: sealed layers and process images", checkpointBytes},
	} {
		read := g.read
		if _, err := m.Int64ObservableGauge(g.name, metric.WithDescription(g.desc),
			metric.WithInt64Callback(func(_ context.Context, obs metric.Int64Observer) error {
				obs.Observe(read())
				return nil
			})); err != nil {
			return fmt.Errorf("registering gauge %s: %w", g.name, err)
		}
	}
	err := o.registry.Register(collectors.NewProcessCollector(collectors.ProcessCollectorOpts{}))
	if are := (prometheus.AlreadyRegisteredError{}); err != nil && !errors.As(err, &are) {
		return fmt.Errorf("registering the process collector: %w", err)
	}
	return nil
}
