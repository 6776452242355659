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
//      by nth_element over the maxima not below the bound (a few dozen, not hundreds);
//   3. the entries not below m of the groups whose maximum is not below m: they include the
//      block's k largest (m is at most the k-th largest entry: the k groups above it hold k
//      distinct entries at least m), and at least k of them;
//   4. nth_element of those candidates by (magnitude descending, index ascending), the k first
//      returned in ascending block-local index.
// A magnitude is ranked by the bits of |x| read as an unsigned integer (float for float, bf16
// and half, which convert to it exactly; double for double): for non-negative numbers that is
// their order, with +inf above every finite value and NaN above +inf, as torch.topk ranks them,
// and with no NaN comparison anywhere. Ties at the k-th place go to the lower index: the result
// is a function of the matrix alone.

#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <functional>
#include <limits>
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

template <typename K>
struct Candidate {
  K magnitude;
  int32_t index;  // block-local, row-major
};

template <typename K>
inline bool ranks_before(const Candidate<K>& a, const Candidate<K>& b) {
  return a.magnitude > b.magnitude || (a.magnitude == b.magnitude && a.index < b.index);
}

struct Geometry {
  int64_t cols, chunk_rows, chunk_cols, k, group;
};

template <typename T>
void select_block_rows(const T* data, const Geometry& g, int64_t first, int64_t last, int64_t* index,
                       int64_t* positions, T* values) {
  using K = Key<T>;
  const int64_t bands = g.chunk_rows / g.group;  // groups per column of a block
  const int64_t blocks_cols = g.cols / g.chunk_cols;
  const int64_t groups = bands * g.chunk_cols;  // per block
  const int64_t per_bin = groups / g.k;
  std::vector<K> maxima(bands * g.cols), ranked(groups);
  std::vector<Candidate<K>> candidates;
  candidates.reserve(g.chunk_rows * g.chunk_cols);

  for (int64_t block_row = first; block_row < last; ++block_row) {
    const int64_t top = block_row * g.chunk_rows * g.cols;
    // 1. group maxima, band by band, down the rows
    for (int64_t band = 0; band < bands; ++band) {
      K* out = maxima.data() + band * g.cols;
      const T* row = data + top + band * g.group * g.cols;
      for (int64_t c = 0; c < g.cols; ++c) out[c] = magnitude(row[c]);
      for (int64_t t = 1; t < g.group; ++t) {
        row += g.cols;
        for (int64_t c = 0; c < g.cols; ++c) out[c] = std::max(out[c], magnitude(row[c]));
      }
    }
    for (int64_t bc = 0; bc < blocks_cols; ++bc) {
      const int64_t origin = top + bc * g.chunk_cols;
      for (int64_t band = 0; band < bands; ++band)
        std::copy_n(maxima.data() + band * g.cols + bc * g.chunk_cols, g.chunk_cols,
                    ranked.data() + band * g.chunk_cols);
      // 2. the k-th largest group maximum: a lower bound first, then exactly above it
      K bound = std::numeric_limits<K>::max();
      for (int64_t bin = 0; bin < g.k; ++bin) {
        const K* begin = ranked.data() + bin * per_bin;
        bound = std::min(bound, *std::max_element(begin, begin + per_bin));
      }
      int64_t kept = 0;
      for (int64_t j = 0; j < groups; ++j) {
        ranked[kept] = ranked[j];
        kept += ranked[j] >= bound;
      }
      std::nth_element(ranked.begin(), ranked.begin() + (g.k - 1), ranked.begin() + kept, std::greater<K>());
      const K threshold = ranked[g.k - 1];
      // 3. the candidates: entries not below it, in groups whose maximum is not below it
      candidates.clear();
      for (int64_t band = 0; band < bands; ++band) {
        const K* band_maxima = maxima.data() + band * g.cols + bc * g.chunk_cols;
        for (int64_t c = 0; c < g.chunk_cols; ++c) {
          if (band_maxima[c] < threshold) continue;
          for (int64_t t = 0; t < g.group; ++t) {
            const int64_t r = band * g.group + t;
            const K m = magnitude(data[origin + r * g.cols + c]);
            if (m >= threshold) candidates.push_back({m, static_cast<int32_t>(r * g.chunk_cols + c)});
          }
        }
      }
      // 4. the k first by rank, in index order
      if (static_cast<int64_t>(candidates.size()) > g.k)
        std::nth_element(candidates.begin(), candidates.begin() + (g.k - 1), candidates.end(), ranks_before<K>);
      std::sort(candidates.begin(), candidates.begin() + g.k,
                [](const Candidate<K>& a, const Candidate<K>& b) { return a.index < b.index; });
      const int64_t out = (block_row * blocks_cols + bc) * g.k;
      for (int64_t j = 0; j < g.k; ++j) {
        const int64_t local = candidates[j].index;
        const int64_t at = origin + (local / g.chunk_cols) * g.cols + local % g.chunk_cols;
        index[out + j] = local;
        positions[out + j] = at;
        values[out + j] = data[at];
      }
    }
  }
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> block_topk(const at::Tensor& matrix, int64_t chunk_rows,
                                                          int64_t chunk_cols, int64_t k, int64_t group) {
  TORCH_CHECK(matrix.device().is_cpu(), "lowcomm::block_topk: a CPU tensor, got one on ", matrix.device());
  TORCH_CHECK(matrix.dim() == 2 && matrix.is_contiguous(), "lowcomm::block_topk: a contiguous rows x cols matrix");
  const int64_t rows = matrix.size(0), cols = matrix.size(1);
  TORCH_CHECK(chunk_rows >= 1 && chunk_cols >= 1 && rows % chunk_rows == 0 && cols % chunk_cols == 0,
              "lowcomm::block_topk: blocks of ", chunk_rows, " x ", chunk_cols, " do not tile ", rows, " x ", cols);
  TORCH_CHECK(group >= 1 && chunk_rows % group == 0, "lowcomm::block_topk: group ", group,
              " does not divide the block height ", chunk_rows);
  TORCH_CHECK(chunk_rows * chunk_cols <= std::numeric_limits<int32_t>::max(), "lowcomm::block_topk: blocks of ",
              chunk_rows, " x ", chunk_cols, " have more entries than a 32-bit block-local index holds");
  TORCH_CHECK(k >= 1 && k <= (chunk_rows / group) * chunk_cols, "lowcomm::block_topk: k = ", k,
              " needs at least k groups of ", group, " rows per block, there are ", (chunk_rows / group) * chunk_cols);
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
      select_block_rows<scalar_t>(data, geometry, first, last, index_out, positions_out, values_out);
    });
  });
  return {index, positions, values};
}

}  // namespace

TORCH_LIBRARY(lowcomm, m) {
  m.def("block_topk(Tensor matrix, int chunk_rows, int chunk_cols, int k, int group) -> (Tensor, Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(lowcomm, CPU, m) { m.impl("block_topk", &block_topk); }
