// The native exchange worker: gpu_dense's Attend streams to some kv_attention shards, fed through
// shared memory. It does what services/gpu_dense/exchange/worker.py does (same arguments, same
// control messages: protos/fastdecode/v1/exchange.proto, same answers), without Python's event loop
// and grpc.aio's three threads per completion: each mini-batch slot has one thread that writes its
// layer's items on blocking gRPC C++ streams and reads their answers back (the calling thread polls
// its own call, so a completion costs one wake-up), with q, k and v copied once from the arena into
// the request and o once from the answer into the arena.
//
// Why AttendRequest/AttendResponse are encoded by hand (the proto wire format of
// kv_attention.proto, fields by number): a generated message would copy q, k and v into its own
// strings and o out of them, a copy more each way on the path every layer pays. The Python side
// does the same (fastdecode/runtime/codec.py serialize_with, split_field).
//
// Usage (started by services/gpu_dense/exchange/process.py):
//   fastdecode-exchange-worker --fd N --parent PID [--index I] [--timeout S] [--shards I=HOST:PORT,...]
//                              [--layer-fds FD,FD]  (each mini-batch slot's own socket: Attend, Cancel)
//                              [--tls-cert F] [--tls-key F] [--tls-ca F]

#include <fcntl.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <deque>
#include <fstream>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include <absl/synchronization/mutex.h>
#include <grpcpp/grpcpp.h>
#include <grpcpp/impl/rpc_method.h>
#include <grpcpp/support/byte_buffer.h>
#include <grpcpp/support/sync_stream.h>

#include "fastdecode/v1/exchange.pb.h"

namespace {

namespace pb = fastdecode::v1;
using Clock = std::chrono::steady_clock;

constexpr int kUnavailable = 14, kInternal = 13, kInvalidArgument = 3;
constexpr uint32_t kMaxFrame = 64u << 20;  // handoff.MAX_FRAME
constexpr int kMaxMessage = 256 << 20;     // protocol.MAX_MESSAGE_BYTES
const char* kAttendMethod = "/fastdecode.v1.KVAttention/Attend";
const char* kSecretKey = "fastdecode-fleet-secret";  // fleet_secret.FLEET_SECRET_KEY

int g_index = 0;

void warn(const std::string& text) {
  std::fprintf(stderr, "exchange[%d] WARNING %s\n", g_index, text.c_str());
  std::fflush(stderr);
}

int64_t now_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(Clock::now().time_since_epoch()).count();
}

// ---- dtypes: the arena's names (handoff.DTYPES) and tensor.proto's DType numbers -------------
struct DType {
  const char* name;
  int wire;
  int size;
};
constexpr DType kDTypes[] = {{"float32", 1, 4}, {"float16", 2, 2}, {"bfloat16", 3, 2}};

const DType* dtype_by_name(const std::string& name) {
  for (const auto& d : kDTypes)
    if (name == d.name) return &d;
  return nullptr;
}

const DType* dtype_by_wire(uint64_t wire) {
  for (const auto& d : kDTypes)
    if (static_cast<uint64_t>(d.wire) == wire) return &d;
  return nullptr;
}

// ---- the control socket ----------------------------------------------------------------------
class Control {
 public:
  explicit Control(int fd) : fd_(fd) {}

  // One frame's body; nullopt at the end of the socket (the parent went) or on a garbled frame.
  std::optional<std::string> read() {
    uint32_t n = 0;
    if (!read_all(&n, sizeof n) || n > kMaxFrame) return std::nullopt;
    std::string body(n, '\0');
    if (n && !read_all(body.data(), n)) return std::nullopt;
    return body;
  }

  void write(const google::protobuf::Message& msg) {
    std::string body;
    msg.SerializeToString(&body);
    uint32_t n = static_cast<uint32_t>(body.size());
    std::string data(reinterpret_cast<const char*>(&n), sizeof n);
    data += body;
    std::lock_guard<std::mutex> lock(mu_);
    const char* p = data.data();
    size_t left = data.size();
    while (left) {
      ssize_t w = ::send(fd_, p, left, MSG_NOSIGNAL);
      if (w < 0 && errno == EINTR) continue;
      if (w <= 0) return;  // the parent went: the reader sees the end and the process exits
      p += w;
      left -= static_cast<size_t>(w);
    }
  }

