"""The README's recipe is every GPT file's default: AdamW at lr 1e-3, the global norm clipped to 1, a
warm-up of a tenth of --steps into a cosine; data_parallel.py's default is SGD at a constant rate, unclipped."""
import importlib

import pytest

GPT_FILES = ["tensor_parallel", "pipeline_parallel", "model_parallel", "sharded_data_parallel",
             "context_parallel", "expert_parallel", "hybrid_parallel"]


@pytest.mark.parametrize("name", GPT_FILES)
def test_every_gpt_file_trains_the_recipe_by_default(name):
    module = importlib.import_module(name)
    args = module.parse_args([], 1)
    assert (args.optimizer, args.lr, args.clip_grad, args.lr_schedule) == ("adamw", 1e-3, 1.0, "cosine")
    assert args.warmup_steps == args.steps // 10 > 0
    assert module.parse_args(["--steps", "25"], 1).warmup_steps == 2
    assert module.parse_args(["--steps", "25", "--warmup-steps", "0"], 1).warmup_steps == 0  # 0 is not the default


def test_data_parallel_keeps_sgd_at_a_constant_rate_unclipped():
    args = importlib.import_module("data_parallel").parse_args([], 1)
    assert (args.clip_grad, args.lr_schedule, args.warmup_steps) == (0.0, "constant", 0)
