// dsv4_run: prefill + greedy decode of a DeepSeek-V4 AOTInductor package (.pt2).
//
// The package holds the AOTI models "prefill" (its largest prefill chunk), "prefill_<C>" for each
// smaller chunk size of dsv4.prefill_chunks, and "decode", whose metadata carries the dsv4.* keys
// (see csrc/runner/README.md for the interface). A CUDA package calls the indexer's CUDA
// top-k, dsv4::topk_rows_cuda, a C++ op of dsv4_ops' native library (dsv4_ops/_C*.so) that
// AOTInductor's proxy executor finds in the dispatcher: the runner dlopens that library before
// it loads the package (--library, $DSV4_OPS_LIBRARY, or the checkout's beside the runner).
// Only API present in both torch 2.11 and 2.13 is used:
//   AOTIModelPackageLoader(path, model_name, run_single_threaded, num_runners, device_index)
//   loader.run(inputs, stream_handle), loader.get_metadata()
#include <ATen/Tensor.h>
#include <ATen/ops/argmax.h>
#include <ATen/ops/zeros.h>
#include <c10/util/Exception.h>
#include <torch/csrc/inductor/aoti_package/model_package_loader.h>

#ifdef DSV4_WITH_CUDA
#include <ATen/cuda/CUDAGraph.h>
#include <c10/cuda/CUDAFunctions.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#endif

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <functional>
#include <iostream>
#include <map>
#include <memory>
#include <optional>
#include <sstream>
#include <stdexcept>
#include <string>
#include <unordered_map>
#include <vector>

#include <dirent.h>
#include <dlfcn.h>
#include <limits.h>
#include <sys/stat.h>
#include <unistd.h>

