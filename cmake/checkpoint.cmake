# Checkpoints (issue 6): the safetensors format layer (torch-free parser + ATen glue) and the
# sharded save/load on top of fully_shard. See docs/checkpoint.md.

# Format layer: builds without the FSDP core.
add_library(fsdp_safetensors STATIC
  ${CMAKE_SOURCE_DIR}/src/checkpoint/safetensors.cpp
  ${CMAKE_SOURCE_DIR}/src/checkpoint/index.cpp
  ${CMAKE_SOURCE_DIR}/src/checkpoint/tensor_io.cpp
)
target_include_directories(fsdp_safetensors PUBLIC ${CMAKE_SOURCE_DIR}/include)
target_link_libraries(fsdp_safetensors PUBLIC fsdp_comm nlohmann_json::nlohmann_json)

# Sharded checkpoints: the only translation unit with torch::optim headers.
add_library(fsdp_checkpoint STATIC ${CMAKE_SOURCE_DIR}/src/checkpoint/checkpoint.cpp)
target_include_directories(fsdp_checkpoint PUBLIC ${CMAKE_SOURCE_DIR}/include)
target_link_libraries(fsdp_checkpoint PUBLIC fsdp_safetensors fsdp)
