# Layer Offload developer targets. They work on a fresh clone:
#
#   make demo     python -m offload demo   (CUDA when present, the simulated device otherwise)
#   make test     python -m pytest -q      (tests/)
#   make test-comfy  the ComfyUI tests against COMFYUI_PATH (skipped by make test without it)
#   make test-stress the timing-adjacent test files 20 times in a row with a core kept busy (not in CI; docs/development.md,
#                 "Tests that cannot flake"; STRESS_RUNS, STRESS_BUSY, STRESS_FILES= for the whole suite)
#   make bench    benchmarks/bench_offload.py on the scaled-down shapes (BENCH_ARGS="..." to change)
#   make bench-hooks  benchmarks/bench_hooks.py: hook CPU cost per unit vs accelerate/diffusers (BENCH_HOOKS_ARGS)
#   make bench-gpu    benchmarks/bench_gpu.py: every offloader against resident on one CUDA GPU in under 8 minutes
#                     (its dry run on the simulated device without one; BENCH_GPU_ARGS; runbook: docs/benchmarks.md)
#
# Environment: a .venv is created when missing. torch is never a project dependency; it is installed
# only when the chosen interpreter cannot import one, and an installed torch (e.g. a CUDA build) is kept:
#   PYTHON=/path/to/python3 make test      create .venv from that interpreter (default: python3);
#                                          if it can already import torch (a venv or a system python),
#                                          .venv sees that interpreter's packages through a .pth file
#                                          (REUSE_TORCH=auto|1|0), so its torch is used, never replaced
#   PY=/path/to/comfy/python make test     use an existing environment directly, no .venv
#   TORCH_SPEC="torch==2.13.0" (default)   what to install when no torch is importable

PYTHON ?= python3
VENV ?= .venv
PY ?= $(VENV)/bin/python
REUSE_TORCH ?= auto
TORCH_SPEC ?= torch==2.13.0
PYTEST_ARGS ?= -q
DEMO_ARGS ?=
BENCH_ARGS ?=
BENCH_HOOKS_ARGS ?=
BENCH_GPU_ARGS ?=

ifeq ($(PY),$(VENV)/bin/python)
STAMP := $(VENV)/.layer-offload-installed
else
STAMP := .make/installed-$(subst /,_,$(PY))
endif

.PHONY: env demo test test-comfy bench bench-deps bench-hooks clean

env: $(STAMP)

$(STAMP): pyproject.toml
	@set -e; \
	if [ "$(PY)" = "$(VENV)/bin/python" ] && [ ! -x "$(VENV)/bin/python" ]; then \
	  echo "[make] creating $(VENV) with $(PYTHON)"; \
	  $(PYTHON) -m venv $(VENV); \
	  reuse=0; \
	  case "$(REUSE_TORCH)" in \
	    1|yes|true) reuse=1 ;; \
	    auto) if $(PYTHON) -c "import torch" >/dev/null 2>&1; then reuse=1; fi ;; \
	  esac; \
	  if [ $$reuse = 1 ]; then \
	    site=$$($(PY) -c "import sysconfig; print(sysconfig.get_paths()['purelib'])"); \
	    $(PYTHON) -c "import site, sysconfig; p = sysconfig.get_paths(); print('\n'.join(dict.fromkeys([p['purelib'], p['platlib'], *site.getsitepackages()])))" > "$$site/_layer_offload_parent.pth"; \
	    echo "[make] $(PYTHON) already has torch: $(VENV) sees its packages (after its own) via $$site/_layer_offload_parent.pth"; \
	  fi; \
	fi; \
	if $(PY) -W ignore -c "import torch" >/dev/null 2>&1; then \
	  echo "[make] keeping the installed torch $$($(PY) -W ignore -c 'import torch; print(torch.__version__)')"; \
	else \
	  echo "[make] no torch importable in $(PY): pip install $(TORCH_SPEC)"; \
	  $(PY) -m pip install "$(TORCH_SPEC)"; \
	fi; \
	before=$$($(PY) -W ignore -c "import torch; print(torch.__version__)"); \
	$(PY) -m pip install -e ".[test]"; \
	after=$$($(PY) -W ignore -c "import torch; print(torch.__version__)"); \
	if [ "$$before" != "$$after" ]; then \
	  echo "[make] ERROR: installing the project replaced torch $$before with $$after" >&2; exit 1; \
	fi; \
	echo "[make] environment ready: torch $$after"; \
	mkdir -p $(dir $(STAMP)); touch $(STAMP)

demo: env
	$(PY) -m offload demo $(DEMO_ARGS)

test: env
	@set +e; $(PY) -m pytest $(PYTEST_ARGS); rc=$$?; \
	if [ $$rc -eq 5 ]; then echo "[make] ERROR: pytest collected no tests (exit 5)" >&2; fi; \
	exit $$rc

