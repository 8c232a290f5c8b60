# API code generation: Go (messages, gRPC, Connect) and Python (messages, type
# stubs, gRPC) from proto/, with buf and local plugins only. Generated code is
# committed; `make checkgenerate` fails when it is stale.

# Tool versions. Each Go tool is installed into $(BIN) by `go install` when it
# is missing or its build reports another version.
BUF_VERSION := v1.75.0
PROTOC_GEN_GO_VERSION := v1.36.12
PROTOC_GEN_GO_GRPC_VERSION := v1.6.2
PROTOC_GEN_CONNECT_GO_VERSION := v1.21.1
PROTO_GO_TOOLS := \
	github.com/bufbuild/buf/cmd/buf@$(BUF_VERSION) \
	google.golang.org/protobuf/cmd/protoc-gen-go@$(PROTOC_GEN_GO_VERSION) \
	google.golang.org/grpc/cmd/protoc-gen-go-grpc@$(PROTOC_GEN_GO_GRPC_VERSION) \
	connectrpc.com/connect/cmd/protoc-gen-connect-go@$(PROTOC_GEN_CONNECT_GO_VERSION)

# Python code comes from the protoc bundled in grpcio-tools, run by
# proto/tools/protoc_gen_python.py in this venv (buf.gen.yaml names its path).
PROTO_PYTHON ?= python3
PROTO_VENV := .cache/proto-venv
PROTO_PY_PINS := grpcio-tools==1.85.1 grpcio==1.85.3 protobuf==7.36.2
# The stamp's name changes with the pins, so new pins rebuild the venv.
PROTO_VENV_STAMP := $(PROTO_VENV)/.deltagym-$(shell printf '%s' '$(PROTO_PY_PINS)' | cksum | cut -d' ' -f1)

# Generated trees (each is wiped and rewritten by buf: `clean: true`).
PROTO_GEN_DIRS := clients/go/gen clients/python/deltagym/_proto
# Where `make breaking` compares against; skipped when it has no proto/ yet.
PROTO_BREAKING_REF ?= main

.PHONY: proto-tools lint-proto breaking

proto-tools: $(PROTO_VENV_STAMP) | $(BIN) ## install the pinned buf, protoc plugins and Python generator venv
	@for spec in $(PROTO_GO_TOOLS); do \
		mod=$${spec%@*}; want=$${spec#*@}; exe=$(BIN)/$${mod##*/}; \
		have=$$( [ -x "$$exe" ] && go version -m "$$exe" | awk '$$1 == "mod" { print $$3 }' || true); \
		if [ "$$have" != "$$want" ]; then \
			echo "proto.mk: installing $$spec" >&2; \
			GOBIN=$(BIN) go install "$$spec"; \
		fi; \
	done

$(PROTO_VENV_STAMP):
	@echo "proto.mk: creating $(PROTO_VENV) with $(PROTO_PY_PINS)" >&2
	rm -rf $(PROTO_VENV)
	$(PROTO_PYTHON) -m venv $(PROTO_VENV)
	$(PROTO_VENV)/bin/python -m pip install -q --disable-pip-version-check $(PROTO_PY_PINS)
	touch $@

generate: proto-tools ## regenerate Go and Python code from proto/
	PATH=$(BIN):$$PATH $(BIN)/buf generate

checkgenerate: proto-tools ## fail if generated code differs from proto/
	@tmp=$$(mktemp -d); trap 'rm -rf "$$tmp"' EXIT; \
	PATH=$(BIN):$$PATH $(BIN)/buf generate -o "$$tmp"; \
	status=0; \
	for d in $(PROTO_GEN_DIRS); do \
		diff -r -x __pycache__ "$$tmp/$$d" "$$d" >&2 || status=1; \
	done; \
	if [ $$status -ne 0 ]; then echo "checkgenerate: generated code is stale; run 'make generate'" >&2; exit 1; fi; \
	mods=$$(cd "$$tmp/clients/python" && find deltagym -name '*.py' ! -name __init__.py | sed 's/\.py$$//; s#/#.#g'); \
	for m in $$mods; do \
		PYTHONPATH="$$tmp/clients/python" $(PROTO_VENV)/bin/python -B -c "import $$m" || { echo "checkgenerate: $$m does not import" >&2; exit 1; }; \
	done; \
	untracked=$$(git ls-files --others --exclude-standard -- $(PROTO_GEN_DIRS)); \
	if [ -n "$$untracked" ]; then echo "checkgenerate: generated files not in git:" $$untracked >&2; exit 1; fi; \
	echo "checkgenerate: generated code is up to date"

lint-proto: proto-tools ## lint and format-check the API definitions
	$(BIN)/buf lint
	$(BIN)/buf format --diff --exit-code

breaking: proto-tools ## check proto/ for wire or JSON breaking changes against $(PROTO_BREAKING_REF)
	@if git cat-file -e '$(PROTO_BREAKING_REF):buf.yaml' 2>/dev/null; then \
		$(BIN)/buf breaking --against '.git#ref=$(PROTO_BREAKING_REF)'; \
	else \
		echo "breaking: $(PROTO_BREAKING_REF) has no buf.yaml yet; nothing to compare" >&2; \
	fi

lint: lint-proto
TEST_PREREQS += checkgenerate
