# The CMake package (issue 10, label adoption): examples/consumer configured, built and run as an
# outside project, against a temporary install prefix and as add_subdirectory. The second compiles
# the library again (a fresh project cannot reuse this build's objects): one tiny consumer source.
foreach(mode install subdirectory)
  add_test(NAME consumer_${mode}
           COMMAND ${CMAKE_COMMAND} -DMODE=${mode} -DFSDP_SOURCE_DIR=${PROJECT_SOURCE_DIR}
                   -DFSDP_BUILD_DIR=${PROJECT_BINARY_DIR} -DCXX=${CMAKE_CXX_COMPILER}
                   "-DGENERATOR=${CMAKE_GENERATOR}" -DWORK_DIR=${CMAKE_CURRENT_BINARY_DIR}/consumer_${mode}
                   "-DTORCH_PREFIX=${FSDP_TORCH_PREFIX}"
                   -P ${CMAKE_CURRENT_SOURCE_DIR}/package/build_consumer.cmake)
  # COST: ctest starts the longest tests first, beside the others, not alone at the end.
  set_tests_properties(consumer_${mode} PROPERTIES LABELS adoption TIMEOUT 1200 COST 1000)
endforeach()