 private:
  bool read_all(void* dst, size_t n) {
    auto* p = static_cast<char*>(dst);
    while (n) {
      ssize_t r = ::read(fd_, p, n);
      if (r < 0 && errno == EINTR) continue;
      if (r <= 0) return false;
      p += r;
      n -= static_cast<size_t>(r);
    }
    return true;
  }

  int fd_;
  std::mutex mu_;
};

// ---- shared-memory arenas (the dense side creates and unlinks them; this side maps by name) ----
struct Arena {
  std::string name;
  char* base = nullptr;
  size_t size = 0;

  explicit Arena(const std::string& n) : name(n) {
    std::string path = "/dev/shm/" + n.substr(n.find_first_not_of('/'));
    int fd = ::open(path.c_str(), O_RDWR);
    if (fd < 0) throw std::runtime_error("cannot open the arena " + path + ": " + std::strerror(errno));
    struct stat st {};
    if (::fstat(fd, &st) != 0 || st.st_size <= 0) {
      ::close(fd);
      throw std::runtime_error("cannot size the arena " + path);
    }
    void* p = ::mmap(nullptr, static_cast<size_t>(st.st_size), PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    ::close(fd);
    if (p == MAP_FAILED) throw std::runtime_error("cannot map the arena " + path);
    base = static_cast<char*>(p);
    size = static_cast<size_t>(st.st_size);
  }
  ~Arena() {
    if (base) ::munmap(base, size);
  }
  Arena(const Arena&) = delete;
  Arena& operator=(const Arena&) = delete;
};

struct Span {
  const char* data;
  size_t nbytes;
  const DType* dtype;
  std::vector<int64_t> shape;
};

Span span_of(const Arena& arena, const pb::ArenaSlice& s) {
  const DType* d = dtype_by_name(s.dtype());
  if (!d) throw std::invalid_argument("unknown dtype " + s.dtype());
  size_t n = static_cast<size_t>(d->size);
  for (int64_t x : s.shape()) {
    if (x < 0) throw std::invalid_argument("negative dimension");
    n *= static_cast<size_t>(x);
  }
  if (s.offset() > arena.size || n > arena.size - s.offset()) {
    std::ostringstream m;
    m << "slice of " << n << " bytes at " << s.offset() << " lies outside the " << arena.size << "-byte arena";
    throw std::invalid_argument(m.str());
  }
  return Span{arena.base + s.offset(), n, d, {s.shape().begin(), s.shape().end()}};
}

// ---- the proto wire format, for AttendRequest and AttendResponse ----------------------------
void put_varint(std::string& out, uint64_t v) {
  while (v >= 0x80) {
    out.push_back(static_cast<char>(v | 0x80));
    v >>= 7;
  }
  out.push_back(static_cast<char>(v));
}

void put_tag(std::string& out, int field, int wire_type) { put_varint(out, (static_cast<uint64_t>(field) << 3) | wire_type); }

void put_bytes(std::string& out, int field, const std::string& s) {
  put_tag(out, field, 2);
  put_varint(out, s.size());
  out += s;
}

// AttendRequest fields 3-5 (seq_ids, num_tokens, start_pos): the same for every layer of a step.
std::string item_fields(const pb::ExchangeItem& it) {
  std::string out;
  for (const auto& id : it.seq_ids()) put_bytes(out, 3, id);
  std::string packed;
  for (int32_t n : it.num_tokens()) put_varint(packed, static_cast<uint64_t>(static_cast<int64_t>(n)));
  if (!packed.empty()) put_bytes(out, 4, packed);
  packed.clear();
  for (int64_t p : it.start_pos()) put_varint(packed, static_cast<uint64_t>(p));
  if (!packed.empty()) put_bytes(out, 5, packed);
  return out;
}

// A Tensor field's head: tag and length of the Tensor, its dtype and shape, and the tag and length
// of its data (the data itself follows as its own slice).
std::string tensor_head(int field, const Span& t) {
  std::string inner;
  put_tag(inner, 1, 0);
  put_varint(inner, static_cast<uint64_t>(t.dtype->wire));
  std::string shape;
  for (int64_t x : t.shape) put_varint(shape, static_cast<uint64_t>(x));
  if (!shape.empty()) put_bytes(inner, 2, shape);
  put_tag(inner, 3, 2);
  put_varint(inner, t.nbytes);
  std::string out;
  put_tag(out, field, 2);
  put_varint(out, inner.size() + t.nbytes);
  return out + inner;
}

// Reads a ByteBuffer's slices in order without joining them.
class Reader {
 public:
  explicit Reader(const std::vector<grpc::Slice>& slices) : slices_(slices) {}

