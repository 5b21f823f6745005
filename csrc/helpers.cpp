// The mmap reader of Megatron's indexed datasets, and the `_helpers` extension module.
//
// `IndexedBin(idx_path, bin_path)` opens a `.idx`/`.bin` pair, validates every field of the index
// against the files before handing anything out, and returns zero-copy, read-only numpy views of
// the index arrays and of the tokens. Two on-disk formats are read:
//
//   MMIDIDX v1 (Megatron 'mmap', byte for byte):
//     magic "MMIDIDX\0\0" (9 bytes) | u64 version = 1 | u8 dtype code | u64 N | u64 D |
//     int32 sequence_lengths[N] | int64 sequence_pointers[N] (bytes into .bin) |
//     int64 document_indices[D] (0 ... N, monotone)
//   TNTIDX v1 (legacy 'lazy'/'cached', read-only):
//     magic "TNTIDX\0\0" (8 bytes) | u64 version = 1 | u64 dtype code | u64 element size |
//     u64 N | u64 S | u64 D | int64 dim_offsets[N+1] | int64 data_offsets[N+1] (elements) |
//     int64 sizes[S] | int64 document_indices[D]
//
// A legacy index is converted once to the MMIDIDX arrays (lengths, byte pointers) so that the rest
// of the code sees one shape. A corrupt file must never crash the process: every count is checked
// against the file size (with overflow checks) and every pointer against the .bin size, and each
// failure raises `CorruptIndexError` (a ValueError) naming the file and the field.
//
// The index builders of the datasets live in builders.cpp and are registered here.

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>

#include <cerrno>
#include <cstdint>
#include <cstring>
#include <memory>
#include <sstream>
#include <stdexcept>
#include <string>
#include <vector>

#include "builders.h"

namespace py = pybind11;

namespace {

struct CorruptIndex : std::runtime_error {
  using std::runtime_error::runtime_error;
};

// Raised while the GIL is released; turned into OSError (FileNotFoundError, ...) with the path.
struct OsFailure {
  int err;
  std::string path;
};

template <typename... Args>
[[noreturn]] void corrupt(const std::string &path, const std::string &field, Args &&...args) {
  std::ostringstream msg;
  msg << path << ": corrupt index field '" << field << "': ";
  (msg << ... << args);
  throw CorruptIndex(msg.str());
}

// Read-only mapping of a whole file. An empty file has no mapping (data() == nullptr).
class MappedFile {
 public:
  explicit MappedFile(const std::string &path) : path_(path) {
    int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
    if (fd < 0) throw OsFailure{errno, path};
    struct stat st;
    if (::fstat(fd, &st) != 0) {
      int err = errno;
      ::close(fd);
      throw OsFailure{err, path};
    }
    if (!S_ISREG(st.st_mode)) {
      ::close(fd);
      throw OsFailure{EISDIR, path};
    }
    size_ = static_cast<uint64_t>(st.st_size);
    if (size_ > 0) {
      void *p = ::mmap(nullptr, size_, PROT_READ, MAP_SHARED, fd, 0);
      if (p == MAP_FAILED) {
        int err = errno;
        ::close(fd);
        throw OsFailure{err, path};
      }
      data_ = static_cast<const uint8_t *>(p);
    }
    ::close(fd);
  }
  ~MappedFile() {
    if (data_ != nullptr) ::munmap(const_cast<uint8_t *>(data_), size_);
  }
  MappedFile(const MappedFile &) = delete;
  MappedFile &operator=(const MappedFile &) = delete;

  const uint8_t *data() const { return data_; }
  uint64_t size() const { return size_; }
  const std::string &path() const { return path_; }

