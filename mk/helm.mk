# helm.mk: the Helm chart that runs deltagym nodes on Kubernetes (deploy/helm/deltagym,
# docs/KUBERNETES.md) and its test. Helm is pinned and built by `go install` into a private
# prefix, .cache/helm/bin, with its cache, config and data directories beside it. `make
# helm-test` lints the chart (helm lint --strict), then runs deploy/helmtest, a Go module of its
# own (the Kubernetes API types it decodes the rendered objects into stay out of the server's
# module), which renders the chart with several value sets through $(HELM).
HELM_VERSION := v4.3.2
HELM_MODULE := helm.sh/helm/v4/cmd/helm
HELM_PREFIX ?= $(CURDIR)/.cache/helm
HELM := $(HELM_PREFIX)/bin/helm
HELM_CHART := deploy/helm/deltagym
HELM_ENV := HELM_CACHE_HOME=$(HELM_PREFIX)/cache HELM_CONFIG_HOME=$(HELM_PREFIX)/config HELM_DATA_HOME=$(HELM_PREFIX)/data

.PHONY: helm-tools helm-test lint-helm

helm-tools: ## install the pinned helm into .cache/helm/bin
	@have=$$( [ -x "$(HELM)" ] && go version -m "$(HELM)" | awk '$$1 == "mod" { print $$3 }' || true); \
	if [ "$$have" != "$(HELM_VERSION)" ]; then \
		echo "helm.mk: installing $(HELM_MODULE)@$(HELM_VERSION)" >&2; \
		GOFLAGS= GOBIN=$(HELM_PREFIX)/bin go install "$(HELM_MODULE)@$(HELM_VERSION)"; \
	fi

helm-test: helm-tools ## lint the Helm chart and check what it renders with the test's value sets (deploy/helmtest)
	$(HELM_ENV) $(HELM) lint --strict $(HELM_CHART)
	cd deploy/helmtest && go vet ./... && $(HELM_ENV) HELM=$(HELM) go test -count=1 ./...

TEST_PREREQS += helm-test

lint-helm: lint-tools ## lint the chart test's Go module (deploy/helmtest): golangci-lint, go vet
	cd deploy/helmtest && $(BIN)/golangci-lint run --allow-serial-runners ./... && go vet ./...

lint: lint-helm