  size_t pos() const { return pos_; }
  bool at_end() { return skip_empty(), i_ >= slices_.size(); }

  uint64_t varint() {
    uint64_t v = 0;
    for (int shift = 0; shift < 64; shift += 7) {
      uint8_t b = byte();
      v |= static_cast<uint64_t>(b & 0x7f) << shift;
      if (!(b & 0x80)) return v;
    }
    throw std::runtime_error("malformed varint");
  }

  void copy(char* dst, size_t n) {
    while (n) {
      skip_empty();
      if (i_ >= slices_.size()) throw std::runtime_error("truncated message");
      size_t take = std::min(n, slices_[i_].size() - off_);
      if (dst) {
        std::memcpy(dst, slices_[i_].begin() + off_, take);
        dst += take;
      }
      off_ += take;
      pos_ += take;
      n -= take;
    }
  }

  std::string bytes(size_t n) {
    std::string s(n, '\0');
    copy(s.data(), n);
    return s;
  }

  void skip(int wire_type) {
    switch (wire_type) {
      case 0: varint(); break;
      case 1: copy(nullptr, 8); break;
      case 2: copy(nullptr, varint()); break;
      case 5: copy(nullptr, 4); break;
      default: throw std::runtime_error("unknown wire type");
    }
  }

 private:
  void skip_empty() {
    while (i_ < slices_.size() && off_ >= slices_[i_].size()) {
      ++i_;
      off_ = 0;
    }
  }
  uint8_t byte() {
    skip_empty();
    if (i_ >= slices_.size()) throw std::runtime_error("truncated message");
    ++pos_;
    return slices_[i_].begin()[off_++];
  }

  const std::vector<grpc::Slice>& slices_;
  size_t i_ = 0, off_ = 0, pos_ = 0;
};

// One item's outcome, as the control message sends it back.
struct Outcome {
  int status = 0;
  std::string text;
  pb::ArenaSlice o;
};

Outcome fail(int status, std::string text) { return Outcome{status, std::move(text), {}}; }

// ---- one shard's Attend streams (AttendLink in shards.py) -----------------------------------
using Call = grpc::ClientReaderWriter<grpc::ByteBuffer, grpc::ByteBuffer>;

struct Stream {
  grpc::ClientContext ctx;
  std::unique_ptr<Call> call;
  std::atomic<int64_t> since{0};  // when its unanswered item went out (ns); 0: none
  std::atomic<bool> expired{false};
  bool finished = false;

  // Ends the call and returns its status: the shard's own after a failed Read or Write (the call is
  // over), CANCELLED after `cancel` (a live call, dropped). Only the thread using the call (or the
  // last owner) calls this; others only TryCancel.
  grpc::Status finish(bool cancel) {
    if (finished) return grpc::Status(grpc::StatusCode::CANCELLED, "ended");
    finished = true;
    if (cancel) ctx.TryCancel();
    return call->Finish();
  }
  ~Stream() {
    if (call) finish(true);
  }
};

const char* code_name(int code) {
  static const char* names[] = {"OK", "CANCELLED", "UNKNOWN", "INVALID_ARGUMENT", "DEADLINE_EXCEEDED", "NOT_FOUND",
                                "ALREADY_EXISTS", "PERMISSION_DENIED", "RESOURCE_EXHAUSTED", "FAILED_PRECONDITION",
                                "ABORTED", "OUT_OF_RANGE", "UNIMPLEMENTED", "INTERNAL", "UNAVAILABLE", "DATA_LOSS",
                                "UNAUTHENTICATED"};
  return code >= 0 && code <= 16 ? names[code] : "UNKNOWN";
}

struct Settings {
  double timeout = 60.0;
  std::string secret;
  std::string cert, key, ca;  // file contents
};

class Link {
 public:
  Link(int index, std::string address, const Settings& s) : index_(index), address_(std::move(address)), settings_(s) {
    grpc::ChannelArguments args;
    args.SetMaxSendMessageSize(kMaxMessage);
    args.SetMaxReceiveMessageSize(kMaxMessage);
    args.SetInt("grpc.keepalive_time_ms", 10000);
    args.SetInt("grpc.keepalive_timeout_ms", 5000);
    args.SetInt("grpc.keepalive_permit_without_calls", 1);
    args.SetInt("grpc.initial_reconnect_backoff_ms", 200);
    args.SetInt("grpc.max_reconnect_backoff_ms", 2000);
    args.SetInt("grpc.http2.lookahead_bytes", 8 << 20);  // protocol.DATA_PLANE_OPTIONS
    std::shared_ptr<grpc::ChannelCredentials> creds;
    if ((!s.cert.empty() && !s.key.empty()) || !s.ca.empty()) {
      grpc::SslCredentialsOptions o;
      o.pem_root_certs = s.ca;
      o.pem_private_key = s.key;
      o.pem_cert_chain = s.cert;
      creds = grpc::SslCredentials(o);
    } else {
      creds = grpc::InsecureChannelCredentials();
    }
    channel_ = grpc::CreateCustomChannel(address_, creds, args);
  }

