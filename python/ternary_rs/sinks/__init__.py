"""Floor 3, sinks: the streaming GGUF/safetensors writers (:mod:`.writers`), a converted checkpoint's
staging, shards and manifest (:mod:`.checkpoint`) and the HF -> GGUF metadata (:mod:`.gguf_metadata`)."""
