// SaveHead into a directory other local users can write (issue 35, item 6): nothing planted there
// (a link under a temporary's name, an index naming a file elsewhere, a link under a shard's name)
// makes the server write through a link, or copy a file from elsewhere into the directory.
#include <sys/stat.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>

#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "durable_file.h"
#include "head_source.h"

namespace lce::server {
namespace {

namespace fs = std::filesystem;

std::shared_ptr<const HeadWeights> Seeded(const std::string& shape, uint64_t seed) {
  HeadSource src;
  EXPECT_TRUE(ParseSeedShape(shape, src).ok());
  src.seed = seed;
  auto w = LoadHead(src, 0, 1);
  EXPECT_TRUE(w.ok()) << w.status();
  return *w;
}

fs::path FreshDir(const std::string& what) {
  const fs::path dir = fs::temp_directory_path() / absl::StrCat("lce-shared-", what, "-", ::getpid());
  fs::remove_all(dir);
  fs::create_directories(dir);
  return dir;
}

std::string Contents(const fs::path& p) {
  std::ifstream in(p, std::ios::binary);
  return std::string((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
}

// A file of the server's own, mode 0600 (the admin token file, say), outside the save directory.
fs::path Secret(const fs::path& where) {
  const fs::path secret = where / "admin.token";
  std::ofstream(secret) << "s3cret-token-bytes";
  fs::permissions(secret, fs::perms::owner_read | fs::perms::owner_write);
  return secret;
}

mode_t ModeOf(const fs::path& p) {
  struct stat st {};
  EXPECT_EQ(::stat(p.c_str(), &st), 0) << p;
  return st.st_mode & 07777;
}

// Links planted under every temporary name the server could have used before (path.tmp-<pid>-<n>)
// point at the secret: the save writes its own new files, never through them.
TEST(HeadSaveSharedDir, PlantedLinksUnderTemporaryNamesAreNotWrittenThrough) {
  const fs::path dir = FreshDir("tmp"), outside = FreshDir("tmp-outside");
  const fs::path secret = Secret(outside);
  const auto w = Seeded("30x16", 1);
  for (const std::string& target : {ShardFileName("h", 1, 0, 1), std::string("h.index.json")}) {
    for (int n = 0; n < 512; ++n) {
      fs::create_symlink(secret, dir / absl::StrCat(target, ".tmp-", ::getpid(), "-", n));
    }
  }
  ASSERT_TRUE(WriteHeadShard(dir.string(), "h", 1, *w, 0, 1).ok());
  ASSERT_TRUE(WriteHeadIndex(dir.string(), "h", 1, w->shape, 1).ok());
  EXPECT_EQ(Contents(secret), "s3cret-token-bytes") << "the save wrote through a planted link";
  EXPECT_EQ(ModeOf(secret), 0600);
  // The files the server meant to write, with the mode it means (0644 less the umask).
  const mode_t mask = ::umask(0);
  ::umask(mask);
  EXPECT_EQ(ModeOf(dir / ShardFileName("h", 1, 0, 1)), 0644 & ~mask);
  EXPECT_EQ(ModeOf(dir / "h.index.json"), 0644 & ~mask);
  HeadSource src;
  src.file = (dir / "h.index.json").string();
  EXPECT_TRUE(LoadHead(src, 0, 1).ok());
  fs::remove_all(dir);
  fs::remove_all(outside);
}

// A planted index that names this save's files and a file elsewhere (absolute, or up out of the
// directory, or a link in it): moving the "committed" save aside copies or links none of them in.
TEST(HeadSaveSharedDir, APlantedIndexNamesNoFileOutsideTheDirectory) {
  const fs::path dir = FreshDir("index"), outside = FreshDir("index-outside");
  const fs::path secret = Secret(outside);
  const auto w = Seeded("30x16", 1);
  fs::create_symlink(secret, dir / "planted.safetensors");
  for (const std::string evil : {secret.string(), absl::StrCat("../", outside.filename().string(), "/admin.token"),
                                 std::string("planted.safetensors")}) {
    std::ofstream(dir / "h.index.json")
        << R"({"vocab_size":30,"hidden_size":16,"dtype":"bf16","shards":[)"
        << R"({"file":")" << ShardFileName("h", 1, 0, 2) << R"(","vocab_begin":0,"vocab_end":15},)"
        << R"({"file":")" << evil << R"(","vocab_begin":15,"vocab_end":30}]})";
    std::ofstream(dir / ShardFileName("h", 1, 0, 2)) << "x";
    const absl::Status s = ProtectCommittedSave(dir.string(), "h", 1, 2);
    EXPECT_TRUE(s.ok() || s.code() == absl::StatusCode::kFailedPrecondition) << evil << ": " << s;
    for (const auto& e : fs::directory_iterator(dir)) {
      if (e.path().filename() == "planted.safetensors") continue;
      EXPECT_NE(Contents(e.path()), "s3cret-token-bytes") << evil << ": the secret was copied to " << e.path();
      EXPECT_FALSE(fs::is_symlink(e.path())) << evil << ": a link was kept as " << e.path();
    }
  }
  EXPECT_EQ(ModeOf(secret), 0600);
  fs::remove_all(dir);
  fs::remove_all(outside);
}

// LoadHead reads an index's shards from its own directory only: a name with '/' is refused
// before any file is opened, even one that would load.
TEST(HeadSaveSharedDir, AnIndexNamingAFileElsewhereDoesNotLoad) {
  const fs::path dir = FreshDir("load"), outside = FreshDir("load-outside");
  const auto w = Seeded("30x16", 1);
  ASSERT_TRUE(WriteHeadShard(outside.string(), "h", 1, *w, 0, 1).ok());
  const fs::path shard = outside / ShardFileName("h", 1, 0, 1);
  for (const std::string name : {shard.string(), absl::StrCat("../", outside.filename().string(), "/", shard.filename().string())}) {
    std::ofstream(dir / "h.index.json") << R"({"vocab_size":30,"hidden_size":16,"dtype":"bf16","shards":[{"file":")"
                                        << name << R"(","vocab_begin":0,"vocab_end":30}]})";
    HeadSource src;
    src.file = (dir / "h.index.json").string();
    const auto loaded = LoadHead(src, 0, 1);
    EXPECT_EQ(loaded.status().code(), absl::StatusCode::kInvalidArgument) << name << ": " << loaded.status();
  }
  fs::remove_all(dir);
  fs::remove_all(outside);
}

// A committed save kept aside by a hard link, or a copy with its own permission bits: never a
// wider mode than the file had.
TEST(HeadSaveSharedDir, AKeptFileKeepsItsMode) {
  const fs::path dir = FreshDir("mode");
  std::ofstream(dir / "a") << "bytes";
  fs::permissions(dir / "a", fs::perms::owner_read | fs::perms::owner_write);
  ASSERT_TRUE(LinkDurably(dir.string(), "a", "b").ok());
  EXPECT_EQ(Contents(dir / "b"), "bytes");
  EXPECT_EQ(ModeOf(dir / "b"), 0600);
  EXPECT_EQ(LinkDurably(dir.string(), "../a", "c").code(), absl::StatusCode::kInvalidArgument);
  fs::create_symlink(dir / "a", dir / "l");
  EXPECT_EQ(LinkDurably(dir.string(), "l", "c").code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_FALSE(fs::exists(dir / "c"));
  fs::remove_all(dir);
}

}  // namespace
}  // namespace lce::server
