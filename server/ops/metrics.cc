#include "metrics.h"

#include <algorithm>
#include <charconv>
#include <cmath>
#include <limits>
#include <stdexcept>

namespace lce::server::metrics {
namespace {

bool ValidMetricName(std::string_view s) {
  if (s.empty()) return false;
  for (size_t i = 0; i < s.size(); ++i) {
    char c = s[i];
    bool ok = (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || c == '_' || c == ':' ||
              (i > 0 && c >= '0' && c <= '9');
    if (!ok) return false;
  }
  return true;
}

bool ValidLabelName(std::string_view s) {
  if (s.empty() || s.substr(0, 2) == "__") return false;
  for (size_t i = 0; i < s.size(); ++i) {
    char c = s[i];
    bool ok = (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || c == '_' ||
              (i > 0 && c >= '0' && c <= '9');
    if (!ok) return false;
  }
  return true;
}

const char* TypeName(MetricType t) {
  switch (t) {
    case MetricType::kCounter: return "counter";
    case MetricType::kGauge: return "gauge";
    case MetricType::kHistogram: return "histogram";
  }
  return "untyped";
}

// `{a="x",b="y"}` plus an optional extra label (le) at the end; empty when there are no labels.
void AppendLabels(std::string& out, const std::vector<std::string>& names,
                  const std::vector<std::string>& values, const char* extra_name = nullptr,
                  const std::string& extra_value = {}) {
  if (names.empty() && extra_name == nullptr) return;
  out += '{';
  for (size_t i = 0; i < names.size(); ++i) {
    if (i) out += ',';
    out += names[i];
    out += "=\"";
    out += EscapeLabelValue(values[i]);
    out += '"';
  }
  if (extra_name != nullptr) {
    if (!names.empty()) out += ',';
    out += extra_name;
    out += "=\"";
    out += extra_value;
    out += '"';
  }
  out += '}';
}

void AppendHeader(std::string& out, const FamilyBase& f) {
  out += "# HELP ";
  out += f.name();
  out += ' ';
  out += EscapeHelp(f.help());
  out += "\n# TYPE ";
  out += f.name();
  out += ' ';
  out += TypeName(f.type());
  out += '\n';
}

void AppendSample(std::string& out, std::string_view name, const std::vector<std::string>& names,
                  const std::vector<std::string>& values, double v) {
  out += name;
  AppendLabels(out, names, values);
  out += ' ';
  out += FormatValue(v);
  out += '\n';
}

std::shared_ptr<const std::vector<double>> CheckBuckets(std::vector<double> b) {
  if (b.empty()) b = DefaultBuckets();
  if (std::isinf(b.back()) && b.back() > 0) b.pop_back();
  for (size_t i = 0; i < b.size(); ++i) {
    if (!std::isfinite(b[i])) throw std::invalid_argument("metrics: histogram bucket bounds must be finite");
    if (i > 0 && !(b[i] > b[i - 1]))
      throw std::invalid_argument("metrics: histogram bucket bounds must increase strictly");
  }
  return std::make_shared<const std::vector<double>>(std::move(b));
}

}  // namespace

// ---- formatting ----------------------------------------------------------------------------------

std::string FormatValue(double v) {
  if (std::isnan(v)) return "NaN";
  if (std::isinf(v)) return v > 0 ? "+Inf" : "-Inf";
  // Whole numbers below 2^53 (counts, bytes) as plain integers: 1500000000, not 1.5e+09.
  if (v == std::floor(v) && std::fabs(v) < 9007199254740992.0) {
    return std::to_string(static_cast<int64_t>(v));
  }
  char buf[64];
  auto r = std::to_chars(buf, buf + sizeof buf, v);  // shortest string that reads back as v
  return std::string(buf, r.ptr);
}

std::string EscapeHelp(std::string_view s) {
  std::string out;
  out.reserve(s.size());
  for (char c : s) {
    if (c == '\\') out += "\\\\";
    else if (c == '\n') out += "\\n";
    else out += c;
  }
  return out;
}

std::string EscapeLabelValue(std::string_view s) {
  std::string out;
  out.reserve(s.size());
  for (char c : s) {
    if (c == '\\') out += "\\\\";
    else if (c == '\n') out += "\\n";
    else if (c == '"') out += "\\\"";
    else out += c;
  }
  return out;
}

std::vector<double> DefaultBuckets() { return {.005, .01, .025, .05, .1, .25, .5, 1, 2.5, 5, 10}; }

std::vector<double> ExponentialBuckets(double start, double factor, int count) {
  if (!(start > 0) || !(factor > 1) || count < 1)
    throw std::invalid_argument("metrics: ExponentialBuckets needs start > 0, factor > 1, count >= 1");
  std::vector<double> b(count);
  double v = start;
  for (int i = 0; i < count; ++i, v *= factor) b[i] = v;
  return b;
}

std::vector<double> LinearBuckets(double start, double width, int count) {
  if (!(width > 0) || count < 1)
    throw std::invalid_argument("metrics: LinearBuckets needs width > 0, count >= 1");
  std::vector<double> b(count);
  for (int i = 0; i < count; ++i) b[i] = start + width * i;
  return b;
}

// ---- histogram -----------------------------------------------------------------------------------

Histogram::Histogram(std::shared_ptr<const std::vector<double>> bounds)
    : bounds_(std::move(bounds)), counts_(new std::atomic<uint64_t>[bounds_->size() + 1]) {
  for (size_t i = 0; i <= bounds_->size(); ++i) counts_[i].store(0, std::memory_order_relaxed);
}

void Histogram::Observe(double v) {
  // First bound >= v (buckets are `le`); NaN and values above every bound land in +Inf.
  size_t i = std::isnan(v) ? bounds_->size()
                           : std::lower_bound(bounds_->begin(), bounds_->end(), v) - bounds_->begin();
  counts_[i].fetch_add(1, std::memory_order_relaxed);
  sum_.fetch_add(v, std::memory_order_relaxed);
}

Histogram::Snapshot Histogram::Collect() const {
  Snapshot s;
  s.bounds = *bounds_;
  s.cumulative.resize(bounds_->size() + 1);
  uint64_t acc = 0;
  for (size_t i = 0; i <= bounds_->size(); ++i) {
    acc += counts_[i].load(std::memory_order_relaxed);
    s.cumulative[i] = acc;
  }
  s.count = acc;  // _count equals the +Inf bucket by construction, even mid-update
  s.sum = sum_.load(std::memory_order_relaxed);
  return s;
}

// ---- families ------------------------------------------------------------------------------------

void FamilyBase::CheckArity(const std::vector<std::string>& values) const {
  if (values.size() != label_names_.size())
    throw std::invalid_argument("metrics: " + name_ + " takes " +
                                std::to_string(label_names_.size()) + " label values, got " +
                                std::to_string(values.size()));
}

template <typename M>
Family<M>::Family(std::string name, std::string help, std::vector<std::string> label_names,
                  MetricType type, std::shared_ptr<const std::vector<double>> bounds)
    : FamilyBase(std::move(name), std::move(help), std::move(label_names), type),
      bounds_(std::move(bounds)) {
  if (label_names_.empty()) series_.emplace(std::vector<std::string>{}, Make());
}

template <typename M>
std::unique_ptr<M> Family<M>::Make() const {
  if constexpr (std::is_same_v<M, Histogram>) {
    return std::make_unique<Histogram>(bounds_);
  } else {
    return std::make_unique<M>();
  }
}

template <typename M>
M& Family<M>::WithLabels(const std::vector<std::string>& values) {
  CheckArity(values);
  std::lock_guard<std::mutex> lock(mu_);
  auto it = series_.find(values);
  if (it == series_.end()) it = series_.emplace(values, Make()).first;
  return *it->second;
}

template <typename M>
void Family<M>::Remove(const std::vector<std::string>& values) {
  CheckArity(values);
  std::lock_guard<std::mutex> lock(mu_);
  series_.erase(values);
}

template <typename M>
void Family<M>::Render(std::string& out) const {
  std::lock_guard<std::mutex> lock(mu_);
  if (series_.empty()) return;
  AppendHeader(out, *this);
  for (const auto& [values, metric] : series_) {
    if constexpr (std::is_same_v<M, Histogram>) {
      Histogram::Snapshot s = metric->Collect();
      const std::string bucket = name_ + "_bucket";
      for (size_t i = 0; i <= s.bounds.size(); ++i) {
        out += bucket;
        AppendLabels(out, label_names_, values, "le",
                     i < s.bounds.size() ? FormatValue(s.bounds[i]) : std::string("+Inf"));
        out += ' ';
        out += std::to_string(s.cumulative[i]);
        out += '\n';
      }
      AppendSample(out, name_ + "_sum", label_names_, values, s.sum);
      out += name_ + "_count";
      AppendLabels(out, label_names_, values);
      out += ' ';
      out += std::to_string(s.count);
      out += '\n';
    } else {
      AppendSample(out, name_, label_names_, values, metric->Value());
    }
  }
}

template class Family<Counter>;
template class Family<Gauge>;
template class Family<Histogram>;

// ---- registry ------------------------------------------------------------------------------------

Registry::Registry() = default;
Registry::~Registry() = default;

template <typename M>
Family<M>& Registry::Add(std::string name, std::string help, std::vector<std::string> label_names,
                         MetricType type, std::shared_ptr<const std::vector<double>> bounds) {
  if (!ValidMetricName(name)) throw std::invalid_argument("metrics: bad metric name '" + name + "'");
  for (size_t i = 0; i < label_names.size(); ++i) {
    const std::string& l = label_names[i];
    if (!ValidLabelName(l))
      throw std::invalid_argument("metrics: bad label name '" + l + "' on " + name);
    if (type == MetricType::kHistogram && l == "le")
      throw std::invalid_argument("metrics: histogram " + name + " cannot have a label 'le'");
    if (std::find(label_names.begin(), label_names.begin() + i, l) != label_names.begin() + i)
      throw std::invalid_argument("metrics: label '" + l + "' repeated on " + name);
  }
  std::lock_guard<std::mutex> lock(mu_);
  // Names this family renders, to catch collisions such as a histogram x and a counter x_count.
  auto rendered = [](const std::string& n, MetricType t) {
    if (t != MetricType::kHistogram) return std::vector<std::string>{n};
    return std::vector<std::string>{n, n + "_bucket", n + "_sum", n + "_count"};
  };
  for (const auto& f : families_) {
    if (f->name() == name) {
      bool same = f->type() == type && f->label_names() == label_names;
      if (same && bounds) same = *static_cast<Family<M>*>(f.get())->bounds() == *bounds;
      if (!same)
        throw std::invalid_argument("metrics: " + name + " already registered with another shape");
      return *static_cast<Family<M>*>(f.get());
    }
    for (const std::string& a : rendered(name, type))
      for (const std::string& b : rendered(f->name(), f->type()))
        if (a == b)
          throw std::invalid_argument("metrics: " + name + " collides with " + f->name());
  }
  auto family = std::make_unique<Family<M>>(std::move(name), std::move(help),
                                            std::move(label_names), type, std::move(bounds));
  Family<M>& ref = *family;
  families_.push_back(std::move(family));
  return ref;
}

Family<Counter>& Registry::AddCounter(std::string name, std::string help,
                                      std::vector<std::string> label_names) {
  constexpr std::string_view kSuffix = "_total";
  if (name.size() < kSuffix.size() || name.compare(name.size() - kSuffix.size(), kSuffix.size(), kSuffix) != 0)
    name += kSuffix;
  return Add<Counter>(std::move(name), std::move(help), std::move(label_names),
                      MetricType::kCounter, nullptr);
}

Family<Gauge>& Registry::AddGauge(std::string name, std::string help,
                                  std::vector<std::string> label_names) {
  return Add<Gauge>(std::move(name), std::move(help), std::move(label_names), MetricType::kGauge,
                    nullptr);
}

Family<Histogram>& Registry::AddHistogram(std::string name, std::string help,
                                          std::vector<std::string> label_names,
                                          std::vector<double> buckets) {
  return Add<Histogram>(std::move(name), std::move(help), std::move(label_names),
                        MetricType::kHistogram, CheckBuckets(std::move(buckets)));
}

void Registry::AddCollectHook(std::function<void()> hook) {
  std::lock_guard<std::mutex> lock(mu_);
  hooks_.push_back(std::move(hook));
}

std::string Registry::Render() const {
  std::vector<std::function<void()>> hooks;
  std::vector<const FamilyBase*> families;
  {
    std::lock_guard<std::mutex> lock(mu_);
    hooks = hooks_;
    for (const auto& f : families_) families.push_back(f.get());  // families are never removed
  }
  for (const auto& h : hooks) h();
  std::string out;
  for (const FamilyBase* f : families) f->Render(out);
  return out;
}

}  // namespace lce::server::metrics
