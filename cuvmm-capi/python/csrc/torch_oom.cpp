// libcuvmm_torch.so: the allocation entry points that cuvmm.torch hands to PyTorch's
// CUDAPluggableAllocator under change_current_allocator.
//
// PyTorch takes whatever pointer the plugin returns, NULL included, and wraps it in a tensor; a
// NULL becomes a tensor at address 0 whose first use faults the CUDA context. These entry points
// call libcuvmm.so's and, when it refuses an allocation, throw a C++ exception instead. PyTorch
// calls the plugin from C++ (the same place its own caching allocator throws OutOfMemoryError), and
// its Python bindings turn the exception into a Python one: the process goes on.
//
// libcuvmm.so is Rust: nothing may unwind through its frames, and nothing does, since the
// exception is thrown here after cuvmm_malloc has returned.
//
// No PyTorch header is needed. PyTorch's bindings catch `torch::PyTorchError` (an abstract
// std::exception with a virtual python_type()) and raise python_type() with what() as the
// message; they use those two virtual functions only. C++ runtimes on this platform match a catch
// clause by the type's name, so an exception whose class derives from a class named
// torch::PyTorchError with the same virtual functions in the same order is caught there. The
// Python class it names (torch.OutOfMemoryError, or RuntimeError for other refusals) is handed
// over by cuvmm_torch_bind. An exception thrown before binding is a plain std::exception, which
// the bindings raise as RuntimeError.
//
// Out of memory is better thrown as PyTorch's own c10::OutOfMemoryError: PyTorch's C++ code
// catches that type to fall back (cuDNN's convolution tries the next algorithm, or halves its
// workspace), and a look-alike of another name goes past those catch clauses. Its layout changes
// between PyTorch versions, so it is not reproduced here: cuvmm_torch_bind_c10 hands over, from
// the PyTorch libraries loaded in the process, c10::Error's exported constructor
// Error(SourceLocation, std::string) and c10::OutOfMemoryError's vtable. The object is built by
// that constructor in memory of the C++ runtime's exception allocator, given the vtable (what
// OutOfMemoryError's inherited constructor does after its base's), and thrown with the type_info
// the vtable names. PyTorch's catch clauses, its Python bindings (torch.OutOfMemoryError with
// what_without_backtrace()) and its destructor all see its own object.
//
// That call crosses into PyTorch's C++ with a std::string and a SourceLocation by value, so both
// must be laid out as PyTorch's are, and the object must fit the room reserved for it. The layout
// of SourceLocation is checked when this file is compiled; a std::string of another ABI than
// PyTorch's (libstdc++'s C++11 one: a build with -D_GLIBCXX_USE_CXX11_ABI=0, or libc++) and a
// c10::Error too large for the room are found at binding, which then refuses with the reason
// (cuvmm_torch_c10_refusal): out of memory then throws the look-alike, never a corrupted object.

#include <cxxabi.h>

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <exception>
#include <string>
#include <sys/types.h>
#include <type_traits>
#include <typeinfo>

#define CUVMM_EXPORT __attribute__((visibility("default")))
#define CUVMM_STRINGIFY_(x) #x
#define CUVMM_STRINGIFY(x) CUVMM_STRINGIFY_(x)

namespace torch {
// Mirrors the vtable of PyTorch's torch::PyTorchError: std::exception's slots, then python_type()
// (which returns a PyObject*, a pointer in the same register). Hidden like everything here but the
// C entry points: the match is by name, so PyTorch's own symbols are never interposed.
struct PyTorchError : std::exception {
  virtual void *python_type() = 0;
};
}  // namespace torch

