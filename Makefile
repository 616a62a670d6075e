# fsdp-cpp: thin driver over CMake + Ninja. `make run` and `make test` do everything on a fresh
# Debian 12 machine (missing packages are installed by scripts/setup.sh).
# LIBTORCH selects the LibTorch to build against, each in its own build directory:
#   pip (default): PyPI's torch wheel (TORCH_PIP_VERSION, 2.15) in a venv at TORCH_PIP_VENV, outside
#        the tree and shared by clones, installed by scripts/torch_pip.sh when missing; build/.
#        Used on the CPU (FSDP_CUDA=OFF).
#   debian: Debian's libtorch-dev 1.13; build-debian/.
# `make test` with the default also checks the other two builds: Debian's 1.13 (built, then the
# labels in OTHER_LABELS) and the CUDA path (compiled and linked, build-cuda/; nothing runs on a GPU
# here). `make test LIBTORCH=pip` or `LIBTORCH=debian` runs the whole suite on that one alone.
LIBTORCH ?= pip
TORCH_PIP_VERSION ?= 2.15.0
TORCH_PIP_VENV ?= /opt/fsdp-cpp/torch$(subst .,,$(basename $(TORCH_PIP_VERSION)))
PIP_CMAKE_ARGS = -DCMAKE_PREFIX_PATH=$$(scripts/torch_pip.sh $(TORCH_PIP_VERSION) $(TORCH_PIP_VENV))
ifeq ($(LIBTORCH),pip)
BUILD   ?= build
TORCH_CMAKE_ARGS = $(PIP_CMAKE_ARGS)
else ifeq ($(LIBTORCH),debian)
BUILD   ?= build-debian
TORCH_CMAKE_ARGS =
else
$(error LIBTORCH=$(LIBTORCH): expected pip or debian)
endif
# Set LIBTORCH yourself and `make test` checks that one only.
ifeq ($(origin LIBTORCH),file)
ALSO_TEST = test-debian-labels build-cuda
endif
OTHER_LABELS ?= guarantee|parity|adoption|interception|hf|elastic
JOBS    ?= $(shell nproc)
CTEST_J ?= 2

.PHONY: all setup setup-test configure build run test test-debian-labels build-cuda sanitize fuzz \
        format clean check-torch thread-safety

all: build

setup:
	@scripts/setup.sh --libtorch $(LIBTORCH)

# What only the tests use (scripts/setup.sh --test says which), and the torch 2.15 venv whatever
# the LibTorch: PyTorch's FSDP2, torchrun and safetensors are the tests' peers and oracles.
setup-test:
	@scripts/setup.sh --test --libtorch $(LIBTORCH)
	@scripts/torch_pip.sh $(TORCH_PIP_VERSION) $(TORCH_PIP_VENV) > /dev/null

$(BUILD)/build.ninja: | setup
	cmake -S . -B $(BUILD) -G Ninja -DCMAKE_BUILD_TYPE=Release $(TORCH_CMAKE_ARGS) \
	  -DFSDP_PEER_PYTHON=$(TORCH_PIP_VENV)/bin/python

configure: setup $(BUILD)/build.ninja

build: configure
	cmake --build $(BUILD) -j $(JOBS)

# The main job: the reference trainer on 2 local ranks, no arguments.
run: build
	$(BUILD)/bin/fsdp-train

test: build setup-test $(if $(filter pip,$(LIBTORCH)),check-torch) thread-safety
	cd $(BUILD) && ctest --output-on-failure -j $(CTEST_J) --timeout 600
	@$(if $(ALSO_TEST),$(MAKE) --no-print-directory $(ALSO_TEST))

# Debian's LibTorch 1.13 next to the default: build, then the labels in OTHER_LABELS.
test-debian-labels:
	$(MAKE) --no-print-directory build setup-test LIBTORCH=debian BUILD=build-debian
	cd build-debian && ctest --output-on-failure -j $(CTEST_J) --timeout 600 -L '$(OTHER_LABELS)'

# The CUDA path (FSDP_CUDA=ON: CUDA tensors, ProcessGroupNCCL, [Note: CUDA streams]) compiled and
# linked against the wheel's CUDA build: the library and the programs. Nothing runs on a GPU here;
# the CUDA-linked trainer then takes a few steps on the CPU (Gloo), which checks that it loads.
build-cuda:
	@scripts/setup.sh --libtorch pip
	cmake -S . -B build-cuda -G Ninja -DCMAKE_BUILD_TYPE=Release -DFSDP_CUDA=ON \
	  -DFSDP_BUILD_TESTS=OFF $(PIP_CMAKE_ARGS)
	cmake --build build-cuda -j $(JOBS)
	build-cuda/bin/fsdp-train --steps 3 --layers 1 --width 32 --heads 2 --seq 16 --quiet \
	  --sample-tokens 0 --run-dir build-cuda/smoke

# clang's thread-safety analysis over the sources that hold annotated locks (src/util/mutex.h).
thread-safety: configure setup-test
	scripts/thread_safety.sh $(BUILD)

# A pip build must not have mixed in Debian's LibTorch headers or libraries.
check-torch: build
	scripts/check_torch_single.sh $(BUILD)

# The test suite under AddressSanitizer + UndefinedBehaviorSanitizer, in build-asan/, with leak
# checking (LeakSanitizer at the exit of every process: the test programs, their ranks, the
# trainer and the benchmark). The programs' --malloc auto is glibc's default there (ASan's
# allocator takes no thresholds), and the tests that bound resident-set sizes skip.
SANITIZE_ENV = ASAN_OPTIONS=detect_leaks=1 UBSAN_OPTIONS=print_stacktrace=1
sanitize: setup
	cmake -S . -B build-asan -G Ninja -DFSDP_SANITIZE=ON $(TORCH_CMAKE_ARGS)
	cmake --build build-asan -j $(JOBS)
	cd build-asan && $(SANITIZE_ENV) ctest --output-on-failure -j $(CTEST_J) --timeout 1200

# libFuzzer targets for the checkpoint header and index parsers (clang, ASan+UBSan), in build-fuzz/.
fuzz:
	scripts/fuzz.sh $(or $(FUZZ_SECONDS),120)

format:
	clang-format -i $$(git ls-files '*.cpp' '*.h')

clean:
	rm -rf $(BUILD)
