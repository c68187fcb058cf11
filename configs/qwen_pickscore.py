"""Qwen-Image LoRA FlowGRPO on PickScore: flow_grpo's `config/grpo.py: pickscore_qwenimage`.

    python -m jaxflow.train --config configs/qwen_pickscore.py --config.model.path=/models/Qwen-Image \
      --config.reward.options="{'pickscore': {'path': '/models/PickScore_v1', \
        'processor_path': '/models/CLIP-ViT-H-14-laion2B-s32B-b79K', 'device': 'cuda'}}" \
      --config.data.train=/data/pickscore/train.txt --config.data.test=/data/pickscore/test.txt

Every sampling and training value of pickscore_qwenimage is the OCR recipe's (configs/qwen_ocr.py, whose sources
name it): 512^2, 10 steps, CFG 4, noise 1.2 'sde' in a window of 2 within [0, 5), 32 prompts x 16 images, 2 updates
a step, LoRA, no EMA, beta 0, global std. What differs: the reward, `{"pickscore": 1.0}` (flow_grpo's PickScoreScorer:
the PickScore_v1 CLIP model with the CLIP-ViT-H-14-laion2B processor, exp(logit_scale) x cosine / 26, in float32;
jaxflow_bridge/rewards/models/clip.py), and the prompts, flow_grpo's `dataset/pickscore/{train,test}.txt` (one prompt per line;
not shipped here: pass their paths). Both checkpoint folders are local; a missing file stops the run at start with
one line naming it. PickScore scores in the trainer's process on its GPU (outside JAX's fixed pool); where Ray has a
GPU to spare, `'actor': {'num_gpus': 1}` in its options runs it in a Ray actor of its own instead.
"""
from jaxflow.config.recipes import base


def get_config():
    c = base()
    c.run_dir = "runs/qwen_pickscore"
    c.reward.fns = {"pickscore": 1.0}
    c.reward.options = {"pickscore": {"path": "", "processor_path": "", "device": "cuda", "dtype": "float32",
                                      "batch_size": 32}}  # float32: flow_grpo's PickScoreScorer scores in it
    c.reward.workers = 1  # one model on the GPU scores the whole batch
    c.data.train = c.data.test = ""
    return c