namespace cuvmm_torch {

using MallocFn = void *(*)(ssize_t, int, void *);
using FreeFn = void (*)(void *, ssize_t, int, void *);
using LastErrorFn = const char *(*)();
using LastErrorCodeFn = int (*)();

std::atomic<MallocFn> bound_malloc{nullptr};
std::atomic<FreeFn> bound_free{nullptr};
std::atomic<LastErrorFn> bound_last_error{nullptr};
// cuvmm_last_error_code, where the library has it (cuvmm_torch_bind_codes): out of memory is then
// told by its code, whatever a message says.
std::atomic<LastErrorCodeFn> bound_last_error_code{nullptr};
// CUVMM_ERROR_OUT_OF_MEMORY of cuvmm.h, whose numbers are never changed.
constexpr int kOutOfMemoryCode = 2;
// Python class objects; the Python side keeps them alive (they belong to modules never unloaded).
std::atomic<void *> oom_type{nullptr};
std::atomic<void *> error_type{nullptr};

constexpr size_t kText = 1024;

// What the bindings raise as the Python class `type`.
struct Raised final : torch::PyTorchError {
  Raised(void *type, const char *text) : type_(type) { std::snprintf(text_, kText, "%s", text); }
  const char *what() const noexcept override { return text_; }
  void *python_type() override { return type_; }

 private:
  void *type_;
  char text_[kText];
};

// A refusal with no Python class to name (before cuvmm_torch_bind): RuntimeError.
struct Refused final : std::exception {
  explicit Refused(const char *text) { std::snprintf(text_, kText, "%s", text); }
  const char *what() const noexcept override { return text_; }

 private:
  char text_[kText];
};

// c10::SourceLocation, as Error's constructor takes it (by value).
struct SourceLocation {
  const char *function;
  const char *file;
  uint32_t line;
};
// PyTorch's layout on the 64-bit platforms it supports: passed in memory, 24 bytes, the line last.
static_assert(sizeof(void *) == 8, "libcuvmm_torch.so is built for 64-bit platforms only, as PyTorch");
static_assert(std::is_trivially_copyable<SourceLocation>::value && std::is_standard_layout<SourceLocation>::value,
              "c10::SourceLocation is a plain struct");
static_assert(sizeof(SourceLocation) == 24 && alignof(SourceLocation) == 8 && offsetof(SourceLocation, function) == 0 &&
                  offsetof(SourceLocation, file) == 8 && offsetof(SourceLocation, line) == 16,
              "c10::SourceLocation's layout differs from PyTorch's");

// Why this build's std::string cannot be handed to PyTorch's constructor, or null when it can.
#if defined(__GLIBCXX__) && _GLIBCXX_USE_CXX11_ABI
constexpr const char *kStringProblem = nullptr;
static_assert(sizeof(std::string) == 32, "libstdc++'s C++11 std::string is 32 bytes");
#else
constexpr const char *kStringProblem =
    "libcuvmm_torch.so was built with another std::string than PyTorch's (libstdc++ with "
    "_GLIBCXX_USE_CXX11_ABI=1): rebuild it without -D_GLIBCXX_USE_CXX11_ABI=0 in CXXFLAGS";
#endif
using ErrorCtor = void (*)(void *self, SourceLocation where, std::string msg);
using Destructor = void (*)(void *);

// c10::OutOfMemoryError as the loaded PyTorch defines it (cuvmm_torch_bind_c10), or nulls.
std::atomic<ErrorCtor> c10_ctor{nullptr};
std::atomic<void *const *> c10_vtable{nullptr};  // the address point: the first virtual function
// Room for the object: c10::Error is about 150 bytes in every PyTorch version so far.
#define CUVMM_ERROR_ROOM 2048
constexpr size_t kErrorRoom = CUVMM_ERROR_ROOM;
// Why the last cuvmm_torch_bind_c10 refused, or null.
std::atomic<const char *> c10_refusal{nullptr};

const std::type_info *type_of(void *const *vtable) {
  return static_cast<const std::type_info *>(vtable[-1]);
}

// How far into its memory PyTorch's constructor writes an Error: built twice in a large buffer
// filled with two patterns, the last byte either run changed bounds the object from below. 0 when
// the constructor threw.
size_t error_extent(ErrorCtor ctor) {
  constexpr size_t kProbe = 64 << 10;
  auto *buf = static_cast<unsigned char *>(::operator new(kProbe, std::align_val_t{16}));
  size_t extent = 0;
  for (unsigned char fill : {0xa5, 0x5a}) {
    std::memset(buf, fill, kProbe);
    try {
      ctor(buf, SourceLocation{"cuvmm_torch_bind_c10", __FILE__, static_cast<uint32_t>(__LINE__)}, std::string("probe"));
    } catch (...) {
      extent = 0;
      break;
    }
    for (size_t i = kProbe; i > extent; i--) {
      if (buf[i - 1] != fill) {
        extent = i;
        break;
      }
    }
    // Destroyed through the vtable the constructor set: slot 0 is the complete-object destructor.
    reinterpret_cast<Destructor>((*reinterpret_cast<void *const **>(buf))[0])(buf);
  }
  ::operator delete(buf, std::align_val_t{16});
  return extent;
}

// Throws a c10::OutOfMemoryError built by PyTorch's own constructor; returns when none is bound or
// the constructor itself threw (the caller throws the look-alike then).
void throw_c10_oom(const char *text) {
  ErrorCtor ctor = c10_ctor.load(std::memory_order_acquire);
  void *const *vtable = c10_vtable.load(std::memory_order_acquire);
  if (ctor == nullptr || vtable == nullptr) {
    return;
  }
  void *obj = abi::__cxa_allocate_exception(kErrorRoom);
  std::memset(obj, 0, kErrorRoom);
  try {
    ctor(obj, SourceLocation{"cuvmm_torch_malloc", __FILE__, static_cast<uint32_t>(__LINE__)}, std::string(text));
  } catch (...) {
    abi::__cxa_free_exception(obj);
    return;
  }
  // The most derived class's vtable, as its constructor sets it once the base is built.
  *static_cast<void *const **>(obj) = vtable;
  // Slot 0 of an Itanium vtable is the complete-object destructor.
  abi::__cxa_throw(obj, const_cast<std::type_info *>(type_of(vtable)), reinterpret_cast<Destructor>(vtable[0]));
}

// A request larger than the whole device is out of memory too, as PyTorch's own allocator reports it.
// A library without error codes is read by its text.
bool is_out_of_memory(const char *err) {
  LastErrorCodeFn code = bound_last_error_code.load(std::memory_order_acquire);
  if (code != nullptr) {
    return code() == kOutOfMemoryCode;
  }
  return err != nullptr && (std::strstr(err, "OUT_OF_MEMORY") != nullptr || std::strstr(err, "out of memory") != nullptr ||
                            std::strstr(err, "more than the device's") != nullptr);
}

[[noreturn]] void refuse(ssize_t size, int device, const char *err) {
  const bool oom = is_out_of_memory(err);
  char text[kText];
  std::snprintf(text, sizeof text, "%s: cuvmm could not allocate %zd bytes on device %d (%s)",
                oom ? "CUDA out of memory" : "cuvmm allocation failed", size, device,
                err != nullptr ? err : "no error text");
  if (oom) {
    throw_c10_oom(text);
  }
  void *type = (oom ? oom_type : error_type).load(std::memory_order_acquire);
  if (type == nullptr) {
    throw Refused(text);
  }
  throw Raised(type, text);
}

}  // namespace cuvmm_torch

