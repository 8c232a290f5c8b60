# swerex.mk: swe-rex 1.4.0's own client (RemoteRuntime, which needs aiohttp), from PyPI and
# unchanged, in a venv of its own; server/swerex's TestRemoteRuntime drives a real server's
# sandbox with it, finding its python through DELTAGYM_SWEREX_PYTHON.
SWEREX_PYTHON ?= python3
SWEREX_VENV := .cache/swerex-venv
# Every package of the venv, pinned (pip freeze of swe-rex==1.4.0 and aiohttp).
SWEREX_PINS := swe-rex==1.4.0 aiohttp==3.14.5 aiohappyeyeballs==2.7.1 aiosignal==1.4.0 annotated-doc==0.0.7 \
	annotated-types==0.8.0 anyio==4.16.0 attrs==26.1.0 bashlex==0.18 certifi==2026.10.19.post1 charset-normalizer==3.5.3 \
	click==8.5.1 fastapi==0.165.0 frozenlist==1.8.0 h11==0.16.0 idna==3.21 markdown-it-py==4.3.0 mdurl==0.1.2 \
	multidict==7.2.1 opentelemetry-api==1.45.3 pexpect==4.9.0 propcache==0.5.4 ptyprocess==0.7.0 pydantic==2.14.4 \
	pydantic_core==2.50.5 Pygments==2.21.0 python-multipart==0.0.34 requests==2.34.2 rich==15.0.0 starlette==1.10.0 \
	typing-inspection==0.4.5 typing_extensions==4.16.0 urllib3==2.8.0 uvicorn==0.55.0 yarl==1.25.1
# The stamp's name changes with the pins, so new pins rebuild the venv.
SWEREX_VENV_STAMP := $(SWEREX_VENV)/.deltagym-$(shell printf '%s' '$(SWEREX_PINS)' | cksum | cut -d' ' -f1)

# Every go test that make runs finds the client (the test fails without it under make as root).
export DELTAGYM_SWEREX_PYTHON := $(CURDIR)/$(SWEREX_VENV)/bin/python

.PHONY: swerex-venv

$(SWEREX_VENV_STAMP):
	rm -rf $(SWEREX_VENV)
	$(SWEREX_PYTHON) -m venv $(SWEREX_VENV)
	$(SWEREX_VENV)/bin/python -m pip install -q --disable-pip-version-check --no-deps $(SWEREX_PINS)
	$(SWEREX_VENV)/bin/python -m pip check
	touch $@

swerex-venv: $(SWEREX_VENV_STAMP) ## create the venv with swe-rex 1.4.0's client in .cache/swerex-venv (pinned)

TEST_PREREQS += swerex-venv
test-privileged: swerex-venv
