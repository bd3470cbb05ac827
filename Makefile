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

.PHONY: install engines serve test test-unit lint bench gpu-check devkit clean

install: $(VENV)/.installed

# Re-runs only when a pyproject changes. torch first: a plain torch requirement would pull CUDA.
$(VENV)/.installed: pyproject.toml $(PLUGINS)
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	@$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install -q "torch==$(TORCH_VERSION)"
	$(PY) -m pip install -q -e ".[dev]" $(foreach p,$(PLUGINS),-e "$(dir $(p))[test]")
	@touch $@

engines: install
	$(VENV)/bin/trtserver build $(if $(MODEL),--model "$(MODEL)") $(if $(NAME),--name "$(NAME)")
	@# the fused CPU kernels, compiled once here (~30 s) so that start-up only loads them; optional
	-@$(PY) -m trtserver.engine.torch.kernels

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

bench: engines
	$(PY) -m bench.harness $(BENCH_ARGS)

# the engine, bench.harness --device cuda (1/16/64 streams, roofline), then the HTTP suite on it; 8 minutes at most
gpu-check: install
	PYTHON=$(PY) OUT=bench/out/gpu-check RUN_S=480 bash bench/device_check.sh check

# for a lent GPU machine with no network: wheels and the model in two parts (README, "The GPU check on a lent machine")
devkit: install
	$(PY) -m bench.device_kit

clean:
	rm -rf $(VENV) engines .cache .devkit .devkit.new
