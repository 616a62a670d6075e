# fsdp-train, the reference trainer (issues 5, 13, 14; docs/trainer.md).
#   fsdp_train_base:   settings, data, schedule, metrics, plot, progress, sampling, launching,
#                      --malloc, model size and memory bounds, summary. No torch headers: quick to build,
#                      unit-tested on its own.
#   fsdp_train_resume: which checkpoint a run continues from, its settings, retention (reads
#                      checkpoint indexes; torch-free headers).
#   fsdp_train_model:  the model and optimizer, built one way for the trainer and fsdp-bench.
#   fsdp_train:        the training run (torch::nn, optimizers), sharing the models' precompiled
#                      <torch/torch.h>.
add_library(fsdp_train_base STATIC
  src/train/cli_integers.cpp
  src/train/config.cpp
  src/train/config_file.cpp
  src/train/config_validate.cpp
  src/train/data.cpp
  src/train/generate.cpp
  src/train/launch.cpp
  src/train/malloc.cpp
  src/train/metrics.cpp
  src/train/model_select.cpp
  src/train/model_size.cpp
  src/train/plot.cpp
  src/train/progress.cpp
  src/train/schedule.cpp
  src/train/summary.cpp
  src/train/token_sample.cpp
)
target_include_directories(fsdp_train_base PUBLIC ${PROJECT_SOURCE_DIR}/src ${PROJECT_SOURCE_DIR}/include)
target_link_libraries(fsdp_train_base
  PUBLIC fsdp_io fsdp_util fsdp_llama_config nlohmann_json::nlohmann_json
  PRIVATE CLI11::CLI11 PkgConfig::TOMLPP)
target_compile_definitions(fsdp_train_base PRIVATE FSDP_SOURCE_DIR="${PROJECT_SOURCE_DIR}")

add_library(fsdp_train_resume STATIC src/train/resume.cpp)
target_link_libraries(fsdp_train_resume PUBLIC fsdp_train_base fsdp_safetensors)

add_library(fsdp_train_model STATIC src/train/model_setup.cpp src/train/rounding_collectives.cpp)
target_link_libraries(fsdp_train_model PUBLIC fsdp_train_base fsdp_models fsdp_optim)
target_precompile_headers(fsdp_train_model REUSE_FROM fsdp_models)

add_library(fsdp_train STATIC src/train/trainer.cpp src/train/hf_init.cpp)
target_link_libraries(fsdp_train PUBLIC fsdp_train_resume fsdp_train_model)
target_precompile_headers(fsdp_train REUSE_FROM fsdp_models)
if(TARGET fsdp_checkpoint)
  target_sources(fsdp_train PRIVATE src/train/run_checkpoints.cpp)
  target_link_libraries(fsdp_train PUBLIC fsdp_checkpoint fsdp_hf)
  target_compile_definitions(fsdp_train PRIVATE FSDP_TRAIN_HAVE_CHECKPOINT=1)
endif()

add_executable(fsdp-train apps/fsdp_train.cpp)
target_link_libraries(fsdp-train PRIVATE fsdp_train)
target_precompile_headers(fsdp-train REUSE_FROM fsdp_models)
# fsdp-train starts its local ranks through fsdp-run, found next to it.
add_dependencies(fsdp-train fsdp-run)
