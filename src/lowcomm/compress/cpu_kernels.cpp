// lowcomm's CPU kernels, registered as torch.ops.lowcomm.* (built by lowcomm/compress/cpu_kernels.py).
//
// block_topk: the k largest-magnitude entries of every block of a matrix, blocks in place
// (lowcomm.compress.dct.BlockLayout), in one pass over memory and one selection per block.
// torch's operators need several passes over the whole matrix for the same result (amax, amin,
// two topk, gathers: lowcomm/compress/block_topk.py); this reads each block row once, along
// memory, while it sits in cache.
//
// Per block row (chunk_rows rows, every block along it), per thread:
//   1. the largest magnitude of each group of `group` rows of one column (a vector max down the
//      rows, along memory);
//   2. per block, a lower bound of its k-th largest group maximum, the least of k bins' maxima
//      (each bin holds one at least that large), then that k-th largest maximum m exactly,
//      by nth_element over the maxima not below the bound;
//   3. the entries not below m of the groups whose maximum is not below m: they include the
//      block's k largest (m is at most the k-th largest entry: the k groups above it hold k
//      distinct entries at least m), and at least k of them (usually a few dozen; all of a
//      block's entries where they tie, as in a block of zeros), gathered without a branch on
//      the data;
//   4. the k first by (magnitude descending, index ascending): up to 128 candidates by counting
//      each one's rank against the others, beyond that by nth_element; marked in a bitmap of the
//      block and read back in ascending block-local index.
// A magnitude is ranked by the bits of |x| read as an unsigned integer (float for float, bf16
// and half, which convert to it exactly; double for double): for non-negative numbers that is
// their order, with +inf above every finite value and NaN above +inf, as torch.topk ranks them,
// and with no NaN comparison anywhere. Ties at the k-th place go to the lower index: the result
// is a function of the matrix alone.
//
// dct_blocks: the orthonormal 2-D DCT-II (or its inverse) of every chunk_rows x chunk_cols block
// of a matrix, blocks in place (lowcomm.compress.dct.block_transform with DCT bases), written as
// out = beta * out + alpha * T(matrix). A block row is taken a tile of up to 512 columns at a
// time: read once from memory, transformed in cache, written once. Down the rows of a block (the
// left basis, C_R B) the transform is the even/odd split of the DCT-II,
//     X[2m]   = 2^-1/2 DCT_{N/2}(x[i] + x[N-1-i])[m]
//     X[2m+1] = sum_{i<N/2} C_N[2m+1][i] (x[i] - x[N-1-i]),
// recursively on the even half while it is even and above 8 (then a dense product), every step
// acting on whole tile rows (vectors along memory): for N = 64, 1,365 multiply-adds per column
// instead of 4,096. Along the rows of a block (the right basis, B C_C^T) it is split once, into
// two half-size products. Each step is exact in exact arithmetic; the rounding differs from the
// dense products' by a few float ulps. The inverse runs the transposed steps in the reverse
// order; a block of at most 1.5 x 64 nonzero coefficients (an aggregate of up to three senders'
// top-32) is inverted as one product over them, X = sum_j v_j L[r_j]^T R[c_j]: the choice is made
// per block, from its own coefficients, so a block's result never depends on its neighbours'.
//
// dct_blocks_topk: dct_blocks into one target and block_topk of the new target, each tile
// selected while it is in cache, and what was selected optionally subtracted from it there (DeMo's
// encode). dct_gathered_update: DeMo's decode, the inverse of
// W workers' gathered payloads (the mean over the senders of each coefficient, gathered per tile
// in cache) added, or its sign added, to the parameters.

#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <limits>
#include <map>
#include <memory>
#include <mutex>
#include <tuple>
#include <type_traits>
#include <vector>

