# Communicator, rendezvous and launcher tests (label comm).
fsdp_add_test(comm_test LABEL comm PCH core
  SOURCES ${CMAKE_CURRENT_SOURCE_DIR}/comm_test.cpp ${CMAKE_CURRENT_SOURCE_DIR}/rendezvous_test.cpp)
fsdp_add_test(launcher_test LABEL comm PCH core
  SOURCES ${CMAKE_CURRENT_SOURCE_DIR}/launcher_test.cpp)
add_dependencies(launcher_test fsdp-run)
# fsdp-example under Debian's torchrun (skipped without python3-torch).
fsdp_add_test(torchrun_test LABEL comm PCH core SOURCES ${CMAKE_CURRENT_SOURCE_DIR}/torchrun_test.cpp)
add_dependencies(torchrun_test fsdp-example)
