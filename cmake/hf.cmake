# Hugging Face model directories (issue 48; include/fsdp/hf.h): reading a transformers Llama into
# fsdp::models::Llama (each rank its rows) and exporting a sharded checkpoint to a directory that
# transformers loads.
add_library(fsdp_hf STATIC
  ${PROJECT_SOURCE_DIR}/src/hf/hf_files.cpp
  ${PROJECT_SOURCE_DIR}/src/hf/hf_load.cpp
  ${PROJECT_SOURCE_DIR}/src/hf/hf_export.cpp
)
target_include_directories(fsdp_hf PUBLIC ${FSDP_INCLUDE} PRIVATE ${PROJECT_SOURCE_DIR}/src)
target_link_libraries(fsdp_hf PUBLIC fsdp_checkpoint fsdp_llama_config
                      PRIVATE nlohmann_json::nlohmann_json)
set_target_properties(fsdp_hf PROPERTIES EXPORT_NAME hf)
add_library(fsdp::hf ALIAS fsdp_hf)
