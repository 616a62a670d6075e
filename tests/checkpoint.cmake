# Checkpoint tests (label checkpoint). The format test needs no FSDP core.
fsdp_add_test(safetensors_test LABEL checkpoint SOURCES safetensors_test.cpp LIBS fsdp_safetensors)
target_compile_definitions(safetensors_test PRIVATE FSDP_SOURCE_DIR="${PROJECT_SOURCE_DIR}")

# Sharded checkpoints through fully_shard (multi-rank).
fsdp_model_tests(LABEL checkpoint SOURCES checkpoint_test.cpp checkpoint_async_test.cpp)

# The shared file helpers: hex, strict JSON, atomic writes (torch-free).
fsdp_add_test(fileio_test LABEL checkpoint SOURCES fileio_test.cpp LIBS fsdp_io)
target_include_directories(fileio_test PRIVATE ${PROJECT_SOURCE_DIR}/src)
