// tensorscope native ABI: every layout and number the C++ libraries share with each other or with
// Python, defined once. engine*.cpp, fmode*.cpp and hooks*.cpp include it; each library exports it
// to Python as a plain dict (abi(), built by abi_py.h), which tensorscope/native/_abi.py reads and
// tests/native/test_abi.py compares with the Python side's own definitions (the pure-Python
// fallback keeps those, since it has no compiled code to ask).
//
// Any change here changes every library's build key (native/_build.py hashes the headers), so the
// libraries are always rebuilt together. Pure C++: no Python or torch header.

#pragma once

#include <cstddef>
#include <cstdint>
#include <iterator>
#include <type_traits>

// The libraries' internal names are hidden: code in one shared object reaches another file's
// globals PC-relative, as it did when each library was one file with an anonymous namespace.
#define TS_HIDDEN __attribute__((visibility("hidden")))

namespace tsabi TS_HIDDEN {

// ---------------------------------------------------------------------------
// Field descriptions (what abi() exports): name, byte offset, byte size, numpy kind
// ---------------------------------------------------------------------------
struct Field {
  const char* name;
  size_t offset;
  size_t size;
  char kind;   // 'i' signed, 'u' unsigned, 'f' float, 'p' pointer (numpy kinds; 'p': a C pointer)
};

template <typename T>
constexpr char kind_of() {
  return std::is_pointer<T>::value ? 'p' : std::is_floating_point<T>::value ? 'f' : std::is_signed<T>::value ? 'i' : 'u';
}

#define TSABI_FIELD(S, m) ::tsabi::Field{#m, offsetof(S, m), sizeof(S::m), ::tsabi::kind_of<decltype(S::m)>()}

// The fields, in order, tile the struct: no gap, no member left out of the table.
template <size_t N>
constexpr bool tiles(const Field (&f)[N], size_t size) {
  size_t at = 0;
  for (size_t i = 0; i < N; ++i) {
    if (f[i].offset != at) return false;
    at += f[i].size;
  }
  return at == size;
}

// ---------------------------------------------------------------------------
// The ops row (engine): one per recorded ATen op, 56 bytes. Ids that stay below 2**31 are int32;
// the rare argument encodings (FLOP formulas) live in a sparse side column, not in every row.
// Python: recording/engines/native.py ROW_DTYPE (and recording/recorder.py OPS_FIELDS, its recorder-side columns).
// ---------------------------------------------------------------------------
struct OpsRow {
  int32_t op, ins, outs, alias, module, node;
  int32_t flags;   // RowFlag bits
  int32_t call;
  int64_t seq_nr, start, dur;
};

constexpr Field kOpsRowFields[] = {
    TSABI_FIELD(OpsRow, op),     TSABI_FIELD(OpsRow, ins),   TSABI_FIELD(OpsRow, outs),   TSABI_FIELD(OpsRow, alias),
    TSABI_FIELD(OpsRow, module), TSABI_FIELD(OpsRow, node),  TSABI_FIELD(OpsRow, flags),  TSABI_FIELD(OpsRow, call),
    TSABI_FIELD(OpsRow, seq_nr), TSABI_FIELD(OpsRow, start), TSABI_FIELD(OpsRow, dur),
};
static_assert(sizeof(OpsRow) == 56, "ops row: 56 bytes");
static_assert(offsetof(OpsRow, op) == 0 && offsetof(OpsRow, flags) == 24 && offsetof(OpsRow, call) == 28 &&
                  offsetof(OpsRow, seq_nr) == 32 && offsetof(OpsRow, start) == 40 && offsetof(OpsRow, dur) == 48,
              "ops row offsets");
static_assert(tiles(kOpsRowFields, sizeof(OpsRow)), "kOpsRowFields lists every OpsRow member in order");

// Row flags (OpsRow::flags). F_BACKWARD is the ops table's flag of the same name (recorder.py: its
// bits 1, 2, 4 are the schema flags the Python side adds); the others are the engine's own.
enum RowFlag : int32_t {
  F_BACKWARD = 8,       // recorded inside an autograd node
  F_THREW = 16,         // the op's kernel threw
  F_OTHER_THREAD = 32,  // recorded on a thread other than the tracing one
};
constexpr struct {
  const char* name;
  int32_t value;
} kRowFlags[] = {{"F_BACKWARD", F_BACKWARD}, {"F_THREW", F_THREW}, {"F_OTHER_THREAD", F_OTHER_THREAD}};

// ---------------------------------------------------------------------------
// Packed chunks (engine -> Python): a full block of rows, column by column, each column minus its
// minimum in the narrowest unsigned type that holds it (width 1/2/4), else the raw int64 values
// (width 8, base 0). Python: recording/engines/native.py PACKED_COLUMNS and _PACKED_DTYPES.
// ---------------------------------------------------------------------------
enum PackedColumn { PC_OP, PC_INS, PC_OUTS, PC_ALIAS, PC_MODULE, PC_CALL, PC_NODE, PC_SEQ_NR, PC_FLAGS, PC_START,
                    PC_DUR, PC_STORAGES, PC_N };
// "rflags": the engine's row flags (the Python side derives the ops table's flags from them)
constexpr const char* kPackedColumnNames[] = {"op",     "ins",   "outs",  "alias", "module", "call",
                                              "node",   "seq_nr", "rflags", "start", "dur",   "storages"};
static_assert(std::size(kPackedColumnNames) == PC_N, "a name per packed column");
constexpr size_t kBlockRows = 65536;   // rows per block by default; start(..., block_rows) sets it
// finished storage records the engine holds before it hands them over (with the packed chunks) at the
// next sealed block, spilling or not; start(..., handover_records) sets it
constexpr int64_t kHandoverRecords = 65536;
constexpr struct {
  int width;
  char kind;   // 'u': unsigned, minus the column's base; 'i': raw int64
} kPackedWidths[] = {{1, 'u'}, {2, 'u'}, {4, 'u'}, {8, 'i'}};

// ---------------------------------------------------------------------------
// Argument encodings (engine, the ops whose FLOP formulas need arguments): a flat int64 sequence
// of tag, then the tag's payload. Python: recording/engines/native.py _decode_args.
// ---------------------------------------------------------------------------
enum ArgTag : int64_t {
  TAG_TENSOR = 0,     // + meta id
  TAG_NONE = 1,       // None, or an undefined tensor
  TAG_BOOL = 2,       // + 0/1
  TAG_INT = 3,        // + value
  TAG_DOUBLE = 4,     // + the double's bits
  TAG_INT_LIST = 5,   // + n, n values
  TAG_OTHER = 6,      // anything else (decoded as None)
  TAG_BOOL_LIST = 8,  // + n, n 0/1 values
  TAG_OUTPUTS = 9,    // the outputs follow (TAG_TENSOR / TAG_NONE each, in schema order)
};
constexpr struct {
  const char* name;
  int64_t value;
} kArgTags[] = {{"TENSOR", TAG_TENSOR}, {"NONE", TAG_NONE},         {"BOOL", TAG_BOOL},
                {"INT", TAG_INT},       {"DOUBLE", TAG_DOUBLE},     {"INT_LIST", TAG_INT_LIST},
                {"OTHER", TAG_OTHER},   {"BOOL_LIST", TAG_BOOL_LIST}, {"OUTPUTS", TAG_OUTPUTS}};

// ---------------------------------------------------------------------------
// the storage records (engine: take_chunks' finished ones, take()'s rest): TC_N int64 per storage. Interned metas: MK_HEADER int64, then the
// sizes and (strided) the strides. Python: recording/engines/native.py NativeEngine.finish / _sync_dicts.
// ---------------------------------------------------------------------------
enum TensorColumn { TC_META, TC_NBYTES, TC_ALLOC_SEQ, TC_FREE_SEQ, TC_MODULE, TC_CALL, TC_PTR, TC_SID, TC_N };
constexpr const char* kTensorColumnNames[] = {"meta", "nbytes", "alloc_seq", "free_seq", "module", "call", "ptr", "sid"};
static_assert(std::size(kTensorColumnNames) == TC_N, "a name per storage column");
enum MetaKey { MK_NDIM, MK_DTYPE, MK_DEV_TYPE, MK_DEV_INDEX, MK_STRIDED, MK_HEADER };
constexpr const char* kMetaKeyNames[] = {"ndim", "dtype", "dev_type", "dev_index", "strided"};
static_assert(std::size(kMetaKeyNames) == MK_HEADER, "a name per meta header value");
constexpr int64_t kMaxNdim = 28;   // more dimensions are recorded as 0-d (the key stays under 64 values)
static_assert(MK_HEADER + 2 * kMaxNdim <= 64, "a meta key fits engine_storages.h's buffer");

// ---------------------------------------------------------------------------
// The calls row (function mode): one per recorded torch-level call, 56 bytes.
// Python: recording/function.py CALL_DTYPE; recorder.py CALL_FIELDS is the order field()/column() use.
// ---------------------------------------------------------------------------
struct CallRow {
  int32_t func, module, src, autocast, parent, error, n_ops, pad;
  int64_t first_seq, start, dur;
};
// CallRow's members by index (the function mode packs its blocks member by member)
enum CallMember { CM_FUNC, CM_MODULE, CM_SRC, CM_AUTOCAST, CM_PARENT, CM_ERROR, CM_N_OPS, CM_PAD, CM_FIRST_SEQ,
                  CM_START, CM_DUR, CM_N };
constexpr Field kCallRowFields[] = {
    TSABI_FIELD(CallRow, func),      TSABI_FIELD(CallRow, module), TSABI_FIELD(CallRow, src),
    TSABI_FIELD(CallRow, autocast),  TSABI_FIELD(CallRow, parent), TSABI_FIELD(CallRow, error),
    TSABI_FIELD(CallRow, n_ops),     TSABI_FIELD(CallRow, pad),    TSABI_FIELD(CallRow, first_seq),
    TSABI_FIELD(CallRow, start),     TSABI_FIELD(CallRow, dur),
};
static_assert(sizeof(CallRow) == 56, "calls row: 56 bytes");
static_assert(offsetof(CallRow, func) == 0 && offsetof(CallRow, pad) == 28 && offsetof(CallRow, first_seq) == 32 &&
                  offsetof(CallRow, start) == 40 && offsetof(CallRow, dur) == 48,
              "calls row offsets");
static_assert(tiles(kCallRowFields, sizeof(CallRow)), "kCallRowFields lists every CallRow member in order");
static_assert(std::size(kCallRowFields) == CM_N, "a CallMember per CallRow member");
// field(cid, k) / column(k): k indexes recorder.py's CALL_FIELDS, i.e. these members
constexpr int kCallFieldOrder[] = {CM_FUNC,  CM_MODULE, CM_SRC,   CM_FIRST_SEQ, CM_N_OPS,
                                   CM_AUTOCAST, CM_PARENT, CM_ERROR, CM_START,     CM_DUR};
constexpr int kCallFields = int(std::size(kCallFieldOrder));

// What the Python classifier (recording/function.py NativeFunctionMode._classify) returns per function:
// kind | (call function id << kKindBits).
enum CallKind { KIND_DIRECT = 0, KIND_RECORD = 1, KIND_PASS = 2, KIND_LAZY = 3, KIND_PRINTING = 4 };
constexpr int kKindBits = 3;
constexpr struct {
  const char* name;
  int value;
} kCallKinds[] = {{"DIRECT", KIND_DIRECT}, {"RECORD", KIND_RECORD}, {"PASS", KIND_PASS}, {"LAZY", KIND_LAZY},
                  {"PRINTING", KIND_PRINTING}};
static_assert(KIND_PRINTING < (1 << kKindBits), "the kinds fit their bits");

// ---------------------------------------------------------------------------
// Shared function-mode state: the engine exports it as a capsule (engine's fmode_state), so the
// function mode sets the call/module ids and reads seq per call without a Python round trip.
// ---------------------------------------------------------------------------
constexpr int kFmodeStateAbi = 1;   // FmodeState::abi; bump on any change to the struct
constexpr const char* kFmodeStateCapsule = "tensorscope_engine.fmode_state";
struct FmodeState {
  int abi;
  int64_t* cur_call;
  int64_t* cur_module;
  int64_t* n_rows;
  int (*warnings_pending)();
};
constexpr Field kFmodeStateFields[] = {
    TSABI_FIELD(FmodeState, abi),    TSABI_FIELD(FmodeState, cur_call),         TSABI_FIELD(FmodeState, cur_module),
    TSABI_FIELD(FmodeState, n_rows), TSABI_FIELD(FmodeState, warnings_pending),
};
static_assert(sizeof(void*) == 8, "64-bit platforms only");
static_assert(sizeof(FmodeState) == 40 && offsetof(FmodeState, cur_call) == 8 &&
                  offsetof(FmodeState, cur_module) == 16 && offsetof(FmodeState, n_rows) == 24 &&
                  offsetof(FmodeState, warnings_pending) == 32,
              "function-mode state layout");

// ---------------------------------------------------------------------------
// The hooks' error-site reader, handed to the engine as a capsule (hooks' site_reader, engine's
// set_site_reader): the source location of the newest c10::Error alive on this thread constructed
// at or after since_ns; 1 when found. The strings are c10 SourceLocation literals.
// ---------------------------------------------------------------------------
using ReadSite = int (*)(int64_t since_ns, const char** file, const char** function, uint32_t* line);
constexpr const char* kSiteReaderCapsule = "tensorscope.site_reader";

}  // namespace tsabi