extern "C" {

// Binds the entry points to a loaded libcuvmm.so (its cuvmm_malloc, cuvmm_free and
// cuvmm_last_error) and names the Python classes to raise: `oom` when cuvmm reports out of memory,
// `error` for any other refusal (either may be NULL: RuntimeError). Returns 0, or -1 when a
// function is missing. Call it before handing the entry points to PyTorch.
CUVMM_EXPORT int cuvmm_torch_bind(void *malloc_fn, void *free_fn, void *last_error_fn, void *oom,
                                  void *error) {
  using namespace cuvmm_torch;
  if (malloc_fn == nullptr || free_fn == nullptr || last_error_fn == nullptr) {
    return -1;
  }
  oom_type.store(oom, std::memory_order_release);
  error_type.store(error, std::memory_order_release);
  bound_last_error.store(reinterpret_cast<LastErrorFn>(last_error_fn), std::memory_order_release);
  bound_free.store(reinterpret_cast<FreeFn>(free_fn), std::memory_order_release);
  bound_malloc.store(reinterpret_cast<MallocFn>(malloc_fn), std::memory_order_release);
  return 0;
}

// Tells out of memory by the library's error code (`last_error_code_fn`: its cuvmm_last_error_code)
// rather than by its text; NULL goes back to the text. Returns 0.
CUVMM_EXPORT int cuvmm_torch_bind_codes(void *last_error_code_fn) {
  cuvmm_torch::bound_last_error_code.store(reinterpret_cast<cuvmm_torch::LastErrorCodeFn>(last_error_code_fn),
                                           std::memory_order_release);
  return 0;
}

// Makes out of memory throw c10::OutOfMemoryError (see the top of this file): `error_ctor` is
// c10::Error::Error(c10::SourceLocation, std::string) and `oom_vtable` the symbol
// _ZTVN3c1016OutOfMemoryErrorE, both of the PyTorch loaded in the process. Returns 0, or -1 (and
// binds nothing, cuvmm_torch_c10_refusal saying why) when either is missing, the vtable is not
// that class's, this build's std::string is not PyTorch's, or the constructor builds an object
// larger than the room reserved for it. Both NULL: unbinds.
CUVMM_EXPORT int cuvmm_torch_bind_c10(void *error_ctor, void *oom_vtable) {
  using namespace cuvmm_torch;
  c10_ctor.store(nullptr, std::memory_order_release);
  c10_vtable.store(nullptr, std::memory_order_release);
  auto refuse_binding = [](const char *why) {
    c10_refusal.store(why, std::memory_order_release);
    return -1;
  };
  c10_refusal.store(nullptr, std::memory_order_release);
  if (error_ctor == nullptr && oom_vtable == nullptr) {
    return 0;
  }
  if (error_ctor == nullptr || oom_vtable == nullptr) {
    return refuse_binding("c10::Error's constructor or c10::OutOfMemoryError's vtable is missing");
  }
  // The symbol holds the offset to the top (0 for a primary vtable) and the type_info, then the
  // virtual functions, where an object's vtable pointer points.
  auto *table = static_cast<void *const *>(oom_vtable);
  if (table[0] != nullptr || table[1] == nullptr ||
      std::strcmp(type_of(table + 2)->name(), "N3c1016OutOfMemoryErrorE") != 0) {
    return refuse_binding("the vtable given is not c10::OutOfMemoryError's");
  }
  // Before any call of the constructor: with another std::string it corrupts the heap.
  if (kStringProblem != nullptr) {
    return refuse_binding(kStringProblem);
  }
  // Half the room at most, for members PyTorch fills only later (the text what() caches).
  const size_t extent = error_extent(reinterpret_cast<ErrorCtor>(error_ctor));
  if (extent == 0) {
    return refuse_binding("c10::Error's constructor threw when tried");
  }
  if (extent > kErrorRoom / 2) {
    return refuse_binding("c10::Error of the loaded PyTorch is larger than the room libcuvmm_torch.so reserves "
                          "for it (" CUVMM_STRINGIFY(CUVMM_ERROR_ROOM) " bytes, half of it for the object)");
  }
  c10_vtable.store(table + 2, std::memory_order_release);
  c10_ctor.store(reinterpret_cast<ErrorCtor>(error_ctor), std::memory_order_release);
  return 0;
}

// Why the last cuvmm_torch_bind_c10 refused (a static string), or NULL.
CUVMM_EXPORT const char *cuvmm_torch_c10_refusal() { return cuvmm_torch::c10_refusal.load(std::memory_order_acquire); }

// cuvmm_malloc, throwing where it would return NULL for a size above 0.
CUVMM_EXPORT void *cuvmm_torch_malloc(ssize_t size, int device, void *stream) {
  using namespace cuvmm_torch;
  MallocFn m = bound_malloc.load(std::memory_order_acquire);
  if (m == nullptr) {
    throw Refused("cuvmm allocation failed: libcuvmm_torch.so is not bound to libcuvmm.so (cuvmm_torch_bind)");
  }
  void *p = m(size, device, stream);
  if (p == nullptr && size != 0) {
    LastErrorFn le = bound_last_error.load(std::memory_order_acquire);
    refuse(size, device, le());
  }
  return p;
}

// cuvmm_free. Never throws: PyTorch frees from destructors.
CUVMM_EXPORT void cuvmm_torch_free(void *ptr, ssize_t size, int device, void *stream) noexcept {
  cuvmm_torch::FreeFn f = cuvmm_torch::bound_free.load(std::memory_order_acquire);
  if (f != nullptr) {
    f(ptr, size, device, stream);
  }
}

}  // extern "C"