 private:
  std::string path_;
  const uint8_t *data_ = nullptr;
  uint64_t size_ = 0;
};

// Bounds-checked little-endian cursor over the index file.
class Cursor {
 public:
  Cursor(const MappedFile &f) : f_(f) {}
  const uint8_t *take(uint64_t nbytes, const char *field) {
    if (nbytes > f_.size() - pos_) {
      corrupt(f_.path(), field, "needs ", nbytes, " bytes at offset ", pos_,
              " but the file has only ", f_.size(), " bytes (truncated?)");
    }
    const uint8_t *p = f_.data() + pos_;
    pos_ += nbytes;
    return p;
  }
  template <typename T>
  T scalar(const char *field) {
    T v;
    std::memcpy(&v, take(sizeof(T), field), sizeof(T));
    return v;
  }
  uint64_t pos() const { return pos_; }

 private:
  const MappedFile &f_;
  uint64_t pos_ = 0;
};

// Byte size of `count` items of `itemsize`, or a CorruptIndex if it could not fit in the file.
uint64_t array_bytes(const MappedFile &f, const char *field, uint64_t count, uint64_t itemsize) {
  if (count > f.size() / itemsize) {
    corrupt(f.path(), field, "count ", count, " of ", itemsize,
            "-byte items overflows the file of ", f.size(), " bytes");
  }
  return count * itemsize;
}

// numpy dtype string and size for Megatron's dtype codes (same in MMIDIDX and TNTIDX except that
// TNTIDX's code 7 is float64, which we never write).
struct DtypeInfo {
  const char *format;
  uint64_t itemsize;
};

bool dtype_from_code(uint64_t code, bool legacy, DtypeInfo *out) {
  switch (code) {
    case 1: *out = {"u1", 1}; return true;
    case 2: *out = {"i1", 1}; return true;
    case 3: *out = {"i2", 2}; return true;
    case 4: *out = {"i4", 4}; return true;
    case 5: *out = {"i8", 8}; return true;
    case 6: *out = {"f8", 8}; return true;
    case 7: *out = legacy ? DtypeInfo{"f8", 8} : DtypeInfo{"f4", 4}; return true;
    case 8: *out = {"u2", 2}; return true;
    default: return false;
  }
}

const char kMmapMagic[9] = {'M', 'M', 'I', 'D', 'I', 'D', 'X', '\0', '\0'};
const char kLegacyMagic[8] = {'T', 'N', 'T', 'I', 'D', 'X', '\0', '\0'};

// MMIDIDX puts the int32 lengths at byte 34, so the index arrays are not aligned in the mapping.
// numpy copes with unaligned views; C++ reads them through memcpy (a plain load on x86 and ARM).
template <typename T>
inline T load(const uint8_t *base, uint64_t i) {
  T v;
  std::memcpy(&v, base + i * sizeof(T), sizeof(T));
  return v;
}

}  // namespace

class IndexedBin {
 public:
  // `sequences_are_documents`: accept an index whose document_indices is just [0] although it
  // holds sequences (builders that never end documents, e.g. CPM-2's) and make every sequence
  // its own document.
  // `bin_size` >= 0: the data lives elsewhere (an object in S3, read by the Python side): the
  // index is validated against that size and `bin_path` only names it in messages; tokens are
  // not served here.
  IndexedBin(const std::string &idx_path, const std::string &bin_path,
             bool sequences_are_documents, int64_t bin_size)
      : sequences_are_documents_(sequences_are_documents), bin_path_(bin_path) {
    try {
      py::gil_scoped_release release;
      idx_ = std::make_unique<MappedFile>(idx_path);
      if (bin_size < 0) {
        bin_ = std::make_unique<MappedFile>(bin_path);
        bin_size_ = bin_->size();
      } else {
        bin_size_ = static_cast<uint64_t>(bin_size);
      }
      Cursor c(*idx_);
      const uint8_t *magic = c.take(8, "magic");
      if (std::memcmp(magic, kLegacyMagic, 8) == 0) {
        legacy_ = true;
        parse_legacy(c);
      } else if (std::memcmp(magic, kMmapMagic, 8) == 0 &&
                 std::memcmp(c.take(1, "magic"), kMmapMagic + 8, 1) == 0) {
        parse_mmap(c);
      } else {
        corrupt(idx_path, "magic",
                "not a Megatron index (expected MMIDIDX\\x00\\x00 or legacy TNTIDX\\x00\\x00)");
      }
      check_document_indices();
      check_sequences();
    } catch (const OsFailure &e) {
      errno = e.err;
      PyErr_SetFromErrnoWithFilename(PyExc_OSError, e.path.c_str());
      throw py::error_already_set();
    }
  }

