"""GGUF files in and out: naming one (`names`, torch-free: the recipe checks these fields), converting
one once into a cached Hugging Face folder that is then the base model everywhere (`convert`), and
writing a trained model as one for llama.cpp, Ollama and LM Studio (`export`).

The package sits in the bottom layer (docs/CONTRIBUTING.md): it imports nothing of finetune but the
error classes and the warning helper, so the recipe, the data fingerprint and the model code may all
use it. Loading what training wrote before an export is the model's job
(finetune.model.inference.export_gguf), which hands the loaded model to `export.write_gguf`.
"""
