# Communicator, rendezvous and launcher tests (label comm).
fsdp_add_test(comm_test LABEL comm PCH core
  SOURCES ${CMAKE_CURRENT_SOURCE_DIR}/comm_test.cpp ${CMAKE_CURRENT_SOURCE_DIR}/rendezvous_test.cpp
          ${CMAKE_CURRENT_SOURCE_DIR}/comm_failure_test.cpp
          ${CMAKE_CURRENT_SOURCE_DIR}/shm_exchange_test.cpp
          ${CMAKE_CURRENT_SOURCE_DIR}/rank_order_sum_test.cpp
          ${CMAKE_CURRENT_SOURCE_DIR}/slurm_test.cpp)
# comm_failure_test, shm_exchange_test, rank_order_sum_test and slurm_test reach internal headers
# (src/comm/*.h).
target_include_directories(comm_test PRIVATE ${PROJECT_SOURCE_DIR}/src)
# CommFailureTest.ASecondJobOnTheSamePortIsToldSo starts fsdp-example as another job's rank.
add_dependencies(comm_test fsdp-example)
fsdp_add_test(launcher_test LABEL comm PCH core
  SOURCES ${CMAKE_CURRENT_SOURCE_DIR}/launcher_test.cpp)
add_dependencies(launcher_test fsdp-run)
# fsdp-example under torchrun of the same torch as the build (Debian's python3-torch, or the pip
# venv's).
fsdp_add_test(torchrun_test LABEL comm PCH core SOURCES ${CMAKE_CURRENT_SOURCE_DIR}/torchrun_test.cpp)
add_dependencies(torchrun_test fsdp-example)
# Two network namespaces and a veth pair: training across them, then a cut link (root only).
fsdp_model_tests(LABEL comm SOURCES netns_test.cpp)
# A one-node Slurm cluster the test starts itself (root; Debian's slurmctld, slurmd, slurm-client
# and munge from scripts/setup.sh --test; skipped without them): fsdp-train under srun and sbatch
# with no MASTER_ADDR/MASTER_PORT, losses equal to fsdp-run's (label slurm).
fsdp_add_test(slurm_cluster_test LABEL slurm SOURCES ${CMAKE_CURRENT_SOURCE_DIR}/slurm_cluster_test.cpp
              LIBS fsdp_train_base)
add_dependencies(slurm_cluster_test fsdp-train fsdp-run)
# Internal helpers: environment variables, the checksum, the pure part of rank agreement.
fsdp_add_test(util_test LABEL comm PCH core SOURCES ${CMAKE_CURRENT_SOURCE_DIR}/util_test.cpp)
target_include_directories(util_test PRIVATE ${PROJECT_SOURCE_DIR}/src)
