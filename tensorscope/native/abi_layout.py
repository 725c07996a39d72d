"""The native ABI as Python reads it: generated from tensorscope/native/abi.h by tools/gen_abi.py.

Do not edit: change abi.h and run ``make abi`` (tests/native/test_abi_layout.py fails while this
file is not what abi.h gives). Row fields are abi()'s (name, byte offset, byte size, numpy kind).
"""

#: abi.h OpsRow: the engine's ops row
OPS_ROW_FIELDS = (
    ('op', 0, 4, 'i'),
    ('ins', 4, 4, 'i'),
    ('outs', 8, 4, 'i'),
    ('alias', 12, 4, 'i'),
    ('module', 16, 4, 'i'),
    ('node', 20, 4, 'i'),
    ('flags', 24, 4, 'i'),
    ('call', 28, 4, 'i'),
    ('seq_nr', 32, 8, 'i'),
    ('start', 40, 8, 'i'),
    ('dur', 48, 8, 'i'),
)
OPS_ROW_SIZE = 56
#: abi.h CallRow: the function mode's calls row
CALL_ROW_FIELDS = (
    ('func', 0, 4, 'i'),
    ('module', 4, 4, 'i'),
    ('src', 8, 4, 'i'),
    ('autocast', 12, 4, 'i'),
    ('parent', 16, 4, 'i'),
    ('error', 20, 4, 'i'),
    ('n_ops', 24, 4, 'i'),
    ('pad', 28, 4, 'i'),
    ('first_seq', 32, 8, 'i'),
    ('start', 40, 8, 'i'),
    ('dur', 48, 8, 'i'),
)
CALL_ROW_SIZE = 56
#: abi.h kCallFieldOrder: the CallRow members field(cid, k) / column(k) index, in k order
CALL_FIELDS = ('func', 'module', 'src', 'first_seq', 'n_ops', 'autocast', 'parent', 'error', 'start', 'dur')
#: abi.h kRowFlags (OpsRow::flags bits)
ROW_FLAGS = {'F_BACKWARD': 8, 'F_THREW': 16, 'F_OTHER_THREAD': 32}
F_BACKWARD = 8
F_THREW = 16
F_OTHER_THREAD = 32
#: abi.h kPackedColumnNames: a packed chunk's columns, in PackedColumn order
PACKED_COLUMNS = ('op', 'ins', 'outs', 'alias', 'module', 'call', 'node', 'seq_nr', 'rflags', 'start', 'dur', 'storages')
#: abi.h kPackedWidths: a packed column's byte width -> numpy kind ('u': minus the base, 'i': raw)
PACKED_WIDTHS = {1: 'u', 2: 'u', 4: 'u', 8: 'i'}
BLOCK_ROWS = 65536
#: abi.h kArgTags: argument-encoding tags
ARG_TAGS = {'TENSOR': 0, 'NONE': 1, 'BOOL': 2, 'INT': 3, 'DOUBLE': 4, 'INT_LIST': 5, 'OTHER': 6, 'BOOL_LIST': 8, 'OUTPUTS': 9}
TAG_TENSOR = 0
TAG_NONE = 1
TAG_BOOL = 2
TAG_INT = 3
TAG_DOUBLE = 4
TAG_INT_LIST = 5
TAG_OTHER = 6
TAG_BOOL_LIST = 8
TAG_OUTPUTS = 9
#: abi.h kTensorColumnNames: take()'s storage columns, in TensorColumn order
TENSOR_COLUMNS = ('meta', 'nbytes', 'alloc_seq', 'free_seq', 'module', 'call', 'ptr', 'sid')
#: abi.h kMetaKeyNames: an interned meta's header values (then the sizes, then the strides)
META_KEY = ('ndim', 'dtype', 'dev_type', 'dev_index', 'strided')
MK_NDIM = 0
MK_DTYPE = 1
MK_DEV_TYPE = 2
MK_DEV_INDEX = 3
MK_STRIDED = 4
MK_HEADER = 5
MAX_NDIM = 28
#: abi.h kCallKinds: what the function mode's classifier returns (kind | id << KIND_BITS)
CALL_KINDS = {'DIRECT': 0, 'RECORD': 1, 'PASS': 2, 'LAZY': 3, 'PRINTING': 4}
KIND_BITS = 3
FMODE_STATE_ABI = 1
