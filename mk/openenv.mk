# openenv.mk: the venvs of the OpenEnv clients that the server's OpenEnv front end is tested with
# (server/openenv/testdata/clients): openenv 0.10.0, openenv-core 0.3.0 and verifiers 0.4.0, each
# from PyPI, unchanged, in a venv of its own (openenv and openenv-core both install as `import
# openenv`). Every package of a venv is pinned in its requirements file; the stamp's name changes
# with that file, so new pins rebuild the venv. The venvs live in .cache, kept across test runs.
# The tests find their pythons in the DELTAGYM_OPENENV*_PYTHON variables exported here.

OE_PYTHON ?= python3
OE_CLIENTS := server/openenv/testdata/clients

# $(1): the venv's name; $(2): its requirements file; $(3): Python statements (no commas: they
# would split the argument) that prove the clients import.
define oe_venv
$(1)_VENV := .cache/$(1)-venv
$(1)_STAMP := $$($(1)_VENV)/.deltagym-$$(shell cksum < $(2) | cut -d' ' -f1)
# The stamp's name holds the file's sum, so it depends on the file's contents, not its time: a
# fresh clone reuses the venv that a checkout of the same pins built.
$$($(1)_STAMP):
	rm -rf $$($(1)_VENV)
	$(OE_PYTHON) -m venv $$($(1)_VENV)
	$$($(1)_VENV)/bin/python -m pip install -q --disable-pip-version-check -r $(2)
	$$($(1)_VENV)/bin/python -m pip check
	$$($(1)_VENV)/bin/python -c '$(3)'
	touch $$@
endef

$(eval $(call oe_venv,openenv010,$(OE_CLIENTS)/requirements-openenv010.txt,from openenv import AutoEnv; from openenv.core import GenericEnvClient; from openenv.core import MCPToolClient))
$(eval $(call oe_venv,openenv030,$(OE_CLIENTS)/requirements-openenv030.txt,from openenv import AutoEnv; from openenv.core import GenericEnvClient))
$(eval $(call oe_venv,verifiers040,$(OE_CLIENTS)/requirements-verifiers040.txt,from verifiers.v1.tasksets.openenv import OpenEnvEnv; from openenv.core import GenericEnvClient))

export DELTAGYM_OPENENV010_PYTHON := $(CURDIR)/$(openenv010_VENV)/bin/python
export DELTAGYM_OPENENV030_PYTHON := $(CURDIR)/$(openenv030_VENV)/bin/python
export DELTAGYM_VERIFIERS040_PYTHON := $(CURDIR)/$(verifiers040_VENV)/bin/python

.PHONY: openenv-venvs openenv-clients-smoke

OE_STAMPS := $(openenv010_STAMP) $(openenv030_STAMP) $(verifiers040_STAMP)

# The three are built at once: each is mostly waiting on downloads.
openenv-venvs: ## create the pinned venvs of the OpenEnv clients (openenv 0.10.0, openenv-core 0.3.0, verifiers 0.4.0) in .cache
	@$(MAKE) --no-print-directory -j3 $(OE_STAMPS)

# Each client program, pointed at a port nothing listens on, must fail cleanly: one JSON result
# line that says so, exit status 1.
openenv-clients-smoke: openenv-venvs ## run the OpenEnv client programs against nothing (they must fail cleanly)
	@for p in "$(DELTAGYM_OPENENV010_PYTHON) $(OE_CLIENTS)/openenv010.py" \
		"$(DELTAGYM_OPENENV030_PYTHON) $(OE_CLIENTS)/openenv030.py" \
		"$(DELTAGYM_VERIFIERS040_PYTHON) $(OE_CLIENTS)/verifiers040.py"; do \
		set +e; out=$$($$p http://127.0.0.1:9/openenv/none tok 2>/dev/null); rc=$$?; set -e; \
		echo "$$out"; \
		[ $$rc = 1 ] && printf '%s' "$$out" | grep -q '"ok": false' || { echo "$$p: want exit 1 and ok false, got $$rc" >&2; exit 1; }; \
	done

TEST_PREREQS += openenv-venvs
