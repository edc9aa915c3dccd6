// A small Prometheus metrics library: a Registry of metric families (counters, gauges, histograms
// with label names) rendered in the Prometheus text exposition format 0.0.4. Everything the rest of
// the server uses of it is in this one header, so that prometheus-cpp can replace it later (its
// shapes are close: Registry, Family<T>, T& from a family, invalid_argument on misuse).
//
//   metrics::Registry registry;
//   auto& requests = registry.AddCounter("lce_requests", "RPCs served.", {"method", "code"});
//   requests.WithLabels({"Score", "OK"}).Increment();       // renders lce_requests_total{...}
//   auto& latency = registry.AddHistogram("lce_request_duration_seconds", "RPC latency.",
//                                         {"method"}, metrics::ExponentialBuckets(0.001, 2, 16));
//   latency.WithLabels({"Score"}).Observe(0.012);
//   std::string text = registry.Render();
//
// Threads: WithLabels() takes the family's mutex (a label set is created at most once); the
// reference it returns stays valid as long as the Registry and is updated with atomics only, so
// hot paths should look a handle up once and keep it. Render() may run concurrently with updates.
// Misuse (bad metric or label name, a name registered twice with a different shape, a wrong number
// of label values) throws std::invalid_argument: it is a programming error, found at startup.
#pragma once

#include <atomic>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <string_view>
#include <vector>

namespace lce::server::metrics {

// A monotonically increasing value. Negative increments are ignored.
class Counter {
 public:
  void Increment(double v = 1.0) {
    if (v > 0) value_.fetch_add(v, std::memory_order_relaxed);
  }
  double Value() const { return value_.load(std::memory_order_relaxed); }

 private:
  std::atomic<double> value_{0.0};
};

// A value that goes up and down.
class Gauge {
 public:
  void Set(double v) { value_.store(v, std::memory_order_relaxed); }
  void Increment(double v = 1.0) { value_.fetch_add(v, std::memory_order_relaxed); }
  void Decrement(double v = 1.0) { value_.fetch_sub(v, std::memory_order_relaxed); }
  double Value() const { return value_.load(std::memory_order_relaxed); }

 private:
  std::atomic<double> value_{0.0};
};

// Observations counted into buckets with upper bounds (inclusive, `le`), plus their sum and count.
// The bounds are the family's; +Inf is implicit.
class Histogram {
 public:
  explicit Histogram(std::shared_ptr<const std::vector<double>> bounds);
  void Observe(double v);

  struct Snapshot {
    std::vector<double> bounds;          // finite upper bounds, ascending
    std::vector<uint64_t> cumulative;    // bounds.size() + 1 entries; the last is +Inf == count
    double sum = 0;
    uint64_t count = 0;
  };
  Snapshot Collect() const;

 private:
  std::shared_ptr<const std::vector<double>> bounds_;
  std::unique_ptr<std::atomic<uint64_t>[]> counts_;  // per bucket, not cumulative; +Inf last
  std::atomic<double> sum_{0.0};
};

enum class MetricType { kCounter, kGauge, kHistogram };

// One metric name with fixed label names; a series per distinct label-value tuple.
class FamilyBase {
 public:
  virtual ~FamilyBase() = default;
  const std::string& name() const { return name_; }
  const std::string& help() const { return help_; }
  const std::vector<std::string>& label_names() const { return label_names_; }
  MetricType type() const { return type_; }
  // Appends this family's exposition text (nothing when it has no series yet).
  virtual void Render(std::string& out) const = 0;

 protected:
  FamilyBase(std::string name, std::string help, std::vector<std::string> label_names,
             MetricType type)
      : name_(std::move(name)), help_(std::move(help)), label_names_(std::move(label_names)),
        type_(type) {}
  void CheckArity(const std::vector<std::string>& values) const;

  std::string name_, help_;
  std::vector<std::string> label_names_;
  MetricType type_;
};

template <typename M>
class Family : public FamilyBase {
 public:
  // Values in the order of the family's label names. Creates the series on first use.
  M& WithLabels(const std::vector<std::string>& values);
  // Drops a series (e.g. a peer that left); references to it must not be used afterwards.
  void Remove(const std::vector<std::string>& values);
  void Render(std::string& out) const override;

  // Internal: use Registry::Add*.
  Family(std::string name, std::string help, std::vector<std::string> label_names,
         MetricType type, std::shared_ptr<const std::vector<double>> bounds = nullptr);
  const std::vector<double>* bounds() const { return bounds_.get(); }

 private:
  std::unique_ptr<M> Make() const;
  mutable std::mutex mu_;
  std::map<std::vector<std::string>, std::unique_ptr<M>> series_;
  std::shared_ptr<const std::vector<double>> bounds_;  // histograms only
};

class Registry {
 public:
  Registry();
  ~Registry();
  Registry(const Registry&) = delete;
  Registry& operator=(const Registry&) = delete;

  // Counter names get a `_total` suffix when they lack one (lce_requests -> lce_requests_total).
  // Registering the same name again with the same type and labels (and buckets) returns the same
  // family. A family without label names has its single series created at once (renders 0).
  Family<Counter>& AddCounter(std::string name, std::string help,
                              std::vector<std::string> label_names = {});
  Family<Gauge>& AddGauge(std::string name, std::string help,
                          std::vector<std::string> label_names = {});
  // `buckets`: finite upper bounds, strictly increasing (a trailing +Inf is dropped). Empty means
  // DefaultBuckets().
  Family<Histogram>& AddHistogram(std::string name, std::string help,
                                  std::vector<std::string> label_names = {},
                                  std::vector<double> buckets = {});

  // Runs before every Render(): the place to refresh gauges that are sampled, not pushed (device
  // memory, for instance). Hooks must not call Render().
  void AddCollectHook(std::function<void()> hook);

  // Text exposition format 0.0.4, families in registration order, series sorted by label values.
  std::string Render() const;

 private:
  template <typename M>
  Family<M>& Add(std::string name, std::string help, std::vector<std::string> label_names,
                 MetricType type, std::shared_ptr<const std::vector<double>> bounds);
  mutable std::mutex mu_;
  std::vector<std::unique_ptr<FamilyBase>> families_;
  std::vector<std::function<void()>> hooks_;
};

// Prometheus client defaults: .005 .01 .025 .05 .1 .25 .5 1 2.5 5 10 (seconds).
std::vector<double> DefaultBuckets();
// start, start*factor, ... (count bounds). start > 0, factor > 1, count >= 1.
std::vector<double> ExponentialBuckets(double start, double factor, int count);
// start, start+width, ... (count bounds). width > 0, count >= 1.
std::vector<double> LinearBuckets(double start, double width, int count);

// Exposition helpers, exposed for tests.
// +Inf, -Inf, NaN; whole numbers below 2^53 as integers; otherwise the shortest round-trip form.
std::string FormatValue(double v);
std::string EscapeHelp(std::string_view s);    // backslash, newline
std::string EscapeLabelValue(std::string_view s);  // backslash, double quote, newline

}  // namespace lce::server::metrics
