# Everything goes through .venv, made on demand from the system python3 (3.11+).
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed
# The test files run in this many processes (pytest-xdist), each file's tests in one: most
# tests wait on real processes, so two halve the suite's time on 2 CPUs. A file's tests may
# share what no two files do (a job uid, say). `make test TEST_PROCESSES=0` runs them in one.
TEST_PROCESSES ?= 2

.PHONY: venv proto run test lint bench bench-peers bench-scale chaos clean

venv: $(STAMP)

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -e '.[test,dev]'
	touch $(STAMP)

# Regenerates gen/ from proto/; the output is committed and never edited by hand.
proto: $(STAMP)
	$(BIN)/python -m grpc_tools.protoc -Iproto --python_out=gen --pyi_out=gen proto/worker_protocol.proto

# Development run: sockets and journal under ./.run, UDP on 127.0.0.1:5555, one worker per CPU.
run: $(STAMP)
	mkdir -p .run
	$(BIN)/controller --config packaging/dev.json --workers auto

# Services the tests start themselves (redis-server, chromium and chromium-driver) are
# installed when root and missing; otherwise their tests skip and say why.
test: $(STAMP)
	@if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
	    need=""; \
	    command -v redis-server >/dev/null 2>&1 || need="$$need redis-server"; \
	    command -v chromium >/dev/null 2>&1 || need="$$need chromium"; \
	    command -v chromedriver >/dev/null 2>&1 || need="$$need chromium-driver"; \
	    if [ -n "$$need" ]; then \
	        echo "installing$$need for the tests"; \
	        (apt-get update -qq && apt-get install -y -qq $$need) >/dev/null 2>&1 \
	            || echo "could not install$$need: their tests will be skipped"; \
	    fi; \
	fi
	$(BIN)/python -m pytest -n $(TEST_PROCESSES) --dist loadfile

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy .

bench: $(STAMP)
	$(BIN)/pip install --quiet -e '.[bench]'
	$(BIN)/python -m bench

# The same workload against Gearman, Celery, Dramatiq, RQ and Huey (installed in .venv-peers,
# servers from Debian's packages), beside our doors, in one run; then jobs of 1 ms and 10 ms
# (`python -m bench.peers --lengths` alone). Not part of `make test`.
bench-peers: $(STAMP)
	$(BIN)/pip install --quiet -e '.[bench]'
	$(BIN)/python -m bench.peers

# Jobs/s and the controller's CPU per job for 1, 2, 4, ... workers up to the host's CPUs, jobs of
# 0, 1 and 10 ms, beside ProcessPoolExecutor(n); journal off and on (bench/scale.py).
bench-scale: $(STAMP)
	$(BIN)/pip install --quiet -e '.[bench]'
	$(BIN)/python -m bench.scale

# Every fault at once for 4 minutes (seeded); exit status 1 if an acknowledged task was lost.
chaos: $(STAMP)
	$(BIN)/python -m bench.chaos --seconds 240

clean:
	rm -rf $(VENV) .venv-peers .run build *.egg-info
