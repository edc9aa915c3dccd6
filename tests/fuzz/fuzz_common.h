// Helpers shared by the libFuzzer targets of tests/fuzz (README.md there).
//
// Every target writes its own seed corpus: run it with LCE_FUZZ_WRITE_SEEDS=<dir> and it writes
// its seeds there and exits (tests/fuzz/corpus/<target>/ holds them, committed). Invariants a
// target checks beyond the sanitizers' end in LCE_FUZZ_CHECK, which aborts with a message, so that
// libFuzzer records the input as a crash.
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <string>
#include <string_view>
#include <vector>

#define LCE_FUZZ_CHECK(cond, ...)                                                  \
  do {                                                                             \
    if (!(cond)) {                                                                 \
      std::fprintf(stderr, "%s:%d: invariant failed: %s: ", __FILE__, __LINE__, #cond); \
      std::fprintf(stderr, __VA_ARGS__);                                           \
      std::fprintf(stderr, "\n");                                                  \
      std::abort();                                                                \
    }                                                                              \
  } while (0)

namespace lce::fuzz {

// Records of an input: a 2-byte little-endian length, then that many bytes (cut at the input's end).
class Records {
 public:
  Records(const uint8_t* data, size_t size) : p_(data), end_(data + size) {}
  bool Next(std::string_view* out) {
    if (end_ - p_ < 2) return false;
    size_t n = static_cast<size_t>(p_[0]) | static_cast<size_t>(p_[1]) << 8;
    p_ += 2;
    n = std::min(n, static_cast<size_t>(end_ - p_));
    *out = std::string_view(reinterpret_cast<const char*>(p_), n);
    p_ += n;
    return true;
  }

 private:
  const uint8_t* p_;
  const uint8_t* end_;
};

inline void AppendRecord(std::string& out, std::string_view bytes) {
  const size_t n = std::min<size_t>(bytes.size(), 0xffff);
  out.push_back(static_cast<char>(n & 0xff));
  out.push_back(static_cast<char>(n >> 8));
  out.append(bytes.data(), n);
}

// Seeds: with LCE_FUZZ_WRITE_SEEDS set, `write(dir)` writes them and the process exits.
template <typename F>
void MaybeWriteSeeds(F write) {
  const char* dir = std::getenv("LCE_FUZZ_WRITE_SEEDS");
  if (dir == nullptr || *dir == '\0') return;
  write(std::string(dir));
  std::exit(0);
}

inline void WriteSeed(const std::string& dir, const std::string& name, std::string_view bytes) {
  std::ofstream out(dir + "/" + name, std::ios::binary | std::ios::trunc);
  out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
  if (!out) {
    std::fprintf(stderr, "cannot write seed %s/%s\n", dir.c_str(), name.c_str());
    std::exit(1);
  }
}

// A private scratch directory for targets that go through files, removed at exit.
std::string ScratchDir();

}  // namespace lce::fuzz
