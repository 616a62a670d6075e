# The CMake package (issue 10, label adoption): examples/consumer configured, built and run as an
# outside project, against a temporary install prefix and as add_subdirectory. The second compiles
# the library again (a fresh project cannot reuse this build's objects): one tiny consumer source.
# Another LibTorch version beside the one this build uses (scripts/setup.sh --test installs Debian's
# libtorch-dev beside the wheel; the wheel's venv is there for every build): the installed package
# must still find its own, and refuse the other naming both.
if(FSDP_TORCH_PREFIX)
  set(FSDP_OTHER_TORCH_DIR /usr/lib/${CMAKE_LIBRARY_ARCHITECTURE}/cmake/Torch)
else()
  get_filename_component(FSDP_PEER_VENV ${FSDP_PEER_PYTHON} DIRECTORY)  # <venv>/bin
  get_filename_component(FSDP_PEER_VENV ${FSDP_PEER_VENV} DIRECTORY)
  file(GLOB FSDP_OTHER_TORCH_DIR
       ${FSDP_PEER_VENV}/lib/python3*/site-packages/torch/share/cmake/Torch)
endif()
foreach(mode install subdirectory)
  add_test(NAME consumer_${mode}
           COMMAND ${CMAKE_COMMAND} -DMODE=${mode} -DFSDP_SOURCE_DIR=${PROJECT_SOURCE_DIR}
                   -DFSDP_BUILD_DIR=${PROJECT_BINARY_DIR} -DCXX=${CMAKE_CXX_COMPILER}
                   "-DGENERATOR=${CMAKE_GENERATOR}" -DWORK_DIR=${CMAKE_CURRENT_BINARY_DIR}/consumer_${mode}
                   "-DTORCH_PREFIX=${FSDP_TORCH_PREFIX}" "-DOTHER_TORCH_DIR=${FSDP_OTHER_TORCH_DIR}"
                   -P ${CMAKE_CURRENT_SOURCE_DIR}/package/build_consumer.cmake)
  # COST: ctest starts the longest tests first, beside the others, not alone at the end.
  set_tests_properties(consumer_${mode} PROPERTIES LABELS adoption TIMEOUT 1200 COST 1000)
endforeach()
