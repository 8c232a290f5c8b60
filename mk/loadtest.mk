# loadtest.mk: the load test harness (loadtest/, bin/deltagym-loadtest). `make loadtest`
# starts a private server (own data dir, --no-ledger, free loopback port, private cgroup
# roots), runs a 30-second rollback scenario with 64 sandboxes, measures the full-copy
# baseline after it (same disk), prints the summary and the ratios, and stops
# the server by its PID. Override LOADTEST_ARGS for another scenario, e.g.
#   make loadtest LOADTEST_ARGS='--scenario grpo --duration 60s'
LOADTEST_DATA ?= $(DATA)/loadtest
LOADTEST_ARGS ?= --scenario rollback --concurrency 64 --duration 30s --full-copy
LOADTEST_OUT ?= $(LOADTEST_DATA)/report

.PHONY: loadtest loadtest-test

$(BIN)/deltagym-loadtest: $(shell find loadtest -name '*.go' 2>/dev/null) proto/gen go.mod go.sum | $(BIN)
	go build -o $(BIN)/ ./loadtest/cmd/deltagym-loadtest

loadtest: deps $(BIN)/deltagym $(BIN)/dg-init $(BIN)/deltagym-loadtest image ## 30 s rollback load test (64 sandboxes) against a fresh private server: <N> rollbacks/s, p50/p90/p99/max, errors
	@mkdir -p $(LOADTEST_OUT)
	$(BIN)/deltagym-loadtest --serve $(BIN)/deltagym --init $(BIN)/dg-init --data $(LOADTEST_DATA) --envs $(CURDIR)/envs \
		--image-dir $(DATA)/images/default --server-log $(LOADTEST_OUT)/server.log \
		--json $(LOADTEST_OUT)/report.json --plot $(LOADTEST_OUT)/latency-cdf.png $(LOADTEST_ARGS)

loadtest-test: deps $(BIN)/deltagym $(BIN)/dg-init image ## the load test's own tests (a real server, a few seconds of rollbacks)
	DELTAGYM_INIT=$(BIN)/dg-init DELTAGYM_BIN=$(BIN)/deltagym DELTAGYM_IMAGE_DIR=$(DATA)/images/default \
		go test -count=1 -timeout 10m ./loadtest/...

# The load test's tests (about 40 s) start a real server from bin/deltagym: keep it fresh.
TEST_PREREQS += $(BIN)/deltagym
