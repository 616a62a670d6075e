// at::Tensor <-> safetensors glue (ATen only).
#include <ATen/ATen.h>
#include <fsdp/error.h>
#include <fsdp/safetensors_torch.h>

namespace fsdp::safetensors {

using detail::cat;

std::string dtype_name(at::ScalarType t) {
  switch (t) {
    case at::kBool:
      return "BOOL";
    case at::kByte:
      return "U8";
    case at::kChar:
      return "I8";
    case at::kShort:
      return "I16";
    case at::kHalf:
      return "F16";
    case at::kBFloat16:
      return "BF16";
    case at::kInt:
      return "I32";
    case at::kFloat:
      return "F32";
    case at::kDouble:
      return "F64";
    case at::kLong:
      return "I64";
    default:
      throw Error(cat("safetensors: tensors of dtype ", t,
                      " cannot be stored; supported are bool, uint8, int8/16/32/64, half, "
                      "bfloat16, float, double"));
  }
}

at::ScalarType scalar_type(const std::string& dtype, const std::string& source,
                           const std::string& name) {
  static const std::pair<const char*, at::ScalarType> kTypes[] = {
      {"BOOL", at::kBool},  {"U8", at::kByte},       {"I8", at::kChar}, {"I16", at::kShort},
      {"F16", at::kHalf},   {"BF16", at::kBFloat16}, {"I32", at::kInt}, {"F32", at::kFloat},
      {"F64", at::kDouble}, {"I64", at::kLong}};
  for (const auto& [n, t] : kTypes) {
    if (dtype == n) return t;
  }
  throw Error(cat("safetensors file '", source, "': tensor '", name, "': dtype ", dtype,
                  " has no LibTorch type here; convert the file to F32/F16/BF16/I64"));
}

TensorView view_of(const std::string& name, const at::Tensor& t) {
  FSDP_CHECK(t.defined() && t.device().is_cpu() && t.is_contiguous(), "safetensors: tensor '", name,
             "' must be a defined contiguous CPU tensor to be written; pass .contiguous().cpu()");
  TensorView v;
  v.name = name;
  v.dtype = dtype_name(t.scalar_type());
  v.shape = t.sizes().vec();
  v.data = t.data_ptr();
  v.bytes = static_cast<uint64_t>(t.numel()) * t.element_size();
  return v;
}

at::Tensor read_rows(File& f, const std::string& name, int64_t row_begin, int64_t row_end) {
  const TensorMeta& m = f.tensor(name);
  auto type = scalar_type(m.dtype, f.path(), name);
  std::vector<int64_t> shape = m.shape;
  if (shape.empty()) {
    shape = {0};
  }
  if (row_begin < 0 || row_end < row_begin || row_end > m.rows()) {
    // read_rows below raises the message naming file and tensor.
    f.read_rows(name, row_begin, row_end, nullptr, 0);
  }
  shape[0] = row_end - row_begin;
  at::Tensor out = at::empty(shape, at::TensorOptions().dtype(type));
  f.read_rows(name, row_begin, row_end, out.data_ptr(),
              static_cast<uint64_t>(out.numel()) * out.element_size());
  return out;
}

at::Tensor read_tensor(File& f, const std::string& name) {
  const TensorMeta& m = f.tensor(name);
  at::Tensor rows = read_rows(f, name, 0, m.rows());
  return rows.reshape(m.shape);
}

}  // namespace fsdp::safetensors
