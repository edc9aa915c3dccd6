// Saves that survive being killed (issue 22): every file of a save is written durably and the
// index's rename commits it, so a save interrupted at any point leaves the previous one loadable,
// whole; a damaged file is a clear error at load.
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <filesystem>
#include <fstream>
#include <thread>

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

// A save of `w` as head `name` at `version` by one rank.
void Save(const fs::path& dir, const std::string& name, int64_t version, const HeadWeights& w) {
  ASSERT_TRUE(WriteHeadShard(dir.string(), name, version, w, 0, 1).ok());
  ASSERT_TRUE(WriteHeadIndex(dir.string(), name, version, w.shape, 1).ok());
}

absl::StatusOr<std::shared_ptr<const HeadWeights>> Load(const fs::path& dir, const std::string& name) {
  HeadSource src;
  src.file = (dir / (name + ".index.json")).string();
  return LoadHead(src, 0, 1);
}

fs::path FreshDir(const std::string& what) {
  const fs::path dir = fs::temp_directory_path() / absl::StrCat("lce-save-", what, "-", ::getpid());
  fs::remove_all(dir);
  fs::create_directories(dir);
  return dir;
}

TEST(HeadSave, TheIndexCommitsASave) {
  const fs::path dir = FreshDir("commit");
  const auto v1 = Seeded("300x16", 1), v2 = Seeded("300x16", 2);
  Save(dir, "policy", 1, *v1);
  Save(dir, "policy-v2", 7, *v2);  // another head whose name looks like a version of this one
  // A save that stopped after its shard: the index still names version 1's file, which is intact.
  ASSERT_TRUE(WriteHeadShard(dir.string(), "policy", 2, *v2, 0, 1).ok());
  auto loaded = Load(dir, "policy");
  ASSERT_TRUE(loaded.ok()) << loaded.status();
  EXPECT_EQ((*loaded)->weight, v1->weight);
  // Its index commits version 2 and removes version 1's shard, and nothing of the other head.
  ASSERT_TRUE(WriteHeadIndex(dir.string(), "policy", 2, v2->shape, 1).ok());
  loaded = Load(dir, "policy");
  ASSERT_TRUE(loaded.ok()) << loaded.status();
  EXPECT_EQ((*loaded)->weight, v2->weight);
  EXPECT_FALSE(fs::exists(dir / ShardFileName("policy", 1, 0, 1)));
  EXPECT_TRUE(fs::exists(dir / ShardFileName("policy-v2", 7, 0, 1)));
  auto other = Load(dir, "policy-v2");
  ASSERT_TRUE(other.ok()) << other.status();
  EXPECT_EQ((*other)->weight, v2->weight);
  fs::remove_all(dir);
}

// A process killed at a random moment of a save (SIGKILL, so no cleanup runs) leaves a directory
// that loads as the previous save or the new one, whole; never a mix, never a short file.
TEST(HeadSave, AKilledSaveLeavesTheLastCompleteSaveLoadable) {
  const fs::path dir = FreshDir("kill");
  const auto v1 = Seeded("40000x256", 1), v2 = Seeded("40000x256", 2);  // 20 MB each
  Save(dir, "h", 1, *v1);
  for (int delay_us : {0, 2000, 8000, 20000, 60000}) {
    const pid_t child = ::fork();
    ASSERT_GE(child, 0);
    if (child == 0) {  // saves version 2, then 1 again, for ever
      for (int64_t v = 2;; v = v == 2 ? 1 : 2) {
        const HeadWeights& w = v == 2 ? *v2 : *v1;
        if (!WriteHeadShard(dir.string(), "h", v, w, 0, 1).ok()) _exit(1);
        if (!WriteHeadIndex(dir.string(), "h", v, w.shape, 1).ok()) _exit(1);
      }
    }
    std::this_thread::sleep_for(std::chrono::microseconds(delay_us));
    ::kill(child, SIGKILL);
    int status = 0;
    ::waitpid(child, &status, 0);
    ASSERT_TRUE(WIFSIGNALED(status)) << "the saver stopped on its own (a write failed)";
    auto loaded = Load(dir, "h");
    ASSERT_TRUE(loaded.ok()) << "killed after " << delay_us << " us: " << loaded.status();
    EXPECT_TRUE((*loaded)->weight == v1->weight || (*loaded)->weight == v2->weight)
        << "killed after " << delay_us << " us: the loaded weight is neither save";
  }
  fs::remove_all(dir);
}

