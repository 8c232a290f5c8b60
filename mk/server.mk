# server.mk: run the server with its embedded defaults (the default image, envs/, a private
# Postgres in $(DATA)), and its benchmarks.
DEPS_GROUPS += postgres image
SERVER_ADDR ?= 127.0.0.1:8080
# SERVE_FLAGS adds flags of `deltagym serve` to make run (bin/deltagym serve -h lists them).
SERVE_FLAGS ?=

.PHONY: run server-bench

$(BIN)/deltagym: $(BIN)/dg-init $(shell find cmd server envpool sandbox clients/go internal -name '*.go' 2>/dev/null) go.mod go.sum clients/go/go.mod | $(BIN)
	go build -o $(BIN)/ ./cmd/...

run: deps postgres $(BIN)/deltagym $(BIN)/dg-init image criu ## run the server on $(SERVER_ADDR): default image, envs/, CRIU (process forks), private Postgres in $(DATA)
	DELTAGYM_INIT=$(BIN)/dg-init $(BIN)/deltagym serve --addr $(SERVER_ADDR) --data $(DATA) --envs $(CURDIR)/envs $(SERVE_FLAGS)

server-bench: deps postgres $(BIN)/dg-init ## client-observed Reset, Step, Restore, Fork-16 over loopback gRPC (p50/p99)
	DELTAGYM_INIT=$(BIN)/dg-init go test -run '^$$' -bench . -benchtime 500x -timeout 30m ./server/

BENCH_TARGETS += server-bench
