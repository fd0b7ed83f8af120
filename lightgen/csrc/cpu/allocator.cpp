// A caching CPU allocator for generation: freed blocks are kept by size class and handed out again, so a
// decode step's ~100-200 activation tensors come from memory the first step (or an earlier request)
// already got from the system. Installed as torch's CPU allocator only while a generate call runs; the
// blocks it hands out stay valid after that and return to the cache (or to the system) when freed.
//
// Plain C functions (lightgen_cpu_cache_*), called through ctypes: this is not a tensor op.
#include <c10/core/Allocator.h>
#include <c10/core/CPUAllocator.h>
#include <c10/core/alignment.h>

#include <pthread.h>

#include <cstdint>
#include <cstdlib>
#include <mutex>
#include <unordered_map>
#include <vector>

namespace lightgen {
namespace {

// Classes 1/8 of a power of two apart (at least 64 bytes): at most 12.5% waste, and a tensor that grows
// with the cache length (attention scores) changes class only every few steps.
size_t size_class(size_t bytes) {
  if (bytes <= 512) return (bytes + 63) & ~size_t{63};
  size_t step = size_t{1} << (63 - __builtin_clzll(bytes - 1) - 3);
  return (bytes + step - 1) & ~(step - 1);
}

struct Stats {
  int64_t system_allocations = 0;  // blocks taken from the system
  int64_t reused = 0;              // blocks handed out again from the cache
  int64_t cached_bytes = 0;        // free blocks held
  int64_t live_bytes = 0;          // blocks handed out and not yet freed
};

class CachingCPUAllocator final : public c10::Allocator {
 public:
  c10::DataPtr allocate(size_t bytes) override {
    if (bytes == 0) return {nullptr, nullptr, &release, c10::Device(c10::DeviceType::CPU)};
    const size_t block = size_class(bytes);
    void* data = nullptr;
    {
      std::lock_guard<std::mutex> guard(mutex_);
      auto& free = free_[block];
      if (!free.empty()) {
        data = free.back();
        free.pop_back();
        stats_.cached_bytes -= static_cast<int64_t>(block);
        ++stats_.reused;
        hand_out(data, block);
      }
    }
    if (data == nullptr) {
      TORCH_CHECK(posix_memalign(&data, c10::gAlignment, block) == 0, "lightgen: out of CPU memory allocating ",
                  block, " bytes");
      std::lock_guard<std::mutex> guard(mutex_);
      ++stats_.system_allocations;
      hand_out(data, block);
    }
    report(data, static_cast<int64_t>(block));
    // data doubles as the context, so the pointer counts as "simple" (copy-on-write clones accept it).
    return {data, data, &release, c10::Device(c10::DeviceType::CPU)};
  }

  c10::DeleterFnPtr raw_deleter() const override { return &release; }

  void copy_data(void* dest, const void* src, std::size_t count) const override {
    default_copy_data(dest, src, count);
  }

  static void release(void* data) {
    if (data != nullptr) instance().give_back(data);
  }

  static CachingCPUAllocator& instance() {
    static auto* allocator = [] {
      auto* created = new CachingCPUAllocator();  // never destroyed: tensors may outlive static teardown
      // A fork while another thread holds the lock would leave it locked forever in the child: hold it
      // across fork() instead, as glibc's malloc does.
      pthread_atfork([] { instance().mutex_.lock(); }, [] { instance().mutex_.unlock(); },
                     [] { instance().mutex_.unlock(); });
      return created;
    }();
    return *allocator;
  }

  void enter() {
    std::lock_guard<std::mutex> guard(mutex_);
    if (depth_++ == 0) {
      previous_ = c10::GetCPUAllocator();
      if (previous_ != this) c10::SetCPUAllocator(this);
    }
  }

  void exit() {
    std::lock_guard<std::mutex> guard(mutex_);
    TORCH_CHECK(depth_ > 0, "lightgen: CPU cache exited more often than entered");
    if (--depth_ == 0 && previous_ != this) c10::SetCPUAllocator(previous_);
  }

  void set_limit(int64_t bytes) {
    std::lock_guard<std::mutex> guard(mutex_);
    limit_ = bytes;
  }

  // Frees every cached block; returns how many bytes went back to the system.
  int64_t empty() {
    std::vector<void*> blocks;
    int64_t freed = 0;
    {
      std::lock_guard<std::mutex> guard(mutex_);
      for (auto& entry : free_) blocks.insert(blocks.end(), entry.second.begin(), entry.second.end());
      free_.clear();
      freed = stats_.cached_bytes;
      stats_.cached_bytes = 0;
    }
    for (void* block : blocks) std::free(block);
    return freed;
  }

  Stats stats() {
    std::lock_guard<std::mutex> guard(mutex_);
    return stats_;
  }

 private:
  void hand_out(void* data, size_t block) {  // with mutex_ held
    block_of_[data] = block;
    stats_.live_bytes += static_cast<int64_t>(block);
  }

  void give_back(void* data) {
    size_t block = 0;
    bool keep = false;
    {
      std::lock_guard<std::mutex> guard(mutex_);
      auto found = block_of_.find(data);
      TORCH_INTERNAL_ASSERT(found != block_of_.end(), "lightgen: freeing a block its CPU cache never handed out");
      block = found->second;
      block_of_.erase(found);
      stats_.live_bytes -= static_cast<int64_t>(block);
      keep = stats_.cached_bytes + static_cast<int64_t>(block) <= limit_;
      if (keep) {
        free_[block].push_back(data);
        stats_.cached_bytes += static_cast<int64_t>(block);
      }
    }
    if (!keep) std::free(data);
    report(data, -static_cast<int64_t>(block));
  }

  void report(void* data, int64_t bytes) {
    if (!c10::memoryProfilingEnabled()) return;
    const Stats now = stats();
    c10::reportMemoryUsageToProfiler(data, bytes, static_cast<size_t>(now.live_bytes),
                                     static_cast<size_t>(now.live_bytes + now.cached_bytes),
                                     c10::Device(c10::DeviceType::CPU));
  }

  std::mutex mutex_;
  std::unordered_map<size_t, std::vector<void*>> free_;
  std::unordered_map<void*, size_t> block_of_;
  Stats stats_;
  int64_t limit_ = int64_t{256} << 20;
  int depth_ = 0;
  c10::Allocator* previous_ = nullptr;
};

}  // namespace
}  // namespace lightgen

#define LG_EXPORT extern "C" __attribute__((visibility("default")))

LG_EXPORT void lightgen_cpu_cache_enter() { lightgen::CachingCPUAllocator::instance().enter(); }

LG_EXPORT void lightgen_cpu_cache_exit() { lightgen::CachingCPUAllocator::instance().exit(); }

LG_EXPORT void lightgen_cpu_cache_set_limit(int64_t bytes) { lightgen::CachingCPUAllocator::instance().set_limit(bytes); }

LG_EXPORT int64_t lightgen_cpu_cache_empty() { return lightgen::CachingCPUAllocator::instance().empty(); }

// Writes system_allocations, reused, cached_bytes, live_bytes.
LG_EXPORT void lightgen_cpu_cache_stats(int64_t* out) {
  const auto stats = lightgen::CachingCPUAllocator::instance().stats();
  out[0] = stats.system_allocations;
  out[1] = stats.reused;
  out[2] = stats.cached_bytes;
  out[3] = stats.live_bytes;
}
