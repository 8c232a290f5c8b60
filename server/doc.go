// Package server serves deltagym's EnvService and LedgerService on one port: Connect (JSON and
// binary), gRPC and gRPC-Web over HTTP/1.1 and unencrypted HTTP/2, with gRPC health and
// reflection and Prometheus metrics at /metrics.
//
// A Server wires the sandbox runtime (package sandbox), the env catalog and warm pools (package
// envpool), the trajectory ledger (package server/ledger, on an external Postgres or a private
// cluster in the data directory) and the episode core (package server/episode), which keeps
// each leased sandbox's episode and every rule of it. The EnvService handlers are a thin layer
// over the core: they decode a request into the core's domain types (episode_wire.go), call
// it, and map its result and its error (errors.go: one table from error classes to codes).
// Other protocol front ends call the same core.
package server
