// Files that are either wholly the old or wholly the new: written to a temporary name beside the
// target, flushed to disk (fsync), renamed over it, and the directory flushed. A process killed
// mid-write leaves the old file (and a stray temporary, never read); after a crash of the machine,
// the file is one of the two.
//
// The directory may be shared with other local users (issue 35, item 6): temporaries get names no
// one can guess and are created O_EXCL|O_NOFOLLOW, so a file or link planted there is never opened
// or written through; the rename replaces the target's name, never what a planted link points to.
#pragma once

#include <sys/types.h>

#include <cstddef>
#include <functional>
#include <string>

#include "absl/status/status.h"

namespace lce::server {

// Writes `path` through `fill`, which writes the content to the open descriptor (WriteAll). The
// file is created with `mode` (less the umask).
absl::Status WriteFileDurably(const std::string& path, const std::function<absl::Status(int fd)>& fill,
                              mode_t mode = 0644);
// Writes all `bytes` at `data` to `fd` (retrying short writes); `path` names the file in errors.
absl::Status WriteAll(int fd, const void* data, size_t bytes, const std::string& path);
// Makes `to` a durable second name of the file `from`, both plain names in `dir` (a hard link, or a
// durable copy with `from`'s permission bits where the filesystem has none), replacing whatever
// `to` was at once. `from` must be a regular file of `dir` itself: a symbolic link is
// FAILED_PRECONDITION (never followed), a name with '/' or a dot name INVALID_ARGUMENT.
absl::Status LinkDurably(const std::string& dir, const std::string& from, const std::string& to);
// A name that stays in its directory: not empty, not "." or "..", without '/' or NUL.
bool IsPlainFileName(const std::string& name);

}  // namespace lce::server