  py::array sequence_lengths(py::object self) const {
    return view(self, "i4", lengths_, n_, true);
  }
  py::array sequence_pointers(py::object self) const {
    return view(self, "i8", pointers_, n_, true);
  }
  py::array document_indices(py::object self) const {
    return view(self, "i8", doc_idx_, d_, true);
  }

  // Tokens [offset, offset + length) of sequence i; length < 0 means "to the end".
  py::array get(py::object self, int64_t i, int64_t offset, int64_t length) const {
    if (i < 0) i += static_cast<int64_t>(n_);
    if (i < 0 || static_cast<uint64_t>(i) >= n_) {
      throw py::index_error("sequence index " + std::to_string(i) + " out of range for " +
                            std::to_string(n_) + " sequences in " + idx_->path());
    }
    int64_t len = seq_length(i);
    if (length < 0) length = len - offset;
    if (offset < 0 || offset > len || length < 0 || length > len - offset) {
      throw py::index_error("offset " + std::to_string(offset) + " and length " +
                            std::to_string(length) + " out of range for sequence " +
                            std::to_string(i) + " of length " + std::to_string(len));
    }
    return tokens(self, static_cast<uint64_t>(pointer(i)) + offset * dtype_.itemsize, length);
  }

  // One view per sequence of [start, stop).
  py::list get_range(py::object self, int64_t start, int64_t stop) const {
    if (start < 0 || stop < start || static_cast<uint64_t>(stop) > n_) {
      throw py::index_error("range [" + std::to_string(start) + ", " + std::to_string(stop) +
                            ") out of range for " + std::to_string(n_) + " sequences");
    }
    py::list out(stop - start);
    for (int64_t i = start; i < stop; ++i) {
      out[i - start] = tokens(self, static_cast<uint64_t>(pointer(i)), seq_length(i));
    }
    return out;
  }

  uint64_t num_sequences() const { return n_; }
  uint64_t num_documents() const { return d_ - 1; }
  int dtype_code() const { return static_cast<int>(code_); }
  py::dtype dtype() const { return py::dtype(std::string("<") + dtype_.format); }
  bool legacy() const { return legacy_; }
  uint64_t bin_size() const { return bin_size_; }
  bool mapped() const { return bin_ != nullptr; }
  uint64_t num_tokens() const { return total_tokens_; }

 private:
  void parse_mmap(Cursor &c) {
    const std::string &path = idx_->path();
    uint64_t version = c.scalar<uint64_t>("version");
    if (version != 1) corrupt(path, "version", "is ", version, ", only version 1 is supported");
    code_ = c.scalar<uint8_t>("dtype_code");
    if (!dtype_from_code(code_, false, &dtype_)) {
      corrupt(path, "dtype_code", "is ", code_, ", expected 1..8");
    }
    n_ = c.scalar<uint64_t>("sequence_count");
    d_ = c.scalar<uint64_t>("document_count");
    uint64_t len_bytes = array_bytes(*idx_, "sequence_count", n_, 4);
    uint64_t ptr_bytes = array_bytes(*idx_, "sequence_count", n_, 8);
    uint64_t doc_bytes = array_bytes(*idx_, "document_count", d_, 8);
    uint64_t expected = c.pos() + len_bytes + ptr_bytes + doc_bytes;  // each < size: no overflow
    if (expected != idx_->size()) {
      if (expected + n_ == idx_->size()) {
        corrupt(path, "sequence_modes",
                "this is a multimodal index (per-sequence modes), which is not supported");
      }
      corrupt(path, "sequence_count", "N=", n_, " and D=", d_, " need a file of ", expected,
              " bytes but it has ", idx_->size(), " (truncated or not an index)");
    }
    lengths_ = c.take(len_bytes, "sequence_lengths");
    pointers_ = c.take(ptr_bytes, "sequence_pointers");
    doc_idx_ = c.take(doc_bytes, "document_indices");
  }

