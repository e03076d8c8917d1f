#include "sdpa_mask.h"

#include <ATen/Parallel.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <cstring>
#include <limits>

#include "sdpa_tile.h"

namespace attnx::cpu {
namespace {

// The bits of n bool bytes at stride sj (nonzero = true), 8 per byte.
void pack_bits(const uint8_t* m, int64_t sj, int64_t n, uint8_t* dst) {
  constexpr uint64_t kLow7 = 0x7f7f7f7f7f7f7f7full, kOnes = 0x0101010101010101ull;
  int64_t j = 0;
  if (sj == 1) {
    for (; j + 8 <= n; j += 8) {
      uint64_t w;
      std::memcpy(&w, m + j, sizeof(w));
      // Byte t becomes 1 where it is nonzero (a bool tensor may hold any byte: a uint8 tensor
      // viewed as bool; torch reads nonzero as true): its low 7 bits plus 0x7f, or the byte,
      // sets its top bit. The product then moves byte t's 1 to bit 56 + t, no two colliding.
      w = ((((w & kLow7) + kLow7) | w) >> 7) & kOnes;
      dst[j / 8] = static_cast<uint8_t>((w * 0x0102040810204080ull) >> 56);
    }
  }
  for (; j < n; j += 8) {
    uint8_t byte = 0;
    for (int64_t t = 0; t < 8 && j + t < n; ++t) byte |= uint8_t(m[(j + t) * sj] != 0) << t;
    dst[j / 8] = byte;
  }
}

template <typename M>
bool any_above_neg_inf(const M* m, int64_t sj, int64_t n) {
  for (int64_t j = 0; j < n; ++j) {
    if (!(static_cast<double>(m[j * sj]) == -std::numeric_limits<double>::infinity())) return true;
  }
  return false;
}

template <typename T, typename M>
void add_row(T* s, const M* m, int64_t sj, int64_t n, int64_t stride) {
  for (int64_t j = 0; j < n; ++j) s[j * stride] += static_cast<T>(m[j * sj]);
}

// The bits of keys [k, k + n) of a packed row, key k in bit 0 (n <= 24): only the bytes that
// hold them are read.
uint32_t bit_word(const uint8_t* bits, int64_t k, int64_t n) {
  uint32_t w = 0;
  for (int64_t byte = k >> 3, shift = 0; byte <= (k + n - 1) >> 3; ++byte, shift += 8)
    w |= static_cast<uint32_t>(bits[byte]) << shift;
  return (w >> (k & 7)) & ((uint32_t{1} << n) - 1);
}

}  // namespace

MaskRows::MaskRows(const std::optional<at::Tensor>& mask) {
  if (!mask.has_value()) return;
  const at::Tensor& m = *mask;
  present_ = true;
  dtype_ = m.scalar_type();
  if (dtype_ != at::kBool) {
    data_ = static_cast<const char*>(m.data_ptr());
    sb_ = m.stride(0), sh_ = m.stride(1), si_ = m.stride(2), sj_ = m.stride(3);
    esize_ = static_cast<int64_t>(m.element_size());
    return;
  }
  // One packed row per index the view does not broadcast (stride 0 means one row serves all).
  nb_ = m.stride(0) == 0 ? 1 : m.size(0);
  nh_ = m.stride(1) == 0 ? 1 : m.size(1);
  nq_ = m.stride(2) == 0 ? 1 : m.size(2);
  const int64_t lk = m.size(3), sj = m.stride(3);
  // One spare byte: mask_bits reads up to byte lk / 8 (2 or 3 bytes from a group's first key).
  row_bytes_ = (lk + 7) / 8 + 1;
  bits_ = at::zeros({nb_ * nh_ * nq_, row_bytes_}, m.options().dtype(at::kByte));
  const auto* src = static_cast<const uint8_t*>(m.data_ptr());  // bytes: see pack_bits
  uint8_t* dst = bits_.data_ptr<uint8_t>();
  bits_data_ = dst;
  const int64_t sb = m.stride(0), sh = m.stride(1), si = m.stride(2);
  at::parallel_for(0, nb_ * nh_ * nq_, 64, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const int64_t i = r % nq_, h = r / nq_ % nh_, b = r / nq_ / nh_;
      pack_bits(src + b * sb + h * sh + i * si, sj, lk, dst + r * row_bytes_);
    }
  });
}

