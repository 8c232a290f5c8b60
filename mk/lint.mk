# lint.mk: the Go linters, pinned and installed into $(BIN): golangci-lint with the set in
# .golangci.yml (function length and complexity included), and gVisor's checklocks, which checks
# the `+checklocks` annotations of guarded fields; and the Python SDK's mypy and ruff. `make test`
# runs `make lint`.
GOLANGCI_LINT_VERSION := v2.15.0
CHECKLOCKS_VERSION := v0.0.0-20260905035102-160fafc42237
LINT_GO_TOOLS := \
	github.com/golangci/golangci-lint/v2/cmd/golangci-lint@$(GOLANGCI_LINT_VERSION) \
	gvisor.dev/gvisor/tools/checklocks/cmd/checklocks@$(CHECKLOCKS_VERSION)

.PHONY: lint-tools lint-go

lint-tools: | $(BIN) ## install the pinned golangci-lint and checklocks into bin/
	@for spec in $(LINT_GO_TOOLS); do \
		mod=$${spec%@*}; want=$${spec#*@}; exe=$(BIN)/$${mod##*/}; \
		have=$$( [ -x "$$exe" ] && go version -m "$$exe" | awk '$$1 == "mod" { print $$3 }' || true); \
		if [ "$$have" != "$$want" ]; then \
			echo "lint.mk: installing $$spec" >&2; \
			GOFLAGS= GOBIN=$(BIN) go install "$$spec"; \
		fi; \
	done

lint-go: lint-tools ## lint the Go modules: golangci-lint, then checklocks
	for m in $(GO_MODULES); do (cd $$m && $(BIN)/golangci-lint run --allow-serial-runners ./...); done
	for m in $(GO_MODULES); do (cd $$m && go vet -vettool=$(BIN)/checklocks ./...); done

# The Python SDK (clients/python, its pyproject holds the settings): mypy --strict over the
# package (the generated _proto modules typed for their users by their .pyi stubs), its tools and
# benchmark; ruff check over all its Python. Both pinned, in python.mk's tools venv.
.PHONY: lint-python

lint-python: python-tools ## lint the Python SDK: mypy --strict and ruff check (pinned, .cache/py-tools-venv)
	@cd clients/python && status=0; \
	$(CURDIR)/$(PY_TOOLS_VENV)/bin/python -m mypy --cache-dir $(CURDIR)/.cache/mypy || status=1; \
	$(CURDIR)/$(PY_TOOLS_VENV)/bin/python -m ruff check --cache-dir $(CURDIR)/.cache/ruff --output-format concise . || status=1; \
	exit $$status

lint: lint-go lint-python ## run every linter (proto, golangci-lint, checklocks, mypy, ruff)
TEST_PREREQS += lint
