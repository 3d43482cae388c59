"""Apply packed allowed-token bitmasks to logits on Metal, CUDA or the MLX CPU backend.

Mask layout (the canonical description; everything else in grammar_mlx refers here)
-----------------------------------------------------------------------------------
A grammar's masks live in one *mask table*: an `mx.array` of shape (U, W) and dtype uint32, one
row per distinct allowed-token set (the compiler deduplicates them), W words per row. Token `t` is
allowed by row `r` iff bit `t % 32` (least significant bit = 0) of word `t // 32` is set:

    allowed(r, t) = (mask_table[r, t // 32] >> (t % 32)) & 1

So one row covers tokens 0 .. 32*W - 1. Masking logits of shape (B, V) takes B row ids (`rows`,
one per batch row) and yields ``out[b, t] = logits[b, t] if allowed(rows[b], t) else -inf``, bit
for bit (an allowed NaN stays that NaN; a forbidden +inf becomes -inf). Widths:

* V > 32*W (the model pads its vocabulary past the tokenizer's): the extra columns are disallowed.
* 32*W may exceed V by fewer than 32 bits (padding in the last word): those bits are ignored.
* W > ceil(V / 32) is a table built for another vocabulary: `KernelError`.

Paths
-----
* ``metal`` / ``cuda`` (`gpu`): `token_bitmask.metal` and `token_bitmask.cu` in this package
  (kernel bodies, shipped inside the wheel) run through `mx.fast.metal_kernel` /
  `mx.fast.cuda_kernel`. The kernel reads the mask words straight from the device-resident table
  through the row ids, so only B row ids cross to the device per call. Each kernel is built once.
* ``cpu-native`` (`cpu_native`): MLX's CPU backend, the default there where it builds. An MLX custom
  primitive (`token_bitmask_cpu.cpp`, bound with nanobind into mlx.core's nanobind domain) reads
  the packed words through the row ids (each batch row through its own table, for
  `apply_token_bitmasks`) and writes the output in one pass over the logits, copying their bits or
  writing -inf; nothing is unpacked or cached, so a row's first use costs what its later ones do.
  The row ids are host ints held by the primitive: a call makes no array but its output, and its
  eval runs on MLX's stream thread with no Python. Built with ``g++`` and the `nanobind` package on
  first use, once per cache directory (`cpu_native`); where it cannot be (no compiler, no nanobind, a
  failed build, ``GRAMMAR_MLX_NATIVE=0``) `cpu_native_error()` says why and the two paths below run.
* ``cpu-fused`` (`cpu`): MLX's CPU backend without cpu-native. Masks are unpacked into int8 rows (0 = disallowed, -1 =
  allowed) held in a bounded cache shared by all tables (`set_row_cache_limit`), and the logits are
  masked through their integer view, ``((x ^ NEG_INF) & mask) ^ NEG_INF`` (the int8 mask widens by
  sign: -1 keeps x, 0 gives the bits of -inf; exact for every value). One `mx.compile`d function
  runs that as a single fused loop, which MLX generates as C++ and builds with ``g++`` at run time
  (once per dtype and layout, cached on disk).
* ``cpu-bitwise``: without ``g++`` MLX's compile cannot fuse (an unfused `mx.where` is far slower
  than a copy), so the same three integer ops run as three vectorised passes.

On the two cached CPU paths (cpu-fused, cpu-bitwise) a single row (B = 1) takes the cheapest of
three forms (`cpu.sparse_form`): a row that allows at most V/64 tokens keeps their ids (the output
is a fill of -inf with those logits scattered in), one that forbids at most V/24 keeps the
forbidden ids (a copy of the logits with -inf scattered in), any other the dense mask above. The
forms copy bits and never compute with them, so they are exact too; JSON structure states allow a
handful of tokens and string states forbid a few thousand, and both forms cost less than the dense
mask there (bench/kernels.py, "form/...").

The cached paths' row cache (`cpu.RowCache`; cpu-native has none) keys rows by their content (a
sparse row by its ids, any other by its words), so a row is found again in every table that holds
it (a lazy grammar's table, copied into a larger one when full; equal rows of different grammars
share an entry). A table's writer may hand over a new row's ids with the row (`note_row_ids`: a
lazy grammar's new rows), so its first mask needs no pass over its words (cpu-native reads the
words in any case and ignores them). A table of at most a quarter of the bound also gets a
whole-table entry for batches, an unpacked copy filled a row at a time on the first batch
that uses the row (then a batch is one gather; a larger table's batch concatenates its rows'
entries). One recency policy serves every entry: second chance (a hit marks its entry; eviction
spares a marked entry once). Memory: the bound (`limits.ROW_CACHE_BYTES`; a dense row costs V + 4 W
bytes, the id forms far less) plus one staging row of V bytes (unpacking); noted ids are their
writer's (a lazy grammar's table holds them as its rows' keys) and go with their table.

A batch whose rows follow different tables (a server step mixing grammars, or constrained and free
rows) goes through `apply_token_bitmasks`, one (table, row id) pick per row (None: every token
allowed): rows all of one table take that table and its caches as above; otherwise the GPU paths
read the picked rows gathered into one table (`gathered_table`, this layout, a free row all ones),
cpu-native reads each row through its own table, and the cached CPU paths build the batch's int8
masks from each table's dense row entries, so a table made for one call is never unpacked or cached.

Modules: `dispatch` (the three entry points, input checks, the choice of path, `shared_array`, the
one row cache), `cpu_native` (building and loading cpu-native's primitive), `cpu` (the forms and the
cache), `gpu` (the kernels' sources and launch). The
per-token path is `row_masker`: a table bound once to a logits width and dtype, then a dict read and
the row's op(s) per call. `apply_token_bitmask` with one row takes the same bound masker, made on
its first call for that table, width, dtype and path and kept in the row cache's per-table state
(it holds no table, so it goes with the table), so its per-call checks are the masker's.

Tables may grow in place. A table may hold rows not written yet (a lazy grammar's table has room
for more rows than it has handed out, and writes each new row in place, through `shared_array`,
before handing out its id: compiler/lazy.py). The rule: a row id may be passed here only once its
row is written, and a row, once passed, never changes. Rows past those are never read, so a
table's per-table caches (its row index and whole-table entry, keyed by the table object, held
weakly and dropped when it dies) stay valid while it grows. A table copied into a longer one when
full hands the new object its row indexes and per-token maskers (`carry_row_cache`): the same
rule makes an id below the old table's rows name the same row in both.
"""

from .cpu import jit_available as cpu_jit_available
from .dispatch import (
    ALL_ALLOWED,
    MaskPick,
    apply_token_bitmask,
    apply_token_bitmasks,
    available_paths,
    before_host_write,
    carry_row_cache,
    clear_row_cache,
    cpu_native_error,
    default_path,
    gathered_table,
    note_row_ids,
    row_masker,
    set_row_cache_limit,
    shared_array,
)
from .gpu import INPUT_NAMES, KERNEL_NAME, OUTPUT_NAMES, SOURCE_FILES, kernel_source, launch_geometry

__all__ = [
    "ALL_ALLOWED",
    "INPUT_NAMES",
    "KERNEL_NAME",
    "OUTPUT_NAMES",
    "SOURCE_FILES",
    "MaskPick",
    "apply_token_bitmask",
    "apply_token_bitmasks",
    "available_paths",
    "before_host_write",
    "carry_row_cache",
    "clear_row_cache",
    "cpu_jit_available",
    "cpu_native_error",
    "default_path",
    "gathered_table",
    "kernel_source",
    "launch_geometry",
    "note_row_ids",
    "row_masker",
    "set_row_cache_limit",
    "shared_array",
]
