# Which LibTorch libraries and language level fsdp-cpp builds with, after find_package(Torch).
# Sets FSDP_TORCH_LIBRARIES, FSDP_TORCH_INCLUDE_DIRS, FSDP_CXX_STD, FSDP_TORCH_PREFIX (the
# LibTorch prefix a consumer of this build must be given; empty for the system's) and
# FSDP_TORCH_PYTHON / FSDP_TORCHRUN (the Python of the same torch and its torchrun, which the tests
# use: a 1.13 torchrun agent's store resets 2.x clients, whose first request is new). (Not in cmake/*.cmake: those
# are the areas the top-level list includes one by one.)
#
# - Debian's LibTorch 1.13: ${TORCH_LIBRARIES} as before, C++17.
# - LibTorch 2.x: its headers need C++20 (ATen.h stops otherwise).
# - A CUDA build of LibTorch (the pip wheel) with FSDP_CUDA off: only torch_cpu and c10 are linked.
#   The `torch` target would also pull in libtorch_cuda, the CUDA runtime and, through
#   libtorch_cuda, NCCL; on a host with another NCCL in /usr/local/cuda the link then resolves
#   the wrong libnccl and fails.

if(DEFINED Torch_VERSION AND NOT Torch_VERSION STREQUAL "")
  set(FSDP_TORCH_VERSION ${Torch_VERSION})
else()
  set(FSDP_TORCH_VERSION 1)
endif()

if(FSDP_TORCH_VERSION VERSION_GREATER_EQUAL 2)
  set(FSDP_CXX_STD cxx_std_20)
  if(FSDP_TOP_LEVEL)
    set(CMAKE_CXX_STANDARD 20)
  endif()
else()
  set(FSDP_CXX_STD cxx_std_17)
endif()

# torchrun 1.13 on Python 3.11 needs its output redirected and spells --no-python --no_python
# (tests/harness.h).
if(FSDP_TORCH_VERSION VERSION_LESS 2)
  set(FSDP_TORCHRUN_1_13 1)
else()
  set(FSDP_TORCHRUN_1_13 0)
endif()

set(FSDP_TORCH_INCLUDE_DIRS "")
set(FSDP_TORCH_PREFIX "")
set(FSDP_TORCH_PYTHON /usr/bin/python3)
set(FSDP_TORCHRUN /usr/bin/torchrun)
if(NOT TORCH_INSTALL_PREFIX MATCHES "^/usr(/|$)")
  set(FSDP_TORCH_PREFIX ${TORCH_INSTALL_PREFIX})
  # A wheel: <venv>/lib/pythonX.Y/site-packages/torch.
  get_filename_component(FSDP_TORCH_VENV ${TORCH_INSTALL_PREFIX}/../../../.. ABSOLUTE)
  set(FSDP_TORCH_PYTHON ${FSDP_TORCH_VENV}/bin/python)
  set(FSDP_TORCHRUN ${FSDP_TORCH_VENV}/bin/torchrun)
endif()
if(TARGET torch_cuda AND NOT FSDP_CUDA)
  # The installed package makes the same choice in fsdp::torch (cmake/fsdpConfig.cmake.in).
  set(FSDP_TORCH_LIBRARIES $<BUILD_INTERFACE:torch_cpu_library> $<BUILD_INTERFACE:c10>
                           $<INSTALL_INTERFACE:fsdp::torch>)
  foreach(dir ${TORCH_INCLUDE_DIRS})  # torch/csrc/api/include is on the `torch` target only
    list(APPEND FSDP_TORCH_INCLUDE_DIRS $<BUILD_INTERFACE:${dir}>)
  endforeach()
  message(STATUS "fsdp: LibTorch ${FSDP_TORCH_VERSION} (CUDA build) used on the CPU: linking "
                 "torch_cpu and c10 only (FSDP_CUDA=OFF)")
elseif(TARGET torch_cuda)
  # The wheel's NCCL, not a system nccl.h: ProcessGroupNCCL::Options holds an ncclConfig_t by
  # value, whose size differs between NCCL versions.
  get_filename_component(FSDP_TORCH_SITE ${TORCH_INSTALL_PREFIX} DIRECTORY)
  set(FSDP_NCCL_INCLUDE ${FSDP_TORCH_SITE}/nvidia/nccl/include)
  if(NOT EXISTS ${FSDP_NCCL_INCLUDE}/nccl.h)
    message(FATAL_ERROR "FSDP_CUDA=ON: no nccl.h in ${FSDP_NCCL_INCLUDE}, the NCCL that "
                        "LibTorch ${FSDP_TORCH_VERSION} was built with. Install LibTorch with its "
                        "nvidia-nccl package (pip install torch), or set FSDP_CUDA=OFF")
  endif()
  include_directories(BEFORE SYSTEM ${FSDP_NCCL_INCLUDE})
  # The link must resolve libtorch_cuda's libnccl.so.2 etc. to the wheel's, not /usr/local/cuda's.
  file(GLOB FSDP_NVIDIA_LIBS LIST_DIRECTORIES true ${FSDP_TORCH_SITE}/nvidia/*/lib)
  foreach(dir ${FSDP_NVIDIA_LIBS})
    add_link_options(-Wl,-rpath-link,${dir})
  endforeach()
  set(FSDP_TORCH_LIBRARIES ${TORCH_LIBRARIES})
  message(STATUS "fsdp: LibTorch ${FSDP_TORCH_VERSION} with CUDA (FSDP_CUDA=ON; untested here)")
else()
  set(FSDP_TORCH_LIBRARIES ${TORCH_LIBRARIES})
endif()