  void parse_legacy(Cursor &c) {
    const std::string &path = idx_->path();
    uint64_t version = c.scalar<uint64_t>("version");
    if (version != 1) corrupt(path, "version", "is ", version, ", only version 1 is supported");
    code_ = c.scalar<uint64_t>("dtype_code");
    if (!dtype_from_code(code_, true, &dtype_)) {
      corrupt(path, "dtype_code", "is ", code_, ", expected 1..8");
    }
    uint64_t element_size = c.scalar<uint64_t>("element_size");
    if (element_size != dtype_.itemsize) {
      corrupt(path, "element_size", "is ", element_size, " but dtype code ", code_, " has ",
              dtype_.itemsize, "-byte items");
    }
    n_ = c.scalar<uint64_t>("sequence_count");
    uint64_t s = c.scalar<uint64_t>("sizes_count");
    d_ = c.scalar<uint64_t>("document_count");
    if (n_ >= idx_->size()) corrupt(path, "sequence_count", "N=", n_, " overflows the file");
    uint64_t off_bytes = array_bytes(*idx_, "sequence_count", n_ + 1, 8);
    uint64_t size_bytes = array_bytes(*idx_, "sizes_count", s, 8);
    uint64_t doc_bytes = array_bytes(*idx_, "document_count", d_, 8);
    uint64_t expected = c.pos() + 2 * off_bytes + size_bytes + doc_bytes;
    if (expected != idx_->size()) {
      corrupt(path, "sequence_count", "N=", n_, ", S=", s, " and D=", d_, " need a file of ",
              expected, " bytes but it has ", idx_->size(), " (truncated or not an index)");
    }
    std::vector<int64_t> dim_off(n_ + 1), data_off(n_ + 1), sizes(s);
    std::memcpy(dim_off.data(), c.take(off_bytes, "dim_offsets"), off_bytes);
    std::memcpy(data_off.data(), c.take(off_bytes, "data_offsets"), off_bytes);
    if (s > 0) std::memcpy(sizes.data(), c.take(size_bytes, "sizes"), size_bytes);
    own_doc_idx_.resize(d_);
    if (d_ > 0) std::memcpy(own_doc_idx_.data(), c.take(doc_bytes, "document_indices"), doc_bytes);
    doc_idx_ = reinterpret_cast<const uint8_t *>(own_doc_idx_.data());

    if (data_off[0] != 0) corrupt(path, "data_offsets", "[0] is ", data_off[0], ", expected 0");
    if (dim_off[0] != 0) corrupt(path, "dim_offsets", "[0] is ", dim_off[0], ", expected 0");
    own_lengths_.resize(n_);
    own_pointers_.resize(n_);
    for (uint64_t i = 0; i < n_; ++i) {
      int64_t len = data_off[i + 1] - data_off[i];
      if (data_off[i + 1] < data_off[i] || len > INT32_MAX) {
        corrupt(path, "data_offsets", "[", i + 1, "]=", data_off[i + 1], " after [", i,
                "]=", data_off[i], " (not monotone or sequence too long)");
      }
      if (dim_off[i + 1] != dim_off[i] + 1 || dim_off[i] < 0 ||
          static_cast<uint64_t>(dim_off[i]) >= s) {
        corrupt(path, "dim_offsets", "sequence ", i,
                " is not a 1-D token sequence (only 1-D sequences are supported)");
      }
      if (sizes[dim_off[i]] != len) {
        corrupt(path, "sizes", "[", dim_off[i], "]=", sizes[dim_off[i]], " but data_offsets give ",
                len, " elements for sequence ", i);
      }
      if (static_cast<uint64_t>(data_off[i]) > INT64_MAX / dtype_.itemsize) {
        corrupt(path, "data_offsets", "[", i, "]=", data_off[i], " overflows");
      }
      own_lengths_[i] = static_cast<int32_t>(len);
      own_pointers_[i] = data_off[i] * static_cast<int64_t>(dtype_.itemsize);
    }
    lengths_ = reinterpret_cast<const uint8_t *>(own_lengths_.data());
    pointers_ = reinterpret_cast<const uint8_t *>(own_pointers_.data());
  }

