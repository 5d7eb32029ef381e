# Everything a fresh machine needs: `make demo` and `make test` create .venv and install first.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: demo test test-fast lint bench profiles clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e ".[cpu,test,dev]"
	@command -v dot >/dev/null 2>&1 || { [ "$$(id -u)" = 0 ] && (apt-get install -y -q graphviz >/dev/null 2>&1 || (apt-get update -q >/dev/null 2>&1 && apt-get install -y -q graphviz >/dev/null 2>&1)) || echo "note: graphviz 'dot' not installed; dumps will write .dot files only"; }
	touch $(STAMP)

demo: $(STAMP)
	$(PY) examples/simple_net_propagation.py

# two workers (pytest-xdist): CI's machine has 2 cores; multi-process tests pick free ports and
# unique shared-memory names, so two of them may run at once
test: $(STAMP)
	$(PY) -m pytest -q -n 2

test-fast: $(STAMP)
	$(PY) -m pytest -q -n 2 -m "not slow"

lint: $(STAMP)
	$(VENV)/bin/ruff check autopar passes cost_model tests examples benchmarks tools

bench: $(STAMP)
	$(PY) benchmarks/bench_propagation.py
	$(PY) benchmarks/bench_compile_scale.py
	$(PY) benchmarks/bench_cost_model.py
	$(PY) benchmarks/bench_runtime.py
	$(PY) benchmarks/bench_long_run.py
	$(PY) benchmarks/bench_launch_faults.py
	$(PY) benchmarks/bench_memory.py
	$(PY) benchmarks/bench_mixed_precision.py
	$(PY) benchmarks/bench_pipeline.py
	$(PY) benchmarks/bench_training_pieces.py
	$(PY) benchmarks/bench_checkpoint.py
	$(PY) benchmarks/bench_pipeline_run.py
	$(PY) benchmarks/bench_check.py
	$(PY) benchmarks/bench_strategies.py
	$(PY) benchmarks/bench_vs_paddle.py
	$(PY) benchmarks/bench_context_parallel.py
	$(PY) benchmarks/bench_moe.py
	$(PY) benchmarks/bench_moe_dropless.py

# re-measure this machine's CPU profiles (cost_model/profiles/cpu_shm.json, cpu_gloo.json; about
# four minutes each, on an idle machine): the measuring is a tool, the cost model only reads them
profiles: $(STAMP)
	$(PY) tools/calibrate.py --communicator shm
	$(PY) tools/calibrate.py

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .hypothesis
