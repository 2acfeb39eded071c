# AggBox: `make demo` and `make test` are the two entry points (README.md).
# Every target that needs system packages depends on `deps`, which installs
# only what is missing, so a new Debian 12 machine needs nothing else.

SHELL        := /bin/bash
CARGO        ?= cargo
PROFILE      ?= release
CARGO_FLAGS  := $(if $(filter release,$(PROFILE)),--release,)
BIN          := target/$(PROFILE)/aggbox
BENCH_BIN    := target/$(PROFILE)/aggbox-bench
APT_PACKAGES := clang llvm libelf-dev zlib1g-dev pkg-config make bpftool \
                iproute2 ethtool iputils-ping tcpdump prometheus gcc procps \
                openmpi-bin libopenmpi-dev mpich libmpich-dev
DEPS_STAMP   := target/.deps-ok

.PHONY: all deps build mpi test test-unit test-root demo fmt fmt-check clippy clean help bench bench-deps bench-mpi matrix

all: build mpi

help:
	@echo "make deps    install the Debian packages the build and tests need (idempotent)"
	@echo "make build   build the BPF programs and the aggbox binary ($(PROFILE))"
	@echo "make mpi     build the MPI interposition libraries $(MPI_LIBS) (docs/MPI.md)"
	@echo "make test    deps + build + every test (unit, BPF_PROG_TEST_RUN, netns; needs root)"
	@echo "make demo    deps + build + netns testbed + attach + traffic, printed"
	@echo "make bench   deps + build + every benchmark (BENCH_ARGS=--quick for the CI smoke); results/REPORT.md"
	@echo "make bench-mpi  MPI_Allreduce latency, plain MPI vs libaggbox_mpi; results/mpi/"
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
	  mpicc.$$impl -shared -fPIC -O2 -Wall -Wextra -Werror -o $(MPI_DIR)/libaggbox_mpi_$$impl.so \
	    mpi/aggbox_mpi.c $(MPI_DIR)/libaggbox_mpi.a \
	    -Wl,--version-script=mpi/exports.map $(MPI_LDLIBS) || exit 1; \
	done

# Unit tests need nothing special; the BPF and netns tests need root and a
# kernel with BTF and fail with a clear message otherwise (never skip).
test: deps mpi
	@if [ "$$(id -u)" != 0 ]; then echo "make test: the BPF and netns tests need root (run as root or with sudo)" >&2; exit 1; fi
	@test -r /sys/kernel/btf/vmlinux || { echo "make test: kernel has no BTF (/sys/kernel/btf/vmlinux missing)" >&2; exit 1; }
	$(CARGO) build $(CARGO_FLAGS) --all-targets
	$(CARGO) test $(CARGO_FLAGS) --no-fail-fast

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

bench: deps bench-deps
	@if [ "$$(id -u)" != 0 ]; then echo "make bench: needs root (network namespaces, BPF)" >&2; exit 1; fi
	$(CARGO) build $(CARGO_FLAGS)
	$(BENCH_BIN) all --out $(BENCH_OUT) $(BENCH_ARGS)

# MPI_Allreduce latency, plain MPI vs libaggbox_mpi (docs/MPI.md,
# "Benchmark"): MPI_BENCH_ARGS="--mpi mpich --ranks 8" picks the run.
MPI_BENCH_ARGS ?=
bench-mpi: build mpi
	@if [ "$$(id -u)" != 0 ]; then echo "make bench-mpi: needs root (network namespaces, BPF)" >&2; exit 1; fi
	scripts/mpi_bench.sh --out $(BENCH_OUT)/mpi $(MPI_BENCH_ARGS)

fmt:
	$(CARGO) fmt

fmt-check:
	$(CARGO) fmt -- --check

clippy:
	$(CARGO) clippy --all-targets

clean:
	$(CARGO) clean
	rm -rf results
