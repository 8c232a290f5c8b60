# ui.mk: the web view at /ui/. Its sources are in ui/ (Preact, d3-hierarchy; versions pinned in
# ui/package.json and ui/package-lock.json); esbuild bundles them into server/webui/dist, which
# is committed and embedded in the server (go:embed), so that building the server needs no
# Node.js. `make checkui` (in `make test`) rebuilds the bundle from the sources, twice, and fails
# when the two builds differ or differ from the committed one. The browser test
# (server/webui/browser_test.go) drives Debian's chromium, which the deps group browser installs.
DEPS_GROUPS += browser
UI_NPM_CACHE := $(CURDIR)/.cache/npm
UI_NPM_CI := npm ci --cache $(UI_NPM_CACHE) --prefer-offline --no-audit --no-fund --loglevel=error

.PHONY: ui checkui ui-test

ui: ## build the web view (ui/) into server/webui/dist, which the server embeds
	cd ui && $(UI_NPM_CI) && node build.mjs

checkui: ## fail if server/webui/dist is not what ui/ builds (npm ci, two builds compared)
	@tmp=$$(mktemp -d); trap 'rm -rf "$$tmp"' EXIT; \
	cd ui && $(UI_NPM_CI) && node build.mjs "$$tmp/a" >/dev/null && node build.mjs "$$tmp/b" >/dev/null && cd ..; \
	diff -r "$$tmp/a" "$$tmp/b" >&2 || { echo "checkui: two builds of ui/ differ: the build is not reproducible" >&2; exit 1; }; \
	diff -r "$$tmp/a" server/webui/dist >&2 || { echo "checkui: server/webui/dist is stale; run 'make ui' and commit it" >&2; exit 1; }; \
	untracked=$$(git ls-files --others --exclude-standard -- server/webui/dist); \
	if [ -n "$$untracked" ]; then echo "checkui: files of the bundle not in git:" $$untracked >&2; exit 1; fi; \
	echo "checkui: the web view's bundle is up to date"
TEST_PREREQS += checkui

ui-test: deps postgres $(BIN)/dg-init ## the web view's tests: serving, and the browser test in headless Chromium against a real server (as root)
	DELTAGYM_INIT=$(BIN)/dg-init go test -count=1 -timeout 10m ./server/webui/
