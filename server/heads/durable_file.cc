#include "durable_file.h"

#include <fcntl.h>
#include <sys/random.h>
#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <filesystem>

#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "status_macros.h"

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

// "<base>.tmp-<64 random bits>": another user of the directory cannot plant a file or link under
// it ahead of us (the pid and a counter could be guessed).
std::string TempName(const std::string& base) {
  static std::atomic<uint64_t> counter{0};
  uint64_t r = 0;
  if (::getrandom(&r, sizeof r, 0) != static_cast<ssize_t>(sizeof r)) {  // no entropy yet: still unique
    r = static_cast<uint64_t>(std::chrono::steady_clock::now().time_since_epoch().count()) ^
        (counter.fetch_add(1) << 48) ^ static_cast<uint64_t>(::getpid());
  }
  return absl::StrFormat("%s.tmp-%016x", base, r);
}

// A new file beside `path`, opened for writing; `tmp` gets its name. An existing name (planted, or
// a collision) is never opened: another name is tried.
int CreateTemp(const std::string& path, mode_t mode, std::string& tmp) {
  for (int attempt = 0; attempt < 8; ++attempt) {
    tmp = TempName(path);
    const int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, mode);
    if (fd >= 0 || errno != EEXIST) return fd;
  }
  return -1;  // errno is EEXIST
}

class Fd {
 public:
  explicit Fd(int fd) : fd_(fd) {}
  ~Fd() {
    if (fd_ >= 0) ::close(fd_);
  }
  Fd(const Fd&) = delete;
  Fd& operator=(const Fd&) = delete;
  int get() const { return fd_; }

 private:
  int fd_;
};

// Copies what is left of `in` to `out`.
absl::Status CopyAll(int in, int out, const std::string& from, const std::string& to) {
  char buf[1 << 16];
  for (;;) {
    const ssize_t n = ::read(in, buf, sizeof buf);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) return Errno("cannot read", from);
    if (n == 0) return absl::OkStatus();
    LCE_RETURN_IF_ERROR(WriteAll(out, buf, static_cast<size_t>(n), to));
  }
}

// Hard-links the open file `src` (named `from` in `dfd`) as a fresh temporary beside `to`, renamed
// onto `to`. False where no link could be made (another filesystem, no hard links): copy instead.
absl::StatusOr<bool> LinkOpenFile(int dfd, const std::string& dir, const std::string& from, const struct stat& src,
                                  const std::string& to) {
  std::string tmp;
  int rc = -1;
  for (int attempt = 0; attempt < 8 && rc != 0; ++attempt) {
    tmp = TempName(to);
    rc = ::linkat(dfd, from.c_str(), dfd, tmp.c_str(), 0);
    if (rc != 0 && errno != EEXIST) return false;
  }
  if (rc != 0) return false;
  // The name may have been swapped since it was opened: link only the file we checked.
  struct stat linked {};
  if (::fstatat(dfd, tmp.c_str(), &linked, AT_SYMLINK_NOFOLLOW) != 0 || linked.st_dev != src.st_dev ||
      linked.st_ino != src.st_ino) {
    ::unlinkat(dfd, tmp.c_str(), 0);
    return absl::FailedPreconditionError(absl::StrCat(dir, "/", from, " changed while it was being kept"));
  }
  if (::renameat(dfd, tmp.c_str(), dfd, to.c_str()) != 0) {
    absl::Status s = Errno("cannot rename onto", absl::StrCat(dir, "/", to));
    ::unlinkat(dfd, tmp.c_str(), 0);
    return s;
  }
  return true;
}

}  // namespace

bool IsPlainFileName(const std::string& name) {
  return !name.empty() && name != "." && name != ".." && name.find('/') == std::string::npos &&
         name.find('\0') == std::string::npos;
}

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

absl::Status WriteFileDurably(const std::string& path, const std::function<absl::Status(int fd)>& fill,
                              mode_t mode) {
  std::string tmp;
  const int fd = CreateTemp(path, mode, tmp);
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

absl::Status LinkDurably(const std::string& dir, const std::string& from, const std::string& to) {
  if (!IsPlainFileName(from) || !IsPlainFileName(to)) {
    return absl::InvalidArgumentError(absl::StrCat("'", from, "' and '", to, "' must be plain file names in ", dir));
  }
  const std::string from_path = absl::StrCat(dir, "/", from), to_path = absl::StrCat(dir, "/", to);
  const Fd dfd(::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC));
  if (dfd.get() < 0) return Errno("cannot open", dir);
  // O_NOFOLLOW: a link planted under the name would make us copy what it points to.
  const Fd in(::openat(dfd.get(), from.c_str(), O_RDONLY | O_NOFOLLOW | O_NONBLOCK | O_CLOEXEC));
  if (in.get() < 0) {
    if (errno == ELOOP) return absl::FailedPreconditionError(absl::StrCat(from_path, " is a symbolic link: not kept"));
    return Errno("cannot open", from_path);
  }
  struct stat st {};
  if (::fstat(in.get(), &st) != 0) return Errno("cannot stat", from_path);
  if (!S_ISREG(st.st_mode)) return absl::FailedPreconditionError(absl::StrCat(from_path, " is not a regular file"));
  absl::StatusOr<bool> linked = LinkOpenFile(dfd.get(), dir, from, st, to);
  if (!linked.ok()) return linked.status();
  if (*linked) {
    ::fsync(dfd.get());
    return absl::OkStatus();
  }
  // The copy is no more readable than the file it copies.
  return WriteFileDurably(
      to_path, [&](int fd) { return CopyAll(in.get(), fd, from_path, to_path); }, st.st_mode & 0666);
}

}  // namespace lce::server
