// Index builders of the T5 datasets, registered on `megatron.data._helpers` by register_builders().
//
// Every function checks its arguments before touching any data (exact dtype in native byte order,
// 1-D, C-contiguous and aligned arrays; value ranges; indices within bounds; int64 overflow) and
// raises ValueError naming the function and the argument. Long loops run without the GIL; the
// results are new numpy arrays. All results are pure functions of the arguments (and the seed):
// the only randomness is std::mt19937_64, with our own unbiased bounded draws, and the floating
// point is plain IEEE double arithmetic in a fixed order (ISO C++17: no contraction into FMA).
//
// build_sample_idx(sizes int32[N], doc_idx int64[M], seq_length, num_epochs, tokens_per_epoch,
//                  drop_last_partial_sequence=True, add_extra_token_to_sequence=True)
//     -> int64[num_samples + 1, 2]
//   The packed-sample index of Megatron's GPTDataset. The stream is the tokens of documents
//   doc_idx[0], doc_idx[1], ... back to back; only its first total = num_epochs * tokens_per_epoch
//   tokens are used (the stream must hold at least that many). With extra = 1 if
//   add_extra_token_to_sequence else 0 and usable = total - extra, num_samples is
//   floor(usable / seq_length) (ceil without drop_last_partial_sequence, in integers where
//   Megatron rounds through float32; 0 if usable <= 0).
//   Sample j starts at stream position p_j = j * seq_length and holds tokens
//   [p_j, p_j + seq_length + extra) (the extra token is the first of sample j + 1); the last
//   sample of a ceil count ends at the end of the used stream (p_num_samples = usable).
//   Row j = (position in doc_idx, offset in that document) of p_j, exactly as Megatron writes it:
//   row 0 = (0, 0); otherwise the document is the one holding token p_j - 1 + extra (so empty
//   documents are never named) and offset = p_j - (tokens before that document): with extra = 1
//   the offset of token p_j, with extra = 0 one past the last token of sample j - 1 (it may equal
//   the document's size). A sample spans row j to row j + 1: tokens from (row j) up to offset
//   row[j+1][1] + extra of document row[j+1][0].
//
// build_blending_indices(weights float64[K], size) -> (int32[size], int64[size])
//   Weights must be finite and >= 0 with a positive (finite) sum; they are divided by their sum,
//   added up left to right. Step i (0-based) takes the dataset k with the largest
//   w[k] * (i + 1) - taken[k] (ties: lowest k); dataset_index[i] = k and
//   dataset_sample_index[i] = taken[k] (then taken[k] += 1). A dataset is never more than
//   1 - 1/K samples ahead of w[k] * (i + 1) (the errors sum to 1, so the chosen one is >= 1/K),
//   but it can fall slightly more than one sample behind (43/42 for weights 225:144:4:4:1).
//   Two datasets stay within 1/2. 1 <= K <= 2^31 - 1; O(size * K) time.
//
// build_exhaustive_blending_indices(sizes int64[K]) -> (int32[total], int64[total])
//   The same rule with w[k] = sizes[k] / total (total = sum(sizes)), skipping exhausted datasets,
//   so that sample s of dataset k appears exactly once for every s < sizes[k].
//
// build_mapping(docs int64[D+1], sizes int32[S], num_epochs, max_num_samples, max_seq_length,
//               short_seq_prob, seed, min_num_sent=2, long_sentence_len=512) -> uint64[n, 3]
//   Megatron's BERT/T5 sentence packing. Document d holds sentences [docs[d], docs[d+1]) (docs
//   non-decreasing, docs[0] >= 0, docs[D] <= S). A document is skipped if it has fewer than
//   min_num_sent sentences or any sentence longer than long_sentence_len tokens (Megatron's
//   LONG_SENTENCE_LEN, 512, for documents of two or more sentences; here for all). For each epoch,
//   for each kept document, sentences are grouped greedily: a row is started with a target length
//   (max_seq_length, or with probability short_seq_prob a uniform length in [2, max_seq_length]),
//   and closed after the first sentence where its token count has reached the target, it holds
//   >= min_num_sent sentences and >= min_num_sent sentences remain in the document; else at the
//   end of the document. So every row has >= min_num_sent sentences (Megatron asks 2 to remain
//   whatever min_num_sent is); for min_num_sent = 2 the grouping is Megatron's. Row = (first,
//   one past the last sentence, target length). Rows stop at exactly max_num_samples (Megatron
//   finishes the epoch), after num_epochs epochs, or after an epoch that made no row. The rows are
//   then shuffled (Fisher-Yates). One std::mt19937_64(seed) drives everything, in this order: per
//   row, if short_seq_prob > 0, u = (g() >> 11) * 2^-53 and, if u < short_seq_prob, the length
//   2 + below(max_seq_length - 1); then for i = n-1 .. 1, swap rows i and below(i + 1).
//   below(m) draws r = g() until r >= (2^64 - m) mod m and returns r mod m.

