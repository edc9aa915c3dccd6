#include "fuzz_common.h"

#include <unistd.h>

#include <filesystem>

namespace lce::fuzz {

std::string ScratchDir() {
  // On the heap, never destroyed: the exit handler below runs after static destructors may have.
  static const std::string* dir = [] {
    const char* base = std::getenv("TMPDIR");
    std::string tmpl = std::string(base != nullptr && *base != '\0' ? base : "/tmp") + "/lce-fuzz-XXXXXX";
    if (mkdtemp(tmpl.data()) == nullptr) {
      std::perror("mkdtemp");
      std::exit(1);
    }
    std::atexit([] {
      std::error_code ec;
      std::filesystem::remove_all(ScratchDir(), ec);
    });
    return new std::string(tmpl);
  }();
  return *dir;
}

}  // namespace lce::fuzz
