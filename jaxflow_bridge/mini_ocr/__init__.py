"""Torch side of the mini OCR proof: the small VAE (vae.py), the pipeline folder and its encodings
(folder.py), the data/VAE/encode steps (prepare.py). Never imports JAX."""
