#include "core/payload_digest.h"

#include <ATen/ATen.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <fsdp/error.h>

#include <algorithm>
#include <cmath>
#include <cstring>

#include "util/checksum.h"

namespace fsdp::detail {
namespace {

// splitmix64: 64 weights (one bit each) per block of 64 elements, from the seed and the block.
uint64_t mix(uint64_t z) {
  z += 0x9e3779b97f4a7c15ULL;
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
  return z ^ (z >> 31);
}

at::Tensor on_host(const at::Tensor& t) { return t.is_cpu() ? t : t.cpu(); }

template <class T>
double as_double(T x) {
  return static_cast<double>(static_cast<float>(x));
}
template <>
double as_double(double x) {
  return x;
}
template <>
double as_double(float x) {
  return x;
}

// The weights of eight elements as +-1.0, by the byte of bits that picks them (bit k: element k).
struct SignTable {
  double w[256][8];
  SignTable() {
    for (int byte = 0; byte < 256; ++byte)
      for (int k = 0; k < 8; ++k) w[byte][k] = (byte >> k) & 1 ? -1.0 : 1.0;
  }
};

// A full block of 64: eight partial sums per quantity (element j into lane j % 8), added in a
// fixed order at the end, the weights looked up eight at a time, so that the loop vectorises
// without reassociating anything (one chain of 64 dependent additions per quantity, and a
// conversion per weight, ran at their latency).
template <class T>
void sketch_block(const T* v, uint64_t w, double& s, double& a, double& q) {
  static const SignTable signs;
  double sl[8] = {}, al[8] = {}, ql[8] = {};
  for (int j = 0; j < 64; j += 8) {
    const double* sign = signs.w[(w >> j) & 0xff];
    for (int k = 0; k < 8; ++k) {
      const double d = as_double(v[j + k]);
      sl[k] += sign[k] * d;
      al[k] += std::fabs(d);
      ql[k] += d * d;
    }
  }
  for (int k = 0; k < 8; ++k) {
    s += sl[k];
    a += al[k];
    q += ql[k];
  }
}

// Elements [lo, hi) of x, in blocks of 64 aligned on the elements' indexes (the weights of block
// b are the bits of mix(seed ^ b)).
template <class T>
Sketch sketch_typed(const T* x, int64_t lo, int64_t hi, uint64_t seed) {
  Sketch out;
  for (int64_t b = lo / 64; b * 64 < hi; ++b) {
    const uint64_t w = mix(seed ^ static_cast<uint64_t>(b));
    const int64_t from = std::max(lo, b * 64), to = std::min(hi, b * 64 + 64);
    double s = 0, a = 0, q = 0;
    if (to - from == 64) {
      sketch_block(x + from, w, s, a, q);
    } else {
      for (int64_t i = from; i < to; ++i) {
        const double d = as_double(x[i]);
        s += (1.0 - 2.0 * static_cast<double>((w >> (i & 63)) & 1)) * d;
        a += std::fabs(d);
        q += d * d;
      }
    }
    out.signed_sum += s;
    out.abs_sum += a;
    out.square_sum += q;
  }
  return out;
}

}  // namespace

Part rotating_part(int64_t units, int64_t step, int64_t group, int period) {
  if (period <= 1 || units <= 0) return Part{0, std::max<int64_t>(units, 0)};
  const int64_t k = ((step + group) % period + period) % period;
  return Part{units * k / period, units * (k + 1) / period};
}

uint64_t digest_bytes(const std::vector<at::Tensor>& pieces, Part bytes) {
  StreamingChecksum h;
  int64_t at = 0;  // byte offset of the piece in the concatenation
  for (const auto& piece : pieces) {
    const int64_t n = static_cast<int64_t>(piece.nbytes());
    const int64_t from = std::max(bytes.lo, at), to = std::min(bytes.hi, at + n);
    if (from < to) {
      const at::Tensor p = on_host(piece);
      h.update(static_cast<const char*>(p.data_ptr()) + (from - at),
               static_cast<size_t>(to - from));
    }
    at += n;
    if (at >= bytes.hi) break;
  }
  return h.digest();
}

uint64_t digest_bytes(const at::Tensor& t, Part bytes) {
  return digest_bytes(std::vector<at::Tensor>{t}, bytes);
}

Sketch sketch_values(const at::Tensor& t, Part elements, uint64_t seed) {
  FSDP_CHECK(t.dim() == 1 && t.is_contiguous(),
             "internal: a sketch needs a flat contiguous tensor");
  const int64_t lo = std::max<int64_t>(elements.lo, 0), hi = std::min(elements.hi, t.numel());
  if (lo >= hi) return Sketch{};
  const at::Tensor x = on_host(t);
  switch (x.scalar_type()) {
    case at::kFloat:
      return sketch_typed(x.data_ptr<float>(), lo, hi, seed);
    case at::kDouble:
      return sketch_typed(x.data_ptr<double>(), lo, hi, seed);
    case at::kBFloat16:
      return sketch_typed(x.data_ptr<at::BFloat16>(), lo, hi, seed);
    case at::kHalf:
      return sketch_typed(x.data_ptr<at::Half>(), lo, hi, seed);
    default:
      throw Error(cat("internal: verified collectives cannot sketch a reduction of ",
                      x.scalar_type(), " (float, double, bfloat16 and half only)"));
  }
}

double fp64_gamma(int64_t k) {
  const double ku = static_cast<double>(k) * 0x1p-53;
  return ku / (1 - ku);
}

}  // namespace fsdp::detail
