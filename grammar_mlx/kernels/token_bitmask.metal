// Body of grammar_mlx's allowed-token mask kernel for mx.fast.metal_kernel.
// grammar_mlx/kernels/gpu.py passes this file's text verbatim as `source=`; MLX
// generates the signature around it (inputs: logits, mask_table, rows;
// output: out; template type T = the logits dtype). The mask layout is
// documented once, in grammar_mlx/kernels/__init__.py.
//
// One thread per logit: x = token column, y = batch row. Metal dispatches the
// exact grid, the bounds check only guards against a caller changing that.
const uint col = thread_position_in_grid.x;
const uint b = thread_position_in_grid.y;
const uint batch = uint(logits_shape[0]);
const uint vocab = uint(logits_shape[1]);
if (col >= vocab || b >= batch) {
  return;
}
const uint num_rows = uint(mask_table_shape[0]);
const uint num_words = uint(mask_table_shape[1]);
const uint row = rows[b];
const uint word = col >> 5;
// Columns past the table's bits (a padded vocabulary) and a row id outside the
// table (rejected before launch; checked again so a bad id never reads past
// the table) come out disallowed.
bool allowed = false;
if (row < num_rows && word < num_words) {
  allowed = ((mask_table[size_t(row) * num_words + word] >> (col & 31u)) & 1u) != 0u;
}
const size_t i = size_t(b) * vocab + col;
const T logit = logits[i];
const T neg_inf = static_cast<T>(-metal::numeric_limits<float>::infinity());
out[i] = allowed ? logit : neg_inf;
