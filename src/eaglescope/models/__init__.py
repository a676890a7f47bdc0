"""The models: the targets (models/targets: native Llama-family and DeepSeek-V3 code, any `transformers` model, the
head-only copy), the EAGLE-3 draft (models/draft.py, one forward over the architectures in models/drafts) and the
draft's reduced vocabulary (models/vocab.py: the d2t/t2d maps). Nothing here imports the data pipeline, the
decoders or the commands."""