  int32_t seq_length(uint64_t i) const { return load<int32_t>(lengths_, i); }
  int64_t pointer(uint64_t i) const { return load<int64_t>(pointers_, i); }
  int64_t doc_index(uint64_t j) const { return load<int64_t>(doc_idx_, j); }

  void check_document_indices() {
    const std::string &path = idx_->path();
    if (d_ == 1 && n_ > 0 && doc_index(0) == 0) {
      if (!sequences_are_documents_) {
        corrupt(path, "document_indices",
                "is [0] although the index holds ", n_, " sequences: the writer never ended a "
                "document (CPM-2's builder does this); open it with sequences_are_documents=True");
      }
      own_doc_idx_.resize(n_ + 1);
      for (uint64_t j = 0; j <= n_; ++j) own_doc_idx_[j] = static_cast<int64_t>(j);
      doc_idx_ = reinterpret_cast<const uint8_t *>(own_doc_idx_.data());
      d_ = n_ + 1;
      return;
    }
    if (d_ == 0) corrupt(path, "document_indices", "is empty, expected at least [0]");
    if (doc_index(0) != 0) corrupt(path, "document_indices", "[0] is ", doc_index(0), ", expected 0");
    for (uint64_t j = 1; j < d_; ++j) {
      if (doc_index(j) < doc_index(j - 1)) {
        corrupt(path, "document_indices", "[", j, "]=", doc_index(j), " is below [", j - 1,
                "]=", doc_index(j - 1), " (not monotone)");
      }
    }
    if (static_cast<uint64_t>(doc_index(d_ - 1)) != n_) {
      corrupt(path, "document_indices", "ends at ", doc_index(d_ - 1), ", expected N=", n_);
    }
  }

  void check_sequences() {
    const std::string &path = idx_->path();
    const uint64_t item = dtype_.itemsize;
    const uint64_t bin_size = bin_size_;
    uint64_t end_of_previous = 0;
    total_tokens_ = 0;
    for (uint64_t i = 0; i < n_; ++i) {
      if (seq_length(i) < 0) corrupt(path, "sequence_lengths", "[", i, "]=", seq_length(i), " < 0");
      int64_t p = pointer(i);
      if (p < 0 || static_cast<uint64_t>(p) < end_of_previous) {
        corrupt(path, "sequence_pointers", "[", i, "]=", p,
                " overlaps the previous sequence ending at ", end_of_previous, " (not monotone)");
      }
      if (static_cast<uint64_t>(p) % item != 0) {
        corrupt(path, "sequence_pointers", "[", i, "]=", p, " is not a multiple of the ", item,
                "-byte item size");
      }
      uint64_t nbytes = static_cast<uint64_t>(seq_length(i)) * item;
      if (static_cast<uint64_t>(p) > bin_size || nbytes > bin_size - static_cast<uint64_t>(p)) {
        corrupt(path, "sequence_pointers", "[", i, "]=", p, " with length ", seq_length(i),
                " ends past the end of ", bin_path_, " (", bin_size, " bytes; truncated?)");
      }
      end_of_previous = static_cast<uint64_t>(p) + nbytes;
      total_tokens_ += static_cast<uint64_t>(seq_length(i));
    }
  }

  static py::array view(py::object self, const char *format, const void *data, uint64_t count,
                        bool readonly) {
    py::array out(py::dtype(std::string("<") + format), {static_cast<py::ssize_t>(count)},
                  data != nullptr ? data : &kEmpty, self);
    if (readonly) py::detail::array_proxy(out.ptr())->flags &= ~py::detail::npy_api::NPY_ARRAY_WRITEABLE_;
    return out;
  }