#include "builders.h"

#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>

#include <cmath>
#include <cstdint>
#include <limits>
#include <random>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

namespace py = pybind11;

namespace {

constexpr int64_t kInt64Max = std::numeric_limits<int64_t>::max();
constexpr int64_t kInt32Max = std::numeric_limits<int32_t>::max();

// Raises ValueError("fn(): argument 'arg': ..."). Safe without the GIL: the Python exception is
// only set when pybind11 translates it, with the GIL held again.
template <typename... Args>
[[noreturn]] void fail(const char *fn, const char *arg, Args &&...args) {
  std::ostringstream msg;
  msg << fn << "(): argument '" << arg << "': ";
  (msg << ... << args);
  throw py::value_error(msg.str());
}

template <typename T> const char *dtype_name();
template <> const char *dtype_name<int32_t>() { return "int32"; }
template <> const char *dtype_name<int64_t>() { return "int64"; }
template <> const char *dtype_name<double>() { return "float64"; }

// The array `obj` as a T array of `ndim` dimensions, C-contiguous and aligned; never converts.
template <typename T>
py::array_t<T> take_array(const char *fn, const char *arg, const py::object &obj, int ndim) {
  if (!py::isinstance<py::array>(obj)) {
    fail(fn, arg, "must be a numpy.ndarray of ", dtype_name<T>(), ", got ",
         Py_TYPE(obj.ptr())->tp_name);
  }
  auto a = py::reinterpret_borrow<py::array>(obj);
  if (!py::array_t<T>::check_(a)) {
    fail(fn, arg, "must have dtype ", dtype_name<T>(), " (native byte order), got ",
         std::string(py::str(a.dtype())));
  }
  if (a.ndim() != ndim) fail(fn, arg, "must be ", ndim, "-D, got ", a.ndim(), "-D");
  if (!(a.flags() & py::array::c_style)) {
    fail(fn, arg, "must be C-contiguous (use numpy.ascontiguousarray)");
  }
  if (!(a.flags() & py::detail::npy_api::NPY_ARRAY_ALIGNED_)) fail(fn, arg, "must be aligned");
  return py::reinterpret_borrow<py::array_t<T>>(a);
}

// Raised by the main loops if an array changed after it was validated (another thread wrote it).
[[noreturn]] void changed(const char *fn, const char *arg) {
  fail(fn, arg, "was modified by another thread during the call");
}

// ------------------------------------------------------------------------------------------------
// build_sample_idx

py::array_t<int64_t> build_sample_idx(const py::object &sizes_obj, const py::object &doc_idx_obj,
                                      int64_t seq_length, int64_t num_epochs,
                                      int64_t tokens_per_epoch, bool drop_last_partial_sequence,
                                      bool add_extra_token_to_sequence) {
  const char *fn = "build_sample_idx";
  const auto sizes_arr = take_array<int32_t>(fn, "sizes", sizes_obj, 1);
  const auto doc_idx_arr = take_array<int64_t>(fn, "doc_idx", doc_idx_obj, 1);
  if (seq_length < 1) fail(fn, "seq_length", "must be >= 1, got ", seq_length);
  if (num_epochs < 1) fail(fn, "num_epochs", "must be >= 1, got ", num_epochs);
  if (tokens_per_epoch < 0) fail(fn, "tokens_per_epoch", "must be >= 0, got ", tokens_per_epoch);
  if (tokens_per_epoch > 0 && num_epochs > kInt64Max / tokens_per_epoch) {
    fail(fn, "tokens_per_epoch", "num_epochs * tokens_per_epoch = ", num_epochs, " * ",
         tokens_per_epoch, " overflows int64");
  }
  const int64_t total = num_epochs * tokens_per_epoch;
  const int64_t extra = add_extra_token_to_sequence ? 1 : 0;
  const int64_t usable = total - extra;  // >= -1
  int64_t num_samples = 0;
  if (usable > 0) {
    num_samples = usable / seq_length;
    if (!drop_last_partial_sequence && usable % seq_length != 0) ++num_samples;
  }
  const int32_t *sizes = sizes_arr.data();
  const int64_t *doc_idx = doc_idx_arr.data();
  const int64_t n_sizes = sizes_arr.shape(0), n_docs = doc_idx_arr.shape(0);

  {
    py::gil_scoped_release nogil;
    for (int64_t i = 0; i < n_sizes; ++i) {
      if (sizes[i] < 0) fail(fn, "sizes", "sizes[", i, "] = ", sizes[i], " is negative");
    }
    int64_t stream = 0;  // saturates at kInt64Max: only compared with total
    for (int64_t k = 0; k < n_docs; ++k) {
      const int64_t d = doc_idx[k];
      if (d < 0 || d >= n_sizes) {
        fail(fn, "doc_idx", "doc_idx[", k, "] = ", d, " is not an index into sizes (length ",
             n_sizes, ")");
      }
      stream = sizes[d] > kInt64Max - stream ? kInt64Max : stream + sizes[d];
    }
    if (stream < total) {
      fail(fn, "tokens_per_epoch", "num_epochs * tokens_per_epoch = ", total,
           " exceeds the ", stream, " tokens of the documents listed in doc_idx");
    }
  }

  py::array_t<int64_t> out({num_samples + 1, int64_t{2}});
  int64_t *row = out.mutable_data();
  {
    py::gil_scoped_release nogil;
    // The size of doc_idx[k], checked again in case the arrays changed since the checks above.
    auto doc_size = [&](int64_t k) -> int64_t {
      if (k >= n_docs) changed(fn, "doc_idx");
      const int64_t d = doc_idx[k];
      if (d < 0 || d >= n_sizes) changed(fn, "doc_idx");
      const int64_t s = sizes[d];
      if (s < 0) changed(fn, "sizes");
      return s;
    };
    row[0] = 0;
    row[1] = 0;
    int64_t k = 0, before = 0;  // document position, tokens of the documents before it
    int64_t size_k = n_docs > 0 ? doc_size(0) : 0;
    const int64_t full = usable > 0 ? usable / seq_length : 0;  // samples starting at j * L
    for (int64_t j = 1; j <= num_samples; ++j) {
      const int64_t p = j <= full ? j * seq_length : usable;  // j * L <= usable: no overflow
      const int64_t q = p - 1 + extra;                         // the token that names the document
      while (before + size_k <= q) {
        before += size_k;
        size_k = doc_size(++k);
      }
      row[2 * j] = k;
      row[2 * j + 1] = p - before;
    }
  }
  return out;
}

// ------------------------------------------------------------------------------------------------
// Blending

// The error-minimising interleave of K datasets with normalised weights w; with caps (exhaustive
// blending), dataset k is dropped once caps[k] samples were taken. Runs without the GIL.
void blend(const std::vector<double> &w, const int64_t *caps, int64_t size, int32_t *dataset_index,
           int64_t *dataset_sample_index) {
  const int64_t K = static_cast<int64_t>(w.size());
  std::vector<int64_t> taken(K, 0);
  std::vector<int32_t> active;  // datasets that can still be chosen, ascending (caps only)
  if (caps != nullptr) {
    for (int64_t k = 0; k < K; ++k) {
      if (caps[k] > 0) active.push_back(static_cast<int32_t>(k));
    }
  }
  for (int64_t i = 0; i < size; ++i) {
    const double n = static_cast<double>(i + 1);
    int64_t best = -1;
    double best_error = -std::numeric_limits<double>::infinity();
    if (caps == nullptr) {
      for (int64_t k = 0; k < K; ++k) {
        const double error = w[k] * n - static_cast<double>(taken[k]);
        if (error > best_error) {
          best_error = error;
          best = k;
        }
      }
    } else {
      size_t best_pos = 0;
      for (size_t a = 0; a < active.size(); ++a) {
        const int64_t k = active[a];
        const double error = w[k] * n - static_cast<double>(taken[k]);
        if (error > best_error) {
          best_error = error;
          best = k;
          best_pos = a;
        }
      }
      if (best >= 0 && taken[best] + 1 == caps[best]) {
        active.erase(active.begin() + static_cast<std::ptrdiff_t>(best_pos));
      }
    }
    if (best < 0) best = 0;  // unreachable: the weights are finite and one is positive
    dataset_index[i] = static_cast<int32_t>(best);
    dataset_sample_index[i] = taken[best]++;
  }
}

py::tuple build_blending_indices(const py::object &weights_obj, int64_t size) {
  const char *fn = "build_blending_indices";
  const auto weights_arr = take_array<double>(fn, "weights", weights_obj, 1);
  const int64_t K = weights_arr.shape(0);
  if (K == 0) fail(fn, "weights", "is empty: there must be at least one dataset");
  if (K > kInt32Max) fail(fn, "weights", "has ", K, " datasets, more than 2^31 - 1");
  if (size < 0) fail(fn, "size", "must be >= 0, got ", size);
  const double *weights = weights_arr.data();
  std::vector<double> w(static_cast<size_t>(K));
  {
    py::gil_scoped_release nogil;
    double sum = 0.0;
    for (int64_t k = 0; k < K; ++k) {
      const double x = weights[k];
      if (!std::isfinite(x) || x < 0.0) {
        fail(fn, "weights", "weights[", k, "] = ", x, " is not a finite number >= 0");
      }
      w[k] = x;
      sum += x;
    }
    if (!(sum > 0.0)) fail(fn, "weights", "are all zero: at least one must be positive");
    if (!std::isfinite(sum)) fail(fn, "weights", "sum to infinity in float64");
    for (double &x : w) x /= sum;
  }
  py::array_t<int32_t> dataset_index(size);
  py::array_t<int64_t> dataset_sample_index(size);
  int32_t *di = dataset_index.mutable_data();
  int64_t *dsi = dataset_sample_index.mutable_data();
  {
    py::gil_scoped_release nogil;
    blend(w, nullptr, size, di, dsi);
  }
  return py::make_tuple(dataset_index, dataset_sample_index);
}

py::tuple build_exhaustive_blending_indices(const py::object &sizes_obj) {
  const char *fn = "build_exhaustive_blending_indices";
  const auto sizes_arr = take_array<int64_t>(fn, "sizes", sizes_obj, 1);
  const int64_t K = sizes_arr.shape(0);
  if (K == 0) fail(fn, "sizes", "is empty: there must be at least one dataset");
  if (K > kInt32Max) fail(fn, "sizes", "has ", K, " datasets, more than 2^31 - 1");
  const int64_t *sizes = sizes_arr.data();
  std::vector<int64_t> caps(static_cast<size_t>(K));
  int64_t total = 0;
  {
    py::gil_scoped_release nogil;
    for (int64_t k = 0; k < K; ++k) {
      caps[k] = sizes[k];
      if (caps[k] < 0) fail(fn, "sizes", "sizes[", k, "] = ", caps[k], " is negative");
      if (caps[k] > kInt64Max - total) fail(fn, "sizes", "the sum of sizes overflows int64");
      total += caps[k];
    }
  }
  py::array_t<int32_t> dataset_index(total);
  py::array_t<int64_t> dataset_sample_index(total);
  int32_t *di = dataset_index.mutable_data();
  int64_t *dsi = dataset_sample_index.mutable_data();
  if (total > 0) {
    py::gil_scoped_release nogil;
    std::vector<double> w(static_cast<size_t>(K));
    for (int64_t k = 0; k < K; ++k) {
      w[k] = static_cast<double>(caps[k]) / static_cast<double>(total);
    }
    blend(w, caps.data(), total, di, dsi);
  }
  return py::make_tuple(dataset_index, dataset_sample_index);
}

// ------------------------------------------------------------------------------------------------
// build_mapping

// Uniform in [0, m), m >= 1, without modulo bias.
uint64_t below(std::mt19937_64 &gen, uint64_t m) {
  const uint64_t threshold = (0 - m) % m;  // 2^64 mod m
  uint64_t r;
  do {
    r = gen();
  } while (r < threshold);
  return r % m;
}

struct MappingArgs {
  const char *fn;
  std::vector<int64_t> docs;  // validated copy
  std::vector<char> keep;     // per document
  const int32_t *sizes;
  int64_t n_sizes, num_epochs;
  uint64_t max_num_samples;
  int64_t max_seq_length, min_num_sent;
  double short_seq_prob;
};

// One pass over the epochs with generator `gen`; writes the rows to `out` unless null. Stops at
// `cap` rows. Returns the number of rows.
uint64_t map_sentences(const MappingArgs &a, std::mt19937_64 &gen, uint64_t cap, uint64_t *out) {
  const int64_t n_doc = static_cast<int64_t>(a.docs.size()) - 1;
  uint64_t count = 0;
  for (int64_t epoch = 0; epoch < a.num_epochs && count < cap; ++epoch) {
    const uint64_t at_epoch_start = count;
    for (int64_t d = 0; d < n_doc && count < cap; ++d) {
      if (!a.keep[d]) continue;
      const int64_t last = a.docs[d + 1];
      int64_t s = a.docs[d];
      while (s < last && count < cap) {
        int64_t target = a.max_seq_length;
        if (a.short_seq_prob > 0.0) {
          const double u = static_cast<double>(gen() >> 11) * 0x1.0p-53;
          if (u < a.short_seq_prob) {
            target = 2 + static_cast<int64_t>(
                             below(gen, static_cast<uint64_t>(a.max_seq_length - 1)));
          }
        }
        const int64_t start = s;
        int64_t tokens = 0;  // stops growing at the target: no overflow
        for (;;) {
          if (tokens < target) tokens += a.sizes[s];
          ++s;
          if (s == last || (tokens >= target && s - start >= a.min_num_sent &&
                            last - s >= a.min_num_sent)) {
            break;
          }
        }
        if (out != nullptr) {
          out[3 * count] = static_cast<uint64_t>(start);
          out[3 * count + 1] = static_cast<uint64_t>(s);
          out[3 * count + 2] = static_cast<uint64_t>(target);
        }
        ++count;
      }
    }
    if (count == at_epoch_start) break;  // every document is skipped: so will every epoch be
  }
  return count;
}

py::array_t<uint64_t> build_mapping(const py::object &docs_obj, const py::object &sizes_obj,
                                    int64_t num_epochs, int64_t max_num_samples,
                                    int64_t max_seq_length, double short_seq_prob, int64_t seed,
                                    int64_t min_num_sent, int64_t long_sentence_len) {
  MappingArgs a;
  a.fn = "build_mapping";
  const char *fn = a.fn;
  const auto docs_arr = take_array<int64_t>(fn, "docs", docs_obj, 1);
  const auto sizes_arr = take_array<int32_t>(fn, "sizes", sizes_obj, 1);
  if (docs_arr.shape(0) < 1) fail(fn, "docs", "is empty: it needs at least the final boundary");
  if (num_epochs < 1) fail(fn, "num_epochs", "must be >= 1, got ", num_epochs);
  if (max_num_samples < 0) fail(fn, "max_num_samples", "must be >= 0, got ", max_num_samples);
  if (max_seq_length < 2 || max_seq_length > kInt32Max) {
    fail(fn, "max_seq_length", "must be in [2, 2^31 - 1], got ", max_seq_length);
  }
  if (!(short_seq_prob >= 0.0 && short_seq_prob <= 1.0)) {
    fail(fn, "short_seq_prob", "must be in [0, 1], got ", short_seq_prob);
  }
  if (seed < 0) fail(fn, "seed", "must be >= 0, got ", seed);
  if (min_num_sent < 1) fail(fn, "min_num_sent", "must be >= 1, got ", min_num_sent);
  if (long_sentence_len < 1) {
    fail(fn, "long_sentence_len", "must be >= 1, got ", long_sentence_len);
  }
  a.sizes = sizes_arr.data();
  a.n_sizes = sizes_arr.shape(0);
  a.num_epochs = num_epochs;
  a.max_num_samples = static_cast<uint64_t>(max_num_samples);
  a.max_seq_length = max_seq_length;
  a.min_num_sent = min_num_sent;
  a.short_seq_prob = short_seq_prob;
  const int64_t *docs = docs_arr.data();
  const int64_t n_bounds = docs_arr.shape(0);

  uint64_t n = 0;
  {
    py::gil_scoped_release nogil;
    a.docs.assign(docs, docs + n_bounds);
    for (int64_t i = 0; i < a.n_sizes; ++i) {
      if (a.sizes[i] < 0) fail(fn, "sizes", "sizes[", i, "] = ", a.sizes[i], " is negative");
    }
    if (a.docs[0] < 0) fail(fn, "docs", "docs[0] = ", a.docs[0], " is negative");
    for (int64_t d = 0; d + 1 < n_bounds; ++d) {
      if (a.docs[d + 1] < a.docs[d]) {
        fail(fn, "docs", "must be non-decreasing: docs[", d, "] = ", a.docs[d], " > docs[", d + 1,
             "] = ", a.docs[d + 1]);
      }
    }
    if (a.docs[n_bounds - 1] > a.n_sizes) {
      fail(fn, "docs", "docs[", n_bounds - 1, "] = ", a.docs[n_bounds - 1],
           " is past the end of sizes (length ", a.n_sizes, ")");
    }
    a.keep.assign(static_cast<size_t>(n_bounds - 1), 0);
    for (int64_t d = 0; d + 1 < n_bounds; ++d) {
      bool keep = a.docs[d + 1] - a.docs[d] >= min_num_sent;
      for (int64_t s = a.docs[d]; keep && s < a.docs[d + 1]; ++s) {
        keep = a.sizes[s] <= long_sentence_len;
      }
      a.keep[d] = keep;
    }
    std::mt19937_64 gen(static_cast<uint64_t>(seed));
    n = map_sentences(a, gen, a.max_num_samples, nullptr);
  }
  if (n > static_cast<uint64_t>(kInt64Max / 24)) fail(fn, "max_num_samples", n, " rows is too many");
  py::array_t<uint64_t> out({static_cast<int64_t>(n), int64_t{3}});
  uint64_t *rows = out.mutable_data();
  {
    py::gil_scoped_release nogil;
    std::mt19937_64 gen(static_cast<uint64_t>(seed));
    // The same pass again (the copy of docs cannot change; sizes only steers the grouping).
    if (map_sentences(a, gen, n, rows) != n) changed(fn, "sizes");
    for (uint64_t i = n > 0 ? n - 1 : 0; i > 0; --i) {
      const uint64_t j = below(gen, i + 1);
      for (int c = 0; c < 3; ++c) std::swap(rows[3 * i + c], rows[3 * j + c]);
    }
  }
  return out;
}

}  // namespace

