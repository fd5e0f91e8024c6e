# omni-mesh: `make run` serves a model (`omni-mesh serve $(MODEL)`), `make demo` the toy pipeline,
# `make test` runs the whole suite.
# `make run` needs only python3 with its venv module (no root): .venv with the runtime deps and the
# engines extra (transformers, PyAV, Pillow: what serve runs).
# `make test` adds what only the tests use: system packages (root, or it prints the apt-get line) and
# every extra. Each has its own stamp, so a `make test` after a `make run` installs only the rest.

PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
PIP    := $(BIN)/pip install --quiet --disable-pip-version-check
RUN_STAMP  := $(VENV)/.installed-run
TEST_STAMP := $(VENV)/.installed-test
PORT   ?= 8000
# The model `make run` serves: a hub id or a directory. By default a tiny random Qwen2.5-Omni built
# offline on the first run (seconds; it speaks noise): MODEL=Qwen/Qwen2.5-Omni-3B make run for real weights.
TINY_MODEL := .cache/tiny-qwen2_5_omni
MODEL  ?= $(TINY_MODEL)
# The tiny talker never says stop: its replies are cut at 200 codes (4 s of audio), not the engine's 2048.
SERVE_FLAGS ?= $(if $(filter $(TINY_MODEL),$(MODEL)),--max-audio-tokens 200)
RUN_EXTRAS := engines
# CPU build of torch (a local wheel on this project's machines); an unpinned torch may pull a
# multi-GB CUDA build. GPU users install their own torch before `pip install omni-mesh`. The demo's
# toy models run on torch (services/omni_demo/model.py), so `make run` needs it too.
TORCH  ?= torch==2.13.0
# What the demo imports: checked after the install so that a broken one fails here, not at `ready`.
# torchvision after omni_mesh.engines: importing it makes torchvision importable next to a CPU torch (vision_ops).
RUN_IMPORTS  := torch, numpy, zmq, cryptography, msgpack, yaml, fastapi, fastapi_offline, uvicorn, httpx, prometheus_client, \
                transformers, huggingface_hub, av, PIL, omni_mesh.engines, torchvision
TEST_IMPORTS := pytest, xdist, hypothesis, openai, mooncake.engine, mooncake.store, yr.datasystem
# Only the tests use these: libibverbs1 (Mooncake's wheels link it); iproute2 (multi-host tests, ip
# netns); iptables (a test drops a side channel's packets); docker-compose, docker.io and mmdebstrap (the compose files, the engine and the base image of
# tests/test_docker_compose.py); prometheus and chromium (the observability tests scrape /metrics with a
# real Prometheus, render /dashboard in headless Chromium); openssl (the TLS tests' certificates).
TEST_SYSTEM_PACKAGES := libibverbs1 iproute2 iptables docker-compose prometheus chromium openssl docker.io mmdebstrap
TEST_EXTRAS := dev,mooncake,yuanrong,engines

.PHONY: install install-test test-system-deps run demo test bench lint clean

install: $(RUN_STAMP)
install-test: test-system-deps $(TEST_STAMP)  # system packages checked every time: one may be added

$(RUN_STAMP): pyproject.toml
	@$(PYTHON) -c "import ensurepip, venv" 2>/dev/null || { echo "error: $(PYTHON) cannot create a venv" \
		"(no venv/ensurepip module): install the package python3-venv (Debian, Ubuntu)"; exit 1; }
	$(PYTHON) -m venv $(VENV)
	$(PIP) $(TORCH)
	$(PIP) -e '.[$(RUN_EXTRAS)]'
	$(BIN)/python -c "import $(RUN_IMPORTS)" || { echo "error: the install is incomplete (see above)"; exit 1; }
	touch $@

$(TEST_STAMP): $(RUN_STAMP) pyproject.toml
	@$(MAKE) --no-print-directory test-system-deps
	$(PIP) -e '.[$(TEST_EXTRAS)]'
	$(BIN)/python -c "import $(RUN_IMPORTS), $(TEST_IMPORTS)" \
		|| { echo "error: the install is incomplete (see above)"; exit 1; }
	touch $@

test-system-deps:
	@missing=$$(for p in $(TEST_SYSTEM_PACKAGES); do dpkg -s $$p >/dev/null 2>&1 || echo $$p; done); \
	if [ -n "$$missing" ]; then \
		if [ "$$(id -u)" != 0 ]; then \
			echo "error: missing system packages:$$missing; run: sudo apt-get install -y --no-install-recommends$$missing"; exit 1; \
		fi; \
		echo "installing system packages:$$missing"; \
		apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends $$missing; \
	fi

run: install $(filter $(TINY_MODEL),$(MODEL))
	$(BIN)/omni-mesh serve $(MODEL) --port $(PORT) $(SERVE_FLAGS)

# Built into a temporary directory first: an interrupted build leaves nothing that looks finished.
$(TINY_MODEL): | $(RUN_STAMP)
	rm -rf $@.partial
	$(BIN)/omni-mesh models tiny qwen2_5_omni $@.partial
	mv $@.partial $@

# The toy pipeline (services/omni_demo): seeded toy models with the real pipeline's shapes.
demo: install
	$(BIN)/omni-mesh up compose/omni-demo.yaml --port $(PORT)

# Two workers taking whole files: most test time waits on the processes a test started (docs/testing.md).
test: install-test
	$(BIN)/python -m pytest -q -n 2 --dist loadfile --no-loadscope-reorder

# Every connector that runs here without a service of yours: YuanrongConnector against a throwaway
# worker it starts itself. MooncakeStoreConnector needs a master: `omni-mesh bench connector
# --connector MooncakeStoreConnector --config ...` (docs/benchmarks.md).
bench: install-test
	$(BIN)/omni-mesh bench connector --connector SharedMemoryConnector
	$(BIN)/omni-mesh bench connector --connector ZmqConnector --sizes 16MiB,256MiB
	$(BIN)/omni-mesh bench connector --connector MooncakeTransferEngineConnector --sizes 16MiB,256MiB
	$(BIN)/omni-mesh bench connector --connector YuanrongConnector --sizes 16MiB --start-worker
	$(BIN)/omni-mesh bench pipeline --topology compose/noop-pipeline.yaml --concurrency 32 --duration 10

lint: install-test
	$(BIN)/ruff check .

clean:
	rm -rf $(VENV) .cache .pytest_cache .ruff_cache .hypothesis *.egg-info
