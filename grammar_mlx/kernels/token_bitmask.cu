// Body of grammar_mlx's allowed-token mask kernel for mx.fast.cuda_kernel.
// grammar_mlx/kernels/gpu.py passes this file's text verbatim as `source=`; MLX
// generates the signature around it (inputs: logits, mask_table, rows;
// output: out; `using T` = the logits dtype). The mask layout is documented
// once, in grammar_mlx/kernels/__init__.py.
//
// One thread per logit: x = token column, y = batch row. CUDA launches whole
// blocks, so the last block of every row runs past the vocabulary: bounds-check.
const uint32_t col = blockIdx.x * blockDim.x + threadIdx.x;
const uint32_t b = blockIdx.y * blockDim.y + threadIdx.y;
const uint32_t batch = static_cast<uint32_t>(logits_shape[0]);
const uint32_t vocab = static_cast<uint32_t>(logits_shape[1]);
if (col >= vocab || b >= batch) {
  return;
}
const uint32_t num_rows = static_cast<uint32_t>(mask_table_shape[0]);
const uint32_t num_words = static_cast<uint32_t>(mask_table_shape[1]);
const uint32_t row = rows[b];
const uint32_t word = col >> 5;
// Columns past the table's bits (a padded vocabulary) and a row id outside the
// table (rejected before launch; checked again so a bad id never reads past
// the table) come out disallowed.
bool allowed = false;
if (row < num_rows && word < num_words) {
  allowed = ((mask_table[static_cast<size_t>(row) * num_words + word] >> (col & 31u)) & 1u) != 0u;
}
const size_t i = static_cast<size_t>(b) * vocab + col;
const T logit = logits[i];
// -inf built from its bit pattern: needs no header beyond the CUDA builtins.
const T neg_inf = static_cast<T>(__int_as_float(static_cast<int>(0xff800000u)));
out[i] = allowed ? logit : neg_inf;
