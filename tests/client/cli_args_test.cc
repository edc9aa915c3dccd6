// lce_cli's argument parser.
#include "cli_args.h"

#include "gtest/gtest.h"

namespace lce::client::cli {
namespace {

TEST(CliArgs, BothFlagFormsAndTheCommand) {
  absl::StatusOr<Args> a = Parse({"--target", "127.0.0.1:1", "score", "--rows=64", "--temperature", "0.7",
                                  "--hidden-file=/tmp/a=b"});
  ASSERT_TRUE(a.ok()) << a.status();
  EXPECT_EQ(a->command, "score");
  EXPECT_FALSE(a->help);
  EXPECT_EQ(a->Get("target"), "127.0.0.1:1");
  EXPECT_EQ(a->Get("rows"), "64");
  EXPECT_EQ(a->Get("temperature"), "0.7");
  EXPECT_EQ(a->Get("hidden-file"), "/tmp/a=b");  // only the first '=' splits
  EXPECT_EQ(a->Get("missing", "dflt"), "dflt");
  EXPECT_TRUE(a->Has("rows"));
  EXPECT_FALSE(a->Has("seed"));
}

TEST(CliArgs, NegativeNumbersAsSeparateValues) {
  absl::StatusOr<Args> a = Parse({"forward-backward", "--ignore-index", "-1", "--softcap=-0"});
  ASSERT_TRUE(a.ok()) << a.status();
  EXPECT_EQ(*a->Int("ignore-index", -100), -1);
  EXPECT_EQ(*a->Number("softcap", 5), 0.0);
}

TEST(CliArgs, EmptyValueWithEquals) {
  absl::StatusOr<Args> a = Parse({"info", "--head="});
  ASSERT_TRUE(a.ok());
  EXPECT_TRUE(a->Has("head"));
  EXPECT_EQ(a->Get("head", "x"), "");
}

TEST(CliArgs, Help) {
  absl::StatusOr<Args> a = Parse({"bench", "--help"});
  ASSERT_TRUE(a.ok());
  EXPECT_TRUE(a->help);
  EXPECT_EQ(a->command, "bench");
  a = Parse({"-h"});
  ASSERT_TRUE(a.ok());
  EXPECT_TRUE(a->help);
  EXPECT_EQ(a->command, "");
}

TEST(CliArgs, Errors) {
  EXPECT_TRUE(absl::IsInvalidArgument(Parse({"score", "--rows"}).status()));          // no value left
  EXPECT_TRUE(absl::IsInvalidArgument(Parse({"score", "bench"}).status()));           // two commands
  EXPECT_TRUE(absl::IsInvalidArgument(Parse({"score", "--=3"}).status()));            // no name
  const absl::Status s = Parse({"score", "extra"}).status();
  EXPECT_NE(s.message().find("extra"), std::string::npos) << s;
}

TEST(CliArgs, Numbers) {
  absl::StatusOr<Args> a = Parse({"bench", "--rows=12", "--iterations=x", "--temperature=0.5", "--z-loss=nan",
                                  "--seed=-3", "--big=99999999999"});
  ASSERT_TRUE(a.ok());
  EXPECT_EQ(*a->Int("rows", 1, 1), 12);
  EXPECT_EQ(*a->Int("absent", 42), 42);
  EXPECT_EQ(*a->Number("temperature", 1), 0.5);
  EXPECT_EQ(*a->Int("seed", 0), -3);
  EXPECT_TRUE(absl::IsInvalidArgument(a->Int("iterations", 5).status()));
  EXPECT_TRUE(absl::IsInvalidArgument(a->Number("iterations", 5).status()));
  EXPECT_TRUE(absl::IsInvalidArgument(a->Number("z-loss", 0).status()));  // not finite
  EXPECT_TRUE(absl::IsInvalidArgument(a->Int("rows", 1, 13).status()));   // below the range
  EXPECT_TRUE(absl::IsInvalidArgument(a->Int("big", 0, 0, INT32_MAX).status()));
  EXPECT_TRUE(absl::IsInvalidArgument(a->Int("temperature", 1).status()));  // not an integer
  const absl::Status s = a->Int("iterations", 5).status();
  EXPECT_NE(s.message().find("--iterations"), std::string::npos) << s;
}

TEST(CliArgs, KnownFlags) {
  absl::StatusOr<Args> a = Parse({"score", "--target=x", "--row=3"});
  ASSERT_TRUE(a.ok());
  EXPECT_TRUE(CheckKnownFlags(*a, {"target", "row"}).ok());
  const absl::Status s = CheckKnownFlags(*a, {"target", "rows"});
  EXPECT_TRUE(absl::IsInvalidArgument(s));
  EXPECT_NE(s.message().find("--row"), std::string::npos) << s;
}

}  // namespace
}  // namespace lce::client::cli
