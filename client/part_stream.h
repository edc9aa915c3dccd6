// One stream of a request: rows [first, first + count) of its batch cut into chunks, written on a
// worker while this thread reads the answers into the request's AnswerAssembly; over the data plane
// with uploaders that move each chunk's bytes into server memory first. A request that fits one
// chunk goes as one LceService.Call instead. Private to the client library.
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/types/span.h"
#include "answer_assembly.h"
#include "data_plane_connection.h"
#include "hidden_call.h"
#include "lce/client/lce_client.h"
#include "worker_pool.h"

namespace lce::client {

// One stream's data-plane sockets, ClientOptions.data_plane_sockets each way.
struct DataPlaneLane {
  std::vector<DataPlaneConnection*> up, down;
};

// A request's per-row upstream gradients (each empty, or one value a row).
struct RowGrads {
  absl::Span<const float> loss, logprob, entropy;
};

// What a stream uses of its client.
struct StreamEnv {
  const ClientOptions& options;
  WorkerPool& workers;                                // runs the writer and the uploaders
  std::atomic<bool>& no_call;                         // the server has no LceService.Call: stream from now on
  std::function<void(grpc::ClientContext*)> prepare;  // a call's deadline, token and session metadata
};

// What every stream of one request shares.
struct PartRequest {
  const char* rpc;                  // "Score", "ForwardBackward" or "Backward"
  const HiddenBatch& batch;         // region-backed over the data plane (its bytes travel apart)
  const v1::RequestHeader& header;  // partial where the request is split
  RowGrads grads;
  AnswerAssembly& assembly;
};

// Moves `bytes` over the sockets at once, a share each: `move(socket, offset, length)`, the first
// share on this thread and the others on `workers`. The first failure is returned.
absl::Status SplitTransfer(const std::vector<DataPlaneConnection*>& sockets, int64_t bytes, WorkerPool& workers,
                           const std::function<absl::Status(DataPlaneConnection&, int64_t, int64_t)>& move);

class PartStream {
 public:
  // Rows [rows.first, rows.first + rows.second) of `request`; `lane`: its data-plane sockets (null:
  // the bytes go in the messages, or stay in the batch's regions).
  PartStream(const StreamEnv& env, const PartRequest& request, std::pair<int64_t, int64_t> rows,
             const DataPlaneLane* lane);
  PartStream(const PartStream&) = delete;
  PartStream& operator=(const PartStream&) = delete;

  // Runs the stream on `stub` with `ctx` (which another stream of the request may cancel); its
  // summary goes into `summary`. `hidden_call`: the stub's channel's, for a request that fits one
  // Call (null: none).
  absl::Status Run(v1::LceService::Stub& stub, const HiddenCall* hidden_call, grpc::ClientContext& ctx,
                   PartSummary* summary);

 private:
  using BidiStream = grpc::ClientReaderWriter<v1::StreamRequest, v1::StreamResponse>;

  std::vector<std::pair<int64_t, int64_t>> PlanChunks() const;
  bool FitsOneCall() const;
  // The whole request as one Call; nullopt where the server has no Call (an older one).
  std::optional<absl::Status> RunAsCall(v1::LceService::Stub& stub, const HiddenCall* hidden_call);
  absl::Status RunAsStream(v1::LceService::Stub& stub, grpc::ClientContext& ctx);
  std::unique_ptr<BidiStream> Open(v1::LceService::Stub& stub, grpc::ClientContext& ctx);

  // Writing: the message of plan chunk k (`with_hidden`: with the hidden bytes, which a HiddenCall
  // sends from the batch itself); the uploaders; the header and chunks.
  void ChunkMessage(size_t k, v1::StreamRequest& msg, bool with_hidden = true) const;
  void StartUploaders(grpc::ClientContext& ctx);
  void Upload(int socket, grpc::ClientContext& ctx);
  void WriteRequest(BidiStream& stream);
  size_t WriteHeader(BidiStream& stream, bool* more);
  void WriteChunks(BidiStream& stream, size_t first);
  void StopAll();

  // Reading: answers placed by first_row/rows (relative to the part); together they must cover the
  // part's rows exactly once.
  void ReadAnswers(BidiStream& stream, grpc::ClientContext& ctx);
  bool Handle(const v1::StreamResponse& resp);
  absl::Status Place(const v1::ChunkResult& c);
  absl::Status DownloadDHidden(int64_t first, int64_t n);

  void Mark(StreamTrace::Time& t) const;
  void ReportTrace();

  const StreamEnv& env_;
  const PartRequest& request_;
  const HiddenBatch& batch_;
  const int64_t part_first_, part_rows_, row_bytes_;
  const DataPlaneLane* const lane_;
  const bool hidden_in_region_;
  const bool tracing_;
  const std::vector<std::pair<int64_t, int64_t>> plan_;  // the chunks' [first, count), request rows
  PartSummary* summary_ = nullptr;
  StreamTrace trace_;

  // Over the data plane, uploaders move the plan's chunks into server memory back to back and the
  // writer announces each chunk once its bytes are in, without waiting for answers.
  std::mutex mu_;
  std::condition_variable cv_;
  size_t uploaded_ = 0;           // data plane: plan chunks whose bytes are in server memory (under mu_)
  bool stop_ = false;             // the call is over: failed, or the answers are all in (under mu_)
  std::vector<int> shares_done_;  // by plan chunk: the sockets that moved their share (under mu_)
  absl::Status upload_error_;     // under mu_
  absl::Status answer_error_;     // the answers are unusable (the reading thread's)
  const int uploaders_;
  TaskLatch tasks_done_;  // the uploaders and the writer
};

}  // namespace lce::client
