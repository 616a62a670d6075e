# Elastic replicas (fsdp/elastic.h): the membership protocol on a store, and fsdp-elastic-example
# under fsdp-run --replicas with replicas killed (SIGKILL) and restarted (label elastic).
fsdp_add_test(elastic_test LABEL elastic PCH torch SOURCES ${CMAKE_CURRENT_SOURCE_DIR}/elastic_test.cpp
              LIBS fsdp fsdp_checkpoint)
target_include_directories(elastic_test PRIVATE ${PROJECT_SOURCE_DIR}/src)
add_dependencies(elastic_test fsdp-run fsdp-coordinator fsdp-elastic-example)
