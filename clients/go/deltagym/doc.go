// Package deltagym is the Go client of a deltagym server: a typed wrapper over
// the generated Connect clients of deltagym.v1.EnvService and
// deltagym.v1.LedgerService.
//
// Dial returns a Client for one server. Reset and Fork hand out Sandbox
// handles; a Sandbox performs steps (Exec, Run, WriteFile, ReadFile, Submit),
// takes checkpoints, restores them, forks, evaluates and closes. A handle can
// keep its lease alive with a background heartbeat (KeepAlive) that Close
// stops.
//
// DialCluster returns a Cluster: a client of every node of a deltagym cluster
// ("dns:NAME:PORT", as a Kubernetes headless Service names them, or a list of
// addresses), with no router in between. It asks each node for its report at
// every refresh, places each Reset on the least loaded node (Spread), and
// sends every call on a sandbox or checkpoint to the node its ID names
// (NodeOf); a call on a node that does not answer fails at once with
// Unavailable and a *NodeError naming the node.
//
// Calls are retried only when that is safe: on Unavailable, for calls that
// change nothing (ListEnvs, GetSandbox, ListSandboxes, ListCheckpoints, Heartbeat, the ledger
// queries), for Close and ReportReward, which are idempotent, and for Reset and
// Fork when they carry an idempotency key, which this package generates for
// every call so that a retry returns the sandboxes of the first attempt.
//
// Errors keep their Connect code: connect.CodeOf(err) reports it through any
// wrapping this package adds.
//
// The package uses only the generated code of proto/ (and connect-go); it
// knows nothing of the server's internals.
package deltagym
