# omni-mesh: `make run` starts the demo pipeline, `make test` runs the whole suite.
# Both set everything up on a fresh machine (system packages when missing, then .venv).

PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed
PORT   ?= 8000
# CPU build of torch (a local wheel on this project's machines); an unpinned torch may pull a
# multi-GB CUDA build. GPU users install their own torch before `pip install omni-mesh`.
TORCH  ?= torch==2.13.0
SYSTEM_PACKAGES := libibverbs1 iproute2 docker-compose prometheus chromium openssl docker.io mmdebstrap

.PHONY: install system-deps run test bench lint clean

install: system-deps $(STAMP)  # system packages checked every time: a new one may have been added

$(STAMP): pyproject.toml
	@$(MAKE) --no-print-directory system-deps
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --disable-pip-version-check $(TORCH)
	$(BIN)/pip install --quiet --disable-pip-version-check -e '.[dev,mooncake,yuanrong,engines]'
	$(BIN)/python -c "import torch, zmq, fastapi, prometheus_client, mooncake.engine, mooncake.store, yr.datasystem, transformers" \
		|| { echo "error: the install is incomplete (see above)"; exit 1; }
	touch $(STAMP)

# libibverbs1: Mooncake's wheels link it; iproute2: multi-host tests (ip netns);
# docker-compose: validates the compose files and runs them; docker.io and mmdebstrap: the engine and the
# base image of tests/test_docker_compose.py (no registry needed); prometheus and chromium: the
# observability tests scrape /metrics with a real Prometheus and render /dashboard in headless Chromium.
system-deps:
	@missing=$$(for p in $(SYSTEM_PACKAGES); do dpkg -s $$p >/dev/null 2>&1 || echo $$p; done); \
	if [ -n "$$missing" ]; then \
		if [ "$$(id -u)" != 0 ]; then \
			echo "error: missing system packages:$$missing; run: sudo apt-get install -y --no-install-recommends$$missing"; exit 1; \
		fi; \
		echo "installing system packages:$$missing"; \
		apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends $$missing; \
	fi

run: install
	$(BIN)/omni-mesh up compose/omni-demo.yaml --port $(PORT)

# Two workers taking whole files: most test time waits on the processes a test started (docs/testing.md).
test: install
	$(BIN)/python -m pytest -q -n 2 --dist loadfile --no-loadscope-reorder

# Every connector that runs here without a service of yours: YuanrongConnector against a throwaway
# worker it starts itself. MooncakeStoreConnector needs a master: `omni-mesh bench connector
# --connector MooncakeStoreConnector --config ...` (docs/benchmarks.md).
bench: install
	$(BIN)/omni-mesh bench connector --connector SharedMemoryConnector
	$(BIN)/omni-mesh bench connector --connector ZmqConnector --sizes 16MiB,256MiB
	$(BIN)/omni-mesh bench connector --connector MooncakeTransferEngineConnector --sizes 16MiB,256MiB
	$(BIN)/omni-mesh bench connector --connector YuanrongConnector --sizes 16MiB --start-worker
	$(BIN)/omni-mesh bench pipeline --topology compose/noop-pipeline.yaml --concurrency 32 --duration 10

lint: install
	$(BIN)/ruff check .

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache .hypothesis *.egg-info
