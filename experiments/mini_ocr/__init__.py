"""The mini OCR proof (docs/mini_ocr.md): a tiny text-rendering Qwen-Image trained from scratch,
then FlowGRPO on OCR. run.sh drives it, arms.sh and sweep.sh (over jobs.sh) run it per algorithm arm or FlowGRPO
variant over a host's GPUs, each step a module run as `python -m experiments.mini_ocr.NAME`
from the repository root: words (word lists and prompts), render (the PIL renderer), prepare (data, the small VAE
(vae) and the encodings; torch), folder (the pipeline folder), pretrain (flow-matching pretraining of the Flax
transformer; JAX); evaluate, result, algorithms and sweep are its eval and analysis."""