namespace {

// The ranking key of a magnitude (see the top): |x|'s bits as an unsigned integer of x's width
// (float's for the types narrower than it).
template <typename T>
using Key = std::conditional_t<std::is_same_v<T, double>, uint64_t, uint32_t>;

template <typename T>
inline Key<T> magnitude(T value) {
  using Real = std::conditional_t<std::is_same_v<T, double>, double, float>;
  const Real real = static_cast<Real>(value);
  Key<T> bits;
  std::memcpy(&bits, &real, sizeof(bits));
  return bits & (std::numeric_limits<Key<T>>::max() >> 1);  // the sign bit cleared
}

struct Geometry {
  int64_t cols, chunk_rows, chunk_cols, k, group;
};

template <typename K>
struct Candidate {
  K magnitude;
  int32_t index;  // block-local, row-major
};

template <typename K>
inline bool ranks_before(const Candidate<K>& a, const Candidate<K>& b) {
  return a.magnitude > b.magnitude || (a.magnitude == b.magnitude && a.index < b.index);
}

// Up to this many candidates a block's top k are found by counting ranks (see select_blocks).
constexpr int64_t kCountedCandidates = 128;

// select_blocks' work space, reused by one thread over the blocks of one call.
template <typename T>
struct Selection {
  std::vector<Key<T>> maxima, ranked, keys;
  std::vector<int32_t> groups, columns, locals;
  std::vector<Candidate<Key<T>>> candidates;
  std::vector<uint64_t> bitmap;  // one bit per entry of a block, all zero between blocks
};

// The blocks [bc_first, bc_last) of block row `block_row` of a rows x cols matrix (g.cols wide):
// each one's k entries into index, positions (in that matrix) and values at (block_row *
// blocks_cols + bc) * k. The entries are read from `span`: the block row's columns from block
// bc_first on, rows `ld` apart (the matrix itself, or a copy of those blocks in cache).
template <typename T>
void select_blocks(const T* span, int64_t ld, const Geometry& g, int64_t block_row, int64_t bc_first, int64_t bc_last,
                   int64_t* index, int64_t* positions, T* values, Selection<T>& s) {
  using K = Key<T>;
  const int64_t bands = g.chunk_rows / g.group;  // groups per column of a block
  const int64_t blocks_cols = g.cols / g.chunk_cols;
  const int64_t groups = bands * g.chunk_cols;  // per block
  const int64_t per_bin = groups / g.k;
  const int64_t width = (bc_last - bc_first) * g.chunk_cols;
  s.maxima.resize(bands * width);
  s.ranked.resize(groups);
  s.groups.resize(groups);
  s.columns.resize(groups);
  s.keys.resize(g.chunk_rows * g.chunk_cols);
  s.locals.resize(g.chunk_rows * g.chunk_cols);
  s.bitmap.resize((g.chunk_rows * g.chunk_cols + 63) / 64);
  K* maxima = s.maxima.data();
  K* ranked = s.ranked.data();

  const int64_t top = block_row * g.chunk_rows * g.cols;
  // 1. group maxima, band by band, down the rows: 16 columns at a time, their maxima held in a
  // register down the group's rows (not stored and reloaded once per row)
  constexpr int64_t kColumns = 16;
  for (int64_t band = 0; band < bands; ++band) {
    K* out = maxima + band * width;
    const T* rows = span + band * g.group * ld;
    int64_t c = 0;
    for (; c + kColumns <= width; c += kColumns) {
      K m[kColumns];
      for (int64_t j = 0; j < kColumns; ++j) m[j] = magnitude(rows[c + j]);
      for (int64_t t = 1; t < g.group; ++t) {
        const T* row = rows + t * ld + c;
        for (int64_t j = 0; j < kColumns; ++j) m[j] = std::max(m[j], magnitude(row[j]));
      }
      std::copy_n(m, kColumns, out + c);
    }
    for (; c < width; ++c) {
      K m = magnitude(rows[c]);
      for (int64_t t = 1; t < g.group; ++t) m = std::max(m, magnitude(rows[t * ld + c]));
      out[c] = m;
    }
  }
  for (int64_t bc = bc_first; bc < bc_last; ++bc) {
    const int64_t origin = top + bc * g.chunk_cols;       // in the matrix
    const T* block = span + (bc - bc_first) * g.chunk_cols;  // where it is read
    for (int64_t band = 0; band < bands; ++band)
      std::copy_n(maxima + band * width + (bc - bc_first) * g.chunk_cols, g.chunk_cols, ranked + band * g.chunk_cols);
    // 2. the k-th largest group maximum: a lower bound first, then exactly above it
    K bound = std::numeric_limits<K>::max();
    for (int64_t bin = 0; bin < g.k; ++bin) {
      const K* begin = ranked + bin * per_bin;
      bound = std::min(bound, *std::max_element(begin, begin + per_bin));
    }
    int64_t kept = 0;
    for (int64_t j = 0; j < groups; ++j) {
      ranked[kept] = ranked[j];
      kept += ranked[j] >= bound;
    }
    std::nth_element(ranked, ranked + (g.k - 1), ranked + kept, std::greater<K>());
    const K threshold = ranked[g.k - 1];
    // 3. the candidates: entries not below it, in groups whose maximum is not below it (both
    // gathered without a branch on the data: the compactions below write every entry and
    // advance over the kept ones)
    int64_t chosen = 0;
    for (int64_t band = 0; band < bands; ++band) {
      const K* band_maxima = maxima + band * width + (bc - bc_first) * g.chunk_cols;
      for (int64_t c = 0; c < g.chunk_cols; ++c) {
        s.groups[chosen] = static_cast<int32_t>(band * g.group);  // its first row
        s.columns[chosen] = static_cast<int32_t>(c);
        chosen += band_maxima[c] >= threshold;
      }
    }
    int64_t n = 0;
    for (int64_t j = 0; j < chosen; ++j) {
      const int64_t first = s.groups[j], c = s.columns[j];
      const T* entry = block + first * ld + c;
      for (int64_t t = 0; t < g.group; ++t) {
        const K m = magnitude(entry[t * ld]);
        s.keys[n] = m;
        s.locals[n] = static_cast<int32_t>((first + t) * g.chunk_cols + c);
        n += m >= threshold;
      }
    }
    // 4. the k first by (magnitude descending, index ascending), marked in a bitmap of the block
    // and read back in index order. Usually the candidates are a few dozen, and a candidate's
    // rank is counted against all the others (compares, not branches); where magnitudes tie at
    // the threshold (a block of zeros: every entry is a candidate) or k is large, that would
    // cost n^2, so an nth_element by the same order picks them instead.
    if (n <= kCountedCandidates) {
      for (int64_t i = 0; i < n; ++i) {
        const K key = s.keys[i];
        const int32_t local = s.locals[i];
        int64_t rank = 0;
        for (int64_t j = 0; j < n; ++j)
          rank += (s.keys[j] > key) | ((s.keys[j] == key) & (s.locals[j] < local));
        s.bitmap[local >> 6] |= static_cast<uint64_t>(rank < g.k) << (local & 63);
      }
    } else {
      s.candidates.resize(n);
      for (int64_t i = 0; i < n; ++i) s.candidates[i] = {s.keys[i], s.locals[i]};
      std::nth_element(s.candidates.begin(), s.candidates.begin() + (g.k - 1), s.candidates.end(),
                       ranks_before<K>);
      for (int64_t i = 0; i < g.k; ++i) {
        const int32_t local = s.candidates[i].index;
        s.bitmap[local >> 6] |= uint64_t{1} << (local & 63);
      }
    }
    int64_t out = (block_row * blocks_cols + bc) * g.k;
    for (size_t word = 0; word < s.bitmap.size(); ++word) {
      for (uint64_t bits = s.bitmap[word]; bits; bits &= bits - 1) {
        const int64_t local = static_cast<int64_t>(word * 64) + __builtin_ctzll(bits);
        const int64_t r = local / g.chunk_cols, c = local % g.chunk_cols;
        index[out] = local;
        positions[out] = origin + r * g.cols + c;
        values[out++] = block[r * ld + c];
      }
      s.bitmap[word] = 0;
    }
  }
}

// The checks of a top-k of every chunk_rows x chunk_cols block of a rows x cols matrix.
void check_selection(const char* op, int64_t rows, int64_t cols, int64_t chunk_rows, int64_t chunk_cols, int64_t k,
                     int64_t group) {
  TORCH_CHECK(chunk_rows >= 1 && chunk_cols >= 1 && rows % chunk_rows == 0 && cols % chunk_cols == 0, op,
              ": blocks of ", chunk_rows, " x ", chunk_cols, " do not tile ", rows, " x ", cols);
  TORCH_CHECK(group >= 1 && chunk_rows % group == 0, op, ": group ", group, " does not divide the block height ",
              chunk_rows);
  TORCH_CHECK(chunk_rows * chunk_cols <= std::numeric_limits<int32_t>::max(), op, ": blocks of ", chunk_rows, " x ",
              chunk_cols, " have more entries than a 32-bit block-local index holds");
  TORCH_CHECK(k >= 1 && k <= (chunk_rows / group) * chunk_cols, op, ": k = ", k, " needs at least k groups of ", group,
              " rows per block, there are ", (chunk_rows / group) * chunk_cols);
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> block_topk(const at::Tensor& matrix, int64_t chunk_rows,
                                                          int64_t chunk_cols, int64_t k, int64_t group) {
  TORCH_CHECK(matrix.device().is_cpu(), "lowcomm::block_topk: a CPU tensor, got one on ", matrix.device());
  TORCH_CHECK(matrix.dim() == 2 && matrix.is_contiguous(), "lowcomm::block_topk: a contiguous rows x cols matrix");
  const int64_t rows = matrix.size(0), cols = matrix.size(1);
  check_selection("lowcomm::block_topk", rows, cols, chunk_rows, chunk_cols, k, group);
  const int64_t blocks = (rows / chunk_rows) * (cols / chunk_cols);
  auto index = at::empty({blocks, k}, matrix.options().dtype(at::kLong));
  auto positions = at::empty({blocks, k}, matrix.options().dtype(at::kLong));
  auto values = at::empty({blocks, k}, matrix.options());
  const Geometry geometry{cols, chunk_rows, chunk_cols, k, group};
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, matrix.scalar_type(), "lowcomm::block_topk", [&] {
    const scalar_t* data = matrix.const_data_ptr<scalar_t>();
    int64_t* index_out = index.mutable_data_ptr<int64_t>();
    int64_t* positions_out = positions.mutable_data_ptr<int64_t>();
    scalar_t* values_out = values.mutable_data_ptr<scalar_t>();
    at::parallel_for(0, rows / chunk_rows, 1, [&](int64_t first, int64_t last) {
      Selection<scalar_t> selection;
      for (int64_t block_row = first; block_row < last; ++block_row)
        select_blocks<scalar_t>(data + block_row * chunk_rows * cols, cols, geometry, block_row, 0, cols / chunk_cols,
                                index_out, positions_out, values_out,
                                selection);
    });
  });
  return {index, positions, values};
}

// ------------------------------------------------------------------------------ dct_blocks

// A vector of 64 bytes (16 floats, 8 doubles): one AVX-512 register, two AVX2 ones or four NEON
// ones, as the compiler finds. Written with the compiler's vector types because its own
// vectorisation of these loops kept the sums in memory and ran at half the speed. (A vector
// attribute on an alias template of a dependent type is dropped by GCC: one typedef per type.)
typedef float FloatVec __attribute__((vector_size(64)));
typedef double DoubleVec __attribute__((vector_size(64)));
template <typename T>
struct VecOf;
template <>
struct VecOf<float> {
  using type = FloatVec;
};
template <>
struct VecOf<double> {
  using type = DoubleVec;
};
template <typename T>
using Vec = typename VecOf<T>::type;
template <typename T>
constexpr int64_t kLanes = 64 / sizeof(T);
static_assert(sizeof(FloatVec) == 64 && sizeof(DoubleVec) == 64, "64-byte vectors");

template <typename T>
inline Vec<T> load(const T* p) {
  Vec<T> v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}

template <typename T>
inline void store(T* p, const Vec<T>& v) {
  std::memcpy(p, &v, sizeof(v));
}

// The orthonormal DCT-II matrix of size n in double: C[k][i] = s_k cos(pi (2i + 1) k / (2n)),
// s_0 = sqrt(1/n), s_k = sqrt(2/n) (lowcomm.compress.dct.dct_basis).
std::vector<double> dct_matrix(int64_t n) {
  std::vector<double> c(n * n);
  for (int64_t k = 0; k < n; ++k)
    for (int64_t i = 0; i < n; ++i)
      c[k * n + i] = std::cos(M_PI * (2 * i + 1) * k / (2.0 * n)) * std::sqrt((k == 0 ? 1.0 : 2.0) / n);
  return c;
}

template <typename T>
void fill(const std::vector<double>& c, int64_t n, double scale, std::vector<T>& matrix, std::vector<T>& transposed) {
  matrix.resize(n * n);
  transposed.resize(n * n);
  for (int64_t k = 0; k < n; ++k)
    for (int64_t i = 0; i < n; ++i) matrix[k * n + i] = transposed[i * n + k] = static_cast<T>(scale * c[k * n + i]);
}

constexpr int64_t kDenseUpTo = 8;  // the recursion stops at an odd size or one of at most 8

// The DCT-II down the rows of a block, by the even/odd recursion (see the top). Level l halves
// n_l = size / 2^l: its odd part is the half x half matrix C_{n_l}[2m+1][i] times 2^-l/2 (the
// even parts' factors above it); what is left at the end is the dense DCT-II of size `base`
// times 2^-levels/2. The transposes serve the inverse; the whole matrix the sparse inverse.
template <typename T>
struct DownPlan {
  int64_t size = 0, base = 0;
  std::vector<int64_t> half, odd_start;  // odd_start: where each level's odd part sits in inverse_down's work
  std::vector<std::vector<T>> odd, odd_t;
  std::vector<T> base_matrix, base_t, full;

