# The two commands of the README: `make demo` runs the main job, `make test` runs the tests.
PYTHON ?= python

.PHONY: demo test test-fast bench install gpu-check gpu-wheels

demo:
	bash launch/quickstart.sh

test:
	$(PYTHON) -m pytest tests -q --durations=30

test-fast:
	$(PYTHON) -m pytest tests -q -m "not slow"

bench:
	$(PYTHON) bench/bench_preprocess.py
	$(PYTHON) bench/bench_reader.py
	$(PYTHON) bench/bench_t5_dataset.py
	$(PYTHON) bench/bench_model.py

install:
	$(PYTHON) -m pip install torch==2.13.0
	$(PYTHON) -m pip install -e ".[test]"

# On one CUDA GPU: the tests marked gpu and bench/bench_gpu.py's table (exits 0 without CUDA).
gpu-check:
	$(PYTHON) bench/gpu_check.py

# The wheels a GPU machine with CUDA torch, transformers and sentencepiece lacks, for gpu-check
# without network (under 64 MiB), for that machine's Python (GPU_PYTHON, 3.12 by default: pip
# picks the compiled wheels for it). DeepSpeed is a source release: it is built here into a
# pure-Python wheel (its ops are built on first use). The project's C++ helpers are built there,
# in place, by gpu-check (bench/gpu_check.py).
GPU_PYTHON ?= 3.12
gpu-wheels:
	rm -rf gpu-wheels && mkdir -p gpu-wheels
	$(PYTHON) -m pip download --no-deps --only-binary=:all: --python-version $(GPU_PYTHON) \
		--implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
		--platform manylinux2014_x86_64 -d gpu-wheels nltk hjson ninja py-cpuinfo msgpack \
		pydantic pydantic-core annotated-types typing-inspection einops joblib click regex \
		pybind11 tqdm
	DS_BUILD_OPS=0 $(PYTHON) -m pip wheel --no-deps --no-build-isolation -w gpu-wheels deepspeed==0.19.8
	du -sh gpu-wheels
