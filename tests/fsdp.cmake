# fully_shard: the post-backward guarantee, parity with unsharded training, errors and memory.
fsdp_add_test(guarantee_test LABEL guarantee PCH torch SOURCES guarantee_test.cpp LIBS fsdp fsdp_models)
fsdp_add_test(parity_test LABEL parity PCH torch SOURCES parity_test.cpp LIBS fsdp fsdp_models)
fsdp_add_test(fully_shard_test LABEL fsdp PCH torch SOURCES fully_shard_test.cpp LIBS fsdp fsdp_models)
fsdp_add_test(guarantee_fuzz_test LABEL guarantee PCH torch SOURCES guarantee_fuzz_test.cpp LIBS fsdp fsdp_models)
fsdp_add_test(guarantee_paths_test LABEL guarantee PCH torch SOURCES guarantee_paths_test.cpp LIBS fsdp fsdp_models)
fsdp_add_test(outputs_test LABEL adoption PCH torch SOURCES outputs_test.cpp LIBS fsdp fsdp_models)
