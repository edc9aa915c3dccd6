#include "safetensors.h"

#include <sys/stat.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <fstream>
#include <new>

#include "absl/strings/str_cat.h"
#include "durable_file.h"
#include "nlohmann/json.hpp"
#include "status_macros.h"

namespace lce::server {
namespace {

absl::StatusOr<DType> DTypeFromSafetensors(const std::string& s) {
  if (s == "F32") return DType::kFloat32;
  if (s == "BF16") return DType::kBFloat16;
  if (s == "F16") return DType::kFloat16;
  // Named only when it is one of the format's dtypes: no other text of the file goes into an error.
  static const char* const kKnown[] = {"BOOL", "U8",  "I8",  "F8_E5M2", "F8_E4M3", "I16", "U16", "I32",
                                       "U32",  "I64", "U64", "F64"};
  const bool known = std::any_of(std::begin(kKnown), std::end(kKnown), [&](const char* k) { return s == k; });
  return absl::InvalidArgumentError(
      absl::StrCat("unsupported safetensors dtype", known ? absl::StrCat(" ", s) : std::string(), " (F32, BF16, F16)"));
}

const char* DTypeToSafetensors(DType d) {
  switch (d) {
    case DType::kFloat32: return "F32";
    case DType::kBFloat16: return "BF16";
    case DType::kFloat16: return "F16";
  }
  return "?";
}

}  // namespace

namespace {

// The entry of `tensor` in a parsed header, checked against the file: a shape of positive integers
// whose byte size is a number and matches its offsets, inside the file's data.
absl::StatusOr<SafetensorsEntry> EntryOf(const std::string& path, const nlohmann::json& j, const std::string& tensor,
                                         uint64_t header_len, uint64_t file_size) {
  auto it = j.find(tensor);
  if (it == j.end() || !it->is_object()) {
    return absl::NotFoundError(absl::StrCat(path, ": no tensor named '", tensor, "'"));
  }
  const auto& t = *it;
  auto integers = [](const nlohmann::json& a) {
    return a.is_array() && std::all_of(a.begin(), a.end(), [](const nlohmann::json& v) { return v.is_number_integer(); });
  };
  if (!t.contains("dtype") || !t["dtype"].is_string() || !t.contains("shape") || !integers(t["shape"]) ||
      !t.contains("data_offsets") || !integers(t["data_offsets"]) || t["data_offsets"].size() != 2) {
    return absl::InvalidArgumentError(absl::StrCat(path, ": malformed entry for '", tensor, "'"));
  }
  absl::StatusOr<DType> dtype = DTypeFromSafetensors(t["dtype"].get<std::string>());
  if (!dtype.ok()) return dtype.status();
  const auto& shape = t["shape"];
  if (shape.empty() || shape.size() > 2) {
    return absl::InvalidArgumentError(absl::StrCat(path, ": tensor '", tensor, "' must be 1-D or 2-D"));
  }
  SafetensorsEntry e;
  e.dtype = *dtype;
  e.rows = shape[0].get<int64_t>();
  e.cols = shape.size() == 2 ? shape[1].get<int64_t>() : 1;
  if (e.rows <= 0 || e.cols <= 0) {
    return absl::InvalidArgumentError(
        absl::StrCat(path, ": tensor '", tensor, "' has shape ", shape.dump(), "; dimensions must be positive"));
  }
  absl::StatusOr<int64_t> want = TensorBytes(e.rows, e.cols, DTypeSize(e.dtype), absl::StrCat(path, ": tensor '", tensor, "'"));
  if (!want.ok()) return want.status();
  const uint64_t begin = t["data_offsets"][0].get<uint64_t>();
  const uint64_t end = t["data_offsets"][1].get<uint64_t>();
  const uint64_t data_bytes = file_size - 8 - header_len;  // the caller checked 8 + header_len <= file_size
  if (end < begin || end - begin != static_cast<uint64_t>(*want) || end > data_bytes) {
    return absl::InvalidArgumentError(absl::StrCat(
        path, ": tensor '", tensor, "' offsets [", begin, ", ", end, ") do not match its shape or the file",
        end >= begin && end - begin == static_cast<uint64_t>(*want)
            ? absl::StrCat(" (the file holds ", data_bytes, " bytes of tensor data: truncated?)")
            : std::string()));
  }
  e.data_offset = 8 + header_len + begin;
  return e;
}

// A FIFO or a device (/dev/zero, /dev/urandom) is not a head: it would block, or feed a header of
// up to 100 MB of noise.
absl::Status CheckRegularFile(const std::string& path) {
  struct stat st {};
  if (::stat(path.c_str(), &st) != 0) {
    return absl::NotFoundError(absl::StrCat("cannot open ", path, ": ", std::strerror(errno)));
  }
  if (!S_ISREG(st.st_mode)) return absl::InvalidArgumentError(absl::StrCat(path, ": not a regular file"));
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<SafetensorsEntry> ReadSafetensorsEntry(const std::string& path, const std::string& tensor) {
  LCE_RETURN_IF_ERROR(CheckRegularFile(path));
  std::ifstream in(path, std::ios::binary);
  if (!in) return absl::NotFoundError(absl::StrCat("cannot open ", path));
  in.seekg(0, std::ios::end);
  const uint64_t file_size = static_cast<uint64_t>(in.tellg());
  in.seekg(0);
  uint8_t len_bytes[8];
  if (!in.read(reinterpret_cast<char*>(len_bytes), 8)) {
    return absl::InvalidArgumentError(absl::StrCat(path, ": too short for a safetensors file"));
  }
  uint64_t header_len = 0;
  for (int i = 7; i >= 0; --i) header_len = (header_len << 8) | len_bytes[i];
  if (header_len > (uint64_t{100} << 20) || 8 + header_len > file_size) {
    // The length is the file's first 8 bytes: not quoted, whatever file an admin named (issue 35, item 15).
    return absl::InvalidArgumentError(absl::StrCat(path, ": bad safetensors header length (the file has ", file_size,
                                                   " bytes: truncated, or not a safetensors file)"));
  }
  std::string header(header_len, '\0');
  if (!in.read(header.data(), static_cast<std::streamsize>(header_len))) {
    return absl::InvalidArgumentError(absl::StrCat(path, ": truncated header"));
  }
  nlohmann::json j = nlohmann::json::parse(header, nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded() || !j.is_object()) {
    return absl::InvalidArgumentError(absl::StrCat(path, ": header is not a JSON object"));
  }
  return EntryOf(path, j, tensor, header_len, file_size);
}

absl::StatusOr<std::vector<uint8_t>> ReadSafetensorsRows(const std::string& path,
                                                         const SafetensorsEntry& entry,
                                                         int64_t row_begin, int64_t row_end) {
  if (row_begin < 0 || row_end > entry.rows || row_begin >= row_end) {
    return absl::InvalidArgumentError(
        absl::StrCat("row range [", row_begin, ", ", row_end, ") outside [0, ", entry.rows, ")"));
  }
  // The entry's whole size was checked (ReadSafetensorsEntry); an entry made elsewhere is checked here.
  absl::StatusOr<int64_t> bytes = TensorBytes(row_end - row_begin, entry.cols, DTypeSize(entry.dtype), path);
  if (!bytes.ok()) return bytes.status();
  const int64_t row_bytes = entry.cols * DTypeSize(entry.dtype);
  LCE_RETURN_IF_ERROR(CheckRegularFile(path));
  std::ifstream in(path, std::ios::binary);
  if (!in) return absl::NotFoundError(absl::StrCat("cannot open ", path));
  std::vector<uint8_t> out;
  try {
    out.resize(static_cast<size_t>(*bytes));
  } catch (const std::bad_alloc&) {
    return absl::ResourceExhaustedError(absl::StrCat(path, ": no memory for ", *bytes, " bytes of rows"));
  }
  in.seekg(static_cast<std::streamoff>(entry.data_offset + row_begin * row_bytes));
  if (!in.read(reinterpret_cast<char*>(out.data()), static_cast<std::streamsize>(out.size()))) {
    return absl::DataLossError(absl::StrCat(path, ": short read"));
  }
  return out;
}

absl::Status WriteSafetensors(const std::string& path, const std::vector<SafetensorsTensor>& tensors) {
  nlohmann::ordered_json header = nlohmann::ordered_json::object();
  uint64_t offset = 0;
  for (const auto& t : tensors) {
    header[t.name] = {{"dtype", DTypeToSafetensors(t.dtype)},
                      {"shape", t.shape},
                      {"data_offsets", {offset, offset + static_cast<uint64_t>(t.bytes)}}};
    offset += static_cast<uint64_t>(t.bytes);
  }
  std::string text = header.dump();
  while ((8 + text.size()) % 8 != 0) text.push_back(' ');  // keep tensor data 8-byte aligned
  // Durably: a save killed half-way leaves the file it replaces (durable_file.h).
  return WriteFileDurably(path, [&](int fd) -> absl::Status {
    uint8_t len[8];
    const uint64_t n = text.size();
    for (int i = 0; i < 8; ++i) len[i] = static_cast<uint8_t>(n >> (8 * i));
    LCE_RETURN_IF_ERROR(WriteAll(fd, len, 8, path));
    LCE_RETURN_IF_ERROR(WriteAll(fd, text.data(), text.size(), path));
    for (const auto& t : tensors) {
      LCE_RETURN_IF_ERROR(WriteAll(fd, t.data, static_cast<size_t>(t.bytes), path));
    }
    return absl::OkStatus();
  });
}

}  // namespace lce::server
