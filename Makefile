# One command sets up and serves (`make serve`), one sets up and tests (`make test`).
# Set-up is idempotent: a project venv in .venv, re-installed only when pyproject.toml changes.

PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
HOST   ?= 127.0.0.1
PORT   ?= 50051
MODEL  ?= synthetic
ENGINE ?= auto
STAMP  := $(VENV)/.setup-stamp
NVCC   ?= $(shell command -v nvcc 2>/dev/null)

.PHONY: proxy-tools setup serve test protos check-protos lint-protos kernel kernel-check probes agent bench bench-vs-qwen-tts soak bench-kernel kernel-gpu-check clean

setup: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e ".[server,pipecat,dev]"
	@if [ -n "$(NVCC)" ] && command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then \
		$(MAKE) kernel; fi
	touch $(STAMP)

# On a GPU machine the CUDA libraries are brought up to date first (a no-op when built; a checkout
# set up before csrc/small/ existed gets libqwen_small.so, the small-batch kernel, this way).
serve: setup
	@if [ -n "$(NVCC)" ] && command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then \
		$(MAKE) -s kernel; fi
	$(BIN)/tts-server --host $(HOST) --port $(PORT) --model $(MODEL) --engine $(ENGINE)

test: setup check-protos lint-protos kernel-check proxy-tools
	$(BIN)/python -m pytest

# The example voice agent (STT -> LLM -> this TTS), browser page at http://localhost:7860/client.
# Needs a running server (make serve) and STT/LLM keys: see pipecat_service/README.md.
AGENT_STAMP := $(VENV)/.agent-stamp
$(AGENT_STAMP): $(STAMP)
	$(BIN)/python -m pip install --quiet -e ".[agent]"
	touch $(AGENT_STAMP)

agent: $(AGENT_STAMP)
	$(BIN)/python -m pipecat_service.agent -t webrtc $(AGENT_ARGS)

# Benchmark through the gRPC client (tts-bench). GPU: the full-size synthetic model with default
# server flags, c = 1, 256 concurrent 6 s streams and open-loop 10/20/40 requests/s (capacity =
# the largest load with zero underruns at a 200 ms pre-roll); `make bench-vs-qwen-tts` compares
# with qwen-tts generate at c = 1/4/16. CPU: tiny synthetic model against qwen-tts, a few minutes.
bench: setup
	@mkdir -p out
	@if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then \
		OUT=out PY=$(BIN)/python bash scripts/gpu_server_bench.sh; \
	else \
		$(BIN)/tts-bench --model synthetic-tiny --engine torch --concurrency 1,2,4 --requests 8 \
			--warmup 1 --max-duration 2 --baseline qwen-tts --baseline-requests 3 \
			--json out/bench-cpu.json --plot out/bench-cpu.png; \
	fi

bench-vs-qwen-tts: setup
	@mkdir -p out
	OUT=out PY=$(BIN)/python bash scripts/run_bench_gpu.sh

# Soak: mixed load with random cancels against a self-started loopback server (tiny synthetic
# model) for SOAK_MINUTES; the report goes to out/soak.json; exit 1 on an unexpected status
# code, a leaked stream or descriptor, or memory growth. `make soak SOAK_MINUTES=1` for a quick one.
SOAK_MINUTES ?= 10
soak: setup
	@mkdir -p out
	$(BIN)/tts-soak --minutes $(SOAK_MINUTES) --json out/soak.json

# The kernels' benchmarks (GPU): the megakernel's (copy bandwidth, talker/predictor/frame times vs
# torch), then the batched engine's frame against B = 1..256 at talker contexts 100, 1000 and mixed
# (graph replay ms, frames/s, GB/s of weights + KV, TFLOP/s; JSON in out/batched-frames/).
bench-kernel: kernel
	$(BIN)/python scripts/bench_kernel.py
	$(BIN)/python scripts/gpu_batched_engine.py --sections bench --out out/batched-frames

# The megakernel's full evidence run on a GPU machine: build, correctness, sanitizers, benchmark.
kernel-gpu-check:
	bash scripts/gpu_kernel_check.sh

# Regenerate the checked-in stubs with the pinned grpcio-tools (protobuf-6 gencode).
protos: setup
	$(BIN)/python scripts/gen_protos.py

# Fails when the checked-in stubs differ from a fresh generation.
check-protos: setup
	$(BIN)/python scripts/gen_protos.py --check

lint-protos: setup
	$(BIN)/buf lint
	$(BIN)/buf format --diff --exit-code

# Builds the CUDA megakernel library (needs nvcc; runs on a GPU machine).
kernel:
	$(MAKE) -C csrc

# Compiles the kernel and the probes for sm_90a where nvcc exists (CI has nvcc but no GPU), and
# every Triton kernel specialisation the GPU serving path launches for sm_90 (Triton's own
# compiler, no GPU: scripts/triton_sm90_check.py, ~2 min cold), so build breaks fail the tests.
kernel-check: setup
	@if [ -n "$(NVCC)" ] && [ -f csrc/Makefile ]; then $(MAKE) -C csrc check && $(MAKE) -C tools/probes; \
	else echo "kernel-check: nvcc not found, CUDA build not checked"; fi
	$(BIN)/python scripts/triton_sm90_check.py

# HAProxy for tests/test_proxy_drain.py (replicas behind a real proxy), from the distribution's
# packages where apt-get runs as root; elsewhere that test is skipped and says why.
proxy-tools:
	@if command -v haproxy >/dev/null 2>&1 || [ -x /usr/sbin/haproxy ]; then :; \
	elif [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
		(apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq haproxy) \
			>/dev/null 2>&1 || echo "proxy-tools: apt-get install haproxy failed; the proxy test will skip"; \
	else echo "proxy-tools: haproxy not installed (no root apt-get here); the proxy test will skip"; fi

# The micro-probes behind the kernel's design (tools/probes/: standalone CUDA programs for an H100).
probes:
	$(MAKE) -C tools/probes

clean:
	rm -rf $(VENV) build *.egg-info
	-$(MAKE) -C csrc clean
	-$(MAKE) -C tools/probes clean
