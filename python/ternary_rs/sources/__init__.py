"""Floor 2, sources: opening checkpoints (:mod:`.reader`), decoding one of their tensors (:mod:`.decode`)
and the Hugging Face side files a GGUF implies (:mod:`.hf_gguf`). Imports only from ``core``."""
