# python.mk: the Python SDK (clients/python): its tests, which start a real server (built from
# this checkout) on a Busybox image in a pytest fixture; its distributions (sdist and wheel), and
# the test of the wheel as PyPI's users get it; its overhead benchmark (bench/overhead.py).
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
	$(PY_VENV)/bin/python -m pip install -q --disable-pip-version-check $(PY_PINS)
	touch $@

# The package is installed (not editable) whenever its sources change.
$(PY_VENV)/.deltagym-installed: $(PY_VENV_STAMP) $(PY_SOURCES)
	$(PY_VENV)/bin/python -m pip install -q --disable-pip-version-check --no-build-isolation --force-reinstall --no-deps "./clients/python[test]"
	$(PY_VENV)/bin/python -m pip check
	touch $@

python-venv: $(PY_VENV)/.deltagym-installed ## create the Python SDK test venv in .cache/py-venv (pinned)

python-test: deps postgres $(BIN)/dg-init $(PY_VENV)/.deltagym-installed ## run the Python SDK tests against a real server
	cd clients/python && DELTAGYM_INIT=$(BIN)/dg-init $(CURDIR)/$(PY_VENV)/bin/python -m pytest -q -rs -p no:cacheprovider tests

# make test runs the Python suite too: it starts a real server from the cached build.
TEST_PREREQS += python-test

# The SDK's packaging and lint tools, pinned with every package they pull: build, twine (with
# readme_renderer's Markdown, for `twine check`), mypy with grpcio's and protobuf's stubs, ruff;
# the setuptools and wheel the distributions are built with (build --no-isolation: the pinned
# ones, not the newest on PyPI); and the SDK's dependencies with the gym extra's, for mypy.
PY_TOOLS_VENV := .cache/py-tools-venv
PY_TOOLS_PINS := build==1.6.1 twine==7.0.0 readme_renderer==46.0 comrak==0.0.16 mypy==2.4.1 ruff==0.17.5 \
	setuptools==80.9.0 wheel==0.45.1 types-grpcio==1.85.0.20261028 types-protobuf==7.35.1.20261122 \
	grpcio==1.85.3 protobuf==7.36.2 googleapis-common-protos==1.76.0 gymnasium==1.4.0 numpy==2.4.6 cloudpickle==3.1.3 \
	Farama-Notifications==0.0.6 typing_extensions==4.16.0 ast_serialize==0.13.1 backports.tarfile==1.2.0 \
	certifi==2026.10.19.post1 cffi==2.1.1 charset-normalizer==3.5.3 cryptography==51.0.1 docutils==0.23.1 id==1.6.1 \
	idna==3.21 importlib_metadata==10.2.0 jaraco.classes==3.4.0 jaraco.context==6.1.2 jaraco.functools==4.6.0 \
	jeepney==0.9.0 keyring==25.7.0 lazy-importer==0.1.0 librt==0.17.0 markdown-it-py==4.3.0 mdurl==0.1.2 \
	more-itertools==11.2.1 mypy_extensions==1.2.0 nh3==0.3.8 packaging==26.4 pathspec==1.1.1 pycparser==3.12 \
	Pygments==2.21.0 pyproject_hooks==1.3.3 requests==2.34.2 requests-toolbelt==1.0.0 rfc3986==2.0.0 rich==15.0.0 \
	SecretStorage==3.5.0 urllib3==2.8.0 zipp==4.1.2
PY_TOOLS_STAMP := $(PY_TOOLS_VENV)/.deltagym-$(shell printf '%s' '$(PY_TOOLS_PINS)' | cksum | cut -d' ' -f1)

$(PY_TOOLS_STAMP):
	rm -rf $(PY_TOOLS_VENV)
	$(PY_PYTHON) -m venv $(PY_TOOLS_VENV)
	$(PY_TOOLS_VENV)/bin/python -m pip install -q --disable-pip-version-check --no-deps $(PY_TOOLS_PINS)
	$(PY_TOOLS_VENV)/bin/python -m pip check
	touch $@

.PHONY: python-tools python-dist python-wheel-test

python-tools: $(PY_TOOLS_STAMP) ## create the Python SDK's packaging and lint venv in .cache/py-tools-venv (pinned)

PY_VERSION = $(shell cat VERSION)
PY_DIST := .cache/py-dist
PY_WHEEL_VENV := .cache/py-wheel-venv

# `python -m build` makes the sdist, then the wheel from the unpacked sdist, so the wheel proves
# the sdist complete; twine check renders the README as PyPI will.
python-dist: $(PY_TOOLS_STAMP) ## build the Python SDK's sdist and wheel into .cache/py-dist, and check them (twine check)
	rm -rf $(PY_DIST)
	$(PY_TOOLS_VENV)/bin/python -m build --quiet --no-isolation --outdir $(PY_DIST) clients/python
	$(PY_TOOLS_VENV)/bin/python -m twine check --strict $(PY_DIST)/*
	$(PY_TOOLS_VENV)/bin/python clients/python/tools/check_dist.py sdist $(PY_DIST)/deltagym-$(PY_VERSION).tar.gz $(PY_VERSION)

# The wheel goes into a fresh venv with only its declared dependencies, which pip resolves from
# PyPI; every public module must import there (python -I: not from the source tree), a module
# that needs an extra must say which, and with the gym extra deltagym.gym imports. mypy, from the
# tools venv, type-checks a user's program against the installed package (py.typed, the stubs).
# PY_PYTHON=python3.10 (or any other Python the package supports) tests the wheel on that Python.
python-wheel-test: python-dist ## install the Python SDK's wheel into a fresh venv from PyPI and import every public module
	rm -rf $(PY_WHEEL_VENV)
	$(PY_PYTHON) -m venv $(PY_WHEEL_VENV)
	$(PY_WHEEL_VENV)/bin/python -m pip install -q --disable-pip-version-check $(PY_DIST)/deltagym-$(PY_VERSION)-py3-none-any.whl
	$(PY_WHEEL_VENV)/bin/python -m pip check
	$(PY_WHEEL_VENV)/bin/python -I clients/python/tools/check_dist.py installed $(PY_VERSION)
	$(PY_TOOLS_VENV)/bin/python -m mypy --strict --cache-dir /dev/null --python-executable $(PY_WHEEL_VENV)/bin/python \
		clients/python/tools/typed_user.py
	$(PY_WHEEL_VENV)/bin/python -m pip install -q --disable-pip-version-check "$(PY_DIST)/deltagym-$(PY_VERSION)-py3-none-any.whl[gym]"
	$(PY_WHEEL_VENV)/bin/python -m pip check
	$(PY_WHEEL_VENV)/bin/python -I clients/python/tools/check_dist.py installed $(PY_VERSION) gym

TEST_PREREQS += python-wheel-test

# The SDK's own cost per step over the raw generated stub (docs/PERFORMANCE.md, "The Python
# SDK's overhead"): in process against a trivial servicer (the client's cost alone), then against
# a private server on the default image (no ledger), N interleaved rounds each (raw stub, Client.step, Sandbox.run).
PY_BENCH_ARGS ?= --steps 2000

.PHONY: python-bench

python-bench: deps $(BIN)/deltagym $(BIN)/dg-init image $(PY_VENV)/.deltagym-installed ## the Python SDK's cost per step over the generated stub (p50/p99), in process and against a real server
	$(PY_VENV)/bin/python clients/python/bench/overhead.py --serve $(BIN)/deltagym --init $(BIN)/dg-init \
		--image-dir $(DATA)/images/default $(PY_BENCH_ARGS)

BENCH_TARGETS += python-bench
