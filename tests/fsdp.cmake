# fully_shard: the post-backward guarantee, parity with unsharded training, errors and memory.
fsdp_model_tests(LABEL guarantee
                 SOURCES guarantee_test.cpp guarantee_fuzz_test.cpp guarantee_paths_test.cpp)
fsdp_model_tests(LABEL parity SOURCES parity_test.cpp)
fsdp_model_tests(LABEL fsdp SOURCES fully_shard_test.cpp)
fsdp_model_tests(LABEL mixed_precision SOURCES mixed_precision_test.cpp)
fsdp_model_tests(LABEL hsdp SOURCES hsdp_test.cpp)
# Outputs, misuse, whole-model state, buffers across ranks, the models users write (issue 10), and
# containers (one group per element of Sequential, ModuleList, TransformerEncoder/Decoder).
fsdp_model_tests(LABEL adoption
                 SOURCES outputs_test.cpp misuse_test.cpp state_dict_test.cpp buffers_test.cpp
                         checkpoint_buffers_test.cpp adoption_models_test.cpp containers_test.cpp)
