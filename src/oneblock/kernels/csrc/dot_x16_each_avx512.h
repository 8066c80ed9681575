// How a product walks its groups (each_group), part of dot_x16_avx512.h and included by it in the same namespaces:
// every group of 16 weight rows against all the activation rows, 8 at a time, from a group's unpacked blocks where
// its format keeps them (the group kernels' `Codes`), with each activation block's code sums first where the
// format reads them.

namespace oneblock {
namespace OB_CAT(x16_, OB_SUFFIX) {

// Whether a group kernel can unpack a group's blocks once for many activation rows (it names them `Codes`).
template <typename Group, typename = void>
struct Unpacks : std::false_type {};
template <typename Group>
struct Unpacks<Group, std::void_t<typename Group::Codes>> : std::true_type {};

// Whether a group kernel's unpacked blocks meet the activations unsigned (ActRow::u; its `kUnsignedActs`).
template <typename Group>
constexpr bool unsigned_acts() {
  if constexpr (Unpacks<Group>::value) {
    return Group::kUnsignedActs;
  } else {
    return false;
  }
}

// The rows with their codes also unsigned (ActRow::u), in this thread's buffers: for a caller that gave none (the
// decode step's many rows). `k`: the codes per row.
inline const ActRow* with_unsigned(const ActRow* a, int rows, int64_t k) {
  thread_local std::vector<uint8_t> codes;
  thread_local std::vector<ActRow> copies;
  codes.resize(static_cast<size_t>(rows * k));
  copies.assign(a, a + rows);
  for (int r = 0; r < rows; ++r) {
    unsigned_codes(a[r].q, k, codes.data() + r * k);
    copies[static_cast<size_t>(r)].u = codes.data() + r * k;
  }
  return copies.data();
}

// R activation rows against one group: from its unpacked blocks where `codes` holds them, else from the layout.
template <typename Group, int R>
OB_TARGET inline void run_rows(const uint8_t* group, const void* codes, const ActRow* a, const int32_t* const* s,
                               int64_t nb, float* out, int64_t stride) {
  if constexpr (Unpacks<Group>::value) {
    if (codes != nullptr) {
      Group::template run_unpacked<R>(group, static_cast<const typename Group::Codes*>(codes), a, s, nb, out, stride);
      return;
    }
  }
  Group::template run<R>(group, a, s, nb, out, stride);
}

// Every group of 16 rows in turn, each against all the activation rows (8 at a time, while the group is in L1 or L2:
// a group's codes are unpacked once for the 8, or once for all the rows where the format keeps them unpacked), with
// each activation block's code sums first where the format reads them (`with_sums`).
template <typename Group>
OB_TARGET void each_group(const uint8_t* w, int64_t row_bytes, int cols, const ActRow* a, int rows, int64_t nb,
                          float* out, int64_t stride, bool with_sums) {
  constexpr int64_t kStackSums = 512;  // 8 rows of K = 2048 need no allocation
  constexpr int kRows = kTileRows;
  if constexpr (unsigned_acts<Group>()) {
    if (rows > kRows && a[0].u == nullptr) a = with_unsigned(a, rows, nb * QK_K);
  }
  int32_t local[kStackSums];
  std::vector<int32_t> storage;
  int32_t* sums = local;
  if (with_sums) {
    if (rows * nb > kStackSums) {
      storage.resize(static_cast<size_t>(rows * nb));
      sums = storage.data();
    }
    for (int r = 0; r < rows; ++r) code_sums(a[r], nb, sums + r * nb);
  }
  for (int c = 0; c < cols; c += kGroupRows) {
    const uint8_t* group = w + c * row_bytes;
    const void* codes = nullptr;
    if constexpr (Unpacks<Group>::value) {
      if (rows > kRows) codes = Group::unpack(group, nb);
    }
    for (int r = 0; r < rows; r += kRows) {
      const int32_t* s[kRows];
      for (int i = 0; i < kRows; ++i) s[i] = sums + (r + i) * nb;
      float* o = out + r * stride + c;
      switch (rows - r) {
        case 1: run_rows<Group, 1>(group, codes, a + r, s, nb, o, stride); break;
        case 2: run_rows<Group, 2>(group, codes, a + r, s, nb, o, stride); break;
        case 3: run_rows<Group, 3>(group, codes, a + r, s, nb, o, stride); break;
        case 4: run_rows<Group, 4>(group, codes, a + r, s, nb, o, stride); break;
        case 5: run_rows<Group, 5>(group, codes, a + r, s, nb, o, stride); break;
        case 6: run_rows<Group, 6>(group, codes, a + r, s, nb, o, stride); break;
        case 7: run_rows<Group, 7>(group, codes, a + r, s, nb, o, stride); break;
        default: run_rows<Group, kRows>(group, codes, a + r, s, nb, o, stride); break;
      }
    }
  }
}

}  // namespace OB_CAT(x16_, OB_SUFFIX)
}  // namespace oneblock
