"""The mini OCR proof: a tiny text-rendering Qwen-Image trained from scratch, then FlowGRPO on OCR.

words.py: deterministic word lists and prompts; render.py: the PIL renderer (Pillow's built-in scalable font);
pretrain.py: flow-matching pretraining of the Flax transformer on VAE latents. The torch side (VAE training,
latent/text encoding, the pipeline folder) is `jaxflow_bridge/mini_ocr/`; the whole run is
`experiments/mini_ocr/run.sh`.
"""