  std::string name() const { return "shard " + std::to_string(index_) + " (" + address_ + ")"; }
  const std::string& address() const { return address_; }
  int index() const { return index_; }
  bool removed() const { return removed_.load(); }

  // The slot's stream, fresh when it had none or when its last item's answer was never read (a
  // cancelled layer: that answer would be taken for the next item's).
  std::shared_ptr<Stream> stream(uint32_t slot) {
    std::lock_guard<std::mutex> lock(mu_);
    auto& s = streams_[slot];
    if (s && s->since.load() != 0) s.reset();  // its destructor cancels and ends the call
    if (!s) {
      s = std::make_shared<Stream>();
      if (!settings_.secret.empty()) s->ctx.AddMetadata(kSecretKey, settings_.secret);
      grpc::internal::RpcMethod method(kAttendMethod, grpc::internal::RpcMethod::BIDI_STREAMING);
      s->call.reset(grpc::internal::ClientReaderWriterFactory<grpc::ByteBuffer, grpc::ByteBuffer>::Create(
          channel_.get(), method, &s->ctx));
    }
    return s;
  }

  // The stream failed: drop it (the next item reopens one) and say why, in AttendLink's words
  // (`what` empty: the call's own status says).
  std::string lost(uint32_t slot, const std::shared_ptr<Stream>& s, std::string what) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      auto it = streams_.find(slot);
      if (it != streams_.end() && it->second == s) streams_.erase(it);
    }
    grpc::Status st = s->finish(!what.empty());  // empty: a failed Read or Write ended the call
    if (what.empty())
      what = st.ok() ? "stream ended" : std::string(code_name(st.error_code())) + ": " + st.error_message();
    std::string reason;
    if (s->expired.load()) {
      std::ostringstream m;
      m << name() << " did not answer within " << settings_.timeout << "s";
      reason = m.str();
    } else {
      reason = name() + " unavailable: " + what;
    }
    warn(name() + " stream lost: " + reason);
    return reason;
  }

  void expire(int64_t now) {
    std::lock_guard<std::mutex> lock(mu_);
    for (auto& [slot, s] : streams_) {
      int64_t since = s->since.load();
      if (since && now - since > static_cast<int64_t>(settings_.timeout * 1e9) && !s->expired.exchange(true))
        s->ctx.TryCancel();
    }
  }

  // Cancel the slot's stream if an item on it is unanswered (a cancelled layer).
  void abandon(uint32_t slot) {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = streams_.find(slot);
    if (it != streams_.end() && it->second->since.load() != 0) it->second->ctx.TryCancel();
  }

  void remove() {
    removed_ = true;
    std::lock_guard<std::mutex> lock(mu_);
    for (auto& [slot, s] : streams_) s->ctx.TryCancel();
    streams_.clear();
  }

 private:
  int index_;
  std::string address_;
  const Settings& settings_;
  std::shared_ptr<grpc::Channel> channel_;
  std::mutex mu_;
  std::map<uint32_t, std::shared_ptr<Stream>> streams_;
  std::atomic<bool> removed_{false};
};

// ---- the worker ------------------------------------------------------------------------------
class Worker;

// One mini-batch slot: its layers run in order on its own thread.
class Slot {
 public:
  Slot(Worker* w, uint32_t slot) : worker_(w), slot_(slot), thread_([this] { run(); }) {}
  ~Slot() {
    {
      std::lock_guard<std::mutex> lock(mu_);
      stop_ = true;
    }
    cv_.notify_all();
    thread_.join();
  }

