"""The mini OCR proof (docs/mini_ocr.md): a tiny text-rendering Qwen-Image trained from scratch,
then FlowGRPO on OCR. run.sh and arms.sh drive it, each step a module run as `python -m experiments.mini_ocr.NAME`
from the repository root: words (word lists and prompts), render (the PIL renderer), prepare (data, the small VAE
(vae) and the encodings; torch), folder (the pipeline folder), pretrain (flow-matching pretraining of the Flax
transformer; JAX); evaluate, result and algorithms are its eval and analysis."""
