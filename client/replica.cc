#include "replica.h"

#include <algorithm>

#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "grpcpp/create_channel.h"

namespace lce::client {

absl::Status ToAbsl(const grpc::Status& s) {
  if (s.ok()) return absl::OkStatus();
  return absl::Status(static_cast<absl::StatusCode>(s.error_code()), s.error_message());
}

absl::StatusOr<std::vector<std::string>> ReplicaTargets(const ClientOptions& options) {
  const bool round_robin = options.load_balancing == "round_robin";
  if (!round_robin && !options.load_balancing.empty()) {
    return absl::InvalidArgumentError(absl::StrCat("ClientOptions.load_balancing must be \"\" or \"round_robin\", got '",
                                                   options.load_balancing, "'"));
  }
  if (!options.target.empty() && !options.targets.empty()) {
    return absl::InvalidArgumentError("set ClientOptions.target or ClientOptions.targets, not both");
  }
  std::vector<std::string> out;
  if (!options.targets.empty()) {
    out = options.targets;
  } else if (round_robin) {
    out = {options.target};  // one name; its resolver's addresses are the replicas
  } else {
    out = absl::StrSplit(options.target, ',');
  }
  for (std::string& t : out) {
    t = std::string(absl::StripAsciiWhitespace(t));
    if (t.empty()) {
      return absl::InvalidArgumentError(
          options.target.empty() && options.targets.empty()
              ? "ClientOptions.target is empty"
              : absl::StrCat("an empty target in '", options.target.empty() ? "targets" : options.target, "'"));
    }
  }
  if (round_robin && out.size() != 1) {
    return absl::InvalidArgumentError(
        "load_balancing \"round_robin\" takes one target name (e.g. dns:///fronts:50051), not a list");
  }
  return out;
}

std::shared_ptr<grpc::Channel> MakeChannel(const ClientOptions& options, const std::string& target, int index,
                                           const std::string& lb_policy) {
  grpc::ChannelArguments args;
  args.SetMaxReceiveMessageSize(static_cast<int>(std::min<int64_t>(options.max_message_bytes, INT32_MAX)));
  args.SetMaxSendMessageSize(static_cast<int>(std::min<int64_t>(options.max_message_bytes, INT32_MAX)));
  if (options.http2_window_bytes > 0) {
    args.SetInt(GRPC_ARG_HTTP2_STREAM_LOOKAHEAD_BYTES,
                static_cast<int>(std::min<int64_t>(options.http2_window_bytes, INT32_MAX)));
  }
  for (const auto& [name, value] : options.channel_args) args.SetInt(name, value);
  if (!lb_policy.empty()) args.SetLoadBalancingPolicyName(lb_policy);
  // Channels with equal arguments share one connection (gRPC's global subchannel pool): each
  // stream of a split request gets a pool, and so a TCP connection, of its own.
  if (options.streams > 1) {
    args.SetInt(GRPC_ARG_USE_LOCAL_SUBCHANNEL_POOL, 1);
    args.SetInt("lce.connection_index", index);
  }
  auto creds = options.credentials ? options.credentials : grpc::InsecureChannelCredentials();
  return grpc::CreateCustomChannel(target, creds, args);
}

}  // namespace lce::client