# Tests that cannot flake: the files whose verdicts sit next to timing (placement and re-planning from measured costs,
# stalls and overlap, the read-ahead thread, budgets changed under load, pass locks and thread hand-offs, the measuring
# on the simulated device), STRESS_RUNS times in a row while STRESS_BUSY busy-loop processes (started and stopped by
# tests/stress.py) keep cores busy. Every run must pass. STRESS_FILES= (empty) runs the whole suite that way;
# STRESS_ARGS="--jitter-ms 1" also makes the engine's wall clock jump at random (tests/wall_clock_jitter.py), which finds
# a verdict resting on a measured time in a few runs where load alone may take hundreds.
STRESS_RUNS ?= 20
STRESS_BUSY ?= 1
STRESS_ARGS ?=
STRESS_FILES ?= tests/test_cost_placement.py tests/test_plan_believes_measurements.py tests/test_engine_report.py \
	tests/test_sim_clock.py tests/test_sim_backend.py tests/test_predict.py tests/test_plan.py \
	tests/test_budget_under_load.py tests/test_budget.py tests/test_budget_recency.py tests/test_disk_tier.py \
	tests/test_bounce_path.py tests/test_prefetch_pipeline.py tests/test_demand_loads.py tests/test_multi_device.py \
	tests/test_engine_memory.py tests/test_pass_lock.py tests/test_faults.py tests/test_workflow_plan.py \
	tests/test_demo_cli.py tests/test_benchmark_script.py
.PHONY: test-stress
test-stress: env
	$(PY) tests/stress.py --runs $(STRESS_RUNS) --busy $(STRESS_BUSY) $(STRESS_ARGS) $(STRESS_FILES)

# The ComfyUI tests need a ComfyUI checkout and a Python that can run it (see docs/development.md, "Running the ComfyUI
# tests"): COMFYUI_PATH=/path/to/ComfyUI PY=/path/to/comfy/venv/bin/python make test-comfy
test-comfy:
	@if [ -z "$$COMFYUI_PATH" ]; then \
	  echo "[make] set COMFYUI_PATH to a ComfyUI checkout (and PY to a python that runs it)" >&2; exit 2; fi
	$(PY) -m pytest tests/comfyui $(PYTEST_ARGS)

$(STAMP)-bench: $(STAMP)
	@set -e; before=$$($(PY) -W ignore -c "import torch; print(torch.__version__)"); \
	$(PY) -m pip install -e ".[test,bench]"; \
	after=$$($(PY) -W ignore -c "import torch; print(torch.__version__)"); \
	if [ "$$before" != "$$after" ]; then \
	  echo "[make] ERROR: installing the bench extras replaced torch $$before with $$after" >&2; exit 1; \
	fi; \
	touch $@

bench-deps: $(STAMP)-bench

bench: env
	@if $(PY) -c "import accelerate, diffusers" >/dev/null 2>&1; then :; else \
	  echo "[make] accelerate/diffusers not installed: their baselines are skipped (make bench-deps installs them)"; fi
	$(PY) benchmarks/bench_offload.py --model flux --repeat 3 $(BENCH_ARGS)
	$(PY) benchmarks/bench_offload.py --model decoder7b --repeat 3 $(BENCH_ARGS)

bench-hooks: env
	@if $(PY) -c "import accelerate, diffusers" >/dev/null 2>&1; then :; else \
	  echo "[make] accelerate/diffusers not installed: their rows are skipped (make bench-deps installs them)"; fi
	$(PY) benchmarks/bench_hooks.py $(BENCH_HOOKS_ARGS)

.PHONY: bench-gpu
bench-gpu: env
	$(PY) benchmarks/bench_gpu.py $(BENCH_GPU_ARGS)

clean:
	rm -rf .make .pytest_cache build *.egg-info

# The Layer Offload sidebar panel (and the download plan, the node help, "Offload this workflow") in a real
# ComfyUI frontend, in headless Chromium (selenium, the system chromium and chromedriver; the tests skip with the
# reason when one is missing):
#   COMFYUI_PATH=/path/to/ComfyUI PY=/path/to/comfy/venv/bin/python make test-browser
.PHONY: test-browser
test-browser:
	@if [ -z "$$COMFYUI_PATH" ]; then \
	  echo "[make] set COMFYUI_PATH to a ComfyUI checkout (and PY to a python that runs it)" >&2; exit 2; fi
	$(PY) -m pytest tests/comfyui/test_panel_browser.py tests/comfyui/test_plan_download_browser.py \
		tests/comfyui/test_convert_browser.py $(PYTEST_ARGS)