void register_builders(py::module_ &m) {
  m.def("build_sample_idx", &build_sample_idx, py::arg("sizes"), py::arg("doc_idx"),
        py::arg("seq_length"), py::arg("num_epochs"), py::arg("tokens_per_epoch"),
        py::arg("drop_last_partial_sequence") = true,
        py::arg("add_extra_token_to_sequence") = true,
        "Packed-sample index (Megatron GPTDataset semantics) -> int64[num_samples + 1, 2].\n\n"
        "The documents doc_idx[0], doc_idx[1], ... (int64 ids into the int32 `sizes`) are packed\n"
        "back to back and the first num_epochs * tokens_per_epoch tokens of that stream are cut\n"
        "into samples of seq_length tokens (+1 token shared with the next sample when\n"
        "add_extra_token_to_sequence). num_samples = floor((total - extra) / seq_length), or\n"
        "ceil when not drop_last_partial_sequence (the last sample then ends at the end of the\n"
        "stream). Row j = (position in doc_idx, token offset in that document) where sample j\n"
        "starts; sample j runs up to offset row[j+1][1] + extra of document row[j+1][0].\n"
        "Raises ValueError on invalid arguments.");
  m.def("build_blending_indices", &build_blending_indices, py::arg("weights"), py::arg("size"),
        "Error-minimising interleave -> (dataset_index int32[size], dataset_sample_index "
        "int64[size]).\n\n"
        "weights (float64[K], finite, >= 0, not all zero) are normalised by their sum. Step i\n"
        "takes the dataset k with the largest w[k] * (i + 1) - taken[k] (ties: the lowest k);\n"
        "dataset_sample_index[i] is the number of samples taken from k before. Raises ValueError\n"
        "on invalid arguments.");
  m.def("build_mapping", &build_mapping, py::arg("docs"), py::arg("sizes"), py::arg("num_epochs"),
        py::arg("max_num_samples"), py::arg("max_seq_length"), py::arg("short_seq_prob"),
        py::arg("seed"), py::arg("min_num_sent") = 2, py::arg("long_sentence_len") = 512,
        "Sentence-packing samples mapping (Megatron BERT/T5) -> uint64[n, 3].\n\n"
        "docs (int64[D+1]) are the sentence boundaries of the documents, sizes (int32[S]) the\n"
        "sentence lengths. Documents with fewer than min_num_sent sentences or a sentence longer\n"
        "than long_sentence_len are skipped. Per epoch and document, consecutive sentences are\n"
        "grouped until the group reaches its target length (max_seq_length, or with probability\n"
        "short_seq_prob uniform in [2, max_seq_length]) with at least min_num_sent sentences in\n"
        "it and left in the document, or the document ends. Row = (first sentence, one past the\n"
        "last sentence, target length). At most max_num_samples rows and num_epochs epochs; the\n"
        "rows are shuffled. Deterministic in `seed` (std::mt19937_64). Raises ValueError on\n"
        "invalid arguments.");
  m.def("build_exhaustive_blending_indices", &build_exhaustive_blending_indices,
        py::arg("sizes"),
        "Blend every sample of every dataset exactly once -> (dataset_index int32[total],\n"
        "dataset_sample_index int64[total]), total = sum(sizes).\n\n"
        "build_blending_indices' rule with weights sizes / total, never choosing an exhausted\n"
        "dataset. sizes: int64[K], >= 0. Raises ValueError on invalid arguments.");
}
