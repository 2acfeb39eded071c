# AggBox: `make demo` and `make test` are the two entry points (README.md).
# Every target that needs system packages depends on `deps`, which installs
# only what is missing, so a new Debian 12 machine needs nothing else.

SHELL        := /bin/bash
CARGO        ?= cargo
PROFILE      ?= release
CARGO_FLAGS  := $(if $(filter release,$(PROFILE)),--release,)
BIN          := target/$(PROFILE)/aggbox
BENCH_BIN    := target/$(PROFILE)/aggbox-bench
# The evaluation's executable, BPF yardsticks and benches/xdp_chain.rs are
# built only with this cargo feature (Cargo.toml); `make test` and `make
# clippy` pass it too, so the benchmark's code keeps being compiled, checked
# and unit-tested there.
BENCH_FEATURES := --features bench
# The Python package (python/, docs/PYTHON.md) is built for and tested with
# Debian's /usr/bin/python3 beside its torch, numpy, torchvision (the
# training example) and scikit-learn (its digits data set, for the DDP
# accuracy test); python3-venv holds maturin (from PyPI, pinned).
PY_APT_PACKAGES := python3 python3-venv python3-numpy python3-torch python3-torchvision \
                   python3-sklearn
APT_PACKAGES := clang llvm libelf-dev zlib1g-dev pkg-config make bpftool \
                iproute2 ethtool iputils-ping tcpdump prometheus gcc procps \
                openmpi-bin libopenmpi-dev mpich libmpich-dev \
                $(PY_APT_PACKAGES)
PYTHON       := /usr/bin/python3
MATURIN_VERSION := 1.16.0
PY_TOOLS     := target/python/tools
MATURIN      := $(PY_TOOLS)/bin/maturin
PY_WHEELS    := target/python/wheels
PY_SITE      := target/python/site
DEPS_STAMP   := target/.deps-ok

.PHONY: all deps build python python-deps bench-python mpi bench-mpi test test-unit test-root demo fmt fmt-check clippy clean help bench bench-deps matrix

all: build python mpi

help:
	@echo "make deps    install the Debian packages the build and tests need (idempotent)"
	@echo "make build   build the BPF programs and the aggbox binary ($(PROFILE))"
	@echo "make python  build the Python package's wheel ($(PY_WHEELS)) and unpack it in $(PY_SITE)"
	@echo "make mpi     build the MPI interposition libraries $(MPI_LIBS) (docs/MPI.md)"
	@echo "make test    deps + build + every test (unit, BPF_PROG_TEST_RUN, netns; needs root)"
	@echo "make demo    deps + build + netns testbed + attach + traffic, printed"
	@echo "make bench   deps + build + every benchmark (BENCH_ARGS=--quick for the CI smoke); results/REPORT.md"
	@echo "make bench-python  DDP over AggBox against Gloo (ResNet-18, ResNet-34), the backend and DDP on it against Gloo; results/python_*.json"
	@echo "make bench-mpi  MPI_Allreduce and MPI_Bcast latency and bandwidth, plain MPI vs libaggbox_mpi; results/mpi/"
	@echo "make fmt     format the Rust sources"
	@echo "make clean   remove build outputs"

# Installs only what is missing: dpkg-query answers in milliseconds, so a
# second run costs nothing and prints nothing.
deps:
	@missing=""; \
	for p in $(APT_PACKAGES); do \
	  dpkg-query -W -f='$${Status}' $$p 2>/dev/null | grep -q "ok installed" || missing="$$missing $$p"; \
	done; \
	if [ -n "$$missing" ]; then \
	  echo "deps: installing$$missing"; \
	  if [ "$$(id -u)" != 0 ]; then echo "deps: need root to install packages:$$missing" >&2; exit 1; fi; \
	  export DEBIAN_FRONTEND=noninteractive; \
	  apt-get update -qq >/dev/null && \
	  apt-get install -y -qq --no-install-recommends $$missing >/dev/null || { echo "deps: apt-get install failed" >&2; exit 1; }; \
	fi; \
	command -v $(CARGO) >/dev/null || { echo "deps: cargo not found (install the Rust toolchain)" >&2; exit 1; }

build: deps
	$(CARGO) build $(CARGO_FLAGS) --all-targets

