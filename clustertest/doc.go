// Package clustertest holds the test of a cluster of real nodes: three `deltagym serve`
// processes, each in a network namespace of its own joined to the others by a bridge, found
// through a DNS server of the test's as a Kubernetes headless Service's nodes are, sharing one
// ledger; and the benchmarks of routing and placement across them. It has no code outside its
// tests.
package clustertest
