// The servers an LceClient talks to: one Replica per target (or one per round_robin name), each with
// its channels, stubs and data-plane state. Private to the client library.
#pragma once

#include <atomic>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "data_plane_connection.h"
#include "hidden_call.h"
#include "lce/client/lce_client.h"

namespace lce::client {

struct LceClient::DataPlane {
  std::mutex mu;  // held by the call using the regions
  std::unique_ptr<SharedMemorySession> session;
  int port = 0;
  bool tls = false;  // GetInfoResponse.data_plane_tls
  uint64_t hidden_region = 0, d_hidden_region = 0;
  int64_t hidden_bytes = 0, d_hidden_bytes = 0;  // their sizes (0: none yet)
  std::vector<std::unique_ptr<DataPlaneConnection>> up, down;  // by stream

  void Reset() {  // after a failure: the server may have restarted, a socket be mid-transfer
    session.reset();
    hidden_bytes = d_hidden_bytes = 0;
    up.clear();
    down.clear();
  }
};

struct LceClient::Replica {
  std::string target;
  std::shared_ptr<grpc::Channel> channel;
  std::unique_ptr<v1::LceService::Stub> stub;
  std::unique_ptr<HiddenCall> hidden_call;  // Calls on `channel`, their hidden states not copied
  // Connections 1..streams-1 for split requests (`stub` is the first).
  std::vector<std::shared_ptr<grpc::Channel>> extra_channels;
  std::vector<std::unique_ptr<v1::LceService::Stub>> extra_stubs;
  std::atomic<bool> extra_connected{false};
  DataPlane data_plane;
};

// A gRPC status as an absl::Status of the same code and message.
absl::Status ToAbsl(const grpc::Status& s);

// The targets ClientOptions names: `targets`, or `target` split at commas (one name, unsplit, with
// load_balancing "round_robin"). INVALID_ARGUMENT for none, an empty one, both fields set, or an
// unknown load_balancing.
absl::StatusOr<std::vector<std::string>> ReplicaTargets(const ClientOptions& options);

// A channel to `target` with the options' credentials, message limits and transport arguments; `index`
// tells apart the connections of one target's split-request streams; `lb_policy` "" is gRPC's
// default (pick_first).
std::shared_ptr<grpc::Channel> MakeChannel(const ClientOptions& options, const std::string& target, int index,
                                           const std::string& lb_policy);

}  // namespace lce::client
