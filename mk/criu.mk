# criu.mk: CRIU >= 4.2.1 from Debian sid in a private prefix (scripts/criu.sh).
# $(CRIU) is the wrapper to run; internal/locate finds it through DELTAGYM_CRIU or at this path
# (the default of deltagym serve --criu).
CRIU_PREFIX ?= $(CURDIR)/.cache/criu
CRIU := $(CRIU_PREFIX)/bin/criu

.PHONY: criu
criu: ## install CRIU 4.2.1+ into a private prefix (.cache/criu)
	@./scripts/criu.sh $(CRIU_PREFIX)
TEST_PREREQS += criu
