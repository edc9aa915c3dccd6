// Moving the rows of a vocabulary-sharded tensor over a tensor-parallel group (tp_group.h: what
// UpdateWeights and GetGrad do with a weight, a bias and their gradients): ranks of one process on
// real Gloo communicators (a thread a rank), groups of 2 and 3, a vocabulary that is no multiple of
// its tile, rows of one float (a bias) and of several, pieces far smaller than a shard. Every peer
// receives exactly its VocabShard rows; the front gathers every peer's rows once, in vocabulary order.
#include <unistd.h>

#include <filesystem>
#include <thread>
#include <tuple>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "tp_group.h"

namespace lce::server {
namespace {

namespace fs = std::filesystem;

constexpr int64_t kVocab = 3001;  // tiles of 47 rows; the last one short

// Row r's values: distinct for every row and column.
float ValueAt(int64_t row, int64_t col) { return static_cast<float>(row) + 0.001f * static_cast<float>(col + 1); }

// Runs part(rank, comm, staging) on every rank of a group of k, each on its own thread.
template <typename Part>
void OnGroup(int k, const std::string& name, Part part) {
  const fs::path dir = fs::temp_directory_path() / absl::StrCat("lce-tp-rows-", name, "-", ::getpid());
  fs::remove_all(dir);
  std::vector<std::thread> ranks;
  for (int r = 0; r < k; ++r) {
    ranks.emplace_back([&, r] {
      TpBootstrap b;
      b.rank = r;
      b.world_size = k;
      b.rendezvous_dir = dir.string();
      b.timeout = absl::Seconds(20);
      absl::StatusOr<std::unique_ptr<TpCommunicator>> comm = CreateGlooCommunicator(b);
      ASSERT_TRUE(comm.ok()) << comm.status();
      std::unique_ptr<ChunkStaging> staging = CreateHostStaging();
      part(r, **comm, *staging);
    });
  }
  for (std::thread& t : ranks) t.join();
  fs::remove_all(dir);
}

class TpRows : public ::testing::TestWithParam<std::tuple<int, int64_t>> {};

TEST_P(TpRows, AScatterGivesEachPeerItsRows) {
  // Not a structured binding: clang 14 (the sanitizer builds) cannot capture one in a lambda.
  const int k = std::get<0>(GetParam());
  const int64_t cols = std::get<1>(GetParam());
  std::vector<float> all(kVocab * cols);
  for (int64_t i = 0; i < kVocab; ++i) {
    for (int64_t c = 0; c < cols; ++c) all[i * cols + c] = ValueAt(i, c);
  }
  const int64_t piece_bytes = 7 * cols * 4;  // 7 rows a piece: many pieces a shard, one short at its end
  OnGroup(k, absl::StrCat("scatter", k, "x", cols), [&](int rank, TpCommunicator& comm, ChunkStaging& staging) {
    const VocabRange mine = VocabShard(kVocab, rank, k);
    if (rank == 0) {
      absl::Status s =
          ScatterRows(comm, staging, kVocab, reinterpret_cast<const uint8_t*>(all.data()), cols * 4, piece_bytes);
      EXPECT_TRUE(s.ok()) << s;
      return;
    }
    std::vector<float> got((mine.end - mine.begin) * cols, -1.0f);
    absl::Status s = ReceiveRows(comm, staging, kVocab, reinterpret_cast<uint8_t*>(got.data()), cols * 4, piece_bytes);
    ASSERT_TRUE(s.ok()) << s;
    const std::vector<float> want(all.begin() + mine.begin * cols, all.begin() + mine.end * cols);
    EXPECT_EQ(got, want) << "rank " << rank << " of " << k << ": rows [" << mine.begin << ", " << mine.end << ")";
  });
}

TEST_P(TpRows, AGatherHandsTheFrontEveryPeersRowsInOrder) {
  // Not a structured binding: clang 14 (the sanitizer builds) cannot capture one in a lambda.
  const int k = std::get<0>(GetParam());
  const int64_t cols = std::get<1>(GetParam());
  const int64_t piece_bytes = 7 * cols * 4;
  OnGroup(k, absl::StrCat("gather", k, "x", cols), [&](int rank, TpCommunicator& comm, ChunkStaging& staging) {
    const VocabRange mine = VocabShard(kVocab, rank, k);
    if (rank != 0) {
      std::vector<float> rows((mine.end - mine.begin) * cols);
      for (int64_t i = mine.begin; i < mine.end; ++i) {
        for (int64_t c = 0; c < cols; ++c) rows[(i - mine.begin) * cols + c] = ValueAt(i, c);
      }
      absl::Status s = SendRows(comm, staging, kVocab, cols, rows.data(), piece_bytes);
      EXPECT_TRUE(s.ok()) << s;
      return;
    }
    int64_t next = mine.end;  // the front's rows are its own; the peers' follow them
    int pieces = 0;
    absl::Status s = GatherRows(
        comm, staging, kVocab, cols,
        [&](int64_t first, int64_t n, const float* data) -> absl::Status {
          EXPECT_EQ(first, next) << "piece " << pieces;
          EXPECT_LE(n, 7);
          for (int64_t i = 0; i < n; ++i) {
            for (int64_t c = 0; c < cols; ++c) EXPECT_EQ(data[i * cols + c], ValueAt(first + i, c)) << first + i;
          }
          next = first + n;
          ++pieces;
          return absl::OkStatus();
        },
        piece_bytes);
    ASSERT_TRUE(s.ok()) << s;
    EXPECT_EQ(next, kVocab) << "every row once";
    EXPECT_GT(pieces, k) << "several pieces a shard";
  });
}

// A sink that fails stops the sinking (its error is the answer), not the peers' sending: every rank
// finishes the same collectives, and the group goes on (a second gather works).
TEST(TpRowsFailure, AFailingSinkStillLetsThePeersFinish) {
  constexpr int k = 3;
  OnGroup(k, "sink", [&](int rank, TpCommunicator& comm, ChunkStaging& staging) {
    const VocabRange mine = VocabShard(kVocab, rank, k);
    for (int round = 0; round < 2; ++round) {
      if (rank != 0) {
        std::vector<float> rows(mine.end - mine.begin, static_cast<float>(rank));
        EXPECT_TRUE(SendRows(comm, staging, kVocab, 1, rows.data(), 400).ok());
        continue;
      }
      int calls = 0;
      absl::Status s = GatherRows(
          comm, staging, kVocab, 1,
          [&](int64_t, int64_t, const float*) -> absl::Status {
            ++calls;
            return round == 0 ? absl::CancelledError("client went away") : absl::OkStatus();
          },
          400);
      if (round == 0) {
        EXPECT_EQ(s.code(), absl::StatusCode::kCancelled) << s;
        EXPECT_EQ(calls, 1) << "no sinking after the first error";
      } else {
        EXPECT_TRUE(s.ok()) << s;
        EXPECT_GT(calls, 2);
      }
    }
  });
}

INSTANTIATE_TEST_SUITE_P(GroupsAndWidths, TpRows,
                         ::testing::Combine(::testing::Values(2, 3), ::testing::Values(int64_t{1}, int64_t{5})));

}  // namespace
}  // namespace lce::server
