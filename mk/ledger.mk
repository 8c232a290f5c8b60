# Trajectory ledger (server/ledger): its tests and the default `make run` use a private cluster of
# Debian trixie's PostgreSQL 17, installed into $(PG_PREFIX) by scripts/postgres.sh and started by
# server/ledger/pgserver with the bin directories internal/locate finds (DELTAGYM_POSTGRES, a bin
# directory; else this install, then Debian's): the default of deltagym serve --postgres-bin.
# The deps group postgres installs patchelf for it, and bookworm's PostgreSQL 15: the postgres
# system user, psql, and the binaries for a cluster that 15 made before.
DEPS_GROUPS += postgres
PG_PREFIX ?= $(CURDIR)/.cache/postgres

.PHONY: postgres ledger-test ledger-bench ledger-copycost

postgres: deps ## install PostgreSQL 17 (Debian trixie) into a private prefix (.cache/postgres) for the private cluster
	@./scripts/postgres.sh "$(PG_PREFIX)"
TEST_PREREQS += postgres

ledger-test: deps postgres ## run the ledger tests against a real private Postgres
	go test -count=1 -timeout 10m ./server/ledger/...

# ledger-bench runs the writer saturated (rate=max) and paced at the 50,000 steps/s target
# (rate=50000: delivered-steps/s and max-backlog-rows say whether it keeps up), 300,000 steps each,
# after as many untimed ones and a checkpoint (a warm-up: the timed WAL goes into recycled
# segments, as a server's does once it has run a while). The writer vacuums the steps it delivered
# every 10,000 (vacuums: how many in the timed run), as the server's does;
# DELTAGYM_LEDGER_BENCH_VACUUM_STEPS=n sets that, and -1 leaves the table to autovacuum, modelled
# by a vacuum of the warm-up's rows running alongside the timed ones (vacuum-ms: how long it took).
# It compares settings with DELTAGYM_LEDGER_BENCH_CONNS=n (delivery connections),
# DELTAGYM_LEDGER_BENCH_DELAY=d (Config.DeliveryDelay), DELTAGYM_LEDGER_BENCH_QUEUE_MB=n
# (Config.QueueBytes), DELTAGYM_LEDGER_BENCH_RATE=n (the paced rate, n >= 1000) and
# DELTAGYM_LEDGER_BENCH_PG=name=value,... (Postgres settings), DELTAGYM_LEDGER_BENCH_NEW_SLABS=1
# (the spool's reader without slab reuse), DELTAGYM_LEDGER_BENCH_COLD=1 (no warm-up: WAL into
# new segments, as a new cluster's first gigabytes are), DELTAGYM_LEDGER_BENCH_NO_VACUUM=1 (with
# VACUUM_STEPS=-1, no vacuum alongside the timed steps: autovacuum's, with the settings given),
# DELTAGYM_LEDGER_BENCH_PG_MB=n (the cluster's memory cap) and
# DELTAGYM_POSTGRES=/usr/lib/postgresql/15/bin (bookworm's PostgreSQL). The machine's other load moves steps/s a lot; go-cpu-us/step and
# pg-cpu-us/step hold up better.
ledger-bench: deps postgres ## ledger writer throughput into Postgres (steps/s, Step p50/p99, CPU per step)
	go test -run '^$$' -bench WriterSteps -benchtime 300000x -timeout 20m ./server/ledger/

ledger-copycost: deps postgres ## what Postgres spends per 4 KiB step row (CPU, WAL, disk), per schema variant
	go test -run '^$$' -bench CopyCost -benchtime 100000x -timeout 20m ./server/ledger/

BENCH_TARGETS += ledger-bench
