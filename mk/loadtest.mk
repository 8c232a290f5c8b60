# loadtest.mk: the load test harness (loadtest/, bin/deltagym-loadtest). `make loadtest`
# starts a private server (own data dir, --no-ledger, free loopback port, private cgroup
# roots), runs a 30-second rollback scenario with 64 sandboxes (each on a StepStream, the
# restore carried by a step; --api unary makes three unary calls instead), measures the full-copy
# baseline after it (same disk), prints the summary and the ratios, and stops
# the server by its PID. Override LOADTEST_ARGS for another scenario, e.g.
#   make loadtest LOADTEST_ARGS='--scenario grpo --duration 60s'
LOADTEST_DATA ?= $(DATA)/loadtest
LOADTEST_ARGS ?= --scenario rollback --api stream --concurrency 64 --duration 30s --full-copy
LOADTEST_OUT ?= $(LOADTEST_DATA)/report

# `make loadtest-sustained` is the same harness for 5 minutes (rollback, 64 sandboxes) with a
# timeline sampled every 5 s: throughput, server RSS, discard backlog, live sandboxes,
# checkpoints and CPU per process (server, sandboxes, load generator, whole machine), then a
# flatness verdict (first vs last minute). Its server has its own data dir.
LOADTEST_SUSTAINED_DATA ?= $(LOADTEST_DATA)/sustained
LOADTEST_SUSTAINED_ARGS ?= --scenario rollback --api stream --concurrency 64 --duration 5m --warmup 10s --sample 5s
LOADTEST_SUSTAINED_OUT ?= $(LOADTEST_SUSTAINED_DATA)/report

# `make loadtest-process` is the rollback-process scenario (30 s, 64 sandboxes): one
# single-threaded python3 process of LOADTEST_PROCESS_MB MiB per sandbox, checkpointed
# once with its process as a template, then Restore + a check that the process is back at
# its checkpointed counter with every page consistent + a change of it. Beside it the
# CRIU variant runs, or is reported "not available" if the server answers
# Unimplemented for PROCESS_MODE_CRIU. Its server has its own data dir.
LOADTEST_PROCESS_DATA ?= $(LOADTEST_DATA)/process
LOADTEST_PROCESS_MB ?= 8
LOADTEST_PROCESS_ARGS ?= --scenario rollback-process --process-mb $(LOADTEST_PROCESS_MB) --concurrency 64 --duration 30s
LOADTEST_PROCESS_OUT ?= $(LOADTEST_PROCESS_DATA)/report

.PHONY: loadtest loadtest-test loadtest-sustained loadtest-process

$(BIN)/deltagym-loadtest: $(shell find loadtest clients/go -name "*.go" 2>/dev/null) go.mod go.sum | $(BIN)
	go build -o $(BIN)/ ./loadtest/cmd/deltagym-loadtest

# `make bin/deltagym-loadtest` (a relative name) builds it too.
bin/deltagym-loadtest: $(BIN)/deltagym-loadtest

loadtest: deps postgres $(BIN)/deltagym $(BIN)/dg-init $(BIN)/deltagym-loadtest image ## 30 s rollback load test (64 sandboxes) against a fresh private server: <N> rollbacks/s, p50/p90/p99/max, errors
	@mkdir -p $(LOADTEST_OUT)
	$(BIN)/deltagym-loadtest --serve $(BIN)/deltagym --init $(BIN)/dg-init --data $(LOADTEST_DATA) --envs $(CURDIR)/envs \
		--image-dir $(DATA)/images/default --server-log $(LOADTEST_OUT)/server.log \
		--json $(LOADTEST_OUT)/report.json --plot $(LOADTEST_OUT)/latency-cdf.png $(LOADTEST_ARGS)

loadtest-sustained: deps postgres $(BIN)/deltagym $(BIN)/dg-init $(BIN)/deltagym-loadtest image ## 5 min rollback run (64 sandboxes), fresh private server: throughput, server RSS, discard backlog, CPU per process over time; flatness verdict
	@mkdir -p $(LOADTEST_SUSTAINED_OUT)
	$(BIN)/deltagym-loadtest --serve $(BIN)/deltagym --init $(BIN)/dg-init --data $(LOADTEST_SUSTAINED_DATA) --envs $(CURDIR)/envs \
		--image-dir $(DATA)/images/default --server-log $(LOADTEST_SUSTAINED_OUT)/server.log \
		--json $(LOADTEST_SUSTAINED_OUT)/report.json --plot $(LOADTEST_SUSTAINED_OUT)/latency-cdf.png $(LOADTEST_SUSTAINED_ARGS)

loadtest-process: deps postgres $(BIN)/deltagym $(BIN)/dg-init $(BIN)/deltagym-loadtest image ## 30 s rollback-process run (64 sandboxes, one 8 MiB process each) vs CRIU (or "not available"), fresh private server
	@mkdir -p $(LOADTEST_PROCESS_OUT)
	$(BIN)/deltagym-loadtest --serve $(BIN)/deltagym --init $(BIN)/dg-init --data $(LOADTEST_PROCESS_DATA) --envs $(CURDIR)/envs \
		--image-dir $(DATA)/images/default --server-log $(LOADTEST_PROCESS_OUT)/server.log \
		--json $(LOADTEST_PROCESS_OUT)/report.json --plot $(LOADTEST_PROCESS_OUT)/latency-cdf.png $(LOADTEST_PROCESS_ARGS)

loadtest-test: deps postgres $(BIN)/deltagym $(BIN)/dg-init image ## the load test's own tests (a real server, a few seconds of rollbacks)
	DELTAGYM_INIT=$(BIN)/dg-init DELTAGYM_BIN=$(BIN)/deltagym DELTAGYM_IMAGE_DIR=$(DATA)/images/default \
		go test -count=1 -timeout 10m ./loadtest/...

# The load test's tests start a real server from bin/deltagym: keep it fresh.
TEST_PREREQS += $(BIN)/deltagym

BENCH_TARGETS += loadtest
