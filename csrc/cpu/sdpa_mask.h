// The attention mask as the SDPA kernels read it, row by row.
//
// A float mask is read in place through the strides of its (B, Hq, Lq, Lk) broadcast view. A
// bool mask is packed once per call to one bit per key, one row per distinct (b, h, i) of that
// view: a broadcast mask stays the size of what the caller passed, and a (Lq, Lk) mask read
// again for every head and both passes costs 1/8 of the memory traffic of its bytes.
#pragma once
#include <ATen/ATen.h>

#include <cstdint>
#include <optional>

namespace attnx::cpu {

class MaskRows {
 public:
  explicit MaskRows(const std::optional<at::Tensor>& mask);
  bool present() const { return present_; }

  // Row (b, h, i) located once, for a kernel that applies it to many short blocks of keys (the
  // decoding kernel's 16).
  struct Row {
    const uint8_t* bits;  // bool masks: the packed row
    const char* data;     // float masks: key 0 of the row
  };
  Row row(int64_t b, int64_t h, int64_t i) const {
    if (dtype_ == at::kBool) return {bit_row(b, h, i), nullptr};
    return {nullptr, data_ + (b * sb_ + h * sh_ + i * si_) * esize_};
  }

  // Scores s of keys j0 .. j0 + n - 1 of a row: keys a bool mask refuses become -inf, a float
  // mask is added. Returns the max of the row after.
  template <typename T>
  T apply(const Row& row, T* s, int64_t j0, int64_t n) const;
  template <typename T>
  T apply(T* s, int64_t b, int64_t h, int64_t i, int64_t j0, int64_t n) const {
    return apply(row(b, h, i), s, j0, n);
  }

  // The same on scores `stride` apart (a column of the decoding kernel's lane tile, whose rows
  // are keys), without the max.
  template <typename T>
  void apply_strided(const Row& row, T* s, int64_t stride, int64_t j0, int64_t n) const;

  // Whether row (b, h, i) may attend some key of [j0, j1): a true bit, or a float value other
  // than -inf. Without a mask, whether the range is non-empty.
  bool admits_any(int64_t b, int64_t h, int64_t i, int64_t j0, int64_t j1) const;

 private:
  // A float mask's values of keys j0 .. j0 + n - 1 of a row added to scores `stride` apart.
  template <typename T>
  void add_values(const Row& r, T* s, int64_t stride, int64_t j0, int64_t n) const;

  const uint8_t* bit_row(int64_t b, int64_t h, int64_t i) const {
    return bits_data_ + (((b % nb_) * nh_ + h % nh_) * nq_ + i % nq_) * row_bytes_;
  }

  bool present_ = false;
  at::ScalarType dtype_ = at::kBool;
  // float masks: the view itself
  const char* data_ = nullptr;
  int64_t sb_ = 0, sh_ = 0, si_ = 0, sj_ = 0, esize_ = 1;
  // bool masks: bit j % 8 of byte j / 8 of a packed row is key j; rows_ (nb, nh, nq)
  at::Tensor bits_;
  const uint8_t* bits_data_ = nullptr;
  int64_t nb_ = 1, nh_ = 1, nq_ = 1, row_bytes_ = 0;
};

}  // namespace attnx::cpu