  // `reply`: where the layer's Done goes (the control socket, or the slot's layer socket it came on)
  void push(pb::ExchangeAttend msg, Control* reply) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      queue_.emplace_back(std::move(msg), reply);
    }
    cv_.notify_one();
  }

  // The layer `rid` was cancelled: drop it if queued; abandon its items if running (no answer).
  bool cancel(uint64_t rid);

 private:
  void run();
  void attend(const pb::ExchangeAttend& msg, Control* reply);

  Worker* worker_;
  uint32_t slot_;
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<std::pair<pb::ExchangeAttend, Control*>> queue_;
  bool stop_ = false;
  std::atomic<uint64_t> running_{0};
  std::atomic<bool> cancelled_{false};
  // the slot's arena and last items (a message without items reuses them)
  std::unique_ptr<Arena> arena_;
  std::vector<pb::ExchangeItem> items_;
  std::vector<std::string> fields_;  // item_fields per item
  std::thread thread_;
};

class Worker {
 public:
  Worker(Control& control, Settings settings) : control_(control), settings_(std::move(settings)) {}

  void add(int index, const std::string& address) {
    std::lock_guard<std::mutex> lock(mu_);
    if (!links_.count(index)) links_[index] = std::make_shared<Link>(index, address, settings_);
  }

  void remove(int index) {
    std::shared_ptr<Link> link;
    {
      std::lock_guard<std::mutex> lock(mu_);
      auto it = links_.find(index);
      if (it == links_.end()) return;
      link = it->second;
    }
    link->remove();
  }

  void restore(int index) {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = links_.find(index);
    if (it != links_.end() && it->second->removed())
      it->second = std::make_shared<Link>(index, it->second->address(), settings_);
  }

  std::shared_ptr<Link> link(int index) {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = links_.find(index);
    return it == links_.end() ? nullptr : it->second;
  }

  std::vector<std::shared_ptr<Link>> links() {
    std::lock_guard<std::mutex> lock(mu_);
    std::vector<std::shared_ptr<Link>> out;
    for (auto& [i, l] : links_) out.push_back(l);
    return out;
  }

  // From the control thread or a layer socket's reader: `reply` (null: the control socket) gets the Done.
  void attend(pb::ExchangeAttend msg, Control* reply = nullptr) {
    uint32_t slot = msg.slot();
    std::lock_guard<std::mutex> lock(slots_mu_);
    auto& s = slots_[slot];
    if (!s) s = std::make_unique<Slot>(this, slot);
    s->push(std::move(msg), reply ? reply : &control_);
  }

  void cancel(uint64_t rid) {
    std::lock_guard<std::mutex> lock(slots_mu_);
    for (auto& [i, s] : slots_)
      if (s->cancel(rid)) return;
  }

  // A slot's layer socket (the dense side's threaded layer loop): Attend and Cancel, each Attend
  // answered on it. Read on a thread of its own until the dense side closes it.
  void serve_port(int fd) {
    auto* port = new Control(fd);  // lives as long as the process: queued layers answer on it
    std::thread([this, port, fd] {
      for (;;) {
        auto body = port->read();
        if (!body) return;  // the dense side closed it (it restarts the worker with fresh ones)
        pb::ToWorker m;
        if (!m.ParseFromString(*body)) {
          warn("bad layer message: closing the slot's socket");
          ::shutdown(fd, SHUT_RDWR);
          return;
        }
        if (m.kind_case() == pb::ToWorker::kAttend) attend(std::move(*m.mutable_attend()), port);
        else if (m.kind_case() == pb::ToWorker::kCancel) cancel(m.cancel());
      }
    }).detach();
  }

  void done(uint64_t rid, const std::vector<Outcome>& outcomes, Control* reply) {
    pb::ToDense out;
    auto* d = out.mutable_done();
    d->set_rid(rid);
    for (const auto& o : outcomes) {
      auto* r = d->add_results();
      if (o.status) {
        r->set_status(o.status);
        r->set_text(o.text);
      } else {
        *r->mutable_o() = o.o;
      }
    }
    reply->write(out);
  }

  void watch() {
    int64_t period_ms = static_cast<int64_t>(std::min(1.0, settings_.timeout / 4) * 1000);
    std::thread([this, period_ms] {
      for (;;) {
        std::this_thread::sleep_for(std::chrono::milliseconds(std::max<int64_t>(1, period_ms)));
        int64_t now = now_ns();
        for (auto& l : links()) l->expire(now);
      }
    }).detach();
  }

  const Settings& settings() const { return settings_; }

 private:
  Control& control_;
  Settings settings_;
  std::mutex mu_;
  std::map<int, std::shared_ptr<Link>> links_;
  std::mutex slots_mu_;  // the control thread and the layer sockets' readers
  std::map<uint32_t, std::unique_ptr<Slot>> slots_;
};

