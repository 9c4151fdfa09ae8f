"""Diffusion fine-tuning (model.kind: diffusion): LoRA / DreamBooth for diffusers text-to-image pipelines.

The flow is the LLM one with images: `cache.prepare_images` turns image sources into VAE latents and
text-encoder outputs cached under `dataset_prepared_path/<fingerprint>/`; `train.run_training` runs
the Accelerate loop on them (noise objective in `objective`, validation images in `sampling`) and
saves `pytorch_lora_weights.safetensors` that `pipeline.load_lora_weights(output_dir)` loads.

Modules: model (pipeline parts, LoRA), sources (image records from folders and the Hub), images
(EXIF, buckets, resize and crop), cache (fingerprint, encoding, manifest), loader (bucketed batches),
objective (noise, targets, min-SNR; flow matching for SD3 and Flux), sampling (validation images, class images), train (the loop),
tiny (tiny random pipelines for tests, demos and benchmarks).
"""
