# fsdp::models::Llama and Hugging Face directories (issue 48). Unit tests (model, config.json,
# loading, export) in fsdp_tests; the parity with transformers 5.x (bench/hf_peer.py under
# FSDP_PEER_PYTHON, which scripts/torch_pip.sh gives transformers and tokenizers) in its own
# program (label parity; `ctest -R hf_parity` selects it).
fsdp_model_tests(LABEL hf SOURCES llama_test.cpp)
add_executable(hf_parity_test hf_parity_test.cpp)
target_link_libraries(hf_parity_test PRIVATE fsdp_testing fsdp_train_base fsdp_hf fsdp_models)
target_include_directories(hf_parity_test PRIVATE ${PROJECT_SOURCE_DIR}/src)
target_precompile_headers(hf_parity_test REUSE_FROM fsdp_models)
target_compile_definitions(hf_parity_test PRIVATE FSDP_PEER_PYTHON="${FSDP_PEER_PYTHON}"
                                                  FSDP_SOURCE_DIR="${PROJECT_SOURCE_DIR}")
add_dependencies(hf_parity_test fsdp-train fsdp-run fsdp-checkpoint)
gtest_discover_tests(hf_parity_test TEST_PREFIX "hf_parity_test." PROPERTIES LABELS "parity"
                     TIMEOUT 900 DISCOVERY_TIMEOUT 60)
target_link_libraries(fsdp_tests PRIVATE fsdp_hf)
