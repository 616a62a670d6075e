# fully_shard: the post-backward guarantee, parity with unsharded training, errors and memory.
fsdp_model_tests(LABEL guarantee
                 SOURCES guarantee_test.cpp guarantee_fuzz_test.cpp guarantee_paths_test.cpp
                         verified_collectives_test.cpp copies_test.cpp)
fsdp_model_tests(LABEL parity SOURCES parity_test.cpp attention_test.cpp optim_test.cpp
                 quantized_test.cpp)
fsdp_model_tests(LABEL fsdp SOURCES fully_shard_test.cpp)
fsdp_model_tests(LABEL mixed_precision SOURCES mixed_precision_test.cpp)
fsdp_model_tests(LABEL hsdp SOURCES hsdp_test.cpp)
# Outputs, misuse, whole-model state, buffers across ranks, the models users write (issue 10), and
# containers (one group per element of Sequential, ModuleList, TransformerEncoder/Decoder).
fsdp_model_tests(LABEL adoption
                 SOURCES outputs_test.cpp misuse_test.cpp state_dict_test.cpp buffers_test.cpp
                         checkpoint_buffers_test.cpp adoption_models_test.cpp containers_test.cpp
                         ignored_params_test.cpp shard_placement_test.cpp module_list_test.cpp
                         finalize_backward_test.cpp)
# The operator interception under the guard, elements gathered on use and deferred_init: fails
# naming the LibTorch version when a LibTorch upgrade breaks it (src/compat/interception.h).
fsdp_add_test(interception_test LABEL interception PCH core
  SOURCES ${CMAKE_CURRENT_SOURCE_DIR}/interception_test.cpp LIBS fsdp)
target_include_directories(interception_test PRIVATE ${PROJECT_SOURCE_DIR}/src)
# The cross-rank protocol's rules on plain messages (src/core/protocol.h): no processes.
fsdp_add_test(protocol_test LABEL guarantee PCH core SOURCES ${CMAKE_CURRENT_SOURCE_DIR}/protocol_test.cpp
              LIBS fsdp)
target_include_directories(protocol_test PRIVATE ${PROJECT_SOURCE_DIR}/src)
