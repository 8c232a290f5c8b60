# cluster.mk: the test of a cluster of real nodes (clustertest/): three `deltagym serve`, each in
# a network namespace of its own behind a bridge, found through the test's DNS, sharing one
# ledger (as root; it skips, saying why, otherwise). `make test` runs it too, with every other
# test of the module.
.PHONY: test-cluster bench-cluster

test-cluster: deps postgres $(BIN)/deltagym $(BIN)/dg-init image ## the cluster test: three real nodes in network namespaces, DNS discovery, load test, cross-node checkpoints, a node killed and back (as root)
	DELTAGYM_INIT=$(BIN)/dg-init DELTAGYM_BIN=$(BIN)/deltagym go test -count=1 -v -run '^TestCluster$$' -timeout 10m ./clustertest/

bench-cluster: deps postgres $(BIN)/deltagym $(BIN)/dg-init image ## routed against direct calls, GetNode refresh, placement of a 64-child fork over three real nodes (p50/p99)
	DELTAGYM_INIT=$(BIN)/dg-init DELTAGYM_BIN=$(BIN)/deltagym go test -count=1 -run '^$$' -bench 'ClusterRoutedCall|ClusterRefresh' -benchtime 2000x -timeout 30m ./clustertest/
	DELTAGYM_INIT=$(BIN)/dg-init DELTAGYM_BIN=$(BIN)/deltagym go test -count=1 -run '^$$' -bench ClusterPlacement -benchtime 5x -timeout 30m ./clustertest/

BENCH_TARGETS += bench-cluster
