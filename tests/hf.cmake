# fsdp::models::Llama and Hugging Face directories (issue 48): unit tests (model, config.json,
# loading) in fsdp_tests.
fsdp_model_tests(LABEL hf SOURCES llama_test.cpp)
target_link_libraries(fsdp_tests PRIVATE fsdp_hf)
