# Checkpoints (issue 6): the safetensors format layer (torch-free parser + ATen glue) and the
# sharded save/load on top of fully_shard. See docs/checkpoint.md.

# Torch-free file helpers shared by the checkpoint code (and the trainer): atomic writes, strict
# JSON, hex.
add_library(fsdp_io STATIC
  ${PROJECT_SOURCE_DIR}/src/checkpoint/atomic_file.cpp
  ${PROJECT_SOURCE_DIR}/src/checkpoint/hex.cpp
  ${PROJECT_SOURCE_DIR}/src/checkpoint/strict_json.cpp
)
target_include_directories(fsdp_io PUBLIC ${FSDP_INCLUDE}
                           PRIVATE ${PROJECT_SOURCE_DIR}/src ${PROJECT_SOURCE_DIR}/src/checkpoint)
target_link_libraries(fsdp_io PUBLIC nlohmann_json::nlohmann_json)

# Format layer: builds without the FSDP core.
add_library(fsdp_safetensors STATIC
  ${PROJECT_SOURCE_DIR}/src/checkpoint/safetensors_file.cpp
  ${PROJECT_SOURCE_DIR}/src/checkpoint/safetensors_header.cpp
  ${PROJECT_SOURCE_DIR}/src/checkpoint/index.cpp
  ${PROJECT_SOURCE_DIR}/src/checkpoint/tensor_io.cpp
)
target_include_directories(fsdp_safetensors PUBLIC ${FSDP_INCLUDE} PRIVATE ${PROJECT_SOURCE_DIR}/src)
# xxHash by its library name (Debian's libxxhash-dev): also what the installed package records.
target_link_libraries(fsdp_safetensors PUBLIC fsdp_comm fsdp_io nlohmann_json::nlohmann_json
                      PRIVATE xxhash)

# Sharded checkpoints: the only library with torch::optim headers.
add_library(fsdp_checkpoint STATIC
  ${PROJECT_SOURCE_DIR}/src/checkpoint/async_save.cpp
  ${PROJECT_SOURCE_DIR}/src/checkpoint/checkpoint_common.cpp
  ${PROJECT_SOURCE_DIR}/src/checkpoint/checkpoint_load.cpp
  ${PROJECT_SOURCE_DIR}/src/checkpoint/checkpoint_save.cpp
  ${PROJECT_SOURCE_DIR}/src/checkpoint/optim_state.cpp
  ${PROJECT_SOURCE_DIR}/src/checkpoint/reader.cpp
  ${PROJECT_SOURCE_DIR}/src/checkpoint/scan.cpp
)
target_include_directories(fsdp_checkpoint PUBLIC ${FSDP_INCLUDE} PRIVATE ${PROJECT_SOURCE_DIR}/src)
target_link_libraries(fsdp_checkpoint PUBLIC fsdp_safetensors fsdp)