// The mechanism under the saves: a file written durably is, after a SIGKILL at any moment, the old
// one or the new one, whole.
TEST(DurableFile, AKilledWriteLeavesTheOldOrTheNewFile) {
  const fs::path dir = FreshDir("durable");
  const std::string path = (dir / "f").string();
  const std::string a(8 << 20, 'a'), b(12 << 20, 'b');
  auto write = [&](const std::string& text) {
    return WriteFileDurably(path, [&](int fd) { return WriteAll(fd, text.data(), text.size(), path); });
  };
  ASSERT_TRUE(write(a).ok());
  for (int delay_us : {0, 1000, 3000, 10000, 30000}) {
    const pid_t child = ::fork();
    ASSERT_GE(child, 0);
    if (child == 0) {
      for (int i = 0;; ++i) {
        if (!write(i % 2 == 0 ? b : a).ok()) _exit(1);
      }
    }
    std::this_thread::sleep_for(std::chrono::microseconds(delay_us));
    ::kill(child, SIGKILL);
    int status = 0;
    ::waitpid(child, &status, 0);
    ASSERT_TRUE(WIFSIGNALED(status));
    std::ifstream in(path, std::ios::binary);
    const std::string got((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
    EXPECT_TRUE(got == a || got == b) << "killed after " << delay_us << " us: a file of " << got.size() << " bytes";
  }
  fs::remove_all(dir);
}

TEST(HeadSave, ADamagedShardIsAClearErrorAtLoad) {
  const fs::path dir = FreshDir("damaged");
  const auto v1 = Seeded("300x16", 1);
  Save(dir, "h", 1, *v1);
  const fs::path shard = dir / ShardFileName("h", 1, 0, 1);
  fs::resize_file(shard, fs::file_size(shard) / 2);
  auto loaded = Load(dir, "h");
  EXPECT_EQ(loaded.status().code(), absl::StatusCode::kInvalidArgument) << loaded.status();
  EXPECT_NE(loaded.status().message().find(shard.filename().string()), std::string::npos) << loaded.status();
  fs::remove(shard);
  loaded = Load(dir, "h");
  EXPECT_EQ(loaded.status().code(), absl::StatusCode::kNotFound) << loaded.status();
  EXPECT_NE(loaded.status().message().find(shard.filename().string()), std::string::npos) << loaded.status();
  fs::remove_all(dir);
}

// A save by a group of two at the version the committed save has (a restarted group saving over
// its last run's directory) would rewrite the very files the committed index names: a crash after
// one rank's write, before the index, would leave a mix of the two saves. ProtectCommittedSave,
// which SaveHead calls before any rank writes, moves the committed save out of the way first.
TEST(HeadSave, ASaveAtTheCommittedVersionLeavesTheCommittedSaveWhole) {
  const fs::path dir = FreshDir("same-version");
  const auto a = Seeded("300x16", 1), b = Seeded("300x16", 2);
  auto save_rank = [&](const HeadWeights& whole, int r) {
    HeadWeights shard = whole;
    const VocabRange range = VocabShard(300, r, 2);
    const int64_t row = 16 * 2;
    shard.shape.vocab_begin = range.begin;
    shard.shape.shard_rows = range.end - range.begin;
    shard.weight.assign(whole.weight.begin() + range.begin * row, whole.weight.begin() + range.end * row);
    ASSERT_TRUE(WriteHeadShard(dir.string(), "h", 4, shard, r, 2).ok());
  };
  save_rank(*a, 0);
  save_rank(*a, 1);
  ASSERT_TRUE(WriteHeadIndex(dir.string(), "h", 4, a->shape, 2).ok());
  // Another run's save at version 4 dies after rank 1 wrote its shard.
  ASSERT_TRUE(ProtectCommittedSave(dir.string(), "h", 4, 2).ok());
  save_rank(*b, 1);
  auto loaded = Load(dir, "h");
  ASSERT_TRUE(loaded.ok()) << loaded.status();
  EXPECT_EQ((*loaded)->weight, a->weight) << "the committed save is no longer whole";
  // Saved again, whole: the new save loads and the moved files are gone.
  ASSERT_TRUE(ProtectCommittedSave(dir.string(), "h", 4, 2).ok());
  save_rank(*b, 0);
  save_rank(*b, 1);
  ASSERT_TRUE(WriteHeadIndex(dir.string(), "h", 4, b->shape, 2).ok());
  loaded = Load(dir, "h");
  ASSERT_TRUE(loaded.ok()) << loaded.status();
  EXPECT_EQ((*loaded)->weight, b->weight);
  int files = 0;
  for (const auto& e : fs::directory_iterator(dir)) files += e.path().extension() == ".safetensors";
  EXPECT_EQ(files, 2) << "the moved save's files were left behind";
  // Nothing to move: no save yet, or one at another version or group size.
  EXPECT_TRUE(ProtectCommittedSave(dir.string(), "h", 5, 2).ok());
  EXPECT_TRUE(ProtectCommittedSave(dir.string(), "other", 4, 2).ok());
  fs::remove_all(dir);
}

// A head's name becomes part of the saved files' names: one with a '/' would write outside the
// directory asked for, so it cannot be saved under its name (by any rank).
TEST(HeadSave, ANameWithASlashIsRefused) {
  const fs::path dir = FreshDir("slash");
  const auto w = Seeded("30x16", 1);
  for (const std::string name : {"../evil", "a/b", "..", ""}) {
    const absl::Status shard = WriteHeadShard(dir.string(), name, 1, *w, 0, 1).status();
    EXPECT_EQ(shard.code(), absl::StatusCode::kInvalidArgument) << name << ": " << shard;
    EXPECT_NE(shard.message().find("needs a name without '/'"), std::string::npos) << shard;
    EXPECT_EQ(WriteHeadIndex(dir.string(), name, 1, w->shape, 1).status().code(), absl::StatusCode::kInvalidArgument);
  }
  EXPECT_FALSE(fs::exists(dir.parent_path() / ShardFileName("evil", 1, 0, 1)));
  EXPECT_TRUE(fs::is_empty(dir));
  fs::remove_all(dir);
}

}  // namespace
}  // namespace lce::server
