# Builds and runs examples/consumer as an outside project would (issue 10): cmake -P this file with
#   -DMODE=install       cmake --install FSDP_BUILD_DIR into WORK_DIR/prefix, then find_package(fsdp);
#                        also runs the installed fsdp-checkpoint on the checkpoint the consumer wrote
#   -DMODE=subdirectory  add_subdirectory(FSDP_SOURCE_DIR); checks no test or program of fsdp-cpp
#                        was generated
# and -DFSDP_SOURCE_DIR=... -DFSDP_BUILD_DIR=... -DWORK_DIR=... -DCXX=... -DGENERATOR=...
# and -DTORCH_PREFIX=... (the LibTorch the build used, when not the system's: the pip wheel)
# and -DOTHER_TORCH_DIR=... (the TorchConfig.cmake directory of another LibTorch version installed
# beside it: Debian's next to the wheel, the wheel next to Debian's), for the install mode's checks
# that the package finds the LibTorch it was built with, and refuses another naming both.
# Fails (FATAL_ERROR) naming the step and printing its output.
function(step what)
  execute_process(COMMAND ${ARGN} RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err)
  if(NOT rc EQUAL 0)
    message(FATAL_ERROR "consumer (${MODE}): ${what} failed (${rc}):\n${out}\n${err}")
  endif()
  set(STEP_OUTPUT "${out}" PARENT_SCOPE)
endfunction()

# A configure that must fail with a message holding each of ARGN.
function(expect_refusal what dir)
  execute_process(COMMAND ${configure_base} -B ${dir} ${EXTRA_ARGS} RESULT_VARIABLE rc
                  OUTPUT_VARIABLE out ERROR_VARIABLE err)
  string(REGEX REPLACE "[ \t\r\n]+" " " text "${out} ${err}")
  if(rc EQUAL 0)
    message(FATAL_ERROR "consumer (${MODE}): ${what}: the configure succeeded; expected a refusal")
  endif()
  foreach(part ${ARGN})
    string(FIND "${text}" "${part}" at)
    if(at EQUAL -1)
      message(FATAL_ERROR "consumer (${MODE}): ${what}: the error does not say '${part}':\n${out}\n${err}")
    endif()
  endforeach()
  string(REGEX MATCH "fsdp was built with[^\n]*" reason "${text}")
  message(STATUS "consumer (${MODE}): ${what}: refused: ${reason}")
endfunction()

file(REMOVE_RECURSE ${WORK_DIR})
# A LibTorch outside the system's paths (the pip wheel) is where a user would point CMake at it:
# the CMAKE_PREFIX_PATH environment variable, which find_package searches too. Not for an
# installed package, which records its LibTorch and must find it itself.
if(TORCH_PREFIX AND NOT MODE STREQUAL "install")
  set(ENV{CMAKE_PREFIX_PATH} ${TORCH_PREFIX})
endif()
set(consumer_src ${FSDP_SOURCE_DIR}/examples/consumer)
# No build type (no optimisation) and a unity build: this checks the package, not speed, and the
# subdirectory mode compiles the whole library a second time (220 s alone on the 2-core VM per
# file, 86 s in unity batches), the slowest test of the suite.
set(configure ${CMAKE_COMMAND} -S ${consumer_src} -B ${WORK_DIR}/build -G ${GENERATOR}
              -DCMAKE_BUILD_TYPE= -DCMAKE_UNITY_BUILD=ON -DCMAKE_CXX_COMPILER=${CXX})
# A project at C++20 (what LibTorch 2.x's headers need): the wheel's CUDA probe, run while
# LibTorch is found, must not take the project's C++ standard for CUDA.
if(TORCH_PREFIX)
  set(consumer_std -DCMAKE_CXX_STANDARD=20)
