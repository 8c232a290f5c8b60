// Package loadtest drives a running deltagym server through the generated gRPC client and
// measures it: scenarios (rollback, rollback-exec, steps, grpo, tree, mixed), closed-loop
// concurrency or an open-loop target rate, a warm-up that is discarded, HDR latency
// histograms per operation, errors by code, a JSON report and a latency CDF plot. It also
// holds the baselines measured beside it in the same run (a local full-copy rollback) and a
// launcher that starts a private server for one run (StartServer).
//
// loadtest depends only on generated code (proto/gen/go/...): never on server, envpool or
// sandbox, so it measures what a client sees.
package loadtest
