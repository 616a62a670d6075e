# Compile-time errors (issue 10, item 5): each case of compile_errors.cpp must fail to compile
# with its message. One test runs the cases in turn (each is a syntax-only compile of one file).
foreach(case 1 2 3)
  add_library(compile_error_${case} OBJECT EXCLUDE_FROM_ALL compile_errors.cpp)
  target_link_libraries(compile_error_${case} PRIVATE fsdp)
  target_compile_definitions(compile_error_${case} PRIVATE FSDP_CASE=${case})
  target_compile_options(compile_error_${case} PRIVATE -fsyntax-only)
  target_precompile_headers(compile_error_${case} REUSE_FROM fsdp_models)
endforeach()
add_test(NAME compile_errors_name_the_fix
         COMMAND ${CMAKE_COMMAND} -DBUILD_DIR=${PROJECT_BINARY_DIR}
                 -P ${CMAKE_CURRENT_SOURCE_DIR}/package/check_compile_errors.cmake)
set_tests_properties(compile_errors_name_the_fix PROPERTIES LABELS adoption TIMEOUT 600)