endif()
if(MODE STREQUAL "install")
  step("cmake --install" ${CMAKE_COMMAND} --install ${FSDP_BUILD_DIR} --prefix ${WORK_DIR}/prefix)
  foreach(f include/fsdp/fsdp.h include/fsdp/checkpoint.h lib/cmake/fsdp/fsdpConfig.cmake
            lib/cmake/fsdp/fsdpConfigVersion.cmake lib/cmake/fsdp/fsdpTargets.cmake)
    if(NOT EXISTS ${WORK_DIR}/prefix/${f})
      message(FATAL_ERROR "consumer (install): ${f} was not installed under ${WORK_DIR}/prefix")
    endif()
  endforeach()
  # Only the prefix: the package must find the LibTorch it was built with itself, also where
  # another version is installed in the system's paths (OTHER_TORCH_DIR).
  step("configure (find_package)" ${configure} -DCMAKE_PREFIX_PATH=${WORK_DIR}/prefix
       ${consumer_std})
  if(NOT EXISTS "${OTHER_TORCH_DIR}/TorchConfig.cmake")
    message(FATAL_ERROR "consumer (install): no other LibTorch to check the package against at "
                        "'${OTHER_TORCH_DIR}'; scripts/setup.sh --test installs Debian's "
                        "libtorch-dev beside the wheel (and the wheel's venv beside Debian's)")
  endif()
  file(READ ${OTHER_TORCH_DIR}/TorchConfigVersion.cmake version_file)
  string(REGEX MATCH "PACKAGE_VERSION \"([0-9.]+)\"" _ "${version_file}")
  set(other_version ${CMAKE_MATCH_1})
  file(READ ${WORK_DIR}/prefix/lib/cmake/fsdp/fsdpConfig.cmake config_text)
  string(REGEX MATCH "FSDP_BUILT_TORCH_VERSION \"([0-9.]+)\"" _ "${config_text}")
  set(built_version ${CMAKE_MATCH_1})
  set(configure_base ${CMAKE_COMMAND} -S ${consumer_src} -G ${GENERATOR} -DCMAKE_CXX_COMPILER=${CXX}
                     -DCMAKE_PREFIX_PATH=${WORK_DIR}/prefix)
  # Another version named explicitly: refused, naming both.
  set(EXTRA_ARGS -DTorch_DIR=${OTHER_TORCH_DIR})
  expect_refusal("Torch_DIR of LibTorch ${other_version}" ${WORK_DIR}/other
                 "fsdp was built with LibTorch ${built_version}"
                 "but LibTorch ${other_version} was found" "CMAKE_PREFIX_PATH")
  # The recorded LibTorch gone (a removed venv): whatever else is found, refused. (A build with
  # the system's LibTorch finds it where it was recorded anyway.)
  if(TORCH_PREFIX)
  string(REGEX REPLACE "set\\(FSDP_BUILT_TORCH_DIR \"[^\"]*\"\\)"
         "set(FSDP_BUILT_TORCH_DIR \"${WORK_DIR}/removed/share/cmake/Torch\")" moved
         "${config_text}")
  file(WRITE ${WORK_DIR}/prefix/lib/cmake/fsdp/fsdpConfig.cmake "${moved}")
  set(EXTRA_ARGS)
  expect_refusal("the recorded LibTorch removed" ${WORK_DIR}/missing
                 "fsdp was built with LibTorch ${built_version}" "CMAKE_PREFIX_PATH")
  file(WRITE ${WORK_DIR}/prefix/lib/cmake/fsdp/fsdpConfig.cmake "${config_text}")
  endif()
elseif(MODE STREQUAL "subdirectory")
  step("configure (add_subdirectory)" ${configure} -DFSDP_SOURCE_DIR=${FSDP_SOURCE_DIR}
       ${consumer_std})
  if(EXISTS ${WORK_DIR}/build/fsdp-cpp/tests OR EXISTS ${WORK_DIR}/build/fsdp-cpp/bin)
    message(FATAL_ERROR "consumer (subdirectory): fsdp-cpp generated its tests or programs in "
                        "a subproject; they must be built only when top-level or asked for")
  endif()
else()
  message(FATAL_ERROR "MODE must be install or subdirectory, not '${MODE}'")
endif()
# FSDP_TEST_JOBS (environment, default 2): fewer jobs on a machine shared with other builds.
set(jobs 2)
if(DEFINED ENV{FSDP_TEST_JOBS})
  set(jobs $ENV{FSDP_TEST_JOBS})
endif()
step("build" ${CMAKE_COMMAND} --build ${WORK_DIR}/build --target consumer -j ${jobs})
step("run" ${WORK_DIR}/build/consumer ${WORK_DIR}/ckpt)
if(NOT STEP_OUTPUT MATCHES "consumer ok: loss [0-9.e+-]+, saved .*step_00000000")
  message(FATAL_ERROR "consumer (${MODE}): unexpected output:\n${STEP_OUTPUT}")
endif()
if(NOT EXISTS ${WORK_DIR}/ckpt/step_00000000/index.json)
  message(FATAL_ERROR "consumer (${MODE}): the checkpoint index was not written")
endif()
if(MODE STREQUAL "install")
  # The installed tool runs as installed, no LD_LIBRARY_PATH: it finds the LibTorch it was built
  # with itself, not another that the loader knows first (Debian's beside the wheel).
  set(consolidated ${WORK_DIR}/model.safetensors)
  step("the installed fsdp-checkpoint" ${CMAKE_COMMAND} -E env --unset=LD_LIBRARY_PATH
       ${WORK_DIR}/prefix/bin/fsdp-checkpoint consolidate ${WORK_DIR}/ckpt/step_00000000
       ${consolidated})
  if(NOT EXISTS ${consolidated})
    message(FATAL_ERROR "consumer (install): fsdp-checkpoint consolidate wrote no ${consolidated}")
  endif()
endif()
message(STATUS "consumer (${MODE}): ${STEP_OUTPUT}")
