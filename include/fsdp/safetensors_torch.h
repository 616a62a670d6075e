// Glue between at::Tensor and the torch-free safetensors layer (safetensors.h): dtype mapping,
// views of tensors for writing, reading tensors and row ranges into new tensors.
// Thread-safety: reentrant; see safetensors.h for File.
#pragma once

#include <ATen/core/Tensor.h>
#include <fsdp/safetensors.h>

#include <string>

namespace fsdp::safetensors {

// "F32" <-> at::kFloat, ... Throws naming `source`/`name` for dtypes ATen 1.13 has no type for.
std::string dtype_name(at::ScalarType t);
at::ScalarType scalar_type(const std::string& dtype, const std::string& source,
                           const std::string& name);

// A view of `t` for write(). REQUIRES: t is a contiguous CPU tensor that outlives the view.
TensorView view_of(const std::string& name, const at::Tensor& t);

// Tensor `name` of `f` as a new CPU tensor of its dtype and shape.
at::Tensor read_tensor(File& f, const std::string& name);
// Rows [row_begin, row_end) of tensor `name`: shape [row_end - row_begin, shape[1:]...]; a 0-d
// tensor counts as one row and gives shape [row_end - row_begin].
at::Tensor read_rows(File& f, const std::string& name, int64_t row_begin, int64_t row_end);

}  // namespace fsdp::safetensors