  explicit DownPlan(int64_t n) : size(n) {
    double scale = 1.0;
    while (n % 2 == 0 && n > kDenseUpTo) {
      const int64_t h = n / 2;
      const auto c = dct_matrix(n);
      std::vector<T> matrix(h * h), transposed(h * h);
      for (int64_t m = 0; m < h; ++m)
        for (int64_t i = 0; i < h; ++i)
          matrix[m * h + i] = transposed[i * h + m] = static_cast<T>(scale * c[(2 * m + 1) * n + i]);
      odd_start.push_back(half.empty() ? 0 : odd_start.back() + half.back());
      half.push_back(h);
      odd.push_back(std::move(matrix));
      odd_t.push_back(std::move(transposed));
      scale *= M_SQRT1_2;
      n = h;
    }
    base = n;
    fill(dct_matrix(n), n, scale, base_matrix, base_t);
    const auto whole = dct_matrix(size);
    full.assign(whole.begin(), whole.end());
  }
  int64_t levels() const { return static_cast<int64_t>(half.size()); }
};

// The DCT-II along the rows of a block (see forward_across): C's even and odd rows on the first
// half of the columns, and their transposes, when the halves are whole vectors; C whole always.
template <typename T>
struct AcrossPlan {
  int64_t size = 0;
  bool split = false;
  std::vector<T> even, odd, even_t, odd_t, full, full_t;

  explicit AcrossPlan(int64_t n) : size(n), split(n % (2 * kLanes<T>) == 0) {
    const auto c = dct_matrix(n);
    fill(c, n, 1.0, full, full_t);
    if (!split) return;
    const int64_t h = n / 2;
    for (auto* part : {&even, &odd, &even_t, &odd_t}) part->resize(h * h);
    for (int64_t m = 0; m < h; ++m)
      for (int64_t i = 0; i < h; ++i) {
        even[m * h + i] = even_t[i * h + m] = static_cast<T>(c[2 * m * n + i]);
        odd[m * h + i] = odd_t[i * h + m] = static_cast<T>(c[(2 * m + 1) * n + i]);
      }
  }
};

// One plan per size and element type, built once per process.
template <typename Plan>
const Plan& plan_for(int64_t size) {
  static std::mutex lock;
  static std::map<int64_t, std::unique_ptr<Plan>> plans;
  std::lock_guard<std::mutex> guard(lock);
  auto& slot = plans[size];
  if (!slot) slot = std::make_unique<Plan>(size);
  return *slot;
}

// R output rows of V vectors: out row r (`out_ld` apart) = sum_i M(r, i) in row i (`ld` apart)
// for i < mi, M(r, i) = M[r * lm + i * lk]. With R x V = 16 the sums stay in registers (about
// 170 GFLOP/s on one core of the AVX-512 machine this was written on).
template <typename T, int R, int V>
inline void combine_tile(const T* M, int64_t lm, int64_t lk, int64_t mi, const T* in, int64_t ld, T* out,
                         int64_t out_ld) {
  Vec<T> acc[R][V] = {};
  for (int64_t i = 0; i < mi; ++i) {
    Vec<T> x[V];
    for (int v = 0; v < V; ++v) x[v] = load(in + i * ld + v * kLanes<T>);
    for (int r = 0; r < R; ++r) {
      const T a = M[r * lm + i * lk];
      for (int v = 0; v < V; ++v) acc[r][v] += a * x[v];
    }
  }
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < V; ++v) store(out + r * out_ld + v * kLanes<T>, acc[r][v]);
}

template <typename T, int V>
inline void combine_vectors(const T* M, int64_t lm, int64_t lk, int64_t mo, int64_t mi, const T* in, int64_t ld,
                            T* out, int64_t out_ld) {
  int64_t m = 0;
  if constexpr (V <= 2)  // narrow tiles: eight rows keep as many sums in flight
    for (; m + 8 <= mo; m += 8) combine_tile<T, 8, V>(M + m * lm, lm, lk, mi, in, ld, out + m * out_ld, out_ld);
  for (; m + 4 <= mo; m += 4) combine_tile<T, 4, V>(M + m * lm, lm, lk, mi, in, ld, out + m * out_ld, out_ld);
  for (; m < mo; ++m) combine_tile<T, 1, V>(M + m * lm, lm, lk, mi, in, ld, out + m * out_ld, out_ld);
}

