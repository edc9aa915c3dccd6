#include "tensor_file.h"

#include <cstring>
#include <fstream>
#include <map>
#include <sstream>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "lce/client/lce_client.h"
#include "nlohmann/json.hpp"
#include "wire_codec.h"

namespace lce::client {
namespace {

constexpr char kNpyMagic[] = "\x93NUMPY";

const std::map<v1::DType, std::string>& NpyDescr() {
  static const auto* m = new std::map<v1::DType, std::string>{
      {v1::DTYPE_FLOAT32, "<f4"}, {v1::DTYPE_FLOAT16, "<f2"}, {v1::DTYPE_BFLOAT16, "<u2"}};
  return *m;
}

const std::map<v1::DType, std::string>& SafetensorsDtype() {
  static const auto* m = new std::map<v1::DType, std::string>{
      {v1::DTYPE_FLOAT32, "F32"}, {v1::DTYPE_FLOAT16, "F16"}, {v1::DTYPE_BFLOAT16, "BF16"}};
  return *m;
}

absl::StatusOr<v1::DType> DTypeNamed(const std::map<v1::DType, std::string>& names, const std::string& name,
                                     const std::string& path) {
  for (const auto& [dtype, n] : names) {
    if (n == name) return dtype;
  }
  return absl::InvalidArgumentError(absl::StrCat(path, ": element type '", name, "' is not fp32, fp16 or bf16"));
}

absl::Status WriteBytes(const std::string& path, const std::string& head, absl::Span<const uint8_t> bytes) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out.write(head.data(), static_cast<std::streamsize>(head.size()));
  out.write(reinterpret_cast<const char*>(bytes.data()), static_cast<std::streamsize>(bytes.size()));
  out.close();
  if (!out) return absl::PermissionDeniedError(absl::StrCat("cannot write ", path));
  return absl::OkStatus();
}

// The header of a version 1.0 .npy file, padded to a multiple of 64 bytes as NumPy writes it.
std::string NpyHeader(v1::DType dtype, int64_t rows, int64_t cols) {
  std::string dict = absl::StrCat("{'descr': '", NpyDescr().at(dtype), "', 'fortran_order': False, 'shape': (", rows,
                                  ", ", cols, "), }");
  const size_t unpadded = 6 + 2 + 2 + dict.size() + 1;
  dict.append((64 - unpadded % 64) % 64, ' ');
  dict.push_back('\n');
  std::string head(kNpyMagic, 6);
  head += '\x01';
  head += '\x00';
  head += static_cast<char>(dict.size() & 0xff);
  head += static_cast<char>(dict.size() >> 8);
  return head + dict;
}

std::string SafetensorsHeader(const std::string& name, v1::DType dtype, int64_t rows, int64_t cols, size_t bytes) {
  nlohmann::json j;
  j[name] = {{"dtype", SafetensorsDtype().at(dtype)}, {"shape", {rows, cols}}, {"data_offsets", {0, bytes}}};
  std::string text = j.dump();
  text.append((8 - text.size() % 8) % 8, ' ');
  std::string head(8, '\0');
  const uint64_t n = text.size();
  for (int i = 0; i < 8; ++i) head[static_cast<size_t>(i)] = static_cast<char>((n >> (8 * i)) & 0xff);
  return head + text;
}

// What follows 'key': in a .npy header dict ("{'descr': '<f4', 'fortran_order': False, 'shape': (3, 4), }"),
// from the first `open` character after it up to (not including) the next `close` one; "" if absent.
std::string NpyField(const std::string& dict, const std::string& key, char open, char close) {
  const size_t at = dict.find("'" + key + "':");
  if (at == std::string::npos) return "";
  const size_t from = dict.find(open, at + key.size() + 3);
  const size_t to = from == std::string::npos ? from : dict.find(close, from + 1);
  return to == std::string::npos ? "" : dict.substr(from + 1, to - from - 1);
}

absl::StatusOr<Tensor2D> ParseNpy(const std::string& path, const std::string& file) {
  auto bad = [&](const std::string& why) { return absl::InvalidArgumentError(absl::StrCat(path, ": ", why)); };
  if (file.size() < 10 || file.compare(0, 6, kNpyMagic, 6) != 0) return bad("not a .npy file");
  const int major = static_cast<unsigned char>(file[6]);
  const size_t len_bytes = major == 1 ? 2 : 4;
  size_t header_len = 0;
  for (size_t i = 0; i < len_bytes && 8 + i < file.size(); ++i) {
    header_len |= static_cast<size_t>(static_cast<unsigned char>(file[8 + i])) << (8 * i);
  }
  const size_t data_at = 8 + len_bytes + header_len;
  if (data_at > file.size()) return bad("truncated .npy header");
  const std::string dict = file.substr(8 + len_bytes, header_len);
  if (absl::StrContains(dict, "'fortran_order': True")) return bad("Fortran-ordered arrays are not read");
  const std::string descr = NpyField(dict, "descr", '\'', '\'');
  absl::StatusOr<v1::DType> dtype = DTypeNamed(NpyDescr(), descr, path);
  if (!dtype.ok()) return dtype.status();
  const std::string shape = NpyField(dict, "shape", '(', ')');
  std::vector<std::string> dims = absl::StrSplit(shape, ',', absl::SkipWhitespace());
  Tensor2D t{*dtype, 0, 1, {}};  // 1-D: n x 1
  if (dims.empty() || dims.size() > 2 || !absl::SimpleAtoi(dims[0], &t.rows) ||
      (dims.size() == 2 && !absl::SimpleAtoi(dims[1], &t.cols))) {
    return bad(absl::StrCat("shape (", shape, ") is not 1-D or 2-D"));
  }
  if (static_cast<int64_t>(file.size() - data_at) != t.rows * t.cols * WireDTypeSize(t.dtype)) {
    return bad(absl::StrCat("holds ", file.size() - data_at, " data bytes for a ", t.rows, " x ", t.cols, " ", descr,
                            " array"));
  }
  t.bytes.assign(file.begin() + static_cast<std::ptrdiff_t>(data_at), file.end());
  return t;
}

absl::StatusOr<Tensor2D> ParseSafetensors(const std::string& path, const std::string& file, const std::string& name) {
  auto bad = [&](const std::string& why) { return absl::InvalidArgumentError(absl::StrCat(path, ": ", why)); };
  uint64_t n = 0;
  for (int i = 0; i < 8 && i < static_cast<int>(file.size()); ++i) {
    n |= static_cast<uint64_t>(static_cast<unsigned char>(file[static_cast<size_t>(i)])) << (8 * i);
  }
  if (file.size() < 8 || n > file.size() - 8) return bad("not a safetensors file");
  nlohmann::json j = nlohmann::json::parse(file.substr(8, n), nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded() || !j.is_object()) return bad("the safetensors header is not a JSON object");
  std::vector<std::string> names;
  for (const auto& [key, value] : j.items()) {
    if (key != "__metadata__") names.push_back(key);
  }
  std::string key = name;
  if (key.empty()) {
    if (names.size() != 1) return bad(absl::StrCat("holds ", names.size(), " tensors; name one with --tensor"));
    key = names[0];
  }
  if (!j.contains(key)) return bad(absl::StrCat("has no tensor '", key, "'"));
  const nlohmann::json& m = j[key];
  if (!m.contains("dtype") || !m.contains("shape") || !m.contains("data_offsets") || m["shape"].empty() ||
      m["shape"].size() > 2) {
    return bad(absl::StrCat("tensor '", key, "' is not 1-D or 2-D"));
  }
  absl::StatusOr<v1::DType> dtype = DTypeNamed(SafetensorsDtype(), m["dtype"].get<std::string>(), path);
  if (!dtype.ok()) return dtype.status();
  Tensor2D t{*dtype, m["shape"][0].get<int64_t>(), m["shape"].size() == 2 ? m["shape"][1].get<int64_t>() : 1, {}};
  const uint64_t lo = m["data_offsets"][0].get<uint64_t>(), hi = m["data_offsets"][1].get<uint64_t>();
  const uint64_t data = 8 + n;
  if (lo > hi || hi > file.size() - data ||
      static_cast<int64_t>(hi - lo) != t.rows * t.cols * WireDTypeSize(t.dtype)) {
    return bad(absl::StrCat("tensor '", key, "' has data offsets [", lo, ", ", hi, ") that do not fit its shape or the file"));
  }
  t.bytes.assign(file.begin() + static_cast<std::ptrdiff_t>(data + lo), file.begin() + static_cast<std::ptrdiff_t>(data + hi));
  return t;
}

}  // namespace