# maturin in a virtual environment of Debian's python3 (pip does not touch
# the system's packages); installed once, its version checked every time.
python-deps: deps
	@if [ "$$($(MATURIN) --version 2>/dev/null)" != "maturin $(MATURIN_VERSION)" ]; then \
	  echo "python-deps: installing maturin $(MATURIN_VERSION) from PyPI into $(PY_TOOLS)"; \
	  rm -rf $(PY_TOOLS) && $(PYTHON) -m venv $(PY_TOOLS) && \
	  $(PY_TOOLS)/bin/pip install -q "maturin==$(MATURIN_VERSION)" || \
	    { echo "python-deps: could not install maturin $(MATURIN_VERSION) from PyPI (network? proxy?)" >&2; exit 1; }; \
	fi

# The wheel of the Python package (PyO3 + maturin, python/), built for
# /usr/bin/python3 into the shared target/ (the dependencies the two share
# are compiled once; the library itself twice, since pyo3's proc macros ask
# for more of syn's features), and unpacked into $(PY_SITE), where
# tests/python_package.rs imports it from (PYTHONPATH). `pip install
# target/python/wheels/aggbox-*.whl` installs the same wheel.
python: python-deps
	rm -f $(PY_WHEELS)/aggbox-*.whl
	cd python && CARGO_TARGET_DIR=$(CURDIR)/target $(CURDIR)/$(MATURIN) build $(CARGO_FLAGS) \
	  --interpreter $(PYTHON) --out $(CURDIR)/$(PY_WHEELS)
	rm -rf $(PY_SITE)
	$(PYTHON) -m zipfile -e $(PY_WHEELS)/aggbox-*.whl $(PY_SITE)

# The PMPI interposition library (docs/MPI.md): the Rust half (mpi/, a
# staticlib in this target directory, so the aggbox crate is compiled once)
# linked with the C shim once per MPI implementation, whose handles only
# its own mpi.h knows. libbpf inside the staticlib needs libelf and zlib.
MPI_DIR      := target/$(PROFILE)
MPI_LIBS     := $(MPI_DIR)/libaggbox_mpi_openmpi.so $(MPI_DIR)/libaggbox_mpi_mpich.so
MPI_LDLIBS   := -lelf -lz -lpthread -ldl -lm
mpi: deps
	CARGO_TARGET_DIR=$(CURDIR)/target $(CARGO) build $(CARGO_FLAGS) --manifest-path mpi/Cargo.toml
	@for impl in openmpi mpich; do \
	  command -v mpicc.$$impl >/dev/null || { echo "make mpi: mpicc.$$impl not found (make deps installs it)" >&2; exit 1; }; \
	  echo "mpicc.$$impl -> $(MPI_DIR)/libaggbox_mpi_$$impl.so"; \
	  mpicc.$$impl -shared -fPIC -O2 -Wall -Wextra -Werror -Iinclude -o $(MPI_DIR)/libaggbox_mpi_$$impl.so \
	    mpi/aggbox_mpi.c $(MPI_DIR)/libaggbox_mpi.a \
	    -Wl,--version-script=mpi/exports.map $(MPI_LDLIBS) || exit 1; \
	done

# Unit tests need nothing special; the BPF and netns tests need root and a
# kernel with BTF and fail with a clear message otherwise (never skip).
# tests/python_package.rs needs the wheel `make python` builds,
# tests/mpi_collectives.rs and tests/mpi_on_demand.rs the libraries `make mpi`
# builds.
test: deps python mpi
	@if [ "$$(id -u)" != 0 ]; then echo "make test: the BPF and netns tests need root (run as root or with sudo)" >&2; exit 1; fi
	@test -r /sys/kernel/btf/vmlinux || { echo "make test: kernel has no BTF (/sys/kernel/btf/vmlinux missing)" >&2; exit 1; }
	$(CARGO) build $(CARGO_FLAGS) $(BENCH_FEATURES) --all-targets
	$(CARGO) test $(CARGO_FLAGS) $(BENCH_FEATURES) --no-fail-fast

demo: build
	@if [ "$$(id -u)" != 0 ]; then echo "make demo: needs root (network namespaces, BPF)" >&2; exit 1; fi
	scripts/demo.sh $(BIN)