// Rows of `width` entries: out row m (`out_ld` apart) = sum_i M(m, i) in row i (`ld` apart), for
// m < mo and i < mi, M(m, i) = M[m * lm + i * lk].
template <typename T>
void combine_rows(const T* M, int64_t lm, int64_t lk, int64_t mo, int64_t mi, const T* in, int64_t ld,
                  int64_t width, T* out, int64_t out_ld) {
  if (width % kLanes<T> == 0) {
    for (int64_t c = 0; c < width; c += 4 * kLanes<T>) {
      switch (std::min<int64_t>(4, (width - c) / kLanes<T>)) {
        case 4: combine_vectors<T, 4>(M, lm, lk, mo, mi, in + c, ld, out + c, out_ld); break;
        case 3: combine_vectors<T, 3>(M, lm, lk, mo, mi, in + c, ld, out + c, out_ld); break;
        case 2: combine_vectors<T, 2>(M, lm, lk, mo, mi, in + c, ld, out + c, out_ld); break;
        default: combine_vectors<T, 1>(M, lm, lk, mo, mi, in + c, ld, out + c, out_ld); break;
      }
    }
    return;
  }
  for (int64_t m = 0; m < mo; ++m) {  // a width that is not a whole number of vectors
    T* o = out + m * out_ld;
    std::fill_n(o, width, T(0));
    for (int64_t i = 0; i < mi; ++i) {
      const T a = M[m * lm + i * lk];
      const T* x = in + i * ld;
      for (int64_t c = 0; c < width; ++c) o[c] += a * x[c];
    }
  }
}

// Asks for a row of `width` entries to be brought into cache (`write`: to be written). A tile's
// rows lie one block row apart, each in another page, where the hardware's prefetchers start
// late: asked for one row ahead, a tile's read of a gradient and its read-modify-write of a
// momentum or a parameter wait less (a DeMo step on OLMo-300M's block matrices about 4 %
// faster, bit for bit the same).
template <bool write, typename T>
inline void prefetch_row(const T* p, int64_t width) {
  for (int64_t c = 0; c < width; c += 64 / static_cast<int64_t>(sizeof(T))) __builtin_prefetch(p + c, write, 3);
}

// sum = x + y and difference = x - y, `width` entries each.
template <typename T>
inline void butterfly(const T* x, const T* y, T* sum, T* difference, int64_t width) {
  int64_t c = 0;
  for (; c + kLanes<T> <= width; c += kLanes<T>) {
    const Vec<T> a = load(x + c), b = load(y + c);
    store(sum + c, a + b);
    store(difference + c, a - b);
  }
  for (; c < width; ++c) {
    const T a = x[c], b = y[c];
    sum[c] = a + b;
    difference[c] = a - b;
  }
}

// The DCT-II down the rows, every column at once: out (size rows of `width`, natural order) =
// C_size x (x's rows `ld` apart). `a` holds size x width, `b` size / 2 x width.
template <typename T>
void forward_down(const DownPlan<T>& plan, const T* x, int64_t ld, int64_t width, T* out, T* a, T* b) {
  int64_t n = plan.size;
  for (int64_t level = 0; level < plan.levels(); ++level) {
    const int64_t h = plan.half[level];
    for (int64_t i = 0; i < h; ++i) {
      if (level == 0 && i + 1 < h) {  // the next pair of source rows, from memory
        prefetch_row<false>(x + (i + 1) * ld, width);
        prefetch_row<false>(x + (n - 2 - i) * ld, width);
      }
      butterfly(x + i * ld, x + (n - 1 - i) * ld, a + i * width, a + (h + i) * width, width);
    }
    // the odd coefficients of this level: rows (2m + 1) 2^level
    combine_rows(plan.odd[level].data(), h, 1, h, h, a + h * width, width, width, out + (width << level),
                 width << (level + 1));
    x = a;
    ld = width;
    std::swap(a, b);
    n = h;
  }
  combine_rows(plan.base_matrix.data(), n, 1, n, n, x, ld, width, out, width << plan.levels());
}

// Its inverse (DCT-III: the transposed steps in reverse), out (size rows of `width`) = C_size^T y
// (y's rows `ld` apart). `work` holds 2 x size x width.
template <typename T>
void inverse_down(const DownPlan<T>& plan, const T* y, int64_t ld, int64_t width, T* out, T* work) {
  const int64_t levels = plan.levels();
  if (levels == 0) {
    combine_rows(plan.base_t.data(), plan.size, 1, plan.size, plan.size, y, ld, width, out, width);
    return;
  }
  // each level's odd part: odd^T times its coefficients, rows (2m + 1) 2^level of y
  for (int64_t level = 0; level < levels; ++level) {
    const int64_t h = plan.half[level];
    combine_rows(plan.odd_t[level].data(), h, 1, h, h, y + (ld << level), ld << (level + 1), width,
                 work + plan.odd_start[level] * width, width);
  }
  T* a = work + (plan.odd_start.back() + plan.half.back()) * width;  // the even part from below, up to size / 2 rows
  T* b = a + plan.size / 2 * width;  // the level above's
  combine_rows(plan.base_t.data(), plan.base, 1, plan.base, plan.base, y, ld << levels, width, a, width);
  for (int64_t level = levels - 1; level >= 0; --level) {
    const int64_t h = plan.half[level], n = 2 * h;
    T* target = level == 0 ? out : b;
    for (int64_t i = 0; i < h; ++i)
      butterfly(a + i * width, work + (plan.odd_start[level] + i) * width, target + i * width,
                target + (n - 1 - i) * width, width);
    std::swap(a, b);
  }
}

// The DCT along each row of a block (rows `ld` apart, `size` wide): y_r = C x_r, into out's
// rows (`out_ld` apart). Split once into even and odd halves when they are whole vectors:
//   y_r[2m] = sum_i (x_r[i] + x_r[size-1-i]) C[2m][i],  y_r[2m+1] = sum_i (x_r[i] - x_r[size-1-i]) C[2m+1][i]
// over i < size / 2: half the multiply-adds of C x_r. `work` holds 2 x rows x size.
template <typename T>
void forward_across(const AcrossPlan<T>& plan, const T* x, int64_t ld, int64_t rows, T* out, int64_t out_ld,
                    T* work) {
  const int64_t size = plan.size, h = size / 2;
  if (!plan.split) {
    combine_rows(x, ld, 1, rows, size, plan.full_t.data(), size, size, out, out_ld);
    return;
  }
  T* sums = work;
  T* differences = sums + rows * h;
  T* even = differences + rows * h;
  T* odd = even + rows * h;
  for (int64_t r = 0; r < rows; ++r) {
    const T* row = x + r * ld;
    for (int64_t i = 0; i < h; ++i) {
      sums[r * h + i] = row[i] + row[size - 1 - i];
      differences[r * h + i] = row[i] - row[size - 1 - i];
    }
  }
  combine_rows(sums, h, 1, rows, h, plan.even_t.data(), h, h, even, h);
  combine_rows(differences, h, 1, rows, h, plan.odd_t.data(), h, h, odd, h);
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t m = 0; m < h; ++m) {
      out[r * out_ld + 2 * m] = even[r * h + m];
      out[r * out_ld + 2 * m + 1] = odd[r * h + m];
    }
}

// A row of the inverse along block rows from its even and odd halves' sums (forward_across's
// split, undone): x[i] = a[i] + b[i], x[size-1-i] = a[i] - b[i] for i < size / 2.
template <typename T>
inline void fold_halves(const T* a, const T* b, int64_t size, T* x) {
  for (int64_t i = 0; i < size / 2; ++i) {
    x[i] = a[i] + b[i];
    x[size - 1 - i] = a[i] - b[i];
  }
}

