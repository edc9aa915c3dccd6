#include "metrics_http.h"

#include <civetweb.h>

#include <cstring>
#include <mutex>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"

namespace lce::server::metrics {
namespace {

constexpr char kMetricsContentType[] = "text/plain; version=0.0.4; charset=utf-8";

void InitCivetwebOnce() {
  static std::once_flag once;
  std::call_once(once, [] { mg_init_library(0); });
}

// civetweb logs to stderr by default; keep its messages but say whose they are.
int LogMessage(const mg_connection*, const char* message) {
  fprintf(stderr, "metrics http: %s\n", message);
  return 1;  // handled
}

// Returns true when the request may go on (GET or HEAD); otherwise has answered 405.
bool CheckMethod(mg_connection* conn, bool* head_only) {
  const mg_request_info* info = mg_get_request_info(conn);
  const char* m = info ? info->request_method : "";
  *head_only = std::strcmp(m, "HEAD") == 0;
  if (std::strcmp(m, "GET") == 0 || *head_only) return true;
  mg_printf(conn,
            "HTTP/1.1 405 Method Not Allowed\r\nAllow: GET, HEAD\r\nContent-Type: text/plain\r\n"
            "Content-Length: 19\r\nConnection: close\r\n\r\nmethod not allowed\n");
  return false;
}

void Reply(mg_connection* conn, int code, const char* content_type, const std::string& body,
           bool head_only) {
  if (code == 200) {
    mg_send_http_ok(conn, content_type, static_cast<long long>(body.size()));
  } else {
    mg_printf(conn, "HTTP/1.1 %d %s\r\nContent-Type: %s\r\nContent-Length: %zu\r\n\r\n", code,
              mg_get_response_code_text(conn, code), content_type, body.size());
  }
  if (!head_only && !body.empty()) mg_write(conn, body.data(), body.size());
}

}  // namespace

int MetricsHttpServer::HandleMetrics(mg_connection* conn, void* self) {
  auto* server = static_cast<MetricsHttpServer*>(self);
  bool head_only = false;
  if (!CheckMethod(conn, &head_only)) return 405;
  Reply(conn, 200, kMetricsContentType, server->registry_->Render(), head_only);
  return 200;
}

int MetricsHttpServer::HandleHealth(mg_connection* conn, void* self) {
  auto* server = static_cast<MetricsHttpServer*>(self);
  bool head_only = false;
  if (!CheckMethod(conn, &head_only)) return 405;
  bool ok = !server->options_.healthy || server->options_.healthy();
  Reply(conn, ok ? 200 : 503, "text/plain; charset=utf-8", ok ? "ok\n" : "not serving\n",
        head_only);
  return ok ? 200 : 503;
}

absl::StatusOr<std::unique_ptr<MetricsHttpServer>> MetricsHttpServer::Start(
    const Registry* registry, MetricsHttpOptions options) {
  if (registry == nullptr) return absl::InvalidArgumentError("metrics http: no registry");
  if (options.port < 0 || options.port > 65535)
    return absl::InvalidArgumentError(absl::StrCat("metrics http: bad port ", options.port));
  if (options.num_threads < 1) options.num_threads = 1;
  InitCivetwebOnce();

  std::unique_ptr<MetricsHttpServer> server(new MetricsHttpServer());
  server->registry_ = registry;
  server->options_ = std::move(options);
  const MetricsHttpOptions& o = server->options_;

  std::string listen;
  if (o.host.empty()) listen = std::to_string(o.port);
  else if (o.host.find(':') != std::string::npos) listen = absl::StrCat("[", o.host, "]:", o.port);
  else listen = absl::StrCat(o.host, ":", o.port);
  const std::string threads = std::to_string(o.num_threads);
  // No document_root: civetweb serves no files, only the handlers below.
  const char* config[] = {"listening_ports", listen.c_str(),
                          "num_threads", threads.c_str(),
                          "request_timeout_ms", "10000",
                          "enable_keep_alive", "no",
                          nullptr};

  mg_callbacks callbacks;
  std::memset(&callbacks, 0, sizeof callbacks);
  callbacks.log_message = LogMessage;
  mg_init_data init;
  std::memset(&init, 0, sizeof init);
  init.callbacks = &callbacks;
  init.user_data = server.get();
  init.configuration_options = config;
  unsigned error_code = 0;
  char error_text[256] = {0};
  mg_error_data error;
  error.code = &error_code;
  error.text = error_text;
  error.text_buffer_size = sizeof error_text;
  server->ctx_ = mg_start2(&init, &error);
  if (server->ctx_ == nullptr) {
    return absl::UnavailableError(absl::StrCat("metrics http: cannot listen on ", listen, ": ",
                                               error_text[0] ? error_text : "civetweb failed to start",
                                               " (code ", error_code, ")"));
  }
  mg_set_request_handler(server->ctx_, "/metrics$", &MetricsHttpServer::HandleMetrics, server.get());
  mg_set_request_handler(server->ctx_, "/healthz$", &MetricsHttpServer::HandleHealth, server.get());

  mg_server_port ports[4];
  std::memset(ports, 0, sizeof ports);
  int n = mg_get_server_ports(server->ctx_, 4, ports);
  if (n < 1 || ports[0].port <= 0) {
    return absl::InternalError(absl::StrCat("metrics http: no port bound for ", listen));
  }
  server->port_ = ports[0].port;
  return server;
}

MetricsHttpServer::~MetricsHttpServer() {
  if (ctx_ != nullptr) mg_stop(ctx_);
}

}  // namespace lce::server::metrics
