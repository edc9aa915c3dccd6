// lce_server: loads the head, builds the engine, serves lce.v1.LceService until SIGTERM/SIGINT,
// then stops accepting, lets in-flight streams finish and exits 0.
#include <csignal>
#include <cstdio>
#include <fstream>
#include <iostream>

#include <unistd.h>

#include "absl/strings/str_cat.h"
#include "grpc_server.h"
#include "head_source.h"
#include "server_flags.h"

namespace {

// SIGTERM/SIGINT write the signal number here; main blocks reading it. A handler (not sigwait)
// because libraries start threads before main, and a blocked-signal mask would not cover them.
int g_signal_pipe[2] = {-1, -1};

void OnSignal(int sig) {
  const char c = static_cast<char>(sig);
  (void)!write(g_signal_pipe[1], &c, 1);
}

int Fail(const absl::Status& s) {
  std::cerr << "lce_server: " << s << std::endl;
  return 2;
}

}  // namespace

int main(int argc, char** argv) {
  using namespace lce;
  using namespace lce::server;
  if (pipe(g_signal_pipe) != 0) return Fail(absl::InternalError("pipe() failed"));
  struct sigaction action = {};
  action.sa_handler = OnSignal;
  sigemptyset(&action.sa_mask);
  sigaction(SIGTERM, &action, nullptr);
  sigaction(SIGINT, &action, nullptr);

  absl::StatusOr<ServerFlags> flags = ParseServerFlags(argc, argv);
  if (!flags.ok()) return Fail(flags.status());
  if (flags->help) {
    std::cout << ServerUsage();
    return 0;
  }
  absl::StatusOr<Backend> backend = ParseBackend(flags->backend);
  if (!backend.ok()) return Fail(backend.status());
  absl::StatusOr<std::shared_ptr<HeadWeights>> weights = LoadHead(flags->head, 0, 1);
  if (!weights.ok()) return Fail(weights.status());
  EngineConfig config;
  config.workspace_bytes = flags->workspace_bytes;
  config.cpu_threads = flags->cpu_threads;
  config.device = flags->device;
  absl::StatusOr<std::unique_ptr<LceEngine>> engine = CreateEngine(*backend, *weights, config);
  if (!engine.ok()) return Fail(engine.status());
  const HeadShape shape = (*engine)->shape();

  auto heads = std::make_shared<HeadStore>();
  if (absl::Status s = heads->Put(flags->head_name, std::move(*engine)); !s.ok()) return Fail(s);

  GrpcServerOptions options;
  options.address = absl::StrCat(flags->host, ":", flags->port);
  options.service.max_message_bytes = flags->max_message_bytes;
  options.service.limits.max_rows_per_request = flags->max_rows_per_request;
  absl::StatusOr<std::unique_ptr<GrpcServer>> server = GrpcServer::Start(heads, options);
  if (!server.ok()) return Fail(server.status());
  const int port = (*server)->port();
  if (!flags->port_file.empty()) {
    const std::string tmp = flags->port_file + ".tmp";
    std::ofstream(tmp) << port << "\n";
    std::rename(tmp.c_str(), flags->port_file.c_str());  // readers never see a half-written file
  }
  std::cout << "lce_server listening on " << (flags->host == "0.0.0.0" ? "127.0.0.1" : flags->host) << ":"
            << port << " (backend " << (*heads->Get(""))->engine->backend() << ", head '" << flags->head_name
            << "' V=" << shape.vocab_size << " H=" << shape.hidden_size << " " << DTypeName(shape.dtype) << ")"
            << std::endl;

  char sig = 0;
  while (read(g_signal_pipe[0], &sig, 1) != 1) {
  }
  std::cout << "lce_server: signal " << static_cast<int>(sig) << ", draining in-flight streams" << std::endl;
  (*server)->Shutdown(absl::Seconds(flags->shutdown_grace_seconds));
  std::cout << "lce_server: stopped" << std::endl;
  return 0;
}
