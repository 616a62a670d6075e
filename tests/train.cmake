# fsdp-train (issues 5, 13, 14): unit tests of the torch-free parts (settings, data, schedule,
# metrics, plot, resume and retention on fake checkpoints, bounds), and end-to-end runs of the real
# binary (parity, resume, evaluation, accumulation, .bin data, retention, torchrun, bad input).
fsdp_add_test(train_unit_test LABEL train SOURCES train_unit_test.cpp LIBS fsdp_train_resume)
fsdp_add_test(train_e2e_test LABEL train SOURCES train_e2e_test.cpp LIBS fsdp_train_base)
# Faults survived end to end: --async-save under kills, checkpoints refused or skipped by name,
# torchrun's agent killed (TrainResilience).
fsdp_add_test(train_resilience_test LABEL train SOURCES train_resilience_test.cpp LIBS fsdp_train_base)
# The end-to-end tests run build/bin/fsdp-train, which starts its ranks with fsdp-run.
add_dependencies(train_e2e_test fsdp-train fsdp-run)
add_dependencies(train_resilience_test fsdp-train fsdp-run)