  py::array tokens(py::object self, uint64_t byte_offset, int64_t count) const {
    if (bin_ == nullptr) {
      throw std::runtime_error(bin_path_ + " is not mapped here: its tokens are read elsewhere");
    }
    const uint8_t *base = bin_->data() != nullptr ? bin_->data() + byte_offset : nullptr;
    return view(self, dtype_.format, base, static_cast<uint64_t>(count), true);
  }

  static const int64_t kEmpty;

  std::unique_ptr<MappedFile> idx_, bin_;
  bool sequences_are_documents_ = false;
  std::string bin_path_;
  uint64_t bin_size_ = 0;
  bool legacy_ = false;
  uint64_t code_ = 0;
  DtypeInfo dtype_{};
  uint64_t n_ = 0, d_ = 0, total_tokens_ = 0;
  // The index arrays: views into the mapped .idx (MMIDIDX) or into the vectors below (legacy).
  const uint8_t *lengths_ = nullptr;
  const uint8_t *pointers_ = nullptr;
  const uint8_t *doc_idx_ = nullptr;
  std::vector<int32_t> own_lengths_;
  std::vector<int64_t> own_pointers_, own_doc_idx_;
};

const int64_t IndexedBin::kEmpty = 0;

PYBIND11_MODULE(_helpers, m) {
  m.doc() = "C++ helpers of the data pipeline: the mmap .bin/.idx reader and index builders.";
  py::register_exception<CorruptIndex>(m, "CorruptIndexError", PyExc_ValueError);

  py::class_<IndexedBin>(m, "IndexedBin",
                         "A validated, memory-mapped .idx/.bin pair (MMIDIDX v1 or legacy TNTIDX).")
      .def(py::init<const std::string &, const std::string &, bool, int64_t>(),
           py::arg("idx_path"), py::arg("bin_path"), py::arg("sequences_are_documents") = false,
           py::arg("bin_size") = -1)
      .def_property_readonly(
          "sequence_lengths",
          [](py::object self) { return self.cast<const IndexedBin &>().sequence_lengths(self); },
          "int32[N] tokens per sequence (read-only view).")
      .def_property_readonly(
          "sequence_pointers",
          [](py::object self) { return self.cast<const IndexedBin &>().sequence_pointers(self); },
          "int64[N] byte offsets of the sequences in .bin (read-only view).")
      .def_property_readonly(
          "document_indices",
          [](py::object self) { return self.cast<const IndexedBin &>().document_indices(self); },
          "int64[D] sequence index where each document starts, ending with N (read-only view).")
      .def(
          "get",
          [](py::object self, int64_t i, int64_t offset, int64_t length) {
            return self.cast<const IndexedBin &>().get(self, i, offset, length);
          },
          py::arg("i"), py::arg("offset") = 0, py::arg("length") = -1,
          "Read-only view of tokens [offset, offset+length) of sequence i (length -1: to the end).")
      .def(
          "get_range",
          [](py::object self, int64_t start, int64_t stop) {
            return self.cast<const IndexedBin &>().get_range(self, start, stop);
          },
          py::arg("start"), py::arg("stop"), "Views of sequences [start, stop).")
      .def_property_readonly("num_sequences", &IndexedBin::num_sequences)
      .def_property_readonly("num_documents", &IndexedBin::num_documents)
      .def_property_readonly("num_tokens", &IndexedBin::num_tokens)
      .def_property_readonly("dtype_code", &IndexedBin::dtype_code)
      .def_property_readonly("dtype", &IndexedBin::dtype)
      .def_property_readonly("legacy", &IndexedBin::legacy,
                             "True for the legacy TNTIDX ('lazy'/'cached') format.")
      .def_property_readonly("bin_size", &IndexedBin::bin_size)
      .def_property_readonly("mapped", &IndexedBin::mapped);

  register_builders(m);
}