// forward_across's inverse for every row of a block, x_r = C^T y_r, as matrix products: with
// a = y_r[even] E and b = y_r[odd] O for all rows at once, x_r[i] = a[i] + b[i] and
// x_r[size-1-i] = a[i] - b[i]. `work` holds rows x size.
template <typename T>
void inverse_across_dense(const AcrossPlan<T>& plan, const T* y, int64_t ld, int64_t rows, T* out, int64_t out_ld,
                          T* work) {
  const int64_t size = plan.size, h = size / 2;
  if (!plan.split) {
    combine_rows(y, ld, 1, rows, size, plan.full.data(), size, size, out, out_ld);
    return;
  }
  T* a = work;
  T* b = work + rows * h;
  combine_rows(y, ld, 2, rows, h, plan.even.data(), h, h, a, h);
  combine_rows(y + 1, ld, 2, rows, h, plan.odd.data(), h, h, b, h);
  for (int64_t r = 0; r < rows; ++r) fold_halves(a + r * h, b + r * h, size, out + r * out_ld);
}

// X = L^T Y R for a block Y of `count` nonzero coefficients v_j at (r_j, c_j), as one product:
// X[r][c] = sum_j (v_j L[r_j][r]) R[c_j][c]. Up to about 1.5 x 64 of them in a 64 x 64 block
// that is fewer multiply-adds than the inverse's two directions. `work` holds count x (rows +
// width); out's rows are `out_ld` apart.
template <typename T>
void inverse_sparse(const DownPlan<T>& left, const AcrossPlan<T>& right, int64_t count, const int64_t* at_row,
                    const int64_t* at_col, const T* values, T* out, int64_t out_ld, T* work) {
  const int64_t rows = left.size, width = right.size;
  if (count == 0) {
    for (int64_t r = 0; r < rows; ++r) std::fill_n(out + r * out_ld, width, T(0));
    return;
  }
  T* scaled = work;                 // count x rows: v_j L[r_j]
  T* across = work + count * rows;  // count x width: R[c_j]
  for (int64_t j = 0; j < count; ++j) {
    const T* l = left.full.data() + at_row[j] * rows;
    for (int64_t r = 0; r < rows; ++r) scaled[j * rows + r] = values[j] * l[r];
    std::copy_n(right.full.data() + at_col[j] * width, width, across + j * width);
  }
  combine_rows(scaled, 1, rows, rows, count, across, width, width, out, out_ld);
}

template <typename T>
inline T signum(T x) {
  return x > T(0) ? T(1) : (x < T(0) ? T(-1) : T(0));  // 0 and NaN give 0, as torch.sign does
}

struct Emit {
  double beta, alpha;
  bool sign;
};

// target = beta * target + alpha * f(y) for `rows` rows of `width` (target's `ld` apart, y's
// `width` apart), f the sign or nothing; beta = 0 does not read the target (BLAS's rule). With
// `keep`, y is overwritten with what was written (a copy in cache of the new target). Each sum is
// one explicit fused multiply-add, so every caller rounds alike whatever the compiler contracts.
template <typename T>
void emit_rows(const Emit& emit, T* y, int64_t rows, int64_t width, T* target, int64_t ld, bool keep = false) {
  const T beta = static_cast<T>(emit.beta), alpha = static_cast<T>(emit.alpha);
  for (int64_t r = 0; r < rows; ++r) {
    T* o = target + r * ld;
    T* v = y + r * width;
    if (r + 1 < rows) prefetch_row<true>(o + ld, width);
    if (emit.sign) {
      for (int64_t c = 0; c < width; ++c) o[c] = std::fma(alpha, signum(v[c]), beta * o[c]);
    } else if (beta == T(0)) {
      for (int64_t c = 0; c < width; ++c) o[c] = alpha * v[c];
    } else if (beta == T(1)) {
      for (int64_t c = 0; c < width; ++c) o[c] = std::fma(alpha, v[c], o[c]);
    } else {
      for (int64_t c = 0; c < width; ++c) o[c] = std::fma(alpha, v[c], beta * o[c]);
    }
    if (keep) std::copy_n(o, width, v);
  }
}

// How a matrix of `cols` columns and blocks of chunk_rows x chunk_cols is cut into tiles: up to
// 512 columns (tile_blocks blocks) of one block row.
struct TileGeometry {
  int64_t cols, chunk_rows, chunk_cols, tile_blocks;

  TileGeometry(int64_t cols_, int64_t chunk_rows_, int64_t chunk_cols_)
      : cols(cols_), chunk_rows(chunk_rows_), chunk_cols(chunk_cols_),
        tile_blocks(std::max<int64_t>(1, std::min(cols_ / chunk_cols_, 512 / chunk_cols_))) {}
  int64_t tiles() const { return (cols / chunk_cols + tile_blocks - 1) / tile_blocks; }
};

// W workers' payloads, as dct_gathered_update reads them: worker w's block-local indices and
// values (num_blocks x k each, contiguous) start `w * index_stride` and `w * values_stride`
// entries in.
template <typename T>
struct Gathered {
  const int64_t* index;
  const T* values;
  int64_t workers, k, index_stride, values_stride;
};

// One block row, `tile_blocks` blocks at a time (a tile: rows of up to 512 entries, read and
// written along memory), transformed in cache and emitted into the targets' same tile.
template <typename T>
class TileTransform {
 public:
  TileTransform(const TileGeometry& g, bool inverse, const Emit& emit)
      : g_(g), inverse_(inverse), emit_(emit),
        down_(g.chunk_rows > 1 ? &plan_for<DownPlan<T>>(g.chunk_rows) : nullptr),
        across_(g.chunk_cols > 1 ? &plan_for<AcrossPlan<T>>(g.chunk_cols) : nullptr) {
    const int64_t tile = g.chunk_rows * g.chunk_cols * g.tile_blocks;
    // a block with at most this many nonzero coefficients is inverted as one product
    rank_limit_ = down_ && across_ ? 3 * std::min(g.chunk_rows, g.chunk_cols) / 2 : -1;
    space_.reset(new Vec<T>[7 * tile / kLanes<T> + 1]);  // not zeroed: every use writes first
    stage_ = reinterpret_cast<T*>(space_.get());
    result_ = stage_ + tile;
    gathered_ = result_ + tile;  // the coefficients of run_gathered
    spare_ = gathered_ + tile;   // their senders in run_gathered; a block's inverse in transform
    work_ = spare_ + tile;  // 3 tiles
    const int64_t lists = g.tile_blocks * (rank_limit_ + 1);
    at_row_.resize(lists);
    at_col_.resize(lists);
    values_.resize(lists);
    counts_.resize(g.tile_blocks);
    heads_.resize(2 * std::max<int64_t>(rank_limit_, 1));  // list_payloads': at most a worker per listed coefficient
  }

  // Tile `tile` of the block row starting at `source` (rows `cols` apart) into `target`'s.
  void run(const T* source, T* target, int64_t tile) {
    const int64_t first = tile * g_.tile_blocks * g_.chunk_cols;
    transform(source + first, g_.cols, target + first, tile_blocks(tile));
  }

  // run(), then select_blocks of the tile's new target values, read from the copy of them the
  // emit leaves in cache (`selecting`: the target's geometry, k and rows per group); then, unless
  // `subtract` is 0, target -= subtract * value at each selected position, while the tile is
  // still in cache, rounded as torch's index_add_(positions, values, alpha=-subtract) rounds it:
  // the product, then the sum.
  void run_selecting(const T* source, T* target, int64_t tile, const Geometry& selecting, int64_t block_row,
                     int64_t* index, int64_t* positions, T* values, Selection<T>& selection, double subtract) {
    const int64_t first = tile * g_.tile_blocks * g_.chunk_cols, blocks = tile_blocks(tile);
    keep_ = true;
    transform(source + first, g_.cols, target + first, blocks);
    keep_ = false;
    const int64_t bc_first = tile * g_.tile_blocks;
    select_blocks<T>(result_, blocks * g_.chunk_cols, selecting, block_row, bc_first, bc_first + blocks, index,
                     positions, values, selection);
    if (subtract == 0.0) return;
    const T minus = static_cast<T>(-subtract);  // as index_add_ takes its alpha
    const int64_t origin = block_row * g_.chunk_rows * g_.cols;  // the block row's first position
    const int64_t from = (block_row * (g_.cols / g_.chunk_cols) + bc_first) * selecting.k;
    for (int64_t at = from; at < from + blocks * selecting.k; ++at) {
      volatile T product = values[at] * minus;  // rounded on its own: never fused into the add
      T& entry = target[positions[at] - origin];
      entry = entry + product;
    }
  }