bool Slot::cancel(uint64_t rid) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    for (auto it = queue_.begin(); it != queue_.end(); ++it) {
      if (it->first.rid() == rid) {
        queue_.erase(it);
        return true;
      }
    }
  }
  if (running_.load() != rid) return false;
  cancelled_ = true;
  for (auto& l : worker_->links()) l->abandon(slot_);
  return true;
}

void Slot::run() {
  for (;;) {
    pb::ExchangeAttend msg;
    Control* reply = nullptr;
    {
      std::unique_lock<std::mutex> lock(mu_);
      cv_.wait(lock, [this] { return stop_ || !queue_.empty(); });
      if (stop_) return;
      msg = std::move(queue_.front().first);
      reply = queue_.front().second;
      queue_.pop_front();
      cancelled_ = false;
      running_ = msg.rid();
    }
    attend(msg, reply);
    running_ = 0;
  }
}

void Slot::attend(const pb::ExchangeAttend& msg, Control* reply) {
  std::vector<Outcome> outcomes;
  std::vector<Span> qkv;  // three per item
  try {
    if (msg.has_items()) {
      if (!arena_ || arena_->name != msg.arena()) {
        arena_.reset();  // the dense side replaced it with a bigger one
        arena_ = std::make_unique<Arena>(msg.arena());
      }
      items_.assign(msg.items().begin(), msg.items().end());
      fields_.clear();
      for (const auto& it : items_) fields_.push_back(item_fields(it));
    } else if (!arena_) {
      throw std::invalid_argument("no items for this slot yet");
    }
    for (const auto& it : items_) {
      qkv.push_back(span_of(*arena_, it.q()));
      qkv.push_back(span_of(*arena_, it.k()));
      qkv.push_back(span_of(*arena_, it.v()));
    }
  } catch (const std::exception& e) {  // every item of the layer fails in-band
    items_.clear();
    fields_.clear();
    worker_->done(msg.rid(), std::vector<Outcome>(msg.items_size(), fail(kInvalidArgument, e.what())), reply);
    return;
  }
  // The device's q, k, v land in the arena at not_before_ns (CLOCK_MONOTONIC): none of their bytes
  // go out before then. An absolute sleep, exact to the microsecond, on this slot's thread only.
  if (msg.not_before_ns() != 0) {
    timespec until{static_cast<time_t>(msg.not_before_ns() / 1000000000ULL),
                   static_cast<long>(msg.not_before_ns() % 1000000000ULL)};
    while (clock_nanosleep(CLOCK_MONOTONIC, TIMER_ABSTIME, &until, nullptr) == EINTR) {
    }
  }
  const size_t n = items_.size();
  outcomes.resize(n);
  std::vector<std::shared_ptr<Link>> links(n);
  std::vector<std::shared_ptr<Stream>> streams(n);
  std::vector<uint64_t> rids(n, 0);
  static std::atomic<uint64_t> next_id{1};
  // all requests out before the first answer is awaited
  for (size_t i = 0; i < n; ++i) {
    const auto& it = items_[i];
    links[i] = worker_->link(static_cast<int>(it.shard()));
    if (!links[i]) {
      outcomes[i] = fail(kUnavailable, "shard " + std::to_string(it.shard()) + " is not known to this worker");
      continue;
    }
    if (links[i]->removed()) {
      outcomes[i] = fail(kUnavailable, links[i]->name() + " was removed");
      continue;
    }
    auto s = streams[i] = links[i]->stream(slot_);
    uint64_t rid = rids[i] = next_id++;
    std::string head;
    put_tag(head, 1, 0);
    put_varint(head, rid);
    put_tag(head, 2, 0);
    put_varint(head, static_cast<uint64_t>(static_cast<int64_t>(msg.layer())));
    head += fields_[i];
    std::vector<grpc::Slice> parts;
    for (int j = 0; j < 3; ++j) {
      const Span& t = qkv[3 * i + j];
      head += tensor_head(6 + j, t);
      parts.emplace_back(head);
      head.clear();
      parts.emplace_back(t.data, t.nbytes);  // the one copy, out of the arena
    }
    grpc::ByteBuffer request(parts.data(), parts.size());
    s->since = now_ns();
    if (!s->call->Write(request)) {
      outcomes[i] = fail(kUnavailable, links[i]->lost(slot_, s, ""));
      streams[i].reset();
    }
  }
  for (size_t i = 0; i < n; ++i) {
    auto& s = streams[i];
    if (!s) continue;
    Link& link = *links[i];
    grpc::ByteBuffer answer;
    if (!s->call->Read(&answer)) {
      if (cancelled_) continue;  // the stream keeps its unanswered mark: the next item replaces it
      outcomes[i] = fail(kUnavailable, link.lost(slot_, s, ""));
      continue;
    }
    s->since = 0;
    std::vector<grpc::Slice> slices;
    if (!answer.Dump(&slices).ok()) {
      outcomes[i] = fail(kUnavailable, link.lost(slot_, s, "an unreadable answer"));
      continue;
    }
    // AttendResponse: 1 request_id, 2 o (Tensor: 1 dtype, 2 shape, 3 data), 3 error (1 code, 2 message)
    const auto& it = items_[i];
    try {
      Reader r(slices);
      uint64_t got = 0, code = 0;
      std::string message;
      bool has_o = false;
      Outcome ok;
      while (!r.at_end()) {
        uint64_t tag = r.varint();
        int field = static_cast<int>(tag >> 3), wt = static_cast<int>(tag & 7);
        if (field == 1 && wt == 0) {
          got = r.varint();
        } else if (field == 2 && wt == 2) {
          size_t o_len = r.varint(), end = r.pos() + o_len;  // the length first: then where it ends
          const DType* d = nullptr;
          size_t expect = 0;
          std::vector<int64_t> shape;
          bool data_seen = false;
          while (r.pos() < end) {
            uint64_t t = r.varint();
            int f = static_cast<int>(t >> 3), w = static_cast<int>(t & 7);
            if (f == 1 && w == 0) {
              d = dtype_by_wire(r.varint());
            } else if (f == 2 && w == 2) {
              size_t packed = r.varint(), stop = r.pos() + packed;
              while (r.pos() < stop) shape.push_back(static_cast<int64_t>(r.varint()));
            } else if (f == 3 && w == 2) {
              size_t len = r.varint();
              if (!d) throw std::runtime_error("o's dtype is not one the arena holds");
              expect = static_cast<size_t>(d->size);
              for (int64_t x : shape) expect *= static_cast<size_t>(x);
              if (len != expect) throw std::runtime_error("o's data does not match its shape");
              if (it.o_offset() > arena_->size || it.o_room() > arena_->size - it.o_offset()) {
                r.copy(nullptr, len);
                ok = fail(kInvalidArgument, "o's room lies outside the arena");
              } else if (len > it.o_room()) {
                r.copy(nullptr, len);
                ok = fail(kInternal, "answer of " + std::to_string(len) + " bytes, room " + std::to_string(it.o_room()));
              } else {
                r.copy(arena_->base + it.o_offset(), len);  // the one copy, into the arena
                ok.o.set_offset(it.o_offset());
                ok.o.set_dtype(d->name);
                for (int64_t x : shape) ok.o.add_shape(x);
              }
              data_seen = true;
            } else {
              r.skip(w);
            }
          }
          if (!data_seen) throw std::runtime_error("o carries no data");
          has_o = true;
        } else if (field == 3 && wt == 2) {
          size_t e_len = r.varint(), end = r.pos() + e_len;
          while (r.pos() < end) {
            uint64_t t = r.varint();
            int f = static_cast<int>(t >> 3), w = static_cast<int>(t & 7);
            if (f == 1 && w == 0) code = r.varint();
            else if (f == 2 && w == 2) message = r.bytes(r.varint());
            else r.skip(w);
          }
        } else {
          r.skip(wt);
        }
      }
      if (got != rids[i]) {
        outcomes[i] = fail(kUnavailable, link.lost(slot_, s, "answer " + std::to_string(got) + " for item " + std::to_string(rids[i])));
      } else if (code) {
        outcomes[i] = fail(static_cast<int>(code), link.name() + ": " + message);
      } else if (!has_o) {
        outcomes[i] = fail(kUnavailable, link.lost(slot_, s, "answer " + std::to_string(got) + " carries no o"));
      } else {
        outcomes[i] = std::move(ok);
      }
    } catch (const std::exception& e) {  // a garbled answer: the stream cannot be trusted any more
      outcomes[i] = fail(kUnavailable, link.lost(slot_, s, std::string("malformed AttendResponse: ") + e.what()));
    }
  }
  if (!cancelled_) worker_->done(msg.rid(), outcomes, reply);
}

