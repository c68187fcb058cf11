"""The reward models in torch (CLIP-based: PickScore, CLIP score, aesthetic; HPS v2.1; ImageReward) and the
pixel preprocessing each reference uses."""
