# python.mk: the Python SDK (clients/python) and its tests, which start a real server
# (built from this checkout) on a Busybox image in a pytest fixture.
DEPS_GROUPS += postgres image

PY_PYTHON ?= python3
PY_VENV := .cache/py-venv
# Every package of the test venv, pinned (the SDK's own floors are in its pyproject).
PY_PINS := grpcio==1.85.3 protobuf==7.36.2 googleapis-common-protos==1.76.0 gymnasium==1.4.0 numpy==2.4.6 cloudpickle==3.1.3 \
	Farama-Notifications==0.0.6 typing_extensions==4.16.0 pytest==9.2.0 pytest-timeout==2.4.0 \
	iniconfig==2.3.1 packaging==26.4 pluggy==1.7.0 Pygments==2.21.0 setuptools==80.9.0 wheel==0.45.1
# The stamp's name changes with the pins, so new pins rebuild the venv.
PY_VENV_STAMP := $(PY_VENV)/.deltagym-$(shell printf '%s' '$(PY_PINS)' | cksum | cut -d' ' -f1)
PY_SOURCES := $(shell find clients/python/deltagym -name '*.py' -o -name '*.pyi' 2>/dev/null) clients/python/pyproject.toml

.PHONY: python-venv python-test

$(PY_VENV_STAMP):
	rm -rf $(PY_VENV)
	$(PY_PYTHON) -m venv $(PY_VENV)
	$(PY_VENV)/bin/pip install -q --disable-pip-version-check $(PY_PINS)
	touch $@

# The package is installed (not editable) whenever its sources change.
$(PY_VENV)/.deltagym-installed: $(PY_VENV_STAMP) $(PY_SOURCES)
	$(PY_VENV)/bin/pip install -q --disable-pip-version-check --no-build-isolation --force-reinstall --no-deps "./clients/python[test]"
	$(PY_VENV)/bin/pip check
	touch $@

python-venv: $(PY_VENV)/.deltagym-installed ## create the Python SDK test venv in .cache/py-venv (pinned)

python-test: deps postgres $(BIN)/dg-init $(PY_VENV)/.deltagym-installed ## run the Python SDK tests against a real server
	cd clients/python && DELTAGYM_INIT=$(BIN)/dg-init $(CURDIR)/$(PY_VENV)/bin/python -m pytest -q -rs -p no:cacheprovider tests

# make test runs the Python suite too: it starts a real server from the cached build.
TEST_PREREQS += python-test
