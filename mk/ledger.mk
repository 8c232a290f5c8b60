# Trajectory ledger (server/ledger): its tests and the default `make run` use a private cluster of
# Debian 12's PostgreSQL 15, started from /usr/lib/postgresql/15/bin by server/ledger/pgserver.
DEPS_GROUPS += postgres

.PHONY: ledger-test ledger-bench ledger-copycost

ledger-test: deps ## run the ledger tests against a real private Postgres
	go test -count=1 -timeout 10m ./server/ledger/...

# ledger-bench runs the writer saturated (rate=max) and paced at the 50,000 steps/s target
# (rate=50000: delivered-steps/s and max-backlog-rows say whether it keeps up), 300,000 steps each.
# It compares settings with DELTAGYM_LEDGER_BENCH_CONNS=n (delivery connections),
# DELTAGYM_LEDGER_BENCH_DELAY=d (Config.DeliveryDelay), DELTAGYM_LEDGER_BENCH_QUEUE_MB=n
# (Config.QueueBytes), DELTAGYM_LEDGER_BENCH_RATE=n (the paced rate, n >= 1000) and
# DELTAGYM_LEDGER_BENCH_PG=name=value,... (Postgres settings). The machine's other load moves
# steps/s a lot; go-cpu-us/step and pg-cpu-us/step hold up better.
ledger-bench: deps ## ledger writer throughput into Postgres (steps/s, Step p50/p99, CPU per step)
	go test -run '^$$' -bench WriterSteps -benchtime 300000x -timeout 20m ./server/ledger/

ledger-copycost: deps ## what Postgres spends per 4 KiB step row (CPU, WAL, disk), per schema variant
	go test -run '^$$' -bench CopyCost -benchtime 100000x -timeout 20m ./server/ledger/

BENCH_TARGETS += ledger-bench
