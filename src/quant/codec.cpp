#include "quant/codec.h"

#include <ATen/ATen.h>
#include <fsdp/error.h>

#include <algorithm>
#include <cmath>
#include <cstring>

namespace fsdp::quant {

void check_block(int block) {
  FSDP_CHECK(block >= 64 && block <= 256, "quantized collectives: int8 blocks of ", block,
             " values; use 64 to 256 (one fp32 scale per block: 128 costs 3% over the int8 bytes)");
}

int64_t encoded_bytes(int64_t n, Quantization q, at::ScalarType dtype, int block) {
  switch (q) {
    case Quantization::kBf16:
      return 2 * n;
    case Quantization::kInt8:
      return 4 * ((n + block - 1) / block) + n;
    default:
      return n * static_cast<int64_t>(c10::elementSize(dtype));
  }
}

namespace {
void encode_int8(const float* x, int64_t n, int block, uint8_t* out) {
  const int64_t blocks = (n + block - 1) / block;
  uint8_t* values = out + 4 * blocks;
  for (int64_t b = 0; b < blocks; ++b) {
    const int64_t from = b * block, to = std::min(n, from + block);
    float absmax = 0;
    bool nan = false;
    for (int64_t i = from; i < to; ++i) {
      absmax = std::max(absmax, std::fabs(x[i]));
      nan |= std::isnan(x[i]);
    }
    if (nan) absmax = NAN;
    const float scale = absmax / 127.0f;
    std::memcpy(out + 4 * b, &scale, 4);
    // A block of zeros (or of non-finite values, whose scale carries them) sends zeros.
    const float inv = scale > 0 && std::isfinite(scale) ? 127.0f / absmax : 0.0f;
    for (int64_t i = from; i < to; ++i) {
      const float v = std::clamp(x[i] * inv, -127.0f, 127.0f);
      const auto k = static_cast<int8_t>(v >= 0 ? v + 0.5f : v - 0.5f);  // nearest, ties away
      std::memcpy(values + i, &k, 1);
    }
  }
}

void decode_int8(const uint8_t* in, int64_t n, int block, float* out) {
  const int64_t blocks = (n + block - 1) / block;
  const uint8_t* values = in + 4 * blocks;
  for (int64_t b = 0; b < blocks; ++b) {
    float scale;
    std::memcpy(&scale, in + 4 * b, 4);
    const int64_t from = b * block, to = std::min(n, from + block);
    for (int64_t i = from; i < to; ++i) {
      int8_t k;
      std::memcpy(&k, values + i, 1);
      // 0 * NaN is NaN: a block that was not finite stays visibly so.
      out[i] = static_cast<float>(k) * scale;
    }
  }
}
}  // namespace

void encode(const at::Tensor& x, uint8_t* out, Quantization q, int block) {
  const int64_t n = x.numel();
  if (n == 0) return;
  if (q == Quantization::kBf16) {
    const at::Tensor h = x.to(at::kBFloat16).contiguous();
    std::memcpy(out, h.data_ptr(), 2 * n);
  } else if (q == Quantization::kInt8) {
    const at::Tensor f = x.to(at::kFloat).contiguous();
    encode_int8(f.data_ptr<float>(), n, block, out);
  } else {
    const at::Tensor c = x.contiguous();
    std::memcpy(out, c.data_ptr(), c.nbytes());
  }
}

void decode(const uint8_t* in, int64_t n, Quantization q, at::ScalarType dtype, int block,
            float* out) {
  if (n == 0) return;
  if (q == Quantization::kBf16) {
    for (int64_t i = 0; i < n; ++i) {
      uint16_t h;
      std::memcpy(&h, in + 2 * i, 2);
      const uint32_t bits = static_cast<uint32_t>(h) << 16;
      std::memcpy(out + i, &bits, 4);
    }
  } else if (q == Quantization::kInt8) {
    decode_int8(in, n, block, out);
  } else {
    const at::Tensor raw =
        at::from_blob(const_cast<uint8_t*>(in), {n * static_cast<int64_t>(c10::elementSize(dtype))},
                      at::kByte)
            .view(dtype);
    at::from_blob(out, {n}, at::kFloat).copy_(raw);
  }
}

}  // namespace fsdp::quant
