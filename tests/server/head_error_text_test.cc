// LoadHead's errors name the file and what is wrong with it, never its bytes (issue 35, item 15):
// an admin who names a secret file (a token, a key) reads none of it back in the answer.
#include <unistd.h>

#include <cstdint>
#include <cstring>
#include <filesystem>
#include <fstream>

#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "head_source.h"

namespace lce::server {
namespace {

namespace fs = std::filesystem;

absl::Status LoadFile(const fs::path& file) {
  HeadSource src;
  src.file = file.string();
  return LoadHead(src, 0, 1).status();
}

// Neither the bytes as text nor the number their first 8 make (the header length) appear.
void ExpectNotQuoted(const absl::Status& s, const std::string& secret) {
  ASSERT_FALSE(s.ok());
  uint64_t as_number = 0;
  std::memcpy(&as_number, secret.data(), 8);
  const std::string msg(s.message());
  EXPECT_EQ(msg.find(secret.substr(0, 8)), std::string::npos) << msg;
  EXPECT_EQ(msg.find(absl::StrCat(as_number)), std::string::npos) << msg;
  EXPECT_EQ(msg.find("do-not-echo"), std::string::npos) << msg;
}

TEST(HeadErrorText, ASecretFileIsNotQuoted) {
  const fs::path dir = fs::temp_directory_path() / absl::StrCat("lce-errtext-", ::getpid());
  fs::create_directories(dir);
  const std::string secret = "tok3n-abcdefgh-do-not-echo\n";
  std::ofstream(dir / "admin.token") << secret;
  ExpectNotQuoted(LoadFile(dir / "admin.token"), secret);
  // A valid header whose dtype is text of the file.
  const std::string header = R"({"lm_head.weight":{"dtype":"do-not-echo","shape":[2,2],"data_offsets":[0,8]}})";
  {
    std::ofstream out(dir / "h.safetensors", std::ios::binary);
    const uint64_t n = header.size();
    out.write(reinterpret_cast<const char*>(&n), 8);
    out << header << std::string(8, '\0');
  }
  const absl::Status dtype = LoadFile(dir / "h.safetensors");
  EXPECT_EQ(dtype.code(), absl::StatusCode::kInvalidArgument) << dtype;
  EXPECT_EQ(std::string(dtype.message()).find("do-not-echo"), std::string::npos) << dtype;
  // An index whose dtype is text of the file.
  std::ofstream(dir / "x.index.json") << R"({"vocab_size":2,"hidden_size":2,"dtype":"do-not-echo","shards":[]})";
  const absl::Status index = LoadFile(dir / "x.index.json");
  EXPECT_EQ(index.code(), absl::StatusCode::kInvalidArgument) << index;
  EXPECT_EQ(std::string(index.message()).find("do-not-echo"), std::string::npos) << index;
  fs::remove_all(dir);
}

}  // namespace
}  // namespace lce::server
