// The data-parallel rendezvous directory is not trusted blindly (issue 35, item 7): it must be this
// uid's and writable by no one else before any link reads it, and a front's address is used only
// when the job's secret signed it.
#include <pwd.h>
#include <sys/stat.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>

#include "absl/strings/str_cat.h"
#include "dp_job.h"
#include "dp_rank.h"
#include "gtest/gtest.h"

namespace lce::server {
namespace {

namespace fs = std::filesystem;

fs::path FreshDir(const std::string& what) {
  const fs::path dir = fs::temp_directory_path() / absl::StrCat("lce-rdv-", what, "-", ::getpid());
  fs::remove_all(dir);
  fs::create_directories(dir);
  fs::permissions(dir, fs::perms::owner_all);
  return dir;
}

mode_t ModeOf(const fs::path& p) {
  struct stat st {};
  EXPECT_EQ(::lstat(p.c_str(), &st), 0) << p;
  return st.st_mode & 07777;
}

TEST(DpRendezvous, AMissingDirectoryIsMadeOnlyOurs) {
  const fs::path base = FreshDir("new");
  const absl::Status s = CheckRendezvousDirectory((base / "job").string());
  EXPECT_TRUE(s.ok()) << s;
  EXPECT_EQ(ModeOf(base / "job"), 0700);
  EXPECT_TRUE(CheckRendezvousDirectory((base / "job").string()).ok()) << "a second replica joins the same one";
  fs::remove_all(base);
}

// The launchers once turned mktemp's 0700 directory into a 0755 one, and a directory another user
// made first was used as it was.
TEST(DpRendezvous, ADirectoryOthersCanWriteIsRefused) {
  const fs::path base = FreshDir("open");
  for (mode_t mode : {0777, 0770, 0733, 01777}) {
    fs::create_directory(base / "job");
    ASSERT_EQ(::chmod((base / "job").c_str(), mode), 0);
    const absl::Status s = CheckRendezvousDirectory((base / "job").string());
    EXPECT_EQ(s.code(), absl::StatusCode::kPermissionDenied) << std::oct << mode << ": " << s;
    EXPECT_NE(s.message().find((base / "job").string()), std::string::npos) << s;
    fs::remove(base / "job");
  }
  fs::create_directory(base / "real");
  fs::create_directory_symlink(base / "real", base / "link");
  EXPECT_EQ(CheckRendezvousDirectory((base / "link").string()).code(), absl::StatusCode::kPermissionDenied);
  fs::remove_all(base);
}

TEST(DpRendezvous, AnotherUsersDirectoryIsRefused) {
  const passwd* nobody = ::getpwnam("nobody");
  if (::geteuid() != 0 || nobody == nullptr) {
    GTEST_SKIP() << "needs root and a second uid ('nobody') to make a directory of another user";
  }
  const fs::path base = FreshDir("other");
  fs::create_directory(base / "job");
  ASSERT_EQ(::chmod((base / "job").c_str(), 0700), 0);
  ASSERT_EQ(::chown((base / "job").c_str(), nobody->pw_uid, nobody->pw_gid), 0);
  const absl::Status s = CheckRendezvousDirectory((base / "job").string());
  EXPECT_EQ(s.code(), absl::StatusCode::kPermissionDenied) << s;
  fs::remove_all(base);
}

// A planted front-1.addr (no signature, another job's, or one for another replica) is not used.
TEST(DpRendezvous, OnlyAnAddressTheJobSignedIsUsed) {
  const fs::path base = FreshDir("addr");
  DpOptions o;
  o.rendezvous = base.string();
  fs::create_directories(base / "fronts");
  const std::string secret = "0123456789abcdef0123456789abcdef";
  EXPECT_EQ(ReadFrontAddress(o, 1, secret).status().code(), absl::StatusCode::kNotFound);
  std::ofstream(base / "fronts" / "front-1.addr") << "10.0.0.66:443\n";
  EXPECT_FALSE(ReadFrontAddress(o, 1, secret).ok());
  ASSERT_TRUE(PublishFrontAddress(o, 1, "10.0.0.66:443", "another job's secret, 32 chars!!").ok());
  EXPECT_EQ(ReadFrontAddress(o, 1, secret).status().code(), absl::StatusCode::kPermissionDenied);
  ASSERT_TRUE(PublishFrontAddress(o, 0, "127.0.0.1:5000", secret).ok());
  fs::copy_file(base / "fronts" / "front-0.addr", base / "fronts" / "front-1.addr",
                fs::copy_options::overwrite_existing);
  EXPECT_EQ(ReadFrontAddress(o, 1, secret).status().code(), absl::StatusCode::kPermissionDenied)
      << "replica 0's signed address passed as replica 1's";
  ASSERT_TRUE(PublishFrontAddress(o, 1, "127.0.0.1:5001", secret).ok());
  absl::StatusOr<std::string> a = ReadFrontAddress(o, 1, secret);
  ASSERT_TRUE(a.ok()) << a.status();
  EXPECT_EQ(*a, "127.0.0.1:5001");
  fs::remove_all(base);
}

}  // namespace
}  // namespace lce::server
