// Runs the test process out of file descriptors (issue 35, item 3): lowers RLIMIT_NOFILE's soft
// limit a little above what is open and fills the table with /dev/null, so that the next accept4
// of any listener in the process fails with EMFILE. Destroying it closes them and restores the limit.
#pragma once

#include <dirent.h>
#include <fcntl.h>
#include <sys/resource.h>
#include <unistd.h>

#include <vector>

namespace lce::server {

class DescriptorExhaustion {
 public:
  DescriptorExhaustion() {
    getrlimit(RLIMIT_NOFILE, &saved_);
    rlimit low = saved_;
    low.rlim_cur = static_cast<rlim_t>(OpenDescriptors() + 64);
    if (low.rlim_cur < saved_.rlim_cur) setrlimit(RLIMIT_NOFILE, &low);
    for (int fd; (fd = ::open("/dev/null", O_RDONLY | O_CLOEXEC)) >= 0;) fds_.push_back(fd);
  }
  ~DescriptorExhaustion() {
    Free(fds_.size());
    setrlimit(RLIMIT_NOFILE, &saved_);
  }
  // Frees `n` descriptors for the test's own sockets.
  void Free(size_t n) {
    for (; n > 0 && !fds_.empty(); --n) {
      ::close(fds_.back());
      fds_.pop_back();
    }
  }
  bool exhausted() const { return !fds_.empty(); }

  // Waits (up to 5 s) until at most `n` descriptors are open: a served connection's server side
  // closes on its own thread, and a descriptor it frees after the table was filled would let the
  // next accept succeed.
  static void AwaitOpenAtMost(int n) {
    for (int i = 0; i < 500 && OpenDescriptors() > n; ++i) usleep(10000);
  }
  static int OpenDescriptors() {
    int n = 0;
    if (DIR* d = opendir("/proc/self/fd")) {
      while (readdir(d) != nullptr) ++n;
      closedir(d);
    }
    return n;
  }

 private:
  rlimit saved_{};
  std::vector<int> fds_;
};

}  // namespace lce::server
