# fully_shard: the post-backward guarantee, parity with unsharded training, errors and memory.
fsdp_add_test(guarantee_test LABEL guarantee PCH torch SOURCES guarantee_test.cpp LIBS fsdp fsdp_models)
fsdp_add_test(parity_test LABEL parity PCH torch SOURCES parity_test.cpp LIBS fsdp fsdp_models)
fsdp_add_test(fully_shard_test LABEL fsdp PCH torch SOURCES fully_shard_test.cpp LIBS fsdp fsdp_models)
fsdp_add_test(guarantee_fuzz_test LABEL guarantee PCH torch SOURCES guarantee_fuzz_test.cpp LIBS fsdp fsdp_models)
fsdp_add_test(guarantee_paths_test LABEL guarantee PCH torch SOURCES guarantee_paths_test.cpp LIBS fsdp fsdp_models)
fsdp_add_test(outputs_test LABEL adoption PCH torch SOURCES outputs_test.cpp LIBS fsdp fsdp_models)
fsdp_add_test(mixed_precision_test LABEL mixed_precision PCH torch SOURCES mixed_precision_test.cpp LIBS fsdp fsdp_models)
fsdp_add_test(hsdp_test LABEL hsdp PCH torch SOURCES hsdp_test.cpp LIBS fsdp fsdp_models fsdp_checkpoint)
fsdp_add_test(misuse_test LABEL adoption PCH torch SOURCES misuse_test.cpp LIBS fsdp fsdp_models)
# Whole-model state, buffers across ranks, and the models users write (issue 10).
fsdp_add_test(state_dict_test LABEL adoption PCH torch
              SOURCES state_dict_test.cpp buffers_test.cpp checkpoint_buffers_test.cpp
              LIBS fsdp_checkpoint fsdp_models)
target_include_directories(state_dict_test PRIVATE ${PROJECT_SOURCE_DIR}/src)
fsdp_add_test(adoption_models_test LABEL adoption PCH torch SOURCES adoption_models_test.cpp
              LIBS fsdp fsdp_models)
target_include_directories(adoption_models_test PRIVATE ${PROJECT_SOURCE_DIR}/src)
# Containers: one group per element of Sequential, ModuleList, TransformerEncoder/Decoder.
fsdp_add_test(containers_test LABEL adoption PCH torch SOURCES containers_test.cpp LIBS fsdp)
