"""Finite automata. `byte_nfa`: a regex's UTF-8 byte NFA and the DFA determinized from it on demand
(`LazyDFA`), which the compiler walks token by token; `chars`: character-level DFAs the schema
front end intersects, subtracts and writes back as regexes (pattern x format x length, key
languages). Imports `regex`, `errors`, `limits`; the byte NFA's fallback for constructs it does not
reproduce builds outlines-core's DFA through `compiler.worker`.
"""