std::string read_file(const std::string& path) {
  if (path.empty()) return "";
  std::ifstream f(path, std::ios::binary);
  if (!f) throw std::runtime_error("cannot read " + path);
  std::ostringstream s;
  s << f.rdbuf();
  return s.str();
}

}  // namespace

int main(int argc, char** argv) {
  int fd = -1;
  long parent = -1;
  std::string shards, cert, key, ca, layer_fds;
  Settings settings;
  for (int i = 1; i + 1 < argc; i += 2) {
    std::string a = argv[i], v = argv[i + 1];
    if (a == "--fd") fd = std::stoi(v);
    else if (a == "--parent") parent = std::stol(v);
    else if (a == "--index") g_index = std::stoi(v);
    else if (a == "--timeout") settings.timeout = std::stod(v);
    else if (a == "--shards") shards = v;
    else if (a == "--layer-fds") layer_fds = v;
    else if (a == "--tls-cert") cert = v;
    else if (a == "--tls-key") key = v;
    else if (a == "--tls-ca") ca = v;
    else {
      std::fprintf(stderr, "fastdecode-exchange-worker: unknown argument %s\n", a.c_str());
      return 2;
    }
  }
  if (fd < 0 || parent < 0) {
    std::fprintf(stderr, "usage: fastdecode-exchange-worker --fd N --parent PID [--shards I=HOST:PORT,...]\n");
    return 2;
  }
  // Debian's Abseil tracks lock order on every gRPC mutex (a deadlock detector for debug builds):
  // ~2% of this process's CPU in a profile, for nothing in production.
  absl::SetMutexDeadlockDetectionMode(absl::OnDeadlockCycle::kIgnore);
  ::setenv("GRPC_VERBOSITY", "ERROR", 0);  // gRPC's own info lines (a shard's GOAWAY) are not ours to print
  ::prctl(PR_SET_PDEATHSIG, SIGKILL);
  if (::getppid() != parent) return 0;  // the parent died before prctl took effect
  ::signal(SIGINT, SIG_IGN);            // a ^C goes to the parent, which closes the socket
  ::signal(SIGPIPE, SIG_IGN);
  try {
    settings.cert = read_file(cert);
    settings.key = read_file(key);
    settings.ca = read_file(ca);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "exchange[%d] ERROR %s\n", g_index, e.what());
    return 1;
  }
  Control control(fd);
  auto first = control.read();  // the fleet secret, before anything else
  if (!first) return 0;
  pb::ToWorker hello;
  if (!hello.ParseFromString(*first) || hello.kind_case() != pb::ToWorker::kSecret) return 1;
  settings.secret = hello.secret().send();
  auto* worker = new Worker(control, settings);  // lives until the process exits
  std::stringstream list(shards);
  for (std::string part; std::getline(list, part, ',');) {
    auto eq = part.find('=');
    if (eq != std::string::npos) worker->add(std::stoi(part.substr(0, eq)), part.substr(eq + 1));
  }
  worker->watch();
  std::stringstream fds(layer_fds);
  for (std::string fd_text; std::getline(fds, fd_text, ',');)
    if (!fd_text.empty()) worker->serve_port(std::stoi(fd_text));
  pb::ToDense ready;
  ready.set_ready(static_cast<uint32_t>(::getpid()));
  control.write(ready);
  for (;;) {
    auto body = control.read();
    if (!body) break;  // the parent closed the socket (or died): stop
    pb::ToWorker m;
    if (!m.ParseFromString(*body)) {
      warn("bad control message: stopping");
      break;
    }
    switch (m.kind_case()) {
      case pb::ToWorker::kAttend: worker->attend(std::move(*m.mutable_attend())); break;
      case pb::ToWorker::kCancel: worker->cancel(m.cancel()); break;
      case pb::ToWorker::kAddShard: worker->add(static_cast<int>(m.add_shard().index()), m.add_shard().address()); break;
      case pb::ToWorker::kRemoveShard: worker->remove(static_cast<int>(m.remove_shard())); break;
      case pb::ToWorker::kRestoreShard: worker->restore(static_cast<int>(m.restore_shard())); break;
      case pb::ToWorker::kSync: {  // every message before it applied: this thread reads them in order
        pb::ToDense synced;
        synced.set_synced(m.sync());
        control.write(synced);
        break;
      }
      default: break;
    }
  }
  std::fflush(stderr);
  ::_exit(0);  // in-flight streams end with the process; the shards see their calls cancelled
}
