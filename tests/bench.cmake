# fsdp-bench training modes (issue 4): a tiny --compare run checked for its keys, sanity and the
# communication volume model, and a --trace run whose files are parsed for the expected spans.
fsdp_add_test(bench_test LABEL bench PCH core SOURCES ${CMAKE_CURRENT_SOURCE_DIR}/bench_test.cpp
  LIBS nlohmann_json::nlohmann_json)
# The tests run build/bin/fsdp-bench, which starts its ranks with fsdp-run.
add_dependencies(bench_test fsdp-bench fsdp-run)
# --compare's Python peers (bench/torch_ddp.py: PyTorch's DDP and FSDP2) run under the Python of
# torch 2.15 the FSDP2 peer tests use (tests/fsdp2_peer.cmake, which reads the same cache entry;
# the Makefile sets it from TORCH_PIP_VENV); the tests pass it as --python.
set(FSDP_PEER_PYTHON /opt/fsdp-cpp/torch215/bin/python
    CACHE FILEPATH "Python with torch 2.15 and safetensors that runs bench/fsdp2_peer.py in tests")
target_compile_definitions(bench_test PRIVATE FSDP_PEER_PYTHON="${FSDP_PEER_PYTHON}"
                           FSDP_SOURCE_DIR="${PROJECT_SOURCE_DIR}")
