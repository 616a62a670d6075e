# fsdp-train (issue 5): unit tests of the torch-free parts, and end-to-end runs of the real binary.
fsdp_add_test(train_unit_test LABEL train SOURCES train_unit_test.cpp LIBS fsdp_train_base)
fsdp_add_test(train_e2e_test LABEL train SOURCES train_e2e_test.cpp LIBS fsdp_train_base)
# The end-to-end tests run build/bin/fsdp-train, which starts its ranks with fsdp-run.
add_dependencies(train_e2e_test fsdp-train fsdp-run)