  // The inverse of tile `tile` of block row `block_row` into `target`'s (the block row's start),
  // its coefficients given by W workers' payloads: `index` and `values` (W x num_blocks x k,
  // block-local indices). Each position gets the mean over the workers that sent it, summed in
  // worker order and divided by their number at W > 1 (DCTTopK.aggregate_gathered's rule, bit
  // for bit), in a tile in cache: the rows x cols coefficients never pass through memory. Where
  // the payloads can be read as the one-product inverse's lists (list_payloads), no tile is
  // gathered at all.
  void run_gathered(const Gathered<T>& sent, int64_t block_row, T* target, int64_t tile) {
    const int64_t C = g_.chunk_cols, blocks = tile_blocks(tile), width = blocks * C, k = sent.k;
    const int64_t tile_numel = g_.chunk_rows * width, workers = sent.workers;
    const int64_t first_block = block_row * (g_.cols / C) + tile * g_.tile_blocks;
    if (list_payloads(sent, first_block, blocks)) {
      listed_ = true;  // the lists are the coefficients: no tile is gathered or scanned
      transform(nullptr, width, target + tile * g_.tile_blocks * C, blocks);
      listed_ = false;
      return;
    }
    std::fill_n(gathered_, tile_numel, T(0));
    if (workers > 1) std::fill_n(spare_, tile_numel, T(0));
    for (int64_t w = 0; w < workers; ++w) {
      const int64_t* index = sent.index + w * sent.index_stride + first_block * k;
      const T* values = sent.values + w * sent.values_stride + first_block * k;
      for (int64_t b = 0; b < blocks; ++b)
        for (int64_t j = b * k; j < (b + 1) * k; ++j) {
          const int64_t local = index[j];  // checked by the caller: in [0, block_numel)
          const int64_t position = (local / C) * width + b * C + local % C;
          gathered_[position] += values[j];
          if (workers > 1) spare_[position] += T(1);
        }
    }
    if (workers > 1)
      for (int64_t i = 0; i < tile_numel; ++i) gathered_[i] /= std::max(spare_[i], T(1));
    transform(gathered_, width, target + tile * g_.tile_blocks * C, blocks);
  }

 private:
  int64_t tile_blocks(int64_t tile) const {
    return std::min(g_.tile_blocks, g_.cols / g_.chunk_cols - tile * g_.tile_blocks);
  }

  // `blocks` blocks side by side from `source` (rows `ld` apart) into `target` (rows `cols` apart).
  void transform(const T* source, int64_t ld, T* target, int64_t blocks) {
    const int64_t R = g_.chunk_rows, C = g_.chunk_cols, cols = g_.cols, width = blocks * C;
    if (!inverse_) {
      const T* down = source;
      int64_t down_ld = ld;
      if (down_) {  // every block of the tile at once
        forward_down(*down_, source, ld, width, stage_, work_, work_ + R * width);
        down = stage_;
        down_ld = width;
      }
      for (int64_t b = 0; b < blocks; ++b) {
        if (across_) {
          forward_across(*across_, down + b * C, down_ld, R, result_ + b * C, width, work_);
        } else {
          for (int64_t r = 0; r < R; ++r) std::copy_n(down + r * down_ld + b * C, C, result_ + r * width + b * C);
        }
      }
    } else {
      // each block of few nonzero coefficients as one product over them; the others across
      // their rows, then down (every block of the tile at once when none is sparse)
      const int64_t dense = listed_ ? 0 : rank_limit_ < 0 ? blocks : nonzeros(source, ld, blocks);
      for (int64_t b = 0; b < blocks; ++b) {
        if (dense < blocks && counts_[b] <= rank_limit_) {
          const int64_t at = b * (rank_limit_ + 1);
          inverse_sparse(*down_, *across_, counts_[b], at_row_.data() + at, at_col_.data() + at,
                         values_.data() + at, result_ + b * C, width, work_);
          continue;
        }
        T* out = down_ ? stage_ + b * C : result_ + b * C;
        if (across_) {
          // as products, whatever the block's zeros: from two nonzero coefficients a row (an
          // aggregate of four senders' top-32) that is faster than skipping them row by row
          // (benchmarks/senders.py, OLMo-300M's blocks: DeMo's step at 4 and 8 senders 149.5 and
          // 159.9 ms by rows, 133.4 and 135.9 ms as products)
          inverse_across_dense(*across_, source + b * C, ld, R, out, width, work_);
        } else {
          for (int64_t r = 0; r < R; ++r) std::copy_n(source + r * ld + b * C, C, out + r * width);
        }
        if (down_ && dense < blocks) {  // this block alone, through spare_, into its columns
          inverse_down(*down_, stage_ + b * C, width, C, spare_, work_);
          for (int64_t r = 0; r < R; ++r) std::copy_n(spare_ + r * C, C, result_ + r * width + b * C);
        }
      }
      if (down_ && dense == blocks) inverse_down(*down_, stage_, width, width, result_, work_);
    }
    emit_rows(emit_, result_, R, width, target, cols, keep_);
  }

  // W workers' payloads for the tile's `blocks` blocks (from block `first_block` on, k entries
  // each) as nonzeros() would list the tile run_gathered gathers from them: each block's nonzero
  // coefficients in ascending block-local index, with their rows and columns, each the mean
  // over the workers that sent it, summed in worker order from +0 and divided by their number
  // at W > 1, as the gathered tile holds it. The workers' ascending lists are merged. False,
  // with the lists unusable, unless they are that: each worker's indices of each block strictly
  // ascending (as both top-k paths return them; else the tile is gathered and scanned) and W x k
  // at most rank_limit. A mean of zero is left out: nonzeros() passes over a +0 and keeps a -0
  // (a negative subnormal halved), which adds only exact zeros to sums that start at +0: the
  // inverse is the same either way, and the count stays within rank_limit.
  bool list_payloads(const Gathered<T>& sent, int64_t first_block, int64_t blocks) {
    const int64_t workers = sent.workers, k = sent.k;
    if (k < 1 || workers * k > rank_limit_) return false;
    const int64_t C = g_.chunk_cols, capacity = rank_limit_ + 1;
    const int64_t* index = sent.index;
    const T* values = sent.values;
    int64_t* next = heads_.data();       // per worker: its next entry of the block, in its row
    int64_t* stop = next + workers;      // and where its block's entries end
    const auto at_index = [&](int64_t w, int64_t at) { return index[w * sent.index_stride + at]; };
    for (int64_t b = 0; b < blocks; ++b) {
      for (int64_t w = 0; w < workers; ++w) {
        next[w] = (first_block + b) * k;
        stop[w] = next[w] + k;
        for (int64_t at = next[w] + 1; at < stop[w]; ++at)
          if (at_index(w, at) <= at_index(w, at - 1)) return false;
      }
      int64_t count = 0;
      for (;;) {
        int64_t lowest = std::numeric_limits<int64_t>::max();
        for (int64_t w = 0; w < workers; ++w)
          if (next[w] < stop[w]) lowest = std::min(lowest, at_index(w, next[w]));
        if (lowest == std::numeric_limits<int64_t>::max()) break;
        T sum = T(0);
        int64_t senders = 0;
        for (int64_t w = 0; w < workers; ++w)
          if (next[w] < stop[w] && at_index(w, next[w]) == lowest) {
            sum += values[w * sent.values_stride + next[w]++];
            ++senders;
          }
        if (workers > 1) sum /= T(senders);
        if (sum == T(0)) continue;
        const int64_t slot = b * capacity + count++;
        at_row_[slot] = lowest / C;
        at_col_[slot] = lowest % C;
        values_[slot] = sum;
      }
      counts_[b] = count;
    }
    return true;
  }

