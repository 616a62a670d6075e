# fsdp-train, the reference trainer (issue 5; docs/trainer.md).
#   fsdp_train_base: settings, data order, schedule, metrics, plot, progress, sampling, launching. No torch
#                    headers: quick to build, unit-tested on its own.
#   fsdp_train:      the training loop (torch::nn, optimizers): the one heavy TU, sharing the
#                    models' precompiled <torch/torch.h>.
add_library(fsdp_train_base STATIC
  src/train/config.cpp
  src/train/data.cpp
  src/train/generate.cpp
  src/train/launch.cpp
  src/train/metrics.cpp
  src/train/plot.cpp
  src/train/progress.cpp
  src/train/schedule.cpp
)
target_include_directories(fsdp_train_base PUBLIC ${PROJECT_SOURCE_DIR}/src ${PROJECT_SOURCE_DIR}/include)
target_link_libraries(fsdp_train_base
  PUBLIC nlohmann_json::nlohmann_json
  PRIVATE CLI11::CLI11 PkgConfig::TOMLPP)
target_compile_definitions(fsdp_train_base PRIVATE FSDP_SOURCE_DIR="${PROJECT_SOURCE_DIR}")

add_library(fsdp_train STATIC src/train/trainer.cpp)
target_link_libraries(fsdp_train PUBLIC fsdp_train_base fsdp_models)
target_precompile_headers(fsdp_train REUSE_FROM fsdp_models)
if(TARGET fsdp_checkpoint)
  target_link_libraries(fsdp_train PUBLIC fsdp_checkpoint)
  target_compile_definitions(fsdp_train PRIVATE FSDP_TRAIN_HAVE_CHECKPOINT=1)
endif()

add_executable(fsdp-train apps/fsdp_train.cpp)
target_link_libraries(fsdp-train PRIVATE fsdp_train)
target_precompile_headers(fsdp-train REUSE_FROM fsdp_models)
# fsdp-train starts its local ranks through fsdp-run, found next to it.
add_dependencies(fsdp-train fsdp-run)