absl::StatusOr<std::string> ReadWholeFile(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return absl::NotFoundError(absl::StrCat("cannot open ", path));
  std::ostringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

absl::StatusOr<TensorFormat> ParseTensorFormat(const std::string& format, const std::string& path) {
  std::string f = format;
  if (f.empty()) {
    if (absl::EndsWith(path, ".npy")) f = "npy";
    if (absl::EndsWith(path, ".safetensors")) f = "safetensors";
    if (absl::EndsWith(path, ".raw") || absl::EndsWith(path, ".bin") || absl::EndsWith(path, ".f32")) f = "raw";
  }
  if (f == "npy") return TensorFormat::kNpy;
  if (f == "safetensors") return TensorFormat::kSafetensors;
  if (f == "raw") return TensorFormat::kRaw;
  if (!format.empty()) {
    return absl::InvalidArgumentError(absl::StrCat("--format must be npy, safetensors or raw, got '", format, "'"));
  }
  return absl::InvalidArgumentError(absl::StrCat("cannot tell the format of '", path,
                                                 "' from its name (.npy, .safetensors, .raw): give --format"));
}

absl::Status WriteTensorFile(const std::string& path, TensorFormat format, const std::string& name, v1::DType dtype,
                             int64_t rows, int64_t cols, absl::Span<const uint8_t> bytes) {
  switch (format) {
    case TensorFormat::kNpy: return WriteBytes(path, NpyHeader(dtype, rows, cols), bytes);
    case TensorFormat::kSafetensors:
      return WriteBytes(path, SafetensorsHeader(name, dtype, rows, cols, bytes.size()), bytes);
    case TensorFormat::kRaw: return WriteBytes(path, "", bytes);
  }
  return absl::InvalidArgumentError("unknown tensor format");
}

absl::StatusOr<Tensor2D> ReadTensorFile(const std::string& path, TensorFormat format, const std::string& name,
                                        v1::DType raw_dtype, int64_t raw_cols) {
  absl::StatusOr<std::string> file = ReadWholeFile(path);
  if (!file.ok()) return file.status();
  if (format == TensorFormat::kNpy) return ParseNpy(path, *file);
  if (format == TensorFormat::kSafetensors) return ParseSafetensors(path, *file, name);
  const int64_t row_bytes = raw_cols * WireDTypeSize(raw_dtype);
  if (row_bytes <= 0 || file->empty() || static_cast<int64_t>(file->size()) % row_bytes != 0) {
    return absl::InvalidArgumentError(absl::StrCat(path, ": ", file->size(), " bytes are not whole rows of ", raw_cols,
                                                   " ", v1::DType_Name(raw_dtype), " elements"));
  }
  return Tensor2D{raw_dtype, static_cast<int64_t>(file->size()) / row_bytes, raw_cols,
                  std::vector<uint8_t>(file->begin(), file->end())};
}

absl::StatusOr<std::vector<float>> ReadVectorFile(const std::string& path) {
  absl::StatusOr<TensorFormat> format = ParseTensorFormat("", path);
  if (!format.ok()) {
    return absl::InvalidArgumentError(
        absl::StrCat("cannot tell the format of '", path, "' from its name: .npy, .safetensors or .raw (fp32)"));
  }
  absl::StatusOr<Tensor2D> t = ReadTensorFile(path, *format, "", v1::DTYPE_FLOAT32, 1);
  if (!t.ok()) return t.status();
  if (t->cols != 1) {
    return absl::InvalidArgumentError(absl::StrCat(path, ": a ", t->rows, " x ", t->cols, " tensor, not a vector"));
  }
  return DecodeFloats(t->bytes.data(), t->rows, t->dtype);
}

}  // namespace lce::client
