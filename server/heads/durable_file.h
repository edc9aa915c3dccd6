// Files that are either wholly the old or wholly the new: written to a temporary name beside the
// target, flushed to disk (fsync), renamed over it, and the directory flushed. A process killed
// mid-write leaves the old file (and a stray temporary, never read); after a crash of the machine,
// the file is one of the two.
#pragma once

#include <cstddef>
#include <functional>
#include <string>

#include "absl/status/status.h"

namespace lce::server {

// Writes `path` through `fill`, which writes the content to the open descriptor (WriteAll).
absl::Status WriteFileDurably(const std::string& path, const std::function<absl::Status(int fd)>& fill);
// Writes all `bytes` at `data` to `fd` (retrying short writes); `path` names the file in errors.
absl::Status WriteAll(int fd, const void* data, size_t bytes, const std::string& path);
// Makes `to` a durable second name of the file `from` (a hard link, or a durable copy where the
// filesystem has none), replacing whatever `to` was at once.
absl::Status LinkDurably(const std::string& from, const std::string& to);

}  // namespace lce::server