  // The nonzero coefficients of each of the tile's `blocks` blocks (rows `ld` apart), row by
  // row, into per-block lists of at most rank_limit (counts_; a block with more gets rank_limit
  // + 1 and no list, and is not read further: a dense block costs a few rows): the number of
  // such blocks. A 64-byte run of zero bits is passed over at once (a -0.0 is kept: it adds
  // nothing).
  int64_t nonzeros(const T* tile, int64_t ld, int64_t blocks) {
    const int64_t C = g_.chunk_cols, capacity = rank_limit_ + 1;
    std::fill_n(counts_.begin(), blocks, 0);
    int64_t dense = 0;
    for (int64_t r = 0; r < g_.chunk_rows; ++r) {
      for (int64_t b = 0; b < blocks; ++b) {
        int64_t& count = counts_[b];
        if (count == capacity) continue;  // a block known to have more is not read again
        const T* cells = tile + r * ld + b * C;
        for (int64_t c = 0; c < C; c += kLanes<T>) {
          const int64_t stop = std::min(C, c + kLanes<T>);
          if (stop - c == kLanes<T>) {
            uint64_t words[8], any = 0;
            std::memcpy(words, cells + c, sizeof(words));
            for (uint64_t word : words) any |= word;
            if (any == 0) continue;
          }
          for (int64_t j = c; j < stop; ++j) {
            if (cells[j] == T(0) && !std::signbit(cells[j])) continue;
            if (count >= rank_limit_) {
              dense += count == rank_limit_;
              count = capacity;
              break;
            }
            const int64_t at = b * capacity + count++;
            at_row_[at] = r;
            at_col_[at] = j;
            values_[at] = cells[j];
          }
          if (count == capacity) break;
        }
      }
    }
    return dense;
  }

  TileGeometry g_;
  bool inverse_;
  Emit emit_;
  const DownPlan<T>* down_;
  const AcrossPlan<T>* across_;
  int64_t rank_limit_;
  bool keep_ = false, listed_ = false;  // listed_: the inverse's blocks are listed already (list_payloads)
  std::unique_ptr<Vec<T>[]> space_;  // vectors, so that the buffers are aligned to one
  T *stage_, *result_, *gathered_, *spare_, *work_;
  std::vector<int64_t> at_row_, at_col_, counts_, heads_;
  std::vector<T> values_;
};

// Where each block row of a matrix given as row blocks (each a whole number of block rows,
// contiguous) begins.
template <typename T, typename Pointer>
std::vector<Pointer> block_row_starts(at::TensorList parts, int64_t block_row_numel, const char* what,
                                      const at::Tensor& like) {
  std::vector<Pointer> starts;
  for (const auto& part : parts) {
    TORCH_CHECK(part.device().is_cpu() && part.is_contiguous() && part.scalar_type() == like.scalar_type(),
                "lowcomm::dct_blocks: every ", what, " contiguous, on the CPU, of one dtype");
    TORCH_CHECK(part.numel() % block_row_numel == 0, "lowcomm::dct_blocks: a ", what, " of ", part.numel(),
                " entries is not a whole number of block rows of ", block_row_numel);
    T* data = static_cast<T*>(part.data_ptr());
    for (int64_t start = 0; start < part.numel(); start += block_row_numel) starts.push_back(data + start);
  }
  return starts;
}

// targets = beta * targets + alpha * T(parts): T the block DCT-II of the rows x cols matrix the
// parts make row over row (or its inverse), the targets another rows x cols matrix in row blocks. beta = 0 does not read the targets. A part and a target may be the
// same memory: a tile is read whole before it is written.
void dct_blocks(at::TensorList parts, at::TensorList targets, int64_t cols, int64_t chunk_rows, int64_t chunk_cols,
                bool inverse, double beta, double alpha) {
  TORCH_CHECK(!parts.empty() && !targets.empty(), "lowcomm::dct_blocks: no parts or no targets");
  const at::Tensor& like = parts[0];
  TORCH_CHECK(like.scalar_type() == at::kFloat || like.scalar_type() == at::kDouble,
              "lowcomm::dct_blocks: float32 or float64, got ", like.scalar_type());
  TORCH_CHECK(cols >= 1 && chunk_rows >= 1 && chunk_cols >= 1 && cols % chunk_cols == 0,
              "lowcomm::dct_blocks: blocks of ", chunk_rows, " x ", chunk_cols, " do not tile ", cols, " columns");
  AT_DISPATCH_FLOATING_TYPES(like.scalar_type(), "lowcomm::dct_blocks", [&] {
    const int64_t slab = chunk_rows * cols;
    const auto sources = block_row_starts<scalar_t, const scalar_t*>(parts, slab, "part", like);
    const auto destinations = block_row_starts<scalar_t, scalar_t*>(targets, slab, "target", like);
    TORCH_CHECK(sources.size() == destinations.size(), "lowcomm::dct_blocks: the parts hold ", sources.size(),
                " block rows, the targets ", destinations.size());
    const TileGeometry geometry(cols, chunk_rows, chunk_cols);
    const int64_t tiles = geometry.tiles();
    const Emit emit{beta, alpha, false};
    at::parallel_for(0, static_cast<int64_t>(sources.size()) * tiles, 1, [&](int64_t first, int64_t last) {
      TileTransform<scalar_t> transform(geometry, inverse, emit);
      for (int64_t task = first; task < last; ++task)
        transform.run(sources[task / tiles], destinations[task / tiles], task % tiles);
    });
  });
}

