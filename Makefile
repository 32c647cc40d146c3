# `make demo` and `make test` set everything up on a fresh machine.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: demo test install clean

$(PY):
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip

$(STAMP): $(PY) pyproject.toml
	$(PY) -m pip install --quiet -e '.[test,mpi,opencl,checkpoint,mkl,nccl]'
	# headless Chromium and Graphviz for the `kiln report` tests (Debian packages), where apt
	# is available and we are root; elsewhere those tests skip, naming the package
	-command -v chromium >/dev/null || { [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null && \
	  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq \
	  --no-install-recommends chromium graphviz >/dev/null; } || true
	# PoCL (the CPU OpenCL driver) and clang + llvm-spirv for the opencl backend's tests
	-[ -e /etc/OpenCL/vendors/pocl.icd ] && command -v llvm-spirv-15 >/dev/null || { [ "$$(id -u)" = 0 ] && \
	  command -v apt-get >/dev/null && apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq \
	  --no-install-recommends pocl-opencl-icd ocl-icd-libopencl1 clang llvm-spirv-15 >/dev/null; } || true
	# clang-15 for the metal backend's checks (MSL syntax and the threadgroup simulator)
	-command -v clang++-15 >/dev/null || { [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null && \
	  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq \
	  --no-install-recommends clang-15 >/dev/null; } || true
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(PY) examples/demo.py

test: $(STAMP)
	# pytest exits 5 when it collected no test: that fails the target like any failure.
	$(PY) -m pytest -q -p no:cacheprovider $(PYTEST_ARGS)

clean:
	rm -rf $(VENV) build *.egg-info
