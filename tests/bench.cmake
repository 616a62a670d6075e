# fsdp-bench training modes (issue 4): a tiny --compare run checked for its keys, sanity and the
# communication volume model, and a --trace run whose files are parsed for the expected spans.
fsdp_add_test(bench_test LABEL bench PCH core SOURCES ${CMAKE_CURRENT_SOURCE_DIR}/bench_test.cpp
  LIBS nlohmann_json::nlohmann_json)
# The tests run build/bin/fsdp-bench, which starts its ranks with fsdp-run.
add_dependencies(bench_test fsdp-bench fsdp-run)
