// Package server serves deltagym's EnvService and LedgerService on one port: Connect (JSON and
// binary), gRPC and gRPC-Web over HTTP/1.1 and unencrypted HTTP/2, with gRPC health and
// reflection and Prometheus metrics at /metrics.
//
// A Server wires the sandbox runtime (package sandbox), the env catalog and warm pools (package
// envpool) and the trajectory ledger (package server/ledger, on an external Postgres or a
// private cluster in the data directory). It keeps each leased sandbox's episode: Reset starts
// one; Step appends steps (submit terminates it, budgets truncate it); Restore ends it as
// branched and starts a new one whose step indices continue from the checkpoint's; Close and
// reaping truncate a running one. Calls on one sandbox are serialised, except that Restore and
// Close abort a running exec.
package server
