// lce_cli's command line: the parse, the absl flags it sets, the commands' flags and the help.
#include "cli_args.h"

#include <unistd.h>

#include <cstdlib>
#include <fstream>

#include "absl/flags/flag.h"
#include "absl/flags/reflection.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_replace.h"
#include "gtest/gtest.h"
#include "lce/client/lce_client.h"

namespace lce::client::cli {
namespace {

// Whether a help text lists the flag: "  --name (default: D)" or, with no default, "  --name".
bool Lists(const std::string& help, const std::string& name) {
  const absl::CommandLineFlag* flag = absl::FindCommandLineFlag(name);
  const std::string def = flag->DefaultValue();
  return help.find(absl::StrCat("  --", absl::StrReplaceAll(name, {{"_", "-"}}),
                                def.empty() ? "" : absl::StrCat(" (default: ", def, ")"), "\n")) != std::string::npos;
}

// Parses and sets the flags, as lce_cli does.
absl::Status Set(const std::vector<std::string>& words) {
  absl::StatusOr<Args> a = Parse(words);
  return a.ok() ? SetFlags(*a) : a.status();
}

TEST(CliArgs, BothFlagFormsAndTheCommand) {
  absl::StatusOr<Args> a = Parse({"--target", "127.0.0.1:1", "score", "--rows=64", "--temperature", "0.7",
                                  "--hidden-file=/tmp/a=b", "--chunk_bytes=8"});
  ASSERT_TRUE(a.ok()) << a.status();
  EXPECT_EQ(a->command, "score");
  EXPECT_FALSE(a->help);
  ASSERT_TRUE(SetFlags(*a).ok());
  EXPECT_EQ(absl::GetFlag(FLAGS_target), "127.0.0.1:1");
  EXPECT_EQ(absl::GetFlag(FLAGS_rows), 64);
  EXPECT_EQ(absl::GetFlag(FLAGS_temperature), 0.7);
  EXPECT_EQ(absl::GetFlag(FLAGS_hidden_file), "/tmp/a=b");  // only the first '=' splits
  EXPECT_EQ(absl::GetFlag(FLAGS_chunk_bytes), 8);           // underscores work too
  EXPECT_EQ(absl::GetFlag(FLAGS_seed), std::nullopt);
}

// `--name` alone sets a boolean (before another flag, a command or at the end); `--name false` still reads
// its value.
TEST(CliArgs, BareBooleans) {
  ASSERT_TRUE(Set({"bench", "--accumulate-weight-grad", "--defer-weight-grad", "--op=train"}).ok());
  EXPECT_TRUE(absl::GetFlag(FLAGS_accumulate_weight_grad));
  EXPECT_TRUE(absl::GetFlag(FLAGS_defer_weight_grad));
  EXPECT_EQ(absl::GetFlag(FLAGS_op), "train");
  ASSERT_TRUE(Set({"--data-plane", "score", "--grow-chunks"}).ok());
  EXPECT_TRUE(absl::GetFlag(FLAGS_data_plane));
  EXPECT_TRUE(absl::GetFlag(FLAGS_grow_chunks));
  ASSERT_TRUE(Set({"bench", "--accumulate-weight-grad", "false", "--defer-weight-grad", "TRUE"}).ok());
  EXPECT_FALSE(absl::GetFlag(FLAGS_accumulate_weight_grad));
  EXPECT_TRUE(absl::GetFlag(FLAGS_defer_weight_grad));
  EXPECT_FALSE(Set({"score", "--rows"}).ok());  // a value flag still needs its value
}

TEST(ClientLibrary, VersionIsTheProjects) { EXPECT_EQ(lce::client::Version(), PROJECT_VERSION_FOR_TEST); }

TEST(CliArgs, VersionIsNoCommandOrFlag) {
  absl::StatusOr<Args> a = Parse({"--version"});
  ASSERT_TRUE(a.ok()) << a.status();
  EXPECT_TRUE(a->version);
  EXPECT_TRUE(a->command.empty());
  EXPECT_FALSE(Parse({"score"})->version);
}

TEST(CliArgs, EachParseStartsFromTheDefaults) {
  ASSERT_TRUE(Set({"bench", "--rows=3", "--op=train", "--temperature=2", "--grow-chunks=1"}).ok());
  EXPECT_EQ(absl::GetFlag(FLAGS_rows), 3);
  EXPECT_TRUE(absl::GetFlag(FLAGS_grow_chunks));
  ASSERT_TRUE(Set({"bench"}).ok());
  EXPECT_EQ(absl::GetFlag(FLAGS_rows), 16);
  EXPECT_EQ(absl::GetFlag(FLAGS_op), "score");
  EXPECT_EQ(absl::GetFlag(FLAGS_temperature), std::nullopt);
  EXPECT_FALSE(absl::GetFlag(FLAGS_grow_chunks));
  EXPECT_EQ(absl::GetFlag(FLAGS_timeout_seconds), 600);
  EXPECT_TRUE(absl::GetFlag(FLAGS_zero_grad));
}

// An optional flag left unset lets each command apply its own default (cli_training.cc).
TEST(CliArgs, OptionalFlagsTellUnsetFromGiven) {
  ASSERT_TRUE(Set({"get-grad"}).ok());
  EXPECT_EQ(absl::GetFlag(FLAGS_tensor), std::nullopt);
  EXPECT_EQ(absl::GetFlag(FLAGS_max_attempts), std::nullopt);
  ASSERT_TRUE(Set({"get-grad", "--tensor=w", "--max-attempts=2"}).ok());
  EXPECT_EQ(absl::GetFlag(FLAGS_tensor), "w");
  EXPECT_EQ(absl::GetFlag(FLAGS_max_attempts), 2);
  ASSERT_TRUE(Set({"forward-backward", "--ignore-index", "-1", "--softcap=-0"}).ok());
  EXPECT_EQ(absl::GetFlag(FLAGS_ignore_index), -1);  // a negative number as a separate value
  EXPECT_EQ(absl::GetFlag(FLAGS_softcap), 0.0);
}

TEST(CliArgs, EmptyValueWithEquals) {
  ASSERT_TRUE(Set({"info", "--head=x"}).ok());
  ASSERT_TRUE(Set({"info", "--head="}).ok());
  EXPECT_EQ(absl::GetFlag(FLAGS_head), "");
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

TEST(CliArgs, ParseErrors) {
  EXPECT_TRUE(absl::IsInvalidArgument(Parse({"score", "--rows"}).status()));  // no value left
  EXPECT_TRUE(absl::IsInvalidArgument(Parse({"score", "bench"}).status()));   // two commands
  EXPECT_TRUE(absl::IsInvalidArgument(Parse({"score", "--=3"}).status()));    // no name
  const absl::Status s = Parse({"score", "extra"}).status();
  EXPECT_NE(s.message().find("extra"), std::string::npos) << s;
  EXPECT_TRUE(absl::IsInvalidArgument(Set({"frobnicate"})));
}

// A bad value is INVALID_ARGUMENT naming the flag: of the wrong type, or out of its range.
TEST(CliArgs, BadValuesNameTheFlag) {
  const std::pair<std::vector<std::string>, std::string> cases[] = {
      {{"bench", "--iterations=x"}, "bad value 'x' for --iterations"},
      {{"bench", "--rows=1.5"}, "bad value '1.5' for --rows"},
      {{"bench", "--temperature=warm"}, "bad value 'warm' for --temperature"},
      {{"bench", "--grow-chunks=2"}, "bad value '2' for --grow-chunks"},
      {{"bench", "--ignore-index=99999999999"}, "bad value '99999999999' for --ignore-index"},
      {{"forward-backward", "--z-loss=nan"}, "--z-loss must be a finite number"},
      {{"bench", "--temperature=inf"}, "--temperature must be a finite number"},
      {{"bench", "--rows=0"}, "--rows must be in [1, 2147483648], got 0"},
      {{"bench", "--iterations=0"}, "--iterations must be >= 1, got 0"},
      {{"bench", "--streams=65"}, "--streams must be in [1, 64]"},
      {{"bench", "--data-plane-streams=0"}, "--data-plane-streams must be in [1, 64]"},
      {{"bench", "--timeout-seconds=0"}, "--timeout-seconds must be a finite number > 0"},
      {{"step", "--lr=-1"}, "--lr must be >= 0"},
      {{"step", "--eps=nan"}, "--eps must be >= 0"},
      {{"update-weights", "--expected-version=-1"}, "--expected-version must be >= 0"},
  };
  for (const auto& [words, message] : cases) {
    const absl::Status s = Set(words);
    EXPECT_TRUE(absl::IsInvalidArgument(s)) << words[1] << ": " << s;
    EXPECT_NE(s.message().find(message), std::string::npos) << words[1] << ": " << s;
  }
  EXPECT_TRUE(Set({"bench", "--rows=12", "--seed=-3", "--temperature=0.5", "--grow-chunks=true"}).ok());
  EXPECT_EQ(absl::GetFlag(FLAGS_seed), -3);
}

TEST(CliArgs, AFlagTheCommandDoesNotTakeIsNamed) {
  const absl::Status s = Set({"score", "--target=x", "--row=3"});
  EXPECT_TRUE(absl::IsInvalidArgument(s));
  EXPECT_NE(s.message().find("unknown flag --row for 'score'"), std::string::npos) << s;
  const absl::Status t = Set({"zero-grad", "--lr=1"});  // a flag of another command
  EXPECT_NE(t.message().find("unknown flag --lr for 'zero-grad'"), std::string::npos) << t;
  EXPECT_TRUE(Set({"step", "--lr=1"}).ok());
}

TEST(CliArgs, Flagfile) {
  char path[] = "/tmp/cli_args_test_XXXXXX";
  const int fd = mkstemp(path);
  ASSERT_GE(fd, 0);
  close(fd);
  std::ofstream(path) << "# a comment\n\n  --rows=7\n--op=train\n";
  ASSERT_TRUE(Set({"bench", absl::StrCat("--flagfile=", path), "--iterations=2"}).ok());
  EXPECT_EQ(absl::GetFlag(FLAGS_rows), 7);
  EXPECT_EQ(absl::GetFlag(FLAGS_op), "train");
  EXPECT_EQ(absl::GetFlag(FLAGS_iterations), 2);
  ASSERT_TRUE(Set({"bench", "--flagfile", path, "--rows=9"}).ok());  // later flags win
  EXPECT_EQ(absl::GetFlag(FLAGS_rows), 9);
  std::ofstream(path) << "--streams=2\n--bogus=1\n";
  const absl::Status s = Set({"score", absl::StrCat("--flagfile=", path)});
  EXPECT_NE(s.message().find("unknown flag --bogus"), std::string::npos) << s;
  std::ofstream(path) << "--flagfile=" << path << "\n";  // naming itself
  EXPECT_NE(Set({"score", absl::StrCat("--flagfile=", path)}).message().find("more than 100 --flagfile"),
            std::string::npos);
  std::remove(path);
  EXPECT_NE(Set({"score", absl::StrCat("--flagfile=", path)}).message().find("cannot read --flagfile"),
            std::string::npos);
}

// Every flag of lce_cli (every absl flag defined in cli_args.cc) is listed by --help, with its
// default; a command's --help lists the flags it takes.
TEST(CliArgs, HelpListsEveryFlagWithItsDefault) {
  const std::vector<std::string> listed = FlagsOf(nullptr);
  for (const auto& [name, flag] : absl::GetAllFlags()) {
    if (flag->Filename().find("cli_args.cc") == std::string::npos) continue;
    EXPECT_NE(std::find(listed.begin(), listed.end(), std::string(name)), listed.end()) << name << " is in no command";
  }
  const std::string help = Help();
  for (const std::string& name : listed) {
    ASSERT_NE(absl::FindCommandLineFlag(name), nullptr) << name;
    EXPECT_TRUE(Lists(help, name)) << name;
  }
  for (const Command& c : Commands()) {
    EXPECT_NE(help.find(absl::StrCat("  ", c.name, " ")), std::string::npos) << c.name;
    for (const std::string& name : FlagsOf(&c)) EXPECT_TRUE(Lists(CommandHelp(c), name)) << c.name << ": " << name;
  }
}

}  // namespace
}  // namespace lce::client::cli
