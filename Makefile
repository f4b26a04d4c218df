# Every target works from a fresh clone with nothing but Python 3.11 installed.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
# Two pipeline ranks on this machine, rendezvous on the loopback interface only.
NPROC ?= 2
TORCHRUN := $(VENV)/bin/torchrun --nnodes 1 --nproc-per-node $(NPROC) --rdzv-backend c10d --rdzv-endpoint 127.0.0.1:0
ARGS ?=

.PHONY: install test test-fast test-unit lint smoke train-nmt eval-nmt translate train-amoebanet \
        eval-amoebanet classify \
        bench bench-overhead bench-pipeline bench-protocol bench-decoding reproduce-stability reproduce-depth-width \
        reproduce-memory reproduce-throughput validate-simulator reproduce-app-pipelines \
        reproduce-paper-scale \
        demo-large-nmt reproduce-defaults clean

install: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[dev]'
	touch $(STAMP)

test: install
	$(PY) -m pytest -q tests

# Everything but the slow and the multi-process tests: the apps on a tiny corpus (built once),
# the scripts' quick checks, the library.
test-fast: install
	$(PY) -m pytest -q -m "not slow and not distributed" tests

# The library alone (gpipe_core): no corpus, no app, no script, one process (tests/*.py).
test-unit: install
	$(PY) -m pytest -q -m "not slow and not distributed" tests \
		--ignore=tests/apps --ignore=tests/scripts --ignore=tests/distributed

lint: install
	$(VENV)/bin/ruff check gpipe_core apps data scripts tests
	$(VENV)/bin/mypy gpipe_core

# The paper's second application on this CPU: prepare the corpus, train on 2 pipeline stages
# (at most 30 minutes), then print dev BLEU per resource bucket beside copying the source.
train-nmt: install
	$(TORCHRUN) -m apps.nmt.train $(ARGS)

eval-nmt: install
	$(PY) -m apps.nmt.evaluate --ckpt runs/nmt --split test $(ARGS)

# Text to English with the trained model, stdin to stdout: make translate ARGS="--lang de" < in
translate: install
	$(PY) -m apps.nmt.translate --ckpt runs/nmt $(ARGS)

# The paper's first application: Fashion-MNIST from Debian, AmoebaNet-D on 2 pipeline stages.
train-amoebanet: install
	$(TORCHRUN) -m apps.amoebanet.train $(ARGS)

eval-amoebanet: install
	$(PY) -m apps.amoebanet.evaluate --ckpt runs/amoebanet --split test $(ARGS)

# Top-5 classes of image files: make classify ARGS="shirt.png boot.jpg"
classify: install
	$(PY) -m apps.amoebanet.classify --ckpt runs/amoebanet $(ARGS)

# Both apps end to end on tiny configs with 2 pipeline ranks, in a few minutes.
smoke: install
	$(PY) scripts/smoke.py

# Single-process overhead and re-materialization memory; docs/reproduction/bench_overhead.json
# (every step's sample, commit, torch, time, machine, load) and out/bench_overhead.json.
bench-overhead: install
	$(PY) scripts/bench_overhead.py

# DistributedGPipe against the plain module and torch.distributed.pipelining (K=2, M=1-16);
# docs/reproduction/bench_pipeline.json (every round's sample, provenance) and out/bench_pipeline/.
bench-pipeline: install
	$(PY) scripts/bench_pipeline.py

# Issue 26's protocol: bench-pipeline's comparison with torch.distributed.pipelining at K=2, M=8,
# three independent launches per model family; resumes from the runs' JSON (50 minutes here).
bench-protocol: install
	$(PY) scripts/bench_protocol.py $(ARGS)

# Pipelined NMT decoding (K=2, G groups in flight) against one process with 1 and 2 threads;
# writes docs/reproduction/decoding.json (about 2 minutes on 2 idle cores).
bench-decoding: install
	$(PY) scripts/bench_decoding.py $(ARGS)

bench: bench-overhead bench-pipeline bench-decoding

# The two first commands as a new user runs them, alone (normal) and on half the cores (halved:
# a CPU cgroup, needs root; --condition slowed runs both at once instead): do they end within
# 30 minutes with their promised quality? (~2 h; docs/reproduction/defaults_*.json)
reproduce-defaults: install
	$(PY) scripts/reproduce_defaults.py --condition normal $(ARGS)
	$(PY) scripts/reproduce_defaults.py --condition halved $(ARGS)

# The paper's NMT findings at CPU scale, as issue 21 designs them (docs/REPRODUCTION.md):
# stability as learning-rate sensitivity, and depth against width with transfer. Each prepares
# its corpus, writes one JSON per run under docs/reproduction/<experiment>/ and skips runs whose
# JSON exists (rerun to continue a sweep); hours of CPU, see the plan there. ARGS=--quick runs
# the tiny versions the tests use (needs ARGS="--quick --set data_dir=... packages=none").
reproduce-stability: install
	$(PY) scripts/reproduce_stability.py $(ARGS)

reproduce-depth-width: install
	$(PY) scripts/reproduce_depth_width.py $(ARGS)

# The paper's systems tables at CPU scale (docs/REPRODUCTION.md, results in docs/reproduction/).
# Table 1: the largest AmoebaNet-D / Transformer whose training step fits 512 MB per process.
reproduce-memory: install
	$(PY) scripts/reproduce_memory.py $(ARGS)

# Table 1's budget closed end to end: a 48M-parameter NMT model (whole training state 736 MB)
# trained a few steps on 2 ranks and evaluated with BLEU through the pipeline, every process
# under 512 MB above its baseline (~2 min; docs/reproduction/large_nmt_demo.json).
demo-large-nmt: install
	$(PY) scripts/demo_large_nmt.py $(ARGS)

# Table 2: throughput against M measured at K=2, predicted for K up to 16; simulator accuracy;
# then gp.plan's choice against the best measured configuration (from the results, ~10 s).
reproduce-throughput: install
	$(PY) scripts/reproduce_throughput.py $(ARGS)
	$(PY) scripts/plan_vs_measured.py

# gp.simulate out of sample: costs replayed with gp.profile_stages in one launch predict the
# steps of every configuration measured in another (K=2; Table 2's two families and a held-out
# nn.TransformerEncoderLayer stack; docs/reproduction/simulator/). Needs a quiet machine.
validate-simulator: install
	$(PY) scripts/validate_simulator.py $(ARGS)

# Tables 1 and 2 at the paper's scale, predicted from models counted on meta for the paper's
# devices (TPU v2/v3 cores, P100, P40); nothing allocated at full size (minutes on this CPU;
# docs/reproduction/paper_scale.json, docs/REPRODUCTION.md).
reproduce-paper-scale: install
	$(PY) scripts/reproduce_paper_scale.py $(ARGS)

# The apps' own CPU defaults at K=2 against GPipe's bubble, cut by parameters and by time (~10 min).
reproduce-app-pipelines: install
	$(PY) scripts/reproduce_throughput.py --families nmt_app amoebanet_app --microbatches 1 2 4 8 \
		--balance params --tag apps_params $(ARGS)
	$(PY) scripts/reproduce_throughput.py --families nmt_app amoebanet_app --microbatches 1 2 4 8 \
		--balance time --tag apps_time $(ARGS)
	$(PY) scripts/app_efficiency.py docs/reproduction/throughput_apps_params.json \
		docs/reproduction/throughput_apps_time.json

clean:
	rm -rf $(VENV) .cache out
