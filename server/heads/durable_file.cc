#include "durable_file.h"

#include <fcntl.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <fstream>

#include "absl/strings/str_cat.h"

namespace lce::server {
namespace {

absl::Status Errno(const std::string& what, const std::string& path) {
  const int e = errno;
  const std::string msg = absl::StrCat(what, " ", path, ": ", std::strerror(e));
  if (e == EACCES || e == EPERM || e == EROFS) return absl::PermissionDeniedError(msg);
  if (e == ENOSPC || e == EDQUOT) return absl::ResourceExhaustedError(msg);
  return absl::DataLossError(msg);
}

// fsync of the directory holding `path`: makes the names made in it durable. Best effort (some
// filesystems cannot sync a directory).
void SyncDirectoryOf(const std::string& path) {
  const std::string dir = std::filesystem::path(path).parent_path().string();
  const int dfd = ::open(dir.empty() ? "." : dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (dfd >= 0) {
    ::fsync(dfd);
    ::close(dfd);
  }
}

}  // namespace

absl::Status WriteAll(int fd, const void* data, size_t bytes, const std::string& path) {
  const auto* p = static_cast<const char*>(data);
  while (bytes > 0) {
    const ssize_t n = ::write(fd, p, bytes);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) return Errno("cannot write", path);
    p += n;
    bytes -= static_cast<size_t>(n);
  }
  return absl::OkStatus();
}

absl::Status WriteFileDurably(const std::string& path, const std::function<absl::Status(int fd)>& fill) {
  static std::atomic<uint64_t> counter{0};
  const std::string tmp = absl::StrCat(path, ".tmp-", ::getpid(), "-", counter.fetch_add(1));
  const int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd < 0) return Errno("cannot create", tmp);
  absl::Status s = fill(fd);
  if (s.ok() && ::fsync(fd) != 0) s = Errno("cannot flush", tmp);
  if (::close(fd) != 0 && s.ok()) s = Errno("cannot close", tmp);
  if (s.ok() && ::rename(tmp.c_str(), path.c_str()) != 0) s = Errno("cannot rename onto", path);
  if (!s.ok()) {
    ::unlink(tmp.c_str());
    return s;
  }
  SyncDirectoryOf(path);  // the rename itself is durable once the directory is
  return absl::OkStatus();
}

absl::Status LinkDurably(const std::string& from, const std::string& to) {
  const std::string tmp = to + ".tmp-link";
  ::unlink(tmp.c_str());
  if (::link(from.c_str(), tmp.c_str()) != 0) {
    std::ifstream in(from, std::ios::binary);
    if (!in) return Errno("cannot open", from);
    return WriteFileDurably(to, [&](int fd) -> absl::Status {
      char buf[1 << 16];
      while (in.read(buf, sizeof buf) || in.gcount() > 0) {
        if (absl::Status s = WriteAll(fd, buf, static_cast<size_t>(in.gcount()), to); !s.ok()) return s;
      }
      return in.eof() ? absl::OkStatus() : absl::DataLossError(absl::StrCat("cannot read ", from));
    });
  }
  if (::rename(tmp.c_str(), to.c_str()) != 0) {
    absl::Status s = Errno("cannot rename onto", to);
    ::unlink(tmp.c_str());
    return s;
  }
  SyncDirectoryOf(to);
  return absl::OkStatus();
}

}  // namespace lce::server