# Kernel-version matrix (docs/MATRIX.md): the host kernel, then Debian's 6.1
# and 6.12 cloud kernels under QEMU; `make matrix KERNELS="6.1 6.12"` picks
# the rows. Builds what it runs itself; results in results/matrix/.
matrix: deps
	@if [ "$$(id -u)" != 0 ]; then echo "make matrix: needs root (BPF, network namespaces, QEMU)" >&2; exit 1; fi
	scripts/matrix.sh $(KERNELS)

# Benchmarks (docs/BENCHMARKS.md): aggbox-bench all writes raw CSV/JSON,
# PNG plots (scripts/plot.py) and results/REPORT.md. matplotlib is needed
# only here, so it is installed by bench-deps, not by deps; so is
# python3-torch (1.13 in Debian 12): torch.distributed Gloo, the baseline of
# `aggbox-bench large` (scripts/gloo_allreduce.py).
BENCH_ARGS ?=
BENCH_OUT ?= results
BENCH_PACKAGES := python3-matplotlib python3-torch
bench-deps:
	@missing=""; \
	for p in $(BENCH_PACKAGES); do \
	  dpkg-query -W -f='$${Status}' $$p 2>/dev/null | grep -q "ok installed" || missing="$$missing $$p"; \
	done; \
	if [ -n "$$missing" ]; then \
	  echo "bench-deps: installing$$missing"; \
	  if [ "$$(id -u)" != 0 ]; then echo "bench-deps: need root to install packages:$$missing" >&2; exit 1; fi; \
	  export DEBIAN_FRONTEND=noninteractive; \
	  apt-get update -qq >/dev/null && \
	  apt-get install -y -qq --no-install-recommends $$missing >/dev/null || { echo "bench-deps: apt-get install failed" >&2; exit 1; }; \
	fi

bench: deps bench-deps python mpi
	@if [ "$$(id -u)" != 0 ]; then echo "make bench: needs root (network namespaces, BPF)" >&2; exit 1; fi
	$(CARGO) build $(CARGO_FLAGS) $(BENCH_FEATURES)
	$(BENCH_BIN) all --out $(BENCH_OUT) $(BENCH_ARGS)
	$(MAKE) --no-print-directory bench-python
	$(MAKE) --no-print-directory bench-mpi MPI_BENCH_ARGS="$(if $(filter --quick,$(BENCH_ARGS)),$(MPI_BENCH_QUICK_ARGS),$(MPI_BENCH_FULL_ARGS)) $(MPI_BENCH_ARGS)"

