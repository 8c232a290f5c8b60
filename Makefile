# deltagym Makefile. `make help` lists the targets.
SHELL := bash
.SHELLFLAGS := -eu -o pipefail -c
.DEFAULT_GOAL := help
MAKEFLAGS += --no-builtin-rules

export GOFLAGS ?= -buildvcs=false
BIN := $(CURDIR)/bin
# Where the server keeps images, layers, checkpoints and its private Postgres.
DATA ?= $(CURDIR)/.data

# Each part of the project adds its own targets and prerequisites in mk/*.mk.
DEPS_GROUPS := base
TEST_PREREQS :=
BENCH_TARGETS :=
include $(sort $(wildcard mk/*.mk))

.PHONY: help deps build test test-unit test-privileged test-race run bench bench-sandbox lint generate checkgenerate clean clean-data clean-ledger init

help: ## list targets
	@grep -hE '^[a-zA-Z_/.-]+:.*## ' $(MAKEFILE_LIST) | sort | awk -F':.*## ' '{t[NR] = $$1; h[NR] = $$2; w = length($$1) > w ? length($$1) : w} END {for (i = 1; i <= NR; i++) printf "  %-*s  %s\n", w, t[i], h[i]}' | \
		sed -e 's|\$$(DATA)|$(DATA)|g' -e 's|\$$(SERVER_ADDR)|$(SERVER_ADDR)|g' -e 's|\$$(PROTO_BREAKING_REF)|$(PROTO_BREAKING_REF)|g'

deps: ## install the Debian packages and tools the project needs (idempotent)
	@./scripts/deps.sh $(sort $(DEPS_GROUPS))

$(BIN)/dg-init: sandbox/initproc/csrc/init.c | $(BIN)
	$(CC) -O2 -static -Wall -Wextra -Werror -o $@ $<

init: $(BIN)/dg-init ## build the sandbox init (a small static C program)

$(BIN):
	@mkdir -p $@

build: $(BIN)/dg-init ## build the server, CLI, load generator (bin/deltagym-loadtest) and the sandbox init
	go build -o $(BIN)/ ./cmd/... ./loadtest/cmd/...

# Go modules: the server's (the root) and the Go client's, which has one of its own.
GO_MODULES := . clients/go

# Test tiers (internal/testenv decides, test by test):
# - unit: `go test -short`. Tests that need no root, no network and no Postgres, for any user,
#   in seconds (no make prerequisite: Go alone). Privileged and integration tests skip under
#   -short, saying so; envpool's suite runs here against the fake runtime (envpool/envpooltest).
# - privileged and integration: `go test` without -short, as root. Real sandboxes (namespaces,
#   mounts, cgroups, CRIU), a private Postgres the tests start when one needs it (pgtest), real
#   servers; envpool's suite again, against the real runtime. Not root, the privileged tests
#   skip, saying so.
# - race: the packages with the most concurrency (envpool, server, server/ledger) under -race.
# `make test` runs them all, with vet and the prerequisites' own tests (Python SDK, generated
# code); CI runs `make test`.
RACE_PKGS := ./envpool/... ./server/ ./server/ledger/

test-unit: ## the unit tier: no root, network or Postgres, seconds (go test -short, both Go modules)
	for m in $(GO_MODULES); do (cd $$m && go test -short -count=1 -timeout 5m ./...); done

test-privileged: deps postgres criu image $(BIN)/dg-init $(BIN)/deltagym ## every Go test: the privileged and integration tiers with the unit one (as root)
	for m in $(GO_MODULES); do (cd $$m && DELTAGYM_INIT=$(BIN)/dg-init go test -count=1 -timeout 30m ./...); done

test-race: deps postgres $(BIN)/dg-init ## envpool, server and server/ledger under the race detector (as root)
	DELTAGYM_INIT=$(BIN)/dg-init go test -race -count=1 -timeout 30m $(RACE_PKGS)

test: deps $(BIN)/dg-init $(BIN)/deltagym $(TEST_PREREQS) ## run every test, every tier (root runs the privileged ones)
	for m in $(GO_MODULES); do (cd $$m && go vet ./...); done
	for m in $(GO_MODULES); do (cd $$m && DELTAGYM_INIT=$(BIN)/dg-init go test -count=1 -timeout 30m ./...); done
	DELTAGYM_INIT=$(BIN)/dg-init go test -race -count=1 -timeout 30m $(RACE_PKGS)

bench: bench-sandbox $(BENCH_TARGETS) ## run every benchmark (p50/p99)

bench-sandbox: deps $(BIN)/dg-init criu ## sandbox runtime benchmarks: checkpoint, rollback (and the load test's loop with its CPU), fork, exec, full-copy baseline, processes (template vs CRIU)
	DELTAGYM_INIT=$(BIN)/dg-init go test -run '^$$' -bench 'Checkpoint$$|Rollback$$|RollbackLoop|RollbackDepth|Exec$$' -benchtime 500x -timeout 30m ./sandbox/
	DELTAGYM_INIT=$(BIN)/dg-init go test -run '^$$' -bench 'Fork64|RollbackFullCopy' -benchtime 20x -timeout 30m ./sandbox/
	DELTAGYM_INIT=$(BIN)/dg-init go test -run '^$$' -bench 'CheckpointWithProcess|RollbackWithProcess|RollbackStepWithProcess|RollbackVsCRIU' -benchtime 100x -timeout 30m ./sandbox/
	go test -run '^$$' -bench . -benchtime 2000x -timeout 10m ./sandbox/cgroup/

clean: ## remove build output (not the image cache)
	rm -rf $(BIN)

clean-data: ## unmount and delete the (stopped) server's sandbox store in .data: checkpoints, layers, imported images (keeps the ledger, registered envs, the default image)
	@if [ -x $(BIN)/deltagym ]; then $(BIN)/deltagym purge --data $(DATA); fi
	@findmnt -rn -o TARGET | { grep "^$(DATA)/" || true; } | sort -r | xargs -r umount -l
	rm -rf $(DATA)/sandbox $(DATA)/loadtest

clean-ledger: ## delete the (stopped) server's recorded trajectories in $(DATA): its private Postgres and spool
	@pid=$$(head -1 $(DATA)/pg/postgres/postmaster.pid 2>/dev/null || true); \
	if [ -n "$$pid" ] && kill -0 "$$pid" 2>/dev/null; then echo "clean-ledger: Postgres (pid $$pid) still runs on $(DATA)/pg; stop the server first" >&2; exit 1; fi
	rm -rf $(DATA)/pg $(DATA)/spool
