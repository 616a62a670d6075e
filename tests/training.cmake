# Training features on top of fully_shard: gradient clipping and activation checkpointing.
fsdp_add_test(clip_grad_norm_test LABEL clip PCH torch SOURCES clip_grad_norm_test.cpp LIBS fsdp fsdp_models)
fsdp_add_test(activation_checkpoint_test LABEL checkpointing PCH torch SOURCES activation_checkpoint_test.cpp LIBS fsdp fsdp_models)
fsdp_add_test(deferred_init_test LABEL init PCH torch SOURCES deferred_init_test.cpp LIBS fsdp fsdp_models)
