// Package loadtest drives a running deltagym server through the generated gRPC client and
// measures it: scenarios (rollback, rollback-exec, rollback-process, steps, grpo, tree,
// mixed), closed-loop concurrency or an open-loop target rate, a warm-up that is discarded, HDR latency
// histograms per operation, errors by code, a JSON report and a latency CDF plot, and a
// timeline sampled every Config.SampleInterval (throughput, server RSS, the server's discard
// backlog and other gauges from its /metrics, CPU of the server, its sandboxes and the load
// generator, and the CPU time of a fixed task, which shows the machine's own speed drifting)
// judged for flatness, first against last minute, for sustained runs. It also
// holds the baselines measured beside it in the same run (a local full-copy rollback; the
// CRIU variant of rollback-process, MeasureProcessCRIU, or "not available") and a
// launcher that starts a private server for one run (StartServer).
//
// loadtest depends only on generated code (proto/gen/go/...): never on server, envpool or
// sandbox, so it measures what a client sees.
package loadtest
