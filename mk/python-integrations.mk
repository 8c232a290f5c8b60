# python-integrations.mk: the tests of the Python SDK's TRL and SkyRL adapters
# (deltagym.integrations), in a venv of their own holding the frameworks'
# pieces the adapters meet: transformers 5.23.0 without torch (TRL's
# GRPOTrainer turns an environment's tools into schemas with its
# get_json_schema; the tests do what the trainer does) and skyrl-gym 0.4.0
# from PyPI, unchanged. They start a real server, as python-test does.
PYI_PYTHON ?= python3
PYI_VENV := .cache/py-integrations-venv
# Every package of the venv, pinned (pip freeze of the SDK's test pins,
# transformers==5.23.0 and skyrl-gym==0.4.0).
PYI_PINS := grpcio==1.85.3 protobuf==7.36.2 googleapis-common-protos==1.76.0 gymnasium==1.4.0 numpy==2.4.6 \
	cloudpickle==3.1.3 Farama-Notifications==0.0.6 typing_extensions==4.16.0 pytest==9.2.0 pytest-timeout==2.4.0 \
	iniconfig==2.3.1 packaging==26.4 pluggy==1.7.0 Pygments==2.21.0 setuptools==80.9.0 wheel==0.45.1 \
	transformers==5.23.0 annotated-doc==0.0.7 annotated-types==0.8.0 anyio==4.16.0 click==8.5.1 filelock==4.3.2 \
	fsspec==2026.9.0 h11==0.16.0 hf-xet==1.8.0 httpcore2==2.17.0 httpx2==2.17.0 huggingface_hub==2.4.0 idna==3.21 \
	markdown-it-py==4.3.0 mdurl==0.1.2 pydantic==2.14.4 pydantic_core==2.50.5 PyYAML==6.0.4 regex==2026.12.2 \
	rich==15.0.0 safetensors==0.8.0 shellingham==1.5.4 tokenizers==0.23.3 tqdm==4.70.1 truststore==0.10.5 \
	typer==0.29.2 typing-inspection==0.4.5 \
	skyrl-gym==0.4.0 func_timeout==4.3.5 omegaconf==2.4.0 pandas==3.1.1 python-dateutil==4.0.0 tzdata==2026.6 \
	requests==2.34.2 certifi==2026.10.19.post1 charset-normalizer==3.5.3 urllib3==2.8.0
# TRL's environments need no torch: the venv is checked to have none, so the
# tests prove it.
PYI_VENV_STAMP := $(PYI_VENV)/.deltagym-$(shell printf '%s' '$(PYI_PINS)' | cksum | cut -d' ' -f1)
PYI_SOURCES := $(shell find clients/python/deltagym -name '*.py' -o -name '*.pyi' 2>/dev/null) clients/python/pyproject.toml
PYI_TESTS := tests/test_trl.py tests/test_skyrl.py

.PHONY: python-integrations-venv python-integrations-test

$(PYI_VENV_STAMP):
	rm -rf $(PYI_VENV)
	$(PYI_PYTHON) -m venv $(PYI_VENV)
	$(PYI_VENV)/bin/python -m pip install -q --disable-pip-version-check --no-deps $(PYI_PINS)
	$(PYI_VENV)/bin/python -m pip check
	! $(PYI_VENV)/bin/python -c 'import torch' 2>/dev/null
	touch $@

# The package is installed (not editable) whenever its sources change.
$(PYI_VENV)/.deltagym-installed: $(PYI_VENV_STAMP) $(PYI_SOURCES)
	$(PYI_VENV)/bin/python -m pip install -q --disable-pip-version-check --no-build-isolation --force-reinstall --no-deps ./clients/python
	$(PYI_VENV)/bin/python -m pip check
	touch $@

python-integrations-venv: $(PYI_VENV)/.deltagym-installed ## create the venv of the TRL and SkyRL adapter tests in .cache/py-integrations-venv (pinned)

python-integrations-test: deps postgres $(BIN)/dg-init $(PYI_VENV)/.deltagym-installed ## run the TRL and SkyRL adapter tests against a real server
	cd clients/python && DELTAGYM_INIT=$(BIN)/dg-init $(CURDIR)/$(PYI_VENV)/bin/python -m pytest -q -rs -p no:cacheprovider $(PYI_TESTS)

TEST_PREREQS += python-integrations-test
