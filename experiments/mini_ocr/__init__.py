"""The mini OCR proof (docs/mini_ocr.md): run.sh and arms.sh drive it; evaluate, result and algorithms are its eval and
analysis, run as `python -m experiments.mini_ocr.NAME` from the repository root. Its data and VAE side is
experiments.mini_ocr, its pretraining experiments.mini_ocr (the trainer's two sides import those)."""