namespace {

constexpr int kExitRuntime = 1;
constexpr int kExitUsage = 2;

// Error carrying the exit code: kExitUsage for a wrong command line (including
// arguments beyond the package's limits), kExitRuntime for package/runtime trouble.
struct RunError : std::runtime_error {
  int code;
  RunError(int c, const std::string& msg) : std::runtime_error(msg), code(c) {}
};
[[noreturn]] void usage_error(const std::string& m) { throw RunError(kExitUsage, m); }
[[noreturn]] void runtime_error(const std::string& m) { throw RunError(kExitRuntime, m); }

const char* kHelp =
    "usage: dsv4_run MODEL.pt2 --prompt IDS [--prompt IDS ...] [--max-new-tokens N]\n"
    "                [--quiet] [--no-cuda-graph] [--library PATH ...]\n"
    "\n"
    "Loads the prefill models (one per chunk size) and the \"decode\" model of a dsv4\n"
    "package, prefills every prompt as one batch and decodes greedily.\n"
    "\n"
    "  MODEL.pt2            AOTInductor package written by the dsv4 exporter\n"
    "  --prompt IDS         comma-separated token ids, e.g. 1,2,3 (repeat for a batch;\n"
    "                       at most dsv4.max_batch_size prompts)\n"
    "  --max-new-tokens N   new tokens per prompt, N >= 1 (default 32);\n"
    "                       len(prompt) + N - 1 must be <= dsv4.max_seq_len\n"
    "  --quiet              no timing/progress on stderr\n"
    "  --no-cuda-graph      CUDA packages: run every decode step eagerly instead of\n"
    "                       replaying a captured CUDA graph\n"
    "  --library PATH       dlopen PATH before loading the package (repeatable): dsv4_ops'\n"
    "                       native library, whose C++ ops (the CUDA top-k) CUDA packages\n"
    "                       call; its path: python -c \"import dsv4_ops.native as n;\n"
    "                       print(n.library_path())\". Default: $DSV4_OPS_LIBRARY, else\n"
    "                       (CUDA runner) ../dsv4_ops/_C*.so beside this executable\n"
    "  -h, --help           this text\n"
    "\n"
    "stdout: one line per prompt, in prompt order: the N new token ids, comma-separated.\n"
    "stderr: load time, prefill ms, decode ms/step (unless --quiet), and errors.\n"
    "exit:   0 ok; 2 bad command line (or arguments beyond the package's limits);\n"
    "        1 the package cannot be loaded or run.\n"
    "\n"
    "Known issue (torch 2.11 GPU box): loading a .pt2 segfaults inside std::regex unless\n"
    "the process starts with LD_PRELOAD=/usr/lib/x86_64-linux-gnu/libstdc++.so.6\n";

struct Options {
  std::string model;
  std::vector<std::vector<int64_t>> prompts;
  int64_t max_new_tokens = 32;
  bool quiet = false;
  bool cuda_graph = true;
  std::vector<std::string> libraries;  // --library, in order
};

int64_t parse_int(const std::string& s, const std::string& what) {
  if (s.empty()) usage_error(what + ": empty value");
  errno = 0;
  char* end = nullptr;
  long long v = std::strtoll(s.c_str(), &end, 10);
  if (end != s.c_str() + s.size() || errno == ERANGE || std::isspace((unsigned char)s[0]))
    usage_error(what + ": '" + s + "' is not an integer");
  return v;
}

std::vector<int64_t> parse_ids(const std::string& s, size_t index) {
  const std::string what = "--prompt #" + std::to_string(index + 1);
  if (s.empty()) usage_error(what + ": empty prompt (need at least one token id)");
  std::vector<int64_t> ids;
  size_t start = 0;
  while (true) {
    size_t comma = s.find(',', start);
    std::string tok = s.substr(start, comma == std::string::npos ? std::string::npos : comma - start);
    if (tok.empty()) usage_error(what + ": empty token id in '" + s + "'");
    ids.push_back(parse_int(tok, what));
    if (comma == std::string::npos) break;
    start = comma + 1;
  }
  return ids;
}

// Returns false when --help was requested.
bool parse_args(int argc, char** argv, Options& o) {
  std::vector<std::string> prompt_args;
  bool have_model = false;
  for (int i = 1; i < argc; ++i) {
    std::string a = argv[i];
    std::string val;
    bool has_inline = false;
    if (a.rfind("--", 0) == 0 && a.find('=') != std::string::npos) {
      val = a.substr(a.find('=') + 1);
      a = a.substr(0, a.find('='));
      has_inline = true;
    }
    auto need_value = [&](const std::string& flag) -> std::string {
      if (has_inline) return val;
      if (i + 1 >= argc) usage_error(flag + ": missing value");
      return argv[++i];
    };
    auto no_value = [&](const std::string& flag) {
      if (has_inline) usage_error(flag + " takes no value");
    };
    if (a == "-h" || a == "--help") {
      return false;
    } else if (a == "--prompt") {
      prompt_args.push_back(need_value(a));
    } else if (a == "--max-new-tokens") {
      o.max_new_tokens = parse_int(need_value(a), a);
      if (o.max_new_tokens < 1)
        usage_error("--max-new-tokens: must be >= 1, got " + std::to_string(o.max_new_tokens));
    } else if (a == "--quiet") {
      no_value(a);
      o.quiet = true;
    } else if (a == "--no-cuda-graph") {
      no_value(a);
      o.cuda_graph = false;
    } else if (a == "--library") {
      std::string path = need_value(a);
      if (path.empty()) usage_error("--library: empty path");
      o.libraries.push_back(path);
    } else if (a.size() > 1 && a[0] == '-') {
      usage_error("unknown option '" + a + "' (see --help)");
    } else {
      if (have_model) usage_error("more than one model path given: '" + o.model + "' and '" + a + "'");
      o.model = a;
      have_model = true;
    }
  }
  if (!have_model) usage_error("missing MODEL.pt2 argument (see --help)");
  if (prompt_args.empty()) usage_error("missing --prompt (need at least one)");
  for (size_t i = 0; i < prompt_args.size(); ++i) o.prompts.push_back(parse_ids(prompt_args[i], i));
  return true;
}

// ---- package metadata -------------------------------------------------------

struct CacheSpec {
  c10::ScalarType dtype;
  std::vector<int64_t> shape;
};

struct PackageInfo {
  int64_t max_batch = 0, max_seq_len = 0, chunk = 0, vocab = 0;
  std::vector<int64_t> chunks;  // ascending; the last is `chunk` (the "prefill" model's)
  std::string device;
  std::vector<CacheSpec> cache;
};

int64_t meta_int(const std::unordered_map<std::string, std::string>& m, const std::string& key,
                 const std::string& model) {
  auto it = m.find(key);
  if (it == m.end()) runtime_error(model + ": metadata key " + key + " missing");
  try {
    size_t pos = 0;
    long long v = std::stoll(it->second, &pos);
    if (pos != it->second.size() || v <= 0) throw std::invalid_argument("");
    return v;
  } catch (const std::exception&) {
    runtime_error(model + ": metadata " + key + "='" + it->second + "' is not a positive integer");
  }
}

c10::ScalarType parse_dtype(const std::string& s, const std::string& spec) {
  static const std::map<std::string, c10::ScalarType> kTypes = {
      {"float32", c10::kFloat}, {"bfloat16", c10::kBFloat16}, {"float16", c10::kHalf},
      {"int32", c10::kInt},     {"int64", c10::kLong}};
  auto it = kTypes.find(s);
  if (it == kTypes.end()) runtime_error("dsv4.cache: unknown dtype '" + s + "' in '" + spec + "'");
  return it->second;
}

std::vector<CacheSpec> parse_cache(const std::string& s) {
  std::vector<CacheSpec> out;
  std::stringstream ss(s);
  std::string item;
  while (std::getline(ss, item, ';')) {
    if (item.empty()) continue;
    auto colon = item.find(':');
    if (colon == std::string::npos) runtime_error("dsv4.cache: entry '" + item + "' is not dtype:d0xd1x...");
    CacheSpec c;
    c.dtype = parse_dtype(item.substr(0, colon), item);
    std::stringstream dims(item.substr(colon + 1));
    std::string d;
    while (std::getline(dims, d, 'x')) {
      try {
        size_t pos = 0;
        long long v = std::stoll(d, &pos);
        if (pos != d.size() || v < 0) throw std::invalid_argument("");
        c.shape.push_back(v);
      } catch (const std::exception&) {
        runtime_error("dsv4.cache: bad dimension '" + d + "' in '" + item + "'");
      }
    }
    if (c.shape.empty()) runtime_error("dsv4.cache: entry '" + item + "' has no shape");
    out.push_back(std::move(c));
  }
  return out;
}

PackageInfo read_info(const std::unordered_map<std::string, std::string>& m, const std::string& path,
                      const std::string& model) {
  bool any = false;
  for (auto& kv : m) any = any || kv.first.rfind("dsv4.", 0) == 0;
  if (!any) runtime_error(path + ": model '" + model + "' has no dsv4.* metadata; not a dsv4 package");
  auto fmt = m.find("dsv4.format");
  if (fmt == m.end() || fmt->second != "1")
    runtime_error(path + ": dsv4.format is '" + (fmt == m.end() ? std::string("<missing>") : fmt->second) +
                  "', this runner reads format 1");
  PackageInfo p;
  p.max_batch = meta_int(m, "dsv4.max_batch_size", model);
  p.max_seq_len = meta_int(m, "dsv4.max_seq_len", model);
  p.chunk = meta_int(m, "dsv4.prefill_chunk", model);
  auto chunks = m.find("dsv4.prefill_chunks");  // absent in packages of one chunk size
  if (chunks == m.end()) {
    p.chunks = {p.chunk};
  } else {
    std::stringstream ss(chunks->second);
    std::string part;
    while (std::getline(ss, part, ',')) {
      char* end = nullptr;
      long long c = std::strtoll(part.c_str(), &end, 10);
      if (part.empty() || *end != '\0' || c <= 0 || (!p.chunks.empty() && c <= p.chunks.back()))
        runtime_error(model + ": metadata dsv4.prefill_chunks='" + chunks->second +
                      "' is not an ascending list of positive integers");
      p.chunks.push_back(c);
    }
    if (p.chunks.empty() || p.chunks.back() != p.chunk)
      runtime_error(model + ": metadata dsv4.prefill_chunks='" + chunks->second +
                    "' does not end at dsv4.prefill_chunk=" + std::to_string(p.chunk));
  }
  p.vocab = meta_int(m, "dsv4.vocab_size", model);
  auto dev = m.find("dsv4.device");
  if (dev == m.end()) runtime_error(model + ": metadata key dsv4.device missing");
  p.device = dev->second;
  if (p.device != "cpu" && p.device != "cuda")
    runtime_error(model + ": dsv4.device='" + p.device + "', expected cpu or cuda");
  auto cache = m.find("dsv4.cache");
  if (cache == m.end()) runtime_error(model + ": metadata key dsv4.cache missing");
  p.cache = parse_cache(cache->second);
  return p;
}

// ---- dsv4_ops' native library -------------------------------------------------

// What load_native did: the libraries it loaded, else why none (for the error when a package
// calls an op that no loaded library registered).
struct NativeStatus {
  std::vector<std::string> loaded;
  std::string none_because;
};

// dlopen, never closed: the ops a library registers live as long as the process.
bool open_library(const std::string& path, std::string& error) {
  if (::dlopen(path.c_str(), RTLD_NOW | RTLD_GLOBAL) != nullptr) return true;
  const char* e = ::dlerror();
  error = e != nullptr ? e : "dlopen failed";
  return false;
}

// The checkout's library beside this runner (build/dsv4_run -> dsv4_ops/_C*.so, what
// `pip install -e .` builds), or "" when there is none.
std::string library_beside_runner() {
  char exe[PATH_MAX];
  const ssize_t n = ::readlink("/proc/self/exe", exe, sizeof(exe) - 1);
  if (n <= 0) return "";
  exe[n] = '\0';
  const std::string self(exe);
  const size_t slash = self.rfind('/');
  if (slash == std::string::npos) return "";
  const std::string dir = self.substr(0, slash) + "/../dsv4_ops";
  DIR* d = ::opendir(dir.c_str());
  if (d == nullptr) return "";
  std::vector<std::string> names;  // _C.abi3.so, _C.cpython-3XY-....so, _C.so
  while (const dirent* e = ::readdir(d)) {
    const std::string name = e->d_name;
    if (name.rfind("_C.", 0) == 0 && name.size() > 5 && name.compare(name.size() - 3, 3, ".so") == 0)
      names.push_back(name);
  }
  ::closedir(d);
  if (names.empty()) return "";
  std::sort(names.begin(), names.end());  // "_C.abi3.so" (what setup.py builds) sorts first
  return dir + "/" + names.front();
}

// Before any package loads: the libraries of --library (else $DSV4_OPS_LIBRARY), each one required;
// with neither, a CUDA runner tries the checkout's library beside it.
NativeStatus load_native(const Options& o, const std::function<void(const std::string&)>& log) {
  NativeStatus st;
  std::vector<std::pair<std::string, std::string>> wanted;  // (path, where it came from)
  for (const auto& p : o.libraries) wanted.emplace_back(p, "--library");
  const char* env = std::getenv("DSV4_OPS_LIBRARY");
  if (wanted.empty() && env != nullptr && *env != '\0') wanted.emplace_back(env, "DSV4_OPS_LIBRARY");
  for (const auto& [path, from] : wanted) {
    std::string error;
    if (!open_library(path, error)) runtime_error(from + " " + path + ": cannot load the library (" + error + ")");
    log("loaded " + path + " (" + from + ")");
    st.loaded.push_back(path);
  }
  if (!wanted.empty()) return st;
#ifdef DSV4_WITH_CUDA
  const std::string beside = library_beside_runner();
  if (beside.empty()) {
    st.none_because = "no --library, DSV4_OPS_LIBRARY unset, no dsv4_ops/_C*.so beside the runner";
    return st;
  }
  std::string error;
  if (open_library(beside, error)) {
    log("loaded " + beside + " (beside the runner)");
    st.loaded.push_back(beside);
  } else {
    st.none_because = beside + " did not load: " + error;
  }
#else
  st.none_because = "no --library and DSV4_OPS_LIBRARY unset (a CPU-only runner loads none by itself)";
#endif
  return st;
}

// The load error when it names a dsv4 op (AOTInductor's proxy executor found no schema for it): what
// was loaded, and how to load the library. "" for other errors.
std::string native_hint(const std::string& msg, const NativeStatus& native) {
  const size_t at = msg.find("dsv4::");
  if (at == std::string::npos) return "";
  size_t end = at;
  while (end < msg.size() && (std::isalnum((unsigned char)msg[end]) || msg[end] == '_' || msg[end] == ':')) ++end;
  std::string loaded;
  for (const auto& p : native.loaded) loaded += (loaded.empty() ? "" : ", ") + p;
  return " (the package calls " + msg.substr(at, end - at) + ", a C++ op of dsv4_ops' native library, and " +
         (loaded.empty() ? "none is loaded: " + native.none_because : "the libraries loaded (" + loaded +
                                                                          ") do not register it") +
         "; pass --library PATH, the path that python -c \"import dsv4_ops.native as n; "
         "print(n.library_path())\" prints, or set DSV4_OPS_LIBRARY)";
}

// ---- helpers ------------------------------------------------------------------

using Clock = std::chrono::steady_clock;
double ms_since(Clock::time_point t0) {
  return std::chrono::duration<double, std::milli>(Clock::now() - t0).count();
}
std::string fmt_ms(double ms) {
  char buf[64];
  std::snprintf(buf, sizeof(buf), "%.2f ms", ms);
  return buf;
}

void check_file(const std::string& path) {
  struct stat st;
  if (::stat(path.c_str(), &st) != 0)
    runtime_error(path + ": cannot open model package (" + std::strerror(errno) + ")");
  if (S_ISDIR(st.st_mode)) runtime_error(path + ": is a directory, expected a .pt2 file");
  std::ifstream f(path, std::ios::binary);
  if (!f.good()) runtime_error(path + ": cannot open model package (" + std::strerror(errno) + ")");
  char magic[4] = {0, 0, 0, 0};
  f.read(magic, 4);
  // A .pt2 is a zip archive ("PK\x03\x04"); reject anything else before the loader sees it.
  if (f.gcount() != 4 || std::memcmp(magic, "PK\x03\x04", 4) != 0)
    runtime_error(path + ": not a .pt2 package (not a zip archive)");
}

std::unique_ptr<torch::inductor::AOTIModelPackageLoader> load_model(const std::string& path,
                                                                    const std::string& name,
                                                                    bool single_threaded,
                                                                    c10::DeviceIndex device_index,
                                                                    const NativeStatus& native) {
  try {
    return std::make_unique<torch::inductor::AOTIModelPackageLoader>(path, name, single_threaded,
                                                                     /*num_runners=*/1, device_index);
  } catch (const std::exception& e) {
    std::string msg = e.what();
    // c10::Error messages carry a C++ backtrace; keep the first line for the user.
    auto nl = msg.find('\n');
    if (nl != std::string::npos) msg = msg.substr(0, nl);
    runtime_error(path + ": cannot load model '" + name + "' from the package: " + msg + native_hint(msg, native));
  }
}

at::Tensor argmax_rows(const at::Tensor& logits) {
  // torch.argmax semantics: ties go to the lowest index.
  return at::argmax(logits, /*dim=*/-1, /*keepdim=*/false);
}

// ---- main flow ----------------------------------------------------------------

int run_main(const Options& o) {
  auto log = [&](const std::string& s) {
    if (!o.quiet) std::cerr << "[dsv4_run] " << s << std::endl;
  };
  const NativeStatus native = load_native(o, log);
  check_file(o.model);

  auto t_load = Clock::now();
  // Load prefill first (CPU device index is ignored), read its metadata, then decide
  // how to load decode.
  c10::DeviceIndex dev_index = -1;
  auto prefill = load_model(o.model, "prefill", false, dev_index, native);
  PackageInfo info = read_info(prefill->get_metadata(), o.model, "prefill");

  bool on_cuda = info.device == "cuda";
#ifndef DSV4_WITH_CUDA
  if (on_cuda) runtime_error(o.model + ": dsv4.device=cuda but this dsv4_run was built against a CPU-only libtorch");
#endif

  // Validate the command line against the package's limits.
  const int64_t P = (int64_t)o.prompts.size();
  if (P > info.max_batch)
    usage_error("--prompt: " + std::to_string(P) + " prompts given, the package's dsv4.max_batch_size is " +
                std::to_string(info.max_batch));
  for (int64_t b = 0; b < P; ++b) {
    const auto& p = o.prompts[b];
    const std::string what = "--prompt #" + std::to_string(b + 1);
    if ((int64_t)p.size() > info.max_seq_len)
      usage_error(what + ": " + std::to_string(p.size()) + " tokens, longer than dsv4.max_seq_len=" +
                  std::to_string(info.max_seq_len));
    if ((int64_t)p.size() + o.max_new_tokens - 1 > info.max_seq_len)
      usage_error(what + ": " + std::to_string(p.size()) + " tokens + --max-new-tokens " +
                  std::to_string(o.max_new_tokens) + " - 1 = " +
                  std::to_string(p.size() + o.max_new_tokens - 1) + " exceeds dsv4.max_seq_len=" +
                  std::to_string(info.max_seq_len));
    for (int64_t id : p)
      if (id < 0 || id >= info.vocab)
        usage_error(what + ": token id " + std::to_string(id) + " outside [0, dsv4.vocab_size=" +
                    std::to_string(info.vocab) + ")");
  }

  bool use_graph = false;
#ifdef DSV4_WITH_CUDA
  if (on_cuda) {
    use_graph = o.cuda_graph;
    dev_index = c10::cuda::current_device();
  }
#endif
  // CUDA-graph capture requires the single-threaded container runner.
  auto decode = load_model(o.model, "decode", use_graph, dev_index, native);
  PackageInfo dinfo = read_info(decode->get_metadata(), o.model, "decode");
  if (dinfo.max_batch != info.max_batch || dinfo.vocab != info.vocab || dinfo.device != info.device ||
      dinfo.cache.size() != info.cache.size())
    runtime_error(o.model + ": prefill and decode metadata disagree (batch/vocab/device/cache)");

  // one prefill model per chunk size: a step runs the smallest that holds the longest remaining part of any
  // row (as dsv4_ops' chunk_schedule), so a short prompt does not pay for the largest chunk
  std::map<int64_t, std::unique_ptr<torch::inductor::AOTIModelPackageLoader>> prefills;
  prefills[info.chunk] = std::move(prefill);
  for (int64_t c : info.chunks)
    if (c != info.chunk) prefills[c] = load_model(o.model, "prefill_" + std::to_string(c), false, dev_index, native);
  const int64_t B = info.max_batch;
  const c10::Device device = on_cuda ? c10::Device(c10::kCUDA, dev_index) : c10::Device(c10::kCPU);
  auto sync = [&]() {
#ifdef DSV4_WITH_CUDA
    if (on_cuda) c10::cuda::getCurrentCUDAStream(dev_index).synchronize();
#endif
  };

#ifdef DSV4_WITH_CUDA
  // All work (prefill, eager decode, capture, replay) runs on one side stream:
  // capture must not happen on the legacy default stream.
  std::optional<c10::cuda::CUDAStreamGuard> stream_guard;
  if (on_cuda) stream_guard.emplace(c10::cuda::getStreamFromPool(false, dev_index));
  auto stream_handle = [&]() -> void* {
    return on_cuda ? (void*)c10::cuda::getCurrentCUDAStream(dev_index).stream() : nullptr;
  };
#else
  auto stream_handle = []() -> void* { return nullptr; };
#endif

  // KV pools: allocated once with zeros; lengths start at 0.
  std::vector<at::Tensor> caches;
  for (const auto& c : info.cache) caches.push_back(at::zeros(c.shape, at::TensorOptions().dtype(c.dtype).device(device)));
  at::Tensor lengths = at::zeros({B}, at::TensorOptions().dtype(at::kInt).device(device));
  sync();
  log("loaded " + o.model + " in " + fmt_ms(ms_since(t_load)) + " (device=" + info.device +
      ", B=" + std::to_string(B) + ", chunks=" + [&] {
        std::string out;
        for (int64_t c : info.chunks) out += (out.empty() ? "" : ",") + std::to_string(c);
        return out;
      }() + ", max_seq_len=" +
      std::to_string(info.max_seq_len) + ", vocab=" + std::to_string(info.vocab) + ")");

  auto with_caches = [&](std::vector<at::Tensor> head) {
    for (auto& c : caches) head.push_back(c);
    return head;
  };
  auto run_checked = [&](torch::inductor::AOTIModelPackageLoader& m, const char* name,
                         const std::vector<at::Tensor>& inputs) -> at::Tensor {
    auto out = m.run(inputs, stream_handle());
    if (out.empty()) runtime_error(std::string(name) + " returned no outputs");
    const at::Tensor& lg = out[0];
    if (lg.dim() != 2 || lg.size(0) != B || lg.size(1) != info.vocab)
      runtime_error(std::string(name) + " returned logits of shape " + c10::str(lg.sizes()) + ", expected [" +
                    std::to_string(B) + ", " + std::to_string(info.vocab) + "]");
    return lg;
  };

  // ---- prefill, in chunks ----
  int64_t max_len = 0;
  for (auto& p : o.prompts) max_len = std::max<int64_t>(max_len, (int64_t)p.size());
  std::vector<int64_t> schedule;  // each step's chunk size
  for (int64_t left = max_len; left > 0;) {
    int64_t c = info.chunk;
    for (int64_t s : info.chunks)
      if (s >= left) { c = s; break; }
    schedule.push_back(c);
    left -= c;
  }
  const int64_t n_chunks = (int64_t)schedule.size();
  at::Tensor first = at::zeros({B}, at::kLong);  // each row's first new token (0 for padding rows)
  auto first_a = first.accessor<int64_t, 1>();
  auto t_prefill = Clock::now();
  for (int64_t j = 0, start = 0; j < n_chunks; start += schedule[j], ++j) {
    const int64_t C = schedule[j];
    at::Tensor ids = at::zeros({B, C}, at::kLong);
    at::Tensor n_new = at::zeros({B}, at::kInt);
    auto ids_a = ids.accessor<int64_t, 2>();
    auto n_a = n_new.accessor<int32_t, 1>();
    for (int64_t b = 0; b < P; ++b) {
      const auto& p = o.prompts[b];
      int64_t n = std::clamp<int64_t>((int64_t)p.size() - start, 0, C);
      n_a[b] = (int32_t)n;
      for (int64_t i = 0; i < n; ++i) ids_a[b][i] = p[start + i];
    }
    at::Tensor logits =
        run_checked(*prefills.at(C), "prefill", with_caches({ids.to(device), n_new.to(device), lengths}));
    at::Tensor best = argmax_rows(logits).cpu();
    auto best_a = best.accessor<int64_t, 1>();
    for (int64_t b = 0; b < P; ++b)
      if (n_a[b] > 0) first_a[b] = best_a[b];
  }
  sync();
  double prefill_ms = ms_since(t_prefill);
  log("prefill: " + std::to_string(P) + " prompt(s), " + std::to_string(n_chunks) + " chunk(s), " +
      fmt_ms(prefill_ms));

  // ---- greedy decode ----
  const int64_t steps = o.max_new_tokens - 1;
  // tokens[s] = the new ids of step s (s = 0: from prefill), for all B rows.
  at::Tensor tokens = at::zeros({o.max_new_tokens, B}, at::TensorOptions().dtype(at::kLong).device(device));
  tokens[0].copy_(first);
  // Static decode inputs, reused every step (a CUDA graph replays on these addresses).
  at::Tensor ids = tokens[0].clone();
  at::Tensor n_new = at::zeros({B}, at::TensorOptions().dtype(at::kInt).device(device));
  n_new.slice(/*dim=*/0, 0, P).fill_(1);  // one new token for each prompt's row, none for padding
  const std::vector<at::Tensor> dec_inputs = with_caches({ids, n_new, lengths});

  auto t_decode = Clock::now();
  int64_t s = 1;
  // step s's tokens, from its logits: the output, and the next step's input ids
  auto take = [&](const at::Tensor& logits) {
    at::Tensor next = argmax_rows(logits);
    tokens[s].copy_(next);
    ids.copy_(next);
  };
  bool graph_used = false;
#ifdef DSV4_WITH_CUDA
  std::unique_ptr<at::cuda::CUDAGraph> graph;
  if (use_graph && steps >= 2) {
    // One eager warm-up step (loads kernels, settles the allocator), then capture.
    take(run_checked(*decode, "decode", dec_inputs));
    ++s;
    sync();
    graph = std::make_unique<at::cuda::CUDAGraph>();
    at::Tensor static_logits;
    bool capturing = false;
    try {
      graph->capture_begin();
      capturing = true;
      static_logits = run_checked(*decode, "decode", dec_inputs);
      capturing = false;
      graph->capture_end();  // capture records but does not execute: replay step s now
    } catch (const std::exception& e) {
      if (capturing) {
        try { graph->capture_end(); } catch (...) {}
      }
      std::string msg = e.what();
      msg = msg.substr(0, msg.find('\n'));
      runtime_error("CUDA graph capture of the decode program failed (try --no-cuda-graph): " + msg);
    }
    for (; s <= steps; ++s) {
      graph->replay();
      take(static_logits);
    }
    graph_used = true;
  }
#endif
  for (; s <= steps; ++s) take(run_checked(*decode, "decode", dec_inputs));
  sync();
  double decode_ms = ms_since(t_decode);
  if (steps > 0)
    log("decode: " + std::to_string(steps) + " step(s), " + fmt_ms(decode_ms / steps) + "/step" +
        (on_cuda ? (graph_used ? " (CUDA graph)" : " (eager)") : ""));

  at::Tensor out = tokens.cpu();
  auto out_a = out.accessor<int64_t, 2>();
  std::string text;
  for (int64_t b = 0; b < P; ++b) {
    for (int64_t t = 0; t < o.max_new_tokens; ++t) {
      if (t) text += ',';
      text += std::to_string(out_a[t][b]);
    }
    text += '\n';
  }
  std::fwrite(text.data(), 1, text.size(), stdout);
  std::fflush(stdout);
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  Options o;
  try {
    if (!parse_args(argc, argv, o)) {
      std::fputs(kHelp, stdout);
      return 0;
    }
    return run_main(o);
  } catch (const RunError& e) {
    std::cerr << "dsv4_run: error: " << e.what() << "\n";
    return e.code;
  } catch (const c10::Error& e) {
    std::cerr << "dsv4_run: error: " << e.what_without_backtrace() << "\n";
    return kExitRuntime;
  } catch (const std::exception& e) {
    std::cerr << "dsv4_run: error: " << e.what() << "\n";
    return kExitRuntime;
  } catch (...) {
    std::cerr << "dsv4_run: error: unknown exception\n";
    return kExitRuntime;
  }
}
