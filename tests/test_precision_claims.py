"""The precision claims asserted where they are made: in bf16 runs the master weights and the
optimizer's moments stay float32, and each assertion fails on its planted opposite."""
from pathlib import Path

import pytest
import torch
from torch.optim.optimizer import register_optimizer_step_post_hook

import sharded_data_parallel as zp
from harness import agree, sub_comm, world

SMALL = ["--layers", "2", "--hidden", "16", "--heads", "2", "--seq-len", "16", "--batch-size", "8", "--steps", "3",
         "--no-check", "--precision", "bf16"]


def round_to_bf16(optimizer, *_):
    """The planted opposite of float32 masters: every parameter rounded to bf16 after each step."""
    with torch.no_grad():
        for group in optimizer.param_groups:
            for p in group["params"]:
                p.copy_(p.bfloat16().float())


@pytest.mark.mpi
@pytest.mark.parametrize("planted", [False, True])
@pytest.mark.parametrize("stage", ["1", "3"])
def test_zero_in_bf16_keeps_float32_master_weights_and_moments(planted, stage, tmp_path_factory):
    """The masters a ZeRO rank saves after bf16 steps are float32 and most of them lie between two
    bf16 numbers: masters stepped in bf16 (planted) would all be bf16 numbers."""
    folder = world().bcast(str(tmp_path_factory.mktemp("bf16")), root=0)
    handle = register_optimizer_step_post_hook(round_to_bf16) if planted else None
    try:
        with sub_comm(2) as comm:
            ok = True
            if comm is not None:
                status = zp.main(SMALL + ["--zero-stage", stage, "--save", folder], comm)
                comm.Barrier()
                newest = max(Path(folder).glob("step-*"), key=lambda p: int(p.name[5:]))
                blocks = {k: t for f in newest.glob("*.pt") for k, t in torch.load(f, weights_only=True).items()}
                masters = [t for key, t in blocks.items() if key.startswith("layers.")]
                moments = [t for key, t in blocks.items() if key.startswith("exp_avg/")]
                between = sum(int((t != t.bfloat16().float()).sum()) for t in masters) / sum(t.numel() for t in masters)
                ok = (status == 0 and all(t.dtype == torch.float32 for t in masters + moments)
                      and (between < 0.01 if planted else between > 0.9))
            assert agree(ok), between
    finally:
        if handle is not None:
            handle.remove()