# DDP training over AggBox against Gloo (docs/PYTHON.md "Benchmark"): time per
# step and per allreduce of the whole gradient, ResNet-18 (11.7 M parameters)
# and ResNet-34 (21.8 M), 4 workers, one run; results in
# $(BENCH_OUT)/python_ddp.{json,log}. MTU 9000 with the job slots that fit the
# kernel's block pool there (910, docs/JUMBO.md). Then the backend "aggbox"
# against Gloo (docs/PYTHON.md "The backend against Gloo"): allreduce of
# float32 and bfloat16 from 4 B to 100 MB, interleaved, 4 ranks, MTU 1500;
# $(BENCH_OUT)/python_backend.{json,log}. Then the backend's own Gloo path
# (route "gloo") against a plain Gloo group, float32 4 B to 16 MiB,
# interleaved call by call; $(BENCH_OUT)/python_gloo_path.{json,log}. Last,
# DDP on the backend (docs/PYTHON.md "DDP on the backend against Gloo"): an
# unmodified script's DDP on "aggbox" beside DDP on a Gloo group, steps
# interleaved, ResNet-18, ResNet-34 and a model of many 1 MiB buckets, 4 and
# 8 workers, MTU 9000; $(BENCH_OUT)/python_ddp_backend_w{4,8}.{json,log}.
PY_BENCH_STEPS := $(if $(filter --quick,$(BENCH_ARGS)),3,10)
PY_DDP_BACKEND_MODELS := $(if $(filter --quick,$(BENCH_ARGS)),mlp:b1,resnet18,resnet34,mlp:b1)
PY_DDP_BACKEND_WORKERS := $(if $(filter --quick,$(BENCH_ARGS)),4,4 8)
bench-python: python
	@if [ "$$(id -u)" != 0 ]; then echo "make bench-python: needs root (network namespaces, BPF)" >&2; exit 1; fi
	$(CARGO) build $(CARGO_FLAGS) --bin aggbox
	mkdir -p $(BENCH_OUT)
	set -o pipefail; AGGBOX_BIN=$(BIN) python/examples/ddp_testbed.sh --mtu 9000 --slots 910 --models resnet18,resnet34 \
	  --steps $(PY_BENCH_STEPS) --json $(BENCH_OUT)/python_ddp.json | tee $(BENCH_OUT)/python_ddp.log
	set -o pipefail; AGGBOX_BIN=$(BIN) python/examples/backend_testbed.sh \
	  --max-bytes $(if $(filter --quick,$(BENCH_ARGS)),4194304,100000000) \
	  --json $(BENCH_OUT)/python_backend.json | tee $(BENCH_OUT)/python_backend.log
	set -o pipefail; AGGBOX_BIN=$(BIN) python/examples/backend_testbed.sh --script python/examples/bench_gloo_path.py \
	  $(if $(filter --quick,$(BENCH_ARGS)),--quick) --json $(BENCH_OUT)/python_gloo_path.json | tee $(BENCH_OUT)/python_gloo_path.log
	set -o pipefail; for w in $(PY_DDP_BACKEND_WORKERS); do \
	  AGGBOX_BIN=$(BIN) python/examples/backend_testbed.sh --workers $$w --mtu 9000 --script python/examples/bench_ddp_backend.py \
	    --models $(PY_DDP_BACKEND_MODELS) --steps $(PY_BENCH_STEPS) --json $(BENCH_OUT)/python_ddp_backend_w$$w.json \
	    | tee $(BENCH_OUT)/python_ddp_backend_w$$w.log || exit 1; \
	done

# MPI_Allreduce and MPI_Bcast latency and bandwidth, plain MPI vs
# libaggbox_mpi (docs/MPI.md, "Benchmark"): MPI_BENCH_ARGS="--mpi mpich
# --ranks 8" picks the run. `make bench` runs the issue's sizes (allreduce to
# 87,200,000 B, bcast to 1 MiB, 4 and 8 ranks: minutes), its --quick sizes
# to 64 KB on 4 ranks; MPI_BENCH_ARGS come after either and override them.
MPI_BENCH_ARGS ?=
MPI_BENCH_FULL_ARGS := --ranks 4,8 --max-bytes 87200000
MPI_BENCH_QUICK_ARGS := --max-bytes 65536 --bcast-max-bytes 65536 --iterations 20
bench-mpi: build mpi
	@if [ "$$(id -u)" != 0 ]; then echo "make bench-mpi: needs root (network namespaces, BPF)" >&2; exit 1; fi
	scripts/mpi_bench.sh --out $(BENCH_OUT)/mpi $(MPI_BENCH_ARGS)

# The production-shaped soak (docs/ROBUSTNESS.md, "Production soak"): star,
# node-served and ring jobs at once for SOAK_MINUTES under loss, reloads and
# kills, with an invariant checker; not part of `make test` or CI. Results
# and REPORT.md in $(SOAK_OUT). python3-matplotlib draws its plot.
SOAK_MINUTES ?= 30
SOAK_OUT ?= results/soak
.PHONY: soak
soak: deps
	@if [ "$$(id -u)" != 0 ]; then echo "make soak: needs root (network namespaces, BPF)" >&2; exit 1; fi
	@dpkg-query -W -f='$${Status}' python3-matplotlib 2>/dev/null | grep -q "ok installed" || \
	  { echo "soak: installing python3-matplotlib (the plot)"; DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends python3-matplotlib >/dev/null; }
	$(CARGO) build $(CARGO_FLAGS) $(BENCH_FEATURES)
	$(BENCH_BIN) soak --minutes $(SOAK_MINUTES) --out $(SOAK_OUT)

fmt:
	$(CARGO) fmt

fmt-check:
	$(CARGO) fmt -- --check

clippy:
	$(CARGO) clippy $(BENCH_FEATURES) --all-targets

clean:
	$(CARGO) clean
	rm -rf results
