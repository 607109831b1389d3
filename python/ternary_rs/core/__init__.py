"""Floor 1, core: the type tables (:mod:`.formats`), the canonical tensor and its codecs (:mod:`.tensor`)
and the Hadamard rotation (:mod:`.hadamard`). Imports only the compiled ``ternary_rs._core``."""
