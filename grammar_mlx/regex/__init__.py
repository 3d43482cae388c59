"""Regular expressions as syntax: character sets, the character-level AST the schema front end
reasons with (`syntax`), and the ECMA-262 dialect of JSON Schema's `pattern` parsed into it
(`ecma`). The Rust regex-automata dialect that users and the schema front end hand to the compiler
is parsed by `automata.byte_nfa` (its parser builds the byte NFA directly). Imports only
`grammar_mlx.errors` and `grammar_mlx.limits`.
"""
