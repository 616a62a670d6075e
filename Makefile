# fsdp-cpp: thin driver over CMake + Ninja. `make run` and `make test` do everything on a fresh
# Debian 12 machine (missing packages are installed by scripts/setup.sh).
# LIBTORCH selects the LibTorch to build against, each in its own build directory:
#   debian (default): Debian's libtorch-dev 1.13, in build/.
#   pip: PyPI's torch wheel (TORCH_PIP_VERSION) in a venv at TORCH_PIP_VENV, installed by
#        scripts/torch_pip.sh when missing, in build-pip/. Used on the CPU (FSDP_CUDA=OFF).
LIBTORCH ?= debian
TORCH_PIP_VERSION ?= 2.15.0
TORCH_PIP_VENV ?= /opt/fsdp-cpp/torch$(subst .,,$(basename $(TORCH_PIP_VERSION)))
ifeq ($(LIBTORCH),debian)
BUILD   ?= build
TORCH_CMAKE_ARGS =
else ifeq ($(LIBTORCH),pip)
BUILD   ?= build-pip
TORCH_CMAKE_ARGS = -DCMAKE_PREFIX_PATH=$$(scripts/torch_pip.sh $(TORCH_PIP_VERSION) $(TORCH_PIP_VENV))
else
$(error LIBTORCH=$(LIBTORCH): expected debian or pip)
endif
JOBS    ?= $(shell nproc)
CTEST_J ?= 2

.PHONY: all setup setup-test configure build run test sanitize fuzz format clean check-torch

all: build

setup:
	@scripts/setup.sh

# What only the tests use: Debian's python3-torch (torchrun, the Python DDP peer and oracle),
# iproute2 (the two-namespace test).
setup-test:
	@scripts/setup.sh --test

$(BUILD)/build.ninja: | setup
	cmake -S . -B $(BUILD) -G Ninja -DCMAKE_BUILD_TYPE=Release $(TORCH_CMAKE_ARGS)

configure: setup $(BUILD)/build.ninja

build: configure
	cmake --build $(BUILD) -j $(JOBS)

# The main job: the reference trainer on 2 local ranks, no arguments.
run: build
	$(BUILD)/bin/fsdp-train

test: build setup-test $(if $(filter pip,$(LIBTORCH)),check-torch)
	cd $(BUILD) && ctest --output-on-failure -j $(CTEST_J) --timeout 600

# A pip build must not have mixed in Debian's LibTorch headers or libraries.
check-torch: build
	scripts/check_torch_single.sh $(BUILD)

# The test suite under AddressSanitizer + UndefinedBehaviorSanitizer, in build-asan/.
sanitize: setup
	cmake -S . -B build-asan -G Ninja -DFSDP_SANITIZE=ON
	cmake --build build-asan -j $(JOBS)
	cd build-asan && ASAN_OPTIONS=detect_leaks=0:new_delete_type_mismatch=0 ctest --output-on-failure -j $(CTEST_J) --timeout 1200

# libFuzzer targets for the checkpoint header and index parsers (clang, ASan+UBSan), in build-fuzz/.
fuzz:
	scripts/fuzz.sh $(or $(FUZZ_SECONDS),120)

format:
	clang-format -i $$(git ls-files '*.cpp' '*.h')

clean:
	rm -rf $(BUILD)
