// nvcuda::wmma for the host harness: the 16x16x16 fragments the kernels use, with the
// semantics of the CUDA C++ Programming Guide (warp matrix functions). The guide leaves the
// mapping of a tile's elements to lanes opaque; here lane l holds elements 8l..8l+7 of the tile
// in row-major order. Every call is a warp collective (load, store and mma wait until all lanes
// of the warp have arrived, with the same pointer and stride); products are exact in fp32 and
// accumulated in fp32, as on the tensor cores (which do not fix the order of the additions).
#pragma once

#include <cstdint>

namespace nvcuda {
namespace wmma {

struct matrix_a {};
struct matrix_b {};
struct accumulator {};
struct row_major {};
struct col_major {};
enum layout_t { mem_row_major, mem_col_major };

template <typename Use, int M, int N, int K, typename T, typename Layout = void>
struct fragment {
  static_assert(M == 16 && N == 16 && K == 16, "the harness emulates the m16n16k16 shape");
  static constexpr int num_elements = 8;
  T x[num_elements];
};

namespace detail {

inline float as_float(float x) { return x; }
inline float as_float(__half x) { return __half2float(x); }
inline float as_float(__nv_bfloat16 x) { return __bfloat162float(x); }

// The (row, col) of element e of lane `lane`.
inline int row_of(int lane, int e) { return (lane * 8 + e) / 16; }
inline int col_of(int lane, int e) { return (lane * 8 + e) % 16; }

inline uintptr_t key(const void* ptr, unsigned ldm) {
  return reinterpret_cast<uintptr_t>(ptr) * 31u + ldm;
}

// Element (r, c) of a tile at `ptr` with stride `ldm`, row- or column-major in memory.
inline int64_t offset(int r, int c, unsigned ldm, bool row_major) {
  return row_major ? int64_t(r) * ldm + c : int64_t(c) * ldm + r;
}

template <typename F, typename T>
void load(F& f, const T* ptr, unsigned ldm, bool row_major) {
  ::attnx::host::warp_collective("wmma::load_matrix_sync", key(ptr, ldm), nullptr,
                                 [](void* const*) {});
  const int lane = ::attnx::host::place().lane;
  for (int e = 0; e < 8; ++e) f.x[e] = ptr[offset(row_of(lane, e), col_of(lane, e), ldm, row_major)];
}

}  // namespace detail

template <typename Use, typename T, typename Layout>
void fill_fragment(fragment<Use, 16, 16, 16, T, Layout>& f, const T& value) {
  for (T& x : f.x) x = value;
}

template <typename Use, typename T, typename Layout>
void load_matrix_sync(fragment<Use, 16, 16, 16, T, Layout>& f, const T* ptr, unsigned ldm) {
  detail::load(f, ptr, ldm, std::is_same<Layout, row_major>::value);
}

inline void load_matrix_sync(fragment<accumulator, 16, 16, 16, float>& f, const float* ptr,
                             unsigned ldm, layout_t layout) {
  detail::load(f, ptr, ldm, layout == mem_row_major);
}

inline void store_matrix_sync(float* ptr, const fragment<accumulator, 16, 16, 16, float>& f,
                              unsigned ldm, layout_t layout) {
  ::attnx::host::warp_collective("wmma::store_matrix_sync", detail::key(ptr, ldm), nullptr,
                                 [](void* const*) {});
  const int lane = ::attnx::host::place().lane;
  for (int e = 0; e < 8; ++e)
    ptr[detail::offset(detail::row_of(lane, e), detail::col_of(lane, e), ldm,
                       layout == mem_row_major)] = f.x[e];
}

// d = a b + c over the whole warp: the last lane to arrive gathers every lane's elements.
template <typename T, typename LA, typename LB>
void mma_sync(fragment<accumulator, 16, 16, 16, float>& d,
              const fragment<matrix_a, 16, 16, 16, T, LA>& a,
              const fragment<matrix_b, 16, 16, 16, T, LB>& b,
              const fragment<accumulator, 16, 16, 16, float>& c) {
  using Acc = fragment<accumulator, 16, 16, 16, float>;
  struct Slot {
    const fragment<matrix_a, 16, 16, 16, T, LA>* a;
    const fragment<matrix_b, 16, 16, 16, T, LB>* b;
    const Acc* c;
    Acc* d;
  } slot{&a, &b, &c, &d};
  ::attnx::host::warp_collective("wmma::mma_sync", 0, &slot, [](void* const* slots) {
    float A[16][16], B[16][16], C[16][16];
    for (int l = 0; l < 32; ++l) {
      const Slot& s = *static_cast<const Slot*>(slots[l]);
      for (int e = 0; e < 8; ++e) {
        const int r = detail::row_of(l, e), col = detail::col_of(l, e);
        A[r][col] = detail::as_float(s.a->x[e]);
        B[r][col] = detail::as_float(s.b->x[e]);
        C[r][col] = s.c->x[e];
      }
    }
    for (int l = 0; l < 32; ++l) {
      Acc& out = *static_cast<const Slot*>(slots[l])->d;
      for (int e = 0; e < 8; ++e) {
        const int r = detail::row_of(l, e), col = detail::col_of(l, e);
        float acc = C[r][col];
        for (int k = 0; k < 16; ++k) acc += A[r][k] * B[k][col];
        out.x[e] = acc;
      }
    }
  });
}

}  // namespace wmma
}  // namespace nvcuda
