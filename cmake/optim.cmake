# Fused optimizer steps on flat shards (issue 50): fsdp::optim::AdamW and SGD, drop-in for
# torch::optim's (include/fsdp/optim.h).
add_library(fsdp_optim STATIC
  ${PROJECT_SOURCE_DIR}/src/optim/adamw.cpp
  ${PROJECT_SOURCE_DIR}/src/optim/sgd.cpp
  ${PROJECT_SOURCE_DIR}/src/optim/runs.cpp
  ${PROJECT_SOURCE_DIR}/src/optim/kernels.cpp
)
target_include_directories(fsdp_optim PUBLIC ${FSDP_INCLUDE} PRIVATE ${PROJECT_SOURCE_DIR}/src)
target_link_libraries(fsdp_optim PUBLIC fsdp_comm)
# The element loops: vectorised (-O3; -fno-math-errno lets sqrt vectorise) without contracting
# a * b + c into one rounding where LibTorch rounds twice (-ffp-contract=off); torch-free, so
# compiled on their own, outside the unity batches and the precompiled header.
set_source_files_properties(${PROJECT_SOURCE_DIR}/src/optim/kernels.cpp PROPERTIES
  COMPILE_OPTIONS "-O3;-fno-math-errno;-ffp-contract=off"
  SKIP_UNITY_BUILD_INCLUSION ON SKIP_PRECOMPILE_HEADERS ON)
target_precompile_headers(fsdp_optim REUSE_FROM fsdp_models)
