# Training features on top of fully_shard: gradient clipping and activation checkpointing.
fsdp_model_tests(LABEL clip SOURCES clip_grad_norm_test.cpp)
fsdp_model_tests(LABEL checkpointing SOURCES activation_checkpoint_test.cpp)
fsdp_model_tests(LABEL init SOURCES deferred_init_test.cpp)
