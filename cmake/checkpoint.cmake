# Checkpoints (issue 6): the safetensors format layer (torch-free parser + ATen glue) and the
# sharded save/load on top of fully_shard. See docs/checkpoint.md.

# Torch-free file helpers shared by the checkpoint code (and the trainer): atomic writes, strict
# JSON, hex.
pkg_check_modules(XXHASH REQUIRED IMPORTED_TARGET libxxhash)
add_library(fsdp_io STATIC
  ${CMAKE_SOURCE_DIR}/src/checkpoint/atomic_file.cpp
  ${CMAKE_SOURCE_DIR}/src/checkpoint/hex.cpp
  ${CMAKE_SOURCE_DIR}/src/checkpoint/strict_json.cpp
)
target_include_directories(fsdp_io PUBLIC ${CMAKE_SOURCE_DIR}/include
                           PRIVATE ${CMAKE_SOURCE_DIR}/src/checkpoint)
target_link_libraries(fsdp_io PUBLIC nlohmann_json::nlohmann_json)

# Format layer: builds without the FSDP core.
add_library(fsdp_safetensors STATIC
  ${CMAKE_SOURCE_DIR}/src/checkpoint/safetensors.cpp
  ${CMAKE_SOURCE_DIR}/src/checkpoint/index.cpp
  ${CMAKE_SOURCE_DIR}/src/checkpoint/tensor_io.cpp
)
target_include_directories(fsdp_safetensors PUBLIC ${CMAKE_SOURCE_DIR}/include)
target_link_libraries(fsdp_safetensors PUBLIC fsdp_comm fsdp_io nlohmann_json::nlohmann_json
                      PRIVATE PkgConfig::XXHASH)

# Sharded checkpoints: the only translation unit with torch::optim headers.
add_library(fsdp_checkpoint STATIC ${CMAKE_SOURCE_DIR}/src/checkpoint/checkpoint.cpp
                                   ${CMAKE_SOURCE_DIR}/src/checkpoint/scan.cpp)
target_include_directories(fsdp_checkpoint PUBLIC ${CMAKE_SOURCE_DIR}/include)
target_link_libraries(fsdp_checkpoint PUBLIC fsdp_safetensors fsdp)
