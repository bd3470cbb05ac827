# The README's two commands: `make serve` and `make test`. Everything else is what they build on.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
TORCH_VERSION ?= 2.13.0
MODEL ?=
NAME ?=
ENGINE_DIR ?= engines/SmolLM2-135M-Instruct
HOST ?= 127.0.0.1
PORT ?= 8000
PLUGINS := $(wildcard plugins/*/pyproject.toml)
PYTEST_ARGS ?=
# Debian packages the tests run for real (tests/replicas, plugins/redis_quota, the playground's browser tests)
SYSTEM_PACKAGES ?= redis-server nginx openssl chromium chromium-driver
BUNDLE ?= dist/bundle
BUNDLE_ARGS ?=

.PHONY: install system-packages engines serve test test-unit lint bench gpu-check bundle clean

install: $(VENV)/.installed

# Re-runs only when a pyproject changes. torch first: a plain torch requirement would pull CUDA.
$(VENV)/.installed: pyproject.toml $(PLUGINS) | system-packages
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	@$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install -q "torch==$(TORCH_VERSION)"
	$(PY) -m pip install -q -e ".[dev]" $(foreach p,$(PLUGINS),-e "$(dir $(p))[test]")
	@touch $@

# apt-get (as root, else through sudo) only when one is missing; elsewhere a note of what the tests need
system-packages:
	@missing=""; for p in $(SYSTEM_PACKAGES); do \
	  dpkg-query -W -f='$${Status}' "$$p" 2>/dev/null | grep -q "ok installed" || missing="$$missing $$p"; done; \
	if [ -z "$$missing" ]; then exit 0; fi; \
	if ! command -v apt-get >/dev/null; then echo "note: the tests need these system packages:$$missing" >&2; exit 0; fi; \
	sudo=""; [ "$$(id -u)" = 0 ] || sudo=sudo; \
	echo "installing system packages:$$missing"; \
	$$sudo env DEBIAN_FRONTEND=noninteractive apt-get update -qq && \
	$$sudo env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends $$missing

engines: install
	$(VENV)/bin/trtserver build $(if $(MODEL),--model "$(MODEL)") $(if $(NAME),--name "$(NAME)")
	@# the fused CPU kernels, compiled once here (~30 s) so that start-up only loads them; optional
	-@$(PY) -m trtserver.engine.torch.cpu.kernels

serve: engines
	$(VENV)/bin/trtserver serve $(ENGINE_DIR) --host $(HOST) --port $(PORT)

test: engines
	$(PY) -m pytest -q $(PYTEST_ARGS)

# no model, no network: an existing environment is used as it is (a fresh clone's newer pyproject does not
# reinstall); the fuzz suite's pytest plugins (hypothesis, schemathesis) stay unloaded
test-unit:
	@test -x $(PY) || $(MAKE) install
	$(PY) -m pytest -q -p no:hypothesispytest -p no:schemathesis tests/unit $(PYTEST_ARGS)

lint: install
	$(VENV)/bin/ruff check trtserver build_engines plugins tests bench
	$(VENV)/bin/mypy trtserver build_engines

# ours against llama.cpp on the same model: writes bench/results/<machine-label>.md afresh, raw runs to bench/out/
bench: engines
	$(PY) -m bench.harness $(BENCH_ARGS)

# on a machine with a CUDA GPU: bench.harness --device cuda (1/16/64 streams, roofline), then the HTTP suite on CUDA
gpu-check: engines
	@if $(PY) -c "import sys, torch; sys.exit(not torch.cuda.is_available())"; then \
		$(PY) -m bench.harness --device cuda --no-profile --max-minutes 3; \
	else echo "gpu-check: no CUDA device: the harness is skipped; the HTTP suite runs on the CPU"; exit_code=1; fi; \
	$(PY) bench/gpu_check.py --skip-build --budget 300 && exit $${exit_code:-0}

# an offline install bundle for an air-gapped host (docs/deploy.md, "Air-gapped hosts"), e.g.
#   make bundle BUNDLE_ARGS="--python-version 3.10 --platform linux-aarch64 --part-size 2G"
bundle: install
	$(VENV)/bin/trtserver bundle $(BUNDLE) $(BUNDLE_ARGS)

clean:
	rm -rf $(VENV) engines .cache $(BUNDLE) $(BUNDLE).partial
