# Checkpoint tests (label checkpoint). The format test needs no FSDP core.
fsdp_add_test(safetensors_test LABEL checkpoint SOURCES safetensors_test.cpp LIBS fsdp_safetensors)
target_compile_definitions(safetensors_test PRIVATE FSDP_SOURCE_DIR="${CMAKE_SOURCE_DIR}")
