# Builds each compile_error_<case> target of BUILD_DIR, which must fail, and checks that the
# compiler's output carries the message that names the fix. Fails naming the case otherwise.
set(expect_1 "needs the module declared as fsdp::Sharded<T>.*fully_shard_elements")
set(expect_2 "this forward returns a type fsdp-cpp cannot look into")
set(expect_3 "fully_shard_elements shards the elements of torch::nn::Sequential")
foreach(case 1 2 3)
  execute_process(COMMAND ${CMAKE_COMMAND} --build ${BUILD_DIR} --target compile_error_${case}
                  RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err)
  string(REPLACE "\n" " " all "${out} ${err}")
  if(rc EQUAL 0)
    message(FATAL_ERROR "compile_errors case ${case} compiled; it must not")
  endif()
  if(NOT all MATCHES "${expect_${case}}")
    message(FATAL_ERROR "compile_errors case ${case}: the message '${expect_${case}}' is missing "
                        "from the compiler's output:\n${out}\n${err}")
  endif()
  message(STATUS "compile_errors case ${case}: fails with its message")
endforeach()
