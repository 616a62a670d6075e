# fsdp-train against PyTorch's FSDP2 as a live peer (issue 29; bench/fsdp2_peer.py,
# docs/fsdp2_peer.md). The peer runs under FSDP_PEER_PYTHON, a Python with torch 2.15 and
# safetensors whatever LibTorch this build links (Debian's 1.13 has no FSDP2): by default the venv
# scripts/torch_pip.sh creates. The tests fail, naming it, when it is missing.
set(FSDP_PEER_PYTHON /opt/fsdp-cpp/torch215/bin/python
    CACHE FILEPATH "Python with torch 2.15 and safetensors that runs bench/fsdp2_peer.py in tests")
add_executable(fsdp2_peer_test fsdp2_peer_test.cpp)
target_link_libraries(fsdp2_peer_test PRIVATE fsdp_testing fsdp_train_base fsdp_checkpoint)
target_precompile_headers(fsdp2_peer_test REUSE_FROM fsdp_models)
target_compile_definitions(fsdp2_peer_test PRIVATE FSDP_PEER_PYTHON="${FSDP_PEER_PYTHON}"
                                                   FSDP_SOURCE_DIR="${PROJECT_SOURCE_DIR}")
# It runs build/bin/fsdp-train, which starts its ranks with fsdp-run.
add_dependencies(fsdp2_peer_test fsdp-train fsdp-run)
# The program name as a prefix: `ctest -R fsdp2` selects them (the suite is Fsdp2Peer).
gtest_discover_tests(fsdp2_peer_test TEST_PREFIX "fsdp2_peer_test." PROPERTIES LABELS "parity" TIMEOUT 300 DISCOVERY_TIMEOUT 60)
