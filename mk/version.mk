# version.mk: the project's version is the one line of VERSION at the root. scripts/version.sh
# writes it into the files that carry it (generated, committed): internal/version/version.go, which
# `deltagym version` prints and NodeService.GetNode reports, clients/python/deltagym/_version.py,
# deltagym.__version__ and the Python package's version, and the version and appVersion of the
# Helm chart's Chart.yaml (the node image's tag). `make generate` rewrites them and
# `make checkgenerate` fails when they are stale.
VERSION_FILES := internal/version/version.go clients/python/deltagym/_version.py deploy/helm/deltagym/Chart.yaml

.PHONY: generate-version checkgenerate-version

generate-version: ## write VERSION into the files that carry it (the CLI's, the Python SDK's, the Helm chart's)
	./scripts/version.sh

checkgenerate-version: ## fail if the files that carry VERSION say another version
	@tmp=$$(mktemp -d); trap 'rm -rf "$$tmp"' EXIT; \
	./scripts/version.sh "$$tmp"; \
	status=0; \
	for f in $(VERSION_FILES); do diff -u "$$f" "$$tmp/$$f" >&2 || status=1; done; \
	if [ $$status -ne 0 ]; then echo "checkgenerate: the version files are stale; run 'make generate'" >&2; exit 1; fi

generate: generate-version
checkgenerate: checkgenerate-version
