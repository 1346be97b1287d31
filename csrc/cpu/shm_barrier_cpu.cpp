// The barrier of the shared-memory collectives (fgpsdp_runtime/shm_barrier.py,
// [Note: the shared-memory barrier]): every rank of a node publishes an arrival
// count in the region and waits until all have published the same one.
//
// Area layout (64-byte lines, zeroed with the region):
//   line 0      : wake word (uint32): bumped after every arrival; waiters sleep
//                 on it with futex(FUTEX_WAIT), so an arrival wakes them at once
//   line 1 + r  : rank r's arrival count (int64), written only by rank r
// Liveness: each rank holds a POSIX record lock on byte r of the region's file,
// which the kernel drops when the process ends however it ends; a waiter that
// finds a peer's byte unlocked knows it is gone (no PIDs: any PID namespace).
#include <cstdint>

#include <torch/extension.h>

#if defined(__linux__)
#include <fcntl.h>
#include <linux/futex.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#include <chrono>
#include <climits>
#endif

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define FGPSDP_PAUSE() _mm_pause()
#elif defined(__aarch64__)
#define FGPSDP_PAUSE() asm volatile("yield")
#else
#define FGPSDP_PAUSE() ((void)0)
#endif

namespace fgpsdp {
namespace cpu {

#if defined(__linux__)
namespace {
constexpr int64_t kLine = 64;
// Waiting this long spinning first catches peers that arrive together (the
// copies before a barrier take microseconds) without a sleep and wake.
constexpr auto kSpin = std::chrono::microseconds(5);
// A sleeping waiter wakes this often to look at the failure flag, the exit
// byte, its peers' locks and the deadline.
constexpr int64_t kPollNs = 2'000'000;

inline uint32_t* wake_word(int64_t area) { return reinterpret_cast<uint32_t*>(area); }
inline int64_t* count_of(int64_t area, int64_t r) {
  return reinterpret_cast<int64_t*>(area + (1 + r) * kLine);
}

bool all_arrived(int64_t area, int64_t size, int64_t target, int64_t& first_missing) {
  while (first_missing < size &&
         __atomic_load_n(count_of(area, first_missing), __ATOMIC_ACQUIRE) >= target)
    ++first_missing;
  return first_missing == size;
}

// Whether no process holds a lock on byte `r` of the file (F_GETLK ignores this
// process's own locks). An error says nothing: the peer is taken as alive.
bool lock_free(int fd, int64_t r) {
  struct flock fl {};
  fl.l_type = F_WRLCK;
  fl.l_whence = SEEK_SET;
  fl.l_start = r;
  fl.l_len = 1;
  if (fcntl(fd, F_GETLK, &fl) != 0) return false;
  return fl.l_type == F_UNLCK;
}
}  // namespace

bool shm_barrier_supported() { return true; }

int64_t shm_barrier_wait(int64_t area, int64_t rank, int64_t size, int64_t target, int64_t lock_fd,
                         int64_t flag_addr, int64_t exit_addr, double timeout_s) {
  using clock = std::chrono::steady_clock;
  // Release: every store this rank made to the region before (the caller's
  // copies, OpenMP threads joined) is seen by a peer that acquires this count.
  __atomic_store_n(count_of(area, rank), target, __ATOMIC_RELEASE);
  __atomic_fetch_add(wake_word(area), 1u, __ATOMIC_SEQ_CST);
  syscall(SYS_futex, wake_word(area), FUTEX_WAKE, INT_MAX, nullptr, nullptr, 0);

  const auto* flag = reinterpret_cast<const uint8_t*>(flag_addr);
  const auto* exiting = reinterpret_cast<const uint8_t*>(exit_addr);
  int64_t first_missing = 0;
  const auto start = clock::now();
  while (clock::now() - start < kSpin) {
    for (int i = 0; i < 64; ++i) FGPSDP_PAUSE();
    if (all_arrived(area, size, target, first_missing)) return 0;
  }
  const auto deadline =
      start + std::chrono::duration_cast<clock::duration>(std::chrono::duration<double>(timeout_s));
  for (;;) {
    // Read the wake word before the counts: an arrival after this read changes
    // it, and the futex wait below then returns at once instead of sleeping.
    const uint32_t seen = __atomic_load_n(wake_word(area), __ATOMIC_SEQ_CST);
    if (all_arrived(area, size, target, first_missing)) return 0;
    if (__atomic_load_n(flag, __ATOMIC_ACQUIRE)) return 1;
    if (__atomic_load_n(exiting, __ATOMIC_RELAXED)) return 2;
    for (int64_t p = first_missing; p < size; ++p) {
      if (p == rank || __atomic_load_n(count_of(area, p), __ATOMIC_ACQUIRE) >= target) continue;
      if (lock_free(static_cast<int>(lock_fd), p)) {
        // It may have arrived and then ended (a normal exit after the last
        // barrier): its count was published before its lock went.
        if (all_arrived(area, size, target, first_missing)) return 0;
        return 100 + p;
      }
    }
    if (clock::now() >= deadline) return 3;
    struct timespec ts {0, kPollNs};
    syscall(SYS_futex, wake_word(area), FUTEX_WAIT, seen, &ts, nullptr, 0);
  }
}

#else  // no futex, no shared-memory barrier: the caller uses gloo's

bool shm_barrier_supported() { return false; }

int64_t shm_barrier_wait(int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, double) {
  TORCH_CHECK(false, "shm_barrier_wait: only built on Linux");
}

#endif

}  // namespace cpu
}  // namespace fgpsdp
