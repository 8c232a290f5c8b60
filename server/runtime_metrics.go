package server

import (
	"context"
	"errors"
	"fmt"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/collectors"
	"go.opentelemetry.io/otel/metric"
)

// Runtime gauges on /metrics (Prometheus names): deltagym_sandboxes_live,
// deltagym_checkpoints, deltagym_checkpoints_bytes (charged to the checkpoint budget: sealed
// layers and CRIU images) and deltagym_layers_discard_backlog, read from the sandbox runtime at
// each scrape; and the standard process collector's process_resident_memory_bytes and
// process_cpu_seconds_total, so a load generator that did not start the server can follow
// its memory and CPU over time.
const (
	metricSandboxes       = "deltagym.sandboxes.live"
	metricCheckpoints     = "deltagym.checkpoints"
	metricDiscardBacklog  = "deltagym.layers.discard_backlog"
	metricCheckpointBytes = "deltagym.checkpoints.bytes"
)

// registerRuntimeMetrics exports the runtime gauges and the process collector. A failure
// leaves the server serving without them and is logged: metrics are not worth refusing to
// start for.
func (s *Server) registerRuntimeMetrics() {
	count := func(f func() int) func() int64 { return func() int64 { return int64(f()) } }
	if err := s.obs.registerRuntime(count(s.rt.Sandboxes), count(s.rt.Checkpoints), count(s.rt.DiscardBacklog), s.rt.CheckpointBytes); err != nil {
		s.log.Warn("runtime metrics not exported", "err", err)
	}
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
