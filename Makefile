# The two commands of the README: `make demo` runs the main job, `make test` runs the tests.
PYTHON ?= python

.PHONY: demo test test-fast bench install

demo:
	bash launch/quickstart.sh

test:
	$(PYTHON) -m pytest tests -q

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
