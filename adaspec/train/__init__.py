"""The EAGLE-3 head trainer behind `adaspec train-draft` (training-time test, as in the EAGLE-3
paper / SpecForge): its own top-floor package; nothing in adaspec below it imports it.

  config.py    TrainConfig and the aux-layer rule
  target.py    the frozen target: loading, aux features and logits per batch
  data.py      training sequences (files, jsonl prompts, random) and the draft vocabulary
  ttt.py       the unrolled training-time-test forward and loss (pure)
  trainer.py   the loop, checkpoints, resume, the written head
  evaluate.py  held-out accuracy and acceptance length, the chain-acceptance replay
  cli.py       `adaspec train-draft`
"""
from adaspec.train.config import TrainConfig
from adaspec.train.trainer import train_eagle3_head

__all__ = ["TrainConfig", "train_eagle3_head"]