// target = beta * target + alpha * P(parts) as dct_blocks does (one target, rows x cols), and the
// top-k of every block of the new target as block_topk selects it, each tile selected while it is
// still in cache from its transform: the selection reads no memory the transform did not write.
// Unless `subtract` is 0, target -= subtract * (the selected values) at their positions, bit for bit
// as index_add_(positions, values, alpha=-subtract) after the call, but in cache.
std::tuple<at::Tensor, at::Tensor, at::Tensor> dct_blocks_topk(at::TensorList parts, const at::Tensor& target,
                                                               int64_t chunk_rows, int64_t chunk_cols, double beta,
                                                               double alpha, int64_t k, int64_t group,
                                                               double subtract) {
  TORCH_CHECK(!parts.empty(), "lowcomm::dct_blocks_topk: no parts");
  TORCH_CHECK(target.device().is_cpu() && target.dim() == 2 && target.is_contiguous(),
              "lowcomm::dct_blocks_topk: the target must be a contiguous rows x cols CPU tensor");
  TORCH_CHECK(target.scalar_type() == at::kFloat || target.scalar_type() == at::kDouble,
              "lowcomm::dct_blocks_topk: float32 or float64, got ", target.scalar_type());
  const int64_t rows = target.size(0), cols = target.size(1);
  check_selection("lowcomm::dct_blocks_topk", rows, cols, chunk_rows, chunk_cols, k, group);
  const int64_t blocks = (rows / chunk_rows) * (cols / chunk_cols);
  auto index = at::empty({blocks, k}, target.options().dtype(at::kLong));
  auto positions = at::empty({blocks, k}, target.options().dtype(at::kLong));
  auto values = at::empty({blocks, k}, target.options());
  AT_DISPATCH_FLOATING_TYPES(target.scalar_type(), "lowcomm::dct_blocks_topk", [&] {
    const int64_t slab = chunk_rows * cols;
    const auto sources = block_row_starts<scalar_t, const scalar_t*>(parts, slab, "part", target);
    TORCH_CHECK(static_cast<int64_t>(sources.size()) == rows / chunk_rows, "lowcomm::dct_blocks_topk: the parts hold ",
                sources.size(), " block rows, the target ", rows / chunk_rows);
    const TileGeometry geometry(cols, chunk_rows, chunk_cols);
    const int64_t tiles = geometry.tiles();
    const Geometry selecting{cols, chunk_rows, chunk_cols, k, group};
    const Emit emit{beta, alpha, false};
    scalar_t* data = target.mutable_data_ptr<scalar_t>();
    int64_t* index_out = index.mutable_data_ptr<int64_t>();
    int64_t* positions_out = positions.mutable_data_ptr<int64_t>();
    scalar_t* values_out = values.mutable_data_ptr<scalar_t>();
    at::parallel_for(0, static_cast<int64_t>(sources.size()) * tiles, 1, [&](int64_t first, int64_t last) {
      TileTransform<scalar_t> transform(geometry, false, emit);
      Selection<scalar_t> selection;
      for (int64_t task = first; task < last; ++task) {
        const int64_t block_row = task / tiles, tile = task % tiles;
        transform.run_selecting(sources[block_row], data + block_row * slab, tile, selecting, block_row, index_out,
                                positions_out, values_out, selection, subtract);
      }
    });
  });
  return {index, positions, values};
}

// targets += alpha * f(P^-1(Q)), Q the mean over the workers that sent each coefficient of
// their payloads (index, values: W x num_blocks x k, block-local indices; DeMo's aggregate), P
// the block DCT-II of the rows x cols matrix the targets make row over row, f the sign or nothing.
void dct_gathered_update(const at::Tensor& index, const at::Tensor& values, at::TensorList targets, int64_t cols,
                         int64_t chunk_rows, int64_t chunk_cols, double alpha, bool sign) {
  TORCH_CHECK(!targets.empty(), "lowcomm::dct_gathered_update: no targets");
  const at::Tensor& like = targets[0];
  TORCH_CHECK(like.scalar_type() == at::kFloat || like.scalar_type() == at::kDouble,
              "lowcomm::dct_gathered_update: float32 or float64, got ", like.scalar_type());
  // each worker's row contiguous (blocks x k); the rows anywhere: the views of an all-gather's
  // W x n buffer that a run covers, read where they are
  const auto rows_contiguous = [](const at::Tensor& t) {
    return t.dim() == 3 && (t.size(2) < 2 || t.stride(2) == 1) && (t.size(1) < 2 || t.stride(1) == t.size(2));
  };
  TORCH_CHECK(index.device().is_cpu() && index.scalar_type() == at::kLong && rows_contiguous(index),
              "lowcomm::dct_gathered_update: index must be a W x blocks x k int64 CPU tensor, each worker's row "
              "contiguous");
  TORCH_CHECK(values.sizes() == index.sizes() && values.scalar_type() == like.scalar_type() &&
                  rows_contiguous(values) && values.device().is_cpu(),
              "lowcomm::dct_gathered_update: values must be shaped as index, each worker's row contiguous, of the "
              "targets' dtype");
  TORCH_CHECK(cols >= 1 && chunk_rows >= 1 && chunk_cols >= 1 && cols % chunk_cols == 0,
              "lowcomm::dct_gathered_update: blocks of ", chunk_rows, " x ", chunk_cols, " do not tile ", cols,
              " columns");
  AT_DISPATCH_FLOATING_TYPES(like.scalar_type(), "lowcomm::dct_gathered_update", [&] {
    const auto destinations = block_row_starts<scalar_t, scalar_t*>(targets, chunk_rows * cols, "target", like);
    const int64_t blocks_cols = cols / chunk_cols, block_rows = static_cast<int64_t>(destinations.size());
    TORCH_CHECK(index.size(1) == block_rows * blocks_cols, "lowcomm::dct_gathered_update: payloads of ",
                index.size(1), " blocks for targets of ", block_rows * blocks_cols);
    const TileGeometry geometry(cols, chunk_rows, chunk_cols);
    const int64_t tiles = geometry.tiles();
    const Emit emit{1.0, alpha, sign};
    // every index checked before anything is written: a corrupt one changes nothing (read where the
    // rows are: an aminmax of the strided view would copy it first)
    const int64_t workers = index.size(0), row = index.size(1) * index.size(2), limit = chunk_rows * chunk_cols;
    const int64_t* first_index = index.const_data_ptr<int64_t>();
    std::atomic<bool> found{false};
    std::atomic<int64_t> which{0};  // a bad index, once one is found
    at::parallel_for(0, workers, 1, [&](int64_t first, int64_t last) {
      for (int64_t w = first; w < last; ++w) {
        const int64_t* entries = first_index + w * index.stride(0);
        int64_t low = 0, high = 0;
        for (int64_t j = 0; j < row; ++j) {
          low = std::min(low, entries[j]);
          high = std::max(high, entries[j]);
        }
        if (low < 0 || high >= limit) {
          which.store(low < 0 ? low : high);
          found.store(true);
        }
      }
    });
    TORCH_CHECK(!found.load(), "lowcomm::dct_gathered_update: block-local index ", which.load(),
                " outside a block of ", limit);
    const Gathered<scalar_t> sent{index.const_data_ptr<int64_t>(), values.const_data_ptr<scalar_t>(), index.size(0),
                                  index.size(2), index.stride(0), values.stride(0)};
    at::parallel_for(0, block_rows * tiles, 1, [&](int64_t first, int64_t last) {
      TileTransform<scalar_t> transform(geometry, true, emit);
      for (int64_t task = first; task < last; ++task)
        transform.run_gathered(sent, task / tiles, destinations[task / tiles], task % tiles);
    });
  });
}

}  // namespace

TORCH_LIBRARY(lowcomm, m) {
  m.def("block_topk(Tensor matrix, int chunk_rows, int chunk_cols, int k, int group) -> (Tensor, Tensor, Tensor)");
  m.def("dct_blocks(Tensor[] parts, Tensor(a!)[] targets, int cols, int chunk_rows, int chunk_cols, bool inverse, "
        "float beta, float alpha) -> ()");
  m.def("dct_blocks_topk(Tensor[] parts, Tensor(a!) target, int chunk_rows, int chunk_cols, float beta, "
        "float alpha, int k, int group, float subtract=0.) -> (Tensor, Tensor, Tensor)");
  m.def("dct_gathered_update(Tensor index, Tensor values, Tensor(a!)[] targets, int cols, int chunk_rows, "
        "int chunk_cols, float alpha, bool sign) -> ()");
}

TORCH_LIBRARY_IMPL(lowcomm, CPU, m) {
  m.impl("block_topk", &block_topk);
  m.impl("dct_blocks", &dct_blocks);
  m.impl("dct_blocks_topk", &dct_blocks_topk);
  m.impl("dct_gathered_update", &dct_gathered_update);
}