template <typename T>
T MaskRows::apply(const Row& r, T* s, int64_t j0, int64_t n) const {
  if (dtype_ == at::kBool) {
    return mask_bits(s, r.bits, j0, n);
  }
  add_values(r, s, 1, j0, n);
  return row_max(s, n);
}

template <typename T>
void MaskRows::apply_strided(const Row& r, T* s, int64_t stride, int64_t j0, int64_t n) const {
  if (dtype_ == at::kBool) {
    // 16 keys at a time: most blocks admit every key (padding sits at one end), and the others
    // visit only their refused keys
    for (int64_t t0 = 0; t0 < n; t0 += 16) {
      const int64_t m = std::min<int64_t>(16, n - t0);
      for (uint32_t refused = ~bit_word(r.bits, j0 + t0, m) & ((uint32_t{1} << m) - 1);
           refused != 0; refused &= refused - 1) {
        s[(t0 + __builtin_ctz(refused)) * stride] = -std::numeric_limits<T>::infinity();
      }
    }
    return;
  }
  add_values(r, s, stride, j0, n);
}

template <typename T>
void MaskRows::add_values(const Row& r, T* s, int64_t stride, int64_t j0, int64_t n) const {
  const char* row = r.data + j0 * sj_ * esize_;
  switch (dtype_) {
    case at::kFloat: add_row(s, reinterpret_cast<const float*>(row), sj_, n, stride); break;
    case at::kDouble: add_row(s, reinterpret_cast<const double*>(row), sj_, n, stride); break;
    case at::kBFloat16:
      add_row(s, reinterpret_cast<const at::BFloat16*>(row), sj_, n, stride);
      break;
    case at::kHalf: add_row(s, reinterpret_cast<const at::Half*>(row), sj_, n, stride); break;
    default: TORCH_CHECK(false, "attnx::sdpa: unexpected mask dtype ", dtype_);
  }
}

bool MaskRows::admits_any(int64_t b, int64_t h, int64_t i, int64_t j0, int64_t j1) const {
  if (j1 <= j0) return false;
  if (!present_) return true;
  if (dtype_ == at::kBool) {
    const uint8_t* bits = bit_row(b, h, i);
    for (int64_t j = j0; j < j1; ++j) {
      if (mask_bit(bits, j)) return true;
    }
    return false;
  }
  const char* row = data_ + (b * sb_ + h * sh_ + i * si_ + j0 * sj_) * esize_;
  switch (dtype_) {
    case at::kFloat: return any_above_neg_inf(reinterpret_cast<const float*>(row), sj_, j1 - j0);
    case at::kDouble: return any_above_neg_inf(reinterpret_cast<const double*>(row), sj_, j1 - j0);
    case at::kBFloat16:
      return any_above_neg_inf(reinterpret_cast<const at::BFloat16*>(row), sj_, j1 - j0);
    case at::kHalf: return any_above_neg_inf(reinterpret_cast<const at::Half*>(row), sj_, j1 - j0);
    default: TORCH_CHECK(false, "attnx::sdpa: unexpected mask dtype ", dtype_);
  }
}

template float MaskRows::apply(const Row&, float*, int64_t, int64_t) const;
template double MaskRows::apply(const Row&, double*, int64_t, int64_t) const;
template void MaskRows::apply_strided(const Row&, float*, int64_t, int64_t, int64_t) const;
template void MaskRows::apply_strided(const Row&, double*, int64_t, int64_t, int64_t) const;

}  // namespace attnx::cpu
