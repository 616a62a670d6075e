# Checkpoints (issue 6): the safetensors format layer (torch-free parser + ATen glue) and the
# sharded save/load on top of fully_shard. See docs/checkpoint.md.

# Format layer: builds without the FSDP core.
add_library(fsdp_safetensors STATIC
  ${PROJECT_SOURCE_DIR}/src/checkpoint/safetensors.cpp
  ${PROJECT_SOURCE_DIR}/src/checkpoint/index.cpp
  ${PROJECT_SOURCE_DIR}/src/checkpoint/tensor_io.cpp
)
target_include_directories(fsdp_safetensors PUBLIC ${FSDP_INCLUDE})
target_link_libraries(fsdp_safetensors PUBLIC fsdp_comm nlohmann_json::nlohmann_json)

# Sharded checkpoints: the only translation unit with torch::optim headers.
add_library(fsdp_checkpoint STATIC ${PROJECT_SOURCE_DIR}/src/checkpoint/checkpoint.cpp)
target_include_directories(fsdp_checkpoint PUBLIC ${FSDP_INCLUDE})
target_link_libraries(fsdp_checkpoint PUBLIC fsdp_safetensors fsdp)
